"""The planner's choice between per-step hierarchical sync, DiLoCo and streaming DiLoCo, without Ray."""

from __future__ import annotations

from dataclasses import replace

import pytest
from fakes import topology

from meridian.service.jobs import JobRequest, ParallelismRequest, TopologyRequest
from meridian.service.planning.cost_model import Link
from meridian.service.planning.figures import figures_for
from meridian.service.planning.planner import default_figures, plan_job
from meridian.service.planning.sync_choice import (
    DILOCO_MIN_STEPS,
    FRAGMENTS,
    MAX_H,
    MAX_OVERLAP_FRACTION,
    MIN_INNER_STEPS,
    OUTER_BYTES_PER_PARAM,
    OVERLAP_MARGIN,
    choose_sync,
    cross_dc_time,
)
from meridian.service.planning.train_config import build_train_config
from meridian.workers.contracts.config import Compression, DiLoCoConfig, SyncConfig, SyncStrategy, WanConfig
from meridian.workers.contracts.model_config import model_preset

TINY = model_preset("tiny").num_params  # 0.8 M parameters: 3.3 MB of fp32


def test_fast_link_keeps_per_step_hierarchical_sync():
    c = choose_sync(rtt_ms=1, gbps=100, num_params=TINY, compute_s=0.2)
    assert c.strategy is SyncStrategy.HIERARCHICAL and c.diloco is None and c.compression is Compression.NONE
    # one bucket: its whole exchange follows backward
    assert c.har_exposed_s == pytest.approx(cross_dc_time(4 * TINY, rtt_ms=1, gbps=100, num_dcs=2))
    assert "identical to one process" in c.explanation and "1 ms RTT / 100 Gbit/s" in c.explanation
    # with 8 buckets behind 133 ms of backward, only the last one's latency and eighth of the transfer show
    c = choose_sync(rtt_ms=1, gbps=100, num_params=TINY, compute_s=0.2, last_sync_mb=4 * TINY / 2**20 / 8)
    assert c.har_exposed_s == pytest.approx(0.0005 + (c.outer_sync_s - 0.0005) / 8)


def test_per_step_sync_goes_bf16_across_dcs_when_fp32_would_be_exposed_and_bf16_is_not():
    # 21 ms RTT, 1 Gbit/s, one 3.5 MB bucket: fp32 leaves 10.5 + 28 ms after backward, bf16 10.5 + 14 ms.
    fp32 = cross_dc_time(4 * TINY, rtt_ms=21, gbps=1, num_dcs=2)
    bf16 = cross_dc_time(2 * TINY, rtt_ms=21, gbps=1, num_dcs=2)
    compute_s = bf16 / 0.10  # bf16 exactly at the per-step limit, fp32 far over the exact limit
    c = choose_sync(rtt_ms=21, gbps=1, num_params=TINY, compute_s=compute_s, lookahead=False)
    assert c.strategy is SyncStrategy.HIERARCHICAL and c.compression is Compression.BF16 and c.diloco is None
    assert c.har_exposed_s == pytest.approx(bf16) and c.outer_sync_s == pytest.approx(bf16)
    assert "bf16" in c.explanation and "still one sync per step" in c.explanation and not c.local_lookahead
    assert choose_sync(rtt_ms=21, gbps=1, num_params=TINY, compute_s=fp32 / 0.05).compression is Compression.NONE
    assert choose_sync(rtt_ms=21, gbps=1, num_params=TINY, compute_s=compute_s * 0.9, lookahead=False).strategy.is_diloco


