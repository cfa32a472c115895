"""The FastAPI application: routes, error handlers, and the control plane's lifespan."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response
from starlette.types import Scope

import meridian
from meridian.api.auth import AuthSettings, LoopbackHostOnly, get_caller
from meridian.api.errors import UnexpectedErrors, install_error_handlers
from meridian.api.limits import DEFAULT_MAX_BODY_BYTES, BodySizeLimit
from meridian.api.prometheus import install_metrics
from meridian.api.request_id import RequestId
from meridian.api.routes import cluster, diagnostics, jobs, profiles, quotas
from meridian.api.streams import DEFAULT_MAX_STREAMS_PER_OWNER, StreamSlots
from meridian.service.core import MeridianService, ServiceConfig

STATIC = Path(__file__).parent / "static"
# The page's policy: its own script and styles only (an injected <script> or onerror= never runs), requests
# only to this service, no framing by another site. (Browser tests that evaluate strings in the page, as
# Playwright's wait_for_function does, open it with the policy bypassed; the policy's own test does not.)
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


class PageFiles(StaticFiles):
    """The page's assets, with the page's headers: ``/static/index.html`` is the page too, and must not be a
    way around its policy."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(PAGE_HEADERS)
        return response


def create_app(
    config: ServiceConfig, *, service: MeridianService | None = None, auth: AuthSettings | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_streams_per_owner: int = DEFAULT_MAX_STREAMS_PER_OWNER,
) -> FastAPI:
    """An app that starts (and on shutdown stops) a :class:`MeridianService` for ``config``.

    Pass ``service`` to serve one that is already started (tests, the demo); the app then leaves its
    life cycle to the caller. ``auth`` off (the default) suits a loopback-only workstation; every route
    but ``/healthz`` checks the bearer token when it is on.
    """
    owned = service is None
    service = service or MeridianService(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if owned:
            await run_in_threadpool(service.start)
        try:
            yield
        finally:
            if owned:
                await run_in_threadpool(service.stop)

    app = FastAPI(
        title="Meridian", version=meridian.__version__, lifespan=lifespan,
        description="Train one model across several datacenters as if they were one.",
    )
    app.state.service = service
    app.state.auth = auth or AuthSettings()
    app.state.job_pages = jobs.JobPageCache()
    app.state.stopping = threading.Event()  # set when the server is told to exit: open streams end (api.server)
    app.state.stream_slots = StreamSlots(max_streams_per_owner)  # event streams and followed logs, per owner
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    if not app.state.auth.enabled:
        app.add_middleware(LoopbackHostOnly)
    install_metrics(app, lambda: service.store.count_by_state() if service.store is not None else None)
    app.add_middleware(UnexpectedErrors)  # an unhandled exception: a 500 with the id, counted by the metrics
    app.add_middleware(RequestId)  # outermost: every answer, a refusal, a 413 or a 500 too, carries the id
    for router in (jobs.router, profiles.router, cluster.router, diagnostics.router, quotas.router):
        app.include_router(router, dependencies=[Depends(get_caller)])

    @app.get("/healthz", tags=["health"])
    def healthz() -> JSONResponse:
        """``ok``, ``starting``, ``degraded`` (some jobs cannot be followed) or ``failing`` (503: the
        supervisor's ticks fail), with the problems in words; no error text that could carry others' data."""
        sup = service.supervisor
        health = sup.health() if sup is not None else {"status": "starting", "problems": [], "jobs_failing": 0}
        return JSONResponse({**health, "version": meridian.__version__},
                            status_code=503 if health["status"] == "failing" else 200)

    app.mount("/static", PageFiles(directory=STATIC), name="static")

    @app.get("/", include_in_schema=False)
    def index() -> FileResponse:
        """The live page: jobs, datacenter map, loss/throughput charts (assets ship with the package).
        Its policy lets it run only its own script and talk only to this service, and no other site frame it."""
        return FileResponse(STATIC / "index.html", headers=PAGE_HEADERS)

    return app
