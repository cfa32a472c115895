"""Job metrics reach the Ray metrics endpoint, tagged by job and datacenter, while a real job runs.

Its own small cluster (head + one node in each of two datacenters) with a 1 s metrics report interval;
every node's metrics agent is scraped (the runner actor may land on any node).
"""

from __future__ import annotations

import re
import time

import httpx
import pytest
import ray
from fakes import spec
from ray_env import local_cluster, service_client

pytestmark = pytest.mark.slow

SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)\{(?P<labels>.*)\} (?P<value>\S+)$')


def scrape_meridian() -> list[tuple[str, dict[str, str], float]]:
    samples = []
    for n in ray.nodes():
        if not n["Alive"] or not n.get("MetricsExportPort"):
            continue
        try:
            text = httpx.get(f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics", timeout=5).text
        except httpx.HTTPError:
            continue
        for line in text.splitlines():
            m = SAMPLE.match(line)
            if m and m["name"].startswith("ray_meridian_job_"):
                labels = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"]))
                samples.append((m["name"], labels, float(m["value"])))
    return samples


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    with local_cluster(("dc-a", "dc-b"), system_config={"metrics_report_interval_ms": 1000}) as cluster, \
            service_client(cluster.address, str(tmp_path_factory.mktemp("meridian"))) as client:  # fmt: skip
        yield client


def test_job_metrics_on_the_ray_endpoint_tagged_by_job_and_datacenter(api):
    r = api.post("/v1/jobs", json=spec(training={"steps": 400, "global_batch": 4, "micro_batch": 2}))
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    wanted = {("ray_meridian_job_loss", "all"), ("ray_meridian_job_tokens_per_second", "all"),
              ("ray_meridian_job_mfu", "all"), ("ray_meridian_job_step_seconds", "dc-a"),
              ("ray_meridian_job_step_seconds", "dc-b"), ("ray_meridian_job_live_workers", "dc-a"),
              ("ray_meridian_job_live_workers", "dc-b"), ("ray_meridian_job_steps_total", "all"),
              ("ray_meridian_job_step_duration_seconds_count", "all")}
    deadline, mine = time.monotonic() + 240, []
    while time.monotonic() < deadline:
        mine = [s for s in scrape_meridian() if s[1].get("job_id") == job_id]
        if wanted <= {(name, labels["datacenter"]) for name, labels, _ in mine}:
            break
        job = api.get(f"/v1/jobs/{job_id}").json()
        assert job["state"] in ("queued", "placing", "running"), job["message"]
        time.sleep(1)
    seen = {(name, labels["datacenter"]) for name, labels, _ in mine}
    assert wanted <= seen, f"missing {sorted(wanted - seen)}"
    values = {(name, labels["datacenter"], labels.get("phase")): v for name, labels, v in mine}
    assert values[("ray_meridian_job_live_workers", "dc-a", None)] == 1
    assert values[("ray_meridian_job_live_workers", "dc-b", None)] == 1
    assert values[("ray_meridian_job_steps_total", "all", None)] >= 1
    assert 0 < values[("ray_meridian_job_loss", "all", None)] < 10
    assert values[("ray_meridian_job_step_seconds", "dc-a", None)] > 0
    assert values.get(("ray_meridian_job_step_phase_seconds", "dc-b", "data"), -1) >= 0
    # The same job's stored records carry the data/compute split the gauges came from.
    point = api.get(f"/v1/jobs/{job_id}/metrics", params={"limit": 1}).json()["points"][0]
    assert point["data_s"] > 0 and point["compute_s"] > 0 and "matmul" in point["peak_source"]
    assert api.delete(f"/v1/jobs/{job_id}").status_code == 202


def test_a_frozen_rank_is_named_in_the_events_with_its_node_and_datacenter(api):
    import os
    import signal

    r = api.post("/v1/jobs", json=spec(training={"steps": 100_000, "global_batch": 4, "micro_batch": 2}))
    job_id = r.json()["id"]
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        job = api.get(f"/v1/jobs/{job_id}").json()
        assert job["state"] in ("queued", "placing", "running"), job["message"]
        if job["progress"]["step"] >= 20 and len(job["placement"]) == 2:
            break
        time.sleep(0.5)
    victim = next(p for p in job["placement"] if p["datacenter"] == "dc-b")
    os.kill(victim["pid"], signal.SIGSTOP)  # a worker that stops making progress without dying
    try:
        deadline, stalls = time.monotonic() + 60, []
        while time.monotonic() < deadline and not stalls:
            events = api.get(f"/v1/jobs/{job_id}/events").json()["events"]
            stalls = [e for e in events if e["kind"] == "stall" and e["data"]["rank"] == victim["rank"]]
            time.sleep(0.5)
    finally:
        os.kill(victim["pid"], signal.SIGCONT)
        api.delete(f"/v1/jobs/{job_id}")
    assert stalls, "no stall event named the frozen rank within 60 s"
    data = stalls[0]["data"]
    assert data["node_id"] == victim["node_id"] and data["datacenter"] == "dc-b"
    assert data["silent_s"] > data["threshold_s"] >= 5.0
    assert f"rank {victim['rank']} in dc-b" in stalls[0]["message"]