def test_per_step_sync_goes_one_step_late_at_a_look_ahead_when_the_sync_fits_behind_a_step():
    # 21 ms RTT, 1 Gbit/s, one bucket: the whole fp32 sync (10.5 + 28 ms) follows backward, over 5% of a step
    fp32 = cross_dc_time(4 * TINY, rtt_ms=21, gbps=1, num_dcs=2)
    c = choose_sync(rtt_ms=21, gbps=1, num_params=TINY, compute_s=0.2)
    assert c.strategy is SyncStrategy.HIERARCHICAL and c.local_lookahead and c.compression is Compression.NONE
    assert c.har_exposed_s == 0.0 and c.outer_sync_s == pytest.approx(fp32)  # a whole step to land in
    assert "one step late" in c.explanation and "look-ahead" in c.explanation and "exact global update" in c.explanation
    # the boundary: the sync may outlast the step by 5% of it, no more
    assert choose_sync(rtt_ms=21, gbps=1, num_params=TINY, compute_s=fp32 / 1.049).local_lookahead
    late = choose_sync(rtt_ms=21, gbps=1, num_params=TINY, compute_s=fp32 / 1.06)
    assert not late.local_lookahead and late.strategy.is_diloco
    # where exact sync hides well enough it stays exact
    assert not choose_sync(rtt_ms=21, gbps=1, num_params=TINY, compute_s=fp32 / 0.05).local_lookahead
    # its extra AdamW pass counts: within 5% of the step, and less than exact sync would show
    assert choose_sync(rtt_ms=21, gbps=1, num_params=TINY, compute_s=0.2, optimizer_step_s=0.0099).local_lookahead
    assert not choose_sync(rtt_ms=21, gbps=1, num_params=TINY, compute_s=0.2, optimizer_step_s=0.0101).local_lookahead
    # it starts with exact steps: a job no longer than them is not offered it
    assert "after the first 30 steps" in choose_sync(rtt_ms=21, gbps=1, num_params=TINY, compute_s=0.2, steps=31,
                                                     lookahead_after=30).explanation
    assert not choose_sync(rtt_ms=21, gbps=1, num_params=TINY, compute_s=0.2, steps=30, lookahead_after=30).local_lookahead


def test_slow_link_one_bucket_picks_diloco_with_4bit_deltas_and_h_that_amortises_the_sync():
    # 21 ms RTT, 1 Gbit/s: per-step sync ≈ 10.5 ms + 28 ms, all after backward (the model is one 4 MiB
    # bucket), longer than 35 ms of compute even one step late; nothing to stream either, so plain DiLoCo with
    # int4 outer deltas.
    c = choose_sync(rtt_ms=21, gbps=1, num_params=TINY, compute_s=0.035)
    sync_s = cross_dc_time(4 * TINY, rtt_ms=21, gbps=1, num_dcs=2)
    assert c.strategy is SyncStrategy.DILOCO and c.compression is Compression.INT4
    outer_s = cross_dc_time(OUTER_BYTES_PER_PARAM * TINY, rtt_ms=21, gbps=1, num_dcs=2)
    assert c.outer_sync_s == pytest.approx(outer_s) and outer_s < sync_s / 2
    assert c.diloco.inner_steps == MIN_INNER_STEPS  # the amortisation needs fewer: the evidence floor binds
    assert f"H={MIN_INNER_STEPS}" in c.explanation and "4-bit" in c.explanation
    # without the floor: the smallest H that keeps the averaged sync under half the 10% budget
    h = choose_sync(rtt_ms=21, gbps=1, num_params=TINY, compute_s=0.035, min_inner_steps=1).diloco.inner_steps
    assert outer_s / h <= 0.05 * 0.035 < outer_s / (h - 1)


