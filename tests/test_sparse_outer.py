"""The sparse outer update (SparseLoCo-style top-k with 2-bit values and error feedback) claims what it sends, and
DiLoCo with it matches a single-process reference of the same algorithm.

- The codec: a payload is exactly ``sparse_payload_bytes`` long; it sends, of each block, exactly the top-k
  positions of ``|x|``; each value comes back with its sign, on one of the block's magnitude levels, within half a
  level of the original (values on a level come back exactly); the packed positions round-trip for any width.
- Error feedback: the residual is exactly ``x + decay × residual − decoded``; with decay 1 what was sent plus the
  last residual adds up to the whole stream.
- Sparse DiLoCo over 2 datacenters of 2 + 1 ranks (plain, H = 3, outer Nesterov) and 3 of 2 + 1 + 1 (streaming: 2
  fragments, overlap 1, the paper's mix, decayed feedback) against one AdamW replica per datacenter whose outer
  step runs on the full parameters: each datacenter's delta cut into the same chunks as the wire (the parameter
  elements the engine's ranks report for each chunk), each chunk top-k'd with that datacenter's own residual, the decoded payloads summed in
  datacenter order. Weights checked at rtol 1e-5 / atol 1e-6 (the inner AdamW's rounding, as in the dense tests),
  the datacenters' residuals too, by parameter element. The same with ``sparse_keep_unsent`` (1 + 2 ranks plain, 1 + 1 + 2
  streaming with keep-progress): each datacenter's weights become the outer ones minus its decayed
  residual, and its next delta is not topped up again.
- Recovery: a snapshot taken while a sparse sync is in flight holds the residuals from before that sync (it is
  dropped on a restore and measured again from the same anchor), the packed form carries them, and rebuilding
  the state after one node of a datacenter is lost keeps the other, whole datacenter's residuals exactly and
  restarts the broken one's at zero.
"""

from __future__ import annotations

import pytest
import torch
from sync_helpers import (
    GLOBAL_BATCH,
    lr_of,
    micro_batches,
    params_of,
    share_loss,
    toy_batch,
    toy_model,
    train_steps,
)

from meridian.workers.contracts.config import (
    Compression,
    DiLoCoConfig,
    FinalAverage,
    OptimConfig,
    OuterMerge,
    SyncConfig,
    SyncStrategy,
)
from meridian.workers.contracts.wire_format import sparse_kept, sparse_payload_bytes
from meridian.workers.data.text import rank_slice
from meridian.workers.distributed.layout import DCGroups, DCLayout
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.optim.adamw import build_adamw
from meridian.workers.state.replica_state import FEEDBACK_KEY, assemble, pack, unpack
from meridian.workers.sync.compression import ErrorFeedback
from meridian.workers.sync.diloco import DiLoCoSync
from meridian.workers.sync.diloco_schedule import FragmentSchedule
from meridian.workers.sync.sparse_codec import SparseCodec, pack_bits, sparse_codec_of, unpack_bits

# -- the codec -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_a_payload_sends_exactly_each_blocks_top_k_on_its_levels(bits):
    codec = SparseCodec(density=0.05, value_bits=bits, block=64)
    g = torch.Generator().manual_seed(bits)
    for n in (0, 1, 7, 64, 200, 1000):
        x = torch.randn(n, generator=g) * torch.linspace(0.1, 5, n)
        payload = codec.encode(x)
        assert payload.dtype == torch.uint8 and payload.numel() == codec.payload_bytes(n) == sparse_payload_bytes(
            n, 0.05, bits, 64)
        back = codec.decode(payload)
        assert back.shape == x.shape
        for lo in range(0, n, 64):
            part, got = x[lo : lo + 64], back[lo : lo + 64]
            k = sparse_kept(part.numel(), 0.05)
            top = set(part.abs().topk(k).indices.tolist())
            assert set(got.nonzero().flatten().tolist()) == top  # exactly the top-k positions, nothing else
            kept = part[sorted(top)]
            least, largest = float(kept.abs().min()), float(kept.abs().max())
            step = (largest - least) / (codec.levels - 1)
            sent = got[sorted(top)]
            assert torch.equal(sent.sign(), kept.sign())
            assert float((sent - kept).abs().max()) <= step / 2 * (1 + 1e-5) + 1e-7
            levels = torch.tensor([least + j * step for j in range(codec.levels)])
            assert all(float((levels - m).abs().min()) <= 1e-6 * largest for m in sent.abs())
    # 2 bits: two magnitudes per block, the least and the largest kept; values on them come back exactly
    on_grid = torch.tensor([0.0, -3.0, 1.0, 0.25, 3.0, -1.0, 0.5, 0.0])
    two = SparseCodec(density=0.5, value_bits=2, block=8)
    assert torch.equal(two.decode(two.encode(on_grid)), torch.tensor([0.0, -3, 1, 0, 3, -1, 0, 0]))


