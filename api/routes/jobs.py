"""/v1/jobs: submit, list, read, cancel; a job's events and metric series."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Response, status

from meridian.api.deps import StoreDep, SupervisorDep
from meridian.api.schemas import ErrorBody, EventList, EventPublic, JobList, JobPublic, JobSpec
from meridian.service.jobs import JobState

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

ERRORS: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorBody}, 409: {"model": ErrorBody}, 422: {"model": ErrorBody},
}


@router.post("", status_code=status.HTTP_201_CREATED, response_model=JobPublic, responses=ERRORS)
def submit_job(
    spec: JobSpec, supervisor: SupervisorDep, response: Response,
    idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
) -> JobPublic:
    """Validate, plan against the live cluster (rejecting what can never fit), store and queue a job.
    Repeating a request with the same ``Idempotency-Key`` returns the first job (200) instead of a copy."""
    job, created = supervisor.submit(spec.to_request(), spec.model_dump(mode="json"), idempotency_key=idempotency_key)
    if not created:
        response.status_code = status.HTTP_200_OK
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    return JobPublic.from_record(job)


@router.get("", response_model=JobList)
def list_jobs(
    store: StoreDep,
    state: Annotated[list[JobState] | None, Query(description="filter by state; repeat for several")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
) -> JobList:
    """Newest first."""
    jobs = store.list_jobs(states=set(state) if state else None, limit=limit, offset=offset)
    return JobList(jobs=[JobPublic.from_record(j) for j in jobs], count=len(jobs))


@router.get("/{job_id}", response_model=JobPublic, responses=ERRORS)
def get_job(job_id: str, store: StoreDep) -> JobPublic:
    return JobPublic.from_record(store.get_job(job_id))


@router.delete("/{job_id}", status_code=status.HTTP_202_ACCEPTED, response_model=JobPublic, responses=ERRORS)
def cancel_job(job_id: str, supervisor: SupervisorDep) -> JobPublic:
    """Cancel: a queued job ends at once; a running one stops its workers and frees its placement."""
    return JobPublic.from_record(supervisor.cancel(job_id))


@router.get("/{job_id}/events", response_model=EventList, responses=ERRORS)
def job_events(
    job_id: str, store: StoreDep,
    after: Annotated[int, Query(ge=0, le=2**62, description="only events with a larger id")] = 0,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> EventList:
    store.get_job(job_id)
    return EventList(events=[EventPublic.from_event(e) for e in store.list_events(job_id, after=after, limit=limit)])


@router.get("/{job_id}/metrics", responses=ERRORS)
def job_metrics(
    job_id: str, store: StoreDep,
    after_step: Annotated[int, Query(ge=0, le=2**62)] = 0,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
) -> dict[str, Any]:
    """The stored per-step series: loss, tokens/s, step time, learning rate, inter-DC bytes."""
    store.get_job(job_id)
    return {"job_id": job_id, "points": store.list_metrics(job_id, after_step=after_step, limit=limit)}
