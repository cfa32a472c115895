"""The recovery benchmark's numbers and timeline (bench/recovery_measure.py), on synthetic step records."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from meridian.bench.recovery_measure import Phases, recovery_metrics


def _steps(first_step: int, count: int, t0: float, dt: float, workers: int) -> list[dict]:
    return [{"step": first_step + i, "time": t0 + i * dt, "workers": workers} for i in range(count)]


def _run() -> list[dict]:
    # 4 workers at 1 step/s up to step 40 (t = 0..39); the victim's node dies at t = 39.5 but the old group
    # still finishes step 41 at t = 40; the 3 survivors resume from step 39 at t = 44 and run at 0.75 step/s;
    # the node returns at t = 100 and trains from t = 110.
    old = _steps(1, 41, 0.0, 1.0, 4)
    new = _steps(40, 40, 44.0, 4 / 3, 3)
    back = _steps(80, 10, 110.0, 1.0, 4)
    return old + new + back


def test_recovery_numbers_come_from_the_records():
    m = recovery_metrics(_run(), kill_time=39.5, full_workers=4, survivors=3, tokens_per_step=100,
                         resume_step=39, back_time=100.0)
    assert m["kill_to_next_step_s"] == pytest.approx(4.5)
    assert m["last_step_before_reforming"] == 41
    assert m["steps_lost"] == 2  # steps 40 and 41 are trained again
    assert m["tokens_per_s_before_kill"] == pytest.approx(100.0)
    assert m["tokens_per_s_after_recovery"] == pytest.approx(75.0)
    assert m["post_recovery_throughput_ratio"] == pytest.approx(1.0)
    # the window ends where the node came back, not 60 s later
    assert m["post_recovery_window_s"] <= 100.0 - 44.0
    assert m["scale_up_s"] == pytest.approx(10.0)


def test_slower_survivors_and_no_scale_up_are_reported_as_such():
    records = _steps(1, 20, 0.0, 1.0, 4) + _steps(20, 30, 30.0, 3.0, 3)  # resumed at half the expected rate
    m = recovery_metrics(records, kill_time=19.5, full_workers=4, survivors=3, tokens_per_step=10, back_time=100.0)
    assert m["resumed_from_step"] == 19  # the step before the re-formed group's first
    assert m["steps_lost"] == 1
    assert m["post_recovery_throughput_ratio"] == pytest.approx(0.444, abs=1e-3)
    assert m["scale_up_s"] is None and "scale_up_note" in m


def test_a_run_that_never_reformed_is_an_error():
    with pytest.raises(RuntimeError, match="re-formed"):
        recovery_metrics(_steps(1, 20, 0.0, 1.0, 4), kill_time=10.0, full_workers=4, survivors=3, tokens_per_step=1)


def test_phases_kill_then_bring_back_then_stop():
    now = [0.0]
    args = SimpleNamespace(steps=1000, kill_at_step=5, kill_after_s=10.0, back_after_s=20.0, scale_up_timeout_s=30.0)
    p = Phases(args, 4, clock=lambda: now[0])
    assert p.next_action([]) is None
    assert p.next_action(_steps(1, 8, 0.0, 1.0, 4)) is None  # step 8 but only 7 s in
    records = _steps(1, 12, 0.0, 1.0, 4)
    assert p.next_action(records) == "kill"
    assert p.victim_exited_s() is None
    p.kill_time, p.dead_time = 11.5, 11.625
    assert p.victim_exited_s() == 0.125
    records += _steps(12, 10, 15.0, 1.0, 3)
    assert p.next_action(records) is None  # 9 s of the re-formed group's window
    records += _steps(22, 15, 25.0, 1.0, 3)
    assert p.next_action(records) == "back"
    p.back_time = 40.0
    assert p.next_action(records) is None
    assert p.next_action(records + [{"step": 40, "time": 45.0, "workers": 4}]) == "done"
    now[0] = 31.0  # gave up waiting for the returning worker
    assert p.next_action(records) == "done"


def _recovery_args(*argv: str):
    import argparse

    from meridian.bench import recovery

    p = argparse.ArgumentParser()
    recovery.add_arguments(p)
    return p.parse_args(list(argv))


def test_the_meridian_side_keeps_every_steps_state_unless_told_auto():
    from meridian.api.schemas import JobSpec
    from meridian.bench import recovery

    # The "≤ 1 step lost" is a promise of every-step snapshots: the default asks for them exactly, since a
    # job's own default ("auto") may widen the cadence on this machine and train up to k - 1 steps again.
    assert JobSpec.model_validate(recovery.job_spec(_recovery_args())).to_request().snapshot_every == 1
    auto = recovery.job_spec(_recovery_args("--snapshot-every", "auto"))
    assert JobSpec.model_validate(auto).to_request().snapshot_every is None  # the service's adaptive cadence
    assert JobSpec.model_validate(recovery.job_spec(_recovery_args("--snapshot-every", "4"))).to_request().snapshot_every == 4
    with pytest.raises(SystemExit):
        _recovery_args("--snapshot-every", "0")


def test_the_meridian_log_keeps_each_re_formation_s_restore_data_and_times():
    from meridian.bench.recovery import MeridianLog

    events = [{"id": 1, "kind": "epoch_formed", "time": 10.0, "data": {"epoch": 2, "datacenters": ["a", "b", "b"]}},
              {"id": 2, "kind": "epoch_restored", "time": 10.1,
               "data": {"epoch": 2, "setup_s": 0.0, "restore_s": 0.0, "state_bytes_sent": 120, "state_bytes_cross_dc": 40}}]  # fmt: skip

    class Api:
        def get(self, path, params=None):
            body = {"points": []} if path.endswith("/metrics") else {"events": [e for e in events if e["id"] > params["after"]]}
            return SimpleNamespace(json=lambda: body)

    log = MeridianLog(Api(), "job", 4)
    log.records()
    log.records()  # the cursor moved on: nothing twice
    assert log.restored == [events[1]["data"]]
    assert log.epochs == [{**events[0]["data"], "formed_at": 10.0}]  # with when the service recorded it
    assert log.timeline(9.9, None) == {"epoch_formed": 0.1, "epoch_restored": 0.2}
