"""The service's ``GET /metrics`` under hostile input: a client chooses the method and the path of its
requests, and neither may grow the exported label set; the exposition parses with prometheus_client's own
parser and holds exactly the declared metrics with their declared labels."""

from __future__ import annotations

import pytest
from fakes import FakeService
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from meridian.api.app import create_app
from meridian.api.prometheus import HTTP_METHODS, SERVICE_METRICS


@pytest.fixture
def client(store, supervisor, cluster_view):
    service = FakeService(store, supervisor, cluster_view)
    with TestClient(create_app(service.config, service=service), base_url="http://127.0.0.1") as c:
        yield c


def request_samples(client):
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    return [s for s in families["meridian_service_http_requests"].samples if s.name.endswith("_total")]


def test_made_up_methods_do_not_grow_the_label_set(client):
    """Every method a client invented was a new label value: each request with a fresh one added a counter
    and a 12-line histogram that the service kept, and exported, for ever."""
    for i in range(40):
        client.request(f"X{i}", "/v1/jobs")  # a route that exists: 405
        client.request(f"PROBE{i}", "/no/such/path")  # 404
    samples = request_samples(client)
    methods = {s.labels["method"] for s in samples}
    assert methods <= HTTP_METHODS | {"OTHER"}, sorted(methods)
    other = {(s.labels["route"], s.labels["status"]): s.value for s in samples if s.labels["method"] == "OTHER"}
    assert other == {("/v1/jobs", "405"): 40.0, ("unmatched", "404"): 40.0}


def test_static_assets_are_counted_under_their_mount_not_as_unmatched(client):
    """The page's assets (200s) were counted as route="unmatched", the label of requests for paths that do
    not exist, so the requests dashboard mixed page loads into the 404 noise."""
    assert client.get("/static/app.js").status_code == 200
    assert client.get("/static/nope.js").status_code == 404
    assert client.get("/no/such/path").status_code == 404
    counted = {(s.labels["route"], s.labels["status"]): s.value for s in request_samples(client)
               if s.labels["method"] == "GET"}
    assert counted[("/static", "200")] == 1.0 and counted[("/static", "404")] == 1.0
    assert counted[("unmatched", "404")] == 1.0
    assert ("unmatched", "200") not in counted


def test_the_exposition_holds_the_declared_metrics_with_their_labels(client):
    client.get("/v1/jobs")
    client.get("/v1/jobs/nope")
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    for d in SERVICE_METRICS:
        name = d.name.removesuffix("_total") if d.kind == "counter" else d.name
        family = families[name]
        assert family.type == d.kind, (name, family.type)
        values = [s for s in family.samples if not s.name.endswith("_created")]
        assert values, f"{name} has no samples"
        for s in values:
            extra = {"le"} if s.name.endswith("_bucket") else set()
            assert set(s.labels) == set(d.tags) | extra, (s.name, s.labels)
    routes = {s.labels["route"] for s in families["meridian_service_http_requests"].samples}
    assert "/v1/jobs/{job_id}" in routes and not any("nope" in r for r in routes)  # templates, never raw paths


def test_a_store_that_cannot_be_read_leaves_out_the_job_gauges_not_the_whole_scrape(client, store, caplog):
    """The jobs-by-state gauges read the store at scrape time; a database error there made ``/metrics`` a 500,
    so Prometheus marked the service down and lost the request counts that would show the outage."""
    import sqlalchemy as sa

    client.get("/v1/jobs")

    def broken():
        raise sa.exc.OperationalError("SELECT state, count(*) FROM jobs", {}, Exception("database is locked"))

    store.count_by_state = broken
    r = client.get("/metrics")
    assert r.status_code == 200, r.text
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    assert "meridian_service_jobs" not in families and "meridian_service_queue_length" not in families
    assert any(s.labels.get("route") == "/v1/jobs" for s in families["meridian_service_http_requests"].samples)
    assert any("job store could not be read" in rec.getMessage() and "database is locked" in rec.getMessage()
               for rec in caplog.records)
