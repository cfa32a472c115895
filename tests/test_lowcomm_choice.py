"""``auto`` goes to the sparse outer update exactly where streaming DiLoCo at int4 cannot keep compute busy on the
link, says so with the numbers, and the plan crosses to the workers as a valid sparse config. Without Ray."""

from __future__ import annotations

from dataclasses import replace

import pytest
from fakes import topology

from meridian.service.jobs import JobRequest, TopologyRequest
from meridian.service.planning.cost_model import Link
from meridian.service.planning.lowcomm_choice import (
    MIN_UTILISATION,
    SPARSE_BYTES_PER_PARAM,
    choose_lowcomm,
    sparse_instead,
    streaming_utilisation,
)
from meridian.service.planning.planner import default_figures, plan_job
from meridian.service.planning.sync_choice import OUTER_BYTES_PER_PARAM, choose_sync, cross_dc_time
from meridian.service.planning.train_config import build_train_config
from meridian.workers.contracts.config import Compression, DiLoCoConfig, SyncConfig, SyncStrategy
from meridian.workers.contracts.model_config import model_preset
from meridian.workers.contracts.wire_format import sparse_payload_bytes

SLOW = dict(rtt_ms=100, gbps=0.1, compute_s=0.5, last_sync_mb=64)


def test_utilisation_counts_fragments_outlasting_their_overlap_and_the_links_backlog():
    cfg = DiLoCoConfig(inner_steps=8, fragments=2, overlap_steps=2)
    link = dict(rtt_ms=100, gbps=0.1, num_dcs=2)
    wire = 2.5e6  # 1.25 MB a fragment: 50 ms + 100 ms on the link
    frag_s = cross_dc_time(wire / 2, **link)
    assert frag_s == pytest.approx(0.15)
    # 2 steps of 0.1 s cover a fragment: nothing waits
    assert streaming_utilisation(cfg, wire_bytes=wire, compute_s=0.1, **link) == 1
    # 2 steps of 0.05 s do not: each fragment waits 50 ms, 0.1 s a cycle of 0.4 s
    assert streaming_utilisation(cfg, wire_bytes=wire, compute_s=0.05, **link) == pytest.approx(0.4 / 0.5)
    # the link's backlog: a whole model takes 0.25 s against a cycle of 8 x 0.01 s
    backlog = cross_dc_time(wire, **link) - 0.08
    got = streaming_utilisation(replace(cfg, overlap_steps=7), wire_bytes=wire, compute_s=0.01, **link)
    assert got == pytest.approx(0.08 / (0.08 + max(backlog, 2 * (frag_s - 0.07))))


@pytest.mark.parametrize("params", [10**9, 4 * 10**9])
def test_int4_streaming_stays_where_it_keeps_compute_busy(params):
    c = choose_lowcomm(num_params=params, **SLOW)
    assert c.strategy is SyncStrategy.STREAMING_DILOCO and c.compression is Compression.INT4
    assert c.diloco.sparse_density is None
    u = streaming_utilisation(c.diloco, wire_bytes=OUTER_BYTES_PER_PARAM * params, compute_s=0.5, rtt_ms=100,
                              gbps=0.1, num_dcs=2)  # fmt: skip
    assert u >= MIN_UTILISATION
    assert sparse_instead(c.diloco, rtt_ms=100, gbps=0.1, num_params=params, compute_s=0.5, num_dcs=2, steps=None,
                          head="") is None  # fmt: skip


