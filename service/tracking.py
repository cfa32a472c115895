"""A job's experiment trackers as the service admits them (``"tracking"``), and the job's folder its workers
write tracker logs and profiler traces to.

At submit (:func:`admit_tracking`): each tracker asked for needs its library installed (else a 422 naming the
package), and an MLflow URI must name a place the operator allows: a ``file:`` or ``sqlite:`` path under a
tracking root (``meridian serve --tracking-root PATH``, by default ``<data dir>/tracking``; resolved with
``realpath``), or an ``http(s)://`` server under a declared URL root (:mod:`meridian.service.locations`), in the
same words whether or not anything is there. At launch (:func:`with_job_dir`): the job's folder in the storage,
and the plan's fields as hyperparameters. Never imports a tracker's library (only asks whether it is there).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from meridian.service.errors import InvalidJob
from meridian.service.locations import NotUnderRoots, UrlRoot, admit_url
from meridian.workers.contracts.config import TrainConfig
from meridian.workers.contracts.tracking import MlflowTracking, TrackingConfig
from meridian.workers.state import storage
from meridian.workers.tracking.metrics import flatten

PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
"""The module each tracker imports, which is also the package to install."""


@dataclass(frozen=True)
class TrackingAccess:
    roots: tuple[str, ...] = ()
    """Folders under which a job's MLflow store (``file:`` or ``sqlite:``) may be (real paths)."""
    url_roots: tuple[UrlRoot, ...] = ()
    """MLflow servers (``https://host/prefix``) a job may log to."""

    @classmethod
    def for_roots(cls, roots: Sequence[str]) -> TrackingAccess:
        """``roots`` as ``meridian serve --tracking-root`` gives them: folders and URLs."""
        local = [r for r in roots if "://" not in r]
        return cls(tuple(os.path.realpath(os.path.expanduser(r)) for r in local),
                   tuple(UrlRoot.parse(r) for r in roots if "://" in r))


def missing_package(tracking: TrackingConfig) -> str | None:
    """The first tracker's package that this machine lacks, or ``None``."""
    wanted = [name for name, on in (("tensorboard", tracking.tensorboard), ("mlflow", tracking.mlflow is not None),
                                    ("wandb", tracking.wandb is not None)) if on]
    return next((PACKAGES[n] for n in wanted if importlib.util.find_spec(PACKAGES[n]) is None), None)


def admit_tracking(tracking: TrackingConfig | None, access: TrackingAccess, storage_root: str) -> TrackingConfig | None:
    """``tracking`` checked (:class:`InvalidJob` saying what to change) with its MLflow URI resolved; ``None`` or
    one asking for nothing gives ``None``."""
    if tracking is None or not tracking.enabled:
        return None
    package = missing_package(tracking)
    if package is not None:
        raise InvalidJob(f"tracking asks for {package}, which is not installed where this service runs: install it "
                         f"(`pip install {package}`, or `pip install 'meridian-train[tracking]'` for every tracker) on the "
                         "service's machine and every node, or drop it from tracking")
    mlflow = tracking.mlflow
    if mlflow is not None:
        if not mlflow.uri and storage.is_url(storage_root):
            raise InvalidJob(f"tracking.mlflow.uri is needed: the service's storage {storage_root} is an object store, "
                             "where an MLflow file store cannot live; give a file:, sqlite: or http(s):// URI under "
                             "a tracking root")
        mlflow = replace(mlflow, uri=_admit_mlflow_uri(mlflow, access)) if mlflow.uri else mlflow
    return replace(tracking, mlflow=mlflow, params=())


def _admit_mlflow_uri(mlflow: MlflowTracking, access: TrackingAccess) -> str:
    uri = mlflow.uri
    declared = ", ".join([*access.roots, *(str(r) for r in access.url_roots)]) or "none declared"
    refused = InvalidJob(f"tracking.mlflow.uri {uri!r} is not a file:, sqlite: or http(s):// location under this "
                         f"service's tracking roots ({declared}); name one under them, or start the service with "
                         "`meridian serve --tracking-root PATH_OR_URL`")
    scheme, sep, rest = uri.partition(":")
    if not sep:
        raise refused
    scheme = scheme.lower()
    if scheme in ("http", "https"):
        try:
            return admit_url(uri, access.url_roots, field="tracking.mlflow.uri", flag="--tracking-root")
        except NotUnderRoots:
            raise refused from None
    if scheme == "file":
        path = rest[2:] if rest.startswith("//") else rest  # file:/p and file:///p
    elif scheme == "sqlite":
        if not rest.startswith("///"):
            raise refused
        path = rest[3:]  # sqlite:////abs/path.db
    else:
        raise refused
    if not path.startswith("/") or "\0" in path or "?" in path or "#" in path:
        raise refused
    real = os.path.realpath(path)
    if not any(os.path.commonpath([real, root]) == root and real != root for root in access.roots):
        raise refused
    return f"file:{real}" if scheme == "file" else f"sqlite:///{real}"


def with_job_dir(config: TrainConfig, job_dir: str, plan: dict[str, Any],
                 tracking: TrackingConfig | None = None) -> TrainConfig:
    """``config`` at launch: the job's folder in the storage, and the job's ``tracking`` (as admitted; ``None``:
    the config's own) with its hyperparameters from ``plan`` (:meth:`~meridian.service.planning.plan.Plan.to_dict`,
    flattened)."""
    tracking = tracking if tracking is not None else config.tracking
    if tracking is not None:
        if tracking.mlflow is not None and not tracking.mlflow.uri:
            tracking = replace(tracking, mlflow=replace(tracking.mlflow, uri=f"file:{storage.join(job_dir, 'mlflow')}"))
        tracking = replace(tracking, params=tuple(flatten(plan, "plan")))
    return replace(config, tracking=tracking, job_dir=job_dir)
