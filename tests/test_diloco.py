"""DiLoCo and streaming DiLoCo on real gloo groups: H=1 with plain outer SGD (lr 1) is per-step parameter
averaging of the DC replicas; streaming fragments cover every parameter exactly once per cycle, on the wire
too; the outer state survives a resize (a node lost, DCs of different sizes) from memory and from a
durable checkpoint."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from sync_helpers import GLOBAL_BATCH, lr_of, params_of, share_loss, toy_batch, toy_model, train_steps
from test_elastic_loop import elastic_run  # noqa: F401 - the fixture

from meridian.workers.contracts.config import (
    DiLoCoConfig,
    FinalAverage,
    OptimConfig,
    OuterMerge,
    SyncConfig,
    SyncStrategy,
)
from meridian.workers.data.text import rank_slice
from meridian.workers.distributed.layout import DCGroups, DCLayout
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.elastic.durable import restore_latest
from meridian.workers.optim.adamw import build_adamw
from meridian.workers.state import checkpoint as ckpt_io
from meridian.workers.state.replica_state import assemble
from meridian.workers.state.sharded_checkpoint import save_shard
from meridian.workers.sync.diloco import DiLoCoSync
from meridian.workers.sync.diloco_schedule import FragmentSchedule, split_fragments

OPTIM = OptimConfig(lr=0.05, weight_decay=0.1, grad_clip=0.5, warmup_steps=0)


def _sync(strategy: SyncStrategy, **diloco) -> SyncConfig:
    return SyncConfig(strategy=strategy, inter_dc_chunk_mb=40 / 2**20, diloco=DiLoCoConfig(**diloco))


def _engine(rank, dcs, sync):
    return DiLoCoSync(toy_model(0), DCGroups(DCLayout(dcs), rank), sync, OPTIM)


def _numel(params) -> int:
    return sum(math.prod(p.param.shape) for p in params)


def _close(engine):
    engine.synchronize()
    out = params_of(engine.model)
    engine.close()
    engine.groups.destroy()
    return out


# -- H = 1, outer SGD lr 1, no momentum: per-step averaging -------------------------------------------------


def _h1_run(rank, world, dcs):
    e = _engine(rank, dcs, _sync(SyncStrategy.DILOCO, inner_steps=1, outer_lr=1.0, outer_momentum=0.0))
    stats = train_steps(e, rank, world, steps=4, micro=2)
    return _close(e), [s.inter_dc_bytes for s in stats], _numel(e.params)


def _inner_steps(layout: DCLayout, replicas, opts, step: int) -> None:
    """Step ``step`` of every DC's replica on its DC's samples, the gradient scaled to the DC mean as the engine
    does (its ranks' shares of the global batch, times world / DC size)."""
    for dc, model in replicas.items():
        for r in layout.ranks_in(dc):
            share = rank_slice(GLOBAL_BATCH, r, layout.world_size)
            x, y = toy_batch(step, share.start, share.stop)
            (share_loss(model, x, y) * layout.world_size / len(layout.ranks_in(dc))).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.grad_clip)
        for g in opts[dc].param_groups:
            g["lr"] = lr_of(step)
        opts[dc].step()
        opts[dc].zero_grad()


def _per_step_averaging(dcs: tuple[str, ...], steps: int) -> dict[str, torch.Tensor]:
    """One AdamW replica per DC on its DC's samples (gradient scaled to the DC mean as the engine does), the
    replicas' parameters averaged after every step; inner AdamW states stay apart, as in DiLoCo."""
    layout = DCLayout(dcs)
    replicas = {dc: toy_model(0) for dc in layout.dcs}
    opts = {dc: build_adamw(m, OPTIM) for dc, m in replicas.items()}
    for step in range(steps):
        _inner_steps(layout, replicas, opts, step)
        with torch.no_grad():
            for name, _ in replicas[layout.dcs[0]].named_parameters():
                mean = torch.stack([dict(m.named_parameters())[name] for m in replicas.values()]).mean(0)
                for m in replicas.values():
                    dict(m.named_parameters())[name].copy_(mean)
    return params_of(replicas[layout.dcs[0]])


