"""The REST API over HTTP, with the control plane running against a fake cluster and launcher."""

from __future__ import annotations

import pytest
from fakes import spec
from fastapi.testclient import TestClient

from meridian.api.app import create_app
from meridian.service.core import ServiceConfig


class FakeService:
    def __init__(self, store, supervisor, cluster_view):
        self.config = ServiceConfig(data_dir="/tmp")
        self.store, self.supervisor, self._view = store, supervisor, cluster_view

    def topology(self):
        return self._view()


@pytest.fixture
def client(store, supervisor, cluster_view):
    app = create_app(FakeService(store, supervisor, cluster_view).config,
                     service=FakeService(store, supervisor, cluster_view))
    with TestClient(app, base_url="http://127.0.0.1") as c:
        yield c


def test_submit_read_list_and_plan(client):
    r = client.post("/v1/jobs", json=spec())
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["state"] == "queued" and job["plan"]["workers_per_datacenter"] == {"dc-a": 2, "dc-b": 2}
    assert r.headers["location"] == f"/v1/jobs/{job['id']}"
    assert client.get(f"/v1/jobs/{job['id']}").json()["id"] == job["id"]
    assert client.get("/v1/jobs").json()["count"] == 1
    assert client.get("/v1/jobs", params={"state": "running"}).json()["count"] == 0
    plan = client.post("/v1/plans", json=spec()).json()
    assert plan["num_workers"] == 4 and plan["sync_strategy"] == "hierarchical"
    # the hierarchical engine syncs per FSDP2 unit: no DDP buckets; flat sync's are sized by the planner when the
    # spec leaves them out (or null), else the spec's
    assert plan["bucket_mb"] is None and "FSDP2 unit" in plan["explanation"]
    flat = client.post("/v1/plans", json=spec(sync={"strategy": "flat", "bucket_mb": None})).json()
    assert flat["bucket_mb"] == 1.0 and "Gradient buckets of 1.00 MiB: one holds" in flat["explanation"]
    mine = client.post("/v1/plans", json=spec(sync={"strategy": "flat", "bucket_mb": 0.25})).json()
    assert mine["bucket_mb"] == 0.25 and "Gradient buckets of" not in mine["explanation"]
    # streaming DiLoCo's merge: the paper's unless the spec asks to keep what trained meanwhile
    knobs = {"inner_steps": 8, "fragments": 2, "overlap_steps": 1}
    for merge in ("keep-progress", "mix", None):
        diloco = knobs if merge is None else {**knobs, "merge": merge}
        r = client.post("/v1/plans", json=spec(sync={"strategy": "streaming-diloco", "diloco": diloco}))
        assert r.status_code == 200 and r.json()["diloco"]["merge"] == (merge or "mix"), r.text
    # the datacenters average their weights at the last step only when the spec asks, in the encoding it names
    for final in ("bf16", None):
        diloco = knobs if final is None else {**knobs, "final_average": final}
        r = client.post("/v1/plans", json=spec(sync={"strategy": "streaming-diloco", "diloco": diloco}))
        assert r.status_code == 200 and r.json()["diloco"]["final_average"] == (final or "off"), r.text
    # one step late at a local look-ahead, asked for with its exact first steps
    late = {"strategy": "hierarchical", "delay_one_step": True, "local_lookahead": True, "lookahead_after": 5}
    r = client.post("/v1/plans", json=spec(sync=late))
    assert r.status_code == 200 and r.json()["sync_strategy"] == "hierarchical", r.text