def test_a_link_too_slow_for_int4_streaming_picks_the_sparse_update_and_says_why_with_the_numbers():
    params = 2 * 10**10  # int4 fragments of 2.66 GB take 212 s on 0.1 Gbit/s; H is capped at 500 steps of 0.5 s
    c = choose_lowcomm(num_params=params, steps=100_000, **SLOW)
    cfg = c.diloco
    assert c.strategy is SyncStrategy.STREAMING_DILOCO and c.compression is Compression.NONE
    assert cfg.sparse_density == 0.02 and cfg.sparse_value_bits == 2 and cfg.sparse_block == 4096
    assert cfg.sparse_keep_unsent and (cfg.outer_lr, cfg.outer_momentum, cfg.merge.value) == (2.0, 0.0, "keep-progress")
    int4 = choose_sync(num_params=params, steps=100_000, **SLOW)  # what it replaces
    assert choose_lowcomm(num_params=params, steps=100_000, sparse=False, **SLOW) == int4
    assert int4.compression is Compression.INT4 and int4.diloco.inner_steps == 500
    link = dict(compute_s=0.5, rtt_ms=100, gbps=0.1, num_dcs=2)
    u4 = streaming_utilisation(int4.diloco, wire_bytes=OUTER_BYTES_PER_PARAM * params, **link)
    u = streaming_utilisation(cfg, wire_bytes=SPARSE_BYTES_PER_PARAM * params, **link)
    assert u4 < MIN_UTILISATION <= u
    assert f"{u4:.1%}" in c.explanation and f"{u:.1%}" in c.explanation and "97%" in c.explanation
    assert "top 2% of every 4,096-element block in 2 bits" in c.explanation
    assert c.outer_sync_s == pytest.approx(cross_dc_time(SPARSE_BYTES_PER_PARAM * params, rtt_ms=100, gbps=0.1,
                                                         num_dcs=2))  # fmt: skip
    assert cfg.inner_steps <= 500 and cfg.overlap_steps < cfg.inner_steps
    SyncConfig(strategy=c.strategy, diloco=cfg, compression=c.compression)  # a valid job config
    # the planner's bytes per parameter are what the codec puts on the wire, over whole blocks
    assert sparse_payload_bytes(4096 * 100, 0.02, 2, 4096) == pytest.approx(SPARSE_BYTES_PER_PARAM * 4096 * 100, abs=8)


def _req(**kw) -> JobRequest:
    return JobRequest(name="p", model=model_preset("nano"), steps=2048, global_batch=8, micro_batch=1,
                      topology=TopologyRequest(), **kw)  # fmt: skip


def test_the_planner_hands_the_sparse_update_to_the_workers_on_a_measured_link_too_slow_for_int4():
    topo = topology(dc_a=2, dc_b=2)
    base = default_figures(topo, ("dc-a", "dc-b"), False)
    # 7 kB/s: nano's int4 fragments (2.6 s each) would keep streaming DiLoCo under 97% computing even at H=500
    crawl = replace(base, inter_dc=Link(0.05, 7e3), inter_dc_known=True)
    plan = plan_job(_req(), topo, crawl)
    assert plan.sync_strategy is SyncStrategy.STREAMING_DILOCO and plan.diloco.sparse_density == 0.02
    assert "Sync 'streaming-diloco' sparse" in plan.explanation and "under the 97% it must keep" in plan.explanation
    config = build_train_config("j", _req(), plan, "")
    assert config.sync.outer == plan.diloco and config.sync.compression is Compression.NONE
    # a job that set its own encoding keeps it: no sparse update for it
    asked = _req(sync=SyncConfig(strategy=None, compression=Compression.INT8))
    other = plan_job(asked, topo, crawl)
    assert other.diloco is not None and other.diloco.sparse_density is None
    assert build_train_config("j", asked, other, "").sync.compression is Compression.INT8
    # where int4 keeps up (100 kB/s, 0.1 Gbit/s) nothing changes
    for bytes_per_s in (1e5, 0.1e9 / 8):
        slow = replace(base, inter_dc=Link(0.05, bytes_per_s), inter_dc_known=True)
        assert plan_job(_req(), topo, slow).diloco.sparse_density is None


def test_nano_on_the_labs_link_keeps_int4_streaming():
    params = model_preset("nano").num_params
    c = choose_lowcomm(rtt_ms=100, gbps=0.1, num_params=params, compute_s=0.031, last_sync_mb=0.1, steps=2048)
    assert c.compression is Compression.INT4 and c.diloco.sparse_density is None
