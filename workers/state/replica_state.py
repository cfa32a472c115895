"""A rank's share of the training state, kept in memory after every step, and the whole state rebuilt from
the shares the survivors of a failure still hold.

With the partial distributed optimizer each rank owns 1/N of its DC's parameters and AdamW moments, and
every DC owns all of them: a whole replica of the state lives in every datacenter. After a step each rank
copies what it owns (parameter values — the fp32 master where there is one — and the moments) into a
:class:`LocalShard`; that is a memcpy of ~(1 + 2)/N of the model, taken *before* the parameter all-gather
so it never waits for communication. When a node dies, the survivors of the next epoch rebuild the state
from their shards of the step they all completed (each rank only what it lacks:
:mod:`meridian.workers.state.exchange_plan`; DiLoCo's pooled whole by :func:`assemble`); if one DC is still
whole, or the losses in different DCs own different elements, every element is covered and no step is lost. If
not, the caller falls back to the durable checkpoint.

The pooled state is in the same layout-free form as checkpoints (:mod:`meridian.workers.optim.adamw`), so the
new epoch may have any world size and any DC sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from meridian.workers.optim.adamw import FULL_STATE_FORMAT, MOMENTS

DILOCO_STATE_FORMAT = "meridian.diloco.outer/1"


class IncompleteState(RuntimeError):
    """The shards offered do not cover every parameter element."""


@dataclass(frozen=True)
class StatePiece:
    name: str
    """Parameter name."""
    start: int
    stop: int
    """Elements ``[start, stop)`` of the flattened parameter."""
    value: torch.Tensor
    """Parameter values of those elements (fp32)."""
    moments: dict[str, torch.Tensor] = field(default_factory=dict)
    """AdamW ``exp_avg``/``exp_avg_sq`` of those elements; empty before the first optimizer step."""


@dataclass(frozen=True)
class OuterShard:
    """What a DiLoCo rank owns of the *outer* state (:mod:`meridian.workers.sync.diloco`): identical in every DC,
    while the inner state (``LocalShard.pieces``) is its own DC's and differs between DCs."""

    dc: str
    """The datacenter whose inner state the enclosing shard's pieces are."""
    inner_steps_done: int
    """Inner steps since the start of training: the fragment schedule's position."""
    pieces: tuple[StatePiece, ...]
    """Outer parameters (the last synced values, ``value``) and outer momentum (``moments["momentum"]``)."""


@dataclass(frozen=True)
class FeedbackShard:
    """The error-feedback residuals of a compressed inter-DC sync that one rank holds
    (:mod:`meridian.workers.sync.compression`): per element, what its datacenter's contribution to the sum
    has not yet put on the wire. Unlike the parameters and moments, which every datacenter holds alike, each
    datacenter carries its own rounding error, so these are its own and are stored per datacenter."""

    dc: str
    compression: str
    """The encoding that left them (``Compression`` value): another encoding's residuals are not carried over."""
    pieces: tuple[StatePiece, ...]
    """Residuals of those elements in ``value`` (fp32); no moments."""


def _pieces_nbytes(pieces: tuple[StatePiece, ...]) -> int:
    return sum(
        p.value.numel() * p.value.element_size() + sum(m.numel() * m.element_size() for m in p.moments.values())
        for p in pieces
    )


@dataclass(frozen=True)
class LocalShard:
    step: int
    """Training steps completed when the shard was taken."""
    adam_step: int
    """AdamW's own step counter (bias correction)."""
    pieces: tuple[StatePiece, ...]
    outer: OuterShard | None = None
    """DiLoCo's outer state, for the DiLoCo engines only."""
    feedback: tuple[FeedbackShard, ...] = ()
    """Error-feedback residuals of a compressed inter-DC sync: the rank's own DC's in what an engine takes;
    every stored DC's in what a checkpoint read returns (the engine keeps its DC's). Durable checkpoints carry
    them, and so does :func:`pack` (in-memory snapshots, the survivors' state exchange) where the engine's
    snapshots hold them (DiLoCo's outer deltas), so a re-formation from memory keeps the residuals of every
    datacenter whose ranks all survived."""

    @property
    def nbytes(self) -> int:
        return (_pieces_nbytes(self.pieces) + (_pieces_nbytes(self.outer.pieces) if self.outer else 0)
                + sum(_pieces_nbytes(f.pieces) for f in self.feedback))


def pack(shard: LocalShard) -> tuple[dict[str, Any], torch.Tensor]:
    """``shard`` as a small description and one flat fp32 tensor holding every value and moment in it, in
    order: the form in which the survivors of a failure exchange their shards (one tensor collective; pickled
    piece by piece with ``all_gather_object``, 3 ranks' nano shards took 35-60 ms to exchange cold on two cores,
    packed 22-30). :func:`unpack` inverts it."""
    desc, tensors = pack_parts(shard)
    return desc, torch.cat(tensors) if tensors else torch.zeros(0)


