"""HAR on FSDP2 (:mod:`meridian.workers.sync.fsdp_har`) against one process training the same model.

Real gloo ranks; every layout must give the single-process losses and weights: one datacenter, two even ones,
two uneven ones (3 + 1, as after a node loss), with micro-batches, with the inter-DC step compressed."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from meridian.workers.contracts.config import Compression, OptimConfig, SyncConfig
from meridian.workers.distributed.layout import DCGroups, DCLayout
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.optim.adamw import build_adamw, set_lr
from meridian.workers.parallel.fsdp import apply_fsdp, dc_mesh
from meridian.workers.sync.fsdp_har import FSDPHierarchicalSync

BATCH = 12
STEPS = 6
OPTIM = OptimConfig(lr=1e-2, warmup_steps=0, grad_clip=0.5)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(7)
        self.up = nn.Linear(7, 9)
        self.down = nn.Linear(9, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Blocks(nn.Module):
    """Odd row counts (7, 9, 2) so the last ranks of a datacenter hold fewer rows, or none."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.out = nn.Linear(7, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 5, generator=g), torch.randn(BATCH, 2, generator=g)


def one_process() -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Blocks()
    opt = build_adamw(model, OPTIM)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = ((model(x) - y) ** 2).sum() / BATCH
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.grad_clip)
        set_lr(opt, OPTIM.lr)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _steps(engine: FSDPHierarchicalSync, rank: int, world: int, micro: int) -> tuple[list[float], list[int]]:
    """``STEPS`` steps of this rank's share of each batch in micro-batches of ``micro``: the global losses and the
    inter-DC bytes each step sent."""
    losses, sent = [], []
    lo, hi = rank * BATCH // world, (rank + 1) * BATCH // world
    for step in range(STEPS):
        x, y = batch(step)
        total = torch.zeros(())
        for a in range(lo, hi, micro):
            b = min(a + micro, hi)
            loss = ((engine.model(x[a:b]) - y[a:b]) ** 2).sum() / BATCH
            engine.backward(loss, last_micro_batch=b == hi)
            total += loss.detach()
        dist.all_reduce(total)
        losses.append(total.item())
        sent.append(engine.step(OPTIM.lr).inter_dc_bytes)
    return losses, sent


def _train(rank, world, dcs, sync, micro):
    groups = DCGroups(DCLayout(dcs), rank, segment_groups=False)
    torch.manual_seed(0)
    engine = FSDPHierarchicalSync(Blocks(), groups, sync, OPTIM)
    losses, sent = _steps(engine, rank, world, micro)
    weights = {n: p.full_tensor().detach().clone() for n, p in engine.model.named_parameters()}
    shard = engine.local_shard(STEPS)
    groups.destroy()
    return losses, weights, sent, shard.nbytes


@pytest.fixture(scope="module")
def reference():
    return one_process()


@pytest.mark.parametrize("dcs, micro", [
    (("a", "a", "a", "a"), 3),
    (("a", "a", "b", "b"), 3),
    (("a", "a", "a", "b"), 1),
])
def test_layouts_train_like_one_process(dcs, micro, reference):
    ref_losses, ref_weights = reference
    out = run_processes(_train, len(dcs), dcs, SyncConfig(), micro, timeout_s=240)
    losses, weights, sent, _ = out[0]
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for name, w in ref_weights.items():
        torch.testing.assert_close(weights[name], w, rtol=1e-5, atol=1e-6)
    params = sum(w.numel() for w in ref_weights.values())
    if len(set(dcs)) > 1:  # each datacenter puts its whole gradient on the link once a step, no more
        for dc in set(dcs):
            assert sum(o[2][0] for o, d in zip(out, dcs, strict=True) if d == dc) == 4 * params
    else:
        assert all(o[2] == [0] * STEPS for o in out)