@pytest.mark.parametrize("dcs", [("a", "a", "b", "b"), ("a", "a", "b")])
def test_h1_diloco_with_plain_outer_sgd_equals_per_step_averaging(dcs):
    out = run_processes(_h1_run, len(dcs), dcs)
    ref = _per_step_averaging(dcs, 4)
    for params, _, _ in out:
        for name in ref:
            torch.testing.assert_close(params[name], ref[name], rtol=1e-5, atol=1e-6)
    # Each step every DC sends one full fp32 copy of the model (its rows, not FSDP2's padding), split over its ranks.
    padded = out[0][2] * 4
    layout = DCLayout(dcs)
    for dc in layout.dcs:
        per_step = [sum(out[r][1][s] for r in layout.ranks_in(dc)) for s in range(4)]
        assert per_step == [padded] * 4


def _h3_bytes(rank, world):
    e = _engine(rank, ("a", "b"), _sync(SyncStrategy.DILOCO, inner_steps=3, outer_lr=0.7, outer_momentum=0.9))
    stats = train_steps(e, rank, world, steps=7, micro=5)
    return [s.inter_dc_bytes for s in stats], _close(e)


def test_diloco_crosses_the_wan_only_every_h_steps_and_replicas_agree_after_a_sync():
    (b0, p0), (b1, p1) = run_processes(_h3_bytes, 2)
    assert [b > 0 for b in b0] == [False, False, True, False, False, True, False]
    assert b0 == b1
    # after step 6 (a sync) both DCs held the same outer parameters; step 7 is local again
    assert any(not torch.equal(p0[n], p1[n]) for n in p0)


# -- streaming: every parameter exactly once per cycle ------------------------------------------------------


def test_fragments_partition_the_parameters_and_each_syncs_once_per_cycle():
    named = list(toy_model(0).named_parameters())
    frags = split_fragments([p.numel() for _, p in named], 3)
    assert [i for f in frags for i in f] == list(range(len(named)))  # contiguous runs, each parameter once
    assert all(frags)
    sched = FragmentSchedule(inner_steps=6, fragments=3, overlap_steps=1)
    for start in (1, 4, 7):
        cycle = sched.cycle(start)
        assert sorted(p for _, p in cycle) == [0, 1, 2]
    assert [sched.starting(t) for t in range(1, 7)] == [[], [0], [], [1], [], [2]]
    assert [sched.landing(t) for t in range(1, 8)] == [[], [], [0], [], [1], [], [2]]
    with pytest.raises(ValueError, match="need at least as many parameters"):
        split_fragments([10, 10], 3)
    DiLoCoConfig(inner_steps=4, fragments=2, overlap_steps=3)  # fragments may be in flight together ...
    with pytest.raises(ValueError, match="overlap_steps"):  # ... each landing before its own next sync
        DiLoCoConfig(inner_steps=4, fragments=2, overlap_steps=4)
    with pytest.raises(ValueError, match="warm-up cycle no longer than inner_steps"):  # max(2 * 4, 1) = 8 > 4
        DiLoCoConfig(inner_steps=4, fragments=2, overlap_steps=3, warmup_steps=8)
    with pytest.raises(ValueError, match="streaming-diloco"):
        SyncConfig(strategy=SyncStrategy.DILOCO, diloco=DiLoCoConfig(inner_steps=4, fragments=2))


def test_warmup_syncs_every_fragment_on_the_short_cycle_then_switches_to_h():
    sched = FragmentSchedule(inner_steps=12, fragments=2, overlap_steps=1, warmup_steps=8)  # short cycle: 4
    started = {t: sched.starting(t) for t in range(1, 33) if sched.starting(t)}
    # warm-up: fragment 0 after 2 steps of each 4-step cycle, fragment 1 after 4; then H = 12 from step 8
    assert started == {2: [0], 4: [1], 6: [0], 8: [1], 14: [0], 20: [1], 26: [0], 32: [1]}
    landed = {t: sched.landing(t) for t in range(1, 34) if sched.landing(t)}
    assert landed == {t + 1: p for t, p in started.items()}  # each lands overlap_steps later, none skipped
    assert sorted(p for _, p in sched.cycle(9)) == [0, 1]
    with pytest.raises(ValueError, match="multiple of the warm-up's sync cycle"):
        DiLoCoConfig(inner_steps=12, fragments=2, overlap_steps=1, warmup_steps=6)
    plain = FragmentSchedule(inner_steps=8, fragments=1, warmup_steps=4)  # plain DiLoCo: every H/4 steps, then H
    assert [t for t in range(1, 21) if plain.starting(t)] == [2, 4, 12, 20]