def pack_parts(shard: LocalShard) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """:func:`pack`'s description and the flat fp32 tensors whose concatenation is its flat tensor, in order
    (what a snapshot file writes one after another, with no concatenated copy)."""
    tensors: list[torch.Tensor] = []

    def describe(pieces: tuple[StatePiece, ...]) -> list[tuple[str, int, int, tuple[str, ...]]]:
        for p in pieces:
            tensors.append(p.value.reshape(-1))
            tensors.extend(p.moments[m].reshape(-1) for m in p.moments)
        return [(p.name, p.start, p.stop, tuple(p.moments)) for p in pieces]

    desc: dict[str, Any] = {"step": shard.step, "adam_step": shard.adam_step, "pieces": describe(shard.pieces),
                            "outer": None}  # fmt: skip
    if shard.outer is not None:
        desc["outer"] = {"dc": shard.outer.dc, "inner_steps_done": shard.outer.inner_steps_done,
                         "pieces": describe(shard.outer.pieces)}  # fmt: skip
    if shard.feedback:
        desc["feedback"] = [{"dc": f.dc, "compression": f.compression, "pieces": describe(f.pieces)}
                            for f in shard.feedback]  # fmt: skip
    tensors = [t.float() for t in tensors]
    desc["numel"] = sum(t.numel() for t in tensors)
    return desc, tensors


def unpack(desc: dict[str, Any], flat: torch.Tensor) -> LocalShard:
    """The shard :func:`pack` described, its tensors views of ``flat`` (which may be longer: padding)."""
    at = 0

    def take(n: int) -> torch.Tensor:
        nonlocal at
        at += n
        return flat[at - n : at]

    def pieces(described: list[tuple[str, int, int, tuple[str, ...]]]) -> tuple[StatePiece, ...]:
        out = []
        for name, start, stop, moments in described:
            value = take(stop - start)
            out.append(StatePiece(name, start, stop, value, {m: take(stop - start) for m in moments}))
        return tuple(out)

    own = pieces(desc["pieces"])
    outer = desc["outer"]
    outer_shard = None if outer is None else OuterShard(outer["dc"], outer["inner_steps_done"], pieces(outer["pieces"]))
    feedback = tuple(FeedbackShard(f["dc"], f["compression"], pieces(f["pieces"])) for f in desc.get("feedback", ()))
    return LocalShard(desc["step"], desc["adam_step"], own, outer_shard, feedback)


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A flat fp32 CPU copy of ``t``. From a GPU it lands in pinned memory without blocking the host: the
    copy is queued on the current stream, so whoever reads it must wait for that stream first (the snapshot
    store waits on an event recorded after the shard, on its writer thread). On CPU a plain copy, as ever."""
    flat = t.detach().reshape(-1)
    if flat.device.type != "cuda":
        return flat.float().cpu().clone()
    out = torch.empty(flat.numel(), dtype=torch.float32, pin_memory=True)
    return out.copy_(flat.float(), non_blocking=True)


def piece_of(
    name: str, start: int, stop: int, value: torch.Tensor, state: dict[str, Any] | None
) -> StatePiece:
    """Copy one owned range (``value`` and the optimizer ``state`` of exactly those elements) to the CPU."""
    moments = {m: host_copy(state[m]) for m in MOMENTS} if state else {}
    return StatePiece(name, start, stop, host_copy(value), moments)


def cut(pieces: tuple[StatePiece, ...], name: str, start: int, stop: int) -> StatePiece:
    """Elements ``[start, stop)`` of parameter ``name`` (values and moments), from the piece that holds them."""
    for p in pieces:
        if p.name == name and p.start <= start and stop <= p.stop:
            a, b = start - p.start, stop - p.start
            return StatePiece(name, start, stop, p.value[a:b], {m: t[a:b] for m, t in p.moments.items()})
    raise ValueError(f"no piece holds elements {start}..{stop} of parameter {name!r}")


def replicated_shard(
    optimizer: torch.optim.Optimizer, named: list[tuple[str, torch.Tensor]], step: int
) -> LocalShard:
    """The shard of an engine that holds everything (DDP, replicated AdamW): every parameter, whole."""
    pieces, adam_step = [], 0
    for name, p in named:
        state = optimizer.state.get(p)
        if state:
            adam_step = int(state["step"])
        pieces.append(piece_of(name, 0, p.numel(), p, state))
    return LocalShard(step, adam_step, tuple(pieces))


def assemble(
    shards: list[LocalShard], shapes: dict[str, torch.Size]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Pool ``shards`` (all of one step) into whole parameters and a full optimizer state.

    Raises :class:`IncompleteState` naming the first element nobody holds."""
    if not shards:
        raise IncompleteState("no rank holds a snapshot of the state")
    steps = {s.step for s in shards}
    if len(steps) != 1:
        raise ValueError(f"shards of different steps {sorted(steps)} cannot be pooled")
    params, optimizer = _assemble_diloco(shards, shapes) if any(s.outer is not None for s in shards) \
        else _pool(shards, shapes)  # fmt: skip
    feedback = _pool_feedback(shards, shapes)
    return params, ({**optimizer, FEEDBACK_KEY: feedback} if feedback else optimizer)


