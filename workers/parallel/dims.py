"""Who holds which part of the model: tensor-parallel, pipeline and data-parallel coordinates of every rank.

:class:`ParallelDims` is pure data (no torch.distributed), checked once, in the spirit of torchtitan's
``ParallelDims``: world ranks are ordered (pipeline stage, data-parallel replica, tensor-parallel rank) with
the tensor-parallel rank fastest — the order the planner places ranks in — so a TP group is consecutive
ranks on one node, and a replica's stages may sit in different datacenters. Replicas are numbered in
datacenter order, so the layout reads pp × dc × dp × tp, outermost first.

:class:`ParallelGroups` builds the process groups one rank needs: its TP group, its pipeline group (the
stages of its replica with its TP rank, whose boundaries exchange activations), its *model-parallel* group
(every rank of its replica, for the gradient norm), the :class:`DCGroups` of its *data-parallel* group —
the ranks holding the same (stage, TP rank) coordinates in every replica, which FSDP2 shards over inside a
datacenter and the hierarchical sync sums across datacenters — and the device meshes FSDP2 and DTensor run
on: ``dp`` (this datacenter's replicas) and ``tp``, two dimensions of one mesh.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meridian.workers.distributed.groups import new_group
from meridian.workers.distributed.layout import DCGroups, DCLayout, make_groups
from meridian.workers.distributed.mp_norm import ModelParallelNorm
from meridian.workers.parallel.fsdp import dc_mesh


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

    def stage_ranks(self, replica: int, tp_rank: int) -> tuple[int, ...]:
        """The ranks of every pipeline stage of ``replica`` with TP rank ``tp_rank``, in stage order."""
        return tuple(self.rank_of(s, replica, tp_rank) for s in range(self.pp))


class ParallelGroups:
    """The process groups and device meshes of one rank. Every rank builds every group in the same order (torch's
    rule), the groups of the (stage, TP rank) positions it is not in included."""

    def __init__(self, dims: ParallelDims, rank: int, *, device: torch.device, backend: str | None = None) -> None:
        if dist.get_world_size() != dims.world_size:
            raise ValueError(f"layout has {dims.world_size} ranks but the process group has {dist.get_world_size()}")
        self.dims = dims
        self.rank = rank
        self.coords = c = dims.coords(rank)
        # 1) tensor parallelism: the ranks of one (stage, replica), on one node
        self.tp_group: dist.ProcessGroup | None = None
        for stage in range(dims.pp):
            for replica in range(dims.dp):
                g = new_group(dims.tp_ranks(stage, replica), backend=backend) if dims.tp_enabled else None
                if (stage, replica) == (c.stage, c.replica):
                    self.tp_group = g
        # 2) pipeline parallelism: the stages of one (replica, TP rank), in stage order
        self.pp_group: dist.ProcessGroup | None = None
        for replica in range(dims.dp):
            for tp_rank in range(dims.tp):
                g = new_group(dims.stage_ranks(replica, tp_rank), backend=backend) if dims.pp > 1 else None
                if (replica, tp_rank) == (c.replica, c.tp_rank):
                    self.pp_group = g
        # 3) the whole replica (the gradient norm's last sum), one rank per (stage, TP rank)
        mp_group = None
        for replica in range(dims.dp):
            g = new_group(dims.replica_ranks(replica), backend=backend)
            if replica == c.replica:
                mp_group = g
        assert mp_group is not None
        self._extra = [g for g in (self.tp_group, self.pp_group, mp_group) if g is not None]
        # 4) data parallelism: the ranks holding the same (stage, TP rank) in every replica, by datacenter
        self.dp: DCGroups | None = None
        for stage in range(dims.pp):
            for tp_rank in range(dims.tp):
                ranks = dims.dp_ranks(stage, tp_rank)
                if (stage, tp_rank) == (c.stage, c.tp_rank):
                    self.dp = DCGroups(dims.dp_layout(stage, tp_rank), c.replica, backend=backend, world_ranks=ranks,
                                       segment_groups=False)  # fmt: skip
                else:  # not ours, but every rank must take part in creating it
                    make_groups(dims.dp_layout(stage, tp_rank), ranks, backend=backend, segments=False)
        assert self.dp is not None
        self.dp.mp_norm = ModelParallelNorm(mp_group, tp_rank=c.tp_rank)
        # 5) meshes: FSDP2 over this datacenter's replicas, tensor parallelism over the TP ranks (one 2-D mesh, as
        # FSDP2 and DTensor compose only on the dimensions of one mesh)
        self.tp_mesh: DeviceMesh | None = None
        if dims.tp_enabled:
            assert self.tp_group is not None
            replicas = self.dp.layout.ranks_in(self.dp.dc)  # this datacenter's replicas, in order
            mesh = torch.tensor([list(dims.tp_ranks(c.stage, d)) for d in replicas])
            both = DeviceMesh.from_group([self.dp.intra_dc, self.tp_group], device.type, mesh=mesh,
                                         mesh_dim_names=("dp", "tp"))  # fmt: skip
            self.dp_mesh, self.tp_mesh = both["dp"], both["tp"]
        else:
            self.dp_mesh = dc_mesh(self.dp.intra_dc, device)

    def destroy(self) -> None:
        assert self.dp is not None
        self.dp.destroy()
        for g in self._extra:
            if g is not dist.group.WORLD:
                dist.destroy_process_group(g)
