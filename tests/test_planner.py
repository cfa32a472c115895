"""The planner, without Ray: feasibility, layout, sizes, admission reasons."""

from __future__ import annotations

from dataclasses import replace

import pytest
from fakes import node, topology

from meridian.service.cluster.topology import ClusterTopology
from meridian.service.errors import InvalidJob, Unschedulable
from meridian.service.jobs import JobRequest, ParallelismRequest, TopologyRequest
from meridian.service.planning.cost_model import shape_of
from meridian.service.planning.placement import admission
from meridian.service.planning.planner import plan_job
from meridian.workers.contracts.config import Compression, FsdpUnits, SyncConfig, SyncStrategy
from meridian.workers.contracts.model_config import model_preset


def req(datacenters=None, workers=None, global_batch=8, min_workers=1, strategy=None) -> JobRequest:
    return JobRequest(
        name="p", model=model_preset("nano"), steps=2, global_batch=global_batch, micro_batch=1,
        topology=TopologyRequest(datacenters=datacenters, workers_per_datacenter=workers, min_workers=min_workers),
        sync=SyncConfig(strategy=strategy),
    )


def test_auto_uses_every_datacenter_with_contiguous_ranks_and_hierarchical_sync():
    plan = plan_job(req(), topology(dc_a=2, dc_b=3))
    assert plan.rank_datacenters == ("dc-a", "dc-a", "dc-b", "dc-b", "dc-b")
    assert plan.sync_strategy is SyncStrategy.HIERARCHICAL and not plan.use_gpu
    assert "2 replica(s) in dc-a, 3 replica(s) in dc-b" in plan.explanation
    assert "Sync 'hierarchical' (chosen" in plan.explanation


def test_single_datacenter_defaults_to_fsdp_and_respects_an_explicit_strategy():
    # FSDP2 inside the datacenter shards the whole state and its optimizer step: it estimates faster than DDP,
    # which is what one datacenter gets where the runtime has no FSDP.
    from meridian.service.planning.runtime_support import RUNTIME

    plan = plan_job(req(["dc-a"]), topology(dc_a=2, dc_b=2))
    assert plan.sync_strategy is SyncStrategy.HIERARCHICAL and plan.sharding == "fsdp"
    no_fsdp = plan_job(req(["dc-a"]), topology(dc_a=2, dc_b=2), runtime=replace(RUNTIME, fsdp=False))
    assert no_fsdp.sync_strategy is SyncStrategy.FLAT
    flat = plan_job(req(["dc-a"], strategy=SyncStrategy.FLAT), topology(dc_a=2))
    assert flat.sync_strategy is SyncStrategy.FLAT and "as requested" in flat.explanation
    forced = plan_job(req(["dc-a"], strategy=SyncStrategy.HIERARCHICAL), topology(dc_a=2))
    assert forced.sync_strategy is SyncStrategy.HIERARCHICAL and "as requested" in forced.explanation


def test_unknown_datacenter_is_unschedulable_and_names_the_alternatives():
    with pytest.raises(Unschedulable, match=r"'dc-z'.*has 'dc-a', 'dc-b'"):
        plan_job(req(["dc-a", "dc-z"]), topology(dc_a=1, dc_b=1))


def test_auto_datacenters_with_counts_for_an_unknown_datacenter_is_unschedulable_not_ignored():
    # The counts of 'dc-zz' were dropped and the job ran on 3 workers (dc-a 1, dc-b 2) instead of the 4 asked for.
    with pytest.raises(Unschedulable, match=r"workers_per_datacenter names 'dc-zz'.*has 'dc-a', 'dc-b'"):
        plan_job(req(workers=(("dc-a", 1), ("dc-zz", 3))), topology(dc_a=2, dc_b=2))
    assert plan_job(req(workers=(("dc-a", 1),)), topology(dc_a=2, dc_b=2)).num_workers == 3  # named ones are fine


def test_too_many_workers_for_a_datacenter_is_unschedulable():
    with pytest.raises(Unschedulable, match="dc-b can hold at most 2 worker"):
        plan_job(req(workers=3), topology(dc_a=4, dc_b=2))


def test_per_datacenter_counts_and_uneven_layouts():
    plan = plan_job(req(["dc-b", "dc-a"], workers=(("dc-a", 1), ("dc-b", 2))), topology(dc_a=2, dc_b=2))
    assert plan.rank_datacenters == ("dc-b", "dc-b", "dc-a")


def test_global_batch_smaller_than_explicit_workers_is_invalid_but_auto_shrinks():
    dp_only = replace(req(workers=2, global_batch=2), parallelism=ParallelismRequest(tp=1, pp=1))
    with pytest.raises(InvalidJob, match="global_batch \\(2\\) is smaller than the number of workers \\(4\\)"):
        plan_job(dp_only, topology(dc_a=2, dc_b=2))
    # With model parallelism allowed, 4 workers and 2 samples per step fit as 2 replicas of 2 stages.
    staged = plan_job(req(workers=2, global_batch=2), topology(dc_a=2, dc_b=2))
    assert (staged.num_workers, staged.pp * staged.tp, staged.dp) == (4, 2, 2)
    assert staged.sync_strategy is SyncStrategy.HIERARCHICAL
    assert plan_job(req(global_batch=3), topology(dc_a=2, dc_b=2)).num_workers == 3


def test_min_workers_above_capacity_is_unschedulable():
    with pytest.raises(Unschedulable, match="min_workers=9 workers, but the datacenters it may use hold 4"):
        plan_job(req(min_workers=9), topology(dc_a=2, dc_b=2))