def _streaming(rank, world):
    sync = _sync(SyncStrategy.STREAMING_DILOCO, inner_steps=6, fragments=3, overlap_steps=0, outer_momentum=0.9)
    e = _engine(rank, ("a", "a", "b", "b"), sync)
    per_step, sent = [], []
    for step in range(12):
        stats = train_steps(e, rank, world, steps=1, micro=2, first_step=step)
        e.synchronize()
        per_step.append(params_of(e.model))
        sent.append(stats[0].inter_dc_bytes)
    frags = [[p.name for p in f] for f in e.fragments]
    sizes = [_numel(f) for f in e.fragments]
    _close(e)
    return per_step, sent, frags, sizes


def test_streaming_syncs_each_fragment_once_per_cycle_on_the_wire():
    out = run_processes(_streaming, 4)
    per_step, _, frags, sizes = out[0]
    dc_sent = [out[0][1][s] + out[1][1][s] for s in range(12)]  # DC a's bytes per step
    expected = [0, sizes[0] * 4, 0, sizes[1] * 4, 0, sizes[2] * 4] * 2
    assert dc_sent == expected
    other = out[2][0]
    for step, landed in ((1, 0), (3, 1), (5, 2), (7, 0), (9, 1), (11, 2)):  # 0-based step index
        for name in frags[landed]:  # the fragment that just landed is the same in both DCs ...
            assert torch.equal(per_step[step][name], other[step][name]), (step, name)
    # ... while a fragment synced earlier has drifted apart again by then
    assert any(not torch.equal(per_step[5][n], other[5][n]) for n in frags[0])


# -- overlap: the merge when a fragment lands, against a single-process reference -------------------------------

OVERLAP = dict(inner_steps=4, fragments=2, outer_lr=0.7, outer_momentum=0.9)
OVERLAP_STEPS = 10  # fragment 0 syncs after inner steps 2, 6, 10 and lands tau steps later; fragment 1 after 4, 8


def _overlap_run(rank, world, dcs, merge, tau):
    e = _engine(rank, dcs, _sync(SyncStrategy.STREAMING_DILOCO, merge=merge, overlap_steps=tau, **OVERLAP))
    train_steps(e, rank, world, steps=OVERLAP_STEPS, micro=2)
    frags = [[p.name for p in f] for f in e.fragments]
    return _close(e), frags


