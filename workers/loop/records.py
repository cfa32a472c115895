"""What the training loop hands out: a :class:`~meridian.workers.contracts.records.StepRecord` per step (rank 0,
through a :class:`ProgressSink`) and a :class:`~meridian.workers.contracts.records.TrainResult` at the end (every
rank); both are defined in the torch-free contracts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from meridian.workers.contracts.config import TrainConfig
from meridian.workers.contracts.records import DevicePeak, StepRecord
from meridian.workers.loop.observe import StepTimes, mfu
from meridian.workers.loop.schedule import lr_at
from meridian.workers.sync.engine import StepStats


class ProgressSink(Protocol):
    """Where rank 0 sends per-step records (the service's job runner, or a list in tests).

    A sink that also has ``rank_step(beat)`` receives every rank's per-step heartbeats
    (:mod:`meridian.workers.loop.observe`), and makes rank 0 measure its device's peak for the MFU."""

    def step(self, record: StepRecord) -> None: ...


@dataclass
class ListSink:
    records: list[StepRecord] = field(default_factory=list)

    def step(self, record: StepRecord) -> None:
        self.records.append(record)


def step_record(
    cfg: TrainConfig, step: int, loss: float, step_s: float, stats: StepStats, inter_dc: int, done_at: float,
    *, data_s: float = 0.0, peak: DevicePeak | None = None, world: int = 1, epoch: int = 0,
    val_loss: float | None = None,
) -> StepRecord:
    """What rank 0 reports of step ``step`` (0-based; reported as ``step + 1`` steps done)."""
    times = StepTimes(step_s=step_s, data_s=data_s, sync_wait_s=stats.sync_wait_s)
    tokens_per_s = cfg.tokens_per_step / step_s
    return StepRecord(
        step=step + 1,
        total_steps=cfg.steps,
        loss=loss,
        lr=lr_at(step, cfg),
        step_s=step_s,
        tokens_per_s=tokens_per_s,
        grad_norm=float(stats.grad_norm),
        inter_dc_bytes=inter_dc,
        sync_wait_s=stats.sync_wait_s,
        comm_s=stats.comm_s,
        comm_intra_dc_s=stats.intra_dc_comm_s,
        comm_inter_dc_s=max(0.0, stats.comm_s - stats.intra_dc_comm_s),
        exposed_s=stats.exposed_s,
        overlap_fraction=stats.overlap_fraction,
        data_s=data_s,
        compute_s=times.compute_s,
        mfu=mfu(cfg.model.flops_per_token, tokens_per_s, world, peak),
        peak_flops=peak.flops if peak else None,
        peak_source=peak.source if peak else "",
        time=done_at,
        workers=world,
        epoch=epoch,
        val_loss=val_loss,
        sync_late=stats.late,
        sync_decision=decision_record(stats),
    )


def decision_record(stats: StepStats) -> dict[str, Any] | None:
    decision = stats.lookahead_decision
    return None if decision is None else decision.to_record()