def test_min_workers_picks_the_fastest_layout_with_enough_workers_or_names_what_caps_them():
    # 3 samples per step: the fastest layout is 3 replicas of one worker; 2 replicas of 2 stages use all 4.
    plan = plan_job(req(global_batch=3, min_workers=4), topology(dc_a=2, dc_b=2))
    assert (plan.num_workers, plan.pp, plan.dp) == (4, 2, 2)
    assert "Faster but left out: tp=1 pp=1 dp=3 hierarchical" in plan.explanation
    assert "fewer than topology.min_workers=4" in plan.explanation
    # Data parallelism only: 2 samples cap the job at 2 replicas, which is what the refusal says (not "the
    # cluster holds 4").
    dp_only = replace(req(global_batch=2, min_workers=4), parallelism=ParallelismRequest(tp=1, pp=1))
    with pytest.raises(Unschedulable, match=r"largest layout that fits uses 2 of the 4 .* training.global_batch=2 "
                                            r"allows at most 2 replica\(s\).*leave parallelism.tp=1 and parallelism.pp=1"):
        plan_job(dp_only, topology(dc_a=2, dc_b=2))


def test_no_labelled_nodes_explains_how_to_label_them():
    with pytest.raises(Unschedulable, match="ray start --labels datacenter="):
        plan_job(req(), ClusterTopology((node("n1", None, cpus=8),)))


def test_gpu_nodes_get_one_worker_per_gpu():
    topo = ClusterTopology((node("a", "dc-a", cpus=16, gpus=2), node("b", "dc-b", cpus=16, gpus=2)))
    plan = plan_job(req(), topo)
    assert plan.use_gpu and plan.num_workers == 4 and plan.resources_per_worker == {"CPU": 1.0, "GPU": 1.0}


def test_dead_nodes_do_not_count():
    topo = ClusterTopology((node("a0", "dc-a"), node("a1", "dc-a", alive=False), node("b0", "dc-b")))
    assert plan_job(req(), topo).rank_datacenters == ("dc-a", "dc-b")


def test_admission_says_what_is_missing_where():
    plan = plan_job(req(), topology(dc_a=2, dc_b=2))
    busy = ClusterTopology((node("a0", "dc-a"), node("a1", "dc-a"), node("b0", "dc-b", free_cpus=0),
                            node("b1", "dc-b", free_cpus=0)))
    assert admission(plan, busy) == "waiting for 2 CPUs in dc-b"
    assert admission(plan, topology(dc_a=2, dc_b=2)) is None


def _two_slot_nodes() -> ClusterTopology:
    from fakes import node

    return ClusterTopology((node("n-a", "dc-a", cpus=2), node("n-b", "dc-b", cpus=2)))


def test_planner_offers_tensor_and_pipeline_layouts_the_workers_can_run():
    from meridian.service.planning.planner import default_figures, ranked_layouts, strategy_for
    from meridian.workers.parallel.dims import ParallelDims

    topo = _two_slot_nodes()
    request = req(global_batch=8)
    ranked = ranked_layouts(request, topo, default_figures(topo, ("dc-a", "dc-b"), False))
    shapes = {(c.layout.tp, c.layout.pp, c.layout.pp_spans_dcs) for c, _ in ranked}
    assert {(2, 1, False), (1, 2, False), (1, 2, True), (1, 1, False)} <= shapes
    for cand, rank_dcs in ranked:
        # Every offered placement is one the workers accept: TP groups inside one DC, stage-major ranks.
        dims = ParallelDims(cand.layout.tp, cand.layout.pp, rank_dcs)
        assert dims.dp == cand.layout.dp
        if cand.layout.pp > 1:
            assert strategy_for(cand.layout) is SyncStrategy.HIERARCHICAL
    spans = next(dcs for c, dcs in ranked if c.layout.pp_spans_dcs)
    assert spans == ("dc-a", "dc-a", "dc-b", "dc-b")  # stage 0 (2 replicas) in dc-a, stage 1 in dc-b
    est = [c.estimate.step_s for c, _ in ranked]
    assert est == sorted(est)


def test_plan_with_tp_pins_each_tensor_parallel_group_to_one_node():
    from meridian.service.jobs import ParallelismRequest

    plan = plan_job(replace(req(global_batch=8), parallelism=ParallelismRequest(tp=2, pp=1)), _two_slot_nodes())
    assert (plan.tp, plan.pp, plan.dp) == (2, 1, 2)
    assert plan.rank_nodes == ("n-a", "n-a", "n-b", "n-b")
    assert plan.to_dict()["parallelism"]["tp"] == 2
    # The runner asks Ray Train for each rank on its node, not just its datacenter.
    from meridian.service.runner.train_run import worker_label_selectors

    assert worker_label_selectors(plan) == [
        {"datacenter": "dc-a", "ray.io/node-id": "n-a"}, {"datacenter": "dc-a", "ray.io/node-id": "n-a"},
        {"datacenter": "dc-b", "ray.io/node-id": "n-b"}, {"datacenter": "dc-b", "ray.io/node-id": "n-b"}]
    dp_only = plan_job(replace(req(global_batch=8), parallelism=ParallelismRequest(tp=1, pp=1)), _two_slot_nodes())
    assert all(set(sel) == {"datacenter"} for sel in worker_label_selectors(dp_only))
    # At launch, with the cluster as it is then, every rank gets a node: the TP groups keep theirs.
    assert worker_label_selectors(plan, _two_slot_nodes()) == worker_label_selectors(plan)


