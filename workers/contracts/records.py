"""What the training processes hand out, torch-free: the record rank 0 reports after every optimizer step, the
device peak rank 0 measured, and every rank's result at the end.

Produced by the training loop (:mod:`meridian.workers.loop`), carried to the job's runner actor as itself
(pipe and Ray pickle a dataclass), folded into metrics there and polled by the supervisor, which stores
:meth:`StepRecord.to_dict` — the only place it becomes a dict, because the store and the wire speak JSON.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    step: int
    """Optimizer steps done (1-based: the record of the first step says 1)."""
    total_steps: int
    loss: float
    """The global mean training loss of this step's batch."""
    lr: float
    step_s: float
    """Wall-clock seconds of the step on rank 0: forward, backward, sync and update."""
    tokens_per_s: float
    grad_norm: float
    inter_dc_bytes: int
    """Bytes all ranks put into collectives that cross a datacenter boundary in this step."""
    sync_wait_s: float = 0.0
    comm_s: float = 0.0
    comm_intra_dc_s: float = 0.0
    comm_inter_dc_s: float = 0.0
    exposed_s: float = 0.0
    overlap_fraction: float = 0.0
    data_s: float = 0.0
    compute_s: float = 0.0
    mfu: float | None = None
    peak_flops: float | None = None
    peak_source: str = ""
    time: float = 0.0
    """When the step finished (the reporting rank's ``time.time()``)."""
    workers: int = 1
    epoch: int = 0
    """The elastic membership the step ran in (0: a run without a rendezvous)."""
    val_loss: float | None = None
    """Loss on the validation split after this step, when the job's ``validation`` scheduled one."""
    sync_late: bool = False
    """This step's gradient sync was applied one step late (with ``sync.local_lookahead``: at a look-ahead)."""
    sync_decision: dict[str, Any] | None = None
    """On the step where an armed look-ahead (``sync.lookahead_when_exposed``) was decided: the decision and the
    measured figures it was taken on (``LookaheadDecision.to_dict`` plus its ``reason``)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepRecord:
        """A stored record (keys it does not know, from an older or newer version, are ignored)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class DevicePeak:
    flops: float
    """Dense matmul FLOP/s this device reached (the denominator of MFU)."""
    source: str
    """How it was obtained, so a reader of the MFU knows what it is relative to."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TrainResult:
    """What every rank's training ends with. Torch-free to unpickle (but for ``final_params``), as the peak above
    is: a worker's agent receives both from its training process over a pipe, and importing torch for them cost
    every agent seconds of CPU at the end of every job (rank 0's also at its start), beside the training."""

    first_loss: float
    final_loss: float
    eval_loss: float | None
    """The held-out loss after the last step; ``None`` when the held-out split has no sample (``eval_skipped``)."""
    steps: int
    tokens_per_s: float
    """Mean training throughput over the steps after the first (which includes warm-up costs)."""
    inter_dc_bytes_per_step: float
    """Mean tensor bytes per step put into collectives crossing a DC boundary, summed over ranks."""
    optimizer_state_bytes: int = 0
    """Optimizer state held on this rank after the last step (1/N of replicated AdamW when sharded)."""
    final_params: dict[str, torch.Tensor] | None = None
    """This rank's model (or stage) parameters after the last step (CPU copies), with ``keep_params``."""
    eval_skipped: str = ""
    """Why the final evaluation did not run (its split is too short for one sample), or empty."""