def test_very_slow_link_picks_streaming_diloco_whose_overlap_covers_each_fragment_sync():
    c = choose_sync(rtt_ms=100, gbps=0.1, num_params=TINY, compute_s=0.05, last_sync_mb=0.5)
    assert c.strategy is SyncStrategy.STREAMING_DILOCO and c.compression is Compression.INT4
    cfg = c.diloco
    assert cfg.fragments == FRAGMENTS and cfg.inner_steps % cfg.fragments == 0
    frag_s = cross_dc_time(OUTER_BYTES_PER_PARAM * TINY / cfg.fragments, rtt_ms=100, gbps=0.1, num_dcs=2)
    # the fewest steps that cover 1.5x its modelled time
    assert (cfg.overlap_steps - 1) * 0.05 < OVERLAP_MARGIN * frag_s <= cfg.overlap_steps * 0.05
    assert cfg.inner_steps == MIN_INNER_STEPS and cfg.overlap_steps <= cfg.inner_steps * MAX_OVERLAP_FRACTION
    assert "evidence floor" in c.explanation and "x fewer inter-DC bytes" in c.explanation
    DiLoCoConfig(**{f: getattr(cfg, f) for f in ("inner_steps", "fragments", "overlap_steps")})  # valid
    assert cfg.warmup_steps == 0  # the job's length unknown: no warm-up
    warm = choose_sync(rtt_ms=100, gbps=0.1, num_params=TINY, compute_s=0.05, last_sync_mb=0.5, steps=1200).diloco
    cycle = max(cfg.fragments * (cfg.overlap_steps + 1), cfg.inner_steps // 4)
    assert warm.warmup_steps % cycle == 0 and 0.4 * 1200 - cycle < warm.warmup_steps <= 0.4 * 1200


def test_the_explanation_counts_the_warm_up_in_the_job_s_bytes():
    import re

    from meridian.workers.sync.diloco_schedule import FragmentSchedule

    # the bench's nano model at 64 samples a step (~31 ms) on 100 ms / 0.1 Gbit/s, a 2,048-step job
    nano, steps = 136_960, 2048
    c = choose_sync(rtt_ms=100, gbps=0.1, num_params=nano, compute_s=0.031, last_sync_mb=0.1, steps=steps)
    cfg = c.diloco
    assert cfg.warmup_steps > 0
    after, whole = (float(x) for x in re.search(r"(\d+)x fewer inter-DC bytes .* so (\d+)x fewer over the whole",
                                                 c.explanation).groups())
    # what the workers' schedule sends over the job: each fragment start sends 1/fragments of the outer deltas
    schedule = FragmentSchedule(cfg.inner_steps, cfg.fragments, cfg.overlap_steps, cfg.warmup_steps)
    starts = sum(len(schedule.starting(done)) for done in range(1, steps + 1))
    sent = starts * OUTER_BYTES_PER_PARAM * nano / cfg.fragments
    assert whole == pytest.approx(4 * nano * steps / sent, rel=0.03)
    assert whole < after == pytest.approx(4 / OUTER_BYTES_PER_PARAM * cfg.inner_steps, abs=1)


def test_no_warm_up_when_its_cycle_would_not_be_shorter_than_h():
    # the bench's nano model and step on 100 ms / 0.1 Gbit/s: 11 overlapped steps need H = 36 (a third of H), and
    # 11 steps of each of 4 fragments make a 48-step warm-up cycle, longer than H, so a "warm-up" would sync less
    # often than H does; several fragments are in flight at once instead
    nano = 136_960
    c = choose_sync(rtt_ms=100, gbps=0.1, num_params=nano, compute_s=0.0076, last_sync_mb=0.1, steps=4096)
    cfg = c.diloco
    assert cfg.overlap_steps == 11 and cfg.inner_steps == 36 and "room for the overlap" in c.explanation
    assert cfg.overlap_steps <= cfg.inner_steps * MAX_OVERLAP_FRACTION
    assert max(cfg.fragments * (cfg.overlap_steps + 1), cfg.inner_steps // 4) > cfg.inner_steps
    assert cfg.warmup_steps == 0 and "warm-up" not in c.explanation


@pytest.mark.parametrize("params, bound", [(10**9, "link at most 50% busy"), (2 * 10**10, "largest H")])
def test_a_huge_model_on_a_slow_link_raises_h_until_the_link_keeps_up_then_caps_it(params, bound):
    c = choose_sync(rtt_ms=100, gbps=0.1, num_params=params, compute_s=0.5, last_sync_mb=64)
    cfg = c.diloco
    assert c.strategy is SyncStrategy.STREAMING_DILOCO and cfg.inner_steps % cfg.fragments == 0
    if "busy" in bound:
        assert c.outer_sync_s <= 0.5 * cfg.inner_steps * 0.5 < c.outer_sync_s + 0.5 * cfg.fragments * 0.5
        assert bound in c.explanation
    else:
        assert cfg.inner_steps == MAX_H and "capped at H=500" in c.explanation
    DiLoCoConfig(**{f: getattr(cfg, f) for f in ("inner_steps", "fragments", "overlap_steps")})  # valid


def test_a_job_shorter_than_diloco_s_evidence_keeps_the_cheapest_per_step_sync():
    # the demo (tiny, 60 steps) on the lab's 21 ms link, as this machine probed it: ~120 ms steps, 0.5 Gbit/s
    link = dict(rtt_ms=21, gbps=0.5, num_params=TINY, compute_s=0.12, last_sync_mb=1)
    assert choose_sync(**link, steps=DILOCO_MIN_STEPS, optimizer_step_s=0.008).strategy is SyncStrategy.STREAMING_DILOCO
    short = choose_sync(**link, steps=60, optimizer_step_s=0.008)
    assert short.strategy is SyncStrategy.HIERARCHICAL and short.diloco is None and short.local_lookahead
    assert short.har_exposed_s == pytest.approx(0.008)  # the look-ahead's extra AdamW pass, over the 5% limit
    assert "60-step job is shorter than the 1024 steps" in short.explanation and "over the limit" in short.explanation
    # a costlier look-ahead pass: bf16's exposed ~17 ms is cheaper; exact fp32 would expose ~25 ms
    bf16 = choose_sync(**link, steps=60, optimizer_step_s=0.03)
    assert not bf16.local_lookahead and bf16.compression is Compression.BF16
    total = cross_dc_time(4 * TINY, rtt_ms=21, gbps=0.5, num_dcs=2)
    exact_s = max(total - 0.12 * 2 / 3, 0.0105 + (total - 0.0105) / 4)  # 4 buckets of 1 MB: the last one's share
    assert bf16.har_exposed_s < exact_s < 0.03
    # a job that cannot look ahead, on a link where bf16 saves under 1% of a step: exact fp32
    assert choose_sync(rtt_ms=300, gbps=100, num_params=TINY, compute_s=0.12, steps=60,
                       lookahead=False).compression is Compression.NONE  # fmt: skip


def test_choice_rejects_impossible_inputs():
    with pytest.raises(ValueError, match="compute_s must be > 0"):
        choose_sync(rtt_ms=1, gbps=1, num_params=TINY, compute_s=0)


def _req(steps: int = DILOCO_MIN_STEPS, **kw) -> JobRequest:
    return JobRequest(name="p", model=model_preset("nano"), steps=steps, global_batch=8, micro_batch=1,
                      topology=TopologyRequest(), **kw)


def test_planner_picks_diloco_on_a_measured_slow_link_and_hierarchical_on_a_fast_one():
    topo = topology(dc_a=2, dc_b=2)
    base = default_figures(topo, ("dc-a", "dc-b"), False)
    slow = replace(base, inter_dc=Link(0.05, 0.1e9 / 8), inter_dc_known=True)
    plan = plan_job(_req(), topo, slow)
    assert plan.sync_strategy.is_diloco and plan.diloco is not None
    assert "DiLoCo" in plan.explanation and plan.to_dict()["diloco"]["inner_steps"] == plan.diloco.inner_steps
    config = build_train_config("j1", _req(), plan, "")
    assert config.sync.strategy is plan.sync_strategy and config.sync.outer == plan.diloco
    assert plan.compression is Compression.INT4 and config.sync.compression is Compression.INT4
    assert plan.to_dict()["compression"] == "int4"
    asked = _req(sync=SyncConfig(strategy=None, compression=Compression.INT8))  # the job's own encoding stays
    assert build_train_config("j2", asked, plan_job(asked, topo, slow), "").sync.compression is Compression.INT8
    fast = replace(base, inter_dc=Link(0.0001, 100e9 / 8), inter_dc_known=True)
    assert not plan_job(_req(), topo, fast).sync_strategy.is_diloco  # per-step sync (flat is fastest here)
    # unmeasured default figures never trade exact per-step sync away
    assert plan_job(_req(), topo, replace(slow, inter_dc_known=False)).sync_strategy is SyncStrategy.HIERARCHICAL


def test_an_auto_job_put_on_diloco_is_told_its_per_step_sync_knobs_go_unused():
    topo = topology(dc_a=2, dc_b=2)
    slow = replace(default_figures(topo, ("dc-a", "dc-b"), False), inter_dc=Link(0.05, 0.1e9 / 8), inter_dc_known=True)
    assert "apply to per-step sync only" not in plan_job(_req(), topo, slow).explanation  # none set: nothing to say
    for sync, named in ((SyncConfig(strategy=None, bucket_mb=2.0), "sync.bucket_mb apply"),
                        (SyncConfig(strategy=None, bucket_mb=None, overlap=False), "sync.overlap=false apply"),
                        (SyncConfig(strategy=None, bucket_mb=2.0, overlap=False), "sync.bucket_mb and sync.overlap=false")):
        plan = plan_job(_req(sync=sync), topo, slow)
        assert plan.sync_strategy.is_diloco and named in plan.explanation, plan.explanation
        assert "apply to per-step sync only" in plan.explanation
    per_step = plan_job(_req(sync=SyncConfig(strategy=None, bucket_mb=2.0)), topo,
                        replace(slow, inter_dc=Link(0.0001, 100e9 / 8)))
    assert not per_step.sync_strategy.is_diloco and "apply to per-step sync only" not in per_step.explanation


def test_a_job_can_force_a_strategy_and_its_knobs():
    topo = topology(dc_a=2, dc_b=2)
    slow = figures_for(_req(wan=WanConfig(rtt_ms=100, gbps=0.1)), topo, None)[0]
    assert slow.inter_dc_known
    forced = plan_job(_req(wan=WanConfig(rtt_ms=100, gbps=0.1), sync=SyncConfig(strategy=SyncStrategy.HIERARCHICAL)),
                      topo, slow)
    assert forced.sync_strategy is SyncStrategy.HIERARCHICAL and forced.diloco is None
    knobs = DiLoCoConfig(inner_steps=8)
    request = _req(sync=SyncConfig(strategy=SyncStrategy.DILOCO, diloco=knobs))
    plan = plan_job(request, topo, slow)
    assert plan.sync_strategy is SyncStrategy.DILOCO and plan.diloco == knobs and "as requested" in plan.explanation


def test_one_step_late_sync_without_the_look_ahead_is_the_jobs_choice_never_autos():
    topo = topology(dc_a=2, dc_b=2)
    base = default_figures(topo, ("dc-a", "dc-b"), False)
    for rtt_s, bps in ((0.0005, 100e9 / 8), (0.0105, 1e9 / 8), (0.05, 0.1e9 / 8)):  # exposed or not
        link = replace(base, inter_dc=Link(rtt_s, bps), inter_dc_known=True)
        sync = build_train_config("j", _req(), plan_job(_req(), topo, link), "").sync
        assert sync.delay_one_step == sync.local_lookahead  # auto's one-step-late sync always looks ahead
    late = _req(sync=SyncConfig(strategy=SyncStrategy.HIERARCHICAL, delay_one_step=True))
    config = build_train_config("j", late, plan_job(late, topo, base), "")
    assert config.sync.strategy is SyncStrategy.HIERARCHICAL and config.sync.delay_one_step
    with pytest.raises(ValueError, match="delay_one_step applies to 'hierarchical' sync only, not 'auto'"):
        SyncConfig(strategy=None, delay_one_step=True)


def test_diloco_knobs_cross_the_service_to_workers_boundary_intact():
    import json
    import pickle

    from meridian.workers.contracts.config import TrainConfig

    sync = SyncConfig(strategy=SyncStrategy.STREAMING_DILOCO,
                      diloco=DiLoCoConfig(inner_steps=8, fragments=2, overlap_steps=1))
    cfg = TrainConfig(job_id="x", model=model_preset("nano"), steps=3, global_batch=4, micro_batch=2, sync=sync)
    assert pickle.loads(pickle.dumps(cfg)) == cfg  # how Ray hands it to the runner and the workers
    request = _req(sync=sync)
    assert JobRequest.from_dict(json.loads(json.dumps(request.to_dict()))) == request  # how the store keeps it


def test_auto_strategy_is_resolved_by_the_plan_never_by_the_config():
    topo = topology(dc_a=2, dc_b=2)
    request = _req()
    assert request.sync.strategy is None  # "auto": the one field a job asks for a strategy in
    plan = plan_job(request, topo)
    assert build_train_config("j", request, plan, "").sync.strategy is plan.sync_strategy is SyncStrategy.HIERARCHICAL
    from meridian.workers.contracts.config import TrainConfig

    with pytest.raises(ValueError, match="sync.strategy is 'auto'"):
        TrainConfig(job_id="x", model=model_preset("nano"), steps=1, global_batch=2, micro_batch=1, sync=request.sync)
    with pytest.raises(ValueError, match="with 'auto' the planner picks H"):
        SyncConfig(strategy=None, diloco=DiLoCoConfig())


def test_planner_runs_the_demo_one_step_late_at_a_look_ahead_where_exact_sync_would_show():
    # The demo job (tiny) on a measured 21 ms / 1 Gbit/s link, its sync after backward (overlap off): all exposed
    topo = topology(dc_a=2, dc_b=2)
    base = default_figures(topo, ("dc-a", "dc-b"), False)
    link = replace(base, inter_dc=Link(0.0105, 1e9 / 8), inter_dc_known=True)
    demo = JobRequest(name="demo", model=model_preset("tiny"), steps=60, global_batch=16, micro_batch=4,
                      topology=TopologyRequest(), sync=SyncConfig(strategy=None, overlap=False))
    plan = plan_job(demo, topo, link)
    assert plan.sync_strategy is SyncStrategy.HIERARCHICAL and plan.local_lookahead and plan.compression is None
    assert "one step late" in plan.explanation and plan.to_dict()["local_lookahead"] is True
    assert plan.estimate["exposed_dp_s"] == 0.0 and plan.estimate["step_s"] < plan.estimate["compute_s"] * 1.05
    sync = build_train_config("j", demo, plan, "").sync
    assert sync.delay_one_step and sync.local_lookahead
    assert not plan_job(demo, topo, replace(link, inter_dc_known=False)).local_lookahead  # never on guesses


def test_planner_sends_per_step_sync_in_bf16_on_a_measured_link_where_fp32_would_show():
    # The demo job (tiny) on a measured 21 ms / 1 Gbit/s link, its sync after backward (overlap off), on devices
    # that hold the layout but not the look-ahead's buffers (so no look-ahead)
    topo = topology(dc_a=2, dc_b=2)
    base = default_figures(topo, ("dc-a", "dc-b"), False)
    link = replace(base, inter_dc=Link(0.0105, 1e9 / 8), inter_dc_known=True)
    demo = JobRequest(name="demo", model=model_preset("tiny"), steps=60, global_batch=16, micro_batch=4,
                      topology=TopologyRequest(), sync=SyncConfig(strategy=None, overlap=False))
    roomy = plan_job(demo, topo, link)
    assert roomy.local_lookahead  # where the look-ahead fits it is the choice
    link = replace(link, device_memory_bytes=roomy.estimate["memory_bytes"] + 1)
    plan = plan_job(demo, topo, link)
    assert not plan.local_lookahead
    assert plan.sync_strategy is SyncStrategy.HIERARCHICAL and plan.compression is Compression.BF16
    assert "in bf16" in plan.explanation and plan.to_dict()["compression"] == "bf16"
    assert build_train_config("j", demo, plan, "").sync.compression is Compression.BF16
    asked = replace(demo, sync=replace(demo.sync, compression=Compression.INT8))  # kept
    assert build_train_config("j", asked, plan_job(asked, topo, link), "").sync.compression is Compression.INT8
    # guessed figures never trade exact sync away; a fast measured link keeps fp32
    assert plan_job(demo, topo, replace(link, inter_dc_known=False)).compression is None
    fast = replace(base, inter_dc=Link(0.0001, 100e9 / 8), inter_dc_known=True)
    assert plan_job(demo, topo, fast).compression is None
    # syncing each FSDP2 unit as backward completes it hides all but the last unit's sync: exact fp32 again
    sized = plan_job(replace(demo, sync=replace(demo.sync, overlap=True)), topo, link)
    assert sized.bucket_mb is None and sized.compression is None and "limit 5%" in sized.explanation
    assert "Gradients sync per FSDP2 unit (4 transformer blocks" in sized.explanation


def test_the_planners_int4_bytes_are_what_the_codec_puts_on_the_wire():
    import torch

    from meridian.workers.sync.compression import Int4Codec

    n = 128 * 1000  # whole blocks: only the 4-byte element count is left out of the per-parameter figure
    assert Int4Codec().encode(torch.randn(n)).numel() == OUTER_BYTES_PER_PARAM * n + 4


def test_with_gradient_accumulation_exact_sync_hides_only_behind_the_last_micro_batch_s_backward():
    # 8 buckets on 1 ms / 1 Gbit/s: behind one micro-batch's 67 ms of backward only the last bucket shows; the
    # same step's compute in 16 micro-batches syncs behind the last one's 4 ms (cost_model.estimate's window).
    kw = dict(rtt_ms=1, gbps=1, num_params=TINY, compute_s=0.1, last_sync_mb=4 * TINY / 2**20 / 8, lookahead=False)
    whole = cross_dc_time(4 * TINY, rtt_ms=1, gbps=1, num_dcs=2)
    one = choose_sync(**kw)
    assert one.compression is Compression.NONE and one.har_exposed_s == pytest.approx(0.0005 + (whole - 0.0005) / 8)
    sixteen = choose_sync(**kw, micro_batches=16)
    assert sixteen.har_exposed_s == pytest.approx(whole - 0.1 * 2 / 3 / 16)
    assert sixteen.compression is not Compression.NONE  # not exact fp32, which would show 24% of a step (limit 5%)
    with pytest.raises(ValueError, match="micro_batches must be > 0"):
        choose_sync(**kw, micro_batches=0)
    # The planner passes the layout's micro-batches: 'auto' no longer keeps exact sync its own estimate shows over
    # the limit (64 samples as 16 micro-batches of 1 per replica: 8% of the step exposed).
    topo = topology(dc_a=2, dc_b=2)
    link = replace(default_figures(topo, ("dc-a", "dc-b"), False), inter_dc=Link(0.01, 0.1e9 / 8), inter_dc_known=True)
    for micro_batch in (16, 1):
        request = JobRequest(name="p", model=model_preset("small"), steps=2000, global_batch=64,
                             micro_batch=micro_batch, parallelism=ParallelismRequest(tp=1, pp=1))
        plan = plan_job(request, topo, link)
        exact = plan.sync_strategy is SyncStrategy.HIERARCHICAL and not plan.local_lookahead and not plan.compression
        assert exact == (micro_batch == 16)
        if exact:
            assert plan.estimate["exposed_dp_s"] <= 0.05 * plan.estimate["compute_s"]