def test_at_launch_every_rank_is_pinned_to_a_node_with_room_now_most_free_first():
    from meridian.service.planning.placement import pin_ranks_to_nodes
    from meridian.service.runner.train_run import worker_label_selectors

    planned = ClusterTopology((node("a0", "dc-a", cpus=2), node("a1", "dc-a", cpus=2), node("b0", "dc-b", cpus=2)))
    plan = plan_job(req(workers=(("dc-a", 3), ("dc-b", 2)), global_batch=10), planned)
    assert plan.rank_datacenters == ("dc-a", "dc-a", "dc-a", "dc-b", "dc-b") and not any(plan.rank_nodes)
    # Since planning, another workload took one CPU of a0 and b0 went away: a1 (2 free) fills first, then a0;
    # dc-b's ranks have no node with room, so they keep the datacenter-only selector.
    now = ClusterTopology((node("a0", "dc-a", cpus=2, free_cpus=1), node("a1", "dc-a", cpus=2),
                           node("b0", "dc-b", cpus=2, alive=False)))  # fmt: skip
    assert pin_ranks_to_nodes(plan, now) == ("a1", "a1", "a0", None, None)
    assert worker_label_selectors(plan, now)[0] == {"datacenter": "dc-a", "ray.io/node-id": "a1"}
    assert worker_label_selectors(plan, now)[3] == {"datacenter": "dc-b"}


def test_flat_sync_request_never_gets_a_pipeline():
    from meridian.service.planning.planner import default_figures, ranked_layouts

    topo = _two_slot_nodes()
    ranked = ranked_layouts(req(strategy=SyncStrategy.FLAT), topo, default_figures(topo, ("dc-a", "dc-b"), False))
    assert ranked and all(c.layout.pp == 1 for c, _ in ranked)


def test_the_plan_s_tp_and_pp_reach_the_workers_config():
    from meridian.service.jobs import ParallelismRequest
    from meridian.service.planning.train_config import build_train_config

    request = replace(req(global_batch=8), parallelism=ParallelismRequest(tp=2, pp=1, schedule="gpipe"))
    plan = plan_job(request, _two_slot_nodes())
    cfg = build_train_config("j", request, plan, "")
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.schedule.value) == (2, 1, "gpipe")
    assert cfg.datacenters == plan.rank_datacenters


def _figures():
    from meridian.service.planning.cost_model import Figures, Link

    lan, wan = Link(1e-4, 1e9), Link(0.01, 125e6)
    return Figures(device_flops=50e9, device_memory_bytes=8 * 2**30, intra_node=lan, intra_dc=lan, inter_dc=wan,
                   inter_dc_known=True)


def _layout(**kw):
    from meridian.service.planning.cost_model import Layout

    base = dict(tp=1, pp=1, dp=2, num_dcs=2, dp_per_dc=1, pp_spans_dcs=False, micro_batch=2, micro_batches=1,
                hierarchical=True, overlap=True)
    return Layout(**{**base, **kw})


def test_under_flat_sync_a_model_smaller_than_one_bucket_cannot_hide_its_sync():
    from meridian.service.planning.cost_model import Link, estimate

    tiny = model_preset("tiny")  # 3.5 MB of fp32 gradients
    near = replace(_figures(), inter_dc=Link(1e-4, 125e6))  # each bucket's ring pays the latency rounds again
    whole = estimate(tiny, _layout(hierarchical=False, bucket_bytes=4 * 2**20), near, 8)
    assert whole.exposed_dp_s == pytest.approx(whole.dp_comm_s)  # one bucket: ready when backward ends
    split = estimate(tiny, _layout(hierarchical=False, bucket_bytes=2**19), near, 8)
    assert split.exposed_dp_s < whole.exposed_dp_s
    # on a far link the rings' latency outweighs what overlapping them saves
    far = estimate(tiny, _layout(hierarchical=False, bucket_bytes=2**19), _figures(), 8)
    assert far.dp_comm_s > estimate(tiny, _layout(hierarchical=False, bucket_bytes=4 * 2**20), _figures(), 8).dp_comm_s


def test_the_hierarchical_engine_syncs_per_fsdp_unit_so_only_the_root_follows_backward():
    from meridian.service.planning.cost_model import estimate, last_synced_bytes

    tiny = model_preset("tiny")
    shape = shape_of(tiny)
    lay = _layout()
    # the blocks sync as backward completes each; the root (embedding, final norm, head) completes last
    assert last_synced_bytes(tiny, lay) == 4 * (shape.num_params - shape.n_layers * shape.layer_params)
    est = estimate(tiny, lay, _figures(), 8)
    assert est.exposed_dp_s < est.dp_comm_s
    # DDP's bucket size is not the hierarchical engine's: it changes nothing there
    assert estimate(tiny, _layout(bucket_bytes=2**19), _figures(), 8) == est
    # a pipeline's first stage finishes backward last: its root is the embedding alone
    staged = _layout(pp=2)
    assert last_synced_bytes(tiny, staged) == 4 * shape.embedding_params


def test_only_the_last_micro_batch_s_backward_hides_the_sync():
    from meridian.service.planning.cost_model import estimate

    small = model_preset("small")
    one = estimate(small, _layout(micro_batches=1, bucket_bytes=2**18), _figures(), 8)
    four = estimate(small, _layout(micro_batches=4, bucket_bytes=2**18), _figures(), 8)
    # the same sync, a quarter of the backward to hide it behind
    assert four.dp_comm_s == pytest.approx(one.dp_comm_s) and four.exposed_dp_s > one.exposed_dp_s


