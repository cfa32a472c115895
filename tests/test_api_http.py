"""HTTP details of issue 19: RFC 9457 problem bodies from the one error mapping, a request id on every
response and log line, a readable 413 for a 5 MB body over a real socket, ETags on job reads and lists,
and the Host check that stops DNS rebinding while auth is off."""

from __future__ import annotations

import logging

import httpx
import pytest
from fakes import FakeService, spec
from fastapi.testclient import TestClient

from meridian.api.app import create_app
from meridian.api.server import serve_in_thread

PROBLEM = "application/problem+json"


@pytest.fixture
def fake(store, supervisor, cluster_view):
    return FakeService(store, supervisor, cluster_view)


@pytest.fixture
def client(fake):
    with TestClient(create_app(fake.config, service=fake), base_url="http://127.0.0.1") as c:
        yield c


def test_errors_are_problem_json_with_type_title_status_detail_and_the_field_list(client):
    missing = client.get("/v1/jobs/000000000000")
    assert missing.status_code == 404 and missing.headers["content-type"] == PROBLEM
    body = missing.json()
    assert body["type"] == "urn:meridian:problem:job-not-found" and body["title"] == "Not Found"
    assert body["status"] == 404 and "no job with id" in body["detail"] and body["instance"] == "/v1/jobs/000000000000"
    invalid = client.post("/v1/jobs", json=spec(training={"steps": 0}))
    body = invalid.json()
    assert invalid.status_code == 422 and invalid.headers["content-type"] == PROBLEM
    assert body["type"] == "urn:meridian:problem:invalid-request" and body["status"] == 422
    assert body["errors"][0]["field"] == "training.steps" and "training.steps" in body["detail"]


def test_every_response_has_a_request_id_echoed_or_made(client, caplog):
    ok = client.get("/v1/jobs", headers={"X-Request-ID": "trace-42"})
    assert ok.headers["x-request-id"] == "trace-42"
    made = client.get("/v1/jobs", headers={"X-Request-ID": "bad id\twith junk"})
    assert len(made.headers["x-request-id"]) == 32 and made.headers["x-request-id"] != "bad id\twith junk"
    missing = client.get("/v1/jobs/000000000000", headers={"X-Request-ID": "trace-43"})
    assert missing.headers["x-request-id"] == "trace-43" and missing.json()["request_id"] == "trace-43"
    assert client.post("/v1/jobs", json=spec()).headers["x-request-id"]
    assert client.get("/healthz").headers["x-request-id"]
    caplog.set_level(logging.INFO)
    logging.getLogger("meridian.test").warning("outside a request")  # no id appended
    assert [r.getMessage() for r in caplog.records if r.name == "meridian.test"] == ["outside a request"]


def test_log_lines_written_while_serving_a_request_end_with_its_id(fake, caplog):
    app = create_app(fake.config, service=fake)

    @app.get("/v1/log-probe")
    def probe() -> dict:
        logging.getLogger("meridian.probe").warning("probe line")
        return {}

    caplog.set_level(logging.INFO)
    with TestClient(app, base_url="http://127.0.0.1") as c:
        c.get("/v1/log-probe", headers={"X-Request-ID": "trace-77"})
    lines = [r.getMessage() for r in caplog.records if r.name == "meridian.probe"]
    assert lines == ["probe line [request trace-77]"]


def test_an_unexpected_error_is_a_500_problem_with_the_request_id_logged_and_counted(fake, caplog):
    app = create_app(fake.config, service=fake)

    @app.get("/v1/broken")
    def broken() -> dict:
        raise ZeroDivisionError("a bug")

    caplog.set_level(logging.INFO)
    with TestClient(app, base_url="http://127.0.0.1", raise_server_exceptions=False) as c:
        r = c.get("/v1/broken", headers={"X-Request-ID": "trace-500"})
        metrics = c.get("/metrics").text
    # Before: the 500 was made outside every middleware, so its body said "under request id " with no id and the
    # response had no X-Request-ID: nothing a user could quote.
    assert r.status_code == 500 and r.headers["content-type"] == PROBLEM and r.headers["x-request-id"] == "trace-500"
    body = r.json()
    assert body["request_id"] == "trace-500" and body["detail"].endswith("under request id trace-500")
    assert "ZeroDivisionError" in body["detail"] and "a bug" not in body["detail"]  # no error text to a client
    logged = [rec for rec in caplog.records if rec.getMessage().startswith("unhandled error on GET /v1/broken")]
    assert logged and logged[0].getMessage().endswith("[request trace-500]") and logged[0].exc_info
    assert 'meridian_service_http_requests_total{method="GET",route="/v1/broken",status="500"} 1.0' in metrics


def test_a_5mb_body_over_a_real_socket_gets_a_readable_413_problem(fake):
    with serve_in_thread(fake) as url:
        r = httpx.post(f"{url}/v1/jobs", content=b"x" * 5_000_000, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.headers["content-type"] == PROBLEM
    assert r.json()["type"] == "urn:meridian:problem:payload-too-large" and "larger than" in r.json()["detail"]
    assert r.headers["x-request-id"]


@pytest.mark.parametrize("path", ["/v1/jobs/{id}", "/v1/jobs"])
def test_job_reads_and_lists_answer_304_while_unchanged(client, supervisor, path):
    job = client.post("/v1/jobs", json=spec()).json()
    url = path.format(id=job["id"])
    first = client.get(url)
    etag = first.headers["etag"]
    again = client.get(url, headers={"If-None-Match": etag})
    assert again.status_code == 304 and again.content == b"" and again.headers["etag"] == etag
    supervisor.tick()  # the job is admitted: it changed
    changed = client.get(url, headers={"If-None-Match": etag})
    assert changed.status_code == 200 and changed.headers["etag"] != etag and changed.json()


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8080", "127.0.0.1.nip.io", "10.0.0.5"])
def test_with_auth_off_a_request_for_another_host_name_is_refused(client, host):
    r = client.get("/v1/jobs", headers={"Host": host})
    assert r.status_code == 403 and r.headers["content-type"] == PROBLEM
    assert "DNS rebinding" in r.json()["detail"] and r.headers["x-request-id"]


@pytest.mark.parametrize("host", ["127.0.0.1:8080", "localhost", "LOCALHOST:80", "[::1]:8080", "meridian.localhost"])
def test_with_auth_off_loopback_host_names_are_served(client, host):
    assert client.get("/v1/jobs", headers={"Host": host}).status_code == 200


def test_with_auth_on_any_host_name_is_served_to_a_valid_token(fake, tmp_path):
    from meridian.api.auth import AuthSettings, create_token

    token = create_token(tmp_path / "tokens.json", "alice")
    auth = AuthSettings.load(enabled=True, token_file=str(tmp_path / "tokens.json"))
    with TestClient(create_app(fake.config, service=fake, auth=auth), base_url="http://meridian.example") as c:
        assert c.get("/v1/jobs", headers={"Authorization": f"Bearer {token}"}).status_code == 200
