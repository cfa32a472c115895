"""Edge cases of the armed look-ahead (``sync.lookahead_when_exposed``): restores, snapshots, validation passes,
close mid-trial, compression, and the planner that arms it (review of a9170d5 / 2587f33 / 59165ff).

The engine runs are real gloo groups on CPU (the uneven 2 + 1 layout, no WAN emulator). The decision is made
deterministic instead of timed: ``lookahead_when_exposed=0`` tries the look-ahead whatever the sync waited (any
wait > 0 × compute), and ``PREFERRED_WITHIN`` (set inside each rank's process) makes the trial lose (1.0: the
look-ahead would have to save all of a step) or win (-100). Each engine outcome is held to a single-process
replay of what it chose (``_reference``), or at least to every replica agreeing bit for bit.

Each test says what it pins; those marked "was a bug" failed on a9170d5/2587f33 and pass since the review's fixes.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
import torch
from fakes import topology
from sync_helpers import (
    lr_of,
    max_rel_diff,
    micro_batches,
    params_of,
    reference_schedule_params,
    share_loss,
    toy_model,
)

from meridian.service.jobs import JobRequest, ParallelismRequest, TopologyRequest
from meridian.service.planning.cost_model import Link
from meridian.service.planning.planner import default_figures, plan_job
from meridian.service.planning.train_config import build_train_config
from meridian.workers.contracts.config import (
    LOOKAHEAD_DECISION_MEASURE,
    LOOKAHEAD_DECISION_SKIP,
    Compression,
    OptimConfig,
    SyncConfig,
    SyncStrategy,
    lookahead_start,
)
from meridian.workers.contracts.model_config import model_preset
from meridian.workers.distributed.layout import DCGroups, DCLayout
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.sync import lookahead_decision
from meridian.workers.sync.build import build_sync

OPTIM = OptimConfig(lr=0.05, weight_decay=0.1, grad_clip=0.5, warmup_steps=0)
UNEVEN = ("a", "a", "b")
WINDOW = LOOKAHEAD_DECISION_SKIP + LOOKAHEAD_DECISION_MEASURE
LOSE, WIN = 1.0, -100.0  # PREFERRED_WITHIN: the trial always loses / always wins


# -- a single-process replay of any sequence of exact and one-step-late steps ------------------------------------

def _reference(steps: int, modes: str, *, sync_before=(), drop_before=(), micro: int = 3,
               dcs: tuple[str, ...] = UNEVEN) -> dict[str, torch.Tensor]:
    """:func:`sync_helpers.reference_schedule_params` with this file's optimizer."""
    return reference_schedule_params(steps, OPTIM, dcs, modes, sync_before=sync_before, drop_before=drop_before,
                                     micro=micro)


def _modes(*runs: tuple[str, int]) -> str:
    return "".join(m * n for m, n in runs)


# -- the engine, driven step by step in each rank ----------------------------------------------------------------

def _engine(rank, dcs=UNEVEN, **kw):
    sync = SyncConfig(**{"bucket_mb": 64 / 2**20, "inter_dc_chunk_mb": 40 / 2**20, "delay_one_step": True,
                         "local_lookahead": True, "lookahead_after": 3, "lookahead_when_exposed": 0.0, **kw})
    return build_sync(toy_model(0), DCGroups(DCLayout(dcs), rank), sync, OPTIM)


def _step(e, rank, world, s, *, micro=3, snapshot_as=None):
    batches = micro_batches(s, rank, world, micro)
    for i, (x, y) in enumerate(batches):
        last = i == len(batches) - 1
        with e.micro_batch(last_micro_batch=last):
            e.backward(share_loss(e.model, x, y), last_micro_batch=last)
    return e.step(lr_of(s), snapshot_as=snapshot_as)


def _row(stats):
    d = stats.lookahead_decision
    return stats.late, None if d is None else (d.at_step, d.lookahead)


def _decided(rows):
    return [(i, d) for i, (_, d) in enumerate(rows) if d is not None]


def _late(rows):
    return "".join("L" if late else "E" for late, _ in rows)


