"""Public exceptions of the control plane.

Each carries a message a person can act on. The HTTP layer maps them to status codes in exactly one place
(:mod:`meridian.api.errors`); nothing else in the service knows about HTTP.
"""

from __future__ import annotations


class MeridianError(Exception):
    """Base class: ``str(error)`` is the message shown to the user."""


class JobNotFound(MeridianError):
    def __init__(self, job_id: str) -> None:
        super().__init__(f"no job with id {job_id!r}; list jobs with GET /v1/jobs")


class InvalidJob(MeridianError):
    """The request is well-formed but asks for something that cannot make sense (e.g. 3 workers for a
    global batch of 2)."""


class Unschedulable(MeridianError):
    """The cluster can never hold this job as asked (e.g. a datacenter that does not exist)."""


class InvalidTransition(MeridianError):
    """The job is in a state where the action does not apply (e.g. cancelling a finished job)."""


class IdempotencyConflict(MeridianError):
    """An ``Idempotency-Key`` already used by this owner for a different request body."""


class ClusterUnavailable(MeridianError):
    """Ray cannot be reached right now."""


class StorageUnreadable(MeridianError):
    """The jobs' storage cannot be read right now (for a URL: credentials, endpoint, network)."""


class Forbidden(MeridianError):
    """The caller may not act on this resource."""


class Unauthorized(MeridianError):
    """No credentials, or ones the service does not know."""


class PayloadTooLarge(MeridianError):
    """The request body is larger than the service accepts."""
