"""Durable checkpoints written with ``torch.distributed.checkpoint`` (DCP): every rank writes its own shard.

What a rank writes is what it already owns (:class:`~meridian.workers.state.replica_state.LocalShard`: the
flat element ranges ``[start, stop)`` of parameters it holds, with their AdamW moments, and DiLoCo's outer
state). Nothing is gathered. Each parameter is one 1-D DCP tensor of its flattened elements per kind::

    param/<name>            values (the fp32 master where there is one)
    exp_avg/<name>, exp_avg_sq/<name>
    outer/<name>, outer_momentum/<name>     DiLoCo's outer parameters and momentum
    feedback<i>/<name>      error-feedback residuals of compressed sync, datacenter i's (``meridian.json``
                            names them), each datacenter's written by its own ranks

and the ranks' ranges are its DCP chunks. Replicas hold the same elements (every datacenter has a whole
replica; a replicated optimizer holds everything on every rank): :func:`assign_writers` gives every element
to exactly one of its holders, split evenly among them, so the write is spread over every rank and nothing
is written twice. DiLoCo's inner state differs between datacenters; the first datacenter's is written (as
the gathered format did).

Loading reads any element range of any tensor (:class:`_RangeLoadPlanner`, no collective), so a checkpoint
written by one layout loads into any other world size and datacenter sizes.

``<dir>`` is a local folder or an fsspec URL (DCP's fsspec writer and reader); a save commits as
:mod:`meridian.workers.state.storage` describes (``meridian.json`` is the folder's marker, written last).
Layout::

    <dir>/step-00000040/.metadata, __<rank>_0.distcp ...   DCP
    <dir>/step-00000040/meridian.json                       step, AdamW step, fingerprint, shapes, DiLoCo
    <dir>/latest                                            "step-00000040" (written last)
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from meridian.workers.optim.adamw import MOMENTS
from meridian.workers.state import storage
from meridian.workers.state.checkpoint import publish
from meridian.workers.state.replica_state import FeedbackShard, LocalShard, OuterShard, StatePiece, assemble

FORMAT = "meridian.dcp/1"
META_FILE = "meridian.json"
OUTER = "outer:"
"""Prefix of DiLoCo's outer pieces in :func:`assign_writers`' names."""
FEEDBACK = "feedback"
"""Prefix of error-feedback residuals: ``feedback<i>:<name>`` in :func:`assign_writers`' names, ``feedback<i>/<name>``
in DCP's, ``i`` the datacenter's index in ``meridian.json``'s ``feedback.dcs`` (its name may be any string)."""


# -- who writes what ---------------------------------------------------------------------------------------
def assign_writers(offers: list[tuple[int, str, int, int]]) -> dict[int, list[tuple[str, int, int]]]:
    """``offers``: ``(rank, name, start, stop)`` of every range a rank holds. Returns, per rank, the ranges it
    writes: every offered element exactly once, an element held by k ranks split evenly among the k."""
    by_name: dict[str, list[tuple[int, int, int]]] = {}
    for rank, name, start, stop in offers:
        by_name.setdefault(name, []).append((rank, start, stop))
    out: dict[int, list[tuple[str, int, int]]] = {}
    for name, held in sorted(by_name.items()):
        cuts = sorted({b for _, start, stop in held for b in (start, stop)})
        for a, b in zip(cuts, cuts[1:], strict=False):
            holders = sorted({r for r, start, stop in held if start <= a and b <= stop})
            for j, rank in enumerate(holders):
                lo, hi = a + (b - a) * j // len(holders), a + (b - a) * (j + 1) // len(holders)
                if lo < hi:
                    out.setdefault(rank, []).append((name, lo, hi))
    return out


def _offers(rank: int, shard: LocalShard, write_inner: bool) -> list[tuple[int, str, int, int]]:
    inner = [(rank, p.name, p.start, p.stop) for p in shard.pieces] if write_inner else []
    outer = [(rank, OUTER + p.name, p.start, p.stop) for p in shard.outer.pieces] if shard.outer else []
    return inner + outer


def _chunks_of(shard: LocalShard, mine: list[tuple[str, int, int]], feedback_dcs: list[str]) -> list[Chunk]:
    """``(DCP key, start, tensor)`` of the ranges ``mine`` this rank writes, cut from its shard's pieces."""
    out = []
    for name, a, b in mine:
        if name.startswith(FEEDBACK):  # feedback<i>:<name>: datacenter feedback_dcs[i]'s residuals
            kind, base = name.split(":", 1)
            dc = feedback_dcs[int(kind.removeprefix(FEEDBACK))]
            p = next(p for f in shard.feedback if f.dc == dc for p in f.pieces
                     if p.name == base and p.start <= a and b <= p.stop)
            out.append((f"{kind}/{base}", (a,), p.value[a - p.start : b - p.start]))
            continue
        outer = name.startswith(OUTER)
        pieces = shard.outer.pieces if outer and shard.outer else shard.pieces
        base = name.removeprefix(OUTER) if outer else name
        p = next(p for p in pieces if p.name == base and p.start <= a and b <= p.stop)
        kinds = {"outer": p.value, **({"outer_momentum": p.moments["momentum"]} if p.moments else {})} if outer \
            else {"param": p.value, **{m: p.moments[m] for m in MOMENTS if m in p.moments}}  # fmt: skip
        out += [(f"{kind}/{base}", (a,), t[a - p.start : b - p.start]) for kind, t in kinds.items()]
    return out