def _streaming_reference(dcs, fragments, merge: OuterMerge, tau: int, alpha: float = 0.5, *,
                         average_at_end: bool = False) -> dict[str, dict[str, torch.Tensor]]:
    """One AdamW replica per DC; each fragment's outer Nesterov step on the DCs' mean delta ``anchor - theta``
    taken when its sync starts, applied ``tau`` steps later, merged into every replica's weights then.
    ``average_at_end``: the last step starts no sync, lands those in flight, and every replica becomes
    ``anchor - mean(anchor - theta)``, the mean of the replicas."""
    cfg = DiLoCoConfig(overlap_steps=tau, **OVERLAP)
    sched = FragmentSchedule(cfg.inner_steps, cfg.fragments, cfg.overlap_steps)
    layout = DCLayout(dcs)
    replicas = {dc: toy_model(0) for dc in layout.dcs}
    opts = {dc: build_adamw(m, OPTIM) for dc, m in replicas.items()}
    theta = {dc: dict(m.named_parameters()) for dc, m in replicas.items()}
    anchor = {n: p.detach().clone() for n, p in replicas[layout.dcs[0]].named_parameters()}
    momentum = {n: torch.zeros_like(a) for n, a in anchor.items()}
    started, mean_delta = {}, {}
    for step in range(OVERLAP_STEPS):
        _inner_steps(layout, replicas, opts, step)
        done = step + 1
        closing = average_at_end and done == OVERLAP_STEPS
        with torch.no_grad():
            for f in [] if closing else sched.starting(done):
                started[f] = {dc: {n: theta[dc][n].detach().clone() for n in fragments[f]} for dc in layout.dcs}
                mean_delta[f] = {n: torch.stack([anchor[n] - theta[dc][n] for dc in layout.dcs]).mean(0)
                                 for n in fragments[f]}  # fmt: skip
            for f in sorted(mean_delta) if closing else sched.landing(done):
                for n in fragments[f]:
                    momentum[n].mul_(cfg.outer_momentum).add_(mean_delta[f][n])
                    anchor[n].sub_(mean_delta[f][n] + cfg.outer_momentum * momentum[n], alpha=cfg.outer_lr)
                    for dc in layout.dcs:
                        if merge is OuterMerge.KEEP_PROGRESS:
                            theta[dc][n].copy_(theta[dc][n] - started[f][dc][n] + anchor[n])
                        else:
                            theta[dc][n].copy_(alpha * theta[dc][n] + (1 - alpha) * anchor[n])
                del mean_delta[f]  # landed: what is left there is in flight
            if closing:
                for n, a in anchor.items():
                    a.sub_(torch.stack([a - theta[dc][n] for dc in layout.dcs]).mean(0))
                    for dc in layout.dcs:
                        theta[dc][n].copy_(a)
    return {dc: params_of(m) for dc, m in replicas.items()}


@pytest.mark.parametrize("dcs,merge,tau", [(("a", "a", "b", "b"), OuterMerge.KEEP_PROGRESS, 1),
                                           (("a", "a", "b"), OuterMerge.KEEP_PROGRESS, 3),
                                           (("a", "b"), OuterMerge.MIX, 1)])  # fmt: skip
def test_a_fragment_landing_late_merges_as_the_single_process_reference(dcs, merge, tau):
    # tau 3 of H 4 with 2 fragments: the second fragment starts while the first is still in flight
    out = run_processes(_overlap_run, len(dcs), dcs, merge, tau)
    fragments = out[0][1]
    ref = _streaming_reference(dcs, fragments, merge, tau)
    other = _streaming_reference(dcs, fragments, next(m for m in OuterMerge if m is not merge), tau)
    for rank, (params, _) in enumerate(out):
        for name in params:
            torch.testing.assert_close(params[name], ref[dcs[rank]][name], rtol=1e-5, atol=1e-6)
    # the two merges train differently here, so the comparison above tells them apart
    assert any(not torch.allclose(ref[d][n], other[d][n], rtol=1e-3, atol=1e-4) for d in ref for n in ref[d])


# -- the last step: the datacenters average their weights -------------------------------------------------------


def _closing_run(rank, world, dcs, merge, tau, final):
    sync = _sync(SyncStrategy.STREAMING_DILOCO, merge=merge, overlap_steps=tau, final_average=final, **OVERLAP)
    e = _engine(rank, dcs, sync)
    stats = train_steps(e, rank, world, steps=OVERLAP_STEPS - 1, micro=2)
    in_flight = sorted(e.in_flight)
    stats += train_steps(e, rank, world, steps=1, micro=2, first_step=OVERLAP_STEPS - 1, job_ends=True)
    rows = sum(p.local.numel() for p in e.params)
    frags = [[p.name for p in f] for f in e.fragments]
    return _close(e), frags, in_flight, [s.inter_dc_bytes for s in stats], rows


