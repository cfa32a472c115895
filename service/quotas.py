"""Per-owner quotas: the CPUs and GPUs an owner's running jobs may hold, and how many may run at once.

Admission asks :func:`over_quota` before it asks whether a job fits in the free capacity: a job that would take
its owner over a quota stays queued, with the quota named in its reason, and does not hold back other owners'
jobs. Pure: the supervisor gives it the owner's quota and the jobs it has placing or running.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from meridian.service.planning.plan import Plan


@dataclass(frozen=True, kw_only=True)
class Quota:
    """What one owner's jobs may hold at once; ``None``: no limit."""

    owner: str
    cpus: float | None = None
    gpus: float | None = None
    jobs: int | None = None
    """Jobs placing or running at once."""

    def __post_init__(self) -> None:
        for name in ("cpus", "gpus", "jobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"quota.{name} must be >= 0 or null (no limit), got {value}")


@dataclass(frozen=True)
class Held:
    """What one job holds (or will hold once placed)."""

    cpus: float
    gpus: float

    @classmethod
    def of(cls, plan: Plan) -> Held:
        per = plan.resources_per_worker
        return cls(cpus=plan.num_workers * per.get("CPU", 0.0), gpus=plan.num_workers * per.get("GPU", 0.0))


def over_quota(quota: Quota | None, active: Iterable[Held], job: Held) -> str | None:
    """Why ``job`` may not start for its owner now, naming the quota; ``None`` when it may. ``active``: what the
    owner's placing and running jobs hold."""
    if quota is None:
        return None
    active = list(active)
    cpus, gpus = sum(h.cpus for h in active), sum(h.gpus for h in active)
    why = []
    if quota.jobs is not None and len(active) + 1 > quota.jobs:
        why.append(f"{len(active)} of its {quota.jobs} concurrent job(s) already run (quota.jobs)")
    if quota.cpus is not None and cpus + job.cpus > quota.cpus:
        why.append(f"it needs {job.cpus:g} CPU(s) with {cpus:g} in use of a quota of {quota.cpus:g} (quota.cpus)")
    if quota.gpus is not None and gpus + job.gpus > quota.gpus:
        why.append(f"it needs {job.gpus:g} GPU(s) with {gpus:g} in use of a quota of {quota.gpus:g} (quota.gpus)")
    if not why:
        return None
    return (f"owner {quota.owner!r} is at its quota: {'; '.join(why)}; the job starts once the owner's other jobs "
            "free enough or an admin raises the quota (`meridian quota set`)")
