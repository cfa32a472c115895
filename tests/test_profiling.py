"""Profiler traces on request: the runner tells a rank's agent over its liveness port, the agent leaves the request
for its training process, which records the next N steps with ``torch.profiler`` at its step boundaries and writes
a Chrome trace to the job's folder. Bad requests are clear 4xx. The slow test profiles 3 steps of rank 0 of a job
on a Ray cluster through the REST API and downloads a valid Chrome trace with the steps' ops in it."""

from __future__ import annotations

import json
import time

import pytest
import torch
from fakes import spec, submit

from meridian.service.jobs import JobState, JobStatus
from meridian.service.runner.membership import Member
from meridian.service.runner.profiling import NoSuchRank, deliver, profile_targets
from meridian.workers.elastic.liveness import LivenessListener, parse_profile, profile_message
from meridian.workers.elastic.profile_request import take_request, write_request
from meridian.workers.elastic.profiling import StepProfiler, trace_location
from meridian.workers.loop.observe import StepTimes, computed_beat, heartbeat


def test_the_profile_message_carries_only_an_id_of_hex_digits_and_a_bounded_step_count():
    assert parse_profile(profile_message("0a1b2c3d4e5f", 3)) == ("0a1b2c3d4e5f", 3)
    for bad in (b"profile ../../etc 3\n", b"profile abc 0\n", b"profile abc 1001\n", b"profile abc x\n",
                b"abort 3\n", b"profile abc\n", b""):
        assert parse_profile(bad) is None, bad


def test_a_request_is_taken_once(tmp_path):
    write_request(str(tmp_path), "abc", 2)
    write_request(str(tmp_path), "def", 4)  # a newer one replaces one not taken yet
    assert take_request(str(tmp_path)) == ("def", 4)
    assert take_request(str(tmp_path)) is None and list(tmp_path.iterdir()) == []


def _members(n: int, port: int = 0) -> tuple[Member, ...]:
    return tuple(Member(worker_id=f"w{i}", datacenter="dc-a", node_id="n", address="127.0.0.1", joined_at=0.0,
                        probe_port=port) for i in range(n))


def test_the_ranks_asked_for_must_be_in_the_current_epoch():
    assert [r for r, _ in profile_targets(_members(4), [3, 0, 3])] == [0, 3]
    with pytest.raises(NoSuchRank, match=r"ranks \[4, 9\] are not in the job's current epoch, which has ranks 0-3"):
        profile_targets(_members(4), [0, 4, 9])
    with pytest.raises(NoSuchRank, match="not formed its first epoch"):
        profile_targets((), [0])


def _train_steps(profiler: StepProfiler, model, opt, first: int, count: int) -> None:
    """What a rank's loop does per step, with its heartbeats (a computed one, then a done one; ``step``: the
    steps done once it ends, as the loop's heartbeats count them)."""
    for step in range(first, first + count):
        x = torch.randn(8, 32)
        loss = model(x).pow(2).mean()
        loss.backward()
        profiler.beat(computed_beat(0, step))
        opt.step()
        opt.zero_grad()
        profiler.beat(heartbeat(0, step, StepTimes(0.01, 0.0, 0.0)))


def test_a_request_sent_to_an_agents_port_becomes_a_trace_of_the_next_steps(tmp_path):
    request_dir, job_dir = str(tmp_path / "worker"), str(tmp_path / "job")
    listener = LivenessListener(on_profile=lambda rid, steps: write_request(request_dir, rid, steps))
    events: list[tuple] = []
    profiler = StepProfiler(request_dir, job_dir, lambda *e: events.append(e), poll_s=0.02)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        opt = torch.optim.AdamW(model.parameters())
        _train_steps(profiler, model, opt, 1, 2)
        delivery = deliver(_members(2, listener.port), "00aa11bb22cc", 3, [0])
        assert delivery.told == (0,) and delivery.world_size == 2
        time.sleep(0.2)  # the watch takes the request
        _train_steps(profiler, model, opt, 3, 5)
        deadline = time.monotonic() + 30
        while not any(e[0] == "profile_captured" for e in events):
            assert time.monotonic() < deadline, events
            time.sleep(0.05)
    finally:
        profiler.close()
        listener.close()
    kinds = [e[0] for e in events]
    assert kinds == ["profile_started", "profile_captured"], events
    captured = events[1][2]
    # Taken before step 3 ended: started at that boundary, it records steps 4-6.
    assert (captured["from_step"], captured["to_step"]) == (4, 6)
    with open(trace_location(job_dir, "00aa11bb22cc", 0)) as f:
        trace = json.load(f)
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"step 4", "step 5", "step 6"} <= names and "step 7" not in names and "step 3" not in names
    assert "aten::addmm" in names and any("Backward" in (n or "") for n in names)


