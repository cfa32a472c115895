"""Partial distributed optimizer: AdamW state sharded across the ranks of a DC, replicated across DCs.

One step, after HAR steps 1–2 left the global gradient sum of this rank's shard in each bucket::

    # 1) clip: sum of squares per owned segment, all-reduced inside the DC → the global norm
    # 2) AdamW on this rank's shard only (exp_avg, exp_avg_sq, fp32 master when params are not fp32)
    # 3) all-gather the updated parameters inside the DC (instead of HAR step 3 on gradients)

So each rank holds 1/N of the optimizer state (N = ranks in its DC) and the slow inter-DC link still carries
only gradients.

With ``keep_committed`` (the engine's ``local_lookahead``) every bucket keeps an fp32 copy of its shard, the
*committed* parameters, which only :meth:`step` changes; :meth:`lookahead` then writes into the model's
parameters what one more AdamW step with this datacenter's own gradients would make of them, without touching
the committed values or the moments::

    step(lr)                       committed <- AdamW(committed, exact global gradient)   moments advance
    lookahead(lr, local, scale)    params    <- AdamW(committed, scale * local gradient)  moments do not

The look-ahead's gradient is clipped with the coefficient the last committed update used: one datacenter's
gradient, scaled to the global batch, carries its sampling noise in its norm, and clipping by that norm
shrank the look-ahead step (a one-process replay of this maths, a throwaway script not in the repository; nano,
1,024 steps of 16 samples, seed 0: +1.5% of exact sync's held-out loss clipped by its own norm, +1.0% by the
last committed coefficient, +0.5% unclipped).

A rank's shard of a bucket cuts through several parameters; each (parameter ∩ shard) becomes
one 1-D *piece* tensor (a view into the flat parameter buffer, or into the fp32 master), given to a plain
``torch.optim.AdamW`` in the parameter's weight-decay group. AdamW is elementwise, so a piece gets exactly
the update the whole parameter would get in a replicated AdamW.

Invariants checked at construction: in every DC, the pieces of its ranks cover every parameter element
exactly once (Megatron-Core's distributed optimizer once shipped shards with no owner, silently frozen).
The gradient norm is summed per *segment* (one owner per DC, values bit-identical across DCs after step 2)
into a fixed-order vector, so every DC computes the same norm bit for bit and the replicas never drift.

Never talks across DCs: the caller runs HAR steps 1–2.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meridian.workers.contracts.config import OptimConfig
from meridian.workers.distributed.direct_collectives import Transfers
from meridian.workers.distributed.flat_collectives import all_gather_single
from meridian.workers.distributed.layout import DCGroups, DCLayout
from meridian.workers.optim.adamw import (
    FULL_STATE_FORMAT,
    MOMENTS,
    check_full_state,
    make_adamw,
    param_groups,
    set_lr,
    state_nbytes,
    step_counter,
)
from meridian.workers.state.replica_state import LocalShard, cut, piece_of
from meridian.workers.sync.grad_buffer import Bucket, GradBuffer, ParamSlot
from meridian.workers.sync.har import all_gather_in_dc


@dataclass(frozen=True)
class ShardPiece:
    """Elements ``[start, stop)`` of bucket ``bucket``: one parameter's part of one rank's shard."""

    bucket: int
    slot: ParamSlot
    start: int
    stop: int

    @property
    def in_param(self) -> slice:
        """The same elements, as a slice of the flattened parameter."""
        return slice(self.start - self.slot.offset, self.stop - self.slot.offset)


def shard_bounds(bucket: Bucket, layout: DCLayout, rank: int) -> tuple[int, int]:
    u = bucket.padded_numel // layout.units
    lo, hi = layout.shard_units(rank)
    return lo * u, hi * u


def shard_pieces(buffer: GradBuffer, layout: DCLayout, rank: int) -> list[ShardPiece]:
    """Every (parameter ∩ shard of ``rank``), in bucket then offset order. Padding belongs to no piece."""
    pieces = []
    for bucket in buffer.buckets:
        lo, hi = shard_bounds(bucket, layout, rank)
        for s in bucket.slots:
            start, stop = max(lo, s.offset), min(hi, s.stop)
            if start < stop:
                pieces.append(ShardPiece(bucket.index, s, start, stop))
    return pieces


def check_ownership(buffer: GradBuffer, layout: DCLayout) -> None:
    """Raise unless, in every DC, each parameter element belongs to exactly one rank's piece."""
    for dc in layout.dcs:
        by_bucket: dict[int, list[ShardPiece]] = {b.index: [] for b in buffer.buckets}
        for r in layout.ranks_in(dc):
            for piece in shard_pieces(buffer, layout, r):
                by_bucket[piece.bucket].append(piece)
        for bucket in buffer.buckets:
            covered = 0
            for piece in sorted(by_bucket[bucket.index], key=lambda p: p.start):
                if piece.start != covered:
                    what = "owned twice" if piece.start < covered else "has no owner"
                    raise RuntimeError(
                        f"DC {dc!r}, bucket {bucket.index}: element {min(covered, piece.start)} {what} "
                        f"(parameter {piece.slot.name!r})"
                    )
                covered = piece.stop
            if covered != bucket.numel:
                raise RuntimeError(
                    f"DC {dc!r}, bucket {bucket.index}: elements {covered}..{bucket.numel} have no owner"
                )


