"""A node that goes silent on a real Ray cluster, through the service's HTTP API.

A host that loses its power or its network closes no socket: every process of the node is stopped here with
SIGSTOP (its raylet, the Ray Train worker, its training process), so the survivors' collectives wait on a peer
that neither answers nor hangs up. Ray declares the node dead by its health check; the coordinator then tells
the survivors to leave their stuck epoch (``worker_stranded``), and the job re-forms without the node and
trains on, instead of waiting out the collective timeout.
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


@pytest.mark.timeout(900)
def test_a_node_that_goes_silent_is_left_behind_and_the_job_trains_on(tmp_path):
    with local_cluster(("dc-a", "dc-b", "dc-b")) as cluster, service_client(cluster.address, str(tmp_path)) as api:
        job = api.post("/v1/jobs", json=spec(training={"steps": 100_000, "global_batch": 6, "micro_batch": 2},
                                             checkpoint={"snapshot_every": 1})).json()  # fmt: skip
        first = until(api, job["id"], lambda j, ev: j["progress"].get("step", 0) >= 10 and len(j["placement"]) == 3
                      and j, 300, "three workers training")  # fmt: skip
        victim = next(p for p in first["placement"] if p["datacenter"] == "dc-b" and p["rank"] != 0)
        raylet = node_of(cluster.nodes_by_dc, victim["node_id"]).all_processes["raylet"][0].process.pid
        frozen = [raylet, *descendants(raylet)]
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        stopped_at = time.time()
        try:
            after = until(api, job["id"], lambda j, ev: next((e for e in epochs(ev) if e["lost"]), None), 120,
                          "an epoch without the silent node")  # fmt: skip
            events = api.get(f"/v1/jobs/{job['id']}/events").json()["events"]
            stranded = [e for e in events if e["kind"] == "worker_stranded"]
            trained = until(api, job["id"], lambda j, ev: j["progress"].get("step", 0) > after["resume_step"] + 5
                            and j, 120, "steps after the re-formation")  # fmt: skip
        finally:
            for pid in frozen:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            api.delete(f"/v1/jobs/{job['id']}")
        # The two others were stuck with it and told to leave; the epoch re-formed well inside the collective
        # timeout (300 s) and the job trained on.
        assert sorted(e["data"]["worker_id"] for e in stranded) != [] and len(stranded) == 2, stranded
        assert after["datacenters"] == ["dc-a", "dc-b"] and after["time"] - stopped_at < 60, after
        assert trained["state"] == "running"
