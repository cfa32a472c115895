"""What the trackers log: each step record's figures by name, and the job's config and plan as hyperparameters.

Torch-free. The names are the record's own fields (the series ``GET /v1/jobs/{id}/metrics`` serves), so a
TensorBoard scalar, an MLflow metric and a W&B history key read back the same figures as the API.
"""

from __future__ import annotations

import math
from typing import Any

from meridian.workers.contracts.config import TrainConfig
from meridian.workers.contracts.fields import to_plain
from meridian.workers.contracts.records import StepRecord

SERIES = ("loss", "val_loss", "lr", "tokens_per_s", "mfu", "step_s", "data_s", "compute_s", "sync_wait_s",
          "comm_s", "exposed_s", "grad_norm", "inter_dc_bytes", "workers")
"""The record's fields each tracker logs per step: loss and validation loss, learning rate, throughput, MFU, the
step's split (data, compute, sync wait, communication, exposed communication), inter-DC bytes, live workers."""


def step_metrics(record: StepRecord) -> dict[str, float]:
    """The figures of one step's record that it has (a validation loss only where one was evaluated)."""
    out: dict[str, float] = {}
    for name in SERIES:
        value = getattr(record, name)
        if value is not None and not (isinstance(value, float) and math.isnan(value)):
            out[name] = float(value)
    return out


def hyperparameters(cfg: TrainConfig) -> dict[str, str]:
    """The job's config (``config.*``, its tracking section left out) and the plan the service chose
    (``plan.*``: ``tracking.params``), flattened to strings."""
    plain = {k: v for k, v in to_plain(cfg).items() if k != "tracking"}
    out = dict(flatten(plain, "config"))
    if cfg.tracking is not None:
        out.update(dict(cfg.tracking.params))
    return out


def flatten(value: Any, prefix: str) -> list[tuple[str, str]]:
    """``("a.b", "1")`` pairs of a JSON-like value (a list of plain values joined by commas, others by index)."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in flatten(v, f"{prefix}.{k}")]
    if isinstance(value, (list, tuple)) and any(isinstance(v, (dict, list, tuple)) for v in value):
        return [p for i, v in enumerate(value) for p in flatten(v, f"{prefix}.{i}")]
    if isinstance(value, (list, tuple)):
        return [(prefix, ",".join(str(v) for v in value))]
    return [(prefix, str(value))]
