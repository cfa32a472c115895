"""/v1/cluster and /v1/plans: what the cluster looks like, and what a job would get on it; /v1/event-kinds: what
a job's events can say."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from meridian.api.deps import ServiceDep, SupervisorDep
from meridian.api.schemas import ErrorBody, JobSpec, admitted_request
from meridian.workers.contracts.events import registry

router = APIRouter(tags=["cluster"])


@router.get("/v1/cluster")
def get_cluster(service: ServiceDep) -> dict[str, Any]:
    """Every node with its Ray node id, datacenter, liveness, resources and labels, grouped by datacenter; and the
    jobs' storage: the nodes proven to share it, and what the last proof that failed found."""
    shared = getattr(service, "shared_storage", None)
    return {**service.topology().to_dict(), **({"storage": shared.status()} if shared is not None else {})}


@router.post("/v1/plans", responses={409: {"model": ErrorBody}, 422: {"model": ErrorBody}})
def dry_run_plan(spec: JobSpec, supervisor: SupervisorDep, service: ServiceDep) -> dict[str, Any]:
    """The plan a job spec would get on the cluster right now, without submitting it; a 422 where submitting it
    would be one (its options and the plan make no valid training config)."""
    request = admitted_request(spec, "", supervisor.data_access.admit_checkpoint,
                               service.config.model_access().admit_factory)
    return supervisor.resolve(request, "dry-run").plan.to_dict()


@router.get("/v1/event-kinds", tags=["jobs"])
def event_kinds() -> dict[str, Any]:
    """Every kind of job event: its name (the ``event`` field of a job's event stream), what it means, and the
    fields of its ``data``: the one registry the service, the web page and the CLI share."""
    return {"kinds": registry()}
