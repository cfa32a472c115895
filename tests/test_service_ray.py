"""The service through HTTP against a real local Ray cluster with two labelled datacenters."""

from __future__ import annotations

import time

import pytest
import ray
from fakes import spec
from ray_env import service_client

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def api(four_nodes, tmp_path_factory):  # the cluster is shared with the next module that asks for it
    with service_client(four_nodes.address, str(tmp_path_factory.mktemp("meridian"))) as client:
        yield client


def wait_for(client, job_id, states, timeout_s, seen=None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if seen is not None:
            seen.append(job)
        if job["state"] in states:
            return job
        time.sleep(0.3)
    raise AssertionError(f"job {job_id} not in {states} after {timeout_s} s: {job['state']} {job['message']}")


def test_two_datacenter_job_succeeds_with_workers_in_both_and_lower_loss(api):
    r = api.post("/v1/jobs", json=spec(training={"steps": 40, "global_batch": 8, "micro_batch": 2, "lr": 3e-3}))
    assert r.status_code == 201, r.text
    seen: list[dict] = []
    job = wait_for(api, r.json()["id"], {"succeeded", "failed", "cancelled"}, timeout_s=240, seen=seen)
    assert job["state"] == "succeeded", job["message"]

    # Live progress reached the service while the job ran, not only at the end.
    assert any(j["state"] == "running" and 0 < j["progress"]["step"] < 40 for j in seen)
    # Workers ran where the labels put them: two in each datacenter, on four distinct nodes.
    node_dc = {n["node_id"]: dc["name"] for dc in api.get("/v1/cluster").json()["datacenters"] for n in dc["nodes"]}
    placement = job["placement"]
    events = [f"{e['kind']}: {e['message']}" for e in api.get(f"/v1/jobs/{job['id']}/events").json()["events"]]
    assert [p["datacenter"] for p in placement] == ["dc-a", "dc-a", "dc-b", "dc-b"], events
    assert all(node_dc[p["node_id"]] == p["datacenter"] for p in placement)
    assert len({p["node_id"] for p in placement}) == 4
    # It learned something, and every step's record was stored exactly once.
    assert job["result"]["final_loss"] < job["result"]["first_loss"] - 0.5
    points = api.get(f"/v1/jobs/{job['id']}/metrics").json()["points"]
    assert [p["step"] for p in points] == list(range(1, 41))
    assert job["result"]["inter_dc_bytes_per_step"] > 0
    kinds = [e["kind"] for e in api.get(f"/v1/jobs/{job['id']}/events").json()["events"]]
    assert kinds.count("worker_started") == 4
    # `auto` planned on default figures (no probe), so the look-ahead was armed: the exact steps before step 20
    # measured the sync; every rank decided the same, and the steps after ran as decided.
    assert job["plan"]["lookahead_when_exposed"] == 0.05 and not job["plan"]["local_lookahead"]
    decided = [e for e in api.get(f"/v1/jobs/{job['id']}/events").json()["events"] if e["kind"] == "sync_decided"]
    assert len(decided) == 1, decided
    d, late = decided[0]["data"], [p["step"] for p in points if p["sync_late"]]
    assert d["steps_measured"] == 8 and d["compute_s"] > 0 and d["exact_step_s"] > 0
    if d["lookahead_step_s"] is None:  # exact sync hid well enough: nothing tried
        assert d["at_step"] == 20 and not d["lookahead"] and late == [], (d, late)
    else:  # the look-ahead tried from step 21 (whose sync lands late), kept or not at step 31
        assert d["at_step"] == 30 and late == list(range(21, 41 if d["lookahead"] else 32)), (d, late)
    # The final weights were kept (checkpoint.keep_final defaults to true) and are listed.
    artifacts = api.get(f"/v1/jobs/{job['id']}/artifacts").json()
    assert artifacts["artifacts"] and artifacts["artifacts"][-1]["final"], artifacts


def test_cancel_stops_workers_and_frees_the_placement(api):
    r = api.post("/v1/jobs", json=spec(training={"steps": 100_000, "global_batch": 8, "micro_batch": 2}))
    job_id = r.json()["id"]
    wait_for(api, job_id, {"running"}, timeout_s=180)
    assert ray.available_resources().get("CPU", 0) == 0  # the job holds all four CPUs
    r = api.delete(f"/v1/jobs/{job_id}")
    assert r.status_code == 202
    job = wait_for(api, job_id, {"cancelled", "failed", "succeeded"}, timeout_s=60)
    assert job["state"] == "cancelled" and job["progress"]["step"] < 100_000
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < 4 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray.available_resources().get("CPU", 0) == 4
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


def test_a_job_cancelled_while_placing_ends_cancelled_with_no_worker_left_30_s_later(api):
    # The actor table of the GCS, which Ray's state API (ray.util.state) serves through the dashboard; this
    # test cluster runs without a dashboard, so it is read directly.
    from ray._private.state import actors

    r = api.post("/v1/jobs", json=spec(training={"steps": 100_000, "global_batch": 8, "micro_batch": 2}))
    job_id = r.json()["id"]
    wait_for(api, job_id, {"placing", "running"}, timeout_s=60)
    assert api.get(f"/v1/jobs/{job_id}").json()["state"] == "placing", "the job started too fast to cancel it placing"
    assert api.delete(f"/v1/jobs/{job_id}").status_code == 202
    job = wait_for(api, job_id, {"cancelled", "failed", "succeeded"}, timeout_s=180)
    assert job["state"] == "cancelled", job["message"]
    time.sleep(30)
    alive = [a for a in actors().values()
             if a["ActorClassName"].endswith("RayTrainWorker") and a["State"] != "DEAD"]
    assert alive == [], alive
    assert ray.available_resources().get("CPU", 0) == 4


@pytest.mark.parametrize("runner_host", ["this host", "another host"])
def test_the_end_of_a_run_sweeps_snapshot_folders_from_here_and_on_other_hosts_by_task(api, monkeypatch, runner_host):
    """A killed worker's snapshot folder outlives it in RAM: the runner removes its own host's at the end of a run,
    and starts a task on every other address. (Every node of this cluster is on this host; "another host" makes
    the runner believe it is elsewhere, so the tasks do the work.)"""
    import os
    import uuid

    from meridian.service.runner import snapshots
    from meridian.workers.state.snapshot_paths import snapshot_dir, snapshot_dirs

    job_id = f"sweep-{uuid.uuid4().hex[:8]}"
    for worker in ("w1", "w2"):
        os.makedirs(snapshot_dir(job_id, worker))
    if runner_host == "another host":
        monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "203.0.113.1")  # TEST-NET-3: no node's
    tasks_to = []
    pin = snapshots.NodeAffinitySchedulingStrategy
    monkeypatch.setattr(snapshots, "NodeAffinitySchedulingStrategy", lambda node, soft: tasks_to.append(node) or pin(node, soft))
    removed = snapshots.sweep_snapshots(job_id)
    assert sorted(removed) == sorted(snapshot_dir(job_id, w) for w in ("w1", "w2")) and not snapshot_dirs(job_id)
    # One address here (every node of this cluster runs on this host): a task to it only from "elsewhere".
    assert len(tasks_to) == (1 if runner_host == "another host" else 0), tasks_to


def test_a_two_datacenter_look_ahead_job_with_validation_passes_runs_to_its_end(api):
    # Each validation pass lands the look-ahead's sync in flight; the step after one waited for ever on an
    # exchange (two receives posted on one tag), so such a job hung at its first validation.
    sync = {"strategy": "hierarchical", "delay_one_step": True, "local_lookahead": True, "lookahead_after": 0}
    r = api.post("/v1/jobs", json=spec(training={"steps": 12, "global_batch": 8, "micro_batch": 2}, sync=sync,
                                       validation={"every_steps": 4, "batches": 1}))
    assert r.status_code == 201, r.text
    job = wait_for(api, r.json()["id"], {"succeeded", "failed", "cancelled"}, timeout_s=180)
    assert job["state"] == "succeeded", job["message"]
    points = api.get(f"/v1/jobs/{job['id']}/metrics").json()["points"]
    assert [p["step"] for p in points if p.get("val_loss") is not None] == [4, 8, 12]
    assert all(p["sync_late"] for p in points)  # one step late from the first step