# -- DCP planners over element ranges ----------------------------------------------------------------------
Chunk = tuple[str, tuple[int, ...], torch.Tensor]
"""``(DCP key, offsets, tensor)``: a box of a global tensor, at ``offsets`` (1-D ranges: ``(start,)``)."""


class _RangeSavePlanner(DefaultSavePlanner):
    """Writes the given chunks of global tensors (no state dict walk, no ShardedTensor)."""

    def __init__(self, chunks: list[Chunk], sizes: dict[str, torch.Size]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._chunks, self._sizes = chunks, sizes
        self._data: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: Any = None,
                       is_coordinator: bool = False) -> None:
        self.state_dict, self.is_coordinator = state_dict, is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, offsets, t in self._chunks:
            self._data[(key, offsets)] = t
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=t.shape)
            items.append(WriteItem(
                index=MetadataIndex(key, torch.Size(offsets)), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=t.dtype),
                                            size=self._sizes[key])))  # fmt: skip
        self.plan = SavePlan(items)
        return self.plan

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self.plan = new_plan
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return self._data[(write_item.index.fqn, tuple(write_item.index.offset))]


class _RangeLoadPlanner(DefaultLoadPlanner):
    """Reads boxes of checkpoint tensors (1-D element ranges, or whole N-D tensors) into the given tensors,
    in place."""

    def __init__(self, wants: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._wants = wants

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False) -> None:
        self.state_dict, self.metadata, self.is_coordinator = state_dict, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, boxes in self._wants.items():
            local = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.shape) for o, t in boxes]
            items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], local)
        return LoadPlan(items)

    def resolve_tensor(self, read_item: Any) -> torch.Tensor:
        _, t = self._wants[read_item.dest_index.fqn][read_item.dest_index.index]
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            t = t.narrow(dim, offset, length)
        return t

    def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor handed out a view of the destination: the data is already there


def write_chunks(directory: str, name: str, chunks: list[Chunk], sizes: dict[str, torch.Size], *, rank: int,
                 group: dist.ProcessGroup | None, meta: Any, keep: int = 2) -> Path | str | None:
    """Every rank of ``group`` writes its ``chunks`` into ``directory/name`` (a collective); rank 0 then adds
    ``meta()`` as ``meridian.json`` and publishes the folder (and ``latest``). An interrupted save leaves
    a folder that is never read (locally ``.step-N.partial``; under a URL ``step-N/`` without ``meridian.json``).
    Returns the folder (the URL under a URL) on rank 0, ``None`` elsewhere."""
    partial = storage.writing_folder(directory, name)
    if rank == 0:  # an earlier attempt at this step (maybe of another world size)
        storage.prepare(directory, name)
    dist.barrier(group=group)  # nobody writes before that clean-up
    dcp.save({}, storage_writer=_writer(partial), planner=_RangeSavePlanner(chunks, sizes),
             process_group=group)
    if rank != 0:
        return None
    storage.write_text(storage.join(partial, META_FILE), json.dumps(meta(), indent=1))
    return publish(directory, partial, name, keep=keep)


def _writer(path: str) -> dcp.StorageWriter:
    if not storage.is_url(path):
        return dcp.FileSystemWriter(path)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(path, sync_files=False)  # an object is durable once closed; no fsync of an upload


def _reader(path: str) -> dcp.StorageReader:
    if not storage.is_url(path):
        return dcp.FileSystemReader(path)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(path)