def test_positions_and_codes_pack_to_exactly_their_bits():
    g = torch.Generator().manual_seed(0)
    for width in range(1, 17):
        for count in (0, 1, 3, 8, 37):
            values = torch.randint(0, 1 << width, (count,), generator=g)
            packed = pack_bits(values, width)
            assert packed.numel() == -(-count * width // 8)
            assert torch.equal(unpack_bits(packed, width, count), values)
    assert pack_bits(torch.tensor([1, 0, 3]), 2).tolist() == [0b110001]  # little-endian, value 0 in the low bits


def test_a_non_finite_value_is_sent_and_poisons_only_its_block():
    codec = SparseCodec(density=0.25, block=8)
    x = torch.arange(1.0, 17.0)
    x[3] = float("nan")
    back = codec.decode(codec.encode(x))
    assert back[:8].isnan().sum() == 2 and back[3].isnan()  # sent (counted as the largest), with its block's other
    assert torch.equal(back[8:], codec.decode(codec.encode(torch.arange(1.0, 17.0)))[8:])  # the next block: finite


@pytest.mark.parametrize("decay", [1.0, 0.9])
def test_error_feedback_keeps_exactly_what_was_not_sent(decay):
    codec = SparseCodec(density=0.03, value_bits=2, block=128)
    feedback = ErrorFeedback(codec, decay=decay)
    g = torch.Generator().manual_seed(3)
    residual = torch.zeros(500)
    true, sent = torch.zeros(500, dtype=torch.float64), torch.zeros(500, dtype=torch.float64)
    for _ in range(200):
        x = torch.randn(500, generator=g)
        corrected = x + residual * decay if decay != 1 else x + residual
        payload = feedback.encode("k", x)
        assert torch.equal(codec.decode(payload), codec.decode(codec.encode(corrected)))  # x plus the residual
        residual = corrected - codec.decode(payload)
        assert torch.equal(feedback.residuals["k"], residual)
        true += x.double()
        sent += codec.decode(payload).double()
    if decay == 1:  # Σ sent = Σ x − the last residual
        torch.testing.assert_close(sent + residual.double(), true, rtol=0, atol=1e-3)


def test_sparse_knobs_are_checked_and_name_their_field():
    with pytest.raises(ValueError, match="sync.diloco.sparse_value_bits must be 2, 4 or 8"):
        DiLoCoConfig(sparse_density=0.02, sparse_value_bits=3)
    with pytest.raises(ValueError, match="sync.diloco.sparse_density must be <= 0.5"):
        DiLoCoConfig(sparse_density=0.6)
    with pytest.raises(ValueError, match="sync.diloco.sparse_block applies to the sparse outer update only"):
        DiLoCoConfig(sparse_block=1024)
    with pytest.raises(ValueError, match="sync.diloco.sparse_keep_unsent applies to the sparse outer update only"):
        DiLoCoConfig(sparse_keep_unsent=True)
    with pytest.raises(ValueError, match="sync.compression 'int4' and sync.diloco.sparse_density exclude each other"):
        SyncConfig(strategy=SyncStrategy.DILOCO, compression=Compression.INT4, diloco=DiLoCoConfig(sparse_density=0.02))
    assert sparse_codec_of(DiLoCoConfig()) is None
    assert sparse_codec_of(DiLoCoConfig(sparse_density=0.02, sparse_value_bits=4)) == SparseCodec(0.02, 4, 4096)


# -- sparse DiLoCo against a single-process reference ------------------------------------------------------------

OPTIM = OptimConfig(lr=0.05, weight_decay=0.1, grad_clip=0.5, warmup_steps=0)
CHUNK_MB = 40 / 2**20  # 10 elements per inter-DC chunk: segments split into chunks
BLOCK = 16  # ... and chunks of 10 into one short block each
PLAIN = dict(inner_steps=3, outer_lr=0.7, outer_momentum=0.9, sparse_density=0.25, sparse_value_bits=2,
             sparse_block=BLOCK)  # fmt: skip
KEEP_UNSENT = dict(inner_steps=3, outer_lr=1.0, outer_momentum=0.0, sparse_density=0.25, sparse_block=BLOCK,
                   sparse_keep_unsent=True, sparse_error_decay=0.8)  # fmt: skip
KEEP_UNSENT_STREAMING = dict(inner_steps=4, fragments=2, overlap_steps=1, merge=OuterMerge.KEEP_PROGRESS,
                             outer_lr=0.7, outer_momentum=0.9, sparse_density=0.25, sparse_block=BLOCK,
                             sparse_keep_unsent=True)  # fmt: skip
STREAMING = dict(inner_steps=4, fragments=2, overlap_steps=1, merge=OuterMerge.MIX, outer_lr=0.8, outer_momentum=0.5,
                 sparse_density=0.3, sparse_value_bits=4, sparse_block=BLOCK, sparse_error_decay=0.9)  # fmt: skip


def _sync(strategy: SyncStrategy, knobs: dict, chunk_mb: float = CHUNK_MB) -> SyncConfig:
    return SyncConfig(strategy=strategy, inter_dc_chunk_mb=chunk_mb,
                      diloco=DiLoCoConfig(**knobs))  # fmt: skip


def _engine(rank: int, dcs: tuple[str, ...], sync: SyncConfig) -> DiLoCoSync:
    return DiLoCoSync(toy_model(0), DCGroups(DCLayout(dcs), rank), sync, OPTIM)


def _run(rank, world, dcs, sync, steps):
    e = _engine(rank, dcs, sync)
    stats = train_steps(e, rank, world, steps=steps, micro=2)
    e.synchronize()
    out = params_of(e.model), e.local_shard(steps), [s.inter_dc_bytes for s in stats], e.chunk_layout()
    e.close()
    e.groups.destroy()
    return out


class SparseReference:
    """One AdamW replica per datacenter; every sync cuts each datacenter's fp32 delta ``anchor - theta`` into the
    chunks the wire sends (``chunks``: each chunk's parameter elements, as the engine's ranks report them), encodes
    each chunk with that datacenter's own residual, sums the decoded chunks in datacenter order, and steps the outer
    parameters on the mean (Nesterov SGD, as torch's); the weights then become the outer ones (or the paper's mix
    when landing late)."""

    def __init__(self, dcs: tuple[str, ...], cfg: DiLoCoConfig, layouts: list[list]) -> None:
        self.layout, self.cfg = DCLayout(dcs), cfg
        self.replicas = {dc: toy_model(0) for dc in self.layout.dcs}
        self.opts = {dc: build_adamw(m, OPTIM) for dc, m in self.replicas.items()}
        self.layouts = layouts
        self.chunks: dict[int, dict] = {}
        """fragment → {chunk key: its parts (parameter, first element, elements)}, every rank's chunks."""
        for rank_chunks in layouts:
            for f, key, parts in rank_chunks:
                self.chunks.setdefault(f, {})[key] = parts
        self.fragments = {f: sorted({name for parts in chunks.values() for name, _, _ in parts})
                          for f, chunks in self.chunks.items()}  # fmt: skip
        self.schedule = FragmentSchedule(cfg.inner_steps, cfg.fragments, cfg.overlap_steps)
        self.codec = sparse_codec_of(cfg)
        self.anchor = self._flat(self.layout.dcs[0])
        self.momentum = {n: torch.zeros_like(a) for n, a in self.anchor.items()}
        self.residual: dict[tuple[str, object], torch.Tensor] = {}
        """(datacenter, chunk key) → what that datacenter has not yet sent of it."""
        self.mean: dict[int, dict[str, torch.Tensor]] = {}
        self.started: dict[str, dict[str, torch.Tensor]] = {}
        """datacenter → its weights when each parameter's last sync started (the keep-progress merge)."""
        self.before: dict[int, dict[tuple[str, object], torch.Tensor]] = {}
        """Per fragment in flight: its residuals from before its sync encoded them (what a snapshot saves)."""

    def _flat(self, dc: str) -> dict[str, torch.Tensor]:
        return {n: p.detach().reshape(-1).clone() for n, p in self.replicas[dc].named_parameters()}

    def _inner_step(self, step: int) -> None:
        layout = self.layout
        for dc, model in self.replicas.items():
            for r in layout.ranks_in(dc):
                share = rank_slice(GLOBAL_BATCH, r, layout.world_size)
                x, y = toy_batch(step, share.start, share.stop)
                (share_loss(model, x, y) * layout.world_size / len(layout.ranks_in(dc))).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.grad_clip)
            for g in self.opts[dc].param_groups:
                g["lr"] = lr_of(step)
            self.opts[dc].step()
            self.opts[dc].zero_grad()

    def _start(self, f: int) -> dict[str, torch.Tensor]:
        thetas = {dc: self._flat(dc) for dc in self.layout.dcs}
        for dc in self.layout.dcs:
            self.started.setdefault(dc, {}).update({n: thetas[dc][n] for n in self.fragments[f]})
        total = {n: torch.zeros_like(self.anchor[n]) for n in self.fragments[f]}
        for key, parts in self.chunks[f].items():
            for i, dc in enumerate(self.layout.dcs):  # decoded and added in datacenter order, as every owner does
                x = torch.cat([self.anchor[n][a : a + m] - thetas[dc][n][a : a + m] for n, a, m in parts])
                held = None if self.cfg.sparse_keep_unsent else self.residual.get((dc, key))  # (in the weights)
                corrected = x if held is None else x + (held if self.cfg.sparse_error_decay == 1 else
                                                        held * self.cfg.sparse_error_decay)  # fmt: skip
                sent = self.codec.decode(self.codec.encode(corrected))
                self.residual[(dc, key)] = corrected - sent
                at = 0
                for n, a, m in parts:
                    total[n][a : a + m] = sent[at : at + m] if i == 0 else total[n][a : a + m] + sent[at : at + m]
                    at += m
        return {n: t / self.layout.num_dcs for n, t in total.items()}

    def _unsent(self, dc: str, f: int) -> dict[str, torch.Tensor]:
        out = {n: torch.zeros_like(self.anchor[n]) for n in self.fragments[f]}
        for key, parts in self.chunks[f].items():
            at = 0
            for n, a, m in parts:
                out[n][a : a + m] = self.residual[(dc, key)][at : at + m]
                at += m
        return out

    def _land(self, f: int, mean: dict[str, torch.Tensor]) -> None:
        mu, lr = self.cfg.outer_momentum, self.cfg.outer_lr
        for n in self.fragments[f]:
            self.momentum[n].mul_(mu).add_(mean[n])
            self.anchor[n].sub_(mean[n].add(self.momentum[n], alpha=mu), alpha=lr)
        for dc in self.layout.dcs:
            unsent = self._unsent(dc, f) if self.cfg.sparse_keep_unsent else {}
            theta = self._flat(dc)
            params = dict(self.replicas[dc].named_parameters())
            for n in self.fragments[f]:
                joined = self.anchor[n]
                if self.cfg.sparse_keep_unsent:  # the datacenter keeps what it did not send: anchor - decay x residual
                    joined = joined - unsent[n] * self.cfg.sparse_error_decay
                if not self.cfg.overlap_steps:
                    merged = joined
                elif self.cfg.merge is OuterMerge.KEEP_PROGRESS:
                    merged = theta[n] - self.started[dc][n] + joined
                else:
                    merged = theta[n].mul(self.cfg.mix_alpha).add_(joined, alpha=1 - self.cfg.mix_alpha)
                with torch.no_grad():
                    params[n].copy_(merged.view(params[n].shape))

    def run(self, steps: int, *, average_at_end: bool = False) -> None:
        """``average_at_end``: the last step starts no sync, lands those in flight, and every datacenter's weights
        become the outer weights less the datacenters' mean of ``anchor - theta`` plus what error feedback would add
        to the next delta (``decay × residual``; nothing where the weights keep the residual)."""
        for step in range(steps):
            self._inner_step(step)
            done = step + 1
            closing = average_at_end and done == steps
            for f in [] if closing else self.schedule.starting(done):
                self.before[f] = {k: r for k, r in self.residual.items() if k[1] in self.chunks[f]}
                self.mean[f] = self._start(f)
            for f in sorted(self.mean) if closing else self.schedule.landing(done):
                self.before.pop(f)
                self._land(f, self.mean.pop(f))
        if average_at_end:
            decay = 0.0 if self.cfg.sparse_keep_unsent else self.cfg.sparse_error_decay
            deltas = []
            for dc in self.layout.dcs:
                theta, held = self._flat(dc), self.residuals(dc)
                deltas.append({n: self.anchor[n] - theta[n] + decay * held[n] for n in self.anchor})
            for n, a in self.anchor.items():
                a.sub_(torch.stack([d[n] for d in deltas]).mean(0))
            for model in self.replicas.values():
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        p.copy_(self.anchor[n].view(p.shape))
            self.residual.clear()

    def bytes_sent(self, rank: int, steps: int) -> list[int]:
        """Per step, the sparse payload bytes ``rank`` puts on inter-DC links: its chunks of the fragments whose
        sync starts, each payload once to every other datacenter."""
        out = []
        for done in range(1, steps + 1):
            sent = 0
            for f in self.schedule.starting(done):
                for g, _, parts in self.layouts[rank]:
                    if g == f:
                        sent += (self.layout.num_dcs - 1) * self.codec.payload_bytes(sum(m for _, _, m in parts))
            out.append(sent)
        return out

    def residuals(self, dc: str) -> dict[str, torch.Tensor]:
        """``dc``'s settled residuals by parameter element (a fragment in flight: from before its sync)."""
        out = {n: torch.zeros_like(a) for n, a in self.anchor.items()}
        for f, chunks in self.chunks.items():
            source = self.before.get(f, self.residual)
            for key, parts in chunks.items():
                held = source.get((dc, key))
                if held is None:
                    continue
                at = 0
                for n, a, m in parts:
                    out[n][a : a + m] = held[at : at + m]
                    at += m
        return out


