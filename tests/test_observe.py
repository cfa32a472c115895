"""Metrics and diagnostics without Ray: the runner's metric fold, the runner naming a silent rank (the liveness
judge's own rules are tabled in test_liveness_judge.py), the supervisor's stall events, the service's Prometheus
/metrics, and the data/compute split in step records."""

from __future__ import annotations

import pytest
from fakes import spec, step_record
from fastapi.testclient import TestClient

from meridian.api.app import create_app
from meridian.service.jobs import JobState
from meridian.service.runner.liveness.judge import Beat, Cause, Liveness, Verdict
from meridian.service.runner.metrics import JobMetricsState, _key
from meridian.workers.contracts.events import EventKind, JobEvent
from meridian.workers.contracts.model_config import model_preset
from meridian.workers.loop.observe import DevicePeak, StepTimes, measure_peak_flops, mfu


def beat(rank, step, t, step_s=1.0, data_s=0.1, sync=0.2):
    times = StepTimes(step_s, data_s, sync)
    return {"rank": rank, "step": step, "step_s": step_s, "data_s": data_s, "compute_s": times.compute_s,
            "sync_wait_s": sync, "time": t}


# -- the runner names a silent rank once ----------------------------------------------------------------
class _Clock:
    """``time`` for the runner module: a wall clock the test moves."""

    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now


def _runner_with_two_ranks(monkeypatch, clock):
    from fakes import job_runner

    import meridian.service.runner.actor as actor_module
    import meridian.service.runner.reports as reports_module
    from meridian.workers.contracts.rendezvous import JoinRequest

    class NoExport:
        def export(self, _state):
            pass

    monkeypatch.setattr(reports_module, "time", clock)
    monkeypatch.setattr(actor_module, "time", clock)
    r = job_runner(NoExport())
    for rank, dc in ((0, "dc-a"), (1, "dc-b")):  # the two members form the first epoch: ranks 0 and 1
        r.push_event("worker_started", "", {"rank": rank, "node_id": f"node-{dc}", "datacenter": dc})
        r.coordinator.join(JoinRequest(worker_id=f"w{rank}", datacenter=dc, node_id=f"node-{dc}", address="10.0.0.1",
                                       port=29500 + rank), poll_s=0)  # fmt: skip
    assert r.coordinator.epoch is not None and len(r.coordinator.epoch.members) == 2
    return r


NODES = {"node-dc-a", "node-dc-b"}


def test_the_runner_names_one_stall_per_rank_and_step_and_the_supervisor_stores_it(store, supervisor, monkeypatch):
    clock = _Clock(80.0)
    r = _runner_with_two_ranks(monkeypatch, clock)
    r.push_heartbeats([beat(0, 2, 0.0), beat(1, 2, 0.0)])  # stamped 80.0 on arrival
    clock.now = 100.0
    r.push_heartbeats([beat(0, 5, 0.0)])  # rank 0 goes on; rank 1 last finished step 2 at 80.0
    clock.now = 100.5
    r._judge_ranks(NODES)  # the runner's tick
    first = r.poll(0)
    stalls = [e for e in first.events if e.kind is EventKind.STALL]
    assert [(e.payload.rank, e.payload.step, e.payload.node_id, e.payload.datacenter) for e in stalls] == [
        (1, 2, "node-dc-b", "dc-b")]
    assert stalls[0].payload.silent_s == pytest.approx(20.5) and "rank 1 in dc-b on node node-dc-b" in stalls[0].message
    assert [s.rank for s in first.stalls] == [1]
    clock.now = 101.0
    r._judge_ranks(NODES)
    again = r.poll(first.cursor)
    assert not [e for e in again.events if e.kind is EventKind.STALL] and [s.rank for s in again.stalls] == [1]

    # The supervisor stores what the poll brings: the one stall event, once.
    job, _ = supervisor.submit(*_request())
    supervisor.tick()
    fake = supervisor.launcher.runners[job.id]
    fake.state = "running"
    fake.push("event", stalls[0])
    supervisor.tick()
    supervisor.tick()
    stored = [e for e in store.list_events(job.id) if e.kind == "stall"]
    assert len(stored) == 1 and stored[0].data["rank"] == 1 and stored[0].data["silent_s"] == pytest.approx(20.5)


def _request():
    from meridian.api.schemas import JobSpec

    s = JobSpec.model_validate(spec())
    return s.to_request(), s.model_dump(mode="json")


