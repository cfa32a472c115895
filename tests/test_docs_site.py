"""The documentation site builds with ``mkdocs build --strict`` (a broken link or anchor, a page missing from the
navigation, a Reference page the hook cannot generate: each fails it), and the built pages load nothing from
outside: no script, stylesheet, font or image from another host, so the site works offline."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                           "-d", str(out)], capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return out


class _Assets(HTMLParser):
    """Every URL a page loads by itself: ``src`` of any element, ``href`` of a ``<link>`` (a stylesheet, an icon, a
    preconnect), ``url(...)`` in inline styles. An ``<a href>`` is a link a reader may follow, not an asset."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        for name in ("src", "srcset", "data-src", "poster"):
            if a.get(name):
                self.urls.append(a[name] or "")
        if tag == "link" and a.get("href"):
            self.urls.append(a["href"] or "")
        self.urls += re.findall(r"url\(['\"]?([^'\")]+)", a.get("style") or "")


def test_every_page_and_reference_page_is_built(site):
    for page in ("index.html", "getting-started/install.html", "tutorials/your-data.html",
                 "reference/job-spec.html", "reference/rest-api.html", "reference/cli.html", "reference/metrics.html",
                 "reference/events.html", "reference/errors.html", "operations/troubleshooting.html",
                 "benchmarks/history.html"):  # fmt: skip
        assert (site / page).is_file(), page
    assert "training.global_batch" in (site / "reference/job-spec.html").read_text(encoding="utf-8")


def test_the_built_site_loads_nothing_from_another_host(site):
    outside = []
    for page in site.rglob("*.html"):
        parser = _Assets()
        parser.feed(page.read_text(encoding="utf-8"))
        outside += [f"{page.relative_to(site)}: {u}" for u in parser.urls if re.match(r"(https?:)?//", u)]
    assert not outside, outside[:20]
    for css in site.rglob("*.css"):
        text = css.read_text(encoding="utf-8", errors="replace")
        assert not re.search(r"@import\s+url\(['\"]?https?:|url\(['\"]?https?://", text), css


def test_the_readme_stays_a_front_door():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; put the rest in a docs/ page"
    text = "\n".join(lines)
    for must in ("make demo", "make test", "ray start --head", "--storage", "meridian-train", "What is proven where"):
        assert must in text, must