@pytest.mark.parametrize("dcs, strategy, knobs, steps", [
    (("a", "a", "b"), SyncStrategy.DILOCO, PLAIN, 7),                  # 2 DCs, 2 + 1 ranks: two outer steps, then one
    (("a", "a", "b", "c"), SyncStrategy.STREAMING_DILOCO, STREAMING, 10),  # 3 DCs, 2 + 1 + 1: fragments land late
    (("a", "b", "b"), SyncStrategy.DILOCO, KEEP_UNSENT, 7),  # the residual in the weights
    (("a", "b", "c", "c"), SyncStrategy.STREAMING_DILOCO, KEEP_UNSENT_STREAMING, 9),
], ids=["2dc-uneven-plain", "3dc-uneven-streaming", "2dc-uneven-keep-unsent", "3dc-uneven-keep-unsent-streaming"])  # fmt: skip
def test_sparse_diloco_matches_a_single_process_reference(dcs, strategy, knobs, steps):
    sync = _sync(strategy, knobs)
    out = run_processes(_run, len(dcs), dcs, sync, steps)
    ref = SparseReference(dcs, sync.outer, [layout for *_, layout in out])
    ref.run(steps)
    for rank, (params, _, _, _) in enumerate(out):
        for name, t in params.items():
            torch.testing.assert_close(t, dict(ref.replicas[dcs[rank]].named_parameters())[name].detach(),
                                       rtol=1e-5, atol=1e-6)  # fmt: skip
    shapes = {n: t.shape for n, t in out[0][0].items()}
    _, optimizer = assemble([shard for _, shard, _, _ in out], shapes)
    for rank, (_, _, sent, _) in enumerate(out):  # on the wire: each rank's chunks of the fragments that started,
        assert sent == ref.bytes_sent(rank, steps)  # each one payload to every other datacenter
    if sync.outer.sparse_keep_unsent:  # the weights hold the residuals: nothing else to save
        assert FEEDBACK_KEY not in optimizer
        return
    held = optimizer[FEEDBACK_KEY]
    assert held["compression"] == "sparse" and sorted(held["residuals"]) == sorted(set(dcs))
    for dc in set(dcs):
        expected = ref.residuals(dc)
        assert any(float(t.abs().max()) > 0 for t in expected.values())  # something was held back
        for name, t in held["residuals"][dc].items():
            torch.testing.assert_close(t, expected[name], rtol=1e-5, atol=1e-6)