# -- the runner's metric fold -----------------------------------------------------------------------------
def test_metric_state_tags_job_and_datacenter_and_splits_step_time():
    m = JobMetricsState("j1")
    for rank, dc in ((0, "dc-a"), (1, "dc-a"), (2, "dc-b")):
        m.on_event(JobEvent.of("worker_started", "", {"rank": rank, "datacenter": dc, "node_id": f"n{rank}"}))
    rec = step_record(1, 10, 2.5, step_s=0.5, inter_dc_bytes=1000, data_s=0.05, compute_s=0.3, comm_s=0.2,
                      mfu=0.25, overlap_fraction=0.4, comm_intra_dc_s=0.05, comm_inter_dc_s=0.15)
    m.on_record(rec)
    m.on_heartbeat({"rank": 0, "phase": "computed", "step": 1, "time": 9.5})
    m.on_heartbeat(beat(0, 1, 10.0, step_s=1.0, data_s=0.1))
    m.on_heartbeat({"rank": 2, "phase": "computed", "step": 2, "time": 11.0})
    m.on_heartbeat(beat(1, 1, 10.0, step_s=2.0, data_s=0.3))
    m.on_heartbeat(beat(2, 1, 10.0, step_s=4.0, data_s=0.5, sync=0.5))
    m.on_event(JobEvent.of("worker_lost", "", {"worker_id": "w2", "datacenter": "dc-b", "node_id": "n2"}))
    m.refresh_live([_verdict(0, "dc-a", Liveness.STUCK), _verdict(1, "dc-a", Liveness.DEAD),
                    _verdict(2, "dc-b", Liveness.ALIVE)])  # fmt: skip
    gauges, counts, obs = m.drain()
    assert gauges[_key("meridian_job_loss", job_id="j1", datacenter="all")] == 2.5
    assert gauges[_key("meridian_job_inter_dc_bytes_per_second", job_id="j1", datacenter="all")] == 2000
    assert gauges[_key("meridian_job_mfu", job_id="j1", datacenter="all")] == 0.25
    assert gauges[_key("meridian_job_step_seconds", job_id="j1", datacenter="dc-a")] == 1.5
    assert gauges[_key("meridian_job_comm_seconds", job_id="j1", datacenter="all", tier="inter_dc")] == 0.15
    assert gauges[_key("meridian_job_step_phase_seconds", job_id="j1", datacenter="dc-a", phase="data")] == pytest.approx(0.2)
    assert gauges[_key("meridian_job_step_phase_seconds", job_id="j1", datacenter="dc-b", phase="compute")] == pytest.approx(3.0)
    assert gauges[_key("meridian_job_live_workers", job_id="j1", datacenter="dc-a")] == 0
    assert gauges[_key("meridian_job_live_workers", job_id="j1", datacenter="dc-b")] == 1
    assert counts == {_key("meridian_job_steps_total", job_id="j1", datacenter="all"): 1,
                      _key("meridian_job_recoveries_total", job_id="j1", datacenter="dc-b"): 1}
    assert obs == [(_key("meridian_job_step_duration_seconds", job_id="j1", datacenter="all"), 0.5)]
    m.refresh_live([_verdict(0, "dc-a", Liveness.ALIVE), _verdict(1, "dc-a", Liveness.SLOW),
                    _verdict(2, "dc-b", Liveness.ALIVE), _verdict(None, "dc-b", Liveness.ALIVE)])  # a newcomer: no member
    gauges, counts, obs = m.drain()
    assert gauges[_key("meridian_job_live_workers", job_id="j1", datacenter="dc-a")] == 2
    assert gauges[_key("meridian_job_live_workers", job_id="j1", datacenter="all")] == 3
    assert counts == {} and obs == []  # increments are handed over once
    assert m.beats()[2] == Beat(step=1, computed=2, at=11.0, compute_s=(3.0,))
    b0 = m.beats()[0]
    assert (b0.step, b0.computed, b0.at) == (1, 1, 10.0) and b0.compute_s == pytest.approx((0.7,))


def _verdict(rank, dc, liveness):
    return Verdict(worker_id=f"w{rank}", rank=rank, node_id="n", datacenter=dc, epoch=1, liveness=liveness,
                   cause=Cause.TRAINING, reason="")


# -- worker-side figures ----------------------------------------------------------------------------------
def test_step_times_and_mfu():
    t = StepTimes(step_s=1.0, data_s=0.25, sync_wait_s=0.5)
    assert t.compute_s == 0.25
    assert StepTimes(0.1, 0.2, 0.3).compute_s == 0.0
    assert mfu(600, 100.0, 2, DevicePeak(flops=1e5, source="x")) == pytest.approx(0.3)
    assert mfu(600, 100.0, 2, None) is None


def test_measured_peak_is_positive_and_says_how():
    peak = measure_peak_flops(__import__("torch").device("cpu"), n=128, bursts=2, burst_s=0.01)
    assert peak.flops > 1e6 and "matmul on cpu" in peak.source


def test_records_split_data_and_compute_time():
    from meridian.workers.distributed.multiproc import run_processes

    (records,) = run_processes(_train_records, 1, timeout_s=300)
    assert len(records) == 3
    for r in records:
        assert r.data_s > 0 and r.compute_s > 0
        assert r.data_s + r.compute_s + r.sync_wait_s == pytest.approx(r.step_s, rel=1e-6)
        # MFU is relative to the matmul peak measured on this (shared, noisy) machine: check the arithmetic.
        assert "matmul" in r.peak_source and r.peak_flops > 0
        assert r.mfu == pytest.approx(r.tokens_per_s * model_preset("nano").flops_per_token / r.peak_flops)


