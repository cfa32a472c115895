"""Fakes of Ray-facing pieces, so the control plane is tested tick by tick without a cluster."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from meridian.service.cluster.topology import ClusterTopology, NodeInfo
from meridian.service.runner.placement import PlacementTracker
from meridian.service.runner.poll import RunnerLost, RunnerPoll, RunnerState
from meridian.workers.contracts.events import JobEvent
from meridian.workers.contracts.records import StepRecord
from meridian.workers.contracts.rendezvous import Assignment


def node(node_id: str, dc: str | None, *, cpus: float = 1, gpus: float = 0, alive: bool = True,
         free_cpus: float | None = None, free_gpus: float | None = None) -> NodeInfo:
    return NodeInfo(
        node_id=node_id, datacenter=dc, alive=alive, address="127.0.0.1", is_head=dc is None, cpus=cpus,
        gpus=gpus, memory_bytes=2**30, available_cpus=cpus if free_cpus is None else free_cpus,
        available_gpus=gpus if free_gpus is None else free_gpus,
        labels={"datacenter": dc} if dc else {},
    )


def topology(**dcs: int) -> ClusterTopology:
    """``topology(dc_a=2, dc_b=2)`` → nodes n-dc-a-0 … with one CPU each (underscores become dashes)."""
    nodes = [node("head", None, cpus=0)]
    for name, count in dcs.items():
        dc = name.replace("_", "-")
        nodes += [node(f"n-{dc}-{i}", dc) for i in range(count)]
    return ClusterTopology(tuple(nodes))


@dataclass
class FakeRunner:
    state: str = "starting"  # a RunnerState value (tests set the plain word)
    error: str = ""
    result: dict[str, Any] | None = None
    items: list[tuple[int, str, Any]] = field(default_factory=list)  # (seq, "record"|"event", StepRecord|dict)
    cancelled: bool = False
    suspending: bool = False
    suspended_step: int | None = None
    wait_reason: str = ""
    finished: bool = False

    stalls: tuple[Any, ...] = ()  # StallSeen, as JobRunner.poll judges them now
    placement: PlacementTracker = field(default_factory=PlacementTracker)

    def push(self, kind: str, data: Any) -> None:
        """``("record", StepRecord)``, or ``("event", {"kind", "message", "data", "time"})`` in the wire form a
        worker sends (typed here, as ``JobRunner.push_event`` does), or ``("event", JobEvent)``."""
        if kind == "event" and not isinstance(data, JobEvent):
            data = JobEvent.of(data["kind"], data.get("message", ""), data.get("data"), at=data.get("time"))
        if kind == "event":
            self.placement.observe(data)
        self.items.append((len(self.items) + 1, kind, data))


class FakeLauncher:
    def __init__(self) -> None:
        self.runners: dict[str, FakeRunner] = {}
        self.launched: list[tuple[str, Any, Any]] = []
        self.released: list[str] = []
        self.resumed: list[str] = []
        self.cancels: list[str] = []  # every cancel asked for, delivered or not
        self.suspends: list[str] = []  # every suspension asked for
        self.swept: list[str] = []  # jobs whose snapshot folders were to be removed on every node
        self.on_launch: Any = None  # called with the job id before the runner exists (to step a race)
        self.launch_error: Exception | None = None  # raised after the runner was created (a start timeout)
        self.poll_errors: dict[str, Exception] = {}  # job id → raised by its polls (a runner that does not answer)

    def launch(self, job_id: str, config: Any, plan: Any, *, min_workers: int = 1) -> str:
        if self.on_launch is not None:
            self.on_launch(job_id)
        self.runners[job_id] = FakeRunner()
        self.launched.append((job_id, config, plan))
        if self.launch_error is not None:
            raise self.launch_error
        return f"meridian-job-{job_id}"

    def sweep_snapshots(self, job_id: str, after_s: float = 0.0) -> None:
        self.swept.append(job_id)

    def poll(self, job_id: str, after: int) -> RunnerPoll:
        if job_id in self.poll_errors:
            raise self.poll_errors[job_id]
        r = self.runners.get(job_id)
        if r is None:
            raise RunnerLost(job_id)
        return RunnerPoll(
            state=RunnerState(r.state), error=r.error, result=r.result,
            records=tuple(d for s, k, d in r.items if k == "record" and s > after),
            events=tuple(d for s, k, d in r.items if k == "event" and s > after),
            cursor=len(r.items), wait_reason=r.wait_reason, finished=r.finished,
            placement=r.placement.ranks, stalls=tuple(r.stalls), suspended_step=r.suspended_step,
        )

    def resume(self, job_id: str) -> None:
        if job_id not in self.runners:
            raise RunnerLost(job_id)
        self.resumed.append(job_id)

    def cancel(self, job_id: str) -> None:
        self.cancels.append(job_id)
        if job_id in self.runners:
            self.runners[job_id].cancelled = True

    def suspend(self, job_id: str) -> None:
        self.suspends.append(job_id)
        if job_id in self.runners:
            self.runners[job_id].suspending = True

    def release(self, job_id: str) -> None:
        self.released.append(job_id)
        self.runners.pop(job_id, None)

    def exists(self, job_id: str) -> bool:
        return job_id in self.runners


def raw_event(store: Any, job_id: str, kind: str, message: str, data: dict[str, Any] | None = None) -> int:
    """An event row written as an older version of the service could have (any kind, any data), straight into
    the table: what readers of stored events must still handle."""
    import json
    import time

    from meridian.service.store import JobStore

    with store.engine.begin() as conn:
        return JobStore._insert_events(conn, [dict(job_id=job_id, time=time.time(), kind=kind, message=message,
                                                   data=json.dumps(data or {}))])[0]


def step_record(step: int, total: int, loss: float, **fields: Any) -> StepRecord:
    """What rank 0 pushes after a step; ``fields`` override any other field (``time=...``, ``data_s=...``)."""
    return StepRecord(**{"step": step, "total_steps": total, "loss": loss, "lr": 1e-3, "step_s": 0.1,
                         "tokens_per_s": 1000.0, "grad_norm": 1.0, "inter_dc_bytes": 100, "sync_wait_s": 0.0,
                         "time": 1000.0 + step, **fields})


def spec(**overrides: Any) -> dict[str, Any]:
    """A small valid job spec (JSON form)."""
    s: dict[str, Any] = {"name": "t", "model": {"preset": "nano"},
                         "training": {"steps": 4, "global_batch": 4, "micro_batch": 2}}
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(s.get(key), dict):
            s[key] = {**s[key], **value}
        else:
            s[key] = value
    return s


def submit(supervisor: Any, owner: str = "", **fields: Any) -> str:
    """Submit :func:`spec` (with ``fields``) for ``owner`` straight to the supervisor; the job's id."""
    from meridian.api.schemas import JobSpec

    s = JobSpec.model_validate(spec(**fields))
    return supervisor.submit(s.to_request(owner), s.model_dump(mode="json"))[0].id


