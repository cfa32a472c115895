"""What rank 0 reports after every optimizer step, as one typed record; torch-free.

Produced by the training loop (:mod:`meridian.workers.loop`), carried to the job's runner actor as itself
(pipe and Ray pickle a dataclass), folded into metrics there and polled by the supervisor, which stores
:meth:`StepRecord.to_dict` — the only place it becomes a dict, because the store and the wire speak JSON.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepRecord:
        """A stored record (keys it does not know, from an older or newer version, are ignored)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
