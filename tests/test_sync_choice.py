"""The planner's choice between per-step hierarchical sync, DiLoCo and streaming DiLoCo, without Ray."""

from __future__ import annotations

from dataclasses import replace

import pytest
from fakes import topology

from meridian.service.jobs import JobRequest, TopologyRequest
from meridian.service.planning.cost_model import Link
from meridian.service.planning.figures import figures_for
from meridian.service.planning.planner import default_figures, plan_job
from meridian.service.planning.sync_choice import choose_sync, cross_dc_time
from meridian.service.planning.train_config import build_train_config
from meridian.workers.contracts.config import DiLoCoConfig, SyncConfig, SyncStrategy, WanConfig
from meridian.workers.contracts.model_config import model_preset

TINY = model_preset("tiny").num_params  # 0.8 M parameters: 3.3 MB of fp32


def test_fast_link_keeps_per_step_hierarchical_sync():
    c = choose_sync(rtt_ms=1, gbps=100, num_params=TINY, compute_s=0.2)
    assert c.strategy is SyncStrategy.HIERARCHICAL and c.diloco is None
    assert c.har_exposed_s == pytest.approx(0.0005)  # only the last bucket's one-way latency shows
    assert "identical to one process" in c.explanation and "1 ms RTT / 100 Gbit/s" in c.explanation


def test_slow_link_picks_diloco_with_h_that_amortises_the_sync():
    # 21 ms RTT, 1 Gbit/s: one whole-model sync ≈ 10.5 ms + 28 ms; 45 ms of compute hides only 30 ms of it
    c = choose_sync(rtt_ms=21, gbps=1, num_params=TINY, compute_s=0.045)
    sync_s = cross_dc_time(4 * TINY, rtt_ms=21, gbps=1, num_dcs=2)
    assert c.outer_sync_s == pytest.approx(sync_s) and sync_s < 0.045
    assert c.har_exposed_s == pytest.approx(max(sync_s - 0.03, 0.0105))  # at least the last bucket's RTT/2
    assert c.strategy is SyncStrategy.DILOCO
    h = c.diloco.inner_steps
    assert sync_s / h <= 0.05 * 0.045 < sync_s / (h - 1)  # the smallest H under half the 10% budget
    assert f"H={h}" in c.explanation


def test_very_slow_link_picks_streaming_diloco_with_fragments_and_overlap():
    c = choose_sync(rtt_ms=100, gbps=0.1, num_params=TINY, compute_s=0.05, bucket_mb=0.5)
    assert c.strategy is SyncStrategy.STREAMING_DILOCO
    cfg = c.diloco
    sync_s = cross_dc_time(4 * TINY, rtt_ms=100, gbps=0.1, num_dcs=2)  # ≈ 0.32 s, over six steps of compute
    assert cfg.fragments == 7  # ceil(0.32 / 0.05), under the 7 buckets of 0.5 MiB and H / 2
    assert cfg.overlap_steps == 1 and cfg.inner_steps == 133 and sync_s / cfg.fragments < 0.05
    DiLoCoConfig(**{f: getattr(cfg, f) for f in ("inner_steps", "fragments", "overlap_steps")})  # valid


def test_choice_rejects_impossible_inputs():
    with pytest.raises(ValueError, match="compute_s must be > 0"):
        choose_sync(rtt_ms=1, gbps=1, num_params=TINY, compute_s=0)


def _req(**kw) -> JobRequest:
    return JobRequest(name="p", model=model_preset("nano"), steps=2, global_batch=8, micro_batch=1,
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
    fast = replace(base, inter_dc=Link(0.0001, 100e9 / 8), inter_dc_known=True)
    assert not plan_job(_req(), topo, fast).sync_strategy.is_diloco  # per-step sync (flat is fastest here)
    # unmeasured default figures never trade exact per-step sync away
    assert plan_job(_req(), topo, replace(slow, inter_dc_known=False)).sync_strategy is SyncStrategy.HIERARCHICAL


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
