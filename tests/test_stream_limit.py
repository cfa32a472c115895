"""An owner may hold only so many event streams and followed logs open at once: one more is a 429 saying what to
close, the slot comes back when a stream ends however it ends, and one owner's streams never refuse another's."""

from __future__ import annotations

import asyncio
import gc
import socket
import time

import httpx
import pytest
from fakes import submit

from meridian.api import streams
from meridian.api.auth import AuthSettings, create_token
from meridian.api.errors import TooManyStreams
from meridian.api.server import serve_in_thread
from meridian.cli.main import build_parser

SSE = {"Accept": "text/event-stream"}


def _open(url: str, path: str, token: str | None = None) -> socket.socket:
    """A follower that sent its request and reads nothing: its stream stays open until the socket closes."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n{auth}\r\n".encode())
    assert sock.recv(64).startswith(b"HTTP/1.1 200"), "the stream did not start"
    return sock


def _status(url: str) -> int:
    """The status a stream starts with (the stream then closed, freeing its slot)."""
    with httpx.stream("GET", url, headers=SSE, timeout=10) as r:
        return r.status_code


def _until(check, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_one_stream_past_the_limit_is_a_429_and_a_closed_one_gives_its_slot_back(service, supervisor, monkeypatch):
    monkeypatch.setattr(streams, "KEEPALIVE_S", 0.2)
    job = submit(supervisor)
    with serve_in_thread(service, max_streams_per_owner=2) as url:
        events, logs = f"/v1/jobs/{job}/events", f"/v1/jobs/{job}/logs?follow=true"
        first, second = _open(url, events), _open(url, logs)  # event streams and followed logs count together
        for path, headers in ((events, SSE), (logs, {})):
            refused = httpx.get(url + path, headers=headers, timeout=10)
            assert refused.status_code == 429, refused.text
            assert refused.headers["content-type"] == "application/problem+json"
            assert refused.headers["retry-after"] == "5"
            body = refused.json()
            assert body["type"] == "urn:meridian:problem:too-many-streams"
            assert "holds 2 event streams and followed logs open" in body["detail"]
            assert "--max-streams-per-owner" in body["detail"]
        # Reading without following is not a stream: it is never refused.
        assert httpx.get(url + f"/v1/jobs/{job}/events", timeout=10).status_code == 200
        assert httpx.get(url + f"/v1/jobs/{job}/logs", timeout=10).status_code == 200
        first.close()  # a follower goes away: the server notices at its next poll and frees the slot
        _until(lambda: _status(url + events) == 200)
        second.close()
        supervisor.cancel(job)  # a stream that ends by itself frees its slot too
        for _ in range(5):
            r = httpx.get(url + events, headers=SSE, timeout=10)
            assert r.status_code == 200 and "event: end" in r.text


def test_one_owner_at_the_limit_does_not_refuse_another(service, supervisor, tmp_path, monkeypatch):
    monkeypatch.setattr(streams, "KEEPALIVE_S", 0.2)
    path = tmp_path / "tokens.json"
    alice, bob = create_token(path, "alice"), create_token(path, "bob")
    theirs, mine = submit(supervisor, owner="alice"), submit(supervisor, owner="bob")
    auth = AuthSettings.load(enabled=True, token_file=str(path))
    with serve_in_thread(service, auth=auth, max_streams_per_owner=1) as url:
        held = _open(url, f"/v1/jobs/{theirs}/events", alice)
        try:
            again = httpx.get(f"{url}/v1/jobs/{theirs}/events", headers={**SSE, "Authorization": f"Bearer {alice}"},
                              timeout=10)  # fmt: skip
            assert again.status_code == 429 and "owner 'alice'" in again.json()["detail"]
            other = _open(url, f"/v1/jobs/{mine}/events", bob)
            other.close()
        finally:
            held.close()


def test_a_stream_dropped_before_its_first_byte_or_failing_gives_its_slot_back() -> None:
    slots = streams.StreamSlots(per_owner=1)

    async def body():
        yield "a"
        raise RuntimeError("the store went away")

    dropped = slots.hold("", body())
    with pytest.raises(TooManyStreams):
        slots.hold("", body())
    del dropped  # a response never sent (its client left first): its body was never iterated
    gc.collect()
    assert slots.open_count("") == 0

    async def drain():
        async for _ in slots.hold("", body()):
            pass

    with pytest.raises(RuntimeError, match="the store went away"):
        asyncio.run(drain())
    assert slots.open_count("") == 0
    with pytest.raises(ValueError, match="at least 1"):
        streams.StreamSlots(per_owner=0)


def test_serve_documents_the_limit_it_applies() -> None:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    text = serve.format_help().replace("\n", " ")
    assert f"default: {streams.DEFAULT_MAX_STREAMS_PER_OWNER}," in " ".join(text.split())
