"""Request size limit, enforced before a body is parsed.

A job spec is a few kilobytes; anything near the limit is a mistake or an attack. The limit is checked on
``Content-Length`` and again while a chunked body streams in, so neither form can make the service buffer
more than ``max_bytes``.
"""

from __future__ import annotations

from typing import Any

from meridian.api.errors import send_problem

DEFAULT_MAX_BODY_BYTES = 1 * 2**20


class BodySizeLimit:
    def __init__(self, app: Any, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _message(self) -> str:
        return f"request body larger than {self.max_bytes} bytes; a job spec is a few kB, send less"

    async def _reject(self, scope: dict, send: Any) -> None:
        await send_problem(send, 413, self._message(), instance=scope.get("path", ""))

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    too_big = int(value) > self.max_bytes
                except ValueError:
                    too_big = False  # the server rejects a malformed length itself
                if too_big:
                    await self._reject(scope, send)
                    return
        # Read the (bounded) body before the app sees it, then replay it: the app never holds more than
        # max_bytes, and later receive() calls (disconnect detection of event streams) go to the server.
        chunks, seen = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay(message, receive), send)
                return
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.max_bytes:
                await self._reject(scope, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay(body, receive), send)


def _replay(first: dict, receive: Any) -> Any:
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return first
        return await receive()

    return replay