# -- save --------------------------------------------------------------------------------------------------
def save_shard(directory: str, shard: LocalShard, *, rank: int, datacenter: str, shapes: dict[str, torch.Size],
               fingerprint: dict[str, Any], group: dist.ProcessGroup | None = None,
               keep: int = 2) -> Path | str | None:
    """Write the job's state at ``shard.step``: every rank of ``group`` calls this with its own shard (a
    collective over ``group``). Rank 0 finishes it (``meridian.json``, rename, ``latest``) and returns the
    folder; the others return ``None``. An interrupted save is never read (:func:`write_chunks`)."""
    mine = (rank, datacenter, shard.adam_step, shard.outer.inner_steps_done if shard.outer else None,
            [(p.name, p.start, p.stop) for p in shard.pieces],
            [(p.name, p.start, p.stop) for p in shard.outer.pieces] if shard.outer else None,
            [(f.dc, f.compression, [(p.name, p.start, p.stop) for p in f.pieces]) for f in shard.feedback])
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    first_dc = min(everyone, key=lambda e: e[0])[1]
    diloco = any(e[5] is not None for e in everyone)
    feedback_dcs = sorted({dc for e in everyone for dc, _, _ in e[6]})
    offers = []
    for r, dc, _, _, inner, outer, held in everyone:
        if not diloco or dc == first_dc:  # DiLoCo's inner state differs per DC: write the first DC's
            offers += [(r, n, a, b) for n, a, b in inner]
        offers += [(r, OUTER + n, a, b) for n, a, b in outer or ()]
        for dc, _, ranges in held:  # residuals differ per DC too, and every DC's are kept
            offers += [(r, f"{FEEDBACK}{feedback_dcs.index(dc)}:{n}", a, b) for n, a, b in ranges]
    chunks = _chunks_of(shard, assign_writers(offers).get(rank, []), feedback_dcs)
    sizes = {key: torch.Size([shapes[key.split("/", 1)[1]].numel()]) for key, _, _ in chunks}

    def meta() -> dict[str, Any]:
        return {"format": FORMAT, "step": shard.step, "adam_step": max(e[2] for e in everyone),
                "fingerprint": fingerprint, "shapes": {n: list(s) for n, s in shapes.items()},
                "diloco": {"dc": first_dc, "inner_steps_done": next(e[3] for e in everyone if e[3] is not None)}
                if diloco else None,
                "feedback": {"compression": next(c for e in everyone for _, c, _ in e[6]), "dcs": feedback_dcs}
                if feedback_dcs else None}  # fmt: skip

    return write_chunks(directory, f"step-{shard.step:08d}", chunks, sizes, rank=rank, group=group, meta=meta,
                        keep=keep)


# -- load --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShardedCheckpoint:
    path: str
    step: int
    adam_step: int
    fingerprint: dict[str, Any]
    shapes: dict[str, torch.Size]
    diloco: dict[str, Any] | None
    feedback: dict[str, Any] | None = None
    """``{"compression": ..., "dcs": [...]}`` when error-feedback residuals are stored (``feedback<i>/``)."""


def is_sharded(path: str) -> bool:
    return storage.exists(storage.join(path, META_FILE))


def open_checkpoint(path: str) -> ShardedCheckpoint:
    """The checkpoint folder ``path``'s description (``meridian.json``); a ``FileNotFoundError`` if it has none
    (incomplete), :class:`~meridian.workers.state.storage.CheckpointUnreadable` if it does not parse."""
    text = storage.read_text(storage.join(path, META_FILE))
    if text is None:
        raise FileNotFoundError(f"{path} holds no {META_FILE}: not a complete checkpoint")
    try:
        meta = json.loads(text)
        found = meta.get("format")
    except (ValueError, AttributeError) as e:
        raise storage.unreadable(path, e) from e
    if found != FORMAT:
        raise ValueError(f"{path}: checkpoint format {found!r}, this Meridian reads {FORMAT!r}")
    try:
        return ShardedCheckpoint(path=path, step=int(meta["step"]), adam_step=int(meta["adam_step"]),
                                 fingerprint=meta["fingerprint"], diloco=meta["diloco"], feedback=meta.get("feedback"),
                                 shapes={n: torch.Size(s) for n, s in meta["shapes"].items()})  # fmt: skip
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise storage.unreadable(path, KeyError(f"{META_FILE} lacks {e}") if isinstance(e, KeyError) else e) from e


def _metadata(ck: ShardedCheckpoint) -> Any:
    """DCP's ``.metadata`` of the checkpoint (what every chunk is and where)."""
    try:
        return _reader(ck.path).read_metadata()
    except Exception as e:  # cut short: an unpickling error; gone: FileNotFoundError; a URL's library's own
        raise storage.unreadable(ck.path, e) from e


