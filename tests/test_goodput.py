"""``meridian bench goodput``: its figures from step records, and one short run of both sides with one kill."""

from __future__ import annotations

import json

import pytest

from meridian.bench.goodput import kill_metrics, tokens_in_window


def _steps(start_step: int, t0: float, n: int, dt: float, workers: int) -> list[dict]:
    return [{"step": start_step + i, "time": t0 + i * dt, "workers": workers} for i in range(n)]


def test_tokens_count_the_step_reached_in_the_window_once():
    # 10 steps at 1 s, then a loss: steps 9 and 10 trained again by 3 workers, then on to step 14
    records = _steps(1, 100.0, 10, 1.0, 4) + _steps(9, 115.0, 6, 1.0, 3)
    got = tokens_in_window(records, wall_s=18.0, tokens_per_step=100)
    assert got["first_step"] == 1 and got["last_step"] == 12  # the record at 118 s is the last inside
    assert got["steps"] == 11 and got["tokens"] == 1100
    assert got["window_s"] == 18.0


def test_a_kill_gives_the_stall_the_steps_lost_and_the_rejoin():
    records = (_steps(1, 100.0, 10, 1.0, 4)          # steps 1..10 by 4 workers, the last at 109 s
               + _steps(9, 115.0, 10, 1.0, 3)        # re-formed at 115 s from step 8: steps 9 and 10 again
               + _steps(19, 130.0, 5, 1.0, 4))       # every worker again from 130 s
    got = kill_metrics(records, kill_time=109.5, back_time=120.0, full=4, resume_step=8)
    assert got == {"stall_s": 6.0, "steps_lost": 2, "rejoin_s": 10.0, "rejoin_stall_s": 6.0}
    # torchft's: it resumes right after its last committed step
    assert kill_metrics(records, kill_time=109.5, back_time=120.0, full=4)["steps_lost"] == 2


def test_a_kill_the_survivors_never_recovered_from_has_no_figures():
    records = _steps(1, 100.0, 10, 1.0, 4)
    assert kill_metrics(records, kill_time=109.5, back_time=None, full=4) == {
        "stall_s": None, "steps_lost": None, "rejoin_s": None}


def test_a_schedule_with_no_kill_in_the_window_is_refused(capsys):
    from meridian.cli.bench import main

    assert main(["goodput", "--json", "--wall-s", "30", "--kill-every-s", "60"]) == 1
    assert "must be under --wall-s" in json.loads(capsys.readouterr().out)["error"]["detail"]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # four runs, each starting a cluster or torchft's processes: ~11 min on a loaded 2-core host
def test_one_kill_on_both_sides_is_counted_and_its_figures_agree(capsys):
    from meridian.bench.goodput import render
    from meridian.cli.bench import main

    # kills fall due 10 s after the first step, then every 10 s inside the 20 s window: one kill (a late one only
    # moves the next past the window's end), and the run trains on past the window until that kill is over
    assert main(["goodput", "--json", "--wall-s", "20", "--kill-every-s", "10", "--back-after-s", "5"]) == 0
    report = json.loads(capsys.readouterr().out)
    for side in ("meridian", "torchft"):
        r = report[side]
        assert "error" not in r, r["error"]
        assert r["kills"] == len(r["with_kills"]["kills"]) == 1  # one kill made
        assert r["stall_s"]["measured"] == 1  # and the survivors re-formed once, without the victim
        # No upper bound: over a 20 s window each run's rate follows the machine's load, and the two runs are
        # minutes apart (a run with the kill measured 2.1x its uninterrupted one on the loaded 2-core host)
        assert r["goodput"] > 0
        assert r["goodput"] == pytest.approx(r["tokens_with_kills"] / r["tokens_uninterrupted"], abs=1e-4)
        (kill,) = r["with_kills"]["kills"]
        assert kill["steps_lost"] is not None and kill["steps_lost"] >= 0
        assert kill["stall_s"] is not None and kill["stall_s"] > 0
        assert r["steps_lost"] == kill["steps_lost"]
        assert r["tokens_uninterrupted"] == r["uninterrupted"]["steps"] * report["setup"]["tokens_per_step"]
    assert report["meridian_vs_torchft"]["goodput"] == pytest.approx(
        report["meridian"]["goodput"] / report["torchft"]["goodput"], abs=1e-3)
    assert "Meridian ÷ torchft" in render(report)
