"""Server-sent events under unlucky clients: a resume in the middle of a long history, another owner's job,
a quiet job (keep-alives), and a client that never reads (the server must not buffer the history for it)."""

from __future__ import annotations

import json
import socket
import threading
import time

from fakes import raw_event, submit
from fastapi.testclient import TestClient

from meridian.api import streams
from meridian.api.app import create_app
from meridian.api.auth import AuthSettings, create_token
from meridian.api.client import parse_sse
from meridian.api.server import serve_in_thread

SSE = {"Accept": "text/event-stream"}


def add_notes(store, job_id, n, size=10):
    with store.engine.begin() as conn:
        store._insert_events(conn, [dict(job_id=job_id, time=time.time(), kind="note", message=f"{i}:" + "x" * size,
                                         data="{}") for i in range(n)])


def stream(client, job_id, **headers):
    r = client.get(f"/v1/jobs/{job_id}/events", headers={**SSE, **headers})
    assert r.status_code == 200, r.text
    return [(kind, json.loads(data)) for kind, data in parse_sse(iter(r.text.splitlines()))]


def test_a_resume_anywhere_in_a_long_history_gets_each_later_event_once(service, store, supervisor):
    job = submit(supervisor)
    add_notes(store, job, 2 * streams.BATCH + 3)  # more than one read of the store
    supervisor.cancel(job)  # finished: the stream ends
    ids = [e.id for e in store.list_events(job, limit=10_000)]
    with TestClient(create_app(service.config, service=service), base_url="http://127.0.0.1") as c:
        full = stream(c, job)
        assert [e["id"] for _, e in full[:-1]] == ids
        assert full[-1] == ("end", {"state": "cancelled", "last_event_id": ids[-1]})
        for cut in (ids[0], ids[streams.BATCH - 1], ids[streams.BATCH], ids[-2], ids[-1]):
            got = stream(c, job, **{"Last-Event-ID": str(cut)})
            assert [e["id"] for _, e in got[:-1]] == [i for i in ids if i > cut], cut
            assert got[-1][0] == "end"


def test_another_owners_stream_is_a_404_like_a_missing_job_and_no_token_is_a_401(service, supervisor, tmp_path):
    path = tmp_path / "tokens.json"
    alice, bob = create_token(path, "alice"), create_token(path, "bob")
    job = submit(supervisor, owner="alice")
    app = create_app(service.config, service=service, auth=AuthSettings.load(enabled=True, token_file=str(path)))
    with TestClient(app) as c:
        theirs = c.get(f"/v1/jobs/{job}/events", headers={**SSE, "Authorization": f"Bearer {bob}"})
        missing = c.get("/v1/jobs/000000000000/events", headers={**SSE, "Authorization": f"Bearer {bob}"})
        assert theirs.status_code == missing.status_code == 404
        assert theirs.headers["content-type"] == "application/problem+json"
        assert theirs.json()["detail"].replace(job, "ID") == missing.json()["detail"].replace("000000000000", "ID")
        assert c.get(f"/v1/jobs/{job}/events", headers=SSE).status_code == 401
        supervisor.cancel(job)
        mine = c.get(f"/v1/jobs/{job}/events", headers={**SSE, "Authorization": f"Bearer {alice}"})
        assert mine.status_code == 200 and "event: end" in mine.text


def test_a_quiet_stream_sends_keep_alives(service, supervisor, monkeypatch):
    monkeypatch.setattr(streams, "KEEPALIVE_S", 0.3)
    job = submit(supervisor)
    with serve_in_thread(service) as url:
        import httpx

        with httpx.stream("GET", f"{url}/v1/jobs/{job}/events", headers=SSE, timeout=10) as r:
            seen, deadline = [], time.monotonic() + 5
            for line in r.iter_lines():
                seen.append(line)
                if seen.count(": keep-alive") >= 2 or time.monotonic() > deadline:
                    break
    assert seen.count(": keep-alive") >= 2, seen