def _run_to_the_end(rank, world, dcs, sync, steps):
    e = _engine(rank, dcs, sync)
    stats = train_steps(e, rank, world, steps=steps, micro=2, job_ends=True)
    e.synchronize()
    out = params_of(e.model), e.local_shard(steps), [s.inter_dc_bytes for s in stats], e.chunk_layout()
    e.close()
    e.groups.destroy()
    return out


@pytest.mark.parametrize("dcs, strategy, knobs, steps", [
    (("a", "a", "b"), SyncStrategy.DILOCO, PLAIN, 8),  # the residual, decayed, goes into the average
    (("a", "b", "c", "c"), SyncStrategy.STREAMING_DILOCO, KEEP_UNSENT_STREAMING, 9),  # the weights hold it
], ids=["2dc-uneven-plain", "3dc-uneven-keep-unsent-streaming"])  # fmt: skip
def test_sparse_diloco_ends_with_the_reference_average_of_the_datacenters(dcs, strategy, knobs, steps):
    sync = _sync(strategy, {**knobs, "final_average": FinalAverage.FP32})
    out = run_processes(_run_to_the_end, len(dcs), dcs, sync, steps)
    ref = SparseReference(dcs, sync.outer, [layout for *_, layout in out])
    ref.run(steps, average_at_end=True)
    for params, _, _, _ in out:
        for name, t in params.items():
            torch.testing.assert_close(t, dict(ref.replicas[dcs[0]].named_parameters())[name].detach(),
                                       rtol=1e-5, atol=1e-6)  # fmt: skip
    _, optimizer = assemble([shard for _, shard, _, _ in out], shapes={n: t.shape for n, t in out[0][0].items()})
    if FEEDBACK_KEY in optimizer:  # what error feedback held went into the average
        assert all(float(t.abs().max()) == 0 for r in optimizer[FEEDBACK_KEY]["residuals"].values() for t in r.values())


