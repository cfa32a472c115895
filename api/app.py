"""The FastAPI application: routes, error handlers, and the control plane's lifespan."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

import meridian
from meridian.api.errors import install_error_handlers
from meridian.api.routes import cluster, diagnostics, jobs
from meridian.service.core import MeridianService, ServiceConfig


def create_app(config: ServiceConfig, *, service: MeridianService | None = None) -> FastAPI:
    """An app that starts (and on shutdown stops) a :class:`MeridianService` for ``config``.

    Pass ``service`` to serve one that is already started (tests, the demo); the app then leaves its
    life cycle to the caller.
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
    install_error_handlers(app)
    app.include_router(jobs.router)
    app.include_router(cluster.router)
    app.include_router(diagnostics.router)

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict[str, Any]:
        sup = service.supervisor
        return {"status": "ok" if sup is not None else "starting", "version": meridian.__version__,
                "last_tick_error": sup.last_tick_error if sup else ""}

    return app
