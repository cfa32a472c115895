"""A re-formed epoch's state, rebuilt from the survivors' snapshots over the epoch's default process group.

Two rounds. Every rank all-gathers every rank's :class:`~meridian.workers.state.exchange_plan.Offer` (what it
holds, what it will own) in one fixed-size buffer; then each computes the same plan
(:func:`~meridian.workers.state.exchange_plan.plan_exchange`) and the ranks send each other exactly the planned
ranges, point to point, all at once. A rank's own snapshot never moves; a range it lacks comes once, from a peer
in its own datacenter where one holds it. DiLoCo's snapshots are pooled whole instead (their inner state must
come from one datacenter: :func:`~meridian.workers.state.replica_state.assemble`), in one all-gather of every
rank's packed shard.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from meridian.workers.elastic.durable import load_weights
from meridian.workers.state.exchange_plan import ExchangePlan, Move, Offer, Range, plan_exchange
from meridian.workers.state.replica_state import LocalShard, StatePiece, assemble, unpack
from meridian.workers.sync.engine import GradientSync

INLINE_OFFER_BYTES = 16 * 1024
"""Room for one rank's pickled offer in the first all-gather (measured: 1.9 KB for nano's 29 parameters, 3.5 KB
for tiny's 53; it grows with the parameters a rank holds pieces of). Offers that do not fit go in a second
all-gather sized to the largest."""

Packed = tuple[dict[str, Any], torch.Tensor]


@dataclass
class RebuiltState:
    """What this rank loads: every parameter's fp32 values and its own ranges' optimizer state (the targeted
    exchange), or the whole pooled state (DiLoCo)."""

    weights: dict[str, torch.Tensor]
    owned: LocalShard | None = None
    optimizer: dict[str, Any] | None = None
    sent_bytes: int = 0
    """fp32 bytes the whole exchange sent between ranks, every rank's sends (the plan's: the same figure on every
    rank; each receive is sized by it, so a message of another size fails the exchange)."""
    cross_dc_bytes: int = 0
    """Of those, between datacenters."""
    received: dict[int, int] = field(default_factory=dict)
    """Bytes that arrived at this rank, by sender."""

    def load(self, model: torch.nn.Module, engine: GradientSync) -> None:
        if self.owned is None:
            assert self.optimizer is not None
            load_weights(model, engine, self.weights)
            engine.load_optimizer_state(self.optimizer)
        elif engine.owned_ranges() is None:  # a replicated optimizer: its whole state, in the layout-free form
            shapes = {n: p.shape for n, p in model.named_parameters()}
            params, optimizer = assemble([self.owned], shapes)
            load_weights(model, engine, params)
            engine.load_optimizer_state(optimizer)
        else:
            load_weights(model, engine, self.weights)
            engine.load_local_shard(self.owned)


def rebuild_state(mine: Packed | None, *, dc: str, needs: list[Range] | None,
                  shapes: dict[str, torch.Size], inline_bytes: int = INLINE_OFFER_BYTES) -> RebuiltState:  # fmt: skip
    """This rank's state for the epoch, from every rank's snapshot of the step it resumes (``mine``: this rank's,
    packed as its snapshot file holds it; ``None`` for a newcomer). ``needs``: the engine's
    :meth:`~meridian.workers.sync.engine.GradientSync.owned_ranges`. Every rank of the default group calls it;
    all raise :class:`~meridian.workers.state.replica_state.IncompleteState` alike when the snapshots do not
    cover the state."""
    offers = share_offers(Offer(dc, None if mine is None else mine[0], needs), inline_bytes)
    if any(o.held is not None and o.held.get("outer") is not None for o in offers):
        shards = gather_shards(mine, [o.held for o in offers])
        params, optimizer = assemble([s for s in shards if s is not None], shapes)
        # every rank's buffer, padded to the longest shard, reaches every other rank
        each = 4 * max(o.held["numel"] for o in offers if o.held is not None)
        pairs = [(a.dc, b.dc) for i, a in enumerate(offers) for j, b in enumerate(offers) if i != j]
        received = {r: each for r in range(len(offers)) if r != dist.get_rank()}
        return RebuiltState(params, optimizer=optimizer, sent_bytes=each * len(pairs),
                            cross_dc_bytes=each * sum(a != b for a, b in pairs), received=received)  # fmt: skip
    plan = plan_exchange(offers, {n: s.numel() for n, s in shapes.items()})
    return _transfer(plan, dist.get_rank(), mine, shapes)


def share_offers(offer: Offer, inline_bytes: int = INLINE_OFFER_BYTES) -> list[Offer]:
    """Every rank's offer, on every rank: one all-gather of ``inline_bytes`` per rank, a second only when
    some offer does not fit (every rank sees whose, from the first)."""
    blob = pickle.dumps(offer)
    box = torch.zeros(8 + inline_bytes, dtype=torch.uint8)
    box[:8].view(torch.int64)[0] = len(blob)
    if len(blob) <= inline_bytes:
        box[8 : 8 + len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    boxes = [torch.empty_like(box) for _ in range(dist.get_world_size())]
    dist.all_gather(boxes, box)
    sizes = [int(b[:8].view(torch.int64)[0]) for b in boxes]
    if max(sizes) > inline_bytes:
        big = torch.zeros(max(sizes), dtype=torch.uint8)
        if len(blob) > inline_bytes:
            big[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        bigs = [torch.empty_like(big) for _ in boxes]
        dist.all_gather(bigs, big)
        boxes = [bg if n > inline_bytes else bx[8:] for bg, bx, n in zip(bigs, boxes, sizes, strict=True)]
    else:
        boxes = [b[8:] for b in boxes]
    return [pickle.loads(b[:n].numpy().tobytes()) for b, n in zip(boxes, sizes, strict=True)]


def gather_shards(mine: Packed | None, held: list[dict[str, Any] | None]) -> list[LocalShard | None]:
    """Every rank's whole shard on every rank (``held``: every rank's description, from the offers), in one
    all-gather of the packed numbers padded to the longest."""
    longest = max((h["numel"] for h in held if h is not None), default=0)
    flat = torch.zeros(longest)
    if mine is not None:
        flat[: mine[1].numel()] = mine[1]
    everyone = [torch.empty_like(flat) for _ in held]
    dist.all_gather(everyone, flat)
    return [None if h is None else unpack(h, got) for h, got in zip(held, everyone, strict=True)]


def _transfer(plan: ExchangePlan, rank: int, mine: Packed | None, shapes: dict[str, torch.Size]) -> RebuiltState:
    """Send and receive this rank's planned moves, round by round, each round's all at once."""
    got = _Landing(shapes, plan.needs[rank])
    held = _Pieces.of_snapshot(mine)
    received: dict[int, int] = {}
    for round_, moves in enumerate(plan.rounds):
        inbound = {src: torch.empty(plan.numel(src, rank, round_)) for src in range(len(plan.dcs))
                   if src != rank and plan.numel(src, rank, round_)}  # fmt: skip
        works = [dist.irecv(buf, src) for src, buf in inbound.items()]
        works += [dist.isend(held.message(m), dst) for (src, dst), m in moves.items() if src == rank != dst]
        for m in moves.get((rank, rank), ()):  # its own pieces: copied straight from the snapshot
            for part in (None, *m.moments):
                for start, view in held.parts(m, part):
                    got.range_of(m, part)[start - m.start : start - m.start + view.numel()] = view
        for w in works:
            w.wait()
        for src, buf in inbound.items():
            got.unpack(buf, moves[(src, rank)])
            received[src] = received.get(src, 0) + buf.numel() * buf.element_size()
            held.add(got, moves[(src, rank)])  # what it relays in the next round
    pieces = tuple(StatePiece(n, a, b, got.weights[n][a:b], got.moments[i]) for i, (n, a, b) in enumerate(got.needs))
    return RebuiltState({n: w.view(shapes[n]) for n, w in got.weights.items()},
                        owned=LocalShard(plan.step, plan.adam_step, pieces),
                        sent_bytes=plan.sent_bytes(), cross_dc_bytes=plan.sent_bytes(cross_dc_only=True),
                        received=received)  # fmt: skip


class _Landing:
    """Where this rank's state lands: every parameter's values, and the moments of each of its need ranges."""

    def __init__(self, shapes: dict[str, torch.Size], needs: tuple[Range, ...]) -> None:
        self.weights = {n: torch.empty(s.numel()) for n, s in shapes.items()}
        self.needs = needs
        self.moments: list[dict[str, torch.Tensor]] = [{} for _ in needs]

    def range_of(self, m: Move, part: str | None) -> torch.Tensor:
        """The elements ``m`` names: of the values (``part`` None) or of moment ``part``."""
        if part is None:
            return self.weights[m.name][m.start : m.stop]
        _, lo, hi = self.needs[m.need]
        into = self.moments[m.need].setdefault(part, torch.empty(hi - lo))
        return into[m.start - lo : m.stop - lo]

    def unpack(self, buf: torch.Tensor, moves: tuple[Move, ...]) -> None:
        at = 0
        for m in moves:
            for part in (None, *m.moments):
                self.range_of(m, part).copy_(buf[at : at + m.stop - m.start])
                at += m.stop - m.start


class _Pieces:
    """What this rank can send: views of its packed snapshot, then of what landed for it in round one."""

    def __init__(self) -> None:
        self.by_name: dict[str, list[tuple[int, int, dict[str | None, torch.Tensor]]]] = {}
        """parameter → ``(start, stop, {None: values, moment: moment})``, by ``start``."""

    @classmethod
    def of_snapshot(cls, mine: Packed | None) -> _Pieces:
        pieces = cls()
        for p in unpack(*mine).pieces if mine is not None else ():  # views of the packed numbers: no copy
            pieces.by_name.setdefault(p.name, []).append((p.start, p.stop, {None: p.value, **p.moments}))
        for held in pieces.by_name.values():
            held.sort(key=lambda p: p[0])
        return pieces

    def add(self, got: _Landing, moves: tuple[Move, ...]) -> None:
        for m in moves:
            fields = {part: got.range_of(m, part) for part in (None, *m.moments)}
            self.by_name.setdefault(m.name, []).append((m.start, m.stop, fields))
            self.by_name[m.name].sort(key=lambda p: p[0])

    def parts(self, m: Move, part: str | None) -> list[tuple[int, torch.Tensor]]:
        """``(first element, view)`` of each held stretch that together make up ``m``'s range of ``part``."""
        out, at = [], m.start
        for start, stop, fields in self.by_name.get(m.name, ()):
            if start <= at < stop and part in fields:
                upto = min(stop, m.stop)
                out.append((at, fields[part][at - start : upto - start]))
                at = upto
        if at != m.stop:
            raise RuntimeError(f"the plan sends {m.name}[{m.start}:{m.stop}] ({part or 'values'}) from a rank that "
                               f"holds it only up to {at}")
        return out

    def message(self, moves: tuple[Move, ...]) -> torch.Tensor:
        """The ranges ``moves`` name, in one flat tensor: each move's values, then its moments."""
        out = [view for m in moves for part in (None, *m.moments) for _, view in self.parts(m, part)]
        return torch.cat(out) if out else torch.zeros(0)