FEEDBACK_KEY = "error_feedback"
"""Key of the full state's error-feedback residuals: ``{"compression": str, "residuals": {dc: {parameter: flat
fp32 tensor}}}``, each datacenter's whole (the engines take their own ranks' elements of their own DC's)."""


def _pool_feedback(shards: list[LocalShard], shapes: dict[str, torch.Size]) -> dict[str, Any] | None:
    """Each datacenter's residuals pooled whole, for the datacenters whose shards cover every element (a
    datacenter missing some restarts at zero); ``None`` when no shard holds any."""
    held = [f for s in shards for f in s.feedback]
    if not held:
        return None
    residuals: dict[str, dict[str, torch.Tensor]] = {}
    for dc in dict.fromkeys(f.dc for f in held):
        mine = [f for f in held if f.dc == dc]
        try:
            pooled, _ = _pool([LocalShard(0, 0, f.pieces) for f in mine], shapes, moment_names=())
        except IncompleteState:
            continue
        residuals[dc] = {n: t.reshape(-1) for n, t in pooled.items()}
    return {"compression": held[0].compression, "residuals": residuals} if residuals else None


def _assemble_diloco(
    shards: list[LocalShard], shapes: dict[str, torch.Size]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """DiLoCo: the outer state is pooled from every DC (it is the same in all); the inner state must come
    from ONE datacenter, because DCs drift apart between syncs. The first DC (in rank order) whose
    survivors still hold all of its inner state wins and every DC resumes from it. If no DC is whole, the
    inner phase restarts from the outer parameters with a fresh inner AdamW: the inner progress since each
    fragment's last sync is lost, never the synced state."""
    if any(s.outer is None for s in shards):
        raise ValueError("DiLoCo and non-DiLoCo snapshots cannot be pooled")
    done = {s.outer.inner_steps_done for s in shards if s.outer is not None}
    if len(done) != 1:
        raise ValueError(f"DiLoCo snapshots disagree on the inner step count: {sorted(done)}")
    outer = [LocalShard(s.step, 0, s.outer.pieces) for s in shards if s.outer is not None]
    anchor, outer_state = _pool(outer, shapes, moment_names=("momentum",))
    diloco = {
        "format": DILOCO_STATE_FORMAT,
        "inner_steps_done": done.pop(),
        "anchor": anchor,
        "momentum": {n: m["momentum"] for n, m in outer_state["params"].items()},
    }
    for dc in dict.fromkeys(s.outer.dc for s in shards if s.outer is not None):
        try:
            params, optimizer = _pool([s for s in shards if s.outer is not None and s.outer.dc == dc], shapes)
        except IncompleteState:
            continue
        return params, {**optimizer, "diloco": diloco}
    fresh = {"format": FULL_STATE_FORMAT, "step": 0, "params": {}, "master": anchor}
    return {n: t.clone() for n, t in anchor.items()}, {**fresh, "diloco": diloco}


def _pool(
    shards: list[LocalShard], shapes: dict[str, torch.Size], moment_names: tuple[str, ...] = MOMENTS
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Pool pieces into whole tensors; ``moment_names``: AdamW's moments, or DiLoCo's outer momentum."""
    adam_step = max(s.adam_step for s in shards)
    values = {n: torch.empty(torch.Size(sh).numel()) for n, sh in shapes.items()}
    moments = {n: {m: torch.zeros(torch.Size(sh).numel()) for m in moment_names} for n, sh in shapes.items()}
    covered = {n: torch.zeros(torch.Size(sh).numel(), dtype=torch.bool) for n, sh in shapes.items()}
    for shard in shards:
        for p in shard.pieces:
            if p.name not in values:
                raise ValueError(f"snapshot holds parameter {p.name!r} that the model does not have")
            values[p.name][p.start : p.stop] = p.value
            for m, t in p.moments.items():
                moments[p.name][m][p.start : p.stop] = t
            covered[p.name][p.start : p.stop] = True
    for n, mask in covered.items():
        if not bool(mask.all()):
            first = int((~mask).nonzero()[0])
            raise IncompleteState(f"no surviving rank holds element {first} of parameter {n!r}")
    params = {n: v.reshape(shapes[n]) for n, v in values.items()}
    optimizer: dict[str, Any] = {
        "format": FULL_STATE_FORMAT,
        "step": adam_step,
        "params": {n: {m: t.reshape(shapes[n]) for m, t in ms.items()} for n, ms in moments.items()}
        if adam_step or moment_names != MOMENTS
        else {},
        "master": params,  # the fp32 values are the truth, also for a model held in lower precision
    }
    return params, optimizer


def feedback_of_full_state(state: dict[str, Any]) -> tuple[FeedbackShard, ...]:
    """The residuals a full (layout-free) state holds (:func:`~meridian.workers.state.replica_state.assemble`
    pools them from a checkpoint), as whole-parameter pieces; ``()`` where it holds none."""
    saved = state.get(FEEDBACK_KEY)
    if not saved:
        return ()
    return tuple(
        FeedbackShard(dc, saved["compression"], tuple(StatePiece(n, 0, t.numel(), t.reshape(-1)) for n, t in by_name.items()))
        for dc, by_name in saved["residuals"].items()
    )
