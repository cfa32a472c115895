"""The control plane through HTTP against fakes: auth and owners, queue order, event streams with resume,
worker logs, restart reattach, size limits. The supervisor is ticked by hand, so every step is exact."""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import replace

import httpx
import pytest
from conftest import TopologyBox
from fakes import FakeLauncher, FakeService, spec, step_record, topology
from fastapi.testclient import TestClient

from meridian.api.app import create_app
from meridian.api.auth import (
    AuthSettings,
    UnsafeDeployment,
    check_bind,
    create_token,
    hash_token,
    read_tokens,
)
from meridian.api.client import Client, parse_sse
from meridian.api.server import serve_in_thread
from meridian.cli.main import main as cli_main
from meridian.service.cluster.topology import ClusterTopology
from meridian.service.store import JobStore
from meridian.service.supervision.supervisor import Supervisor


def app_for(service, **options):
    return create_app(service.config, service=service, **options)


@pytest.fixture
def fake(store, supervisor, cluster_view):
    return FakeService(store, supervisor, cluster_view)


@pytest.fixture
def client(fake):
    with TestClient(app_for(fake), base_url="http://127.0.0.1") as c:
        yield c


def run_job_to(supervisor, job_id, *, steps, total, state="running"):
    """Drive the fake runner of a launched job: workers start, ``steps`` records, then ``state``."""
    runner = supervisor.launcher.runners[job_id]
    for rank, dc in enumerate(("dc-a", "dc-a", "dc-b", "dc-b")):
        runner.push("event", {"kind": "worker_started", "message": f"rank {rank}", "time": time.time(),
                              "data": {"rank": rank, "node_id": f"n-{dc}-{rank % 2}", "datacenter": dc, "pid": 100 + rank}})
    runner.state = "running"
    for step in range(1, steps + 1):
        runner.push("record", step_record(step, total, 5.0 - 0.1 * step, time=time.time()))
    if state != "running":
        runner.state = state
        runner.result = {"first_loss": 4.9, "final_loss": 5.0 - 0.1 * steps}
    return runner


# -- auth ---------------------------------------------------------------------------------------------------
@pytest.fixture
def tokens(tmp_path):
    path = tmp_path / "tokens.json"
    return path, {"alice": create_token(path, "alice"), "bob": create_token(path, "bob")}


@pytest.fixture
def auth_client(fake, tokens):
    path, _ = tokens
    with TestClient(app_for(fake, auth=AuthSettings.load(enabled=True, token_file=str(path)))) as c:
        yield c


def bearer(token):
    return {"Authorization": f"Bearer {token}"}


def test_token_file_holds_only_hashes(tokens):
    path, toks = tokens
    text = path.read_text()
    assert toks["alice"] not in text and toks["bob"] not in text
    assert {e.owner: e.hash for e in read_tokens(path)} == {"alice": hash_token(toks["alice"]), "bob": hash_token(toks["bob"])}
    assert len(toks["alice"]) >= 40 and toks["alice"] != toks["bob"]
    assert path.stat().st_mode & 0o077 == 0  # owner-only file


def test_every_endpoint_but_healthz_needs_a_valid_token(auth_client, tokens):
    _, toks = tokens
    assert auth_client.get("/healthz").status_code == 200
    for method, path in (("GET", "/v1/jobs"), ("GET", "/v1/cluster"), ("POST", "/v1/plans"), ("GET", "/v1/jobs/x"),
                         ("GET", "/v1/jobs/x/events"), ("GET", "/v1/jobs/x/logs"), ("GET", "/v1/diagnostics/collectives")):
        r = auth_client.request(method, path, json=spec() if method == "POST" else None)
        assert r.status_code == 401, (path, r.text)
        assert r.headers["www-authenticate"] == "Bearer" and "bearer token" in r.json()["detail"]
        r = auth_client.request(method, path, headers=bearer("mrd_not-a-real-token"))
        assert r.status_code == 401 and "not valid" in r.json()["detail"]
    assert auth_client.get("/v1/jobs", headers={"Authorization": "Basic YWxpY2U6eA=="}).status_code == 401
    assert auth_client.get("/v1/cluster", headers=bearer(toks["alice"])).status_code == 200