# -- bad requests through the API -------------------------------------------------------------------------
@pytest.fixture
def api(store, supervisor, cluster_view):
    from fakes import FakeService
    from fastapi.testclient import TestClient

    from meridian.api.app import create_app

    service = FakeService(store, supervisor, cluster_view)
    with TestClient(create_app(service.config, service=service), base_url="http://127.0.0.1") as c:
        yield c


def test_bad_profile_requests_are_clear_4xx(supervisor, store, api):
    job_id = submit(supervisor)
    r = api.post(f"/v1/jobs/{job_id}/profile", json={"steps": 3})
    assert r.status_code == 409 and "not training yet" in r.json()["detail"]
    store.set_status(job_id, JobStatus(JobState.PLACING, "Placing", ""))
    store.set_status(job_id, JobStatus(JobState.RUNNING, "Running", ""))
    r = api.post(f"/v1/jobs/{job_id}/profile", json={"steps": 0, "ranks": [0]})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "steps"
    r = api.post(f"/v1/jobs/{job_id}/profile", json={"steps": 3, "ranks": [0, 7]})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "ranks"
    assert "ranks [7] are not ranks of job" in r.json()["detail"]
    r = api.post(f"/v1/jobs/{job_id}/profile", json={"steps": 3, "ranks": [-1]})
    assert r.status_code == 422 and r.json()["errors"][0]["field"].startswith("ranks")
    store.set_status(job_id, JobStatus(JobState.SUCCEEDED, "Succeeded", ""))
    r = api.post(f"/v1/jobs/{job_id}/profile", json={"steps": 3})
    assert r.status_code == 409 and "already succeeded" in r.json()["detail"]
    assert api.get(f"/v1/jobs/{job_id}/profiles").json()["traces"] == []
    r = api.get(f"/v1/jobs/{job_id}/profiles/00aa11bb22cc/ranks/0")
    assert r.status_code == 404 and "no trace of profile 00aa11bb22cc by rank 0" in r.json()["detail"]
    assert api.get(f"/v1/jobs/{job_id}/profiles/..%2Fx/ranks/0").status_code in (404, 422)
    assert api.post("/v1/jobs/nosuchjob/profile", json={"steps": 3}).status_code == 404


# -- through the service, on an embedded Ray cluster -------------------------------------------------------
@pytest.mark.slow
def test_a_profile_of_three_steps_on_rank_0_downloads_as_a_chrome_trace_with_the_steps_ops(tmp_path, monkeypatch,
                                                                                          capsys, two_nodes):
    from ray_env import service_client

    from meridian.cli.main import main as cli_main

    with service_client(two_nodes.address, str(tmp_path / "data")) as api:
        body = spec(name="profiled", training={"steps": 400, "global_batch": 4, "micro_batch": 2},
                    topology={"datacenters": ["dc-a", "dc-b"]})
        r = api.post("/v1/jobs", json=body)
        assert r.status_code == 201, r.text
        job_id, deadline = r.json()["id"], time.monotonic() + 240
        while (job := api.get(f"/v1/jobs/{job_id}").json())["progress"]["step"] < 3:
            assert job["state"] in ("queued", "placing", "running"), job["message"]
            assert time.monotonic() < deadline, f"job did not reach step 3 in 240 s: {job['state']}"
            time.sleep(0.3)
        monkeypatch.setenv("MERIDIAN_URL", str(api.base_url))
        code = cli_main(["profile", job_id, "--steps", "3", "--rank", "0", "--out", str(tmp_path / "traces"),
                         "--timeout", "120", "--json"])
        out = capsys.readouterr().out
        assert code == 0, out
        result = json.loads(out.splitlines()[-1])
        assert result["told"] == [0] and [f["rank"] for f in result["files"]] == [0]
        with open(result["files"][0]["file"]) as f:
            trace = json.load(f)
        listed = api.get(f"/v1/jobs/{job_id}/profiles").json()["traces"]
        events = api.get(f"/v1/jobs/{job_id}/events").json()["events"]
        api.delete(f"/v1/jobs/{job_id}")
    assert [(t["id"], t["rank"]) for t in listed] == [(result["id"], 0)]
    captured = next(e["data"] for e in events if e["kind"] == "profile_captured")
    steps = [f"step {s}" for s in range(captured["from_step"], captured["to_step"] + 1)]
    names = [e.get("name") for e in trace["traceEvents"]]
    assert len(steps) == 3 and all(names.count(s) == 1 for s in steps), steps
    assert "aten::addmm" in names or "aten::mm" in names
    assert any("Backward" in (n or "") for n in names)