class _BeatSink:
    def __init__(self):
        self.records, self.beats = [], []

    def step(self, record):
        self.records.append(record)

    def rank_step(self, b):
        self.beats.append(b)


def _train_records(rank, world):
    from meridian.workers.contracts.config import TrainConfig
    from meridian.workers.contracts.model_config import model_preset
    from meridian.workers.loop.train import train

    sink = _BeatSink()
    train(TrainConfig(job_id="o", model=model_preset("nano"), steps=3, global_batch=2, micro_batch=2), sink=sink)
    assert [(b["phase"], b["step"]) for b in sink.beats] == [
        ("computed", 1), ("done", 1), ("computed", 2), ("done", 2), ("computed", 3), ("done", 3)]
    assert all(b["rank"] == 0 for b in sink.beats)
    return sink.records


# -- the service's Prometheus /metrics --------------------------------------------------------------------
class _Svc:
    def __init__(self, store, supervisor, view):
        from meridian.service.core import ServiceConfig

        self.config = ServiceConfig(data_dir="/tmp")
        self.store, self.supervisor, self._view, self.probe_cache = store, supervisor, view, None

    def topology(self):
        return self._view()


def test_service_metrics_count_requests_queue_and_states(store, supervisor, cluster_view):
    svc = _Svc(store, supervisor, cluster_view)
    with TestClient(create_app(svc.config, service=svc), base_url="http://127.0.0.1") as c:
        for _ in range(2):
            assert c.post("/v1/jobs", json=spec()).status_code == 201
        assert c.get("/v1/jobs/nope").status_code == 404
        text = c.get("/metrics").text
    assert "meridian_service_queue_length 2.0" in text
    assert 'meridian_service_jobs{state="queued"} 2.0' in text and 'meridian_service_jobs{state="running"} 0.0' in text
    assert 'meridian_service_http_requests_total{method="POST",route="/v1/jobs",status="201"} 2.0' in text
    assert 'meridian_service_http_requests_total{method="GET",route="/v1/jobs/{job_id}",status="404"} 1.0' in text
    assert store.count_by_state()[JobState.QUEUED] == 2


def test_cli_progress_bar_shows_eta_and_where_the_step_went():
    from meridian.cli.render import progress_line

    job = {"state": "running", "message": "", "progress": {
        "step": 30, "total_steps": 120, "loss": 2.5, "tokens_per_s": 5000.0, "eta_s": 95.0, "step_s": 0.5,
        "data_s": 0.2, "compute_s": 0.25, "mfu": 0.123}}
    line = progress_line(job, width=12)
    assert line.startswith("[###.........] step 30/120  loss 2.500  5.0k tok/s  ETA 1:35")
    assert line.endswith("data 40% compute 50%  MFU 12.3%")


def test_supervisor_progress_keeps_the_split_and_a_smoothed_eta():
    from meridian.service.supervision.reconcile import fold_progress

    recs = [step_record(s, 10, 3.0, step_s=st, data_s=0.1, compute_s=0.3, mfu=0.2) for s, st in ((1, 1.0), (2, 0.5))]
    p = fold_progress(None, recs, cursor=2)
    assert p["step_s_ema"] == pytest.approx(0.9)  # 0.8 * 1.0 + 0.2 * 0.5
    assert p["eta_s"] == pytest.approx(8 * 0.9) and p["data_s"] == 0.1 and p["mfu"] == 0.2


def _har_records(rank, world):
    from meridian.workers.contracts.config import SyncConfig, SyncStrategy, TrainConfig
    from meridian.workers.contracts.model_config import model_preset
    from meridian.workers.loop.train import ListSink, train

    sink = ListSink()
    cfg = TrainConfig(job_id="h", model=model_preset("nano"), steps=3, global_batch=4, micro_batch=2,
                      datacenters=("a", "a", "b", "b"), sync=SyncConfig(strategy=SyncStrategy("hierarchical")))
    train(cfg, sink=sink)
    return sink.records


def test_hierarchical_records_split_sync_time_by_tier():
    from meridian.workers.distributed.multiproc import run_processes

    records = run_processes(_har_records, 4, timeout_s=300)[0]
    for r in records:
        assert r.comm_intra_dc_s > 0 and r.comm_inter_dc_s >= 0
        assert r.comm_intra_dc_s + r.comm_inter_dc_s == pytest.approx(r.comm_s, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("idle", ["waiting", "finished"])
def test_no_stall_is_named_while_the_job_waits_or_after_its_last_step(monkeypatch, idle):
    # Ranks are idle by design then: below min_workers, mid re-formation, or done and shutting down.
    clock = _Clock(80.0)
    r = _runner_with_two_ranks(monkeypatch, clock)
    r.push_heartbeats([beat(0, 5, 0.0)])
    if idle == "waiting":
        r.coordinator.wait_reason = "2 worker(s) left after losing 1; the job needs at least 3 (topology.min_workers)"
    else:
        r.coordinator.finished.add("w0")
    clock.now = 100.5
    r._judge_ranks(NODES)
    poll = r.poll(0)
    assert not [e for e in poll.events if e.kind is EventKind.STALL] and poll.stalls == ()