def test_1f1b_pays_one_activation_hop_per_tick_gpipe_two():
    from meridian.service.planning.cost_model import estimate

    kw = dict(pp=2, dp=1, dp_per_dc=0, pp_spans_dcs=True, micro_batches=4)
    f1b = estimate(model_preset("tiny"), _layout(schedule="1f1b", **kw), _figures(), 8)
    gpipe = estimate(model_preset("tiny"), _layout(schedule="gpipe", **kw), _figures(), 8)
    assert gpipe.pp_comm_s == pytest.approx(2 * f1b.pp_comm_s) and f1b.pp_comm_s > 0


def test_bucket_size_aims_at_four_buckets_within_its_limits():
    from meridian.service.planning.buckets import MAX_BUCKET_MB, MIN_BUCKET_MB, bucket_mb_for, buckets_of

    assert bucket_mb_for(40 * 2**20) == 10.0  # four buckets
    assert bucket_mb_for(0.5 * 2**20) == MIN_BUCKET_MB  # a tiny model: one bucket, not four of 128 KiB
    assert bucket_mb_for(10 * 2**30) == MAX_BUCKET_MB  # a large one: many buckets of DDP's size
    assert buckets_of(40 * 2**20, 10.0) == 4 and buckets_of(3.5e6, 1.0) == 4
    with pytest.raises(ValueError, match="grad_bytes must be > 0"):
        bucket_mb_for(0)


def test_a_flat_job_that_leaves_the_bucket_size_out_gets_the_planner_s_and_says_why():
    from meridian.service.planning.buckets import bucket_mb_for
    from meridian.service.planning.cost_model import Link
    from meridian.service.planning.planner import default_figures
    from meridian.service.planning.train_config import build_train_config

    tiny = model_preset("tiny")  # 3.5 MB of fp32 gradients: one 4 MiB bucket would hold it all
    auto = replace(req(), model=tiny, sync=SyncConfig(strategy=SyncStrategy.FLAT, bucket_mb=None))
    topo = topology(dc_a=2, dc_b=2)
    near = replace(default_figures(topo, topo.datacenters, False), inter_dc=Link(1e-4, 10e9 / 8))
    plan = plan_job(auto, topo, near)
    assert plan.sync_strategy is SyncStrategy.FLAT
    assert plan.bucket_mb == bucket_mb_for(4 * tiny.num_params) < 4.0
    assert "Gradient buckets of 1.00 MiB: about 4 for the 3.34 MiB" in plan.explanation
    assert plan.to_dict()["bucket_mb"] == plan.bucket_mb
    assert build_train_config("j", auto, plan, "").sync.bucket_mb == plan.bucket_mb
    # the estimate is the one of those buckets: less of the sync exposed than behind one bucket
    whole = plan_job(replace(auto, sync=SyncConfig(strategy=SyncStrategy.FLAT, bucket_mb=4.0)), topo, near)
    assert plan.estimate["exposed_dp_s"] < whole.estimate["exposed_dp_s"]
    # an explicit size is the job's: kept, and not explained as the planner's
    assert whole.bucket_mb == 4.0 and "Gradient buckets of" not in whole.explanation
    assert build_train_config("j", auto, whole, "").sync.bucket_mb == 4.0


def _wan_21ms(topo):
    from meridian.service.planning.cost_model import Link
    from meridian.service.planning.planner import default_figures

    return replace(default_figures(topo, topo.datacenters, False), inter_dc=Link(10.5e-3, 1e9 / 8), inter_dc_known=True)


def test_a_hierarchical_plan_has_no_buckets_it_syncs_per_fsdp_unit_and_says_so():
    from meridian.service.planning.train_config import build_train_config

    topo = topology(dc_a=2, dc_b=2)
    auto = replace(req(global_batch=12), micro_batch=2, model=model_preset("tiny"), steps=200,
                   sync=SyncConfig(strategy=None, bucket_mb=None))
    plan = plan_job(auto, topo, _wan_21ms(topo))  # a WAN: overlapping each block's sync pays for its collectives
    assert plan.sync_strategy is SyncStrategy.HIERARCHICAL and plan.bucket_mb is None and plan.fsdp_units == "block"
    assert plan.to_dict()["bucket_mb"] is None and "Gradient buckets" not in plan.explanation
    # tiny: 4 blocks, then the root (embedding 49,152 + head 33,024 parameters: 0.31 MiB of fp32 gradients)
    assert ("Gradients sync per FSDP2 unit (4 transformer blocks, then the embeddings and head), each as soon as "
            "backward completes it, so only the last unit's sync (0.31 of the 3.34 MiB") in plan.explanation
    config = build_train_config("j", auto, plan, "")
    assert config.sync.bucket_mb is None and config.parallel.fsdp_units is FsdpUnits.BLOCK
    # an auto job's own bucket size, where the plan is hierarchical: unused, and the plan says so
    sized = replace(auto, sync=SyncConfig(strategy=None, bucket_mb=4.0))
    other = plan_job(sized, topo, _wan_21ms(topo))
    assert other.sync_strategy is SyncStrategy.HIERARCHICAL and other.bucket_mb is None
    assert "sync.bucket_mb sizes flat sync's DDP buckets only" in other.explanation
    assert other.estimate == plan.estimate