@pytest.mark.parametrize("body, field", [
    (spec(training={"steps": 0}), "training.steps"),
    (spec(training={"micro_batch": 8}), "training.micro_batch"),
    (spec(modle={"preset": "nano"}), "modle"),
    (spec(model={"preset": "huge"}), "model.preset"),
    (spec(model={"preset": "nano", "n_heads": 3}), "model.d_model"),
    (spec(sync={"strategy": "flat", "compression": "int8"}), "sync.compression"),
    (spec(sync={"strategy": "auto", "delay_one_step": True}), "sync.delay_one_step"),
    (spec(sync={"strategy": "hierarchical", "local_lookahead": True}), "sync.local_lookahead"),
    (spec(sync={"strategy": "hierarchical", "delay_one_step": True, "local_lookahead": True, "lookahead_after": -1}),
     "sync.lookahead_after"),
    (spec(sync={"strategy": "hierarchical", "lookahead_after": 5}), "sync.lookahead_after"),
    (spec(wan={"rtt_ms": -1, "gbps": 1}), "wan.rtt_ms"),
    (spec(sync={"bucket_mb": 0}), "sync.bucket_mb"),
    (spec(sync={"strategy": "streaming-diloco", "diloco": {"inner_steps": 8, "fragments": 2, "overlap_steps": 1,
                                                           "merge": "average"}}), "sync.diloco.merge"),
    (spec(sync={"strategy": "diloco", "diloco": {"inner_steps": 8, "final_average": "fp16"}}),
     "sync.diloco.final_average"),
    (spec(sync={"strategy": "streaming-diloco", "diloco": {"inner_steps": 8, "fragments": 2, "overlap_steps": 5,
                                                           "warmup_steps": 12}}), "sync.diloco.warmup_steps"),
    (spec(topology={"datacenters": ["bad name!"]}), "topology.datacenters"),
    ({"name": "x"}, "training"),
    (spec(parallelism={"tp": 1, "sequence_parallel": True}), "parallelism.sequence_parallel"),
    (spec(parallelism={"pp": 2, "virtual_stages": 2}), "parallelism.virtual_stages"),
    (spec(parallelism={"tp": 2}, sync={"strategy": "diloco"}), "sync.strategy"),
    (spec(training={"activation_checkpointing": "some"}), "training.activation_checkpointing"),
    (spec(sync={"shard_optimizer": False}), "sync.shard_optimizer"),
    (spec(sync={"strategy": "hierarchical", "shard_optimizer": False}), "sync.shard_optimizer"),
    (spec(sync={"strategy": "diloco", "bucket_mb": 4.0}), "sync.bucket_mb"),
    (spec(sync={"strategy": "hierarchical", "bucket_mb": 4.0}), "sync.bucket_mb does not apply with sync.strategy 'hierarchical'"),
    (spec(sync={"strategy": "streaming-diloco", "overlap": False}), "sync.overlap"),
])
def test_bad_specs_are_422_naming_the_field(client, body, field):
    r = client.post("/v1/jobs", json=body)
    assert r.status_code == 422, r.text
    assert field in r.json()["detail"]
    assert client.get("/v1/jobs").json()["count"] == 0  # nothing stored


def test_a_replicated_optimizer_is_refused_saying_why_and_the_sharded_one_still_accepted(client):
    r = client.post("/v1/jobs", json=spec(sync={"shard_optimizer": False}))
    assert r.status_code == 422 and "sharded inside each datacenter by FSDP2" in r.json()["detail"], r.text
    assert "remove the field" in r.json()["detail"]
    assert client.post("/v1/plans", json=spec(sync={"shard_optimizer": True})).status_code == 200
    # DiLoCo with per-step sync's knobs left at what it runs with anyway: accepted
    r = client.post("/v1/plans", json=spec(sync={"strategy": "diloco", "overlap": True, "bucket_mb": None}))
    assert r.status_code == 200 and r.json()["sync_strategy"] == "diloco", r.text


def test_job_the_cluster_can_never_hold_is_409_with_reason(client):
    r = client.post("/v1/jobs", json=spec(topology={"datacenters": ["dc-a", "dc-x"]}))
    assert r.status_code == 409
    assert "'dc-x' have no live node" in r.json()["detail"] and "'dc-a', 'dc-b'" in r.json()["detail"]


