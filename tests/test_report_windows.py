"""The training loop's per-step sums over all ranks (:mod:`meridian.workers.loop.report`), on real gloo processes.

Every step is reported once, in order, with the sum over ranks of its loss and bytes; every rank reads the leave
flag after the same step; and when the sum takes longer than a step (a far link, emulated here by a sum that
cannot be read before a fixed latency), every rank widens its windows alike, so the loop stops waiting for it.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.loop.report import ReportWindows
from meridian.workers.loop.step import StepOutput
from meridian.workers.state.snapshots import snapshot_interval
from meridian.workers.sync.engine import StepStats


class _LateWork:
    """A sum that cannot be read before ``latency_s`` after it was issued (a far link's round trips)."""

    def __init__(self, work, latency_s: float) -> None:
        self.work, self.until = work, time.perf_counter() + latency_s

    def wait(self) -> bool:
        time.sleep(max(0.0, self.until - time.perf_counter()))
        return self.work.wait()


def _run(rank: int, world: int, steps: int, step_s: float, latency_s: float, leave_at: int | None,
         min_window_steps: int = 1) -> dict:  # fmt: skip
    import torch.distributed as dist

    all_reduce, sums = dist.all_reduce, []

    def counted(t, **kw):
        sums.append(t.numel())
        work = all_reduce(t, **kw)
        return _LateWork(work, latency_s) if latency_s else work

    dist.all_reduce = counted
    windows = ReportWindows(torch.device("cpu"), world, min_window_steps=min_window_steps)
    seen, sizes, left_after = [], [], None
    blocked_s, walls, began = 0.0, [], time.perf_counter()
    for step in range(steps):
        time.sleep(step_s)  # the step's compute
        out = StepOutput(loss=torch.zeros(()), stats=StepStats(grad_norm=float(step), inter_dc_bytes=0, sync_wait_s=0.0),
                         step_s=step_s, data_s=0.0, inter_dc_bytes=100 * step + rank)  # fmt: skip
        t0 = time.perf_counter()
        rows = windows.add(step, out, torch.tensor(10.0 * step + rank), leave=rank == 1 and step == leave_at)
        blocked_s += time.perf_counter() - t0 if step >= steps // 2 else 0.0
        if step == steps // 2 and latency_s:
            windows.set_val_loss(0.5)
        seen += [(r.step, r.loss, r.inter_dc_bytes, r.stats.grad_norm, r.val_loss) for r in rows]
        sizes.append(windows.window)
        walls.append(time.perf_counter() - began)
        began = time.perf_counter()
        if windows.leave:
            left_after = step
            break
    seen += [(r.step, r.loss, r.inter_dc_bytes, r.stats.grad_norm, r.val_loss) for r in windows.flush()]
    return {"seen": seen, "sizes": sizes, "left_after": left_after, "blocked_s": blocked_s, "sums": len(sums),
            "step_wall_s": sorted(walls)[len(walls) // 2]}


def _expected(world: int, steps: range) -> list[tuple]:
    return [(s, sum(10.0 * s + r for r in range(world)), sum(100 * s + r for r in range(world)), float(s))
            for s in steps]  # fmt: skip


def test_every_step_is_reported_once_in_order_with_the_sum_over_ranks():
    world, steps = 3, 40
    results = run_processes(_run, world, steps, 0.002, 0.0, None, timeout_s=120)
    for res in results:
        assert [row[:4] for row in res["seen"]] == _expected(world, range(steps))
        assert res["left_after"] is None
    # The windows' widths are agreed: every rank closes its windows after the same steps.
    assert len({tuple(r["sizes"]) for r in results}) == 1


def test_a_diloco_jobs_sums_cross_once_per_outer_cycle_past_the_time_cap():
    # 50 ms steps cap a window at 40 steps (2 s). Once the first sum tells the ranks the step's time, a window
    # spans the outer cycle (here 48 steps): 96 steps take two sums of one step each, then one a cycle.
    world, steps, cycle = 2, 96, 48
    results = run_processes(_run, world, steps, 0.05, 0.0, None, cycle, timeout_s=120)
    for res in results:
        assert res["sizes"][0] == 1 and set(res["sizes"][1:]) == {cycle}  # widened when step 0's sum is read
        assert res["sums"] == 2 + math.ceil((steps - 2) / cycle)
        assert [row[:4] for row in res["seen"]] == _expected(world, range(steps))


def test_a_long_outer_cycle_still_reports_every_max_cycle_window_s():
    # A cycle of 500 steps of 1 s would report every 8 minutes; the window stops at 30 s of steps.
    windows = ReportWindows(torch.device("cpu"), 1, min_window_steps=500)
    windows._widen(0.0, 0.0, 1.0)
    assert windows.window == 30
    windows._widen(0.0, 0.0, 0.01)  # short steps: the whole cycle
    assert windows.window == 500


def test_a_leave_is_read_within_two_outer_cycles_on_every_rank():
    world, steps, cycle, asked_at = 2, 120, 16, 20
    results = run_processes(_run, world, steps, 0.01, 0.0, asked_at, cycle, timeout_s=120)
    left = {r["left_after"] for r in results}
    assert len(left) == 1 and None not in left
    (left_after,) = left
    assert asked_at <= left_after < asked_at + 2 * cycle
    assert (left_after - 1) % cycle == 0  # at a window's end: windows of one step (0 and 1), then of the cycle


@pytest.mark.parametrize("latency_s", [0.0, 0.12])
def test_every_rank_leaves_after_the_same_step_and_reports_every_step_before_it(latency_s):
    world, steps, asked_at = 2, 120, 30
    results = run_processes(_run, world, steps, 0.01, latency_s, asked_at, timeout_s=120)
    left = {r["left_after"] for r in results}
    assert len(left) == 1 and None not in left
    (left_after,) = left
    # Read a window or two after it was asked for; never before.
    assert asked_at <= left_after < steps - 1
    for res in results:
        assert [row[:4] for row in res["seen"]] == _expected(world, range(left_after + 1))


def test_a_sum_slower_than_a_step_widens_every_ranks_window_alike_and_stops_pacing_the_loop():
    world, steps, step_s, latency_s = 2, 80, 0.01, 0.12
    results = run_processes(_run, world, steps, step_s, latency_s, None, timeout_s=120)
    sizes = {tuple(r["sizes"]) for r in results}
    assert len(sizes) == 1
    (sizes,) = sizes
    assert sizes[0] == 1  # a LAN's width until a sum was seen to be slow
    # The steps the latency spans, at the step the ranks measured (~12 at 10 ms; fewer on a loaded machine, where
    # a 10 ms sleep and the loop around it take longer).
    spans = math.floor(latency_s / max(r["step_wall_s"] for r in results))
    # The first slow read (after step 2) travels with the very next sum, so by step 8 every rank has widened
    # past the latency; carried one window later, it took until ~step 12.
    assert sizes[7] >= spans, (spans, sizes[:16])
    # Twice the steps the latency spans, and never past max_window_s (2 s) of steps.
    assert spans <= sizes[-1] <= 2.0 / step_s
    assert list(sizes) == sorted(sizes)  # only ever widens
    for res in results:
        assert [row[:4] for row in res["seen"]] == _expected(world, range(steps))
        assert [row[0] for row in res["seen"] if row[4] is not None] == [steps // 2]
        # In the second half the loop blocks on a sum for far less than the one latency per step (4.8 s) it
        # would wait at a window of one step; the flush at the end is not counted.
        assert res["blocked_s"] < 0.25 * (steps // 2) * latency_s


def test_short_steps_share_one_sum_per_min_window_on_every_rank():
    # A sum per 2 ms step would cost every step its issue and read and tie the ranks' loops together at each one;
    # once the step's time is known, a window spans at least min_window_s (50 ms), on every rank alike.
    world, steps, step_s = 2, 80, 0.002
    results = run_processes(_run, world, steps, step_s, 0.0, None, timeout_s=120)
    sizes = {tuple(r["sizes"]) for r in results}
    assert len(sizes) == 1
    (sizes,) = sizes
    assert sizes[0] == 1
    assert 8 <= sizes[-1] <= 25  # ceil(50 ms / the step as measured: the sleep plus the loop's own time)
    for res in results:
        assert [row[:4] for row in res["seen"]] == _expected(world, range(steps))


def _snapshotting(rank: int, world: int, steps: int, step_s: float, write_s: float, adaptive: bool) -> dict:
    """A loop whose snapshots keep a background writer busy for ``write_s`` (a GPU's copies and file write);
    rank 1's writer is twice as slow. Returns the steps this rank snapshotted and the cadence after each."""
    windows = ReportWindows(torch.device("cpu"), world, adaptive_snapshots=adaptive)
    snapped, cadence, widened = [], [], []
    for step in range(steps):
        time.sleep(step_s)
        out = StepOutput(loss=torch.zeros(()), stats=StepStats(grad_norm=0.0, inter_dc_bytes=0, sync_wait_s=0.0),
                         step_s=step_s, data_s=0.0, inter_dc_bytes=0)  # fmt: skip
        snap = (step + 1) % windows.snapshot_every == 0
        snapped += [step] if snap else []
        cost = (0.0, write_s * (1 + rank)) if snap else None
        windows.add(step, out, torch.zeros(()), leave=False, snapshot=None if cost is None else (cost, 0.0))
        cadence.append(windows.snapshot_every)
        if windows.snapshots_widened is not None:
            widened.append(windows.snapshots_widened)
            windows.snapshots_widened = None
    windows.flush()
    return {"snapped": snapped, "cadence": cadence, "widened": widened}


def test_every_rank_widens_its_snapshot_cadence_at_the_same_step_from_the_ranks_mean_cost():
    world, steps, step_s, write_s = 2, 60, 0.01, 0.04  # writes of 40 and 80 ms against 10 ms steps
    results = run_processes(_snapshotting, world, steps, step_s, write_s, True, timeout_s=120)
    assert results[0] == results[1]  # same steps snapshotted, same cadence after every step, same figures
    final = results[0]["cadence"][-1]
    every, loop_s, background_s, measured_step_s = results[0]["widened"][-1]
    # the ranks' mean write (40 and 80 ms) over the step they measured (a sleep of 10 ms plus the loop's own time)
    assert background_s == pytest.approx(0.06) and loop_s == 0.0 and measured_step_s >= step_s
    assert final == every == snapshot_interval(loop_s, background_s, measured_step_s) > 1
    assert results[0]["cadence"][0] == 1 and sorted(results[0]["cadence"]) == results[0]["cadence"]  # only widens
    widened_at = results[0]["cadence"].index(final)
    later = [s for s in results[0]["snapped"] if s > widened_at]
    assert later and all((s + 1) % final == 0 for s in later)  # from then on, every final-th step only


def test_a_fixed_snapshot_cadence_never_widens():
    results = run_processes(_snapshotting, 2, 30, 0.01, 0.04, False, timeout_s=120)
    assert all(r["snapped"] == list(range(30)) and set(r["cadence"]) == {1} for r in results)


def test_only_a_diloco_job_across_datacenters_widens_its_windows_to_the_outer_cycle():
    from meridian.workers.contracts.config import DiLoCoConfig, SyncConfig, SyncStrategy, TrainConfig
    from meridian.workers.contracts.model_config import model_preset
    from meridian.workers.loop.train import Membership, report_window_steps

    def job(sync: SyncConfig) -> TrainConfig:
        return TrainConfig(job_id="windows", model=model_preset("nano"), steps=2, global_batch=2, micro_batch=1,
                           sync=sync)  # fmt: skip

    two_dcs = Membership(epoch=0, rank=0, world_size=2, datacenters=("a", "b"))
    one_dc = Membership(epoch=0, rank=0, world_size=2, datacenters=("a", "a"))
    diloco = job(SyncConfig(strategy=SyncStrategy.DILOCO, diloco=DiLoCoConfig(inner_steps=24)))
    streaming = job(SyncConfig(strategy=SyncStrategy.STREAMING_DILOCO,
                               diloco=DiLoCoConfig(inner_steps=32, fragments=4, overlap_steps=1)))  # fmt: skip
    assert report_window_steps(diloco, two_dcs) == 24
    assert report_window_steps(streaming, two_dcs) == 32
    assert report_window_steps(diloco, one_dc) == 1
    assert report_window_steps(job(SyncConfig(strategy=SyncStrategy.HIERARCHICAL)), two_dcs) == 1
