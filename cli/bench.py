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

from meridian.cli.errors import local_problem, report

# name → module (imported lazily: a benchmark's heavy imports only load when it runs)
BENCHMARKS: dict[str, str] = {
    "sync": "meridian.bench.sync",
    "lowcomm": "meridian.bench.lowcomm",
    "scaling": "meridian.bench.scaling",
    "api": "meridian.bench.api",
    "consistency": "meridian.bench.consistency",
    "plan": "meridian.bench.plan",
    "plan-tables": "meridian.bench.plan_tables",
    "recovery": "meridian.bench.recovery",
    "goodput": "meridian.bench.goodput",
    "data": "meridian.bench.data",
    "checkpoint": "meridian.bench.checkpoint",
    "lab": "meridian.bench.lab",
    "lab-demo": "meridian.bench.lab_demo",
    "pgspin": "meridian.bench.pgspin",
    "gpu": "meridian.bench.gpu",
    "gloo-release": "meridian.bench.gloo_release",
    "memory": "meridian.bench.memory",
    "state-exchange": "meridian.bench.state_exchange",
    "scale": "meridian.bench.control_scale",
}


MAY_BE_ZERO = frozenset({
    "rtt_ms", "lab_rtt_ms", "warmup", "warmup_steps", "diloco_warmup_steps", "overlap_steps",
    "steady_from", "kill_at_step", "kill_after_s", "back_after_s", "settle_s", "linger_s", "die_after_s",
    "outer_momentum", "sparse_outer_momentum", "mix_alpha", "perturb_rank", "perturb_eps",
})  # fmt: skip
"""Numeric options that mean something at 0 (no delay, no warm-up, kill at once); every other one counts or bounds
something, so 0 is as wrong as a negative number, unless 0 is the option's own default ("pick for me", as
``bench sync --global-batch``)."""
MAY_BE_NEGATIVE = frozenset({"seed"})


def check_numbers(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a number no benchmark can run with (``--rounds 0``, ``--timeout-s -1``) before anything starts,
    as a usage error (exit 2) naming the option, instead of a traceback minutes in."""
    bench_parser = parser._subparsers._group_actions[0].choices[args.bench]  # type: ignore[union-attr]
    zero_by_default = {a.dest for a in bench_parser._actions if a.default == 0 and not isinstance(a.default, bool)}
    for name, value in vars(args).items():
        values = value if isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or name in MAY_BE_NEGATIVE:
                continue
            option = "--" + name.replace("_", "-")
            zero_ok = name in MAY_BE_ZERO or name in zero_by_default
            if v < 0 or (v == 0 and not zero_ok):
                parser.error(f"{option} must be {'at least 0' if zero_ok else 'above 0'}, got {v}")


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
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    check_numbers(parser, args)
    mod = _module(args.bench)
    try:
        with _stdout_to_stderr() if args.json else contextlib.nullcontext():
            result = mod.run(args)
    except (ValueError, RuntimeError) as e:
        return report(args.json, local_problem("bench-failed", "Benchmark failed", str(e), bench=args.bench), 1)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        render = getattr(mod, "render", None)
        print(render(result) if render else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
