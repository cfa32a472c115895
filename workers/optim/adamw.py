"""AdamW as every engine builds it, and its optimizer state in one layout-free form for checkpoints.

:func:`build_adamw` makes the two parameter groups every engine uses (weight decay on matrices; none on
biases, norms and position embeddings, see :func:`decay_mask`).

The *full state* is keyed by parameter name, not by optimizer index, holds whole (unsharded) fp32
tensors, and names its format, so a checkpoint written by one engine and layout loads into another::

    {"format": "meridian.adamw.full/1", "step": 12,
     "params": {"blocks.0.attn.qkv.weight": {"exp_avg": T, "exp_avg_sq": T}, ...},
     "master": {"blocks.0.attn.qkv.weight": T, ...}}      # only when parameters are not fp32

Never communicates: the sharded optimizer gathers its shards before calling anything here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from meridian.workers.contracts.config import OptimConfig

FULL_STATE_FORMAT = "meridian.adamw.full/1"
MOMENTS = ("exp_avg", "exp_avg_sq")


def decay_mask(model: nn.Module) -> dict[str, bool]:
    """Which parameters get weight decay: matrices yes; biases, norms and embeddings' positions no."""
    return {name: p.dim() >= 2 and "pos_emb" not in name for name, p in model.named_parameters()}


def param_groups(named: list[tuple[str, Any]], model: nn.Module, cfg: OptimConfig) -> list[dict[str, Any]]:
    """``named`` (name, tensor) split into the decay / no-decay groups, empty groups dropped."""
    mask = decay_mask(model)
    groups = [
        {"params": [t for n, t in named if mask[n]], "weight_decay": cfg.weight_decay},
        {"params": [t for n, t in named if not mask[n]], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def adamw_impl(device: torch.device) -> dict[str, bool]:
    """Which AdamW implementation runs on ``device``. On CPU, ``foreach=False``: the single-tensor path does
    the same elementwise ops on a whole parameter and on any slice of it, so a sharded optimizer reproduces
    the replicated one bit for bit (a CPU test). On CUDA, ``fused=True``: one kernel launch for all the
    pieces of a shard instead of one per op per piece; the fused kernel is elementwise too, so sharded and
    replicated AdamW (both fused on a GPU) still agree element for element — a GPU check."""
    return {"fused": True} if device.type == "cuda" else {"foreach": False}


def make_adamw(groups: list[dict[str, Any]], cfg: OptimConfig) -> torch.optim.AdamW:
    device = next((p.device for g in groups for p in g["params"]), torch.device("cpu"))
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **adamw_impl(device))


def build_adamw(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return make_adamw(param_groups(named, model, cfg), cfg)


def step_counter(optimizer: torch.optim.Optimizer, steps: int, param: torch.Tensor) -> torch.Tensor:
    """AdamW's step count for ``param``'s state, kept where torch keeps it: on the parameter's device for the
    fused and capturable kernels, which read it there (a CPU counter fails the fused CUDA step: "state_steps is
    on cpu, different from other tensors on cuda:0", seen restoring a snapshot on an H200), else on the CPU."""
    on_device = optimizer.defaults.get("fused") or optimizer.defaults.get("capturable")
    return torch.tensor(float(steps), dtype=torch.float32, device=param.device if on_device else "cpu")


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def state_nbytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of every tensor in the optimizer's state (moments and step counters)."""
    if optimizer is None:
        return 0
    return sum(
        v.numel() * v.element_size()
        for st in optimizer.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor)
    )


def check_full_state(state: dict[str, Any], names: list[str]) -> None:
    if state.get("format") != FULL_STATE_FORMAT:
        raise ValueError(
            f"optimizer state has format {state.get('format')!r}, expected {FULL_STATE_FORMAT!r}"
        )
    if state["step"] and sorted(state["params"]) != sorted(names):
        missing, extra = set(names) - set(state["params"]), set(state["params"]) - set(names)
        raise ValueError(
            f"optimizer state does not match the model: missing {sorted(missing)}, extra {sorted(extra)}"
        )


def full_state_of(optimizer: torch.optim.AdamW, named: list[tuple[str, nn.Parameter]]) -> dict[str, Any]:
    """The full state of a replicated AdamW over the named parameters."""
    params: dict[str, dict[str, torch.Tensor]] = {}
    step = 0
    for name, p in named:
        st = optimizer.state.get(p)
        if st:
            step = int(st["step"])
            params[name] = {m: st[m].detach().float().cpu().clone() for m in MOMENTS}
    return {"format": FULL_STATE_FORMAT, "step": step, "params": params}


def load_full_state(
    optimizer: torch.optim.AdamW, named: list[tuple[str, nn.Parameter]], state: dict[str, Any]
) -> None:
    """Put a full state into a replicated AdamW (``master`` copies, if any, are not needed: params hold it)."""
    check_full_state(state, [n for n, _ in named])
    optimizer.state.clear()
    if not state["step"]:
        return
    for name, p in named:
        saved = state["params"][name]
        optimizer.state[p] = {
            "step": step_counter(optimizer, state["step"], p),
            **{m: saved[m].to(device=p.device, dtype=p.dtype).reshape(p.shape).clone() for m in MOMENTS},
        }
