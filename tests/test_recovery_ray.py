"""Node loss on a real Ray cluster, through the service's HTTP API.

Two datacenters of two one-CPU nodes each. One job (min_workers=3) loses a node of dc-a (killed: no grace),
then the rest of dc-a with rank 0 (drained gracefully), which leaves it below min_workers, then gets a dc-a
node back. It must keep training through all of it — re-forming over the survivors, a datacenter dropping
out, waiting with a reason, scaling back up — and end where a job with no failure ends: same data order,
same final and held-out loss within fp32 round-off. The job with no failure is the same spec trained in one
process (every engine trains like one process: ``test_sync_engine``, ``test_train_loop``), which costs a tenth of
a second job on the cluster.
"""

from __future__ import annotations

import time

import pytest
from fakes import spec, topology
from ray_env import local_cluster, service_client

from meridian.api.schemas import JobSpec
from meridian.service.planning.planner import plan_job
from meridian.service.planning.train_config import build_train_config
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.loop.train import ListSink, train
from meridian.workers.state.snapshot_paths import snapshot_dirs

pytestmark = pytest.mark.slow

STEPS = 300  # long enough to outlast Ray declaring a killed node dead (~30 s) at this job's speed
TRAINING = {"steps": STEPS, "global_batch": 12, "micro_batch": 2, "lr": 3e-3}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with local_cluster(("dc-a", "dc-a", "dc-b", "dc-b")) as cluster, \
            service_client(cluster.address, str(tmp_path_factory.mktemp("meridian"))) as client:  # fmt: skip
        yield cluster, cluster.nodes_by_dc, client


def _one_process(rank, world, cfg):
    return train(cfg, sink=ListSink())


def trained_in_one_process(job_spec: dict):
    """The job's request trained by one process, with the config the service would give a one-worker plan."""
    request = JobSpec.model_validate(job_spec).to_request()
    cfg = build_train_config("reference", request, plan_job(request, topology(dc_a=1)), checkpoint_dir="")
    return run_processes(_one_process, 1, cfg, timeout_s=600)[0]


