"""``meridian bench lab-demo``'s own arithmetic and order, without a lab (its runs need root and minutes)."""

from __future__ import annotations

import math
import time

import pytest

from meridian.bench import lab_demo
from meridian.cli import bench as cli


def point(step, t, step_s=0.2, tokens_per_step=2048):
    return {"step": step, "time": t, "step_s": step_s, "tokens_per_s": tokens_per_step / step_s, "exposed_s": 0.01}


def test_rounds_alternate_which_side_runs_first():
    assert lab_demo.run_order(1) == ["two", "one"]
    assert lab_demo.run_order(3) == ["two", "one", "one", "two", "two", "one"]


def test_two_datacenters_split_the_workers_and_one_holds_them_all():
    assert lab_demo.layout("two", 4) == {"dc-a": 2, "dc-b": 2}
    assert lab_demo.layout("two", 5) == {"dc-a": 3, "dc-b": 2}
    assert lab_demo.layout("one", 4) == {"dc-a": 4}


def test_steady_tokens_per_s_counts_the_steps_after_the_first_steady_record_over_their_time():
    # Steps 1-20 are slow start-up; from step 21 one step every 0.25 s whatever each record's own step_s says.
    points = [point(s, 0.5 * s) for s in range(1, 21)] + [point(s, 10.0 + 0.25 * (s - 20)) for s in range(21, 61)]
    assert lab_demo.steady_tokens_per_s(points, 21) == pytest.approx(2048 / 0.25)
    # Records can arrive out of order (and some be missing): the steps between the first and the last count.
    shuffled = list(reversed(points))[::2] + [points[20]]
    assert lab_demo.steady_tokens_per_s(shuffled, 21) == pytest.approx(2048 / 0.25)
    assert lab_demo.steady_tokens_per_s(points[:21], 21) is None  # one steady record: no interval


def test_pairs_divide_two_by_one_in_each_round_whatever_order_they_ran():
    def run(side, steady, job, loss):
        return {"side": side, "steady_tokens_per_s": steady, "job_tokens_per_s": job, "final_loss": loss}

    runs = [run("two", 9000.0, 8000.0, 2.7), run("one", 10000.0, 9000.0, 2.6961),
            run("one", 12000.0, 10000.0, 2.6961), run("two", 11400.0, 9500.0, 2.6961)]
    first, second = lab_demo.pairs(runs)
    assert first["scaling_efficiency"] == 0.9 and first["job_tokens_per_s_ratio"] == pytest.approx(0.889, abs=1e-3)
    assert first["final_loss_rel_diff"] == pytest.approx(2.7 / 2.6961 - 1, abs=1e-5)
    assert second["scaling_efficiency"] == 0.95 and second["final_loss_rel_diff"] == 0
    assert math.isclose(second["job_tokens_per_s_ratio"], 0.95)
    runs[0]["steady_tokens_per_s"] = None  # too few steady steps to say
    assert lab_demo.pairs(runs)[0]["scaling_efficiency"] is None


def test_the_bench_is_listed_and_its_default_spec_is_the_demo():
    args = cli.build_parser().parse_args(["lab-demo", "--json", "--rounds", "1", "--probe"])
    assert args.rounds == 1 and args.probe and args.spec is None
    assert lab_demo.DEFAULT_SPEC.name == "demo.json" and lab_demo.DEFAULT_SPEC.exists()


def test_a_round_that_would_end_past_the_wall_budget_is_not_started():
    assert lab_demo.round_would_overrun(elapsed_s=150, last_round_s=140, max_wall_s=None) is None
    assert lab_demo.round_would_overrun(elapsed_s=150, last_round_s=140, max_wall_s=300) is None
    why = lab_demo.round_would_overrun(elapsed_s=150, last_round_s=160, max_wall_s=300)
    assert "310 s" in why and "--max-wall-s 300" in why


def test_the_run_keeps_the_plan_s_reason_for_its_sync():
    plan = "4 workers in 2 datacenters. Sync 'hierarchical' one step late (chosen: a (b) c). Buckets: 4 of 1 MiB."
    assert lab_demo.sync_sentence(plan) == "Sync 'hierarchical' one step late (chosen: a (b) c)."
    assert lab_demo.sync_sentence("no sync here") is None


def test_the_steady_breakdown_is_each_per_step_time_s_median_from_the_steady_step_on():
    points = [{"step": 1, "step_s": 9.0, "compute_s": 9.0},
              *({"step": s, "step_s": 0.1 * s, "compute_s": 0.05 * s, "exposed_s": 0.001, "loss": 2.0,
                 "tokens_per_s": 1e4}
                for s in (3, 4, 5))]  # fmt: skip
    assert lab_demo.steady_breakdown_ms(points, 3) == {"step": 400.0, "compute": 200.0, "exposed": 1.0}


def test_the_machine_s_busy_cpu_counts_a_process_that_has_ended():
    # lab-demo's cpu_during_job lists processes alive at both ends of the job; the training processes are gone by
    # then, and the machine-wide figure is what still counts them.
    import multiprocessing

    from meridian.bench.cpu_sample import machine_busy_cpu_s, snapshot

    before, listed_before = machine_busy_cpu_s(), snapshot()
    p = multiprocessing.get_context("fork").Process(target=_spin, args=(0.5,))
    p.start()
    p.join(10)
    assert p.pid not in snapshot() and p.pid not in listed_before
    assert machine_busy_cpu_s() - before >= 0.3


def _spin(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_the_run_reports_what_an_armed_look_ahead_decided_the_last_time_it_decided():
    decided = {"lookahead": True, "at_step": 20, "reason": "one step late at a local look-ahead from step 21: ..."}
    points = [{"step": 20, "sync_decision": None}, {"step": 21, "sync_decision": decided, "sync_late": False},
              {"step": 22, "sync_late": True}]
    assert lab_demo.sync_decision(points) == decided
    again = {**decided, "lookahead": False, "at_step": 40}
    assert lab_demo.sync_decision([*points, {"step": 41, "sync_decision": again}]) == again
    assert lab_demo.sync_decision([{"step": 1}]) is None