def _run(rank, world, prefer, steps, kw, sync_before, micro):
    """One engine over ``steps`` steps, synchronized before the steps in ``sync_before``."""
    lookahead_decision.PREFERRED_WITHIN = prefer
    e = _engine(rank, **kw)
    rows = []
    for s in range(steps):
        if s in sync_before:
            e.synchronize()  # what a validation pass does
        rows.append(_row(_step(e, rank, world, s, micro=micro)))
    e.synchronize()
    feedback = len(e.local_shard(steps).feedback)  # nothing in flight any more: the residuals go with the state
    out = params_of(e.model), rows, e.lookahead_copies > 0, feedback
    e.close()
    e.groups.destroy()
    return out


def _restored(rank, world, prefer):
    """Engine A trains 5 exact steps; engine B (new groups, as a re-formed epoch) restores A's state at 5 committed
    updates (past lookahead_after=3) and trains on."""
    lookahead_decision.PREFERRED_WITHIN = prefer
    a = _engine(rank)
    for s in range(5):
        _step(a, rank, world, s)
    a.synchronize()
    shard, weights = a.local_shard(5), params_of(a.model)
    a.close()
    a.groups.destroy()
    b = _engine(rank)
    b.load_weights(b.model, weights)
    b.load_local_shard(shard)
    rows = [_row(_step(b, rank, world, s)) for s in range(5, 32)]
    b.synchronize()
    out = params_of(b.model), rows
    b.close()
    b.groups.destroy()
    return out


def _closed_mid_trial(rank, world, prefer):
    """Engine A: exact steps 0-9, the trial from step 10; a snapshot inside step 12, the state read after it, step
    13, then closed with the trial (and a sync) in flight. Engine B (new groups) restores that state and trains on
    from step 13 (the sync of step 12, in flight when the state was read, is not in it)."""
    lookahead_decision.PREFERRED_WITHIN = prefer
    a = _engine(rank)
    first = None
    for s in range(13):
        stats = _step(a, rank, world, s, snapshot_as=s + 1 if s in (10, 12) else None)
        if s == 10:  # the trial's first step: nothing committed yet this step
            first = (stats.late, stats.shard.step, stats.shard.adam_step, a.steps, len(stats.shard.feedback))
        if s == 12:
            snap = (stats.late, stats.shard.step, stats.shard.adam_step, a.steps, bool(a._in_flight))
    state = a.optimizer_state()  # the committed state (collective inside each DC)
    _step(a, rank, world, 13)
    a.close()  # mid-trial, a sync in flight: must not hang, nor leave anything the next engine trips on
    a.groups.destroy()
    b = _engine(rank)
    b.load_optimizer_state(state)
    rows = [_row(_step(b, rank, world, s)) for s in range(13, 38)]
    b.synchronize()
    out = params_of(b.model), rows, first, snap
    b.close()
    b.groups.destroy()
    return out


def _snapshot_at_lost_decision(rank, world):
    lookahead_decision.PREFERRED_WITHIN = LOSE
    e = _engine(rank)
    for s in range(2 * WINDOW + 1):  # the trial's decision comes on step 20
        stats = _step(e, rank, world, s, snapshot_as=s + 1 if s == 2 * WINDOW else None)
    d = stats.lookahead_decision
    out = (d is not None and not d.lookahead, stats.shard.adam_step, e.steps, bool(e._in_flight))
    e.synchronize()
    e.close()
    e.groups.destroy()
    return out


def _all(per_rank, key):
    return [key(out) for out in per_rank]


def _agree(per_rank):
    first = per_rank[0][0]
    return all(torch.equal(out[0][n], first[n]) for out in per_rank[1:] for n in first)


# -- restores, snapshots, validation passes, close mid-trial ------------------------------------------------------

def test_an_engine_built_after_a_restore_past_lookahead_after_measures_then_tries_and_matches_the_replay():
    # PINS: due_at is fixed at the first step() of the restored engine (5 committed + 10), every rank
    # checks and decides at the same step, and the maths is the replay of exact → trial → exact / kept.
    for prefer, tail in ((LOSE, "E"), (WIN, "L")):
        per_rank = run_processes(_restored, 3, prefer, timeout_s=120)
        rows = per_rank[0][1]
        assert all(out[1] == rows for out in per_rank) and _agree(per_rank)
        assert _decided(rows) == [(20, (25, prefer == WIN))]  # steps 5..31: the check at 15, the decision at 25
        late = _modes(("E", 5 + 10), ("L", 11), (tail, 6))
        assert _late(rows) == late[5:]
        ref = _reference(32, late)
        assert max_rel_diff(per_rank[0][0], ref) < 1e-5


