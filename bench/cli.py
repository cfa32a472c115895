"""``meridian bench <name>``: every benchmark prints one JSON object (``--json``) or a table.

Each benchmark is a module of this package exposing ``NAME``, ``HELP``, ``add_arguments(parser)`` and
``run(args) -> dict``; listing it in ``BENCHMARKS`` is all it takes to appear here.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
from collections.abc import Iterator

# name → module (imported lazily: a benchmark's heavy imports only load when it runs)
BENCHMARKS: dict[str, str] = {
    "sync": "meridian.bench.sync",
    "lowcomm": "meridian.bench.lowcomm",
    "scaling": "meridian.bench.scaling",
    "api": "meridian.bench.api",
    "consistency": "meridian.bench.consistency",
    "plan": "meridian.bench.plan",
    "recovery": "meridian.bench.recovery",
    "data": "meridian.bench.data",
    "checkpoint": "meridian.bench.checkpoint",
    "lab": "meridian.bench.lab",
    "lab-demo": "meridian.bench.lab_demo",
    "pgspin": "meridian.bench.pgspin",
    "gpu": "meridian.bench.gpu",
    "gloo-release": "meridian.bench.gloo_release",
    "memory": "meridian.bench.memory",
    "state-exchange": "meridian.bench.state_exchange",
}


def _module(name: str):
    return importlib.import_module(BENCHMARKS[name])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meridian bench", description="Meridian benchmarks; each prints what it measured.")
    sub = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name in BENCHMARKS:
        mod = _module(name)
        sp = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
        sp.add_argument("--json", action="store_true", help="print one JSON object")
        mod.add_arguments(sp)
    return p


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """While a bench runs, whatever writes to stdout — Ray's forwarded worker and raylet logs, C++ code —
    goes to stderr instead, so ``--json`` output is the one JSON object and nothing else."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    mod = _module(args.bench)
    try:
        with _stdout_to_stderr() if args.json else contextlib.nullcontext():
            result = mod.run(args)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        render = getattr(mod, "render", None)
        print(render(result) if render else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