class FakeService:
    """What the API needs of a :class:`~meridian.service.core.MeridianService`, over a real store and
    supervisor but a fake cluster, launcher and worker logs (``logs[(rank, stream)]`` = lines so far)."""

    def __init__(self, store: Any, supervisor: Any, cluster_view: Any) -> None:
        from meridian.service.core import ServiceConfig

        self.config = ServiceConfig(data_dir="/tmp")
        self.store, self.supervisor, self._view = store, supervisor, cluster_view
        self.logs: dict[tuple[int, str], list[str]] = {}
        self.probe_cache = None  # no collective benchmark has run
        self.probes: list[tuple[tuple[str, ...], int]] = []

    def probe_links(self, tiers: tuple[str, ...], max_bytes: int) -> dict[str, Any]:
        """A collective benchmark that measured a 21 ms RTT, 0.62 Gbit/s inter-DC link (no actors run)."""
        self.probes.append((tiers, max_bytes))
        summary = {"latency_us": 10_500.0, "bandwidth_gbps": 0.62}
        return {"measured_at": 0.0, "skipped": [], "tiers": [
            {"tier": t, "nodes": ["n1", "n2"], "datacenters": ["dc-a", "dc-b"], "summary": summary, "rows": []}
            for t in tiers]}

    def probe_compute(self, request: Any) -> dict[str, Any]:
        """A compute probe that measured 2 and 3 GFLOP/s on two slots (no actors run)."""
        self.probes.append((("compute", request.model.d_model), request.micro_batch))
        return {"key": f"d{request.model.d_model}-b{request.micro_batch}", "slots": 2, "measured_at": 0.0,
                "flops": 2.5e9, "optimizer_step_s": 0.004, "per_slot_flops": [2e9, 3e9]}

    def topology(self) -> ClusterTopology:
        return self._view()

    def read_logs(self, placement: list[dict[str, Any]], offsets: dict[str, int] | None, *, tail_bytes: int,
                  ranks: set[int] | None = None) -> tuple[list[Any], dict[str, int]]:
        from meridian.service.cluster.logs import LogEntry

        offsets = dict(offsets or {})
        entries = []
        for p in placement:
            for stream in ("out", "err"):
                key, lines = f"{p['rank']}:{stream}", self.logs.get((p["rank"], stream), [])
                if ranks is None or p["rank"] in ranks:
                    entries += [LogEntry(p["rank"], stream, line) for line in lines[offsets.get(key, 0):]]
                    offsets[key] = len(lines)
        return entries, offsets


def join_concurrently(coord, requests, known_epoch=0, *, poll_s=0.2, polls=100):
    """Each join request polls ``coord.join`` from its own thread until it gets an assignment (at most ``polls``
    polls, so a test that fails never leaves a thread behind). Returns the started threads and the
    assignments by worker id, filled in as they come."""
    out: dict[str, Assignment] = {}

    def go(r):
        for _ in range(polls):
            a = coord.join(r, known_epoch=known_epoch, poll_s=poll_s)
            if isinstance(a, Assignment):
                out[r.worker_id] = a
                return

    threads = [threading.Thread(target=go, args=(r,)) for r in requests]
    for t in threads:
        t.start()
    return threads, out


def job_runner(exporter: Any) -> Any:
    """A JobRunner of a two-datacenter plan, outside Ray, exporting its metrics to ``exporter``."""
    from meridian.service.runner.actor import JobRunner

    plan = type("P", (), {"rank_datacenters": ("dc-a", "dc-b")})()
    r = JobRunner("j1", {}, plan, "/tmp/unused")
    r._reports._exporter = exporter
    return r