def test_a_model_of_small_blocks_on_a_fast_link_is_one_fsdp_unit():
    from meridian.service.planning.cost_model import collectives_per_step, estimate
    from meridian.service.planning.train_config import build_train_config

    topo = topology(dc_a=2, dc_b=2)
    job = replace(req(global_batch=12), micro_batch=2, steps=200)  # nano: 2 blocks of 0.19 MiB of gradients
    plan = plan_job(job, topo)  # the default link: 10 ms, 10 Gbit/s
    assert plan.sync_strategy is SyncStrategy.HIERARCHICAL and plan.fsdp_units == "model"
    assert "The whole model is one FSDP2 unit: 3 data-parallel collectives a step instead of 9" in plan.explanation
    assert "FSDP gathers the model's weights once a step" in plan.explanation
    assert build_train_config("j", job, plan, "").parallel.fsdp_units is FsdpUnits.MODEL
    assert plan.to_dict()["parallelism"]["fsdp_units"] == "model"
    # the cost model's reason: each collective's fixed cost, which a unit per block pays three times as often
    lay = _layout(dp=4, dp_per_dc=2, micro_batches=2, fsdp=True, reshard_after_forward=False)
    one = replace(lay, fsdp_units=FsdpUnits.MODEL)
    assert (collectives_per_step(job.model, lay), collectives_per_step(job.model, one)) == (9, 3)
    fig = _figures()
    assert estimate(job.model, lay, fig, 12).collectives_s == pytest.approx(3 * estimate(job.model, one, fig, 12).collectives_s)


def test_fsdp_keeps_the_blocks_gathered_through_the_step_and_reshards_where_memory_is_short():
    from meridian.service.planning.cost_model import Layout, memory_per_device
    from meridian.service.planning.train_config import build_train_config

    topo = topology(dc_a=2, dc_b=2)
    job = replace(req(global_batch=12), micro_batch=2, model=model_preset("tiny"), steps=200,
                  parallelism=ParallelismRequest(tp=1, pp=1))  # 2 micro-batches per rank
    plan = plan_job(job, topo, _wan_21ms(topo))
    assert plan.sharding == "fsdp" and plan.fsdp_units == "block" and plan.reshard_after_forward is False
    assert "so a step gathers each once rather than 4 times" in plan.explanation
    assert build_train_config("j", job, plan, "").parallel.reshard_after_forward is False
    # a device that holds the sharded layout but not the whole weights gathered: resharded after forward
    lay = Layout(tp=1, pp=1, dp=4, num_dcs=2, dp_per_dc=2, pp_spans_dcs=False, micro_batch=2, micro_batches=2,
                 hierarchical=True, overlap=True, fsdp=True)
    kept = memory_per_device(job.model, replace(lay, reshard_after_forward=False))
    freed = memory_per_device(job.model, lay)
    assert freed < kept == memory_per_device(job.model, replace(lay, fsdp_units=FsdpUnits.MODEL))
    short = plan_job(job, topo, replace(_wan_21ms(topo), device_memory_bytes=(freed + kept) / 2))
    assert short.sharding == "fsdp" and short.fsdp_units == "block" and short.reshard_after_forward is True
    assert "keeping them gathered would need" in short.explanation
    assert build_train_config("j", job, short, "").parallel.reshard_after_forward is True
    # and the estimate counts the extra gathers
    assert short.estimate["collectives_s"] > plan.estimate["collectives_s"]


def test_a_train_config_never_leaves_the_bucket_size_to_the_workers():
    from meridian.workers.contracts.config import TrainConfig

    with pytest.raises(ValueError, match=r"sync.bucket_mb is 'auto' \(None\) for flat sync"):
        TrainConfig(job_id="j", model=model_preset("nano"), steps=1, global_batch=2, micro_batch=1,
                    sync=SyncConfig(strategy=SyncStrategy.FLAT, bucket_mb=None))  # fmt: skip
    # the hierarchical engine has no buckets to size
    TrainConfig(job_id="j", model=model_preset("nano"), steps=1, global_batch=2, micro_batch=1,
                sync=SyncConfig(bucket_mb=None))  # fmt: skip


@pytest.mark.parametrize("sync, dcs", [
    (SyncConfig(strategy=None, bucket_mb=None, lookahead_after=50), {"dc_a": 2}),
    (SyncConfig(strategy=None, bucket_mb=None, lookahead_after=50), {"dc_a": 2, "dc_b": 2}),
    (SyncConfig(strategy=None, bucket_mb=None, compression=Compression.INT8), {"dc_a": 2}),
    (SyncConfig(strategy=None, bucket_mb=None, compression=Compression.BF16), {"dc_a": 2, "dc_b": 2}),
])  # fmt: skip
def test_an_auto_option_the_chosen_strategy_does_not_use_never_makes_its_config_invalid(sync, dcs):
    # Planning and submit succeeded, then the launch's TrainConfig raised: lookahead_after without the look-ahead,
    # or compression on the flat sync 'auto' picked for one datacenter.
    from meridian.service.planning.runtime_support import RUNTIME
    from meridian.service.planning.train_config import build_train_config

    request = replace(req(), steps=200, sync=sync)
    plan = plan_job(request, topology(**dcs))
    config = build_train_config("j", request, plan, "")
    if sync.compression is not Compression.NONE and len(dcs) == 1:
        # where flat sync would win (no FSDP), the encoding is why the plan is hierarchical, and it says so
        no_fsdp = plan_job(request, topology(**dcs), runtime=replace(RUNTIME, fsdp=False))
        assert no_fsdp.sync_strategy is SyncStrategy.HIERARCHICAL
        assert "sync.compression applies to hierarchical sync only" in no_fsdp.explanation
    assert config.sync.strategy is plan.sync_strategy
    assert config.sync.compression is sync.compression  # the job's encoding is kept, on a strategy that has it
    if sync.compression is not Compression.NONE:
        assert plan.sync_strategy is SyncStrategy.HIERARCHICAL
    if not (plan.local_lookahead or plan.lookahead_when_exposed is not None):
        assert config.sync.lookahead_after is None
    # An explicit contradiction is still the job's own error, refused when the request is read.
    with pytest.raises(ValueError, match="compression applies to the inter-DC step of 'hierarchical' sync only"):
        SyncConfig(strategy=SyncStrategy.FLAT, compression=Compression.INT8)


