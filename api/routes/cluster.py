"""/v1/cluster and /v1/plans: what the cluster looks like, and what a job would get on it."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from meridian.api.deps import ServiceDep, SupervisorDep
from meridian.api.schemas import ErrorBody, JobSpec, admitted_request

router = APIRouter(tags=["cluster"])


@router.get("/v1/cluster")
def get_cluster(service: ServiceDep) -> dict[str, Any]:
    """Every node with its Ray node id, datacenter, liveness, resources and labels, grouped by datacenter."""
    return service.topology().to_dict()


@router.post("/v1/plans", responses={409: {"model": ErrorBody}, 422: {"model": ErrorBody}})
def dry_run_plan(spec: JobSpec, supervisor: SupervisorDep, service: ServiceDep) -> dict[str, Any]:
    """The plan a job spec would get on the cluster right now, without submitting it."""
    return supervisor.plan(admitted_request(spec, "", supervisor.data_access.admit_checkpoint,
                                            service.config.model_access().admit_factory)).to_dict()
