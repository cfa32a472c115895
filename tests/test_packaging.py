"""The wheel ships every module of the source tree and the example specs: ``pip install .`` is how every node
installs Meridian, and an editable install hides a package the wheel forgot (it once lacked
``meridian.api.routes``, and ``meridian demo`` from a wheel once found no ``examples/demo.json``), and the C
source ``meridian lab`` builds its delay line from."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"meridian": "meridian", "api": "meridian/api", "service": "meridian/service",
           "workers": "meridian/workers", "bench": "meridian/bench", "cli": "meridian/cli", "lab": "meridian/lab",
           "examples": "meridian/examples"}  # fmt: skip
SPEC_SUFFIXES = (".json", ".yaml")
DISTRIBUTION = "meridian_train"
"""The wheel's name for the distribution ``meridian-train`` (``meridian`` on PyPI is another project's)."""


def _source_files() -> set[str]:
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    shipped = set()
    for path in tracked:
        folder, _, rest = path.partition("/")
        if folder not in FOLDERS or not (ROOT / path).exists():
            continue
        # .c: the lab's delay line, compiled where the lab runs
        if (folder == "examples" and path.endswith(SPEC_SUFFIXES) or path.endswith((".py", ".c"))
                or rest.startswith("static/")):
            shipped.add(f"{FOLDERS[folder]}/{rest}")
    return shipped


def test_wheel_ships_every_module_of_the_source_tree(tmp_path):
    # Built from a copy: setuptools reuses a build/ folder, which keeps modules deleted since.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "dist", "site", "*.egg-info",
                                                             ".meridian", "__pycache__", ".pytest_cache",
                                                             ".ruff_cache"))  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(src), "-w", str(tmp_path)],
        check=True, capture_output=True, cwd=tmp_path,
    )  # fmt: skip
    (wheel,) = tmp_path.glob(f"{DISTRIBUTION}-*.whl")
    in_wheel = {n for n in zipfile.ZipFile(wheel).namelist() if not n.startswith(f"{DISTRIBUTION}-")}
    expected = _source_files()
    assert "meridian/api/routes/jobs.py" in expected and "meridian/api/static/index.html" in expected
    assert "meridian/examples/demo.json" in expected
    assert "meridian/lab/delay_line.c" in expected
    assert expected - in_wheel == set(), "modules the wheel forgot"
    assert in_wheel - expected == set(), "files in the wheel that are not in the source tree"
