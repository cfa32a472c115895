"""Who is where: the datacenter layout of the data-parallel ranks, and the process groups it implies.

:class:`DCLayout` is pure data (no torch.distributed) so the rank arithmetic is tested on its own: which
ranks share a datacenter, which shard of a bucket each rank owns inside its datacenter, and — for uneven
datacenters (2 + 1 after a node loss) — which ranks must all-reduce each piece of a bucket across
datacenters. :class:`DCGroups` builds the matching process groups; every rank builds every group in the
same order, as torch.distributed requires.

Sharding for any datacenter sizes: a bucket is padded to a multiple of L = lcm(sizes) and cut into L
units; local rank i of a datacenter with n ranks owns units [i·L/n, (i+1)·L/n). Cutting the bucket at the
union of all datacenters' shard boundaries gives *segments*; each segment has exactly one owner in every
datacenter, and those owners all-reduce it across datacenters. With equal sizes the segments are the
shards and the owner tuples are the familiar "same local rank in each DC" groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch.distributed as dist

from meridian.workers.distributed.groups import new_group
from meridian.workers.distributed.mp_norm import ModelParallelNorm


@dataclass(frozen=True)
class Segment:
    """Units ``[lo, hi)`` of a bucket cut into ``DCLayout.units`` units, and the world ranks owning it."""

    lo: int
    hi: int
    owners: tuple[int, ...]  # one world rank per datacenter, in DCLayout.dcs order


@dataclass(frozen=True)
class DCLayout:
    """Datacenter of every data-parallel rank, in world-rank order."""

    datacenters: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.datacenters:
            raise ValueError("a layout needs at least one rank")
        if any(not dc for dc in self.datacenters):
            raise ValueError(f"every rank needs a datacenter name, got {self.datacenters}")

    @property
    def world_size(self) -> int:
        return len(self.datacenters)

    @cached_property
    def dcs(self) -> tuple[str, ...]:
        """Distinct datacenters in order of first appearance."""
        return tuple(dict.fromkeys(self.datacenters))

    @property
    def num_dcs(self) -> int:
        return len(self.dcs)

    def ranks_in(self, dc: str) -> tuple[int, ...]:
        return tuple(r for r, d in enumerate(self.datacenters) if d == dc)

    def dc_of(self, rank: int) -> str:
        return self.datacenters[rank]

    def dc_size(self, rank: int) -> int:
        return len(self.ranks_in(self.dc_of(rank)))

    def dc_rank(self, rank: int) -> int:
        """Index of ``rank`` among the ranks of its datacenter."""
        return self.ranks_in(self.dc_of(rank)).index(rank)

    @cached_property
    def units(self) -> int:
        """L = lcm of the datacenter sizes: every bucket is padded to a multiple of L elements."""
        return math.lcm(*(len(self.ranks_in(dc)) for dc in self.dcs))

    def shard_units(self, rank: int) -> tuple[int, int]:
        """Units ``[lo, hi)`` of every bucket that ``rank`` owns inside its datacenter."""
        n, i = self.dc_size(rank), self.dc_rank(rank)
        per = self.units // n
        return i * per, (i + 1) * per

    @cached_property
    def segments(self) -> tuple[Segment, ...]:
        """The bucket cut at every datacenter's shard boundaries, with one owner per datacenter."""
        cuts = sorted({k * self.units // len(self.ranks_in(dc)) for dc in self.dcs for k in range(len(self.ranks_in(dc)) + 1)})
        out = []
        for lo, hi in zip(cuts, cuts[1:], strict=False):
            owners = tuple(self.ranks_in(dc)[lo * len(self.ranks_in(dc)) // self.units] for dc in self.dcs)
            out.append(Segment(lo, hi, owners))
        return tuple(out)



class DCGroups:
    """The process groups of one layout, as seen from one rank.

    ``intra_dc``: the ranks of this rank's datacenter. ``inter_dc[segment]``: the owners of each segment this
    rank takes part in (absent with a single datacenter). ``world``: every rank of the layout (flat sync,
    barriers). ``rank`` and segment owners are *layout* indices; ``world_ranks[i]`` is the torch.distributed
    rank of layout index ``i`` — the identity unless the layout is one data-parallel group among several
    (tensor/pipeline parallelism: :mod:`meridian.workers.parallel.dims`). ``mp_norm``, when set, makes
    the engines' gradient norm cover the other parts of the replica (:mod:`meridian.workers.distributed.mp_norm`).
    """

    def __init__(
        self, layout: DCLayout, rank: int, *, backend: str | None = None,
        world_ranks: tuple[int, ...] | None = None, segment_groups: bool = True,
    ) -> None:
        if world_ranks is None:
            if dist.get_world_size() != layout.world_size:
                raise ValueError(
                    f"layout has {layout.world_size} ranks but the process group has {dist.get_world_size()}"
                )
        elif len(world_ranks) != layout.world_size:
            raise ValueError(f"layout has {layout.world_size} ranks but world_ranks lists {len(world_ranks)}")
        self.layout = layout
        self.rank = rank
        self.world_ranks = world_ranks or tuple(range(layout.world_size))
        self.mp_norm: ModelParallelNorm | None = None
        self._owner_groups: list[dist.ProcessGroup] = []
        self.world, intra, inter = make_groups(layout, self.world_ranks, backend=backend, segments=segment_groups)
        self.intra_dc = intra[layout.dc_of(rank)]
        self.inter_dc: dict[Segment, dist.ProcessGroup] = {
            seg: group for seg, group in inter.items() if rank in seg.owners
        }

    @property
    def dc(self) -> str:
        return self.layout.dc_of(self.rank)

    @property
    def dc_rank(self) -> int:
        return self.layout.dc_rank(self.rank)

    @property
    def dc_size(self) -> int:
        return self.layout.dc_size(self.rank)

    @property
    def num_dcs(self) -> int:
        return self.layout.num_dcs

    @property
    def has_siblings(self) -> bool:
        """This layout is one data-parallel group among several (tensor/pipeline parallelism): the others' ranks
        make their own groups at the same time."""
        return self.world_ranks != tuple(range(dist.get_world_size()))

    def owner_groups(self, owner_tuples: list[tuple[int, ...]]) -> dict[tuple[int, ...], dist.ProcessGroup]:
        """Groups for the holder tuples an engine's inter-DC pieces name (:func:`make_owner_groups`), made now
        and destroyed with the others. Every rank of the layout calls it with the same tuples in the same order;
        with siblings every rank of the default group calls it (collective: the siblings' tuples differ, as their
        parameters do, and every rank makes every group)."""
        if self.has_siblings:
            return self._owner_groups_with_siblings(owner_tuples)
        made = make_owner_groups(owner_tuples, self.world_ranks)
        mine = {owners: g for owners, g in made.items() if self.rank in owners}
        self._owner_groups.extend(mine.values())
        return mine

    def _owner_groups_with_siblings(self, owner_tuples: list[tuple[int, ...]]) -> dict[tuple[int, ...], dist.ProcessGroup]:
        as_world = {tuple(self.world_ranks[r] for r in owners): owners for owners in owner_tuples}
        everyone: list[object] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, sorted(as_world))
        union = sorted({tuple(t) for part in everyone for t in part})  # type: ignore[union-attr]
        made = {t: new_group(list(t)) for t in union}
        mine = {as_world[t]: g for t, g in made.items() if t in as_world and self.rank in as_world[t]}
        self._owner_groups.extend(mine.values())
        return mine

    def destroy(self) -> None:
        """Destroy every group this rank made, in one order on every rank (NCCL needs the communicators of a
        node destroyed in the same order by all its processes: a set's order differs per process)."""
        ordered = [*self.inter_dc.values(), *self._owner_groups, self.intra_dc, self.world]
        seen: set[int] = set()
        for group in ordered:
            if group is None or group is dist.group.WORLD or id(group) in seen:
                continue
            seen.add(id(group))
            dist.destroy_process_group(group)
        self._owner_groups = []


def make_groups(
    layout: DCLayout, world_ranks: tuple[int, ...], *, backend: str | None = None, segments: bool = True
) -> tuple[dist.ProcessGroup, dict[str, dist.ProcessGroup], dict[Segment, dist.ProcessGroup]]:
    """(all ranks, per-DC, per-segment) groups of ``layout``; ``segments=False``: no per-segment groups (an
    engine whose inter-DC pieces are not the layout's segments makes its own, :func:`make_owner_groups`). Every
    rank of the default group must call this for every layout, in the same order, even for layouts it is not in
    (torch.distributed's rule)."""
    whole = world_ranks == tuple(range(dist.get_world_size()))
    world = dist.group.WORLD if whole else new_group(world_ranks, backend=backend)
    intra = {
        dc: new_group([world_ranks[r] for r in layout.ranks_in(dc)], backend=backend) for dc in layout.dcs
    }
    inter: dict[Segment, dist.ProcessGroup] = {}
    if layout.num_dcs > 1 and segments:
        for seg in layout.segments:
            inter[seg] = new_group([world_ranks[r] for r in seg.owners], backend=backend)
    return world, intra, inter


def make_owner_groups(
    owner_tuples: list[tuple[int, ...]], world_ranks: tuple[int, ...], *, backend: str | None = None
) -> dict[tuple[int, ...], dist.ProcessGroup]:
    """One group per tuple of layout ranks (one per datacenter) that sum a piece of a parameter together. Every
    rank of the default group calls this with the same tuples in the same order."""
    return {owners: new_group([world_ranks[r] for r in owners], backend=backend) for owners in owner_tuples}