def read_ranges(ck: ShardedCheckpoint, ranges: list[tuple[str, int, int]], *, state: bool = True,
                weights: dict[str, torch.Tensor] | None = None) -> LocalShard:
    """The elements ``[start, stop)`` of each ``(parameter, start, stop)`` (values, moments, outer state,
    error-feedback residuals; only the values without ``state``), read on this rank alone (no collective), as
    a :class:`LocalShard` (:func:`assemble` pools such shards). DCP reads just those bytes of its files.
    ``weights``: the values already read (:func:`read_weights`); the pieces' values are views of them, not
    read again. Residuals are read for every datacenter stored (this function does not know the reader's;
    the engine keeps its own): k × 4 bytes per element with k datacenters."""
    stored = _metadata(ck).state_dict_metadata
    wants: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]] = {}

    def want(key: str, start: int, stop: int) -> torch.Tensor | None:
        if key not in stored:
            return None
        shape = stored[key].size
        if len(shape) == 1:
            t = torch.empty(stop - start, dtype=torch.float32)
            wants.setdefault(key, []).append(((start,), t))
            return t
        # a tensor stored in its own shape (a model-parallel job's weights): read whole, flattened
        if (start, stop) != (0, shape.numel()):
            raise ValueError(f"{ck.path}: {key} is stored as {list(shape)}, read whole only")
        t = torch.empty(shape, dtype=torch.float32)
        wants.setdefault(key, []).append(((0,) * len(shape), t))
        return t.reshape(-1)

    pieces, outer = [], []
    feedback_dcs = ck.feedback["dcs"] if ck.feedback is not None and state else []
    residuals: list[list[tuple[str, int, int, torch.Tensor | None]]] = [[] for _ in feedback_dcs]
    for name, a, b in ranges:
        for i, held in enumerate(residuals):
            key = f"{FEEDBACK}{i}/{name}"  # a range its DC's ranks did not all write is left out: zero
            held.append((name, a, b, want(key, a, b) if key in stored and _covers(stored[key], a, b) else None))
        value = weights[name].reshape(-1)[a:b] if weights is not None else want(f"param/{name}", a, b)
        assert value is not None, f"{ck.path} has no values of {name!r}"
        moments = {m: want(f"{m}/{name}", a, b) for m in MOMENTS} if ck.adam_step and state else {}
        pieces.append((name, a, b, value, moments))
        if ck.diloco is not None and state:
            outer.append((name, a, b, want(f"outer/{name}", a, b), want(f"outer_momentum/{name}", a, b)))
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load({}, storage_reader=_reader(ck.path), planner=_RangeLoadPlanner(wants), no_dist=True)
        except (Exception, CheckpointException) as e:  # (DCP's is a BaseException holding the reader's error)
            raise storage.unreadable(ck.path, first_failure(e)) from e
    feedback = tuple(
        FeedbackShard(dc, ck.feedback["compression"], tuple(StatePiece(n, a, b, v) for n, a, b, v in held if v is not None))
        for dc, held in zip(feedback_dcs, residuals, strict=True)
    ) if ck.feedback is not None else ()  # fmt: skip
    shard = LocalShard(ck.step, ck.adam_step, tuple(
        StatePiece(n, a, b, v, {m: t for m, t in ms.items() if t is not None}) for n, a, b, v, ms in pieces),
        feedback=feedback)  # fmt: skip
    if ck.diloco is None or not state:
        return shard
    outer_pieces = tuple(StatePiece(n, a, b, v, {"momentum": m}) for n, a, b, v, m in outer)
    return dataclasses.replace(shard, outer=OuterShard(ck.diloco["dc"], ck.diloco["inner_steps_done"], outer_pieces))


def first_failure(error: BaseException) -> BaseException:
    """The error under DCP's ``CheckpointException`` (each rank's failure), else ``error``."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        inner = first[0] if isinstance(first, tuple) else first
        if isinstance(inner, BaseException):
            return inner
    return error


def _covers(md: Any, start: int, stop: int) -> bool:
    """Whether the chunks written of a 1-D DCP tensor cover its elements ``[start, stop)`` (a read of elements
    nobody wrote would leave them as they were allocated)."""
    at = start
    for lo, n in sorted((c.offsets[0], c.sizes[0]) for c in md.chunks):
        if lo > at:
            break
        at = max(at, lo + n)
    return at >= stop


def read_weights(ck: ShardedCheckpoint) -> dict[str, torch.Tensor]:
    """Every parameter's fp32 values, whole, without optimizer state: what every data-parallel rank holds."""
    shard = read_ranges(ck, [(n, 0, s.numel()) for n, s in ck.shapes.items()], state=False)
    return {p.name: p.value.reshape(ck.shapes[p.name]) for p in shard.pieces}


def stored_nbytes(ck: ShardedCheckpoint) -> int:
    """Bytes of tensor data the checkpoint holds (values, moments, outer state), from its DCP metadata."""
    md = _metadata(ck)
    return sum(m.size.numel() * m.properties.dtype.itemsize for m in md.state_dict_metadata.values()
               if hasattr(m, "chunks"))


def load_full(ck: ShardedCheckpoint) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Whole parameters and the full optimizer state (the layout-free form every engine loads)."""
    shard = read_ranges(ck, [(n, 0, s.numel()) for n, s in ck.shapes.items()])
    return assemble([shard], ck.shapes)