# -- recovery: the residual of the datacenter that is still whole ---------------------------------------------

RECOVERY = _sync(SyncStrategy.STREAMING_DILOCO, dict(inner_steps=4, fragments=2, overlap_steps=1, outer_momentum=0.9,
                                                     sparse_density=0.25, sparse_block=BLOCK))  # fmt: skip


def _residual_now(e: DiLoCoSync) -> dict[tuple[str, int, int], torch.Tensor]:
    """What the comm holds now (post-encoding), by (parameter, first element, last): the settled override left out."""
    out = {}
    for _, key, parts in e.chunk_layout():
        residual, at = e.comm.residual(*key), 0
        for name, start, n in parts:
            out[(name, start, start + n)] = torch.zeros(n) if residual is None else residual[at : at + n].clone()
            at += n
    return out


def _before_loss(rank, world):
    e = _engine(rank, ("a", "a", "b", "b"), RECOVERY)
    train_steps(e, rank, world, steps=5, micro=2)  # fragment 0 landed after step 3, fragment 1 after step 5
    at5 = e.local_shard(5).feedback
    batches = micro_batches(5, rank, world, 2)
    for i, (x, y) in enumerate(batches):
        last = i == len(batches) - 1
        with e.micro_batch(last_micro_batch=last):
            e.backward(share_loss(e.model, x, y), last_micro_batch=last)
    stats = e.step(lr_of(5), snapshot_as=6)  # fragment 0's sync starts: the in-memory snapshot of step 6
    assert list(e.in_flight) == [0] and stats.inter_dc_bytes > 0 and stats.shard is not None
    now = _residual_now(e)
    e.close()
    e.groups.destroy()
    return at5, stats.shard, now


