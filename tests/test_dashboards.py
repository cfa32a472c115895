"""The Grafana dashboards are valid JSON and every metric a panel queries is one the code exports.

Exported names come from the code's own definitions (:data:`JOB_METRICS`, :data:`SERVICE_METRICS`), not
from a second hand-written list. Ray prefixes user metrics with ``ray_``; histograms export ``_bucket``,
``_sum`` and ``_count`` series.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from meridian.api.prometheus import SERVICE_METRICS
from meridian.service.runner.metrics import JOB_METRICS, MetricDef

DASHBOARDS = Path(__file__).parent.parent / "dashboards"
PROMQL_WORDS = {"rate", "irate", "increase", "sum", "by", "without", "avg", "max", "min", "count", "le",
                "histogram_quantile", "topk", "bottomk", "on", "ignoring", "group_left", "group_right", "and",
                "or", "unless", "offset", "delta", "deriv", "label_values"}


def series_names(defs: tuple[MetricDef, ...], prefix: str = "") -> set[str]:
    names = set()
    for d in defs:
        names.add(prefix + d.name)
        if d.kind == "histogram":
            names |= {f"{prefix}{d.name}_{s}" for s in ("bucket", "sum", "count")}
    return names


EXPORTED = series_names(JOB_METRICS, "ray_") | series_names(SERVICE_METRICS)


def queried_metrics(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers outside strings, {matchers}, [ranges] and
    ``by (labels)`` clauses that are neither keywords nor function calls."""
    stripped = re.sub(r'"[^"]*"', "", expr)
    stripped = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", stripped)
    stripped = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", stripped)
    stripped = re.sub(r"[A-Za-z_][A-Za-z0-9_]*\s*\(", "(", stripped)  # function names
    idents = re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", stripped)
    return {i for i in idents if i not in PROMQL_WORDS and not re.fullmatch(r"[0-9.e]+", i)}


def dashboards() -> list[Path]:
    return sorted(DASHBOARDS.glob("*.json"))


def test_there_are_dashboards_for_jobs_and_the_service():
    assert {p.name for p in dashboards()} >= {"meridian_jobs.json", "meridian_service.json"}


@pytest.mark.parametrize("path", dashboards(), ids=lambda p: p.name)
def test_dashboard_is_valid_and_queries_only_exported_metrics(path):
    board = json.loads(path.read_text())
    assert board["uid"] and board["title"] and board["panels"]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    queried = set()
    for panel in board["panels"]:
        assert panel["targets"], f"panel {panel['title']!r} queries nothing"
        for t in panel["targets"]:
            names = queried_metrics(t["expr"])
            assert names, f"no metric in {t['expr']!r}"
            unknown = names - EXPORTED
            assert not unknown, f"panel {panel['title']!r} queries {sorted(unknown)}, which the code does not export"
            queried |= names
    for var in board.get("templating", {}).get("list", []):
        if var["type"] == "query":  # Grafana's label_values(metric{...}, label)
            metric = re.match(r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)", var["query"])
            assert metric and metric.group(1) in EXPORTED, var["query"]


def test_every_job_metric_has_a_panel():
    queried = set()
    for path in dashboards():
        for panel in json.loads(path.read_text())["panels"]:
            for t in panel["targets"]:
                queried |= queried_metrics(t["expr"])
    missing = {d.name for d in JOB_METRICS + SERVICE_METRICS} - {
        q.removeprefix("ray_").removesuffix("_bucket") for q in queried}
    assert not missing, f"exported but on no dashboard: {sorted(missing)}"


def test_parser_finds_metric_names():
    expr = 'histogram_quantile(0.95, sum by (le, job_id) (rate(ray_x_bucket{job_id=~"$job"}[5m])))'
    assert queried_metrics(expr) == {"ray_x_bucket"}


def test_scrape_config_targets_ray_discovery_and_the_service():
    text = (DASHBOARDS / "prometheus.yml").read_text()
    assert "/tmp/ray/prom_metrics_service_discovery.json" in text
    assert "metrics_path: /metrics" in text
