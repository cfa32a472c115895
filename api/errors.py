"""Service exceptions → HTTP responses, in exactly one place.

Every error is an RFC 9457 problem (``application/problem+json``): ``type`` (a URN naming the kind of
problem), ``title``, ``status``, ``detail`` (what went wrong and what to do), ``instance`` (the path) and the
``request_id`` of the request; validation errors also carry the field-level list under ``errors``. No
traceback ever reaches a client.
"""

from __future__ import annotations

import json
import logging
import re
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from meridian.api.problems import PROBLEM_TYPE
from meridian.api.request_id import current_request_id
from meridian.service.errors import (
    ClusterUnavailable,
    Forbidden,
    IdempotencyConflict,
    InvalidJob,
    InvalidTransition,
    JobNotFound,
    MeridianError,
    PayloadTooLarge,
    StorageUnreadable,
    Unauthorized,
    Unschedulable,
)

log = logging.getLogger(__name__)


class TooManyStreams(MeridianError):
    """An owner already holds as many event streams and followed logs open as the service allows
    (:class:`meridian.api.streams.StreamSlots`)."""


RETRY_AFTER_S = {TooManyStreams: 5}
"""What a refusal that passes by itself tells the client to wait (``Retry-After``, seconds)."""

STATUS: dict[type[MeridianError], int] = {
    JobNotFound: 404,
    InvalidJob: 422,
    Unschedulable: 409,
    InvalidTransition: 409,
    IdempotencyConflict: 422,
    Forbidden: 403,
    ClusterUnavailable: 503,
    StorageUnreadable: 503,
    Unauthorized: 401,
    PayloadTooLarge: 413,
    TooManyStreams: 429,
}


def _field_errors(exc: RequestValidationError) -> tuple[str, list[dict]]:
    parts, errors = [], []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x not in ("body",))
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
        errors.append({"field": loc, "message": msg, "type": err.get("type", "")})
    return "; ".join(parts) or "invalid request", errors


PROBLEM_JSON = "application/problem+json"


def problem_body(status: int, detail: str, *, kind: str = "", instance: str = "", **extra: Any) -> dict[str, Any]:
    """The RFC 9457 fields of a problem; ``kind`` names its type (default: the HTTP status phrase)."""
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Error"
    slug = re.sub(r"(?<!^)(?=[A-Z])", "-", kind).lower() if kind else phrase.lower().replace(" ", "-")
    body = {"type": PROBLEM_TYPE + slug, "title": phrase, "status": status, "detail": detail}
    if instance:
        body["instance"] = instance
    rid = current_request_id()
    if rid:
        body["request_id"] = rid
    return {**body, **extra}


def problem(request: Request | None, status: int, detail: str, *, kind: str = "",
            headers: dict[str, str] | None = None, **extra: Any) -> JSONResponse:
    instance = request.url.path if request is not None else ""
    return JSONResponse(problem_body(status, detail, kind=kind, instance=instance, **extra), status_code=status,
                        headers=headers, media_type=PROBLEM_JSON)


def problem_bytes(status: int, detail: str, *, instance: str = "", **extra: Any) -> bytes:
    """For responses sent below the app (the body size limit)."""
    return json.dumps(problem_body(status, detail, kind="PayloadTooLarge" if status == 413 else "",
                                   instance=instance, **extra)).encode()


async def send_problem(send: Any, status: int, detail: str, *, instance: str = "") -> None:
    """Answer with a problem from an ASGI middleware, below the app's handlers (the body size limit, the
    loopback Host check, an unhandled exception)."""
    body = problem_bytes(status, detail, instance=instance)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", PROBLEM_JSON.encode()), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(MeridianError)
    async def _meridian(request: Request, exc: MeridianError) -> JSONResponse:
        status = next((code for cls, code in STATUS.items() if isinstance(exc, cls)), 400)
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        if (wait_s := RETRY_AFTER_S.get(type(exc))) is not None:
            headers = {"Retry-After": str(wait_s)}
        return problem(request, status, str(exc), kind=type(exc).__name__, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        detail, errors = _field_errors(exc)
        return problem(request, 422, detail, kind="InvalidRequest", errors=errors)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return problem(request, exc.status_code, detail, headers=getattr(exc, "headers", None))



class UnexpectedErrors:
    """Pure ASGI middleware, just inside :class:`~meridian.api.request_id.RequestId`: an exception no handler
    took becomes a 500 problem naming the request id, logged with the traceback under that id.

    Not an ``exception_handler(Exception)``: Starlette runs that in its outermost middleware, outside every
    middleware of the app, where the request id was never set (the body said "under request id " with none, the
    response had no ``X-Request-ID``) and where the request metrics never saw the 500."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracked(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception as exc:
            rid = current_request_id()
            log.exception("unhandled error on %s %s", scope.get("method", ""), scope.get("path", ""))
            if started:  # a streamed body broke half-way: nothing more can be said on this response
                raise
            await send_problem(send, 500, f"internal error ({type(exc).__name__}); the service log has the details "
                                          f"under request id {rid}", instance=scope.get("path", ""))
