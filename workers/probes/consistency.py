"""Replica consistency check: with the same seed, every data-parallel replica must start identical.

Every rank builds the model from ``cfg.seed``, runs forward + backward on the *same* micro-batch (not its
own share) and compares, across ranks, a fingerprint of its initial parameters, its loss and per-tensor
gradient checksums. Identical code on identical input must give bit-identical numbers on one kind of
device; a rank that differs has a different seed, library version, device kernel or corrupted memory, and
would silently drag the all-reduced gradient (the field's first check when loss curves disagree between
runs). Needs only a process group: runs under Ray Train, or on local processes (``meridian bench
consistency``). Never imports Ray, ``meridian.api`` or ``meridian.service``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from meridian.workers.contracts.config import TrainConfig
from meridian.workers.data.shards import make_dataset
from meridian.workers.model.build import build_model


@dataclass(frozen=True)
class RankFingerprint:
    rank: int
    loss: float
    param_checksum: float
    grad_norm: float
    max_param_diff: float
    """Largest absolute difference of a parameter checksum from the reference replica's."""
    max_grad_diff: float
    """Largest absolute difference of a per-tensor gradient checksum (sum and sum of squares)."""
    loss_diff: float
    consistent: bool


@dataclass(frozen=True)
class ConsistencyReport:
    world_size: int
    reference_rank: int
    """The rank whose numbers most ranks share exactly (rank 0 on a tie)."""
    tolerance: float
    ranks: tuple[RankFingerprint, ...]

    @property
    def inconsistent_ranks(self) -> list[int]:
        return [r.rank for r in self.ranks if not r.consistent]

    def to_dict(self) -> dict:
        return {"world_size": self.world_size, "reference_rank": self.reference_rank, "tolerance": self.tolerance,
                "inconsistent_ranks": self.inconsistent_ranks, "ranks": [asdict(r) for r in self.ranks]}


def _checksums(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Per parameter tensor: (sum, sum of squares) of the values and of the gradients, in float64."""
    params, grads = [], []
    for p in model.parameters():
        v = p.detach().double()
        params += [v.sum(), (v * v).sum()]
        g = p.grad.detach().double() if p.grad is not None else torch.zeros_like(v)
        grads += [g.sum(), (g * g).sum()]
    return torch.stack(params), torch.stack(grads)


def check_consistency(
    cfg: TrainConfig, *, device: torch.device | None = None, tolerance: float = 0.0,
    perturb: Callable[[torch.nn.Module], None] | None = None,
) -> ConsistencyReport:
    """Run on every rank of the default process group; every rank gets the same report.

    ``perturb`` changes this rank's freshly built model before the check (tests use it to plant a bad
    replica). ``tolerance`` is absolute; 0 demands bit-identical numbers, right for one device type.
    """
    device = device or torch.device("cpu")
    world = dist.get_world_size()
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model).to(device)
    if perturb is not None:
        perturb(model)
    x, y = make_dataset(cfg.data, cfg.model.seq_len, cfg.seed).batch(0, cfg.micro_batch)
    loss = model(x.to(device), y.to(device)).mean()  # each sample's loss, as the loop asks for it
    loss.backward()
    params, grads = _checksums(model)
    grad_norm = torch.sqrt(grads[1::2].sum())
    mine = torch.cat([loss.detach().double().reshape(1), grad_norm.reshape(1), params, grads]).cpu()
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)

    votes = Counter(tuple(t.tolist()) for t in gathered)
    top = max(votes.values())
    reference = next(r for r, t in enumerate(gathered) if votes[tuple(t.tolist())] == top)
    ref = gathered[reference]
    n = params.numel()
    ranks = []
    for r, t in enumerate(gathered):
        d = (t - ref).abs()
        loss_diff, pdiff, gdiff = d[0].item(), d[2:2 + n].max().item(), d[2 + n:].max().item()
        ranks.append(RankFingerprint(
            rank=r, loss=t[0].item(), param_checksum=t[2:2 + n:2].sum().item(), grad_norm=t[1].item(),
            max_param_diff=pdiff, max_grad_diff=gdiff, loss_diff=loss_diff,
            consistent=max(loss_diff, pdiff, gdiff) <= tolerance,
        ))
    return ConsistencyReport(world_size=world, reference_rank=reference, tolerance=tolerance, ranks=tuple(ranks))
