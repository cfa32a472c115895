"""A request id on every response and every log line written while serving it.

The client's ``X-Request-ID`` is echoed when it is a plain token (letters, digits, ``._:-``, at most 128),
otherwise a new one is made. Error bodies carry it too (:mod:`meridian.api.errors`), so a user can quote it
and an operator finds the matching log lines.
"""

from __future__ import annotations

import contextvars
import logging
import re
import uuid
from typing import Any

HEADER = b"x-request-id"
_SAFE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_current: contextvars.ContextVar[str] = contextvars.ContextVar("meridian_request_id", default="")
_factory_installed = False


def current_request_id() -> str:
    return _current.get()


class RequestId:
    """Pure ASGI middleware (works for streaming responses too)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        install_log_factory()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == HEADER), "")
        rid = given if _SAFE.match(given) else uuid.uuid4().hex
        _current.set(rid)  # not reset: the outermost error handler of this request still reads it

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, rid.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def install_log_factory() -> None:
    """Every log record made while a request is served ends with ``[request <id>]`` and has a
    ``request_id`` attribute (for formatters that want it elsewhere)."""
    global _factory_installed
    if _factory_installed:
        return
    previous = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        rid = _current.get()
        record.request_id = rid
        if rid and isinstance(record.msg, str):
            record.msg = f"{record.msg} [request {rid}]"
        return record

    logging.setLogRecordFactory(factory)
    _factory_installed = True