@pytest.mark.parametrize("prefer", [LOSE, WIN])
def test_a_validation_pass_mid_trial_commits_the_sync_in_flight_and_the_trial_decides_on_the_same_step(prefer):
    # PINS: synchronize() inside the trial (before step 14) lands and commits the sync in flight; the next
    # step commits nothing (its previous sync was landed), so the committed count and the decision step are those
    # of a trial without it, on every rank; the result is the replay with that extra commit. Ranks have 4, 3, 3
    # micro-batches (micro=1): the decision is per step(), not per backward.
    tail = "E" if prefer == LOSE else "L"
    per_rank = run_processes(_run, 3, prefer, 26, {}, (14,), 1, timeout_s=120)
    rows = per_rank[0][1]
    assert all(out[1] == rows for out in per_rank) and _agree(per_rank)
    assert _decided(rows) == [(20, (20, prefer == WIN))]
    modes = _modes(("E", 10), ("L", 11), (tail, 5))
    assert _late(rows) == modes
    assert max_rel_diff(per_rank[0][0], _reference(26, modes, sync_before=(14,), micro=1)) < 1e-5
    assert _all(per_rank, lambda out: out[2]) == [prefer != LOSE] * 3  # a lost trial frees the look-ahead's copies


def test_a_snapshot_inside_the_trial_and_an_engine_closed_mid_trial_restore_into_an_engine_that_decides_again():
    # PINS: the trial's first step (nothing committed yet) snapshots the committed state, without error
    # feedback and with adam_step = the committed updates; a later one likewise holds the state without the sync in
    # flight; close() with the trial and a sync in flight does not hang; a new epoch's engine restored from that
    # state measures again (10 exact steps), tries, decides, and matches the replay that drops the sync of step 12.
    per_rank = run_processes(_closed_mid_trial, 3, LOSE, timeout_s=120)
    rows = per_rank[0][1]
    assert all(out[1] == rows for out in per_rank) and _agree(per_rank)
    assert _all(per_rank, lambda out: out[2]) == [(True, 11, 10, 10, 0)] * 3
    assert _all(per_rank, lambda out: out[3]) == [(True, 13, 12, 12, True)] * 3
    # B: exact 13..22 (checked at 12 + 10 committed), trial 23..33, decided (lost) at 33, exact again
    assert _decided(rows) == [(33 - 13, (32, False))]
    modes = _modes(("E", 10), ("L", 3), ("E", 10), ("L", 11), ("E", 4))
    assert _late(rows) == modes[13:]
    assert max_rel_diff(per_rank[0][0], _reference(38, modes, drop_before=(13,))) < 1e-5


def test_a_snapshot_taken_on_the_step_a_lost_trial_committed_its_sync_holds_that_update():
    # Was a bug: on the step where the trial lost, step() took the snapshot (snapshot_as) *before* _decide()
    # committed the sync in flight, so the shard it returned was one committed update behind the engine it came
    # from, although nothing was in flight when step() returned (adam_step 20, engine at 21). A re-formation (or a
    # durable checkpoint of that step, which reuses the snapshot) resumed without an update the job had made.
    per_rank = run_processes(_snapshot_at_lost_decision, 3, timeout_s=120)
    for lost, adam_step, committed, in_flight in per_rank:
        assert lost and not in_flight
        assert adam_step == committed, f"snapshot adam_step {adam_step}, engine committed {committed}"


# -- compression with the trial and the switch back ----------------------------------------------------------------

@pytest.mark.parametrize("compression", [Compression.BF16, Compression.INT8])
def test_a_compressed_sync_tries_and_leaves_the_look_ahead_with_its_residuals_and_posted_receives_intact(compression):
    # PINS: with an inter-DC encoding (error feedback; two datacenters: exchanges with receives posted a
    # step ahead) a trial that loses, with a validation pass inside it, and one that wins, run on without hanging;
    # every replica holds the same bits; residuals go with the state once nothing is in flight; the result stays
    # near the uncompressed replay of the same schedule.
    for prefer, tail in ((LOSE, "E"), (WIN, "L")):
        per_rank = run_processes(_run, 3, prefer, 26, {"compression": compression}, (14,), 3, timeout_s=120)
        rows = per_rank[0][1]
        assert all(out[1] == rows for out in per_rank) and _agree(per_rank)
        assert _decided(rows) == [(20, (20, prefer == WIN))]
        modes = _modes(("E", 10), ("L", 11), (tail, 5))
        assert _late(rows) == modes
        assert all(out[3] > 0 for out in per_rank)  # the residuals are part of the state again
        assert max_rel_diff(per_rank[0][0], _reference(26, modes, sync_before=(14,))) < 3e-2  # measured: bf16 4e-3, int8 1.1e-2