def test_a_picked_look_ahead_keeps_the_job_s_lookahead_after():
    from meridian.service.planning.train_config import build_train_config

    request = replace(req(), sync=SyncConfig(strategy=None, lookahead_after=50))
    plan = replace(plan_job(request, topology(dc_a=1, dc_b=1)), local_lookahead=True)
    assert build_train_config("j", request, plan, "").sync.lookahead_after == 50


def _measured(topo, fast=True):
    from meridian.service.planning.cost_model import Link
    from meridian.service.planning.planner import default_figures

    figures = replace(default_figures(topo, topo.datacenters, False), inter_dc_known=True, compute_known=True)
    if fast:  # a link 1 ms away and slow devices: exact sync hides behind backward
        return replace(figures, device_flops=5e8, inter_dc=Link(1e-3, 1e9 / 8))
    return replace(figures, device_flops=5e9, inter_dc=Link(10.5e-3, 1e9 / 8))


def test_auto_arms_the_look_ahead_when_it_planned_exact_sync_on_figures_nobody_measured():
    from meridian.service.planning.train_config import build_train_config

    topo = topology(dc_a=2, dc_b=2)
    request = replace(req(), steps=200)
    plan = plan_job(request, topo)  # no probe: the link and the compute are defaults
    assert plan.sync_strategy is SyncStrategy.HIERARCHICAL and not plan.local_lookahead
    assert plan.lookahead_when_exposed == 0.05 and "The look-ahead is armed" in plan.explanation
    sync = build_train_config("j", request, plan, "").sync
    assert (sync.delay_one_step, sync.local_lookahead, sync.lookahead_when_exposed) == (True, True, 0.05)
    # measured figures that call for exact sync: exact sync, nothing armed
    measured = plan_job(request, topo, _measured(topo))
    assert measured.sync_strategy is SyncStrategy.HIERARCHICAL and measured.lookahead_when_exposed is None
    assert not measured.local_lookahead and "armed" not in measured.explanation
    sync = build_train_config("j", request, measured, "").sync
    assert (sync.delay_one_step, sync.local_lookahead, sync.lookahead_when_exposed) == (False, False, None)
    # measured figures that call for the look-ahead: set, not armed, unless the job asks for it armed
    slow = plan_job(request, topo, _measured(topo, fast=False))
    assert slow.local_lookahead and slow.lookahead_when_exposed is None
    asked = replace(request, sync=SyncConfig(strategy=None, lookahead_when_exposed=0.2))
    assert plan_job(asked, topo, _measured(topo, fast=False)).lookahead_when_exposed == 0.2
    assert plan_job(asked, topo, _measured(topo)).lookahead_when_exposed == 0.2  # asked: armed on exact sync too


def test_the_look_ahead_is_neither_set_nor_armed_where_a_device_cannot_hold_its_buffers():
    from meridian.service.planning.planner import default_figures

    topo = topology(dc_a=2, dc_b=2)
    request = replace(req(), steps=200)
    roomy = plan_job(request, topo)
    assert roomy.lookahead_when_exposed == 0.05
    just = roomy.estimate["memory_bytes"] + 1  # the layout fits, its look-ahead's buffers do not
    tight = plan_job(request, topo, replace(default_figures(topo, topo.datacenters, False), device_memory_bytes=just))
    assert tight.num_workers == 4 and tight.lookahead_when_exposed is None  # armed on defaults, but no room
    slow = _measured(topo, fast=False)  # figures that call for the look-ahead: set where it fits
    assert plan_job(request, topo, slow).local_lookahead
    squeezed = plan_job(request, topo, replace(slow, device_memory_bytes=just))
    assert not squeezed.local_lookahead and squeezed.lookahead_when_exposed is None


@pytest.mark.parametrize("change, dcs", [
    ({"steps": 20}, {"dc_a": 2, "dc_b": 2}),  # no longer than the exact steps the look-ahead starts with
    ({"steps": 200}, {"dc_a": 4}),  # one datacenter: no link to hide
    ({"steps": 200, "sync": SyncConfig(strategy=SyncStrategy.HIERARCHICAL)}, {"dc_a": 2, "dc_b": 2}),  # asked
    ({"steps": 200, "parallelism": ParallelismRequest(tp=1, pp=2)}, {"dc_a": 2, "dc_b": 2}),
])  # fmt: skip
def test_auto_never_arms_a_look_ahead_the_job_could_not_run(change, dcs):
    from meridian.service.planning.train_config import build_train_config

    request = replace(req(), **change)
    plan = plan_job(request, topology(**dcs))
    assert plan.lookahead_when_exposed is None and not plan.local_lookahead
    assert build_train_config("j", request, plan, "").sync.lookahead_when_exposed is None


