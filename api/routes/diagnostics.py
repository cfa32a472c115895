"""/v1/diagnostics: measurements of the cluster itself."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from meridian.api.deps import ServiceDep, SupervisorDep
from meridian.api.schemas import ErrorBody, JobSpec, admitted_request
from meridian.service.errors import JobNotFound

router = APIRouter(prefix="/v1/diagnostics", tags=["diagnostics"])

Tier = Literal["intra_node", "intra_dc", "inter_dc"]


class CollectivesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tiers: list[Tier] = Field(default=["intra_node", "intra_dc", "inter_dc"], min_length=1, max_length=3)
    max_bytes: int = Field(64 * 2**20, ge=1024, le=1024 * 2**20, description="largest message size")


@router.post("/collectives", responses={503: {"model": ErrorBody}})
def run_collectives(body: CollectivesRequest, service: ServiceDep) -> dict[str, Any]:
    """Run an all_reduce_perf-style benchmark on each link tier (intra-node, intra-DC, inter-DC) with Ray
    actors pinned to chosen nodes; returns the table (size, time, algbw, busbw) and a latency/bandwidth
    summary per tier. The result is kept and feeds the planner. Takes ~10–60 s."""
    return service.probe_links(tuple(dict.fromkeys(body.tiers)), body.max_bytes)


@router.post("/compute", responses={422: {"model": ErrorBody}, 503: {"model": ErrorBody}})
def run_compute(spec: JobSpec, service: ServiceDep, supervisor: SupervisorDep) -> dict[str, Any]:
    """Measure forward + backward of this job spec's model and micro-batch on every worker slot at once, as
    training runs (a few seconds per slot, after the actors start). The figure is kept and feeds every later
    plan of that model shape and micro-batch: ``auto`` then weighs the link against the step this cluster
    really computes, not a default guess. Returns what was measured (``flops`` per slot, median)."""
    return service.probe_compute(admitted_request(spec, "", supervisor.data_access.admit_checkpoint,
                                                  service.config.model_access().admit_factory))


class NoProbeYet(JobNotFound):
    def __init__(self) -> None:
        Exception.__init__(self, "no collective benchmark has run yet; POST /v1/diagnostics/collectives runs one")


@router.get("/collectives", responses={404: {"model": ErrorBody}})
def latest_collectives(service: ServiceDep) -> dict[str, Any]:
    """The latest benchmark result with its timestamp (``measured_at``)."""
    report = service.probe_cache.latest() if service.probe_cache else None
    if report is None:
        raise NoProbeYet()
    return report
