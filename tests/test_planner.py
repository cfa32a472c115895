"""The planner, without Ray: feasibility, layout, sizes, admission reasons."""

from __future__ import annotations

import pytest
from fakes import node, topology

from meridian.service.errors import InvalidJob, Unschedulable
from meridian.service.jobs import JobRequest, TopologyRequest
from meridian.service.planner import admission, plan_job
from meridian.service.topology import ClusterTopology
from meridian.workers.config import SyncStrategy, model_preset


def req(datacenters=None, workers=None, global_batch=8, min_workers=1, strategy=None) -> JobRequest:
    return JobRequest(
        name="p", model=model_preset("nano"), steps=2, global_batch=global_batch, micro_batch=1,
        topology=TopologyRequest(datacenters=datacenters, workers_per_datacenter=workers, min_workers=min_workers),
        sync_strategy=strategy,
    )


def test_auto_uses_every_datacenter_with_contiguous_ranks_and_hierarchical_sync():
    plan = plan_job(req(), topology(dc_a=2, dc_b=3))
    assert plan.rank_datacenters == ("dc-a", "dc-a", "dc-b", "dc-b", "dc-b")
    assert plan.sync_strategy is SyncStrategy.HIERARCHICAL and not plan.use_gpu
    assert "2 replica(s) in dc-a, 3 replica(s) in dc-b" in plan.explanation
    assert "Sync 'hierarchical' (chosen" in plan.explanation


def test_single_datacenter_defaults_to_flat_and_respects_an_explicit_strategy():
    assert plan_job(req(["dc-a"]), topology(dc_a=2, dc_b=2)).sync_strategy is SyncStrategy.FLAT
    forced = plan_job(req(["dc-a"], strategy=SyncStrategy.HIERARCHICAL), topology(dc_a=2))
    assert forced.sync_strategy is SyncStrategy.HIERARCHICAL and "as requested" in forced.explanation


def test_unknown_datacenter_is_unschedulable_and_names_the_alternatives():
    with pytest.raises(Unschedulable, match=r"'dc-z'.*has 'dc-a', 'dc-b'"):
        plan_job(req(["dc-a", "dc-z"]), topology(dc_a=1, dc_b=1))


def test_too_many_workers_for_a_datacenter_is_unschedulable():
    with pytest.raises(Unschedulable, match="dc-b can hold at most 2 worker"):
        plan_job(req(workers=3), topology(dc_a=4, dc_b=2))


def test_per_datacenter_counts_and_uneven_layouts():
    plan = plan_job(req(["dc-b", "dc-a"], workers=(("dc-a", 1), ("dc-b", 2))), topology(dc_a=2, dc_b=2))
    assert plan.rank_datacenters == ("dc-b", "dc-b", "dc-a")


def test_global_batch_smaller_than_explicit_workers_is_invalid_but_auto_shrinks():
    with pytest.raises(InvalidJob, match="global_batch \\(2\\) is smaller than the number of workers \\(4\\)"):
        plan_job(req(workers=2, global_batch=2), topology(dc_a=2, dc_b=2))
    assert plan_job(req(global_batch=3), topology(dc_a=2, dc_b=2)).num_workers == 3


def test_min_workers_above_capacity_is_unschedulable():
    with pytest.raises(Unschedulable, match="min_workers=9"):
        plan_job(req(min_workers=9), topology(dc_a=2, dc_b=2))


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
