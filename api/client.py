"""A small HTTP client of the REST API, shared by the CLI and the demo."""

from __future__ import annotations

import os
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:8080"


class ApiError(RuntimeError):
    """The service answered with an error; ``str()`` is its ``detail``."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status


class Client:
    def __init__(self, url: str | None = None, *, token: str | None = None, timeout: float = 30.0) -> None:
        self.url = (url or os.environ.get("MERIDIAN_URL") or DEFAULT_URL).rstrip("/")
        token = token or os.environ.get("MERIDIAN_TOKEN")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, timeout=timeout, headers=headers)

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            r = self._http.request(method, path, **kwargs)
        except httpx.ConnectError:
            raise ApiError(0, f"cannot reach the Meridian service at {self.url}: is `meridian serve` running? "
                              "(set --url or MERIDIAN_URL)") from None
        except httpx.TimeoutException:
            raise ApiError(0, f"the Meridian service at {self.url} did not answer in time") from None
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail", r.text)
            except ValueError:
                detail = r.text
            raise ApiError(r.status_code, str(detail))
        return r.json() if r.content else None

    def submit(self, spec: dict[str, Any], *, idempotency_key: str | None = None) -> dict[str, Any]:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self.request("POST", "/v1/jobs", json=spec, headers=headers)

    def job(self, job_id: str) -> dict[str, Any]:
        return self.request("GET", f"/v1/jobs/{job_id}")

    def jobs(self, **params: Any) -> dict[str, Any]:
        return self.request("GET", "/v1/jobs", params=params)

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self.request("DELETE", f"/v1/jobs/{job_id}")

    def cluster(self) -> dict[str, Any]:
        return self.request("GET", "/v1/cluster")

    def plan(self, spec: dict[str, Any]) -> dict[str, Any]:
        return self.request("POST", "/v1/plans", json=spec)

    def events(self, job_id: str, after: int = 0) -> dict[str, Any]:
        return self.request("GET", f"/v1/jobs/{job_id}/events", params={"after": after})

    def metrics(self, job_id: str) -> dict[str, Any]:
        return self.request("GET", f"/v1/jobs/{job_id}/metrics")

    def health(self) -> dict[str, Any]:
        return self.request("GET", "/healthz")

    def close(self) -> None:
        self._http.close()
