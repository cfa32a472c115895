"""The Getting started and Tutorial pages' commands run as written, and their job specs are valid.

Each page's shell blocks run in order as one bash script (``set -euo pipefail``), from the repository's root, with
a scratch ``HOME`` (so ``~/.meridian``, ``~/.ray`` and the tutorials' folders are the test's own). Two wrappers keep
a run from touching anyone else's: ``meridian serve`` gets a free ``--port`` (and ``MERIDIAN_URL`` points the CLI
there), and ``ray start`` a free ``--port`` and a ``--temp-dir`` of its own, with ``ray stop`` stopping only the
processes under it (never every Ray process of the host). Nothing else in a command is changed. A page's
``kill $SERVE`` stops the service it started in the background, as it does run directly.

A comment before a block changes how it is treated (``docs/development/docs.md`` lists them): ``skip needs …``
(not run, reported as skipped with that reason), ``needs-root``, ``needs-venv``, ``cleanup COMMAND`` (run after the
page, whatever happened) and ``output`` (an example, not checked). JSON and YAML blocks are validated as job specs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from processes import process_group

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted((DOCS / "getting-started").glob("*.md")) + sorted((DOCS / "tutorials").glob("*.md"))
SHELL = ("bash", "sh", "shell")
SPECS = ("json", "yaml")
PAGE_TIMEOUT_S = 1200


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    text: str
    directives: tuple[str, ...]

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(DOCS)}:{self.line}"

    def directive(self, name: str) -> str | None:
        """The rest of the directive ``name`` (``""`` when it has none), or ``None`` without it."""
        for d in self.directives:
            if d == name or d.startswith(name + " "):
                return d[len(name):].strip()
        return None


def blocks(page: Path) -> list[Block]:
    lines = page.read_text(encoding="utf-8").splitlines()
    found, pending, i = [], [], 0
    while i < len(lines):
        m = re.fullmatch(r"<!-- docs-test: (.+?) -->", lines[i].strip())
        fence = re.fullmatch(r"```(\w*)\s*", lines[i])
        if m:
            pending.append(m.group(1).strip())
        elif fence:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            found.append(Block(page, i + 1, fence.group(1), "\n".join(lines[i + 1:end]), tuple(pending)))
            pending, i = [], end
        elif lines[i].strip():
            pending = []
        i += 1
    return found


ALL = [b for page in PAGES for b in blocks(page)]
SPEC_PAGES = [p for p in sorted(DOCS.rglob("*.md")) if "benchmarks" not in p.parts]
"""Job specs are validated on every page (the concepts' examples too); commands run on PAGES only."""
SKIPPED = [b for b in ALL if b.lang in SHELL and b.directive("skip") is not None]


def test_the_pages_are_found_and_have_blocks():
    names = {p.name for p in PAGES}
    assert {"install.md", "demo.md", "workstation.md", "cluster.md", "your-data.md"} <= names
    assert sum(b.lang in SHELL for b in ALL) >= 20 and sum(b.lang in SPECS for b in ALL) >= 3
    for b in SKIPPED:
        assert b.directive("skip").startswith("needs "), f"{b.id}: a skip must say what it needs"


@pytest.mark.parametrize("block", [b for page in SPEC_PAGES for b in blocks(page)
                                   if b.lang in SPECS and b.directive("output") is None], ids=lambda b: b.id)
def test_job_spec_blocks_are_valid(block):
    """A block is a whole job spec; with ``spec-part``, sections of one (a bare ``"key": value`` too), checked
    inside the smallest spec; with ``cluster-file``, a ``meridian plan --cluster`` file."""
    from meridian.api.schemas import JobSpec

    text = block.text
    if block.directive("spec-part") is not None and block.lang == "json" and not text.lstrip().startswith("{"):
        text = "{" + text + "}"
    if block.lang == "json":
        data = json.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text)
    if block.directive("cluster-file") is not None:
        from meridian.service.planning.described import cluster_from_dict

        assert cluster_from_dict(data).datacenters
        return
    if block.directive("spec-part") is not None:
        data = _merged({"name": "docs-part", "training": {"steps": 1, "global_batch": 8, "micro_batch": 2}}, data)
    JobSpec.model_validate(data)


def _merged(base: dict, part: dict) -> dict:
    """``base`` with ``part``'s sections laid over it, section by section."""
    out = dict(base)
    for key, value in part.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


@pytest.mark.parametrize("block", SKIPPED, ids=lambda b: b.id)
def test_blocks_that_cannot_run_here_say_why(block):
    pytest.skip(block.directive("skip"))


