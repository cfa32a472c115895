"""The training loop of a tensor- and/or pipeline-parallel job (``parallel.tp * parallel.pp > 1``).

The same contract as :func:`meridian.workers.loop.train.train`, which hands over to :func:`train_parallel`:
build → ``cfg.steps`` optimizer steps → close. What differs is who holds what::

    ranks         (stage, replica, tp_rank), tp fastest                    (:mod:`meridian.workers.parallel.dims`)
    model         this stage's blocks, TP-sliced, cut from the seeded GPT   (:mod:`meridian.workers.parallel.tensor_parallel`)
    forward/back  the pipeline schedule over micro-batches                  (:mod:`meridian.workers.parallel.pipeline`)
    gradient sync the usual engine over the data-parallel group (same stage and TP rank in every
                  replica): HAR within and across DCs, norm summed over the replica's ranks

Each replica reads the samples of its data-parallel index, so the step's global batch is the same set of
samples as in single-process training; only TP rank 0 of the last stage adds its loss to the global loss.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from meridian.workers.contracts.config import TrainConfig
from meridian.workers.data.text import TextDataset
from meridian.workers.distributed.layout import DCLayout
from meridian.workers.model.gpt import GPT
from meridian.workers.parallel.dims import ParallelDims, ParallelGroups
from meridian.workers.parallel.pipeline import StageRunner
from meridian.workers.parallel.tensor_parallel import GPTStage
from meridian.workers.sync.build import build_sync
from meridian.workers.wan.collectives import WanEmulator, agree_key, cleanup

if TYPE_CHECKING:
    from meridian.workers.loop.train import ProgressSink, TrainResult


def train_parallel(
    cfg: TrainConfig, *, sink: ProgressSink, device: torch.device, keep_params: bool = False
) -> TrainResult:
    from meridian.workers.loop.train import TrainResult, autocast_context, lr_at, progress_record

    rank, world = dist.get_rank(), dist.get_world_size()
    dims = ParallelDims(cfg.parallel.tp, cfg.parallel.pp, cfg.datacenters or ("local",) * world)
    groups = ParallelGroups(dims, rank)
    c = groups.coords
    dp_groups = groups.dp
    assert dp_groups is not None

    torch.manual_seed(cfg.seed)
    full = GPT(cfg.model)  # the single-process initial weights, on every rank
    model = GPTStage(full, stage=c.stage, pp=dims.pp, tp_rank=c.tp_rank, tp=dims.tp, tp_group=groups.tp_group)
    model = model.to(device)
    del full

    dp_emulator = stage_emulator = None
    key = agree_key(f"job-{cfg.job_id}") if cfg.wan is not None and len(set(dims.datacenters)) > 1 else ""
    if key:
        # One set of link files for the job (same key): data-parallel traffic of every group and pipeline
        # traffic between stages share the emulated inter-DC links.
        dp_emulator = WanEmulator(cfg.wan, dp_groups.layout, c.replica, key=key)
        stage_emulator = WanEmulator(cfg.wan, DCLayout(dims.datacenters), rank, key=key)
    engine = build_sync(model, dp_groups, cfg.sync, cfg.optim, emulator=dp_emulator)
    prev, nxt = dims.stage_neighbours(rank)
    runner = StageRunner(
        engine.model, prev=prev, next=nxt, schedule=cfg.parallel.schedule, pp=dims.pp, stage_index=c.stage,
        d_model=cfg.model.d_model, autocast=lambda: autocast_context(cfg.precision, device), emulator=stage_emulator,
    )
    data = TextDataset(cfg.data, cfg.model.seq_len, cfg.seed)
    held_out = TextDataset(cfg.data, cfg.model.seq_len, cfg.seed, split="eval")

    losses: list[float] = []
    timed_tokens, timed_s, inter_dc_total = 0, 0.0, 0
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        batches = data.step_batches(step, cfg.global_batch, cfg.micro_batch, c.replica, dims.dp)
        loss_share = runner.train_step(engine, batches, cfg.global_batch, device)
        stats = engine.step(lr_at(step, cfg))
        step_s = time.perf_counter() - t0
        pp_bytes = stage_emulator.counter.reset().tensor_bytes if stage_emulator is not None else 0
        inter_dc = stats.inter_dc_bytes + pp_bytes
        contrib = loss_share.detach().float().cpu() if groups.reports_loss else torch.zeros(())
        totals = torch.stack([contrib, torch.tensor(float(inter_dc))])
        dist.all_reduce(totals)
        loss = totals[0].item()
        losses.append(loss)
        if rank == 0:
            sink.step(progress_record(cfg, step, loss, step_s, stats, int(totals[1].item()), time.time()))
        if step > 0:
            timed_tokens += cfg.tokens_per_step
            timed_s += step_s
        inter_dc_total += int(totals[1].item())

    eval_loss = _evaluate(runner, held_out, cfg, device, reports=groups.reports_loss and c.replica == 0)
    final_params = None
    if keep_params:
        engine.synchronize()
        final_params = {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
    state_bytes = engine.optimizer_state_nbytes()
    engine.close()
    for emu in (dp_emulator, stage_emulator):
        if emu is not None:
            emu.close()
    if key:
        dist.barrier()  # every rank is done with the shared link files
        if rank == 0:
            cleanup(key)
    groups.destroy()
    return TrainResult(
        first_loss=losses[0] if losses else math.nan,
        final_loss=losses[-1] if losses else math.nan,
        eval_loss=eval_loss,
        steps=cfg.steps,
        tokens_per_s=timed_tokens / timed_s if timed_s else 0.0,
        inter_dc_bytes_per_step=inter_dc_total / cfg.steps,
        optimizer_state_bytes=state_bytes,
        final_params=final_params,
    )


@torch.no_grad()
def _evaluate(runner: StageRunner, data: TextDataset, cfg: TrainConfig, device: torch.device, *, reports: bool,
              batches: int = 4) -> float:
    """Held-out loss as :func:`meridian.workers.loop.train.evaluate` computes it, through the pipeline."""
    runner.stage.eval()
    total = torch.zeros(())
    for b in range(batches):
        x, y = data.batch(b * cfg.micro_batch, cfg.micro_batch)
        loss = runner.forward_only(x, y, device)
        if reports:
            total += loss.float().cpu()
    runner.stage.train()
    dist.all_reduce(total)
    return total.item() / batches
