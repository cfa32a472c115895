"""The dashboards beyond metric names: every label a panel filters, groups or titles by is one its metric
carries, and the files that dashboards/README.md sends a reader to exist."""

from __future__ import annotations

import json
import re

import pytest
from test_dashboards import DASHBOARDS, dashboards, queried_metrics

from meridian.api.prometheus import SERVICE_METRICS
from meridian.service.runner.metrics import JOB_METRICS

ROOT = DASHBOARDS.parent


def labels_by_series() -> dict[str, set[str]]:
    labels: dict[str, set[str]] = {}
    for prefix, defs in (("ray_", JOB_METRICS), ("", SERVICE_METRICS)):
        for d in defs:
            labels[prefix + d.name] = set(d.tags)
            if d.kind == "histogram":
                labels[f"{prefix}{d.name}_bucket"] = set(d.tags) | {"le"}
                labels[f"{prefix}{d.name}_sum"] = labels[f"{prefix}{d.name}_count"] = set(d.tags)
    return labels


@pytest.mark.parametrize("path", dashboards(), ids=lambda p: p.name)
def test_panels_use_only_labels_their_metrics_carry(path):
    known = labels_by_series()
    for panel in json.loads(path.read_text())["panels"]:
        for t in panel["targets"]:
            expr = t["expr"]
            carried = set().union(*(known[n] for n in queried_metrics(expr)))
            used = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)\s*\"", expr))
            kept = None
            for group in re.findall(r"\b(by|without)\s*\(([^)]*)\)", expr):
                names = {g.strip() for g in group[1].split(",") if g.strip()}
                used |= names
                if group[0] == "by":
                    kept = names - {"le"} if kept is None else kept & names
            legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", t.get("legendFormat", "")))
            assert used | legend <= carried, (panel["title"], sorted((used | legend) - carried))
            if kept is not None:  # a legend can only name what the aggregation kept
                assert legend <= kept, (panel["title"], sorted(legend - kept))


def test_the_readme_names_files_that_exist():
    """It sent readers to service/job_metrics.py for the job metrics' names, a file that does not exist."""
    text = (DASHBOARDS / "README.md").read_text()
    paths = set(re.findall(r"`((?:service|api|tests|dashboards)/[\w/.-]+\.(?:py|json|yml))`", text))
    assert paths, "the README names no file"
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"dashboards/README.md names files that do not exist: {missing}"