def _train_counting_gathers(rank, world, dcs, reshard_after_forward, per_block=True):
    """``_train`` with two micro-batches a step, counting FSDP2's all-gathers (what keeping units gathered saves)."""
    gathers = 0
    all_gather = dist.all_gather_single

    def counted(*args, **kwargs):
        nonlocal gathers
        gathers += 1
        return all_gather(*args, **kwargs)

    dist.all_gather_single = counted
    try:
        groups = DCGroups(DCLayout(dcs), rank, segment_groups=False)
        torch.manual_seed(0)
        mesh = dc_mesh(groups.intra_dc, torch.device("cpu"))
        engine = FSDPHierarchicalSync(
            Blocks(), groups, SyncConfig(), OPTIM, reshard_after_forward=reshard_after_forward,
            shard=lambda model, reduce_scatter: apply_fsdp(model, mesh, reshard_after_forward=reshard_after_forward,
                                                           reduce_scatter=reduce_scatter, per_block=per_block))
        lo, hi = rank * BATCH // world, (rank + 1) * BATCH // world
        losses, _ = _steps(engine, rank, world, micro=-(-(hi - lo) // 2))  # two micro-batches a step
        weights = {n: p.full_tensor().detach().clone() for n, p in engine.model.named_parameters()}
        units = len(engine.units)
        groups.destroy()
        return losses, weights, gathers, units
    finally:
        dist.all_gather_single = all_gather


def test_units_kept_gathered_across_micro_batches_train_the_same_and_gather_once_a_step(reference):
    ref_losses, ref_weights = reference
    dcs = ("a", "a", "b", "b")
    kept = run_processes(_train_counting_gathers, 4, dcs, False, timeout_s=240)
    resharded = run_processes(_train_counting_gathers, 4, dcs, True, timeout_s=240)
    for losses, weights, _, _ in (kept[0], resharded[0]):
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for name, w in ref_weights.items():
            torch.testing.assert_close(weights[name], w, rtol=1e-5, atol=1e-6)
    units = 4  # three blocks and the root
    # kept: each unit once a step (plus full_tensor's gathers at the end); resharded: each block twice per
    # micro-batch (forward, backward) and the root once per micro-batch, two micro-batches a step
    final = kept[0][2] - units * STEPS
    assert 0 <= final < units
    assert resharded[0][2] - final == STEPS * 2 * (3 * 2 + 1)


def test_the_whole_model_as_one_unit_trains_the_same_and_gathers_once_a_step(reference):
    ref_losses, ref_weights = reference
    out = run_processes(_train_counting_gathers, 4, ("a", "a", "b", "b"), False, False, timeout_s=240)
    losses, weights, gathers, units = out[0]
    assert units == 1
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for name, w in ref_weights.items():
        torch.testing.assert_close(weights[name], w, rtol=1e-5, atol=1e-6)
    assert gathers == STEPS  # once a step (full_tensor gathers through DTensor, not FSDP2)


def test_without_overlap_the_same_updates(reference):
    out = run_processes(_train, 3, ("a", "a", "b"), SyncConfig(overlap=False), 2, timeout_s=240)
    assert out[0][0] == pytest.approx(reference[0], rel=1e-5)


def test_state_is_sharded_inside_a_datacenter_and_whole_in_each():
    """Each rank holds its rows' values and moments: a datacenter's shards add up to one copy of the state."""
    params = sum(p.numel() for p in Blocks().parameters())
    out = run_processes(_train, 4, ("a", "a", "a", "b"), SyncConfig(), 3, timeout_s=240)
    per_copy = params * 4 * 3  # fp32 values, exp_avg, exp_avg_sq
    assert sum(o[3] for o in out[:3]) == per_copy
    assert out[3][3] == per_copy


def test_bf16_inter_dc_step_stays_close_with_error_feedback(reference):
    out = run_processes(_train, 2, ("a", "b"), SyncConfig(compression=Compression.BF16), 6, timeout_s=240)
    losses, _, sent, _ = out[0]
    assert losses == pytest.approx(reference[0], rel=1e-3)
    params = sum(w.numel() for w in reference[1].values())
    assert sent[0] == 2 * params  # bf16 on the wire


def _units_of(rank, world, model_cfg):
    from meridian.workers.model.build import build_model

    groups = DCGroups(DCLayout(("a",) * world), rank, segment_groups=False)
    engine = FSDPHierarchicalSync(build_model(model_cfg), groups, SyncConfig(), OPTIM)
    sizes = [len(u.params) for u in engine.units]
    groups.destroy()
    return sizes


@pytest.mark.parametrize("family", ["builtin", "hf"])
def test_every_transformer_block_is_its_own_fsdp_unit(family, tmp_path):
    """One unit per block (its parameters gathered and reduced on their own), the rest (embeddings, norm, head) in
    the root's: a Hugging Face model's blocks come from the model interface, not from a name."""
    if family == "hf":
        pytest.importorskip("transformers")
        from test_hf_models import save_random

        from meridian.workers.contracts.hf_config import hf_model_config

        save_random(tmp_path, "llama3")
        cfg = hf_model_config(str(tmp_path), weights=True, seq_len=32)
    else:
        from meridian.workers.contracts.model_config import model_preset

        cfg = model_preset("llama-tiny")
    sizes = run_processes(_units_of, 2, cfg, timeout_s=240)[0]
    assert len(sizes) == cfg.n_layers + 1
    assert len(set(sizes[:-1])) == 1  # the blocks alike