@pytest.mark.parametrize("dcs,merge,tau,in_flight", [
    (("a", "a", "b"), OuterMerge.KEEP_PROGRESS, 3, [1]),  # fragment 1's sync, started after step 8, lands early
    (("a", "b", "c", "c"), OuterMerge.MIX, 1, []),  # fragment 0's, due after step 10, is not started
])  # fmt: skip
def test_the_last_step_lands_what_is_in_flight_and_averages_the_datacenters(dcs, merge, tau, in_flight):
    out = run_processes(_closing_run, len(dcs), dcs, merge, tau, FinalAverage.FP32)
    fragments = out[0][1]
    ref = _streaming_reference(dcs, fragments, merge, tau, average_at_end=True)
    apart = _streaming_reference(dcs, fragments, merge, tau)
    assert any(not torch.allclose(apart[dcs[0]][n], apart[dcs[-1]][n]) for n in apart[dcs[0]])  # they differ
    assert out[0][2] == in_flight  # at the last step
    for rank, (params, _, _, sent, rows) in enumerate(out):
        for name in params:
            torch.testing.assert_close(params[name], ref[dcs[rank]][name], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(params[name], out[0][0][name], rtol=0, atol=0)  # one model everywhere
        # the last step sends every row once (fp32), over a ring of the datacenters' holders when more than two
        k = len(set(dcs))
        assert sent[-1] == (4 * rows if k == 2 else round(2 * (k - 1) / k * 4 * rows))
        assert sent[-2] == 0  # step 9 starts no sync


def test_the_average_in_bf16_is_the_fp32_one_to_bf16_precision_of_the_deltas():
    dcs = ("a", "b")
    exact = run_processes(_closing_run, 2, dcs, OuterMerge.KEEP_PROGRESS, 1, FinalAverage.FP32)
    bf16 = run_processes(_closing_run, 2, dcs, OuterMerge.KEEP_PROGRESS, 1, FinalAverage.BF16)
    for (e, _, _, e_sent, rows), (b, _, _, b_sent, _) in zip(exact, bf16, strict=True):
        for name in e:
            torch.testing.assert_close(b[name], e[name], rtol=0, atol=2e-3)
        assert e_sent[-1] == 4 * rows and b_sent[-1] == 2 * rows
    assert any(not torch.equal(b[n], e[n]) for (e, *_), (b, *_) in zip(exact, bf16, strict=True) for n in e)


# -- state survives a resize -----------------------------------------------------------------------------------

RESIZE = _sync(SyncStrategy.STREAMING_DILOCO, inner_steps=4, fragments=2, overlap_steps=1, outer_momentum=0.9)


def _before(rank, world, directory):
    e = _engine(rank, ("a", "a", "b", "b"), RESIZE)
    train_steps(e, rank, world, steps=6, micro=2)  # fragment 0 starts at inner step 6: in flight now
    assert list(e.in_flight) == [0]
    shard = e.local_shard(6)
    full = e.optimizer_state()
    e.synchronize()
    model = params_of(e.model)  # whole (FSDP2 shards them: every rank gathers)
    if rank == 0:
        ckpt_io.save(directory, ckpt_io.Checkpoint(step=6, model=model, optimizer=full, fingerprint={}))
    shapes = {n: p.shape for n, p in e.model.named_parameters()}
    save_shard(f"{directory}/sharded", shard, rank=rank, datacenter=e.groups.dc, shapes=shapes, fingerprint={})
    return _close(e), shard, full


def _after(rank, world, params, optimizer):
    e = _engine(rank, ("a", "a", "b"), RESIZE)
    e.synchronize()
    e.load_weights(e.model, params)
    e.load_optimizer_state(optimizer)
    restored = e.optimizer_state()
    stats = train_steps(e, rank, world, steps=4, micro=2, first_step=6)
    return restored, [s.inter_dc_bytes for s in stats], _close(e)


def _after_sharded(rank, world, directory):
    """As :func:`_after`, each rank reading from the sharded checkpoint only what it holds."""
    e = _engine(rank, ("a", "a", "b"), RESIZE)
    restore_latest(directory, {}, e.model, e)
    restored = e.optimizer_state()
    stats = train_steps(e, rank, world, steps=4, micro=2, first_step=6)
    return restored, [s.inter_dc_bytes for s in stats], _close(e)


def _assert_same_state(restored, full):
    for key in ("anchor", "momentum"):
        for name, t in full["diloco"][key].items():
            assert torch.equal(restored["diloco"][key][name], t), (key, name)
    assert restored["diloco"]["inner_steps_done"] == full["diloco"]["inner_steps_done"] == 6
    assert restored["step"] == full["step"] == 6
    for name, ms in full["params"].items():
        for m, t in ms.items():
            assert torch.equal(restored["params"][name][m], t), (name, m)


def test_outer_state_survives_a_resize_from_memory_and_from_a_checkpoint(tmp_path):
    before = run_processes(_before, 4, str(tmp_path))
    dc_a_params, _, dc_a_full = before[0]
    assert dc_a_full["diloco"]["momentum"] and any(t.abs().sum() > 0 for t in dc_a_full["diloco"]["momentum"].values())
    # DC b loses rank 3: the survivors' shards rebuild DC a's inner state and the whole outer state
    shapes = {n: t.shape for n, t in dc_a_params.items()}
    params, optimizer = assemble([before[r][1] for r in (0, 1, 2)], shapes)
    for name, t in dc_a_params.items():
        assert torch.equal(params[name], t)
    ck = ckpt_io.load_latest(str(tmp_path))
    assert ck is not None
    for source in ((params, optimizer), (ck.model, ck.optimizer), f"{tmp_path}/sharded"):
        after = run_processes(_after_sharded, 3, source) if isinstance(source, str) else run_processes(_after, 3, *source)
        for restored, sent, _ in after:
            _assert_same_state(restored, dc_a_full)
            # The schedule resumes where it was: fragment 0's sync in flight at the failure is dropped (its
            # delta is measured again from the same anchor next cycle); fragment 1 starts at inner step 8,
            # fragment 0 at 10. Uneven DCs (2 + 1): every rank still sends its share.
            assert [b > 0 for b in sent] == [False, True, False, True]
        # DC b's single rank carries its whole DC's share of fragment 1: as much as DC a's two ranks together
        assert after[2][1][1] == after[0][1][1] + after[1][1][1]

    # One rank lost in each DC (0 and 3 survive): no DC's inner state is whole, the outer state is (the
    # survivors own different halves). The inner phase restarts from the outer parameters.
    params, optimizer = assemble([before[r][1] for r in (0, 3)], shapes)
    anchor = before[0][2]["diloco"]["anchor"]
    for name, t in anchor.items():
        assert torch.equal(params[name], t)
    assert optimizer["step"] == 0 and optimizer["params"] == {} and optimizer["diloco"]["inner_steps_done"] == 6
    for name, t in before[0][2]["diloco"]["momentum"].items():
        assert torch.equal(optimizer["diloco"]["momentum"][name], t)


# -- through the elastic loop: a node lost mid-run ---------------------------------------------------------


@pytest.mark.slow
def test_elastic_loop_with_diloco_loses_a_rank_and_resumes_from_the_whole_dc(elastic_run):  # noqa: F811
    from test_elastic_loop import DCS, job

    cfg = dataclasses.replace(job(), sync=SyncConfig(
        strategy=SyncStrategy.STREAMING_DILOCO, bucket_mb=0.05, inter_dc_chunk_mb=0.02,
        diloco=DiLoCoConfig(inner_steps=4, fragments=2, overlap_steps=1),
    ))  # fmt: skip
    run = elastic_run(4)
    for i, dc in enumerate(DCS):
        run.start(i, dc, cfg)
    run.kill_after_step(1, cfg, 3)  # dc-a keeps one of its two ranks: only dc-b's inner state is whole
    out = run.collect({0, 2, 3})
    formed = [e[2] for e in run.events() if e[0] == "epoch_formed"]
    assert len(formed) == 2 and formed[1]["datacenters"] == ["dc-a", "dc-b", "dc-b"], formed
    assert formed[1]["resume_step"] >= 3  # resumed from memory, no step lost
    finished = [o["result"] for o in out.values() if o["result"] is not None]
    assert len(finished) == 3 and all(r.final_loss == r.final_loss for r in finished)  # not NaN
    # Both DCs sync again after the resize: the outer syncs of the later steps crossed the WAN.
    later = [r for o in out.values() for r in o["records"] if r.epoch == 2]
    assert later and any(r.inter_dc_bytes > 0 for r in later)