def test_gpipe_holds_every_micro_batch_s_activations_1f1b_at_most_pp():
    from meridian.service.planning.cost_model import (
        activation_bytes,
        logits_bytes,
        memory_per_device,
        stage_params,
    )
    from meridian.service.planning.planner import default_figures
    from meridian.workers.contracts.model_shape import ModelShape

    model = model_preset("gpt2-350m")
    kw = dict(pp=2, dp=1, num_dcs=1, dp_per_dc=1, micro_batch=4, micro_batches=16)
    logits = logits_bytes(model, 4)
    one = activation_bytes(model, 4, model.n_layers // 2, 1) - logits  # one stage's layers, one micro-batch
    f1b, gpipe = (memory_per_device(model, _layout(schedule=s, **kw), 1) for s in ("1f1b", "gpipe"))
    # pipeline.py's GPipe runs all 16 forwards before any backward: its last stage holds 16 micro-batches'
    # activations and logits. 1F1B's first stage keeps pp=2 in flight (no logits; its last stage holds one). The
    # estimate counted the logits on every micro-batch in flight on one stage that had both ends' parameters.
    first, last = stage_params(ModelShape.of(model), 2)
    assert gpipe - f1b == pytest.approx(16 * (one + logits) - 2 * one + 16 * (last - first))
    tp_only = dict(tp=2, pp=1, dp=1, num_dcs=1, dp_per_dc=1, micro_batch=4, micro_batches=16)  # the stage runner too
    assert (memory_per_device(model, _layout(schedule="gpipe", **tp_only), 1)
            - memory_per_device(model, _layout(schedule="1f1b", **tp_only), 1)) == pytest.approx(
        15 * activation_bytes(model, 4, model.n_layers, 2))
    # On 24 GiB GPUs the 1F1B plan fits; GPipe's 16 micro-batches of activations do not, and the refusal says so.
    topo = ClusterTopology((node("a0", "dc-a", cpus=8, gpus=1), node("a1", "dc-a", cpus=8, gpus=1)))
    figures = replace(default_figures(topo, ("dc-a",), True), device_memory_bytes=24 * 2**30)

    def request(schedule):
        return JobRequest(name="p", model=model, steps=10, global_batch=64, micro_batch=4,
                          parallelism=ParallelismRequest(tp=1, pp=2, schedule=schedule))

    assert plan_job(request("1f1b"), topo, figures).estimate["memory_bytes"] < 24 * 2**30
    with pytest.raises(Unschedulable, match=r"use parallelism.schedule '1f1b' \(GPipe holds the activations of all 16"):
        plan_job(request("gpipe"), topo, figures)


def test_a_cpu_only_node_in_a_gpu_datacenter_holds_no_worker_instead_of_making_a_cpu_job():
    from meridian.service.planning.figures import figures_for
    from meridian.service.planning.placement import pin_ranks_to_nodes

    # A CPU-only head labelled dc-a (`ray start --head --labels datacenter=dc-a`) made every worker a CPU worker,
    # 36 of them on the GPU nodes' CPUs.
    gpus = (node("g0", "dc-a", cpus=16, gpus=4), node("g1", "dc-b", cpus=16, gpus=4))
    topo = ClusterTopology((*gpus, node("head", "dc-a", cpus=4)))
    request = replace(req(global_batch=64), parallelism=ParallelismRequest(tp=1, pp=1))
    plan = plan_job(request, topo)
    assert plan.use_gpu and plan.num_workers == 8 and plan.resources_per_worker == {"CPU": 1.0, "GPU": 1.0}
    assert "No worker on head (dc-a): no GPU" in plan.explanation
    # the launch pins and admission count the same slots: the head has none
    assert "head" not in pin_ranks_to_nodes(plan, topo) and admission(plan, topo) is None
    busy = ClusterTopology((node("g0", "dc-a", cpus=16, gpus=4, free_gpus=2), gpus[1], node("head", "dc-a", cpus=4)))
    assert admission(plan, busy) == "waiting for 2 GPUs in dc-a (each worker takes 1 CPU and 1 GPU on one node)"
    # the GPUs' memory read on the GPU nodes is the devices' memory (the head has no GPU to read)
    figures, sources = figures_for(request, topo, None, {"g0": 24 * 2**30, "g1": 24 * 2**30})
    assert figures.device_memory_known and figures.device_memory_bytes == 24 * 2**30
    # a datacenter without any GPU still makes it a CPU job: every rank runs on the same kind of device
    assert not plan_job(request, ClusterTopology((gpus[0], node("c0", "dc-b", cpus=4)))).use_gpu


def test_admission_counts_free_slots_per_node_as_ray_places_workers():
    from meridian.service.planning.placement import pin_ranks_to_nodes

    tp2 = replace(req(global_batch=1), parallelism=ParallelismRequest(tp=2, pp=1))
    idle = ClusterTopology((node("a0", "dc-a", cpus=2), node("a1", "dc-a", cpus=2)))
    busy = ClusterTopology((node("a0", "dc-a", cpus=2, free_cpus=1), node("a1", "dc-a", cpus=2)))
    # A tensor-parallel group pinned to a0 (planned when a0 was idle) does not fit a0's one free CPU now: the job
    # waits in the queue, saying why, instead of being admitted on dc-a's 3 free CPUs and placing for 15 minutes.
    planned = plan_job(tp2, idle)
    assert planned.rank_nodes == ("a0", "a0")
    assert admission(planned, busy) == ("waiting for 1 CPU on node a0 in dc-a where the plan keeps a "
                                        "tensor-parallel group of 2 together")
    # Planned with the cluster as it is now (as the queue does every tick), the group goes where it fits.
    now = plan_job(tp2, busy)
    assert now.rank_nodes == ("a1", "a1") and admission(now, busy) is None
    assert pin_ranks_to_nodes(now, busy) == ("a1", "a1")
    # A GPU worker asks Ray for a CPU too: GPUs free on a node whose CPUs other work holds are no slot.
    cpus_held = ClusterTopology((node("g0", "dc-a", cpus=8, gpus=4, free_cpus=1),))
    plan = plan_job(req(), cpus_held)
    assert plan.num_workers == 4 and plan.resources_per_worker == {"CPU": 1.0, "GPU": 1.0}
    assert admission(plan, cpus_held) == "waiting for 3 CPUs in dc-a (each worker takes 1 CPU and 1 GPU on one node)"
    # ... and a node with fewer CPUs than GPUs holds a worker per CPU
    assert plan_job(req(), ClusterTopology((node("g0", "dc-a", cpus=2, gpus=4),))).num_workers == 2
    # GPUs free on one node and CPUs on another make no slot either
    apart = ClusterTopology((node("g0", "dc-a", cpus=4, gpus=2, free_cpus=0), node("g1", "dc-a", cpus=4, gpus=2,
                                                                                   free_gpus=0)))
    assert admission(plan_job(req(global_batch=4), apart), apart) == (
        "waiting for room for 4 more workers in dc-a (each worker takes 1 CPU and 1 GPU on one node)")


def test_a_named_datacenter_that_cannot_hold_a_worker_is_refused_not_dropped():
    topo = ClusterTopology((node("a0", "dc-a", cpus=2), node("b0", "dc-b", cpus=0.5)))
    with pytest.raises(Unschedulable, match=r"topology.datacenters names dc-b, but no live node there can hold a "
                                            r"worker \(each takes 1 CPU; dc-b: b0 has 0.5 CPU"):
        plan_job(req(["dc-a", "dc-b"]), topo)
    auto = plan_job(req(), topo)  # 'auto' uses the datacenters that can, and says why not the other
    assert auto.datacenters == ("dc-a",) and "No worker in dc-b: no live node there can hold one" in auto.explanation


def test_flat_sync_with_tensor_or_pipeline_parallelism_is_refused_at_submission():
    with pytest.raises(ValueError, match="sync.strategy 'flat' cannot run with parallelism.tp = 1, pp = 2"):
        replace(req(strategy=SyncStrategy.FLAT), parallelism=ParallelismRequest(pp=2))


@pytest.mark.parametrize("request_, topo, reason", [
    (replace(req(), parallelism=ParallelismRequest(pp=2, stages_span_dcs=True)), topology(dc_a=4),
     "stages_span_dcs=true puts pipeline stages in different datacenters, but the job's workers can only be in dc-a"),
    (replace(req(workers=(("dc-a", 3), ("dc-b", 1))), parallelism=ParallelismRequest(pp=2, stages_span_dcs=True)),
     topology(dc_a=4, dc_b=4), r"asks for 4 workers and the job must use them all.*closest uses 2: tp=1 pp=2 across"),
])  # fmt: skip
def test_no_layout_names_the_option_that_rules_them_out(request_, topo, reason):
    with pytest.raises(Unschedulable, match=reason):
        plan_job(request_, topo)


def test_uneven_pipeline_stages_count_the_activations_of_the_deepest_stage():
    # 5 layers on 4 stages run 2, 1, 1, 1 (workers/parallel/pipeline.py): the first stage holds two layers'
    # activations per micro-batch in flight; the estimate counted 5 // 4 = 1.
    from meridian.service.planning.cost_model import (
        ADAMW_STATE_BYTES,
        BYTES_FP32,
        layer_activation_bytes,
        logits_bytes,
        memory_per_device,
        stage_params,
    )
    from meridian.workers.contracts.model_shape import ModelShape
    from meridian.workers.parallel.pipeline import stage_layers

    model = replace(model_preset("gpt2-124m"), n_layers=5)
    deepest = max(len(stage_layers(5, 4, s)) for s in range(4))
    kw = dict(pp=4, dp=1, num_dcs=1, dp_per_dc=1, micro_batch=4, micro_batches=16)
    f1b, gpipe = (memory_per_device(model, _layout(schedule=s, **kw), 1) for s in ("1f1b", "gpipe"))
    layer, logits = layer_activation_bytes(model, 4, 1), logits_bytes(model, 4)
    first, last = (p * (2 * BYTES_FP32 + ADAMW_STATE_BYTES) for p in stage_params(ModelShape.of(model), 4))
    # 1F1B: the first stage holds 2 layers of 4 micro-batches in flight, the last 1 layer of one and its logits;
    # GPipe: both hold all 16 micro-batches
    assert deepest == 2 and f1b == pytest.approx(max(first + 4 * deepest * layer, last + layer + logits))
    assert gpipe == pytest.approx(max(first + 16 * deepest * layer, last + 16 * (layer + logits)))


def test_flat_sync_keeps_the_whole_adamw_state_on_every_rank_in_the_memory_estimate():
    # DDP shards nothing: the estimate divided the optimizer state by the datacenter's ranks anyway.
    from meridian.service.planning.cost_model import ADAMW_STATE_BYTES, memory_per_device

    model = model_preset("gpt2-124m")
    one_dc = dict(dp=4, num_dcs=1, dp_per_dc=4)
    flat = memory_per_device(model, _layout(hierarchical=False, **one_dc), 4)
    sharded = memory_per_device(model, _layout(hierarchical=True, encoded=True, **one_dc), 4)
    assert flat - sharded == pytest.approx(ADAMW_STATE_BYTES * model.num_params * (1 - 1 / 4))


def test_a_job_that_asks_for_periodic_checkpoints_is_offered_only_data_parallel_layouts():
    # Only a data-parallel job writes checkpoints it can resume from: under auto a tp/pp layout would have left
    # checkpoint.interval_steps without effect (a tensor/pipeline-parallel job writes only its final weights).
    from meridian.service.planning.planner import default_figures, ranked_layouts

    topo = _two_slot_nodes()
    request = replace(req(global_batch=8), checkpoint_every=5)
    ranked = ranked_layouts(request, topo, default_figures(topo, ("dc-a", "dc-b"), False))
    assert ranked and {(c.layout.tp, c.layout.pp) for c, _ in ranked} == {(1, 1)}
