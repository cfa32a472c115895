"""/v1/jobs/{id}/profile(s): ask ranks of a running job for a ``torch.profiler`` trace of their next N steps,
list the traces and download them (Chrome trace JSON, which Perfetto and TensorBoard open).

A request is told to the ranks once, through the job's runner and each rank's agent
(:mod:`meridian.service.runner.profiling`); each rank writes ``<job folder>/profiles/<id>/rank-<r>.json`` in the
service's storage when its steps are done (:mod:`meridian.workers.elastic.profiling`), and the job's events say
when (``profile_started``, ``profile_captured``).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from meridian.api.auth import CallerDep
from meridian.api.deps import StoreDep, SupervisorDep
from meridian.api.routes.jobs import ERRORS
from meridian.service.errors import ClusterUnavailable, InvalidTransition
from meridian.service.jobs import JobState
from meridian.service.runner.poll import RunnerLost
from meridian.workers.contracts.events import EventKind, JobEvent
from meridian.workers.elastic.liveness import MAX_PROFILE_STEPS
from meridian.workers.state import storage

router = APIRouter(prefix="/v1/jobs", tags=["profiles"])

TRACE = re.compile(r"^(?P<id>[0-9a-f]{12})/rank-(?P<rank>\d+)\.json$")
ProfileId = Annotated[str, Path(pattern=r"^[0-9a-f]{12}$", description="a profile's id, as the request answered")]


class ProfileRequest(BaseModel):
    model_config = {"extra": "forbid"}
    steps: int = Field(3, ge=1, le=MAX_PROFILE_STEPS, description="steps to record, from the next step boundary on")
    ranks: list[Annotated[int, Field(ge=0, le=65535)]] = Field(
        default_factory=lambda: [0], min_length=1, max_length=4096, description="the ranks that record one trace each")


class ProfileAccepted(BaseModel):
    id: str
    job_id: str
    steps: int
    ranks: list[int]
    told: list[int]
    """Ranks whose agent took the request (each writes its trace once its steps are done)."""
    unreachable: list[int]
    """Ranks whose agent did not answer (restarting, or gone): they record nothing for this request."""


def _rank_error(message: str) -> RequestValidationError:
    return RequestValidationError([{"loc": ("body", "ranks"), "msg": message, "type": "value_error"}])


@router.post("/{job_id}/profile", status_code=status.HTTP_202_ACCEPTED, response_model=ProfileAccepted,
             responses=ERRORS)
def request_profile(job_id: str, body: ProfileRequest, store: StoreDep, supervisor: SupervisorDep,
                    caller: CallerDep) -> ProfileAccepted:
    """Ask ``ranks`` of a running job for a profiler trace of their next ``steps`` steps; 202 once told."""
    job = caller.check_owns(store.get_job(job_id))
    state = job.status.state
    if state.is_terminal:
        raise InvalidTransition(f"job {job_id} already {state.value}: a profile records steps still to come, so only "
                                "a running job can take one")
    if state is not JobState.RUNNING:
        raise InvalidTransition(f"job {job_id} is {state.value}, not training yet; ask again once it runs")
    planned = int((job.plan or {}).get("num_workers") or 0)
    lacking = sorted(r for r in set(body.ranks) if r >= planned)
    if lacking:
        raise _rank_error(f"ranks {lacking} are not ranks of job {job_id}, which has ranks 0-{planned - 1}")
    request_id = uuid.uuid4().hex[:12]
    try:
        delivery = supervisor.launcher.profile(job_id, request_id, body.steps, list(body.ranks))
    except RunnerLost:
        raise InvalidTransition(f"job {job_id} has no runner any more (it is ending); nothing to profile") from None
    except Exception as e:  # a busy runner: the request can be repeated
        raise ClusterUnavailable(f"the job's runner did not take the request ({type(e).__name__}); retry") from e
    if isinstance(delivery, str):  # the epoch running now is smaller than the plan (a worker was lost)
        raise _rank_error(delivery)
    told, unreachable = list(delivery.told), list(delivery.unreachable)
    message = f"profile {request_id} of {body.steps} steps asked of ranks {told}"
    if unreachable:
        message += f"; ranks {unreachable} did not answer"
    store.add_event(job_id, JobEvent.of(EventKind.PROFILE_REQUESTED, message, {
        "id": request_id, "steps": body.steps, "told": told, "unreachable": unreachable}))
    return ProfileAccepted(id=request_id, job_id=job_id, steps=body.steps, ranks=sorted(set(body.ranks)),
                           told=list(delivery.told), unreachable=list(delivery.unreachable))


def _profiles_root(supervisor: Any, job_id: str) -> str:
    return storage.join(supervisor.checkpoint_root, job_id, "profiles")


@router.get("/{job_id}/profiles", responses=ERRORS)
def list_profiles(job_id: str, store: StoreDep, supervisor: SupervisorDep, caller: CallerDep) -> dict[str, Any]:
    """The traces the job's ranks wrote (complete ones only), by profile id and rank, each with its bytes, its
    location in the storage and its download path."""
    caller.check_owns(store.get_job(job_id))
    root = _profiles_root(supervisor, job_id)
    traces = []
    for name, size in sorted(storage.list_files(root).items()):
        m = TRACE.match(name.replace("\\", "/"))
        if m:
            traces.append({"id": m["id"], "rank": int(m["rank"]), "bytes": size, "path": storage.join(root, name),
                           "download": f"/v1/jobs/{job_id}/profiles/{m['id']}/ranks/{m['rank']}"})
    return {"job_id": job_id, "storage": root, "traces": traces}


@router.get("/{job_id}/profiles/{profile_id}/ranks/{rank}", responses={
    **ERRORS, 200: {"description": "the Chrome trace JSON", "content": {"application/json": {}}}})
def download_profile(job_id: str, profile_id: ProfileId, rank: Annotated[int, Path(ge=0, le=65535)],
                     store: StoreDep, supervisor: SupervisorDep, caller: CallerDep) -> StreamingResponse:
    """One rank's trace of one request, as written (open it in https://ui.perfetto.dev or TensorBoard)."""
    caller.check_owns(store.get_job(job_id))
    location = storage.join(_profiles_root(supervisor, job_id), profile_id, f"rank-{rank}.json")
    if not storage.exists(location):
        raise HTTPException(404, f"job {job_id} has no trace of profile {profile_id} by rank {rank} (yet: a rank "
                                 f"writes it once its steps are done); list them with GET /v1/jobs/{job_id}/profiles")

    def chunks() -> Iterator[bytes]:
        with storage.open_file(location, "rb") as f:
            while chunk := f.read(1 << 20):
                yield chunk

    return StreamingResponse(chunks(), media_type="application/json", headers={
        "Content-Disposition": f'attachment; filename="{job_id}-{profile_id}-rank-{rank}.json"'})
