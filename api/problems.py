"""The shape of every error Meridian reports: an RFC 9457 problem whose ``type`` starts with :data:`PROBLEM_TYPE`.

The service sends them (:mod:`meridian.api.errors`); the HTTP client (:mod:`meridian.api.client`) and the CLI make
ones of the same shape for errors on their side (the service unreachable, a spec file that does not parse)."""

from __future__ import annotations

from typing import Any

PROBLEM_TYPE = "urn:meridian:problem:"
"""The prefix of every problem's ``type``, the service's and the client's."""


def local_problem(kind: str, title: str, detail: str, **extra: Any) -> dict[str, Any]:
    """A problem found on the client's side of the API; ``kind`` is a slug (``service-unreachable``)."""
    return {"type": PROBLEM_TYPE + kind, "title": title, "detail": detail, **extra}
