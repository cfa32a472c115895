"""What a CLI verb prints when it fails.

One line for a person on stderr, always. With ``--json``, also one JSON object on stdout, ``{"error": PROBLEM}``,
so a script reads every outcome from stdout and the exit code: ``PROBLEM`` is the service's RFC 9457 problem as it
sent it (``type``, ``title``, ``status``, ``detail``, ``request_id``, field ``errors``), or one of the same shape
made here for an error on this side (the service unreachable, a spec file that does not parse, a lab that cannot
start), which has no ``status``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from meridian.api.problems import local_problem

__all__ = ["CliError", "local_problem", "report"]

def report(as_json: bool, problem: dict[str, Any], exit_code: int) -> int:
    """Print ``problem`` (stderr for a person; stdout as JSON with ``as_json``) and return ``exit_code``."""
    print(f"error: {problem.get('detail', '')}", file=sys.stderr, flush=True)
    if as_json:
        print(json.dumps({"error": problem}), flush=True)
    return exit_code


class CliError(Exception):
    """A verb's own failure, found on this side: ``str()`` says what went wrong and what to do."""

    def __init__(self, kind: str, title: str, detail: str, *, exit_code: int = 1) -> None:
        super().__init__(detail)
        self.kind, self.title, self.exit_code = kind, title, exit_code

    @property
    def problem(self) -> dict[str, Any]:
        return local_problem(self.kind, self.title, str(self))
