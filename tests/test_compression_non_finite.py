"""int8 / int4 payloads carry a NaN or infinity as NaN, as uncompressed and bf16 sums do.

A NaN used to make its chunk's (int4: block's) absmax NaN, so the scale fell back to 1: the NaN went out as
0 (int8) or -8 (int4) and every finite value of the chunk was rounded to a whole number. Its error-feedback
residual was NaN from then on, so the same finite garbage was sent for that element at every later step. On
two DCs with streaming DiLoCo's int4 outer deltas, one DC's weights going NaN moved the outer parameters by
+5, +13, +23, +34 over four outer steps, all finite (uncompressed and bf16: NaN, the job visibly fails).
"""

from __future__ import annotations

import pytest
import torch
from sync_helpers import toy_model, train_steps

from meridian.workers.contracts.config import Compression, DiLoCoConfig, OptimConfig, SyncConfig, SyncStrategy
from meridian.workers.distributed.layout import DCGroups, DCLayout
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.sync.compression import INT4_LEVELS, INT8_LEVELS, ErrorFeedback, Int4Codec, Int8Codec
from meridian.workers.sync.diloco import DiLoCoSync

CODECS = [(Int8Codec(), INT8_LEVELS, 10**9), (Int4Codec(), INT4_LEVELS, 128), (Int4Codec(block=4), INT4_LEVELS, 4)]
IDS = ["int8", "int4", "int4-block4"]


@pytest.mark.parametrize("codec, levels, block", CODECS, ids=IDS)
def test_a_non_finite_value_decodes_as_nan_and_the_rest_of_its_chunk_keeps_its_precision(codec, levels, block):
    x = torch.randn(300, generator=torch.Generator().manual_seed(0)) * 1e-3
    bad = torch.tensor([3, 4, 5, 130, 299])
    x[bad] = torch.tensor([float("nan"), float("inf"), -float("inf"), float("nan"), float("nan")])
    out = codec.decode(codec.encode(x))
    finite = torch.isfinite(x)
    assert torch.isnan(out[~finite]).all()
    assert torch.isfinite(out[finite]).all()
    # each finite value within half a step of its chunk's (block's) absmax over the finite values
    for start in range(0, 300, min(block, 300)):
        part = slice(start, min(start + block, 300))
        step = x[part][finite[part]].abs().max() / levels
        assert (out[part][finite[part]] - x[part][finite[part]]).abs().max() <= step / 2 + 1e-9


@pytest.mark.parametrize("codec, levels, block", CODECS, ids=IDS)
def test_after_a_nan_error_feedback_keeps_sending_nan_never_a_finite_value(codec, levels, block):
    feedback = ErrorFeedback(codec)
    x = torch.full((8,), 0.25)
    x[2] = float("nan")
    assert torch.isnan(codec.decode(feedback.encode("k", x))[2])
    for _ in range(3):
        sent = codec.decode(feedback.encode("k", torch.full((8,), 0.25)))
        assert torch.isnan(sent[2])  # the residual is NaN: what this DC owes is unknown, and says so
        assert torch.isfinite(sent[[0, 1, 3, 4, 5, 6, 7]]).all()


@pytest.mark.parametrize("codec, levels, block", CODECS, ids=IDS)
def test_values_too_small_for_a_scale_decode_as_zero_not_nan(codec, levels, block):
    x = torch.tensor([1e-45, 0.0, -1e-45, 0.0])  # absmax / levels underflows to 0
    out = codec.decode(codec.encode(x))
    assert torch.isfinite(out).all() and out.abs().max() <= 1e-44


def _diverged_dc(rank, world, compression):
    sync = SyncConfig(strategy=SyncStrategy.DILOCO, compression=compression, bucket_mb=64 / 2**20,
                      inter_dc_chunk_mb=40 / 2**20, diloco=DiLoCoConfig(inner_steps=2))  # fmt: skip
    e = DiLoCoSync(toy_model(0), DCGroups(DCLayout(("a", "b")), rank), sync, OptimConfig(lr=0.05, warmup_steps=0))
    train_steps(e, rank, world, steps=1, micro=2)
    e.synchronize()
    if rank == 0:  # DC a diverges before its first outer step
        with torch.no_grad():
            e.model.l1.weight[0, 0] = float("nan")
    anchors = []
    for step in range(1, 5):
        train_steps(e, rank, world, steps=1, micro=2, first_step=step)
        if (step + 1) % 2 == 0:
            anchors.append(e.optimizer_state()["diloco"]["anchor"]["l1.weight"].clone())
    e.close()
    e.groups.destroy()
    return anchors


@pytest.mark.parametrize("compression", [Compression.INT4, Compression.INT8, Compression.NONE])
def test_a_diverged_datacenter_makes_the_outer_parameters_nan_whatever_the_encoding(compression):
    for anchors in run_processes(_diverged_dc, 2, compression):
        for anchor in anchors:  # both outer steps, in both DCs
            assert torch.isnan(anchor).any()
