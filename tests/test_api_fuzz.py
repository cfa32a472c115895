"""Property-based fuzzing of the REST API against its own OpenAPI schema (schemathesis, in-process ASGI):
whatever a client sends — valid, malformed, absurd — the answer is never a 5xx.

Runs against the fake cluster and launcher (no Ray). Bounded by ``max_examples`` to stay well under a
minute on this machine. ``POST /v1/diagnostics/collectives`` is left out: a valid body runs a real
benchmark on Ray, which the fakes do not have (its validation is covered by the same models as the rest).
"""

from __future__ import annotations

import schemathesis
from fakes import FakeService
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from meridian.api.app import create_app

MAX_EXAMPLES = 30  # per operation (11 operations): ~30 s here


def test_no_input_gets_a_server_error(store, supervisor, cluster_view):
    # schemathesis' own pytest plugin does not load under this pytest; driving hypothesis per operation
    # is the same fuzzing, and keeps every case's request in the failure message.
    service = FakeService(store, supervisor, cluster_view)
    app = create_app(service.config, service=service)
    # A loopback Host: with auth off the service refuses other names (DNS rebinding), schemathesis' default
    # "testserver" included.
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, headers={"Host": "127.0.0.1"}).exclude(
        path="/v1/diagnostics/collectives", method="POST")
    calls: dict[str, int] = {}
    codes: dict[int, int] = {}
    for result in schema.get_all_operations():
        fuzz(result.ok(), calls, codes)
    # Every operation of the schema was exercised (so a route that vanished from it would show here).
    assert {"POST /v1/jobs", "GET /v1/jobs/{job_id}/events", "GET /v1/jobs/{job_id}/logs", "POST /v1/plans"} <= set(calls)
    assert len(calls) >= 10 and min(calls.values()) >= 1
    assert codes.get(2, 0) > 0 and codes.get(4, 0) > 0 and set(codes) <= {2, 4}, codes


def fuzz(operation, calls: dict[str, int], codes: dict[int, int]) -> None:
    label = f"{operation.method.upper()} {operation.path}"

    @settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    # Valid inputs (reach the planner and the store) and invalid ones (must be clear 4xx), mixed.
    @given(case=st.one_of(operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE)))
    def check(case):
        response = case.call(base_url="http://127.0.0.1")
        calls[label] = calls.get(label, 0) + 1
        codes[response.status_code // 100] = codes.get(response.status_code // 100, 0) + 1
        assert response.status_code < 500, (
            f"{label} -> {response.status_code}: {response.text[:500]}\n{case.as_curl_command()}")
        if response.status_code >= 400:
            assert response.json()["detail"], "every error says what to fix"

    check()
