"""How often an elastic rank snapshots its state (:func:`snapshot_interval`), and the spec's knob for it."""

from __future__ import annotations

import pytest

from meridian.workers.state.snapshots import (
    SNAPSHOT_FREE_S,
    SNAPSHOT_MAX_SHARE,
    WRITER_MARGIN,
    snapshot_interval,
)


def test_a_cheap_snapshot_is_taken_every_step():
    assert snapshot_interval(0.0, 0.0, 0.01) == 1
    assert snapshot_interval(SNAPSHOT_FREE_S / 2, 0.0, 0.001) == 1  # under 10 ms: free, however short the step
    assert snapshot_interval(0.004, 0.0, 0.1) == 1


def test_a_background_write_longer_than_a_step_spaces_the_snapshots_so_it_never_waits():
    # a GPU's 2 GB shard: written in 1.6 s while steps take 0.144 s
    k = snapshot_interval(0.0, 1.6, 0.144)
    assert k == 14 and k * 0.144 >= WRITER_MARGIN * 1.6 > (k - 1) * 0.144


def test_a_snapshot_that_holds_the_loop_up_costs_at_most_its_share_of_the_steps():
    k = snapshot_interval(0.05, 0.0, 0.1)  # a 50 ms synchronous write, 100 ms steps
    assert k == 10 and 0.05 / k <= SNAPSHOT_MAX_SHARE * 0.1 < 0.05 / (k - 1)
    assert snapshot_interval(0.05, 2.0, 0.1) == 25  # the larger of the two needs
    assert snapshot_interval(1.0, 1.0, 0.0) == 1  # no step time measured yet: as given


def test_the_spec_says_auto_by_default_and_an_integer_is_kept_exactly():
    from fakes import topology

    from meridian.api.schemas import JobSpec
    from meridian.service.planning.planner import plan_job
    from meridian.service.planning.train_config import build_train_config

    def train_config(spec: dict):
        request = JobSpec.model_validate(spec).to_request()
        return build_train_config("j", request, plan_job(request, topology(dc_a=2), None), "")

    base = {"name": "s", "model": {"preset": "nano"}, "training": {"steps": 4, "global_batch": 4, "micro_batch": 2}}
    auto = train_config(base)
    assert auto.snapshot_adaptive and auto.snapshot_every == 1
    fixed = train_config({**base, "checkpoint": {"snapshot_every": 3}})
    assert not fixed.snapshot_adaptive and fixed.snapshot_every == 3
    with pytest.raises(ValueError, match="snapshot_every"):
        JobSpec.model_validate({**base, "checkpoint": {"snapshot_every": 0}})


class _SlowSnapshots:
    """An epoch state whose snapshots hold the loop up ``hold_s`` (a synchronous write of a big shard)."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s, self.kept, self.widened = hold_s, [], []

    def restore(self, replica) -> int:
        return 0

    def keep(self, shard) -> None:
        import time

        time.sleep(self.hold_s)
        self.kept.append(shard.step)

    def snapshot_cost(self) -> tuple[float, float]:
        return self.hold_s, 0.0

    def snapshots_widened(self, every, loop_s, background_s, step_s) -> None:
        self.widened.append((every, round(loop_s, 6)))

    def leave_requested(self) -> bool:
        return False

    def step_done(self, replica, steps_done) -> None:
        pass

    def finish(self, replica) -> None:
        pass


def _loop_rank(rank, world, cfg, hold_s, first_every=1):
    from dataclasses import replace

    from meridian.workers.loop.replica import Membership
    from meridian.workers.loop.train import ListSink, TrainingLoop

    state = _SlowSnapshots(hold_s)
    loop = TrainingLoop(cfg, sink=ListSink(), keep_params=True)
    outcome = loop.run_epoch(replace(Membership.of_default_group(cfg), snapshot_every=first_every), state)
    return {"kept": state.kept, "widened": state.widened, "params": outcome.result.final_params}


def test_slow_snapshots_are_spaced_out_alike_on_every_rank_and_change_nothing_of_the_maths():
    from dataclasses import replace

    import torch

    from meridian.workers.contracts.config import OptimConfig, TrainConfig
    from meridian.workers.contracts.model_config import model_preset
    from meridian.workers.distributed.multiproc import run_processes

    cfg = TrainConfig(job_id="cadence", model=model_preset("nano"), steps=40, global_batch=8, micro_batch=2,
                      datacenters=("dc-a", "dc-b"), optim=OptimConfig(warmup_steps=1), snapshot_adaptive=True)
    adaptive = run_processes(_loop_rank, 2, cfg, 0.05, timeout_s=240)
    fixed = run_processes(_loop_rank, 2, replace(cfg, snapshot_adaptive=False), 0.0, timeout_s=240)
    a, b = adaptive
    print("kept:", a["kept"], "widened:", a["widened"])
    assert a["kept"] == b["kept"] and a["widened"] == b["widened"]  # the same steps, the same decisions
    assert a["widened"] and a["widened"][0][1] == 0.05  # the ranks' mean cost
    every = a["widened"][-1][0]
    assert every > 1 and len(a["kept"]) < 40  # 50 ms snapshots against steps of a few ms: spaced out
    assert fixed[0]["kept"] == list(range(1, 41))  # a fixed cadence of 1: after every step
    for name, p in fixed[0]["params"].items():  # snapshots are copies: the training is the same
        assert torch.equal(a["params"][name], p), name


def test_an_epoch_starts_at_the_cadence_the_rendezvous_hands_it_and_a_fixed_one_ignores_it():
    from dataclasses import replace

    from meridian.workers.contracts.config import OptimConfig, TrainConfig
    from meridian.workers.contracts.model_config import model_preset
    from meridian.workers.distributed.multiproc import run_processes

    cfg = TrainConfig(job_id="cadence", model=model_preset("nano"), steps=12, global_batch=8, micro_batch=2,
                      datacenters=("dc-a", "dc-b"), optim=OptimConfig(warmup_steps=1), snapshot_adaptive=True)
    started_wide = run_processes(_loop_rank, 2, cfg, 0.0, 5, timeout_s=240)
    assert all(r["kept"] == [5, 10] for r in started_wide)  # (cheap snapshots: it never narrows)
    fixed = run_processes(_loop_rank, 2, replace(cfg, snapshot_adaptive=False), 0.0, 5, timeout_s=240)
    assert all(r["kept"] == list(range(1, 13)) for r in fixed)