def _after_loss(rank, world, packed, shapes):
    """The survivors (DC a whole: ranks 0, 1; DC b: rank 2 of its two) rebuild the state from their packed
    snapshots as an epoch's re-formation does, into a layout of 2 + 1 ranks, and report the residuals they hold."""
    from meridian.workers.elastic.state_exchange import rebuild_state

    e = _engine(rank, ("a", "a", "b"), RECOVERY)
    e.synchronize()
    state = rebuild_state(packed[rank], dc=e.groups.dc, needs=e.owned_ranges(), shapes=shapes)
    state.load(e.model, e)
    (held,) = e.local_shard(6).feedback
    out = {p.name: (p.start, p.stop, p.value) for p in held.pieces}, e.groups.dc
    e.close()
    e.groups.destroy()
    return out


def test_a_node_loss_keeps_the_residual_of_the_datacenter_that_is_still_whole():
    before = run_processes(_before_loss, 4)
    for at5, snapshot, now in before:
        (settled,), (then,) = snapshot.feedback, at5
        # the snapshot holds the residuals from before the sync in flight: the same as one step earlier, although
        # fragment 0's encoding has replaced them in the comm
        assert [(p.name, p.start, p.stop) for p in settled.pieces] == [(p.name, p.start, p.stop) for p in then.pieces]
        for p, q in zip(settled.pieces, then.pieces, strict=True):
            assert torch.equal(p.value, q.value)
        assert any(not torch.equal(p.value, now[(p.name, p.start, p.stop)]) for p in settled.pieces)
        # the packed form (what snapshot files and the survivors' exchange carry) keeps them
        desc, flat = pack(snapshot)
        back = unpack(desc, flat)
        assert back.feedback[0].dc == settled.dc and back.feedback[0].compression == "sparse"
        for p, q in zip(back.feedback[0].pieces, settled.pieces, strict=True):
            assert (p.name, p.start, p.stop) == (q.name, q.start, q.stop) and torch.equal(p.value, q.value)
    # DC b loses rank 3: DC a (ranks 0, 1) is whole
    shapes = {n: p.shape for n, p in toy_model(0).named_parameters()}
    packed = [pack(before[r][1]) for r in (0, 1, 2)]
    after = run_processes(_after_loss, 3, packed, shapes)
    saved_a = {}
    for r in (0, 1):
        for p in before[r][1].feedback[0].pieces:
            saved_a.setdefault(p.name, torch.zeros(shapes[p.name].numel()))[p.start : p.stop] = p.value
    assert any(float(t.abs().max()) > 0 for t in saved_a.values())
    for held, dc in after:
        for name, (start, stop, value) in held.items():
            if dc == "a":  # the whole datacenter: every residual back, exactly, in the new layout's shards
                assert torch.equal(value, saved_a[name][start:stop]), name
            else:  # the broken one: restarted at zero (half of its residuals died with rank 3)
                assert torch.equal(value, torch.zeros_like(value)), name