# -- the chooser alone ---------------------------------------------------------------------------------------------

def test_the_chooser_s_rule_is_strict_on_both_sides_and_an_empty_trial_never_keeps_the_look_ahead(monkeypatch):
    # PINS: exposed == threshold × compute is not "exposed"; a trial exactly PREFERRED_WITHIN faster is not
    # "faster"; _Steps.medians() of no rows is an endless step (it was 0.0, which as a trial median would have kept
    # the look-ahead; no schedule reaches the check with no trial rows today).
    monkeypatch.setattr(lookahead_decision, "_max_over", lambda group, device, committed, *v: v)
    clock = iter(itertools.count())
    monkeypatch.setattr(lookahead_decision.time, "perf_counter", lambda: float(next(clock)))  # every step: 1 s
    c = lookahead_decision.LookaheadChooser(0.25, earliest=0)
    c.due_at(0)
    for committed in range(1, WINDOW):
        assert c.after_step(committed, 0.2, None, None) is None
    d = c.after_step(WINDOW, 0.2, None, None)  # exposed 0.2 of 1 s: 0.2 = 0.25 × 0.8, not over it
    assert d is not None and not d.lookahead and d.lookahead_step_s is None and d.steps_measured == 8
    # a lower threshold: tried; trial steps as long as exact ones (1 s) are not 1% faster: exact again
    c = lookahead_decision.LookaheadChooser(0.1, earliest=0)
    c.due_at(0)
    for committed in range(1, WINDOW + 1):
        assert c.after_step(committed, 0.2, None, None) is None
    assert c.trying and c.lookahead
    for committed in range(WINDOW, 2 * WINDOW):  # the trial's first step commits nothing
        assert c.after_step(committed, 0.0, None, None) is None
    d = c.after_step(2 * WINDOW, 0.0, None, None)
    assert d is not None and not d.lookahead and d.lookahead_step_s == d.exact_step_s == 1.0 and not c.lookahead
    empty = lookahead_decision._Steps()
    assert empty.medians() == (math.inf, 0.0)


# -- the planner ---------------------------------------------------------------------------------------------------

def _request(sync: SyncConfig, steps: int = 200, **kw) -> JobRequest:
    return JobRequest(name="p", model=model_preset("nano"), steps=steps, global_batch=8, micro_batch=1,
                      topology=TopologyRequest(), sync=sync, **kw)


def _figures(topo, kind):
    f = default_figures(topo, topo.datacenters, False)
    return {
        "default": None,
        "link known": replace(f, inter_dc_known=True),
        "compute known": replace(f, compute_known=True),
        "measured, exact": replace(f, inter_dc_known=True, compute_known=True, device_flops=5e8,
                                   inter_dc=Link(1e-4, 1e9 / 8)),
        "measured, look-ahead": replace(f, inter_dc_known=True, compute_known=True, device_flops=5e9,
                                        inter_dc=Link(10.5e-3, 1e9 / 8)),
        "slow link, compute guessed": replace(f, inter_dc_known=True, inter_dc=Link(50e-3, 1e8 / 8)),
    }[kind]


def _sync_requests():
    for comp, overlap, asked, after in itertools.product(
            (Compression.NONE, Compression.BF16, Compression.INT8), (True, False), (None, 0.2), (None, 0)):
        for strategy, delay, ahead in ((None, False, False), (SyncStrategy.HIERARCHICAL, False, False),
                                       (SyncStrategy.HIERARCHICAL, True, True), (SyncStrategy.DILOCO, False, False)):
            try:
                yield SyncConfig(strategy=strategy, bucket_mb=None, compression=comp, overlap=overlap,
                                 lookahead_when_exposed=asked, lookahead_after=after,
                                 delay_one_step=delay, local_lookahead=ahead)
            except ValueError:
                continue  # refused when the request is read: never planned


