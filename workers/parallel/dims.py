"""Who holds which part of the model: tensor-parallel, pipeline and data-parallel coordinates of every rank.

:class:`ParallelDims` is pure data (no torch.distributed), checked once, in the spirit of torchtitan's
``ParallelDims``: world ranks are ordered (pipeline stage, data-parallel replica, tensor-parallel rank) with
the tensor-parallel rank fastest — the order the planner places ranks in — so a TP group is consecutive
ranks on one node, and a replica's stages may sit in different datacenters.

:class:`ParallelGroups` builds the process groups one rank needs: its TP group, its *model-parallel* group
(every rank of its replica, for the gradient norm), and the :class:`DCGroups` of its *data-parallel* group —
the ranks holding the same (stage, TP rank) coordinates in every replica, whose gradients the hierarchical
sync reduces within and across datacenters exactly as it does without model parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from meridian.workers.distributed.groups import new_group
from meridian.workers.distributed.layout import DCGroups, DCLayout, make_groups
from meridian.workers.distributed.mp_norm import ModelParallelNorm
from meridian.workers.parallel.tensor_parallel import tp_split


@dataclass(frozen=True)
class Coords:
    stage: int
    replica: int
    tp_rank: int


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of tensor and pipeline parallelism over a world whose ranks live in ``datacenters``."""

    tp: int
    pp: int
    datacenters: tuple[str, ...]
    """Datacenter of every world rank, in rank order."""

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"parallelism.tp ({self.tp}) and parallelism.pp ({self.pp}) must be >= 1")
        world = len(self.datacenters)
        if world % (self.tp * self.pp):
            raise ValueError(
                f"{world} ranks cannot be split into replicas of tp × pp = {self.tp} × {self.pp} ranks"
            )
        for stage in range(self.pp):
            for replica in range(self.dp):
                dcs = {self.datacenters[r] for r in self.tp_ranks(stage, replica)}
                if len(dcs) > 1:
                    raise ValueError(
                        f"tensor-parallel group {self.tp_ranks(stage, replica)} spans datacenters {sorted(dcs)}: "
                        "tensor parallelism must stay inside one node"
                    )

    @property
    def world_size(self) -> int:
        return len(self.datacenters)

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1


    def coords(self, rank: int) -> Coords:
        stage, rest = divmod(rank, self.dp * self.tp)
        replica, tp_rank = divmod(rest, self.tp)
        return Coords(stage, replica, tp_rank)

    def rank_of(self, stage: int, replica: int, tp_rank: int) -> int:
        return (stage * self.dp + replica) * self.tp + tp_rank

    def tp_ranks(self, stage: int, replica: int) -> tuple[int, ...]:
        return tuple(self.rank_of(stage, replica, t) for t in range(self.tp))

    def replica_ranks(self, replica: int) -> tuple[int, ...]:
        """Every rank holding a part of replica ``replica`` (its model-parallel group)."""
        return tuple(self.rank_of(s, replica, t) for s in range(self.pp) for t in range(self.tp))

    def dp_ranks(self, stage: int, tp_rank: int) -> tuple[int, ...]:
        """The ranks holding the same part of the model in every replica, in replica order."""
        return tuple(self.rank_of(stage, d, tp_rank) for d in range(self.dp))

    def dp_layout(self, stage: int, tp_rank: int) -> DCLayout:
        return DCLayout(tuple(self.datacenters[r] for r in self.dp_ranks(stage, tp_rank)))

    def stage_neighbours(self, rank: int) -> tuple[int | None, int | None]:
        """World ranks of the previous and next pipeline stage of ``rank`` (same replica and TP rank)."""
        c = self.coords(rank)
        prev = self.rank_of(c.stage - 1, c.replica, c.tp_rank) if c.stage > 0 else None
        nxt = self.rank_of(c.stage + 1, c.replica, c.tp_rank) if c.stage < self.pp - 1 else None
        return prev, nxt


class ParallelGroups:
    """The process groups of one rank. Every rank builds every group in the same order (torch's rule)."""

    def __init__(self, dims: ParallelDims, rank: int, *, backend: str | None = None) -> None:
        if dist.get_world_size() != dims.world_size:
            raise ValueError(f"layout has {dims.world_size} ranks but the process group has {dist.get_world_size()}")
        self.dims = dims
        self.rank = rank
        self.coords = dims.coords(rank)
        c = self.coords
        self.tp_group: dist.ProcessGroup | None = None
        for stage in range(dims.pp):
            for replica in range(dims.dp):
                g = new_group(dims.tp_ranks(stage, replica), backend=backend) if dims.tp_enabled else None
                if (stage, replica) == (c.stage, c.replica):
                    self.tp_group = g
        mp_group = None
        for replica in range(dims.dp):
            g = new_group(dims.replica_ranks(replica), backend=backend)
            if replica == c.replica:
                mp_group = g
        self._extra = [g for g in (self.tp_group, mp_group) if g is not None]
        self.dp: DCGroups | None = None
        for stage in range(dims.pp):
            for tp_rank in range(dims.tp):
                ranks = dims.dp_ranks(stage, tp_rank)
                if (stage, tp_rank) == (c.stage, c.tp_rank):
                    self.dp = DCGroups(dims.dp_layout(stage, tp_rank), c.replica, backend=backend, world_ranks=ranks)
                else:
                    # Not ours, but every rank must take part in creating it.
                    make_groups(dims.dp_layout(stage, tp_rank), ranks, backend=backend)
        assert self.dp is not None and mp_group is not None
        tp_rank = c.tp_rank
        # A parameter sliced across TP ranks counts everywhere; a replicated one on TP rank 0 only.
        self.dp.mp_norm = ModelParallelNorm(
            mp_group, lambda name: tp_rank == 0 or tp_split(name) is not None
        )


    @property
    def is_last_stage(self) -> bool:
        return self.coords.stage == self.dims.pp - 1

    @property
    def reports_loss(self) -> bool:
        """One rank per replica adds its loss to the step's global loss: TP rank 0 of the last stage."""
        return self.is_last_stage and self.coords.tp_rank == 0

    def destroy(self) -> None:
        assert self.dp is not None
        self.dp.destroy()
        for g in self._extra:
            if g is not dist.group.WORLD:
                dist.destroy_process_group(g)
