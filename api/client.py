"""A small HTTP client of the REST API, shared by the CLI and the demo."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from meridian.api.problems import PROBLEM_TYPE, local_problem

DEFAULT_URL = "http://127.0.0.1:8080"
TERMINAL_STATES = frozenset({"succeeded", "failed", "cancelled"})


class ApiError(RuntimeError):
    """The service answered with an error (``status``: its HTTP status), or it could not be asked (``status`` 0);
    ``str()`` is the ``detail``, ``problem`` the whole RFC 9457 problem: the service's body as it sent it, or one
    of the same shape naming ``kind`` (a slug) for an error on this side."""

    def __init__(self, status: int, detail: str, *, kind: str = "", problem: dict[str, Any] | None = None) -> None:
        super().__init__(detail)
        self.status = status
        if problem is None:
            problem = (local_problem(kind or "client-error", kind.replace("-", " ").capitalize() or "Client error", detail)
                       if status == 0 else {"type": PROBLEM_TYPE + "http-error", "title": f"HTTP {status}",
                                            "status": status, "detail": detail})
        self.problem = problem


class Client:
    def __init__(self, url: str | None = None, *, token: str | None = None, timeout: float = 30.0) -> None:
        self.url = (url or os.environ.get("MERIDIAN_URL") or DEFAULT_URL).rstrip("/")
        token = token or os.environ.get("MERIDIAN_TOKEN")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, timeout=timeout, headers=headers)

    @contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except httpx.ConnectError:
            raise ApiError(0, f"cannot reach the Meridian service at {self.url}: is `meridian serve` running? "
                              "(set --url or MERIDIAN_URL)", kind="service-unreachable") from None
        except httpx.TimeoutException:
            raise ApiError(0, f"the Meridian service at {self.url} did not answer in time",
                           kind="service-timeout") from None
        except httpx.RemoteProtocolError as e:
            raise ApiError(0, f"the connection to {self.url} broke: {e}", kind="connection-broken") from None

    @staticmethod
    def _raise_for(r: httpx.Response) -> None:
        if r.status_code >= 400:
            try:
                body = r.json()
            except ValueError:
                body = None
            if isinstance(body, dict) and "detail" in body:  # the service's problem (or a proxy's JSON error)
                raise ApiError(r.status_code, str(body["detail"]), problem={"status": r.status_code, **body})
            raise ApiError(r.status_code, r.text or f"HTTP {r.status_code} with an empty body")

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        with self._errors():
            r = self._http.request(method, path, **kwargs)
        self._raise_for(r)
        return r.json() if r.content else None

    def stream_events(self, job_id: str, after: int = 0, *, reconnects: int = 5) -> Iterator[dict[str, Any]]:
        """A job's events live (Server-Sent Events) until it ends. A dropped connection is resumed with
        ``Last-Event-ID``, so no event is lost or repeated."""
        last, failures = after, 0
        while True:
            headers = {"Accept": "text/event-stream", "Last-Event-ID": str(last)}
            try:
                with self._errors(), self._http.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers,
                                                       timeout=httpx.Timeout(30.0, read=60.0)) as r:
                    if r.status_code >= 400:
                        r.read()
                        self._raise_for(r)
                    for kind, data in parse_sse(r.iter_lines()):
                        if kind == "end":
                            return
                        event = json.loads(data)
                        last = event["id"]
                        failures = 0
                        yield event
            except ApiError as e:
                if e.status or failures >= reconnects:
                    raise
            # The stream ended without its `end` event: the connection dropped; resume after `last`.
            failures += 1
            if failures > reconnects:
                raise ApiError(0, f"the event stream of job {job_id} dropped {failures} times in a row; giving up",
                               kind="event-stream-dropped")
            time.sleep(min(0.5 * 2**failures, 8.0))

    def follow_logs(self, job_id: str, **params: Any) -> Iterator[dict[str, Any]]:
        """Worker log lines as they are written, until the job ends."""
        with self._errors(), self._http.stream("GET", f"/v1/jobs/{job_id}/logs", params={**params, "follow": "true"},
                                               timeout=httpx.Timeout(30.0, read=120.0)) as r:
            if r.status_code >= 400:
                r.read()
                self._raise_for(r)
            for line in r.iter_lines():
                if line.strip():
                    yield json.loads(line)

    def submit(self, spec: dict[str, Any], *, idempotency_key: str | None = None) -> dict[str, Any]:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self.request("POST", "/v1/jobs", json=spec, headers=headers)

    def job(self, job_id: str) -> dict[str, Any]:
        return self.request("GET", f"/v1/jobs/{job_id}")

    def wait(self, job_id: str, *, timeout_s: float, interval_s: float = 1.0) -> dict[str, Any]:
        """Poll job ``job_id`` until it ends; the job as the API returns it. ``ApiError`` (status 0, kind
        ``watch-timeout``) when it has not ended after ``timeout_s`` seconds: the job keeps running."""
        deadline = time.monotonic() + timeout_s
        while (job := self.job(job_id))["state"] not in TERMINAL_STATES:
            if time.monotonic() > deadline:
                raise ApiError(0, f"job {job_id} still {job['state']} after {timeout_s:.0f} s ({job['message']})",
                               kind="watch-timeout")
            time.sleep(interval_s)
        return job

    def jobs(self, **params: Any) -> dict[str, Any]:
        return self.request("GET", "/v1/jobs", params=params)

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self.request("DELETE", f"/v1/jobs/{job_id}")

    def cluster(self) -> dict[str, Any]:
        return self.request("GET", "/v1/cluster")

    def plan(self, spec: dict[str, Any]) -> dict[str, Any]:
        return self.request("POST", "/v1/plans", json=spec)

    def probe_links(self, tiers: list[str] | None, max_bytes: int, *, timeout_s: float = 600.0) -> dict[str, Any]:
        """Run the collective benchmark on the cluster's link tiers (the planner uses the result)."""
        body: dict[str, Any] = {"max_bytes": max_bytes, **({"tiers": tiers} if tiers else {})}
        return self.request("POST", "/v1/diagnostics/collectives", json=body, timeout=timeout_s)

    def probe_compute(self, spec: dict[str, Any], *, timeout_s: float = 600.0) -> dict[str, Any]:
        """Measure the job spec's model and micro-batch on every worker slot (the planner uses the result)."""
        return self.request("POST", "/v1/diagnostics/compute", json=spec, timeout=timeout_s)

    def events(self, job_id: str, after: int = 0, newest: int | None = None) -> dict[str, Any]:
        """The first page of events after ``after``, or with ``newest`` the last ``newest`` of them (and
        ``earlier``, how many come before)."""
        params: dict[str, Any] = {"after": after}
        if newest is not None:
            params["newest"] = newest
        return self.request("GET", f"/v1/jobs/{job_id}/events", params=params)

    def logs(self, job_id: str, **params: Any) -> dict[str, Any]:
        return self.request("GET", f"/v1/jobs/{job_id}/logs", params=params)

    def metrics(self, job_id: str) -> dict[str, Any]:
        return self.request("GET", f"/v1/jobs/{job_id}/metrics")

    def artifacts(self, job_id: str) -> dict[str, Any]:
        return self.request("GET", f"/v1/jobs/{job_id}/artifacts")

    def health(self) -> dict[str, Any]:
        return self.request("GET", "/healthz")

    def profile(self, job_id: str, steps: int, ranks: list[int]) -> dict[str, Any]:
        """Ask ranks of a running job for a profiler trace of their next ``steps`` steps."""
        return self.request("POST", f"/v1/jobs/{job_id}/profile", json={"steps": steps, "ranks": ranks})

    def profiles(self, job_id: str) -> dict[str, Any]:
        return self.request("GET", f"/v1/jobs/{job_id}/profiles")

    def download(self, path: str, out: str) -> int:
        """Write what GET ``path`` answers to the file ``out``; its bytes."""
        written = 0
        with self._errors(), self._http.stream("GET", path, timeout=httpx.Timeout(30.0, read=300.0)) as r:
            if r.status_code >= 400:
                r.read()
                self._raise_for(r)
            with open(out, "wb") as f:
                for chunk in r.iter_bytes():
                    f.write(chunk)
                    written += len(chunk)
        return written

    def close(self) -> None:
        self._http.close()


def parse_sse(lines: Iterator[str]) -> Iterator[tuple[str, str]]:
    """(event, data) for each message of a Server-Sent Events stream (comments and ``retry`` skipped)."""
    kind, data = "message", []
    for line in lines:
        if not line:
            if data:
                yield kind, "\n".join(data)
            kind, data = "message", []
        elif line.startswith(":"):
            continue
        else:
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "event":
                kind = value
            elif name == "data":
                data.append(value)
