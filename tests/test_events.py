"""The job event registry (meridian.workers.contracts.events): every kind the code emits is in it, an event that
does not match it is refused by name (and, from a worker, kept as a ``malformed_event`` rather than dropped), and
clients read the same registry from ``GET /v1/event-kinds``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fakes import FakeService
from fastapi.testclient import TestClient

from meridian.api.app import create_app
from meridian.workers.contracts.events import EventKind, JobEvent, StallSeen, registry

ROOT = Path(__file__).resolve().parents[1]
EMITTED = re.compile(r"""(?:on_event|push_event|_add_event)\(\s*["']([a-z_]+)["']""")


def test_every_kind_the_code_emits_by_name_is_registered():
    found = {m.group(1) for folder in ("service", "workers") for path in (ROOT / folder).rglob("*.py")
             for m in EMITTED.finditer(path.read_text())}
    assert found, "the scan found no emitter: the pattern no longer matches the code"
    assert {k for k in found if EventKind.known(k) is None} == set()


def test_an_event_is_typed_and_what_does_not_match_is_refused_naming_it():
    e = JobEvent.of("stall", "rank 1 is quiet", {"rank": 1, "step": 4, "silent_s": 9.0, "threshold_s": 5.0,
                                                 "median_step_s": 1.0, "node_id": "n1", "datacenter": "dc-b"}, at=3.0)
    assert e.kind is EventKind.STALL and isinstance(e.payload, StallSeen) and e.payload.rank == 1 and e.time == 3.0
    assert e.data["datacenter"] == "dc-b"
    with pytest.raises(ValueError, match="'nope' is not in"):
        JobEvent.of("nope", "", {})
    with pytest.raises(ValueError, match=r"no field\(s\) \['colour'\]"):
        JobEvent.of("node_lost", "", {"node_id": "n", "datacenter": "a", "colour": "red"})
    with pytest.raises(ValueError, match="does not match NodeChanged"):
        JobEvent.of("node_lost", "", {"node_id": "n"})
    with pytest.raises(TypeError, match="carries a NodeChanged"):
        JobEvent(kind=EventKind.NODE_LOST, message="", payload=e.payload)
    kept = JobEvent.parsed_or_malformed("node_lost", "node n is gone", {"node_id": "n"})
    assert kept.kind is EventKind.MALFORMED and kept.message == "node_lost: node n is gone"
    assert "datacenter" in kept.payload.error


def test_clients_read_the_registry_from_the_api(store, supervisor, cluster_view):
    fake = FakeService(store, supervisor, cluster_view)
    with TestClient(create_app(fake.config, service=fake), base_url="http://127.0.0.1") as client:
        kinds = client.get("/v1/event-kinds").json()["kinds"]
    assert kinds == registry() and len(kinds) == len(EventKind)
    stall = next(k for k in kinds if k["kind"] == "stall")
    assert "silent_s" in stall["fields"] and stall["description"]