def test_no_request_the_planner_arms_makes_an_invalid_train_config_or_one_the_engine_refuses():
    # PINS: over request sync options (auto or explicit, compression, overlap, an
    # asked threshold, lookahead_after, the look-ahead set, DiLoCo) × figures × topologies × parallelism, the
    # TrainConfig built from an auto job's plan is always valid, and wherever it arms the look-ahead the engine can
    # run it (hierarchical, two or more datacenters, tp = pp = 1).
    topos = {"2+2": topology(dc_a=2, dc_b=2), "1+1": topology(dc_a=1, dc_b=1), "4": topology(dc_a=4),
             "2+1+1": topology(dc_a=2, dc_b=1, dc_c=1)}
    armed = 0
    for sync, (name, topo), kind, par in itertools.product(
            list(_sync_requests()), topos.items(),
            ("default", "link known", "measured, exact", "measured, look-ahead", "slow link, compute guessed"),
            (ParallelismRequest(), ParallelismRequest(tp=1, pp=2))):
        try:
            request = _request(sync, parallelism=par)
        except ValueError:
            continue  # refused when the request is read (a sync that cannot run with pp = 2): never planned
        plan = plan_job(request, topo, _figures(topo, kind))
        if sync.local_lookahead and plan.pp > 1:  # asked for by the job, which the engine cannot run: a 422 at submit
            with pytest.raises(ValueError, match="sync.local_lookahead applies to data parallelism only"):
                build_train_config("j", request, plan, "")
            continue
        config = build_train_config("j", request, plan, "")  # raises where the config is invalid
        s = config.sync
        if s.lookahead_when_exposed is not None and sync.strategy is None:
            armed += 1
            assert s.strategy is SyncStrategy.HIERARCHICAL and s.local_lookahead
            assert len(set(config.datacenters)) > 1 and config.parallel.tp == config.parallel.pp == 1, name
    assert armed > 50


@pytest.mark.parametrize("after, steps", [(None, 21), (None, 30), (0, 11), (0, 20)])
def test_auto_arms_the_look_ahead_only_for_a_job_long_enough_for_its_decision(after, steps):
    # Was a bug: armed_lookahead armed a job when steps > max(lookahead_start, LOOKAHEAD_DECISION_STEPS), but the
    # exact steps are checked only after max(lookahead_start, 10) steps and the trial then needs 11 more before it
    # decides. Such a job ran the look-ahead (its buffers, its loss) to its end untried and never decided: no
    # sync_decided event, although the plan's explanation promised one.
    request = _request(SyncConfig(strategy=None, lookahead_after=after), steps=steps)
    plan = plan_job(request, topology(dc_a=2, dc_b=2))
    decided_at = max(lookahead_start(after, 0), WINDOW) + WINDOW + 1  # steps needed for the trial's decision
    assert steps < decided_at
    assert plan.lookahead_when_exposed is None, f"armed a {steps}-step job; its decision needs {decided_at} steps"


def test_an_armed_engine_whose_job_ends_inside_the_trial_never_decides():
    # PINS what an engine armed for too short a job does (the planner no longer arms one; a job may still ask):
    # lookahead_after=0 and 20 steps: the exact steps are checked after step 9, steps 10-19 run the look-ahead
    # untried, no step carries a decision (so no sync_decided event), and the final synchronize() commits the last
    # sync.
    per_rank = run_processes(_run, 3, LOSE, 20, {"lookahead_after": 0}, (), 3, timeout_s=120)
    rows = per_rank[0][1]
    assert all(out[1] == rows for out in per_rank) and _agree(per_rank)
    assert _decided(rows) == [] and _late(rows) == _modes(("E", 10), ("L", 10))
    assert max_rel_diff(per_rank[0][0], _reference(20, _late(rows))) < 1e-5


def test_the_armed_plan_names_the_step_where_the_exact_steps_are_checked():
    # Was misleading: with lookahead_after below LOOKAHEAD_DECISION_STEPS (0 here) the explanation said "the exact
    # steps before step 0 measure how long each waits", but the engine checks them after step 10
    # (due_at = max(lookahead_after, committed + 10)).
    request = _request(SyncConfig(strategy=None, lookahead_after=0))
    plan = plan_job(request, topology(dc_a=2, dc_b=2))
    assert plan.lookahead_when_exposed is not None
    assert "before step 0 " not in plan.explanation
    assert f"before step {WINDOW} " in plan.explanation
