"""Who sends what to whom when a re-formed epoch rebuilds its state from the survivors' snapshots.

Every rank of a data-parallel epoch needs the whole model's values (it holds a replica) and the optimizer state
of the ranges it owns in the *new* layout; every survivor holds its snapshot of the old layout (values and
moments of its old ranges). A rank takes what it holds itself, and each missing range from one holder —
one in its own datacenter where there is one, else the least-loaded holder elsewhere — so the inter-DC link
carries only what no peer in the DC holds, and nothing is sent twice to one rank. (Gathering every shard on
every rank moved the job's whole state to every rank once per datacenter: ~24 GB per rank for a 1B model in
two datacenters.)

:func:`plan_exchange` is pure and deterministic: every rank computes the same plan from the same offers, so
the transfers (:mod:`meridian.workers.elastic.state_exchange`) need no further agreement.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from meridian.workers.state.replica_state import IncompleteState

Range = tuple[str, int, int]
"""``(parameter, start, stop)``: elements ``[start, stop)`` of the flattened parameter."""


@dataclass(frozen=True)
class Offer:
    """What one rank tells every other before the state moves."""

    dc: str
    held: dict[str, Any] | None
    """:func:`~meridian.workers.state.replica_state.pack`'s description of the snapshot this rank holds of the
    step the epoch resumes from (no numbers); ``None``: it holds none (a newcomer)."""
    needs: list[Range] | None
    """The optimizer-state ranges this rank owns in the new epoch; ``None``: all of it (a replicated
    optimizer). Every rank needs every parameter's values."""


@dataclass(frozen=True)
class Move:
    """One contiguous range sent from one rank to another: the values, then each named moment."""

    name: str
    start: int
    stop: int
    moments: tuple[str, ...]
    need: int
    """Index of the receiver's need range the moments belong to; -1 for values only."""

    @property
    def numel(self) -> int:
        return (self.stop - self.start) * (1 + len(self.moments))


@dataclass(frozen=True)
class ExchangePlan:
    step: int
    adam_step: int
    dcs: tuple[str, ...]
    needs: tuple[tuple[Range, ...], ...]
    """Every rank's need ranges, resolved (``None`` replaced by whole parameters)."""
    rounds: tuple[dict[tuple[int, int], tuple[Move, ...]], ...]
    """Per round, ``(source, receiver)`` → the moves between them, in the order the message holds them. Round
    one: what each datacenter lacks, once across to one of its ranks, and everything a rank takes from a holder of
    the snapshots (its own pieces as ``(r, r)``); round two (empty when nothing was fetched for more than one
    rank): the fetched ranges, relayed inside the datacenter."""

    def numel(self, src: int, dst: int, round_: int) -> int:
        return sum(m.numel for m in self.rounds[round_].get((src, dst), ()))

    def sent_bytes(self, *, cross_dc_only: bool = False) -> int:
        """fp32 bytes that cross between ranks (a rank's own pieces excluded)."""
        return sum(4 * sum(m.numel for m in moves) for moves_of in self.rounds for (s, d), moves in moves_of.items()
                   if s != d and (not cross_dc_only or self.dcs[s] != self.dcs[d]))  # fmt: skip


@dataclass(frozen=True)
class _Held:
    rank: int
    start: int
    stop: int
    moments: tuple[str, ...]
    fetched: bool = False
    """Arrives in round one (what its datacenter lacked): relayed from it in round two."""

    def covers(self, a: int, b: int) -> bool:
        return self.start <= a and b <= self.stop


def plan_exchange(offers: list[Offer], numels: dict[str, int]) -> ExchangePlan:
    """The moves that give every rank the values of every parameter in ``numels`` and the moments of its need
    ranges. What no rank of a datacenter holds crosses to it once, to the rank that will own its optimizer state
    there, and is relayed inside the datacenter from that rank. Raises :class:`IncompleteState` naming the first
    element no offer holds (every rank raises the same: the caller falls back to the durable checkpoint)."""
    held = [o.held for o in offers if o.held is not None]
    if not held:
        raise IncompleteState("no rank holds a snapshot of the state")
    if any(h.get("outer") is not None for h in held):
        raise ValueError("DiLoCo snapshots are pooled whole: their inner state must come from one datacenter")
    steps = {h["step"] for h in held}
    if len(steps) != 1:
        raise ValueError(f"snapshots of different steps {sorted(steps)} cannot be pooled")
    adam_step = max(h["adam_step"] for h in held)
    holders: dict[str, list[_Held]] = defaultdict(list)
    for rank, o in enumerate(offers):
        for name, start, stop, moments in (o.held or {}).get("pieces", ()):
            if name not in numels:
                raise ValueError(f"snapshot holds parameter {name!r} that the model does not have")
            holders[name].append(_Held(rank, start, stop, tuple(moments)))
    dcs = tuple(o.dc for o in offers)
    needs = tuple(tuple(o.needs) if o.needs is not None else tuple((n, 0, k) for n, k in numels.items())
                  for o in offers)  # fmt: skip
    plan = _Planner(dcs, needs, adam_step)
    for name, numel in numels.items():
        cuts = {0, numel}
        for h in holders[name]:
            cuts.update((h.start, h.stop))
        for by_name in plan.needs_of:
            cuts.update(x for _, a, b in by_name.get(name, ()) for x in (a, b))
        bounds = sorted(c for c in cuts if 0 <= c <= numel)
        segments = list(zip(bounds, bounds[1:], strict=False))
        fetched = [plan.fetch(name, a, b, holders[name], dc) for dc in dict.fromkeys(dcs) for a, b in segments]
        everyone = holders[name] + [h for h in fetched if h is not None]
        for dst in range(len(offers)):
            for a, b in segments:
                plan.take(name, a, b, everyone, dst)
    return ExchangePlan(steps.pop(), adam_step, dcs, needs, plan.rounds())


