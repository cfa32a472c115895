"""A toy model, its data, and a single-process AdamW reference, shared by the sync-engine tests.

Module-level functions only: the multi-process tests pickle them into spawned gloo ranks.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from meridian.workers.contracts.config import OptimConfig
from meridian.workers.data.text import micro_batch_sizes, rank_slice
from meridian.workers.optim.adamw import build_adamw, make_adamw, param_groups
from meridian.workers.sync.engine import GradientSync

GLOBAL_BATCH = 10


class Toy(nn.Module):
    """Odd-sized parameters in both AdamW groups: matrices (decay), biases / norm / ``pos_emb`` (no decay)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(6, 7)
        self.norm = nn.LayerNorm(7)
        self.pos_emb = nn.Parameter(torch.randn(1, 7) * 0.1)  # 2-D but named like a position embedding
        self.l2 = nn.Linear(7, 3)
        self.gain = nn.Parameter(torch.ones(1))  # one element: smaller than any unit count

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.norm(F.gelu(self.l1(x)) + self.pos_emb)) * self.gain


def toy_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> Toy:
    torch.manual_seed(seed)
    return Toy().to(dtype)


def toy_batch(
    step: int, start: int, stop: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global samples ``[start, stop)`` of step ``step``: the same numbers whoever computes them."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)
    return x[start:stop].to(dtype), y[start:stop].to(dtype)


def share_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """This rank's share of the global-batch mean of per-sample squared errors."""
    return ((model(x).float() - y.float()) ** 2).sum(dim=1).sum() / GLOBAL_BATCH


def micro_batches(step: int, rank: int, world: int, micro: int, dtype: torch.dtype = torch.float32):
    """This rank's micro-batches of step ``step``: as many on every rank (:func:`micro_batch_sizes`)."""
    share = rank_slice(GLOBAL_BATCH, rank, world)
    out, at = [], share.start
    for n in micro_batch_sizes(len(share), GLOBAL_BATCH, micro, world):
        out.append(toy_batch(step, at, at + n, dtype))
        at += n
    return out


def lr_of(step: int) -> float:
    return 0.05 * (1 + step) / (2 + step)


def train_steps(
    engine: GradientSync,
    rank: int,
    world: int,
    steps: int,
    micro: int,
    first_step: int = 0,
    dtype=torch.float32,
    job_ends: bool = False,
):
    """Run ``steps`` engine steps on the toy data; returns the StepStats. ``job_ends``: the final one is the job's
    last."""
    stats = []
    for step in range(first_step, first_step + steps):
        batches = micro_batches(step, rank, world, micro, dtype)
        for i, (x, y) in enumerate(batches):
            last = i == len(batches) - 1
            with engine.micro_batch(last_micro_batch=last):
                engine.backward(share_loss(engine.model, x, y), last_micro_batch=last)
        stats.append(engine.step(lr_of(step), last=job_ends and step == first_step + steps - 1))
    return stats


def reference_params(
    steps: int, cfg: OptimConfig, micro: int = 3, seed: int = 0, *, delayed: bool = False
) -> dict[str, torch.Tensor]:
    """Plain single-process AdamW (same groups, clipping) on the whole global batch, accumulated in micro-batches.

    ``delayed``: step t applies the gradients computed at step t-1 (step 0 applies none), with step t's lr."""
    model = toy_model(seed)
    opt = build_adamw(model, cfg)
    previous: list[torch.Tensor] | None = None
    for step in range(steps):
        for a in range(0, GLOBAL_BATCH, micro):
            x, y = toy_batch(step, a, min(a + micro, GLOBAL_BATCH))
            share_loss(model, x, y).backward()
        if delayed:
            fresh = [p.grad.clone() for p in model.parameters()]
            if previous is not None:
                for p, g in zip(model.parameters(), previous, strict=True):
                    p.grad.copy_(g)
            previous, apply = fresh, previous is not None
            if not apply:
                opt.zero_grad()
                continue
        clip = cfg.grad_clip
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
        for group in opt.param_groups:
            group["lr"] = lr_of(step)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def reference_lookahead_params(
    steps: int, cfg: OptimConfig, dcs: tuple[str, ...], micro: int = 3, seed: int = 0, *, exact_first: int = 0,
    exact_from: int | None = None,
) -> dict[str, torch.Tensor]:
    """Single-process ``local_lookahead`` for ranks in datacenters ``dcs``: the first ``exact_first`` steps are
    plain exact steps, the rest one step late at a local look-ahead (:func:`reference_schedule_params`).
    ``exact_from``: from this step on, exact steps again (the gradient still pending is committed first)."""
    modes = "".join("E" if s < exact_first or (exact_from is not None and s >= exact_from) else "L"
                    for s in range(steps))
    return reference_schedule_params(steps, cfg, dcs, modes, micro=micro, seed=seed)


def reference_schedule_params(
    steps: int, cfg: OptimConfig, dcs: tuple[str, ...], modes: str, *, sync_before=(), drop_before=(),
    micro: int = 3, seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Single-process replay of any sequence of exact and one-step-late steps for ranks in datacenters ``dcs``.

    ``modes[s]``: ``E``, step s is exact; ``L``, one step late at a local look-ahead: each DC computes step s's
    gradients at its own look-ahead parameters (its own gradients of step s-1, scaled by world / DC size, clipped
    by the last committed update's coefficient, applied by a throwaway copy of the optimizer), and the committed
    parameters take the exact global gradient of step s-1 (with its lr) before the look-ahead of step s. An exact
    step first commits what is in flight; after the last step what is in flight is committed too (the final
    ``synchronize``). Before a step in ``sync_before`` the gradient in flight is committed and the look-ahead
    dropped (``synchronize()``, a validation pass); before a step in ``drop_before`` it is dropped uncommitted (a
    restore from a snapshot taken while it was in flight)."""
    world = len(dcs)
    model = toy_model(seed)
    opt = build_adamw(model, cfg)
    params = dict(model.named_parameters())

    def load(values: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for n, v in values.items():
                params[n].copy_(v)

    coef: list[torch.Tensor] = []  # the last committed update's clipping coefficient

    def update(values: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], lr: float, *,
               look: bool = False) -> dict[str, torch.Tensor]:
        load(values)
        for n, g in grads.items():
            params[n].grad = g * coef[-1] if look and coef and cfg.grad_clip > 0 else g.clone()
        if not (look and coef):
            clip = cfg.grad_clip
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
            if not look:
                coef.append(torch.clamp(clip / (norm + 1e-6), max=1.0))
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        return params_of(model)

    committed = params_of(model)
    ahead = {dc: committed for dc in dcs}
    pending: tuple[dict[str, torch.Tensor], float] | None = None
    for step in range(steps):
        exact = modes[step] == "E"
        if step in drop_before:
            pending, ahead = None, {dc: committed for dc in dcs}
        if (exact or step in sync_before) and pending is not None:  # land what is in flight
            committed, pending = update(committed, *pending), None
            ahead = {dc: committed for dc in dcs}
        local = {}
        for dc in dict.fromkeys(dcs):
            load(ahead[dc])
            model.zero_grad(set_to_none=True)
            for rank in (r for r, d in enumerate(dcs) if d == dc):
                for x, y in micro_batches(step, rank, world, micro):
                    share_loss(model, x, y).backward()
            local[dc] = {n: p.grad.clone() for n, p in params.items()}
        total = {n: sum(g[n] for g in local.values()) for n in params}
        if exact:
            committed = update(committed, total, lr_of(step))
            ahead = {dc: committed for dc in dcs}
            continue
        if pending is not None:
            committed = update(committed, *pending)
        saved = copy.deepcopy(opt.state_dict())
        for dc, grads in local.items():
            scale = world / dcs.count(dc)
            ahead[dc] = update(committed, {n: g * scale for n, g in grads.items()}, lr_of(step), look=True)
            opt.load_state_dict(copy.deepcopy(saved))
        pending = (total, lr_of(step))
    return update(committed, *pending) if pending is not None else committed


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters, whole (a sharded one is gathered: every rank of its mesh must call this)."""
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max over parameters of max|a - b| / max|b|."""
    return max(
        float((a[n].float() - b[n].float()).abs().max() / b[n].float().abs().max().clamp_min(1e-12))
        for n in b
    )


def reference_bf16_master(
    steps: int, cfg: OptimConfig, micro: int = 3, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Single-process mixed precision by hand, as FSDP2's policy runs it: fp32 parameters (the masters, from the fp32
    build), a bf16 copy of them for forward and backward, AdamW on the masters with the bf16 gradients."""
    masters = [(n, p.detach().clone()) for n, p in toy_model(seed).named_parameters()]
    model = toy_model(seed, torch.bfloat16)
    named = list(model.named_parameters())
    with torch.no_grad():
        for (_, p), (_, m) in zip(named, masters, strict=True):
            p.copy_(m)
    opt = make_adamw(param_groups(masters, model, cfg), cfg)
    for step in range(steps):
        for a in range(0, GLOBAL_BATCH, micro):
            x, y = toy_batch(step, a, min(a + micro, GLOBAL_BATCH), torch.bfloat16)
            share_loss(model, x, y).backward()
        for (_, p), (_, m) in zip(named, masters, strict=True):
            m.grad = p.grad.float()
        clip = cfg.grad_clip
        torch.nn.utils.clip_grad_norm_([m for _, m in masters], clip if clip > 0 else float("inf"))
        for group in opt.param_groups:
            group["lr"] = lr_of(step)
        opt.step()
        for (_, p), (_, m) in zip(named, masters, strict=True):
            p.data.copy_(m)
            p.grad = None
    return {n: m.clone() for n, m in masters}
