"""An armed look-ahead (``sync.lookahead_when_exposed``): the job's own steps decide whether it takes over.

Real gloo groups on CPU, the uneven 2 + 1 layout; the inter-DC link is the WAN emulator (25 ms one way) and every
forward sleeps 30 ms, so exact sync is exposed for sure and the look-ahead hides it for sure. Each outcome is held
to the single-process maths of what it chose: exact sync when it kept it, the look-ahead from the trial's first
step when it kept that, and the look-ahead for the trial only when the trial lost.
"""

from __future__ import annotations

import os
import time

import pytest
from sync_helpers import (
    max_rel_diff,
    params_of,
    reference_lookahead_params,
    reference_params,
    toy_model,
    train_steps,
)

from meridian.workers.contracts.config import (
    LOOKAHEAD_DECISION_MEASURE,
    LOOKAHEAD_DECISION_SKIP,
    OptimConfig,
    SyncConfig,
    WanConfig,
)
from meridian.workers.distributed.layout import DCGroups, DCLayout
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.sync import lookahead_decision
from meridian.workers.sync.build import build_sync
from meridian.workers.sync.lookahead_decision import LookaheadChooser
from meridian.workers.wan.collectives import WanEmulator, cleanup

OPTIM = OptimConfig(lr=0.05, weight_decay=0.1, grad_clip=0.5, warmup_steps=0)
UNEVEN = ("a", "a", "b")
WINDOW = LOOKAHEAD_DECISION_SKIP + LOOKAHEAD_DECISION_MEASURE
TRIAL_FROM = WINDOW  # the exact steps are checked after this many; the next step is the trial's first
DECIDED = 2 * WINDOW  # the trial's first step commits nothing, so its check comes one step later
STEPS = DECIDED + 3
WAN = WanConfig(rtt_ms=50.0, gbps=100.0)
RUNS = {"exposed": 0.05, "never": 100.0, "trial lost": 0.05}


def _armed(rank, world, key):
    layout = DCLayout(UNEVEN)
    emulator = WanEmulator(WAN, layout, rank, key=key)
    out = {}
    for name, threshold in RUNS.items():
        # the look-ahead must save all of a step to stay: it never does
        lookahead_decision.PREFERRED_WITHIN = 1.0 if name == "trial lost" else 0.01
        sync = SyncConfig(inter_dc_chunk_mb=40 / 2**20, delay_one_step=True,
                          local_lookahead=True, lookahead_after=3, lookahead_when_exposed=threshold)
        model = toy_model(0)
        model.register_forward_pre_hook(lambda *_: time.sleep(0.03))  # compute the link can hide behind
        e = build_sync(model, DCGroups(layout, rank), sync, OPTIM, emulator=emulator)
        stats = train_steps(e, rank, world, steps=STEPS, micro=3)
        e.synchronize()
        out[name] = (params_of(e.model), [(s.late, s.lookahead_decision) for s in stats], e.lookahead_copies)
        e.close()
        e.groups.destroy()
    emulator.close()
    return out


def test_an_armed_look_ahead_is_tried_where_the_sync_is_exposed_and_kept_only_where_it_steps_faster():
    key = f"test-armed-lookahead.{os.getpid()}"
    try:
        per_rank = run_processes(_armed, 3, key)
    finally:
        cleanup(key)
    exact = reference_params(STEPS, OPTIM)
    kept = reference_lookahead_params(STEPS, OPTIM, UNEVEN, exact_first=TRIAL_FROM)
    tried = reference_lookahead_params(STEPS, OPTIM, UNEVEN, exact_first=TRIAL_FROM, exact_from=DECIDED + 1)
    assert min(max_rel_diff(kept, exact), max_rel_diff(tried, exact), max_rel_diff(tried, kept)) > 1e-4
    figures = set()
    for out in per_rank:
        params, rows, copies = out["exposed"]
        assert max_rel_diff(params, kept) < 1e-5
        assert [late for late, _ in rows] == [False] * TRIAL_FROM + [True] * (STEPS - TRIAL_FROM)
        (at, d), = [(i, d) for i, (_, d) in enumerate(rows) if d is not None]
        assert at == DECIDED and d.lookahead and d.at_step == DECIDED and d.steps_measured == LOOKAHEAD_DECISION_MEASURE
        assert d.exposed_s > 0.02 and d.lookahead_step_s < 0.99 * d.exact_step_s
        assert "one step late at a local look-ahead, kept" in d.reason and copies > 0  # the committed rows kept
        figures.add((d.exposed_s, d.exact_step_s, d.lookahead_step_s))

        params, rows, copies = out["never"]
        assert max_rel_diff(params, exact) < 1e-5
        assert not any(late for late, _ in rows) and copies == 0  # no trial: the committed copies are dropped
        (at, d), = [(i, d) for i, (_, d) in enumerate(rows) if d is not None]
        assert at == TRIAL_FROM - 1 and not d.lookahead and d.lookahead_step_s is None
        assert d.reason.startswith("exact sync kept")

        params, rows, copies = out["trial lost"]
        assert max_rel_diff(params, tried) < 1e-5
        late = [False] * TRIAL_FROM + [True] * (DECIDED + 1 - TRIAL_FROM)
        assert [s for s, _ in rows] == late + [False] * (STEPS - DECIDED - 1)
        (d,) = [d for _, d in rows if d is not None]
        assert not d.lookahead and d.lookahead_step_s is not None and d.reason.startswith("exact sync again")
        assert copies == 0  # freed
    assert len(figures) == 1  # every rank decided on the same figures


def test_the_check_waits_for_lookahead_after_and_a_resumed_engine_measures_again():
    chooser = LookaheadChooser(0.05, earliest=20)
    assert chooser.due_at(0) == 20  # lookahead_after first
    assert chooser.due_at(500) == 20  # fixed at its first call
    assert LookaheadChooser(0.05, earliest=20).due_at(500) == 500 + WINDOW


def test_lookahead_when_exposed_needs_the_look_ahead():
    with pytest.raises(ValueError, match="lookahead_when_exposed applies with sync.local_lookahead=true"):
        SyncConfig(lookahead_when_exposed=0.05)
    SyncConfig(strategy=None, lookahead_when_exposed=0.05)  # auto may arm it
    with pytest.raises(ValueError, match="lookahead_when_exposed"):
        SyncConfig(delay_one_step=True, local_lookahead=True, lookahead_when_exposed=-1)
    SyncConfig(delay_one_step=True, local_lookahead=True, lookahead_when_exposed=0.05)