# -- running a page ----------------------------------------------------------------------------------------
PRELUDE = r"""
set -euo pipefail
meridian() {
    if [ "${1:-}" = serve ]; then shift
        # Sent to the background (`meridian serve ... &`), this function runs in a subshell, whose pid is the `$!`
        # a page keeps: exec, so that the service is that pid and the page's `kill $SERVE` stops it, as run directly.
        if [ "$BASHPID" != "$$" ]; then exec meridian serve "$@" --port "$DOCS_TEST_PORT"; fi
        command meridian serve "$@" --port "$DOCS_TEST_PORT"
    else command meridian "$@"; fi
}
ray() {
    case "${1:-}" in
        start) shift; command ray start "$@" --port "$DOCS_TEST_RAY_PORT" --temp-dir "$DOCS_TEST_RAY_TMP" \
                   --include-dashboard false --disable-usage-stats ;;
        stop) "$DOCS_TEST_PYTHON" -c "import sys; from meridian.lab.lab import _kill, ray_cluster_processes; \
_kill(ray_cluster_processes(sys.argv[1], int(sys.argv[2])))" "$DOCS_TEST_RAY_TMP" "$DOCS_TEST_RAY_PORT" ;;
        *) command ray "$@" ;;
    esac
}
"""


def runnable(page: Path) -> tuple[list[Block], str | None]:
    """The page's shell blocks to run, in order, or why the page cannot run here."""
    run = [b for b in blocks(page) if b.lang in SHELL and b.directive("skip") is None and b.directive("output") is None]
    for b in run:
        if b.directive("needs-root") is not None and os.geteuid() != 0:
            return run, f"{b.id} needs root"
        if b.directive("needs-venv") is not None and Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
            return run, f"{b.id} needs the repository's .venv (run it through `make test`)"
    return run, None


RUN_PAGES = [p for p in PAGES if runnable(p)[0]]


@pytest.mark.slow
@pytest.mark.timeout(PAGE_TIMEOUT_S + 300)
@pytest.mark.parametrize("page", RUN_PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_page_commands_run_as_written(page, tmp_path):
    from meridian.lab.lab import _kill, ray_cluster_processes
    from meridian.workers.distributed.ports import free_port

    run, why_not = runnable(page)
    if why_not:
        pytest.skip(why_not)
    home = tmp_path / "home"
    home.mkdir()
    ray_tmp = tempfile.mkdtemp(prefix="mrd-docs-")  # short: Ray's socket paths under it must fit 107 bytes
    port, ray_port = free_port(), free_port()
    script = PRELUDE + "\n".join(f"# {b.id}\n{b.text}" for b in run) + "\n"
    cleanups = [c for b in run if (c := b.directive("cleanup"))]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MERIDIAN_"))} | {
        "HOME": str(home), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "MERIDIAN_URL": f"http://127.0.0.1:{port}", "DOCS_TEST_PORT": str(port), "DOCS_TEST_RAY_PORT": str(ray_port),
        "DOCS_TEST_RAY_TMP": ray_tmp, "DOCS_TEST_PYTHON": sys.executable, "RAY_USAGE_STATS_ENABLED": "0",
        "NO_MKDOCS_2_WARNING": "1",
    }  # fmt: skip
    if any("ray start" in b.text for b in run):  # `meridian serve --address auto` finds the page's own head
        from ray._private.services import get_node_ip_address

        env["RAY_ADDRESS"] = f"{get_node_ip_address()}:{ray_port}"
    log_path = tmp_path / "page.log"
    before = _worktree_changes()
    try:
        # The page's background processes (a service and its embedded cluster) are in the script's process
        # group: it ends after the page, given 60 s to stop by itself, and ends too if this process dies.
        with open(log_path, "w") as log, process_group(
            ["bash", "-c", script], grace_s=60.0, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        ) as proc:
            try:
                code = proc.wait(timeout=PAGE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                code = None
            for command in cleanups:
                subprocess.run(["bash", "-c", PRELUDE + command], cwd=ROOT, env=env, stdout=log,
                               stderr=subprocess.STDOUT, timeout=300)  # fmt: skip
    finally:
        _kill(ray_cluster_processes(ray_tmp, ray_port))
        shutil.rmtree(ray_tmp, ignore_errors=True)
    output = log_path.read_text(errors="replace")
    assert code is not None, f"{page.name} did not finish within {PAGE_TIMEOUT_S} s:\n{output[-6000:]}"
    assert code == 0, f"{page.name} failed (exit {code}):\n{output[-6000:]}"
    left = sorted(_worktree_changes() - before)
    assert not left, f"{page.name}'s commands left files in the repository (write them under ~ instead): {left}"


def _worktree_changes() -> set[str]:
    """Files the repository's ``git status`` reports (ignored ones are not: ``.meridian/``, ``dist/``, ``build/``)."""
    out = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    return set(out.stdout.splitlines()) if out.returncode == 0 else set()