class _Planner:
    def __init__(self, dcs: tuple[str, ...], needs: tuple[tuple[Range, ...], ...], adam_step: int) -> None:
        self.dcs, self.adam_step = dcs, adam_step
        self.load = [0] * len(dcs)
        """Elements each rank sends, so far: a range goes to the least-loaded holder."""
        self.landed = [0] * len(dcs)
        """Elements fetched into each rank, so far: what nobody owns yet goes to the least-landed member."""
        self.moves: list[dict[tuple[int, int], list[Move]]] = [defaultdict(list), defaultdict(list)]
        self.needs_of: list[dict[str, list[tuple[int, int, int]]]] = []
        """Per rank, parameter → ``(index, start, stop)`` of its need ranges."""
        for rank_needs in needs:
            by_name: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
            for i, (n, lo, hi) in enumerate(rank_needs):
                by_name[n].append((i, lo, hi))
            self.needs_of.append(by_name)

    def need(self, rank: int, name: str, a: int, b: int) -> int:
        """Index of ``rank``'s need range holding ``[a, b)``; -1 when it needs only the values (or there are no
        moments yet: before the first optimizer step)."""
        if not self.adam_step:
            return -1
        return next((i for i, lo, hi in self.needs_of[rank].get(name, ()) if lo <= a and b <= hi), -1)

    def fetch(self, name: str, a: int, b: int, holders: list[_Held], dc: str) -> _Held | None:
        """Round one: ``[a, b)`` into ``dc`` when none of its ranks holds it: to the rank that owns its optimizer
        state there (else the one that got least so far), from a holder elsewhere. ``None``: the datacenter holds it."""
        if any(self.dcs[h.rank] == dc and h.covers(a, b) for h in holders):
            return None
        members = [r for r, d in enumerate(self.dcs) if d == dc]
        owner = next((r for r in members if self.need(r, name, a, b) >= 0), None)
        dst = owner if owner is not None else min(members, key=lambda r: (self.landed[r], r))
        need = self.need(dst, name, a, b)
        src, moments = self._source(name, a, b, holders, dst, need)
        move = Move(name, a, b, moments, need)
        self.landed[dst] += move.numel
        self._add(0, src, dst, move)
        return _Held(dst, a, b, moments, fetched=True)

    def take(self, name: str, a: int, b: int, holders: list[_Held], dst: int) -> None:
        """``[a, b)`` for ``dst``: from its own snapshot, else from a holder in its datacenter (round two when
        that holder fetched it in round one), else from anywhere."""
        need = self.need(dst, name, a, b)
        covering = [h for h in holders if h.covers(a, b) and (need < 0 or h.moments)]
        if any(h.rank == dst and h.fetched for h in covering):
            return  # it arrives in round one
        src, moments = self._source(name, a, b, holders, dst, need)
        fetched = any(h.rank == src and h.fetched for h in covering) and not any(
            h.rank == src and not h.fetched for h in covering)  # fmt: skip
        self._add(1 if fetched else 0, src, dst, Move(name, a, b, moments, need))

    def _source(self, name: str, a: int, b: int, holders: list[_Held], dst: int, need: int) -> tuple[int, tuple[str, ...]]:
        can = [h for h in holders if h.covers(a, b) and (need < 0 or h.moments)]
        if not can:
            what = "element" if need < 0 or not any(h.covers(a, b) for h in holders) else \
                "optimizer state of element"
            raise IncompleteState(f"no surviving rank holds {what} {a} of parameter {name!r}")
        ranks = sorted({h.rank for h in can})
        if dst in ranks:
            src = dst
        else:  # a holder in its datacenter; else any; the least loaded so far (then the lowest rank)
            near = [r for r in ranks if self.dcs[r] == self.dcs[dst]] or ranks
            src = min(near, key=lambda r: (self.load[r], r))
        return src, (next(h.moments for h in can if h.rank == src) if need >= 0 else ())

    def _add(self, round_: int, src: int, dst: int, move: Move) -> None:
        if src != dst:
            self.load[src] += move.numel
        pair = self.moves[round_][(src, dst)]
        last = pair[-1] if pair else None
        if last and (last.name, last.stop, last.moments, last.need) == (move.name, move.start, move.moments, move.need):
            pair[-1] = Move(move.name, last.start, move.stop, move.moments, move.need)
        else:
            pair.append(move)

    def rounds(self) -> tuple[dict[tuple[int, int], tuple[Move, ...]], ...]:
        done = tuple({k: tuple(v) for k, v in r.items()} for r in self.moves)
        return done if done[1] else done[:1]
