"""A tensor/pipeline-parallel job's final weights, written by the ranks that hold them: nothing is gathered.

Each rank of the first data-parallel replica writes the parameters of its pipeline stage, the tensor-parallel
ones as its own slice, into one DCP checkpoint in the sharded format's folder layout
(:mod:`meridian.workers.state.sharded_checkpoint`). A parameter is stored in its own shape under
``param/<name>`` and each slice is a box of it::

    rows:  tp rank r holds rows [r·R/tp, (r+1)·R/tp)            (column-parallel: q, k, v, gate, up, fc)
    cols:  columns [r·C/tp, (r+1)·C/tp)                        (row-parallel: proj)
    qkv:   three row boxes, one in each of q, k and v          (GPT's fused attention input)

A replicated parameter (norms, embeddings, biases of row-parallel layers) is written once, by TP rank 0 of
the last stage that holds it (the stage whose copy :func:`~meridian.workers.parallel.tensor_parallel.assemble`
keeps). Weights only: such a job does not resume from it (``adam_step`` 0); ``meridian export`` and
:func:`~meridian.workers.state.sharded_checkpoint.load_full` read it like any other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meridian.workers.parallel.tensor_parallel import tp_split
from meridian.workers.state.sharded_checkpoint import FORMAT, Chunk, write_chunks


def slice_boxes(name: str, part: torch.Tensor, tp_rank: int, tp: int) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """``(offsets in the full parameter, box)`` of TP rank ``tp_rank``'s part of parameter ``name``."""
    split = tp_split(name) if tp > 1 else None
    zeros = (0,) * part.dim()
    if split is None:
        return [(zeros, part)]
    if split == "cols":
        return [((0, tp_rank * part.shape[1], *zeros[2:]), part)]
    if split == "rows":
        return [((tp_rank * part.shape[0], *zeros[1:]), part)]
    third = part.shape[0] // 3  # qkv: this rank's heads of q, then of k, then of v
    return [((i * third * tp + tp_rank * third, *zeros[1:]), part[i * third : (i + 1) * third]) for i in range(3)]


def full_shape(name: str, part: torch.Tensor, tp: int) -> torch.Size:
    split = tp_split(name) if tp > 1 else None
    if split is None:
        return part.shape
    dim = 1 if split == "cols" else 0
    return torch.Size(n * tp if d == dim else n for d, n in enumerate(part.shape))


def save_model_parallel_weights(directory: str, params: dict[str, torch.Tensor], *, rank: int, replica: int,
                                stage: int, tp_rank: int, tp: int, step: int,
                                fingerprint: dict[str, Any]) -> Path | None:
    """Every rank calls this with its own parameters (a collective over the world); rank 0 returns the
    folder. Only replica 0's ranks write."""
    mine = (replica, stage, tp_rank, sorted(params))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    last_stage: dict[str, int] = {}
    for r, s, _, names in everyone:
        if r == 0:
            for n in names:
                last_stage[n] = max(s, last_stage.get(n, s))
    chunks: list[Chunk] = []
    sizes: dict[str, torch.Size] = {}
    if replica == 0:
        for name, part in params.items():
            if last_stage[name] != stage or ((tp_split(name) is None or tp == 1) and tp_rank != 0):
                continue
            key = f"param/{name}"
            sizes[key] = full_shape(name, part, tp)
            chunks += [(key, offsets, box.float().contiguous()) for offsets, box in slice_boxes(name, part, tp_rank, tp)]
    shapes = {key.removeprefix("param/"): size for key, size in sizes.items()}
    every_shape: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every_shape, {n: list(s) for n, s in shapes.items()})

    def meta() -> dict[str, Any]:
        merged = {n: s for part in every_shape for n, s in part.items()}
        return {"format": FORMAT, "step": step, "adam_step": 0, "fingerprint": fingerprint,
                "shapes": dict(sorted(merged.items())), "diloco": None}

    return write_chunks(directory, f"step-{step:08d}", chunks, sizes, rank=rank, group=None, meta=meta)