def test_malformed_json_and_unknown_job_are_clear_4xx(client):
    r = client.post("/v1/jobs", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["detail"]
    r = client.get("/v1/jobs/doesnotexist")
    assert r.status_code == 404 and "GET /v1/jobs" in r.json()["detail"]


def test_cancel_queued_then_cancel_again_is_409(client):
    job = client.post("/v1/jobs", json=spec()).json()
    r = client.delete(f"/v1/jobs/{job['id']}")
    assert r.status_code == 202 and r.json()["state"] == "cancelled"
    r = client.delete(f"/v1/jobs/{job['id']}")
    assert r.status_code == 409 and "already cancelled" in r.json()["detail"]


def test_idempotency_key_returns_the_same_job(client):
    a = client.post("/v1/jobs", json=spec(), headers={"Idempotency-Key": "abc"})
    b = client.post("/v1/jobs", json=spec(), headers={"Idempotency-Key": "abc"})
    assert (a.status_code, b.status_code) == (201, 200) and a.json()["id"] == b.json()["id"]


@pytest.mark.parametrize("key", ["", "   "])
def test_a_blank_idempotency_key_is_refused_not_shared(client, key):
    # Stored as given, "" was one key for every keyless-by-mistake request of an owner: the second got the first's job.
    for name in ("first", "second"):
        r = client.post("/v1/jobs", json=spec(name=name), headers={"Idempotency-Key": key})
        assert r.status_code == 422 and r.json()["errors"][0]["field"] == "header.idempotency-key", r.json()
    assert client.get("/v1/jobs").json()["count"] == 0


def test_cluster_lists_nodes_by_datacenter(client):
    data = client.get("/v1/cluster").json()
    assert [dc["name"] for dc in data["datacenters"]] == ["dc-a", "dc-b"]
    n = data["datacenters"][0]["nodes"][0]
    assert {"node_id", "alive", "resources", "labels"} <= set(n) and n["labels"] == {"datacenter": "dc-a"}


def test_events_and_metrics_of_a_job(client, supervisor):
    job = client.post("/v1/jobs", json=spec()).json()
    events = client.get(f"/v1/jobs/{job['id']}/events").json()["events"]
    assert events[0]["kind"] == "state" and events[0]["data"]["state"] == "queued"
    assert client.get(f"/v1/jobs/{job['id']}/metrics").json()["points"] == []


def test_job_list_pages_follow_every_change_to_a_job(client, store):
    # GET /v1/jobs serves cached pages between changes; every change must show on the next read.
    first = client.post("/v1/jobs", json=spec()).json()
    assert [j["id"] for j in client.get("/v1/jobs").json()["jobs"]] == [first["id"]]
    assert client.get("/v1/jobs").content == client.get("/v1/jobs").content  # no change: the same page
    second = client.post("/v1/jobs", json=spec()).json()
    assert [j["id"] for j in client.get("/v1/jobs").json()["jobs"]] == [second["id"], first["id"]]
    store.update_fields(first["id"], progress={"step": 3, "total_steps": 20})  # as the supervisor's poll does
    by_id = {j["id"]: j for j in client.get("/v1/jobs").json()["jobs"]}
    assert by_id[first["id"]]["progress"]["step"] == 3
    client.delete(f"/v1/jobs/{second['id']}")
    assert client.get("/v1/jobs", params={"state": "cancelled"}).json()["jobs"][0]["id"] == second["id"]
    assert [j["id"] for j in client.get("/v1/jobs", params={"limit": 1, "offset": 1}).json()["jobs"]] == [first["id"]]


def test_paging_the_metrics_with_next_keeps_a_step_trained_twice(client, supervisor):
    # After a failure with snapshots every k > 1 steps, steps 5 and 6 were trained (and recorded) again. Paged by
    # step alone, a page ending between a step's two points lost the second.
    job = client.post("/v1/jobs", json=spec()).json()
    points = [{"step": i, "loss": 10.0 - i, "epoch": 1} for i in range(1, 7)]
    points += [{"step": i, "loss": 10.0 - i, "epoch": 2} for i in range(5, 9)]
    supervisor.store.add_metrics(job["id"], points)
    got, params = [], {"limit": 5}
    while True:
        page = client.get(f"/v1/jobs/{job['id']}/metrics", params=params).json()
        got += page["points"]
        if not page["points"]:
            break
        params = {"limit": 5, **page["next"]}
    assert sorted((p["step"], p["epoch"]) for p in got) == sorted((p["step"], p["epoch"]) for p in points)
    assert client.get(f"/v1/jobs/{job['id']}/metrics", params={"after_step": 6}).json()["points"][0]["step"] == 7
