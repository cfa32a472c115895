"""The messages of an elastic job's rendezvous, as both sides see them; torch-free.

A worker (:mod:`meridian.workers.elastic.rendezvous`) sends a :class:`JoinRequest` to the coordinator in the
job's runner actor (:mod:`meridian.service.runner.coordinator`), which answers with one of
:data:`JoinReply`: an :class:`Assignment` in a newer epoch, :class:`Waiting` (call again), or
:class:`Finished` (the job's last step is done). They travel as themselves — through the agent's pipe and
Ray, which pickle frozen dataclasses — so the message has one shape from the worker to the coordinator and
back.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any


@dataclass(frozen=True, kw_only=True)
class JoinRequest:
    """A worker asks to be placed in an epoch newer than the one it knows."""

    worker_id: str
    datacenter: str
    node_id: str
    address: str
    """IP reachable by the other workers (rank 0 of an epoch hosts the rendezvous store)."""
    port: int
    """Where this worker hosts the store if it becomes rank 0: the same for every poll of one join."""
    last_step: int = 0
    """Optimizer steps this worker has completed (its newest in-memory snapshot)."""
    snapshot_every: int = 1
    """The widest state-snapshot cadence this worker's epochs agreed so far (``TrainConfig.snapshot_adaptive``)."""
    probe_port: int = 0
    """Where this worker's agent listens for as long as its process lives (0: nowhere); the coordinator
    connects there to learn, without waiting for Ray, that a silent member is gone."""


def runs(values: Sequence[str]) -> tuple[tuple[str, int], ...]:
    """``values`` run-length encoded: each value and how many times it repeats in a row, in order."""
    out: list[tuple[str, int]] = []
    for v in values:
        if out and out[-1][0] == v:
            out[-1] = (v, out[-1][1] + 1)
        else:
            out.append((v, 1))
    return tuple(out)


def spans(ranks: Iterable[int]) -> tuple[tuple[int, int], ...]:
    """Sorted distinct ``ranks`` as half-open ``(start, stop)`` ranges of consecutive ranks."""
    out: list[tuple[int, int]] = []
    for r in sorted(set(ranks)):
        if out and out[-1][1] == r:
            out[-1] = (out[-1][0], r + 1)
        else:
            out.append((r, r + 1))
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class Assignment:
    """This worker's place in an epoch: its rank, the layout, where the store is, where training resumes.

    Its size does not grow with the world: the layout travels as runs of ranks (ranks are contiguous per
    datacenter, and a first epoch's newcomers are every rank), and :attr:`datacenters` and :attr:`newcomer_ranks`
    expand them where they are read. Every member's assignment of one epoch shares the same runs."""

    epoch: int
    rank: int
    world_size: int
    dc_runs: tuple[tuple[str, int], ...]
    """Each datacenter and how many consecutive ranks it holds, in rank order (:func:`runs` of the ranks' ones)."""
    master_addr: str
    master_port: int
    resume_step: int
    """Every member restores its snapshot of this step and trains from here."""
    from_checkpoint: bool
    """No member holds the state in memory: everyone loads the latest durable checkpoint."""
    newcomer_spans: tuple[tuple[int, int], ...]
    """Ranks without state, which receive it from the others, as ``(start, stop)`` ranges (:func:`spans`)."""
    snapshot_every: int = 1
    """The snapshot cadence every rank starts this epoch with: the widest any member had agreed (a re-formed
    epoch's snapshots cost about what the last one's did; an adaptive job widens it further as measured)."""
    suspend: bool = False
    """The job is being suspended (preempted): restore this epoch's state, write it as a durable checkpoint, tell
    the coordinator, and stop; the job resumes from that checkpoint when it is admitted again."""

    @classmethod
    def of(cls, *, datacenters: Sequence[str], newcomer_ranks: Iterable[int], **rest: Any) -> Assignment:
        """An assignment from each rank's datacenter and the newcomers' ranks, listed in full."""
        return cls(dc_runs=runs(datacenters), newcomer_spans=spans(newcomer_ranks), **rest)

    @cached_property
    def datacenters(self) -> tuple[str, ...]:
        """Each rank's datacenter, in rank order."""
        return tuple(dc for dc, n in self.dc_runs for _ in range(n))

    @cached_property
    def newcomer_ranks(self) -> tuple[int, ...]:
        """Ranks without state: they receive it from the others."""
        return tuple(r for start, stop in self.newcomer_spans for r in range(start, stop))

    @property
    def is_newcomer(self) -> bool:
        return any(start <= self.rank < stop for start, stop in self.newcomer_spans)

    def __getstate__(self) -> dict[str, Any]:
        # What travels is the fields: an expanded layout read on one side stays there.
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Waiting:
    """No epoch for this worker yet; it calls again, after ``retry_after_s``."""

    reason: str
    retry_after_s: float = 0.0
    """The coordinator did not hold this call open (as many calls as it holds already wait): pause this long
    before calling again, instead of calling back at once."""


@dataclass(frozen=True)
class Finished:
    """The job's last step is done: a worker still waiting to join has nothing to do."""


JoinReply = Assignment | Waiting | Finished
