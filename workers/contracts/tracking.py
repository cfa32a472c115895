"""What a job asks its experiment trackers for (``"tracking"`` in the job spec), as the service admitted it; torch-free.

Rank 0 logs every step's record (loss, validation loss, learning rate, tokens/s, MFU, the step's split, inter-DC
bytes) and the job's config and plan as hyperparameters through the real libraries
(:mod:`meridian.workers.tracking`): TensorBoard event files and W&B offline runs in the job's folder of the
service's storage, an MLflow store where the job says (under a root the service declares).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

CLOSE_TIMEOUT_S = 60.0
"""How long rank 0's end waits for its trackers to take the last records and close (opening W&B offline can take
seconds on a loaded host); the job's runner gives a tracking job's run this much more to end by itself."""

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 _.:-]{0,127}$")
"""An MLflow experiment's or a W&B project's name."""


def _check_name(value: str, field: str) -> None:
    if not NAME.match(value):
        raise ValueError(f"{field} {value!r} must be 1-128 letters, digits, spaces or '_.:-', starting with a letter or "
                         "digit")


@dataclass(frozen=True, kw_only=True)
class MlflowTracking:
    """Log to MLflow."""

    uri: str = ""
    """The tracking URI: ``file:/path`` (a file store) or ``sqlite:////path/mlflow.db``, the path under a folder the
    service declares (``meridian serve --tracking-root``), or an ``http(s)://`` server under a URL it declares;
    empty: a file store in the job's folder of the service's storage."""
    experiment: str = "meridian"
    """The MLflow experiment the job's run goes into (made if missing); the run is named by the job's id."""

    def __post_init__(self) -> None:
        _check_name(self.experiment, "tracking.mlflow.experiment")


@dataclass(frozen=True, kw_only=True)
class WandbTracking:
    """Log to Weights & Biases, offline: the run's files go to the job's folder, for ``wandb sync`` later."""

    mode: str = "offline"
    """``offline`` only: the service writes nothing outside the places its operator allows."""
    project: str = "meridian"
    """The W&B project of the run (its id is the job's id)."""

    def __post_init__(self) -> None:
        if self.mode != "offline":
            raise ValueError(f"tracking.wandb.mode {self.mode!r}: only 'offline' is supported (the run's files stay in "
                             "the job's folder; upload them with `wandb sync DIR` where that is allowed)")
        _check_name(self.project, "tracking.wandb.project")


@dataclass(frozen=True, kw_only=True)
class TrackingConfig:
    """The trackers rank 0 logs to."""

    tensorboard: bool = False
    """Write TensorBoard event files to ``<job folder>/tensorboard`` (listed in the job's artifacts)."""
    mlflow: MlflowTracking | None = None
    wandb: WandbTracking | None = None
    params: tuple[tuple[str, str], ...] = ()
    """Set by the service when it launches the job (whatever was sent is replaced): the plan's fields, logged
    beside the config as hyperparameters."""

    @property
    def enabled(self) -> bool:
        return self.tensorboard or self.mlflow is not None or self.wandb is not None
