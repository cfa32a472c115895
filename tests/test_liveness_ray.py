"""The one liveness path on a real Ray cluster, through the service's HTTP API: a frozen rank and a killed node,
each judged once and acted on.

Three one-CPU nodes (dc-a, dc-b, dc-b). First a dc-b worker is frozen (SIGSTOP of its Ray Train worker and every
process below it, the training process among them): its peers wait in the gradient sync, its heartbeats stop,
and the judge finds it stuck (cause ``silent``): one ``stall`` event, however many times the runner judges it
while it stays frozen. (A peer blocked in the same collective may be named too once it is silent as long: when
no rank computed fewer steps than the others, the heartbeats cannot tell the frozen rank from those waiting for
it. Each is named once.) It is let go and the job trains on. Then the other dc-b node is killed: the judge finds its
worker dead (its port refuses once its peers rejoin, or Ray reports the node dead, whichever comes first): one
``worker_gone`` event, and the controller leaves it behind: the epoch re-forms without it and trains on.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest
from fakes import spec
from processes import descendants
from ray_env import local_cluster, service_client
from test_recovery_ray import epochs, node_of, until

pytestmark = pytest.mark.slow


def _step(job: dict) -> int:
    return job["progress"].get("step", 0)


@pytest.mark.timeout(900)
def test_a_frozen_rank_is_named_once_and_a_killed_node_is_left_behind_once(tmp_path):
    with local_cluster(("dc-a", "dc-b", "dc-b")) as cluster, service_client(cluster.address, str(tmp_path)) as api:
        job = api.post("/v1/jobs", json=spec(training={"steps": 100_000, "global_batch": 6, "micro_batch": 2},
                                             checkpoint={"snapshot_every": 1})).json()  # fmt: skip
        job_id = job["id"]
        try:
            first = until(api, job_id, lambda j, ev: _step(j) >= 10 and len(j["placement"]) == 3 and j, 300,
                          "three workers training")  # fmt: skip
            frozen, victim = [p for p in first["placement"] if p["datacenter"] == "dc-b"]

            # 1) A stuck rank: frozen, not dead. Its port still answers (the kernel accepts for a stopped process).
            pids = [frozen["pid"], *descendants(frozen["pid"])]
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
            try:
                stall = until(api, job_id, lambda j, ev: next((e for e in ev if e["kind"] == "stall"), None), 90,
                              "a stall event")  # fmt: skip
                time.sleep(4)  # eight more judgements of the runner's tick while it stays frozen
                during = api.get(f"/v1/jobs/{job_id}/events").json()["events"]
            finally:
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
            assert stall["data"]["rank"] == frozen["rank"] and stall["data"]["node_id"] == frozen["node_id"], stall
            assert stall["data"]["silent_s"] > stall["data"]["threshold_s"] >= 5.0
            named = [(e["data"]["node_id"], e["data"]["step"]) for e in during if e["kind"] == "stall"]
            assert named[0][0] == frozen["node_id"] and len(named) == len(set(named)), named  # it first; each once
            assert [n for n, _ in named].count(frozen["node_id"]) == 1, named
            assert not [e for e in during if e["kind"] in ("worker_gone", "worker_lost", "worker_stuck")], during[-5:]
            thawed_at = _step(api.get(f"/v1/jobs/{job_id}").json())
            until(api, job_id, lambda j, ev: _step(j) > thawed_at + 5 and j, 180, "steps after the thaw")

            # 2) A dead node: killed with no grace. (The job's placement names nodes; its epochs name the workers.)
            now = epochs(api.get(f"/v1/jobs/{job_id}/events").json()["events"])[-1]
            victim["worker_id"] = next(p["worker_id"] for p in now["placement"] if p["node_id"] == victim["node_id"])
            cluster.remove_node(node_of(cluster.nodes_by_dc, victim["node_id"]), allow_graceful=False)
            after = until(api, job_id, lambda j, ev: next((e for e in epochs(ev) if victim["worker_id"] in e["lost"]),
                                                          None), 120, "an epoch without the killed worker")  # fmt: skip
            until(api, job_id, lambda j, ev: _step(j) > after["resume_step"] + 5 and j, 180, "steps after it")
            until(api, job_id, lambda j, ev: any(e["kind"] == "node_lost" for e in ev), 60, "Ray reporting it dead")
            time.sleep(2)  # the judge has now seen Ray's word too: it must not act on the same death again
            events = api.get(f"/v1/jobs/{job_id}/events").json()["events"]
        finally:
            api.delete(f"/v1/jobs/{job_id}")
        gone = [e for e in events if e["kind"] == "worker_gone"]
        assert [e["data"]["worker_id"] for e in gone] == [victim["worker_id"]], gone
        assert gone[0]["data"]["cause"] in ("process_gone", "node_dead", "host_unreachable"), gone
        assert after["datacenters"] == ["dc-a", "dc-b"] and [e["lost"] for e in epochs(events) if e["lost"]] == [
            [victim["worker_id"]]]
        assert len([e for e in events if e["kind"] == "stall" and e["data"]["node_id"] == frozen["node_id"]]) == 1
