"""Imports flow api → service → workers: the service never pulls in the HTTP stack, and worker code
(which runs on remote nodes) never imports the control plane."""

from __future__ import annotations

import subprocess
import sys


def _modules_after(import_line: str) -> set[str]:
    code = f"import sys; {import_line}; print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_service_does_not_import_the_http_stack():
    mods = _modules_after("import meridian.service.core, meridian.service.supervisor")
    assert not {m for m in mods if m.split(".")[0] in ("fastapi", "starlette", "uvicorn")}
    assert not {m for m in mods if m.startswith("meridian.api")}


def test_workers_do_not_import_service_or_api():
    mods = _modules_after("import meridian.workers.entry, meridian.workers.train_loop, meridian.workers.sync")
    assert not {m for m in mods if m.startswith(("meridian.service", "meridian.api"))}
