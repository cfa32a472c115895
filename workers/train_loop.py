"""The training loop every rank runs, with no knowledge of Ray.

Build (model, data, groups, sync engine) → run ``cfg.steps`` optimizer steps → close. The process group
must already exist; the Ray entry point (:mod:`meridian.workers.entry`) and the multi-process test
harness both create it and then call :func:`train`. Progress leaves through a :class:`ProgressSink`.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from meridian.workers.config import Precision, TrainConfig
from meridian.workers.data import TextDataset
from meridian.workers.layout import DCGroups, DCLayout
from meridian.workers.model import GPT, per_sample_loss
from meridian.workers.sync import StepStats, build_sync
from meridian.workers.wan import WanEmulator, agree_key, cleanup


class ProgressSink(Protocol):
    """Where rank 0 sends per-step records (the service's job runner, or a list in tests)."""

    def step(self, record: dict[str, Any]) -> None: ...


@dataclass
class ListSink:
    records: list[dict[str, Any]] = field(default_factory=list)

    def step(self, record: dict[str, Any]) -> None:
        self.records.append(record)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at the last step."""
    o = cfg.optim
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    span = max(1, cfg.steps - o.warmup_steps)
    progress = min(1.0, (step - o.warmup_steps) / span)
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def resolve_precision(precision: Precision, device: torch.device) -> Precision:
    """``auto`` → bf16 on a GPU that supports it, fp32 elsewhere (bf16 autocast on CPU is slower)."""
    if precision is not Precision.AUTO:
        return precision
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return Precision.BF16
    return Precision.FP32


def autocast_context(precision: Precision, device: torch.device):
    if resolve_precision(precision, device) is Precision.BF16:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext()


@dataclass(frozen=True)
class TrainResult:
    first_loss: float
    final_loss: float
    eval_loss: float
    steps: int
    tokens_per_s: float
    """Mean training throughput over the steps after the first (which includes warm-up costs)."""
    inter_dc_bytes_per_step: float
    """Mean tensor bytes per step put into collectives crossing a DC boundary, summed over ranks."""
    optimizer_state_bytes: int = 0
    """Optimizer state held on this rank after the last step (1/N of replicated AdamW when sharded)."""


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, data: TextDataset, cfg: TrainConfig, device: torch.device, batches: int = 4
) -> float:
    model.eval()
    losses = []
    for b in range(batches):
        x, y = data.batch(b * cfg.micro_batch, cfg.micro_batch)
        with autocast_context(cfg.precision, device):
            losses.append(per_sample_loss(model(x.to(device)), y.to(device)).mean().item())
    model.train()
    return sum(losses) / len(losses)


def train(cfg: TrainConfig, *, sink: ProgressSink, device: torch.device | None = None) -> TrainResult:
    """Run the job on this rank. Every rank of the default process group must call it."""
    device = device or torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = DCLayout(cfg.datacenters or ("local",) * world)
    groups = DCGroups(layout, rank)

    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model).to(device)
    emulator = None
    if cfg.wan is not None and layout.num_dcs > 1:  # every inter-DC collective waits for the emulated link
        emulator = WanEmulator(cfg.wan, layout, rank, key=agree_key(f"job-{cfg.job_id}"))
    engine = build_sync(model, groups, cfg.sync, cfg.optim, emulator=emulator)
    data = TextDataset(cfg.data, cfg.model.seq_len, cfg.seed)
    held_out = TextDataset(cfg.data, cfg.model.seq_len, cfg.seed, split="eval")

    first_loss = final_loss = float("nan")
    timed_tokens, timed_s, inter_dc_total = 0, 0.0, 0
    pending: tuple[torch.Tensor, dist.Work, float, StepStats, int] | None = None

    def publish(
        stats_tensor: torch.Tensor, work: dist.Work, step_s: float, step_stats: StepStats, step: int
    ) -> float:
        # The global loss is summed with an async all-reduce and read one step later, so reporting it
        # never puts a latency round on the critical path.
        work.wait()
        loss, inter_dc = stats_tensor[0].item(), int(stats_tensor[1].item())
        if rank == 0:
            sink.step(
                {
                    "step": step + 1,
                    "total_steps": cfg.steps,
                    "loss": loss,
                    "lr": lr_at(step, cfg),
                    "step_s": step_s,
                    "tokens_per_s": cfg.tokens_per_step / step_s,
                    "grad_norm": step_stats.grad_norm,
                    "inter_dc_bytes": inter_dc,
                    "sync_wait_s": step_stats.sync_wait_s,
                    "comm_s": step_stats.comm_s,
                    "exposed_s": step_stats.exposed_s,
                    "overlap_fraction": step_stats.overlap_fraction,
                    "time": time.time(),
                }
            )
        return loss

    for step in range(cfg.steps):
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        batches = data.step_batches(step, cfg.global_batch, cfg.micro_batch, rank, world)
        for i, (x, y) in enumerate(batches):
            last = i == len(batches) - 1
            with engine.micro_batch(last_micro_batch=last):
                with autocast_context(cfg.precision, device):
                    losses = per_sample_loss(engine.model(x.to(device)), y.to(device))
                share = losses.sum() / cfg.global_batch
                engine.backward(share, last_micro_batch=last)
            loss_sum += share.detach()
        stats = engine.step(lr_at(step, cfg))
        step_s = time.perf_counter() - t0

        stats_tensor = torch.stack([loss_sum.float().cpu(), torch.tensor(float(stats.inter_dc_bytes))])
        work = dist.all_reduce(stats_tensor, async_op=True)
        if pending is not None:
            loss = publish(*pending)
            first_loss = loss if math.isnan(first_loss) else first_loss
        pending = (stats_tensor, work, step_s, stats, step)
        if step > 0:
            timed_tokens += cfg.tokens_per_step
            timed_s += step_s
        inter_dc_total += stats.inter_dc_bytes

    final_loss = publish(*pending)
    if math.isnan(first_loss):
        first_loss = final_loss
    eval_loss = evaluate(engine.model, held_out, cfg, device)
    state_bytes = engine.optimizer_state_nbytes()
    totals = torch.tensor([float(inter_dc_total)])
    dist.all_reduce(totals)
    engine.close()
    if emulator is not None:
        emulator.close()
        dist.barrier()  # every rank is done with the shared link files
        if rank == 0:
            cleanup(emulator.key)
    groups.destroy()
    return TrainResult(
        first_loss=first_loss,
        final_loss=final_loss,
        eval_loss=eval_loss,
        steps=cfg.steps,
        tokens_per_s=timed_tokens / timed_s if timed_s else 0.0,
        inter_dc_bytes_per_step=totals.item() / cfg.steps,
        optimizer_state_bytes=state_bytes,
    )