def test_jobs_belong_to_their_owner_and_others_get_404_like_a_missing_job(auth_client, tokens, supervisor):
    _, toks = tokens
    alice, bob = bearer(toks["alice"]), bearer(toks["bob"])
    job = auth_client.post("/v1/jobs", json=spec(), headers=alice).json()
    assert job["owner"] == "alice"
    for method, path in (("GET", ""), ("DELETE", ""), ("GET", "/events"), ("GET", "/metrics"), ("GET", "/logs")):
        r = auth_client.request(method, f"/v1/jobs/{job['id']}{path}", headers=bob)
        missing = auth_client.request(method, f"/v1/jobs/000000000000{path}", headers=bob)
        # Issue 19: a 403 told bob the id exists; now another owner's job is indistinguishable from none.
        assert r.status_code == missing.status_code == 404, (path, r.text)
        assert r.json()["detail"].replace(job["id"], "ID") == missing.json()["detail"].replace("000000000000", "ID")
    assert auth_client.get("/v1/jobs", headers=bob).json()["count"] == 0
    assert [j["id"] for j in auth_client.get("/v1/jobs", headers=alice).json()["jobs"]] == [job["id"]]
    # The same Idempotency-Key is per owner: bob's request makes his own job.
    a = auth_client.post("/v1/jobs", json=spec(), headers={**alice, "Idempotency-Key": "k"})
    b = auth_client.post("/v1/jobs", json=spec(), headers={**bob, "Idempotency-Key": "k"})
    assert (a.status_code, b.status_code) == (201, 201) and b.json()["owner"] == "bob"
    assert auth_client.delete(f"/v1/jobs/{job['id']}", headers=alice).json()["state"] == "cancelled"


def test_tokens_never_reach_the_logs(fake, tokens, caplog):
    path, toks = tokens
    caplog.set_level(logging.DEBUG)
    with TestClient(app_for(fake, auth=AuthSettings.load(enabled=True, token_file=str(path)))) as c:
        c.get("/v1/jobs", headers=bearer(toks["alice"]))
        c.get("/v1/jobs", headers=bearer(toks["alice"] + "x"))
        c.post("/v1/jobs", content=b"{", headers={**bearer(toks["alice"]), "content-type": "application/json"})
    assert caplog.records  # something was logged (httpx, fastapi), and none of it holds a token
    assert not any(toks["alice"] in r.getMessage() for r in caplog.records)


def test_non_loopback_bind_refuses_to_start_without_tokens(tmp_path, capsys):
    with pytest.raises(UnsafeDeployment, match="refusing to serve 0.0.0.0 without auth"):
        check_bind("0.0.0.0", AuthSettings())
    check_bind("127.0.0.1", AuthSettings())
    check_bind("::1", AuthSettings())
    with pytest.raises(UnsafeDeployment, match="holds no tokens"):
        AuthSettings.load(enabled=True, token_file=str(tmp_path / "none.json"))
    # `meridian serve` on a public address forces auth on, and stops before starting anything.
    assert cli_main(["serve", "--host", "0.0.0.0", "--token-file", str(tmp_path / "none.json")]) == 2
    assert "holds no tokens" in capsys.readouterr().err
    create_token(tmp_path / "t.json", "ops")
    auth = AuthSettings.load(enabled=True, token_file=str(tmp_path / "t.json"))
    check_bind("10.1.2.3", auth)
    assert list(auth.hashes.values()) == ["ops"]