class ShardedAdamW:
    """This rank's 1/N of AdamW over a :class:`GradBuffer` whose parameters live in flat buckets."""

    def __init__(
        self, model: nn.Module, buffer: GradBuffer, groups: DCGroups, cfg: OptimConfig, *, keep_committed: bool = False
    ) -> None:
        self.buffer, self.groups, self.cfg = buffer, groups, cfg
        buffer.flatten_params()
        check_ownership(buffer, groups.layout)
        self.bounds = [shard_bounds(b, groups.layout, groups.rank) for b in buffer.buckets]
        # fp32 master copy of the shard: for buckets whose parameters are not fp32, and (keep_committed) for all;
        # an fp32 gradient of the shard for the former.
        self.master: dict[int, torch.Tensor] = {}
        self.grad32: dict[int, torch.Tensor] = {}
        for b, (lo, hi) in zip(buffer.buckets, self.bounds, strict=True):
            if b.dtype != torch.float32 or keep_committed:
                self.master[b.index] = b.data[lo:hi].to(torch.float32, copy=True)
            if b.dtype != torch.float32:
                self.grad32[b.index] = torch.zeros(hi - lo, dtype=torch.float32, device=b.grad.device)
        self.pieces = shard_pieces(buffer, groups.layout, groups.rank)
        self.tensors = [self._piece_tensor(p) for p in self.pieces]
        named = [(p.slot.name, t) for p, t in zip(self.pieces, self.tensors, strict=True)]
        # A rank whose shards are all padding (a model smaller than the unit count) has nothing to update.
        self.optimizer = make_adamw(param_groups(named, model, cfg), cfg) if named else None
        self._by_decay: dict[float, list[int]] = {}
        """Look-ahead: this rank's pieces (indices into :attr:`pieces`) by their AdamW group's weight decay."""
        if self.optimizer is not None:
            decay = {id(t): g["weight_decay"] for g in self.optimizer.param_groups for t in g["params"]}
            for i, t in enumerate(self.tensors):
                self._by_decay.setdefault(decay[id(t)], []).append(i)
        self.steps = 0
        self.clip_coef: torch.Tensor | None = None
        """The clipping coefficient of the last committed update (``None`` before the first)."""
        self.wait_s = 0.0
        self._gathers: dict[int, dist.Work | Transfers] = {}  # NCCL's all-gathers, or a CPU rank's direct ones
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        # Norm vector: one entry per (bucket, segment), filled by that segment's owner in this DC.
        self._entries = [(b, seg) for b in buffer.buckets for seg in groups.layout.segments]
        self._masks: dict[int, torch.Tensor] = {}

    def _piece_tensor(self, piece: ShardPiece) -> torch.Tensor:
        bucket = self.buffer.buckets[piece.bucket]
        lo, _ = self.bounds[piece.bucket]
        if piece.bucket in self.master:
            t = self.master[piece.bucket][piece.start - lo : piece.stop - lo]
            grad = self.grad32.get(piece.bucket)
            t.grad = grad[piece.start - lo : piece.stop - lo] if grad is not None else bucket.grad[piece.start : piece.stop]
        else:
            t = bucket.data[piece.start : piece.stop]
            t.grad = bucket.grad[piece.start : piece.stop]
        return t

    def _shard_grad(self, b: int) -> torch.Tensor:
        lo, hi = self.bounds[b]
        return self.grad32[b] if b in self.grad32 else self.buffer.buckets[b].grad[lo:hi]

    # -- the step ------------------------------------------------------------------------------------------

    def step(self, lr: float, *, write_params: bool = True) -> torch.Tensor:
        """Clip and update this rank's shard; returns the global gradient norm (before clipping). Without
        ``write_params`` the fp32 masters are not copied into the parameters: :meth:`lookahead`, which writes
        every element of the shard, comes next."""
        self.wait_params()  # the previous all-gather still writes into the shard we are about to update
        for b, g32 in self.grad32.items():
            lo, hi = self.bounds[b]
            g32.copy_(self.buffer.buckets[b].grad[lo:hi])
        norm = self._global_norm()  # 1) clip
        if self.cfg.grad_clip > 0:
            coef = self.clip_coef = self._clip_coef(norm)
            for b in range(len(self.buffer.buckets)):
                grad = self._shard_grad(b)
                grad.mul_(coef.to(grad.device))
        if self.optimizer is not None:  # 2) AdamW on the shard
            set_lr(self.optimizer, lr)
            self.optimizer.step()
        for b, master in self.master.items() if write_params else ():
            lo, hi = self.bounds[b]
            self.buffer.buckets[b].data[lo:hi].copy_(master)
        self.steps += 1
        return norm

    def _clip_coef(self, norm: torch.Tensor) -> torch.Tensor:
        # Same formula as torch.nn.utils.clip_grad_norm_, so a replicated run clips identically.
        return torch.clamp(self.cfg.grad_clip / (norm + 1e-6), max=1.0)

    def _global_norm(self, grad_of=None) -> torch.Tensor:
        """The norm of the gradient whose shard of bucket ``b`` is ``grad_of(b)`` (default: the synced one)."""
        grad_of = grad_of or self._shard_grad
        layout = self.groups.layout
        mp = self.groups.mp_norm
        device = self.buffer.buckets[0].grad.device
        sumsq = torch.zeros(len(self._entries), dtype=torch.float64, device=device)
        for i, (bucket, seg) in enumerate(self._entries):
            if self.groups.rank not in seg.owners:
                continue
            u = bucket.padded_numel // layout.units
            lo, _ = self.bounds[bucket.index]
            start, stop = seg.lo * u, min(seg.hi * u, bucket.numel)  # padding excluded
            if start < stop:
                square = grad_of(bucket.index)[start - lo : stop - lo].float().square()
                if mp is not None:
                    square = square * self._counted_mask(bucket.index)[start - lo : stop - lo]
                sumsq[i] = square.sum()
        if self.groups.dc_size > 1:
            t0 = time.perf_counter()
            # One non-zero contributor per entry: the DC-sum is exact, identical in every DC.
            dist.all_reduce(sumsq, op=dist.ReduceOp.SUM, group=self.groups.intra_dc)
            self.wait_s += time.perf_counter() - t0
        total = sumsq.sum()
        if mp is not None:  # the other tensor/pipeline-parallel parts of this replica
            total = mp.reduce(total)
        return total.sqrt().float()

    @torch.no_grad()
    def lookahead(self, lr: float, local: list[torch.Tensor], scale: float) -> None:
        """Write AdamW(committed, ``scale`` × ``local``) into this rank's shard of the model's parameters.

        ``local[b]``: this rank's shard of bucket ``b``'s gradient summed inside its DC (HAR step 1 alone);
        ``scale`` makes it an estimate of the global-batch gradient. Clipped by the last committed update's
        coefficient (before any: by its own norm, like :meth:`step`); the same formula as torch's AdamW
        (single-tensor), from the committed values and moments, which stay as they are. Needs ``keep_committed``;
        the parameters' all-gather follows (:meth:`gather_params`)."""
        self.wait_params()  # the previous all-gather still writes into the shard we are about to overwrite
        coef = torch.ones((), device=self.buffer.buckets[0].grad.device)
        if self.cfg.grad_clip > 0:
            if self.clip_coef is not None:
                coef = self.clip_coef
            else:
                coef = self._clip_coef(self._global_norm(lambda b: local[b]) * scale)
        if self.optimizer is None:
            return
        beta1, beta2, eps = self.cfg.beta1, self.cfg.beta2, self.cfg.eps
        k = self.steps + 1  # the AdamW step this update would be
        for decay, idx in self._by_decay.items():  # one foreach pass per weight-decay group: few kernel launches
            ts = [self.tensors[i] for i in idx]
            gs = torch._foreach_mul([self._local_piece(local, self.pieces[i]) for i in idx], coef * scale)
            states = [self.optimizer.state.get(t) for t in ts]
            if all(states):
                m = torch._foreach_mul([st["exp_avg"] for st in states], beta1)
                v = torch._foreach_mul([st["exp_avg_sq"] for st in states], beta2)
            else:  # before the first committed update: no moments yet
                m, v = torch._foreach_mul(gs, 0.0), torch._foreach_mul(gs, 0.0)
            torch._foreach_add_(m, gs, alpha=1 - beta1)
            torch._foreach_addcmul_(v, gs, gs, value=1 - beta2)
            torch._foreach_sqrt_(v)  # the denominator, in place
            torch._foreach_div_(v, math.sqrt(1 - beta2**k))
            torch._foreach_add_(v, eps)
            torch._foreach_div_(m, v)
            ahead = torch._foreach_mul(ts, 1 - lr * decay)
            torch._foreach_add_(ahead, m, alpha=-lr / (1 - beta1**k))
            torch._foreach_copy_([self._param_piece(self.pieces[i]) for i in idx], ahead)

    def _local_piece(self, local: list[torch.Tensor], piece: ShardPiece) -> torch.Tensor:
        lo, _ = self.bounds[piece.bucket]
        return local[piece.bucket][piece.start - lo : piece.stop - lo].float()

    def _param_piece(self, piece: ShardPiece) -> torch.Tensor:
        return self.buffer.buckets[piece.bucket].data[piece.start : piece.stop]

    def _counted_mask(self, b: int) -> torch.Tensor:
        """1 where this rank's shard of bucket ``b`` holds a parameter it counts in the model-parallel norm."""
        mask = self._masks.get(b)
        if mask is None:
            mp = self.groups.mp_norm
            assert mp is not None
            lo, hi = self.bounds[b]
            mask = torch.zeros(hi - lo, dtype=torch.float32, device=self.buffer.buckets[b].grad.device)
            for piece in self.pieces:
                if piece.bucket == b and mp.counted(piece.slot.name):
                    mask[piece.start - lo : piece.stop - lo] = 1.0
            self._masks[b] = mask
        return mask

    # -- 3) parameters back to every rank of the DC -------------------------------------------------------------

    def gather_params(self, *, async_op: bool) -> None:
        """All-gather every bucket's updated parameters inside the DC; async ones finish in :meth:`wait_params`.

        In forward order: buckets hold parameters in backward order, and a group runs its collectives in the
        order they were issued, so the bucket the next forward needs first (the embedding's) lands first."""
        t0 = time.perf_counter()
        for bucket in reversed(self.buffer.buckets):
            work = all_gather_in_dc(bucket.data, self.groups, async_op=async_op)
            if work is not None and async_op:
                self._gathers[bucket.index] = work
        if not async_op:
            self.wait_s += time.perf_counter() - t0

    def wait_params(self, buckets: list[int] | None = None) -> None:
        """Block until the parameter all-gathers of ``buckets`` (default: all) have landed."""
        if not self._gathers:
            return
        t0 = time.perf_counter()
        for b in list(self._gathers) if buckets is None else buckets:
            work = self._gathers.pop(b, None)
            if work is not None:
                work.wait()
        self.wait_s += time.perf_counter() - t0

    def install_prefetch_hooks(self, model: nn.Module) -> None:
        """Let the next forward start before every all-gather landed: each module waits for its own buckets.

        Only parameters used inside their own module's ``forward`` are covered (true for every Meridian model);
        a parameter read elsewhere (weight tying through ``module.weight``) would need :meth:`wait_params`.
        """
        bucket_of = {id(s.param): b.index for b in self.buffer.buckets for s in b.slots}
        for module in model.modules():
            mine = sorted({bucket_of[id(p)] for p in module.parameters(recurse=False) if id(p) in bucket_of})
            if mine:
                self._hooks.append(
                    module.register_forward_pre_hook(lambda _m, _a, b=mine: self.wait_params(b))
                )

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def take_wait_s(self) -> float:
        waited, self.wait_s = self.wait_s, 0.0
        return waited

    # -- checkpoints ------------------------------------------------------------------------------------------

    def state_nbytes(self) -> int:
        """Bytes of optimizer state on this rank: moments, step counters and fp32 masters."""
        return sum(m.numel() * m.element_size() for m in self.master.values()) + state_nbytes(self.optimizer)

    def local_shard(self, step: int) -> LocalShard:
        """Copies of what this rank owns: its pieces' values (fp32 master where there is one) and moments."""
        pieces = []
        for piece, t in zip(self.pieces, self.tensors, strict=True):
            st = self.optimizer.state.get(t) if self.optimizer is not None else None
            pieces.append(piece_of(piece.slot.name, piece.in_param.start, piece.in_param.stop, t, st))
        return LocalShard(step, self.steps, tuple(pieces))

    def full_state(self) -> dict[str, Any]:
        """The whole (unsharded) state, gathered inside the DC; every rank of the DC gets it."""
        self.wait_params()
        fields = [*MOMENTS, *(["master"] if self.master else [])]
        full: dict[str, dict[str, torch.Tensor]] = {}
        for bucket, (lo, hi) in zip(self.buffer.buckets, self.bounds, strict=True):
            local = torch.zeros(len(fields), hi - lo, dtype=torch.float32, device=bucket.grad.device)
            if bucket.index in self.master:
                local[fields.index("master")] = self.master[bucket.index]
            for piece, t in zip(self.pieces, self.tensors, strict=True):
                st = self.optimizer.state.get(t) if self.optimizer is not None else None
                if piece.bucket == bucket.index and st:
                    for m in MOMENTS:
                        local[fields.index(m), piece.start - lo : piece.stop - lo] = st[m]
            n = self.groups.dc_size
            gathered = torch.empty(n * local.numel(), dtype=torch.float32, device=local.device)
            if n > 1:
                all_gather_single(gathered, local.reshape(-1), group=self.groups.intra_dc)
            else:
                gathered.copy_(local.reshape(-1))
            # (n, fields, shard) → (fields, padded): the shards lie along the bucket in DC-rank order
            flat = gathered.view(n, len(fields), hi - lo).transpose(0, 1).reshape(len(fields), -1).cpu()
            for s in bucket.slots:
                full[s.name] = {
                    f: flat[i, s.offset : s.stop].reshape(s.param.shape).clone() for i, f in enumerate(fields)
                }
        state: dict[str, Any] = {
            "format": FULL_STATE_FORMAT,
            "step": self.steps,
            "params": {name: {m: v[m] for m in MOMENTS} for name, v in full.items()} if self.steps else {},
        }
        if self.master:
            state["master"] = {name: v["master"] for name, v in full.items()}
        return state

    def load_full_state(self, state: dict[str, Any]) -> None:
        """Take this rank's pieces of a full state (every rank passes the same whole state; no collective)."""
        self.wait_params()
        check_full_state(state, [s.name for s in self.buffer.slots])
        self.steps = int(state["step"])
        masters = state.get("master")
        if masters is not None:  # the fp32 values are the truth; the low-precision params follow them
            for s in self.buffer.slots:
                s.param.data.copy_(masters[s.name].reshape(s.param.shape))
        for b, master in self.master.items():
            lo, hi = self.bounds[b]
            master.copy_(
                self.buffer.buckets[b].data[lo:hi].float()
                if masters is None
                else self._master_slice(b, masters)
            )
        if self.optimizer is None:
            return
        self.optimizer.state.clear()
        if not self.steps:
            return
        for piece, t in zip(self.pieces, self.tensors, strict=True):
            saved = state["params"][piece.slot.name]
            self.optimizer.state[t] = {
                "step": step_counter(self.optimizer, self.steps, t),
                **{
                    m: saved[m].reshape(-1)[piece.in_param].to(device=t.device, dtype=t.dtype).clone()
                    for m in MOMENTS
                },
            }

    def owned_ranges(self) -> list[tuple[str, int, int]]:
        """``(parameter, start, stop)`` of every piece, in :meth:`local_shard`'s order."""
        return [(p.slot.name, p.in_param.start, p.in_param.stop) for p in self.pieces]

    def load_local_shard(self, shard: LocalShard) -> None:
        """Take this rank's pieces from a shard holding (at least) :meth:`owned_ranges`: fp32 values into the
        master, moments into AdamW. The model's weights are loaded already; no collective."""
        self.wait_params()
        self.steps = shard.adam_step
        for b, master in self.master.items():  # padding and other ranks' elements: from the loaded weights
            lo, hi = self.bounds[b]
            master.copy_(self.buffer.buckets[b].data[lo:hi].float())
        if self.optimizer is not None:
            self.optimizer.state.clear()
        for piece, t in zip(self.pieces, self.tensors, strict=True):
            saved = cut(shard.pieces, piece.slot.name, piece.in_param.start, piece.in_param.stop)
            if piece.bucket in self.master:
                t.copy_(saved.value)
            if self.optimizer is not None and self.steps:
                if not saved.moments:
                    raise ValueError(f"the state of step {shard.step} has no AdamW moments for {piece.slot.name!r}")
                self.optimizer.state[t] = {
                    "step": step_counter(self.optimizer, self.steps, t),
                    **{m: saved.moments[m].to(device=t.device, dtype=t.dtype).clone() for m in MOMENTS},
                }

    def _master_slice(self, b: int, masters: dict[str, torch.Tensor]) -> torch.Tensor:
        lo, hi = self.bounds[b]
        out = self.master[b].clone()
        for s in self.buffer.buckets[b].slots:
            start, stop = max(lo, s.offset), min(hi, s.stop)
            if start < stop:
                out[start - lo : stop - lo] = masters[s.name].reshape(-1)[start - s.offset : stop - s.offset]
        return out
