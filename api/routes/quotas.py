"""/v1/quotas: what each owner's jobs may hold at once (CPUs, GPUs, concurrent jobs). Everyone reads their own;
an admin (or anyone with auth off) reads every owner's and sets them."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from meridian.api.auth import CallerDep
from meridian.api.deps import StoreDep, SupervisorDep
from meridian.api.schemas import ErrorBody
from meridian.service.errors import Forbidden
from meridian.service.quotas import Quota

router = APIRouter(prefix="/v1/quotas", tags=["quotas"])


class QuotaSpec(BaseModel):
    """An owner's limits; ``null`` (or left out): no limit."""

    model_config = ConfigDict(extra="forbid")
    cpus: float | None = Field(default=None, ge=0, le=1e7, description="CPUs the owner's running jobs may hold")
    gpus: float | None = Field(default=None, ge=0, le=1e6, description="GPUs the owner's running jobs may hold")
    jobs: int | None = Field(default=None, ge=0, le=100_000, description="the owner's jobs placing or running at once")


def _public(q: Quota) -> dict[str, Any]:
    return {"owner": q.owner, "cpus": q.cpus, "gpus": q.gpus, "jobs": q.jobs}


@router.get("", responses={401: {"model": ErrorBody}})
def list_quotas(store: StoreDep, caller: CallerDep) -> dict[str, Any]:
    """Every owner's quota for an admin; the caller's own otherwise (an owner without one has no limit)."""
    quotas = store.quotas()
    if not caller.may_administer:
        quotas = {o: q for o, q in quotas.items() if o == caller.owner}
    return {"quotas": [_public(q) for q in quotas.values()]}


@router.put("/{owner}", responses={401: {"model": ErrorBody}, 403: {"model": ErrorBody}, 422: {"model": ErrorBody}})
def set_quota(owner: str, spec: QuotaSpec, supervisor: SupervisorDep, caller: CallerDep) -> dict[str, Any]:
    """Set ``owner``'s quota (admins only); queued jobs it held back are admitted from the next tick."""
    if not caller.may_administer:
        raise Forbidden("setting quotas needs an admin's token (`meridian token create --admin`)")
    return _public(supervisor.set_quota(Quota(owner=owner, cpus=spec.cpus, gpus=spec.gpus, jobs=spec.jobs)))