def test_a_client_that_never_reads_does_not_make_the_server_read_the_whole_history(service, store, supervisor):
    """Backpressure reaches the generator: with the socket full, it stops reading the store instead of
    buffering a history of any size in memory for a client that is not reading it."""
    job = submit(supervisor)
    add_notes(store, job, 20 * streams.BATCH, size=2_000)  # ~20 MB of events
    reads = []
    list_events = store.list_events

    def counted(job_id, **kw):
        reads.append(kw)
        return list_events(job_id, **kw)

    store.list_events = counted
    with serve_in_thread(service) as url:
        host, port = url.removeprefix("http://").split(":")
        sock = socket.create_connection((host, int(port)))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        try:
            sock.sendall(f"GET /v1/jobs/{job}/events HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         "Accept: text/event-stream\r\n\r\n".encode())
            time.sleep(3)
            stalled = len(reads)
            time.sleep(1)
            # What the kernel's socket buffers hold (a few MB on loopback), then nothing more: not 20 batches.
            assert len(reads) == stalled <= 8, f"the server read {len(reads)} batches for a client reading nothing"
        finally:
            sock.close()
        time.sleep(1.0)
        after_close = len(reads)
        time.sleep(1.5)
        assert len(reads) == after_close  # the stream stopped with the connection


def test_followed_logs_say_a_read_error_once_not_every_second(service, supervisor, monkeypatch):
    """While the nodes could not be read (Ray's control store down, say), ``logs?follow=true`` repeated the
    same error line every second for as long as it lasted; now it says it once, and says when reading works
    again."""
    import httpx

    monkeypatch.setattr(streams, "KEEPALIVE_S", 60.0)
    job = submit(supervisor)
    failing = {"on": True}
    read_logs = service.read_logs

    def flaky(*a, **kw):
        if failing["on"]:
            raise ConnectionError("the GCS at 10.0.0.1:6379 does not answer")
        return read_logs(*a, **kw)

    service.read_logs = flaky
    recovery = threading.Timer(1.5, lambda: failing.update(on=False))  # reads work again after 1.5 s
    with serve_in_thread(service) as url:
        lines: list[dict] = []
        try:
            with httpx.stream("GET", f"{url}/v1/jobs/{job}/logs", params={"follow": "true"},
                              timeout=httpx.Timeout(10.0, read=4.0)) as r:
                recovery.start()
                for raw in r.iter_lines():
                    if raw.strip():
                        lines.append(json.loads(raw))
                    if len(lines) >= 2 and not failing["on"]:
                        break
        except httpx.ReadTimeout:
            pass  # nothing more came: judged below
        recovery.join()
    errors = [x["line"] for x in lines if "could not read logs" in x["line"]]
    assert errors == ["(meridian: could not read logs: the GCS at 10.0.0.1:6379 does not answer)"], lines
    assert lines[-1] == {"rank": -1, "stream": "err", "line": "(meridian: reading logs again)"}, lines


def test_a_message_holding_unicode_line_ends_stays_on_its_data_line(service, store, supervisor):
    """JSON leaves U+2028, U+2029 and NEL (U+0085) raw inside strings, and Python's line readers split on them:
    an event whose message held one (a worker's error text) broke ``meridian events -f`` with a JSONDecodeError."""
    from meridian.api.client import Client

    job = submit(supervisor)
    odd = "before\u2028after\u2029then\x85end \x1c\r\n"
    raw_event(store, job, "note", odd, {"text": odd, odd: 1})
    supervisor.cancel(job)
    with serve_in_thread(service) as url:
        events = list(Client(url).stream_events(job))
        import httpx

        raw = httpx.get(f"{url}/v1/jobs/{job}/events", headers=SSE).text
    note = next(e for e in events if e["kind"] == "note")
    assert note["message"] == odd and note["data"] == {"text": odd, odd: 1}
    assert not {"\x85", "\u2028", "\u2029"} & set(raw)
    assert raw.endswith("\n") and raw.splitlines() == raw.split("\n")[:-1]  # every reader sees the same lines


def test_open_streams_end_when_the_server_is_told_to_exit(service, supervisor, monkeypatch):
    # uvicorn waits for every connection to close; a stream of a running job never closed by itself, so the
    # server did not stop (`meridian serve` with one follower had not stopped 20 s after its Ctrl-C).
    import httpx

    monkeypatch.setattr(streams, "KEEPALIVE_S", 0.2)  # each stream says something soon: both are open
    job = submit(supervisor)
    lines: dict[str, list[str]] = {"events": [], "logs": []}
    ended: dict[str, float] = {}

    def follow(kind: str, url: str) -> None:
        path = f"/v1/jobs/{job}/events" if kind == "events" else f"/v1/jobs/{job}/logs?follow=true"
        with httpx.stream("GET", url + path, headers=SSE, timeout=30) as r:
            for line in r.iter_lines():
                lines[kind].append(line)
        ended[kind] = time.monotonic()

    with serve_in_thread(service) as url:
        followers = [threading.Thread(target=follow, args=(k, url), daemon=True) for k in lines]
        for t in followers:
            t.start()
        deadline = time.monotonic() + 10
        while not (lines["events"] and lines["logs"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        told = time.monotonic()
    stopped = time.monotonic() - told
    for t in followers:
        t.join(5)
    assert stopped < 5, f"the server took {stopped:.1f} s to stop"
    assert set(ended) == {"events", "logs"} and max(ended.values()) - told < 5, ended
    assert "the service is stopping" in lines["logs"][-1]