def test_token_create_cli_prints_a_token_that_works(tmp_path, capsys, fake):
    path = tmp_path / "tokens.json"
    assert cli_main(["token", "create", "--owner", "carol", "--token-file", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["owner"] == "carol" and out["token"] not in path.read_text()
    with TestClient(app_for(fake, auth=AuthSettings.load(enabled=True, token_file=str(path)))) as c:
        assert c.post("/v1/jobs", json=spec(), headers=bearer(out["token"])).json()["owner"] == "carol"
    assert cli_main(["token", "create", "--owner", "bad owner!", "--token-file", str(path)]) == 2


# -- queue ----------------------------------------------------------------------------------------------------
def test_queue_runs_by_priority_then_fifo_and_says_why_jobs_wait(client, supervisor, cluster_view):
    a = client.post("/v1/jobs", json=spec(name="a")).json()["id"]
    b = client.post("/v1/jobs", json=spec(name="b")).json()["id"]
    c = client.post("/v1/jobs", json=spec(name="c", priority=5)).json()["id"]
    free = cluster_view.topo
    busy = ClusterTopology(tuple(replace(n, available_cpus=0) for n in free.nodes))
    order: list[str] = []
    supervisor.tick()
    for _ in range(3):
        (launched,) = [j for j in (a, b, c) if j in supervisor.launcher.runners and j not in order]
        order.append(launched)
        cluster_view.topo = busy  # the running job holds every CPU
        run_job_to(supervisor, launched, steps=2, total=2)
        supervisor.tick()  # placing → running
        supervisor.tick()  # admission looks at the queue again (nothing is admitted while a job is placing)
        waiting = [client.get(f"/v1/jobs/{j}").json() for j in (a, b, c) if j not in order]
        assert all(j["state"] == "queued" for j in waiting)
        if waiting:
            assert waiting[0]["reason"] == "WaitingForCapacity"
            assert waiting[0]["message"] == "waiting for 2 CPUs in dc-a and 2 CPUs in dc-b"
        supervisor.launcher.runners[launched].state = "succeeded"
        cluster_view.topo = free
        supervisor.tick()  # the next job starts by itself once capacity frees up
        assert client.get(f"/v1/jobs/{launched}").json()["state"] == "succeeded"
    assert order == [c, a, b]


def test_concurrent_submissions_lose_nothing(fake):
    with serve_in_thread(fake) as url:
        ids: list[str] = []
        lock = threading.Lock()

        def submit(i):
            r = httpx.post(f"{url}/v1/jobs", json=spec(name=f"j{i}"), timeout=30)
            assert r.status_code == 201, r.text
            with lock:
                ids.append(r.json()["id"])

        threads = [threading.Thread(target=submit, args=(i,)) for i in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        listed = httpx.get(f"{url}/v1/jobs", params={"limit": 100}).json()
    assert len(set(ids)) == 20 and {j["id"] for j in listed["jobs"]} == set(ids)


# -- events -----------------------------------------------------------------------------------------------------
def sse_events(text):
    return [(kind, json.loads(data)) for kind, data in parse_sse(iter(text.splitlines()))]


def test_event_stream_has_ids_and_resumes_after_last_event_id(client, supervisor):
    job_id = client.post("/v1/jobs", json=spec()).json()["id"]
    supervisor.tick()
    runner = run_job_to(supervisor, job_id, steps=3, total=3)
    supervisor.tick()
    runner.state = "succeeded"
    supervisor.tick()
    as_json = client.get(f"/v1/jobs/{job_id}/events").json()["events"]

    r = client.get(f"/v1/jobs/{job_id}/events", headers={"Accept": "text/event-stream"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1][0] == "end" and events[-1][1] == {"state": "succeeded", "last_event_id": as_json[-1]["id"]}
    streamed = [data for kind, data in events[:-1]]
    assert streamed == as_json  # the same events, in the same order
    kinds = [e["kind"] for e in streamed]
    assert kinds.count("worker_started") == 4 and "progress" in kinds
    states = [e["data"]["state"] for e in streamed if e["kind"] == "state"]
    assert states == ["queued", "placing", "running", "succeeded"]
    assert f"id: {as_json[0]['id']}\n" in r.text

    cut = streamed[3]["id"]
    r = client.get(f"/v1/jobs/{job_id}/events", headers={"Accept": "text/event-stream", "Last-Event-ID": str(cut)})
    resumed = [data for kind, data in sse_events(r.text) if kind != "end"]
    assert resumed == streamed[4:]
    assert client.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": "abc"}).status_code == 422


def test_live_event_stream_delivers_while_the_job_runs_and_ends_with_it(fake, supervisor):
    job_id = supervisor.submit(*_req(fake))[0].id
    supervisor.tick()
    got: list[dict] = []
    with serve_in_thread(fake) as url:
        client = Client(url)
        stop = threading.Event()

        def drive():
            runner = supervisor.launcher.runners[job_id]
            runner.state = "running"
            for step in range(1, 6):
                if stop.wait(0.3):
                    return
                runner.push("record", step_record(step, 5, 5.0 - step * 0.1, time=time.time()))
                supervisor._last_progress_event.clear()  # one progress event per step here
                supervisor.tick()
            runner.state = "succeeded"
            supervisor.tick()

        # A first connection reads two events and drops; the client resumes from its last id.
        with httpx.stream("GET", f"{url}/v1/jobs/{job_id}/events", headers={"Accept": "text/event-stream"}) as r:
            first = []
            for _kind, data in parse_sse(r.iter_lines()):
                first.append(json.loads(data))
                if len(first) == 2:
                    break
        driver = threading.Thread(target=drive)
        driver.start()
        try:
            got = first + list(client.stream_events(job_id, after=first[-1]["id"]))
        finally:
            stop.set()
            driver.join()
        stored = client.events(job_id)["events"]
    assert [e["id"] for e in got] == [e["id"] for e in stored]  # nothing lost, nothing twice
    assert [e["data"]["step"] for e in got if e["kind"] == "progress"] == [1, 2, 3, 4, 5]
    assert got[-1]["data"]["state"] == "succeeded"


def _req(fake):
    from meridian.api.schemas import JobSpec

    s = JobSpec.model_validate(spec())
    return s.to_request(), s.model_dump(mode="json")


# -- logs ---------------------------------------------------------------------------------------------------------
def test_logs_of_each_rank_and_follow_until_the_job_ends(client, fake, supervisor):
    job_id = client.post("/v1/jobs", json=spec()).json()["id"]
    assert client.get(f"/v1/jobs/{job_id}/logs").json() == {"job_id": job_id, "lines": []}
    supervisor.tick()
    run_job_to(supervisor, job_id, steps=1, total=2)
    supervisor.tick()
    fake.logs[(0, "out")] = ["step 1 loss 4.9"]
    fake.logs[(2, "err")] = ["warning: slow link"]
    lines = client.get(f"/v1/jobs/{job_id}/logs").json()["lines"]
    assert lines == [{"rank": 0, "stream": "out", "line": "step 1 loss 4.9"},
                     {"rank": 2, "stream": "err", "line": "warning: slow link"}]
    assert client.get(f"/v1/jobs/{job_id}/logs", params={"rank": 2}).json()["lines"] == lines[1:]
    supervisor.launcher.runners[job_id].state = "succeeded"
    supervisor.tick()
    r = client.get(f"/v1/jobs/{job_id}/logs", params={"follow": "true"})
    assert r.headers["content-type"].startswith("application/x-ndjson")
    assert [json.loads(x) for x in r.text.splitlines() if x] == lines
    assert client.get(f"/v1/jobs/{job_id}/logs", params={"tail_kb": -1}).status_code == 422


# -- restart ------------------------------------------------------------------------------------------------------
def test_restarted_service_reattaches_running_jobs_and_fails_lost_ones(tmp_path):
    db = f"sqlite:///{tmp_path / 'jobs.db'}"
    view, launcher = TopologyBox(topology(dc_a=2, dc_b=2)), FakeLauncher()

    def service(launcher, **options):
        store = JobStore(db)
        return FakeService(store, Supervisor(store, launcher, view, checkpoint_root=str(tmp_path), **options), view)

    first = service(launcher)
    with TestClient(app_for(first), base_url="http://127.0.0.1") as c:
        job_id = c.post("/v1/jobs", json=spec(training={"steps": 5})).json()["id"]
        queued_id = c.post("/v1/jobs", json=spec(name="later")).json()["id"]
        first.supervisor.tick()
        run_job_to(first.supervisor, job_id, steps=2, total=5)
        first.supervisor.tick()
        assert c.get(f"/v1/jobs/{job_id}").json()["progress"]["step"] == 2
    first.store.close()  # the service dies; the detached runner (the fake launcher's) keeps training
    runner = launcher.runners[job_id]
    runner.push("record", step_record(3, 5, 4.7))

    second = service(launcher)
    with TestClient(app_for(second), base_url="http://127.0.0.1") as c:
        second.supervisor.tick()
        job = c.get(f"/v1/jobs/{job_id}").json()
        assert job["state"] == "running" and job["progress"]["step"] == 3
        for step in (4, 5):
            runner.push("record", step_record(step, 5, 5.0 - 0.1 * step))
        runner.state, runner.result = "succeeded", {"final_loss": 4.5}
        second.supervisor.tick()
        assert c.get(f"/v1/jobs/{job_id}").json()["state"] == "succeeded"
        assert [p["step"] for p in c.get(f"/v1/jobs/{job_id}/metrics").json()["points"]] == [1, 2, 3, 4, 5]
        events = c.get(f"/v1/jobs/{job_id}/events").json()["events"]
        (reattached,) = [e for e in events if e["kind"] == "reattached"]
        assert reattached["data"]["cursor"] == 6  # 4 worker events + 2 records, stored before the restart
        assert [e["kind"] for e in events].count("worker_started") == 4
        second.supervisor.tick()  # the queued job is launched once, by the new service
        assert c.get(f"/v1/jobs/{queued_id}").json()["state"] == "placing"
        assert [j for j, *_ in launcher.launched] == [job_id, queued_id]
        assert launcher.resumed == []  # the reattached runner was already training
    second.store.close()

    # Killed right after placing the queued job, before its runner was told to start: the next service
    # starts it (once) instead of waiting forever on a runner that never trains.
    assert launcher.runners[queued_id].state == "starting"
    fourth = service(launcher)
    with TestClient(app_for(fourth), base_url="http://127.0.0.1") as c:
        fourth.supervisor.tick()
        assert launcher.resumed == [queued_id] and c.get(f"/v1/jobs/{queued_id}").json()["state"] == "placing"
        fourth.supervisor.tick()
        assert launcher.resumed == [queued_id]
    fourth.store.close()

    # e.g. the Ray cluster was restarted: no runner survived. With relaunches left the job runs again from its
    # checkpoint (admission launches it anew); with none, it fails saying how to resubmit it.
    relaunching = FakeLauncher()
    third = service(relaunching)
    with TestClient(app_for(third), base_url="http://127.0.0.1") as c:
        third.supervisor.tick()
        job = c.get(f"/v1/jobs/{queued_id}").json()
        assert (job["state"], job["reason"]) == ("queued", "Relaunching") and "relaunch 1 of at most 3" in job["message"]
        third.supervisor.tick()
        assert [j for j, *_ in relaunching.launched] == [queued_id]
        assert c.get(f"/v1/jobs/{queued_id}").json()["state"] == "placing"
    third.store.close()
    fifth = service(FakeLauncher(), max_relaunches=1)  # lost again, and one relaunch is all this service allows
    with TestClient(app_for(fifth), base_url="http://127.0.0.1") as c:
        fifth.supervisor.tick()
        job = c.get(f"/v1/jobs/{queued_id}").json()
        assert job["state"] == "failed" and job["reason"] == "RunnerLost" and "resubmit" in job["message"]
        assert "after 1 relaunch(es)" in job["message"]
    fifth.store.close()


# -- limits --------------------------------------------------------------------------------------------------------
def test_oversized_bodies_are_413_before_parsing(client):
    big = b'{"name": "' + b"x" * (2 * 2**20) + b'"}'
    r = client.post("/v1/jobs", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "larger than 1048576 bytes" in r.json()["detail"]
    r = client.post("/v1/jobs", content=iter([big[:2**20], big[2**20:]]), headers={"content-type": "application/json"})
    assert r.status_code == 413  # chunked, no Content-Length
    assert client.get("/v1/jobs").json()["count"] == 0
