"""``meridian bench``: a number no benchmark can run with is a usage error before anything starts, and a benchmark
that fails says so as the CLI's other verbs do (one line on stderr; with ``--json`` the problem on stdout)."""

from __future__ import annotations

import json

import pytest

from meridian.cli.bench import BENCHMARKS, MAY_BE_NEGATIVE, MAY_BE_ZERO, build_parser, main


@pytest.mark.parametrize("argv, message", [
    (["recovery", "--rounds", "0"], "--rounds must be above 0, got 0"),  # was an IndexError after the parse
    (["lab", "--timeout-s", "-3"], "--timeout-s must be above 0, got -3.0"),
    (["lowcomm", "--inner-steps", "8", "0"], "--inner-steps must be above 0, got 0"),
    (["lab-demo", "--rtt-ms", "-1"], "--rtt-ms must be at least 0, got -1.0"),
])  # fmt: skip
def test_a_number_no_benchmark_runs_with_is_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([argv[0], "--json", *argv[1:]])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_zero_is_accepted_where_it_means_something():
    parser = build_parser()
    from meridian.cli.bench import check_numbers

    for argv in (["lowcomm", "--rtt-ms", "0", "--diloco-warmup-steps", "0", "--seed", "-1"],
                 ["lab", "--global-batch", "0"]):  # 0 is its default: 8 samples per worker
        check_numbers(parser, parser.parse_args(argv))  # no SystemExit
    # every name the rules list is an option of some benchmark (a renamed option would leave a stale rule)
    dests = {a.dest for name in BENCHMARKS for a in parser._subparsers._group_actions[0].choices[name]._actions}
    assert dests >= (MAY_BE_ZERO | MAY_BE_NEGATIVE)


def test_a_failing_benchmark_prints_the_problem(capsys, monkeypatch):
    import meridian.bench.recovery as recovery

    def fail(args):
        raise RuntimeError("the lab is held by another run")

    monkeypatch.setattr(recovery, "run", fail)
    assert main(["recovery", "--json"]) == 1
    out = capsys.readouterr()
    assert json.loads(out.out) == {"error": {"type": "urn:meridian:problem:bench-failed", "title": "Benchmark failed",
                                             "detail": "the lab is held by another run", "bench": "recovery"}}
    assert out.err.strip().endswith("error: the lab is held by another run")
