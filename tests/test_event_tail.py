"""A long job's newest events without its history: ``GET /v1/jobs/{id}/events?newest=N``, ``meridian events`` (the
last 1000 by default, ``--tail N``; with ``-f`` the tail, then live). The page's first read of a job:
``tests/test_web_page_hostile.py``."""

from __future__ import annotations

import json
import time

from fakes import submit
from fastapi.testclient import TestClient

from meridian.api.app import create_app
from meridian.api.server import serve_in_thread
from meridian.cli.main import main


def add_notes(store, job_id: str, n: int) -> None:
    with store.engine.begin() as conn:
        store._insert_events(conn, [dict(job_id=job_id, time=time.time(), kind="note", message=f"note {i}", data="{}")
                                    for i in range(n)])


def test_newest_gives_the_last_events_oldest_first_and_counts_the_ones_before(service, store, supervisor):
    job = submit(supervisor)  # its first event: the submission
    add_notes(store, job, 2_500)
    ids = [e.id for e in store.list_events(job, limit=10_000)]
    with TestClient(create_app(service.config, service=service), base_url="http://127.0.0.1") as c:
        page = c.get(f"/v1/jobs/{job}/events", params={"newest": 3}).json()
        assert [e["message"] for e in page["events"]] == ["note 2497", "note 2498", "note 2499"]
        assert page["earlier"] == 2_498  # the submission and notes 0-2496
        after = c.get(f"/v1/jobs/{job}/events", params={"newest": 2, "after": ids[-5]}).json()
        assert [e["id"] for e in after["events"]] == ids[-2:] and after["earlier"] == 2  # counted after `after` only
        assert c.get(f"/v1/jobs/{job}/events", params={"newest": 5, "after": ids[-1]}).json() == {"events": [],
                                                                                                 "earlier": 0}
        first = c.get(f"/v1/jobs/{job}/events").json()  # without it: the first page, as before
        assert len(first["events"]) == 1000 and first["events"][0]["id"] == ids[0] and first["earlier"] is None
        for bad in (0, 10_001, -1):
            r = c.get(f"/v1/jobs/{job}/events", params={"newest": bad})
            assert r.status_code == 422 and "newest" in r.json()["detail"], r.text


def test_the_cli_prints_the_last_events_and_says_how_many_came_before(service, store, supervisor, capsys,
                                                                      monkeypatch):
    job = submit(supervisor)
    add_notes(store, job, 1_500)
    supervisor.cancel(job)  # finished: following it ends
    with serve_in_thread(service) as url:
        monkeypatch.setenv("MERIDIAN_URL", url)
        assert main(["events", job, "--tail", "2"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].startswith("(1500 earlier events not shown: --tail N")  # the submission, notes 0-1498
        assert "note 1499" in lines[1] and "cancelled" in lines[2] and len(lines) == 3
        assert main(["events", job]) == 0  # the last 1000 by default
        lines = capsys.readouterr().out.splitlines()
        assert "(502 earlier events not shown" in lines[0] and len(lines) == 1001 and "cancelled" in lines[-1]
        # Following a long job starts at its tail instead of replaying its history, and misses nothing after it.
        assert main(["events", job, "-f", "--tail", "3", "--json"]) == 0
        got = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert [e["message"] for e in got[:2]] == ["note 1498", "note 1499"] and got[-1]["kind"] == "state"
        assert len(got) == 3
        assert main(["events", job, "--tail", "10001", "--json"]) == 1  # the service's 422, as JSON
        assert "newest" in json.loads(capsys.readouterr().out)["error"]["detail"]
        assert main(["events", job, "--tail", "0", "-f", "--json"]) == 0  # from --after on: every event
        assert len(capsys.readouterr().out.splitlines()) == 1 + 1500 + 1
