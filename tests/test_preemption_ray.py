"""Priority preemption on a real Ray cluster, through the service's HTTP API (issue 60).

Two datacenters of two one-CPU nodes. A priority-0 job (exact per-step sync) takes the whole cluster; a
priority-10 job that needs it too is submitted while it trains. The low job's workers write a durable
checkpoint at their next step boundary and stop; it goes back to the queue, the high job runs to its end, and
the low job resumes from its checkpoint and ends with the final loss of an uninterrupted run (the same spec
trained in one process: every engine trains like one process) within 1e-3, relative.
"""

from __future__ import annotations

import math
import time

import pytest
from fakes import spec
from ray_env import service_client
from test_recovery_ray import trained_in_one_process

pytestmark = pytest.mark.slow

STEPS = 60
LOW = {"steps": STEPS, "global_batch": 8, "micro_batch": 2, "lr": 3e-3}
EXACT = {"strategy": "hierarchical"}


@pytest.fixture(scope="module")
def api(four_nodes, tmp_path_factory):  # the cluster is shared with the next module that asks for it
    with service_client(four_nodes.address, str(tmp_path_factory.mktemp("meridian"))) as client:
        yield client


def wait(api, job_id, what, timeout_s, describe):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = api.get(f"/v1/jobs/{job_id}").json()
        if what(job):
            return job
        if job["state"] in ("failed", "cancelled"):
            break
        time.sleep(0.5)
    events = [f"{e['kind']}: {e['message']}" for e in api.get(f"/v1/jobs/{job_id}/events?newest=10").json()["events"]]
    raise AssertionError(f"{describe} not seen in {timeout_s} s: {job['state']} {job['message']}; {events}")


@pytest.mark.timeout(1500)
def test_a_priority_10_job_preempts_a_priority_0_one_which_resumes_from_its_checkpoint_to_the_same_loss(api):
    low_spec = spec(name="low", training=LOW, sync=EXACT, checkpoint={"snapshot_every": 1})
    ref = trained_in_one_process(low_spec)  # the same job, uninterrupted
    low = api.post("/v1/jobs", json={**low_spec, "priority": 0}).json()
    wait(api, low["id"], lambda j: j["state"] == "running" and j["progress"]["step"] >= 15, 400, "the low job training")

    high = api.post("/v1/jobs", json={**spec(name="high", training={"steps": 10, "global_batch": 8,
                                                                     "micro_batch": 2}, sync=EXACT), "priority": 10})
    assert high.status_code == 201, high.text
    high = high.json()
    suspended = wait(api, low["id"], lambda j: j["state"] == "queued" and j["reason"] == "Preempted", 300,
                     "the low job suspended")
    assert "checkpoint of step" in suspended["message"], suspended["message"]
    step = int(suspended["message"].split("checkpoint of step ")[1].split(" ")[0])
    assert 15 <= step < STEPS
    running_high = wait(api, high["id"], lambda j: j["state"] in ("running", "succeeded"), 300, "the high job running")
    assert api.get(f"/v1/jobs/{low['id']}").json()["reason"] == "Preempted"  # it says so while it waits
    done = wait(api, high["id"], lambda j: j["state"] == "succeeded", 400, "the high job's end")
    assert running_high and done["result"]["steps"] == 10

    finished = wait(api, low["id"], lambda j: j["state"] in ("succeeded",), 600, "the low job's end")
    events = api.get(f"/v1/jobs/{low['id']}/events?limit=10000").json()["events"]
    kinds = [e["kind"] for e in events]
    assert "preempted" in kinds and "checkpoint_loaded" in kinds, kinds
    loaded = next(e for e in events if e["kind"] == "checkpoint_loaded")
    assert loaded["data"]["step"] == step  # it resumed from the checkpoint written at its suspension
    final = finished["result"]["final_loss"]
    assert math.isfinite(final) and final == pytest.approx(ref.final_loss, rel=1e-3), (final, ref.final_loss)
