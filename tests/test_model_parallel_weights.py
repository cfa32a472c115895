"""Where each tensor-parallel slice lands in the full parameter: the boxes a rank writes tile the parameter
exactly, for every way a parameter is cut (both families)."""

from __future__ import annotations

import pytest
import torch

from meridian.workers.parallel.tensor_parallel import shard, tp_split
from meridian.workers.state.model_parallel_weights import full_shape, slice_boxes

NAMES = {
    "blocks.0.attn.qkv.weight": (3 * 8, 8),  # GPT's fused q, k, v
    "blocks.0.attn.qkv.bias": (3 * 8,),
    "blocks.0.mlp.fc.weight": (32, 8),
    "blocks.0.mlp.fc.bias": (32,),
    "blocks.0.attn.proj.weight": (8, 8),
    "blocks.0.mlp.proj.weight": (8, 32),
    "blocks.0.attn.k.weight": (4, 8),  # llama: whole key/value heads
    "blocks.0.mlp.gate.weight": (24, 8),
    "blocks.0.ln_1.weight": (8,),  # replicated
}


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", sorted(NAMES))
def test_every_rank_s_boxes_tile_the_full_parameter_once(name, tp):
    full = torch.randn(NAMES[name])
    rebuilt = torch.zeros_like(full)
    written = torch.zeros_like(full)
    writers = range(tp) if tp_split(name) is not None else range(1)  # a replicated one: TP rank 0 writes it
    for r in writers:
        part = shard(name, full, r, tp)
        assert full_shape(name, part, tp) == full.shape
        for offsets, box in slice_boxes(name, part, r, tp):
            where = tuple(slice(o, o + n) for o, n in zip(offsets, box.shape, strict=True))
            rebuilt[where] = box
            written[where] += 1
    assert torch.equal(rebuilt, full)
    assert bool((written == 1).all())  # every element once: DCP would refuse overlapping chunks
