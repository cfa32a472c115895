"""Request dependencies as named ``Annotated`` aliases, so routes read like prose."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from meridian.service.core import MeridianService
from meridian.service.errors import ClusterUnavailable
from meridian.service.store import JobStore
from meridian.service.supervision.supervisor import Supervisor


def get_service(request: Request) -> MeridianService:
    service: MeridianService = request.app.state.service
    if service.supervisor is None or service.store is None:
        raise ClusterUnavailable("the service is still starting; retry in a few seconds")
    return service


def get_store(service: Annotated[MeridianService, Depends(get_service)]) -> JobStore:
    return service.store  # type: ignore[return-value]


def get_supervisor(service: Annotated[MeridianService, Depends(get_service)]) -> Supervisor:
    return service.supervisor  # type: ignore[return-value]


ServiceDep = Annotated[MeridianService, Depends(get_service)]
StoreDep = Annotated[JobStore, Depends(get_store)]
SupervisorDep = Annotated[Supervisor, Depends(get_supervisor)]
