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

from meridian.workers.contracts.config import Precision, TrainConfig
from meridian.workers.data.text import TextDataset
from meridian.workers.distributed.layout import DCGroups, DCLayout
from meridian.workers.loop.observe import (
    DevicePeak,
    StepTimes,
    computed_beat,
    heartbeat,
    measure_peak_flops,
    mfu,
)
from meridian.workers.model.gpt import GPT, per_sample_loss
from meridian.workers.sync.build import GradientSync, StepStats, build_sync
from meridian.workers.wan.collectives import WanEmulator, agree_key, cleanup


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
    final_params: dict[str, torch.Tensor] | None = None
    """The model's parameters after the last step (CPU copies), when ``train(..., keep_params=True)``."""


def forward_backward(
    engine: GradientSync, data: TextDataset, cfg: TrainConfig, step: int, rank: int, world: int,
    device: torch.device, timings: dict[str, float] | None = None,
) -> torch.Tensor:
    """This rank's micro-batches of step ``step``, forward and backward; returns its share of the loss.
    ``timings["data_s"]`` receives the seconds spent producing the batches (the data loader's share)."""
    loss_sum = torch.zeros((), device=device)
    t0 = time.perf_counter()
    batches = data.step_batches(step, cfg.global_batch, cfg.micro_batch, rank, world)
    if timings is not None:
        timings["data_s"] = time.perf_counter() - t0
    for i, (x, y) in enumerate(batches):
        last = i == len(batches) - 1
        with engine.micro_batch(last_micro_batch=last):
            with autocast_context(cfg.precision, device):
                losses = per_sample_loss(engine.model(x.to(device)), y.to(device))
            share = losses.sum() / cfg.global_batch
            engine.backward(share, last_micro_batch=last)
        loss_sum += share.detach()
    return loss_sum


def timed_step(
    engine: GradientSync, data: TextDataset, cfg: TrainConfig, step: int, rank: int, world: int,
    device: torch.device, rank_step: Any = None, *, snapshot: bool = False,
) -> tuple[torch.Tensor, StepStats, float, float]:
    """Optimizer step ``step`` on this rank: forward/backward, then the engine's sync and update, with the
    per-rank heartbeats around them (``rank_step``, when given). Returns this rank's loss share, the engine's
    stats (with this rank's shard of the new state when ``snapshot``), the step's seconds and its data seconds."""
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    loss_sum = forward_backward(engine, data, cfg, step, rank, world, device, timings)
    if rank_step is not None:
        rank_step(computed_beat(rank, step + 1))
    stats = engine.step(lr_at(step, cfg), snapshot_as=step + 1 if snapshot else None)
    step_s = time.perf_counter() - t0
    if rank_step is not None:
        rank_step(heartbeat(rank, step + 1, StepTimes(step_s, timings["data_s"], stats.sync_wait_s)))
    return loss_sum, stats, step_s, timings["data_s"]


def progress_record(
    cfg: TrainConfig, step: int, loss: float, step_s: float, stats: StepStats, inter_dc: int, done_at: float,
    *, data_s: float = 0.0, peak: DevicePeak | None = None, world: int = 1,
) -> dict[str, Any]:
    """What rank 0 reports of step ``step`` (0-based; reported as ``step + 1`` steps done)."""
    times = StepTimes(step_s=step_s, data_s=data_s, sync_wait_s=stats.sync_wait_s)
    tokens_per_s = cfg.tokens_per_step / step_s
    observed = {
        "data_s": data_s,
        "compute_s": times.compute_s,
        "mfu": mfu(cfg.model.flops_per_token, tokens_per_s, world, peak),
        "peak_flops": peak.flops if peak else None,
        "peak_source": peak.source if peak else "",
    }
    return observed | {
        "step": step + 1,
        "total_steps": cfg.steps,
        "loss": loss,
        "lr": lr_at(step, cfg),
        "step_s": step_s,
        "tokens_per_s": cfg.tokens_per_step / step_s,
        "grad_norm": stats.grad_norm,
        "inter_dc_bytes": inter_dc,
        "sync_wait_s": stats.sync_wait_s,
        "comm_s": stats.comm_s,
        "comm_intra_dc_s": stats.intra_dc_comm_s,
        "comm_inter_dc_s": max(0.0, stats.comm_s - stats.intra_dc_comm_s),
        "exposed_s": stats.exposed_s,
        "overlap_fraction": stats.overlap_fraction,
        "time": done_at,
        "workers": world,
    }


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


def train(
    cfg: TrainConfig, *, sink: ProgressSink, device: torch.device | None = None, keep_params: bool = False
) -> TrainResult:
    """Run the job on this rank. Every rank of the default process group must call it."""
    device = device or torch.device("cpu")
    if cfg.parallel.model_parallel > 1:  # tensor/pipeline parallelism: stages and slices, same contract
        from meridian.workers.loop.parallel import train_parallel

        return train_parallel(cfg, sink=sink, device=device, keep_params=keep_params)
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
    pending: tuple[torch.Tensor, dist.Work, float, StepStats, int, float, float] | None = None
    # Per-rank heartbeats go out of band (not through a collective), so the service can name a rank that
    # stopped finishing steps even while every other rank sits blocked in the collective waiting for it.
    rank_step = getattr(sink, "rank_step", None)
    peak = measure_peak_flops(device) if rank_step is not None and rank == 0 else None

    def publish(
        stats_tensor: torch.Tensor, work: dist.Work, step_s: float, step_stats: StepStats, step: int, done_at: float,
        data_s: float,
    ) -> float:
        # The global loss is summed with an async all-reduce and read one step later, so reporting it
        # never puts a latency round on the critical path.
        work.wait()
        loss, inter_dc = stats_tensor[0].item(), int(stats_tensor[1].item())
        if rank == 0:
            sink.step(progress_record(cfg, step, loss, step_s, step_stats, inter_dc, done_at, data_s=data_s,
                                      peak=peak, world=world))
        return loss

    for step in range(cfg.steps):
        loss_sum, stats, step_s, data_s = timed_step(engine, data, cfg, step, rank, world, device, rank_step)
        stats_tensor = torch.stack([loss_sum.float().cpu(), torch.tensor(float(stats.inter_dc_bytes))])
        work = dist.all_reduce(stats_tensor, async_op=True)
        if pending is not None:
            loss = publish(*pending)
            first_loss = loss if math.isnan(first_loss) else first_loss
        pending = (stats_tensor, work, step_s, stats, step, time.time(), data_s)
        if step > 0:
            timed_tokens += cfg.tokens_per_step
            timed_s += step_s
        inter_dc_total += stats.inter_dc_bytes

    final_loss = publish(*pending)
    if math.isnan(first_loss):
        first_loss = final_loss
    eval_loss = evaluate(engine.model, held_out, cfg, device)
    state_bytes = engine.optimizer_state_nbytes()
    final_params = None
    if keep_params:
        engine.synchronize()
        final_params = {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
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
        final_params=final_params,
    )