def until(client, job_id, what, timeout_s, describe):
    """Poll the job until ``what(job, events)`` is truthy; fail with the job's state and last events."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        events = client.get(f"/v1/jobs/{job_id}/events").json()["events"]
        got = what(job, events)
        if got:
            return got
        if job["state"] in ("failed", "cancelled"):
            break
        time.sleep(0.3)
    tail = [f"{e['kind']}: {e['message']}" for e in events[-8:]]
    raise AssertionError(f"{describe} not seen in {timeout_s} s; job {job['state']}: {job['message']}; events: {tail}")


def epochs(events):
    return [e["data"] for e in events if e["kind"] == "epoch_formed"]


def node_of(cluster_nodes, node_id):
    return next(n for ns in cluster_nodes.values() for n in ns if n.node_id == node_id)


@pytest.mark.timeout(1500)  # a job and three re-formations: ~2 min on an idle 2-core machine
def test_job_survives_node_losses_waits_below_min_workers_and_scales_back_up(env):
    cluster, nodes, api = env
    ref = trained_in_one_process(spec(name="reference", training=TRAINING))  # the same job with no failure

    # Snapshots after every step, whatever they cost on a loaded machine ('auto' may space them out): the
    # survivors resume from the step they reached, not from an earlier snapshot. Exact sync named: on guessed
    # figures `auto` arms the look-ahead, whose trial (in every epoch) makes the model depend on the steps' timing,
    # and this test holds the model to the uninterrupted one's.
    job_id = api.post("/v1/jobs", json=spec(name="elastic", training=TRAINING, topology={"min_workers": 3},
                                            checkpoint={"snapshot_every": 1},
                                            sync={"strategy": "hierarchical"})).json()["id"]
    job = until(api, job_id, lambda j, _: j if (j["progress"]["step"] or 0) >= 10 else None, 300, "step 10")
    # 1) Kill the node of a dc-a worker that is not rank 0, with no grace: the survivors re-form on 2 + 1.
    victim = next(p for p in job["placement"] if p["datacenter"] == "dc-a" and p["rank"] != 0)
    cluster.remove_node(node_of(nodes, victim["node_id"]), allow_graceful=False)
    second = until(api, job_id, lambda j, ev: next((e for e in epochs(ev) if e["epoch"] == 2), None), 120, "epoch 2")
    assert second["datacenters"] == ["dc-a", "dc-b", "dc-b"]
    assert second["resume_step"] >= 10 and not second["from_checkpoint"]

    # 2) A second loss takes the rest of dc-a, rank 0 (host of the epoch's store) included, drained gracefully.
    #    Two workers are left, below the job's min_workers=3: it waits for capacity and says why.
    until(api, job_id, lambda j, _: (j["progress"]["step"] or 0) >= second["resume_step"] + 5, 120, "training in epoch 2")
    # Ray Train replaces the killed worker once Ray has declared its node dead. A drain before that (the job now
    # re-forms in ~0.3 s) met Ray Train 2.60's controller failure twice in a row (docs/concepts/recovery.md:
    # a worker dying during another's replacement), which is not what this test is about.
    until(api, job_id, lambda j, ev: any(e["kind"] == "node_lost" for e in ev), 120, "the killed node declared dead")
    rank0 = next(p for p in api.get(f"/v1/jobs/{job_id}").json()["placement"] if p["rank"] == 0)
    cluster.remove_node(node_of(nodes, rank0["node_id"]), allow_graceful=True)
    # (First it waits up to 30 s for rank 0 to rejoin, then below min_workers: wait for the latter.)
    waiting = until(api, job_id, lambda j, _: j if j["reason"] == "WaitingForWorkers" and "min_workers" in j["message"]
                    else None, 120, "waiting below min_workers")
    assert waiting["state"] == "running" and "min_workers" in waiting["message"]

    # 3) A dc-a node comes back: a worker starts on it and the job grows into it. dc-b's two ranks still hold
    #    a whole replica, so the state comes from memory, not from a checkpoint.
    cluster.add_node(num_cpus=1, labels={"datacenter": "dc-a"})
    # (The epoch with the newcomer: normally epoch 3, later if a re-formation had to be retried, e.g. with a
    # member stopped for being stuck, which costs no worker.)
    grown = until(api, job_id, lambda j, ev: next((e for e in epochs(ev) if e["epoch"] > 2 and e["newcomers"]), None),
                  240, "a worker joining in dc-a")
    # Ray Train 2.60's controller can fail under the drain (it asks the survivors to clear their result queues
    # while replacing the killed worker, and one of them is the drained one: a ControllerError it does not retry).
    # Seen in 3 fresh clones' runs of this test in stops 38-42. The job lives through it (docs/concepts/recovery.md, "When Ray
    # Train's own run fails under the job"): a new Train run's workers take over the ended ones' snapshots, so
    # every member of the grown epoch is new and the three of epoch 2 are lost with it. Either way the state
    # comes from memory and the job ends where the uninterrupted one does (asserted below).
    kinds = [e["kind"] for e in api.get(f"/v1/jobs/{job_id}/events").json()["events"]]
    train_run_restarted = "train_run_restarted" in kinds
    assert grown["datacenters"] == ["dc-a", "dc-b", "dc-b"]
    assert len(grown["newcomers"]) == (3 if train_run_restarted else 1), (grown, kinds)
    assert not grown["from_checkpoint"] and grown["resume_step"] >= second["resume_step"] + 5

    job = until(api, job_id, lambda j, _: j if j["state"] in ("succeeded", "failed") else None, 300, "the end")
    assert job["state"] == "succeeded", job["message"]
    events = api.get(f"/v1/jobs/{job_id}/events").json()["events"]
    kinds = [e["kind"] for e in events]
    t0 = events[0]["time"]
    print("\nTIMELINE", *(f"{e['time'] - t0:7.1f} {e['kind']}: {e['message'][:90]}" for e in events), sep="\n")
    assert kinds.count("node_lost") == 2 and "node_joined" in kinds
    assert kinds.count("worker_lost") == (1 + len(second["datacenters"]) if train_run_restarted else 2), kinds
    assert "restarted" not in kinds and "state_incomplete" not in kinds
    assert [p["datacenter"] for p in job["placement"]] == ["dc-a", "dc-b", "dc-b"]  # the last membership
    # Rank 0 reads a step's loss a window of steps late, so the records of the last steps before a break can be
    # missing, though their state was kept and training resumed after them: each such step is named by a
    # steps_unrecorded event, and the last step always has its record.
    points = api.get(f"/v1/jobs/{job_id}/metrics").json()["points"]
    missing = set(range(1, STEPS + 1)) - {p["step"] for p in points}
    named = {s for e in events if e["kind"] == "steps_unrecorded"
             for s in range(e["data"]["from_step"], e["data"]["to_step"] + 1)}  # fmt: skip
    assert missing == named and STEPS not in missing, (sorted(missing), sorted(named))
    # Same samples in the same order as the reference: the same model at the end, up to fp32 sum order.
    # (Measured: 2.778015614 for both, held-out 2.415289909 in one process and 2.415290028 after the re-formations.)
    assert abs(job["result"]["final_loss"] - ref.final_loss) < 1e-3, (job["result"], ref)
    assert abs(job["result"]["eval_loss"] - ref.eval_loss) < 1e-3, (job["result"], ref)
    # The killed worker's in-memory snapshots (its node shares this host's RAM) are swept when the run ends.
    deadline = time.monotonic() + 60
    while snapshot_dirs(job_id) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not snapshot_dirs(job_id)
