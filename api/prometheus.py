"""The service's own Prometheus ``/metrics``: HTTP requests, queue length, jobs by state.

Not to be confused with ``GET /v1/jobs/{id}/metrics`` (a job's stored training series) nor with the job
metrics the runners export on the Ray metrics endpoint (:mod:`meridian.service.runner.metrics`). Each app gets
its own registry, so several apps in one process (tests) never clash. :data:`SERVICE_METRICS` is the one
list of names the dashboards test checks panels against.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from fastapi import FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from meridian.service.jobs import JobState
from meridian.service.runner.metrics import MetricDef

SERVICE_METRICS: tuple[MetricDef, ...] = (
    MetricDef("meridian_service_http_requests_total", "counter", "HTTP requests served",
              tags=("method", "route", "status")),
    MetricDef("meridian_service_http_request_duration_seconds", "histogram", "HTTP request latency",
              tags=("method", "route"), boundaries=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)),
    MetricDef("meridian_service_queue_length", "gauge", "Jobs queued, waiting for admission", tags=()),
    MetricDef("meridian_service_jobs", "gauge", "Jobs in each state", tags=("state",)),
)
_DEFS = {d.name: d for d in SERVICE_METRICS}
log = logging.getLogger(__name__)


class _JobsCollector(Collector):
    """Reads the store at scrape time, so the gauges are never stale and cost nothing between scrapes."""

    def __init__(self, counts: Callable[[], dict[JobState, int] | None]) -> None:
        self.counts = counts

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            counts = self.counts()
        except Exception as e:  # noqa: BLE001 - the store failing must not take the request metrics down with it
            # A scrape that fails loses every series: the request counts that show the outage too. Export the
            # rest, without these gauges (a gap on the dashboard), and say why in the log.
            log.warning("/metrics: jobs by state left out, the job store could not be read: %s: %s",
                        type(e).__name__, e)
            return
        if counts is None:  # the service is still starting: export nothing rather than zeros
            return
        queue = _DEFS["meridian_service_queue_length"]
        yield GaugeMetricFamily(queue.name, queue.description, value=counts.get(JobState.QUEUED, 0))
        jobs = _DEFS["meridian_service_jobs"]
        family = GaugeMetricFamily(jobs.name, jobs.description, labels=list(jobs.tags))
        for state, n in sorted(counts.items(), key=lambda kv: kv[0].value):
            family.add_metric([state.value], n)
        yield family


HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
"""Methods counted under their own name; any other (a client may send any token as a method) is ``OTHER``,
so requests cannot grow the label set without bound."""


def method_label(method: str) -> str:
    return method if method in HTTP_METHODS else "OTHER"


def route_label(scope: dict[str, Any]) -> str:
    """The route template that served a request (never the raw path: job ids would explode the label set),
    the mount's prefix for a mounted app (``/static``), or ``unmatched``."""
    path = getattr(scope.get("route"), "path", None)
    if path:
        return str(path)
    if "app_root_path" not in scope:  # only a matched Mount sets it
        return "unmatched"
    root, app_root = scope.get("root_path", ""), scope["app_root_path"]
    if root != app_root and root.startswith(app_root):
        return root[len(app_root):] or "unmatched"  # the prefix of a mount the code declares
    return "unmatched"


def install_metrics(app: FastAPI, counts: Callable[[], dict[JobState, int] | None]) -> CollectorRegistry:
    """Count every request by route template (not raw path: job ids would explode the label set) and
    serve ``GET /metrics`` in the Prometheus text format."""
    registry = CollectorRegistry()
    req, dur = _DEFS["meridian_service_http_requests_total"], _DEFS["meridian_service_http_request_duration_seconds"]
    # prometheus_client appends _total itself to a counter's name.
    requests = Counter(req.name.removesuffix("_total"), req.description, list(req.tags), registry=registry)
    latency = Histogram(dur.name, dur.description, list(dur.tags), buckets=dur.boundaries, registry=registry)
    registry.register(_JobsCollector(counts))

    @app.middleware("http")
    async def count_requests(request: Request, call_next: Callable[[Request], Any]) -> Response:
        t0 = time.perf_counter()
        status = "500"  # an exception no handler took: answered as a 500 outside this middleware
        try:
            response = await call_next(request)
            status = str(response.status_code)
        finally:
            method, route = method_label(request.method), route_label(request.scope)
            requests.labels(method, route, status).inc()
            latency.labels(method, route).observe(time.perf_counter() - t0)
        return response

    @app.get("/metrics", tags=["health"], include_in_schema=True)
    def prometheus_metrics() -> Response:
        """The service's metrics in the Prometheus text format (scrape config: ``dashboards/prometheus.yml``)."""
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return registry
