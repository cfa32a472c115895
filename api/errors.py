"""Service exceptions → HTTP responses, in exactly one place.

Every error body is ``{"detail": "<what went wrong and what to do>"}``; validation errors also carry the
field-level list under ``errors``. No traceback ever reaches a client.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from meridian.service.errors import (
    ClusterUnavailable,
    Forbidden,
    IdempotencyConflict,
    InvalidJob,
    InvalidTransition,
    JobNotFound,
    MeridianError,
    PayloadTooLarge,
    Unauthorized,
    Unschedulable,
)

log = logging.getLogger(__name__)

STATUS: dict[type[MeridianError], int] = {
    JobNotFound: 404,
    InvalidJob: 422,
    Unschedulable: 409,
    InvalidTransition: 409,
    IdempotencyConflict: 422,
    Forbidden: 403,
    ClusterUnavailable: 503,
    Unauthorized: 401,
    PayloadTooLarge: 413,
}


def _field_errors(exc: RequestValidationError) -> tuple[str, list[dict]]:
    parts, errors = [], []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x not in ("body",))
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
        errors.append({"field": loc, "message": msg, "type": err.get("type", "")})
    return "; ".join(parts) or "invalid request", errors


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(MeridianError)
    async def _meridian(_: Request, exc: MeridianError) -> JSONResponse:
        status = next((code for cls, code in STATUS.items() if isinstance(exc, cls)), 400)
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        return JSONResponse({"detail": str(exc)}, status_code=status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        detail, errors = _field_errors(exc)
        return JSONResponse({"detail": detail, "errors": errors}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return JSONResponse({"detail": detail}, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(
            {"detail": f"internal error ({type(exc).__name__}); the service log has the details"}, status_code=500,
        )
