"""The cost model's memory and time terms for large jobs, each against the formula its source gives."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meridian.service.planning.calibration import gpt_shape
from meridian.service.planning.cost_model import (
    ADAMW_STATE_BYTES,
    BYTES_FP32,
    Figures,
    Layout,
    Link,
    Recompute,
    estimate,
    layer_activation_bytes,
    memory_per_device,
    stage_params,
    state_bytes,
)

S, B, H, A = 2048, 2, 6144, 48
SHAPE = gpt_shape(layers=48, hidden=H, heads=A, seq_len=S)
SBH = S * B * H
FIG = Figures(device_flops=100e12, device_memory_bytes=80 * 2**30, intra_node=Link(5e-6, 300e9),
              intra_dc=Link(1e-5, 25e9), inter_dc=Link(0.0105, 50e9), peak_flops=312e12)


def layout(**kw) -> Layout:
    base = dict(tp=8, pp=4, dp=8, num_dcs=1, dp_per_dc=8, pp_spans_dcs=False, micro_batch=B, micro_batches=16,
                hierarchical=True, overlap=True, bf16_weights=True)
    return Layout(**{**base, **kw})


@pytest.mark.parametrize("t, sp, recompute, units", [
    # Korthikanti et al. 2022, Table 2 (bytes per layer, 16-bit activations), with attention scores kept:
    (1, False, Recompute.NONE, 34 + 5 * A * S / H),  # no parallelism
    (8, False, Recompute.NONE, 10 + 24 / 8 + 5 * A * S / (H * 8)),  # tensor parallel
    (8, True, Recompute.NONE, (34 + 5 * A * S / H) / 8),  # tensor + sequence parallel
    (8, False, Recompute.SELECTIVE, 10 + 24 / 8),  # tensor parallel + selective recomputation
    (8, True, Recompute.SELECTIVE, 34 / 8),  # tensor + sequence parallel + selective recomputation
    (8, False, Recompute.FULL, 2),  # full recomputation: the layer's input
    (8, True, Recompute.FULL, 2 / 8),
])
def test_activation_memory_per_layer_is_korthikanti_table_2(t, sp, recompute, units):
    got = layer_activation_bytes(SHAPE, B, t, sequence_parallel=sp, recompute=recompute, fused_attention=False,
                                 bf16_weights=True)
    assert got == pytest.approx(SBH * units)


def test_fused_attention_keeps_no_scores_and_fp32_weights_double_the_count():
    fused = layer_activation_bytes(SHAPE, B, 8, sequence_parallel=True, bf16_weights=True)
    assert fused == pytest.approx(SBH * 34 / 8)  # what selective recomputation saves, flash attention never keeps
    assert layer_activation_bytes(SHAPE, B, 8, sequence_parallel=True) == pytest.approx(2 * fused)


def test_interleaving_holds_korthikanti_s_extra_share_on_the_first_stage():
    # §4.2.3: the first stage holds activations of L x (1 + (p - 1) / (p m)) layers, m the interleaving stages
    one = layer_activation_bytes(SHAPE, B, 8, bf16_weights=True)
    plain, interleaved = (memory_per_device(SHAPE, layout(virtual_stages=v)) for v in (1, 4))
    layers = SHAPE.n_layers  # pp stages x (L / pp) layers in flight on the first stage under 1F1B
    assert interleaved - plain == pytest.approx(one * layers * (4 - 1) / (4 * 4))


def test_weights_gradients_and_optimizer_state_by_sharding():
    params, layer = 1e9, 1e7
    n = 8
    replicated = layout(dp=1, dp_per_dc=1)  # nothing to shard over
    zero1 = layout()
    fsdp = layout(fsdp=True)
    # bf16 compute weights (2) + fp32 gradients (4) + fp32 master (4) and AdamW (8), the last two sharded (ZeRO-1)
    assert state_bytes(params, replicated, layer) == pytest.approx(18 * params)
    assert state_bytes(params, zero1, layer) == pytest.approx(6 * params + 12 * params / n)
    # FSDP shards all 16 bytes; under pipelining the stage's bf16 weights stay gathered and its fp32 gradients
    # accumulate unsharded until the schedule's last micro-batch reduce-scatters them
    assert state_bytes(params, fsdp, layer) == pytest.approx(16 * params / n + 2 * params + BYTES_FP32 * params)
    # without pipelining: resharded after forward (two blocks gathered at a time); the micro-batches' gradients
    # accumulate unsharded until the last one's reduce-scatter, one block's at a time with a single micro-batch
    no_pp = layout(fsdp=True, pp=1)
    assert state_bytes(params, no_pp, layer) == pytest.approx(16 * params / n + 2 * 2 * layer + BYTES_FP32 * params)
    one_micro = layout(fsdp=True, pp=1, micro_batches=1)
    assert state_bytes(params, one_micro, layer) == pytest.approx(16 * params / n + 2 * 2 * layer + BYTES_FP32 * layer)
    # fp32 weights under autocast, only the AdamW state sharded (the flat-bucket engine's ZeRO-1)
    fp32 = layout(bf16_weights=False)
    assert state_bytes(params, fp32, layer) == pytest.approx(8 * params + ADAMW_STATE_BYTES * params / n)


def test_fsdp_across_datacenters_shards_inside_each_and_replicates_across():
    two_dcs = layout(pp=1, num_dcs=2, dp=16, dp_per_dc=8, fsdp=True)
    assert two_dcs.shards == 8  # HSDP: one shard set per datacenter
    e = estimate(SHAPE, two_dcs, FIG, 256)
    assert e.inter_dc_bytes == pytest.approx(2 * BYTES_FP32 * SHAPE.num_params)  # each DC's gradients, once


def test_the_interleaved_bubble_is_narayanan_s_p_minus_one_over_v_m():
    for v in (1, 2, 4):
        e = estimate(SHAPE, layout(virtual_stages=v), FIG, 256)
        busy = e.compute_s - e.bubble_s
        assert e.bubble_s / busy == pytest.approx((4 - 1) / (v * 16))


def test_full_recomputation_adds_a_forward_and_two_all_reduces_per_layer():
    none, full = (estimate(SHAPE, layout(recompute=r), FIG, 256) for r in (Recompute.NONE, Recompute.FULL))
    assert full.tp_comm_s == pytest.approx(none.tp_comm_s * 6 / 4)
    assert full.recompute_s > 0 and none.recompute_s == 0
    # the busiest stage does its layers' forward once more (3 passes become 4; its head is not recomputed)
    assert 1.25 < full.compute_s / none.compute_s < 4 / 3


def test_every_model_parallel_rank_s_gradients_share_the_inter_dc_link():
    # the link carries a whole model's gradients whatever the tp x pp split: the same time for tp=8 pp=4 as for
    # one replica that holds the model whole
    split = estimate(SHAPE, layout(num_dcs=2, dp=16, dp_per_dc=8), FIG, 256)
    whole_model = BYTES_FP32 * SHAPE.num_params
    cross = FIG.inter_dc.time(whole_model)
    assert split.dp_comm_s >= cross * 0.95
    assert split.inter_dc_bytes == pytest.approx(2 * whole_model)


def test_stages_across_datacenters_send_every_replica_s_activations_over_the_link():
    lay = layout(pp=4, num_dcs=2, dp=8, dp_per_dc=0, pp_spans_dcs=True)
    e = estimate(SHAPE, lay, FIG, 256)
    act = 2 * B * S * H  # one micro-batch's bf16 activations at the boundary
    assert e.inter_dc_bytes == pytest.approx(2 * 16 * act * 8)  # forward and backward, every micro-batch, 8 replicas
    assert e.pp_comm_s == pytest.approx((16 + 4 - 1) * FIG.inter_dc.time(act * 8))


def test_a_tied_head_on_a_separate_last_stage_keeps_its_own_copy():
    first, last = stage_params(SHAPE, 4)
    untied = replace(SHAPE, tie_embeddings=False)
    assert stage_params(untied, 4)[1] == pytest.approx(last)  # the copy weighs what an untied head weighs
    assert first == 12 * SHAPE.layer_params + SHAPE.embedding_params
