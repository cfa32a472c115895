"""In-memory snapshots: the shards of the survivors rebuild the whole state, which resumes anywhere.

Every rank trains the toy model on 2 + 2 (sharded AdamW, overlapped) and snapshots its shard after the last
step. Pooling the shards of any set of ranks that still covers one element of everything (e.g. one whole
DC plus a rank of the other) gives back exactly the full state; a set that misses a shard says which
element is gone. The pooled state loaded into 2 + 1 continues like an uninterrupted single-process run.
"""

from __future__ import annotations

import pytest
import torch
from sync_helpers import (
    lr_of,
    max_rel_diff,
    micro_batches,
    params_of,
    reference_params,
    share_loss,
    toy_model,
    train_steps,
)

from meridian.workers.contracts.config import OptimConfig, SyncConfig, SyncStrategy
from meridian.workers.distributed.layout import DCGroups, DCLayout
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.state.replica_state import IncompleteState, assemble
from meridian.workers.sync.build import build_sync

OPTIM = OptimConfig(lr=0.05, weight_decay=0.1, grad_clip=0.5, warmup_steps=0)
STEPS, MICRO = 3, 2
FP32_TOL = 1e-5


def _engine(rank, dcs, strategy=SyncStrategy.HIERARCHICAL):
    sync = SyncConfig(strategy=strategy, overlap=True, bucket_mb=64 / 2**20, inter_dc_chunk_mb=40 / 2**20)
    return build_sync(toy_model(0), DCGroups(DCLayout(dcs), rank), sync, OPTIM)


def _snapshot_run(rank, world, dcs, strategy):
    engine = _engine(rank, dcs, strategy)
    train_steps(engine, rank, world, STEPS - 1, MICRO)
    batches = micro_batches(STEPS - 1, rank, world, MICRO)  # the last step by hand, to snapshot it
    for i, (x, y) in enumerate(batches):
        last = i == len(batches) - 1
        with engine.micro_batch(last_micro_batch=last):
            engine.backward(share_loss(engine.model, x, y), last_micro_batch=last)
    shard = engine.step(lr_of(STEPS - 1), snapshot_as=STEPS).shard
    full = engine.optimizer_state()
    engine.synchronize()
    params = params_of(engine.model.module if hasattr(engine.model, "module") else engine.model)
    engine.close()
    engine.groups.destroy()
    return {"shard": shard, "full": full, "params": params}


def _resume_run(rank, world, dcs, params, optimizer):
    engine = _engine(rank, dcs)
    engine.load_weights(engine.model, params)
    engine.load_optimizer_state(optimizer)
    train_steps(engine, rank, world, STEPS, MICRO, first_step=STEPS)
    engine.synchronize()
    out = params_of(engine.model)
    engine.close()
    engine.groups.destroy()
    return out


@pytest.fixture(scope="module")
def sharded():
    return run_processes(_snapshot_run, 4, ("a", "a", "b", "b"), SyncStrategy.HIERARCHICAL)


def _shapes():
    return {n: p.shape for n, p in toy_model(0).named_parameters()}


def test_shard_is_one_nth_and_taken_at_the_step(sharded):
    assert all(out["shard"].step == STEPS and out["shard"].adam_step == STEPS for out in sharded)
    whole = sum(p.numel() for p in toy_model(0).parameters())
    for dc in ((0, 1), (2, 3)):
        assert sum(sum(p.stop - p.start for p in sharded[r]["shard"].pieces) for r in dc) == whole


@pytest.mark.parametrize("survivors", [(0, 2, 3), (1, 2, 3), (0, 1, 3), (0, 1), (0, 3), (1, 2)])
def test_survivors_that_cover_every_shard_rebuild_the_exact_state(sharded, survivors):
    params, optimizer = assemble([sharded[r]["shard"] for r in survivors], _shapes())
    full = sharded[0]["full"]
    assert optimizer["step"] == full["step"] == STEPS
    for name, p in sharded[0]["params"].items():
        assert torch.equal(params[name], p), name
        for m in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer["params"][name][m], full["params"][name][m]), (name, m)


@pytest.mark.parametrize("survivors", [(0, 2), (1, 3), (0,), ()])
def test_survivors_missing_a_shard_are_refused_by_name(sharded, survivors):
    with pytest.raises(IncompleteState, match="no surviving rank holds|no rank holds"):
        assemble([sharded[r]["shard"] for r in survivors], _shapes())


def test_pooled_state_resumes_on_2_plus_1_like_one_uninterrupted_run(sharded):
    params, optimizer = assemble([sharded[r]["shard"] for r in (0, 2, 3)], _shapes())
    resumed = run_processes(_resume_run, 3, ("a", "a", "b"), params, optimizer)
    ref = reference_params(2 * STEPS, OPTIM)
    for out in resumed:
        assert max_rel_diff(out, ref) < FP32_TOL


def test_flat_engine_snapshots_the_whole_replica():
    outs = run_processes(_snapshot_run, 2, ("a", "b"), SyncStrategy.FLAT)
    params, optimizer = assemble([outs[1]["shard"]], _shapes())  # one survivor is enough
    for name, p in outs[0]["params"].items():
        assert torch.equal(params[name], p), name
    assert optimizer["step"] == STEPS


@pytest.mark.parametrize("dcs", [("a", "b"), ("a", "a", "a", "b")], ids=["1+1", "3+1"])
def test_durable_checkpoint_of_2_plus_2_reshards_onto_other_dc_sizes(sharded, tmp_path, dcs):
    from meridian.workers.state import checkpoint as ckpt_io

    written = ckpt_io.Checkpoint(step=STEPS, model=sharded[0]["params"], optimizer=sharded[0]["full"],
                                 fingerprint={"toy": True})
    ckpt_io.save(str(tmp_path), written)
    loaded = ckpt_io.load_latest(str(tmp_path))
    assert loaded is not None and loaded.step == STEPS
    resumed = run_processes(_resume_run, len(dcs), dcs, loaded.model, loaded.optimizer)
    ref = reference_params(2 * STEPS, OPTIM)
    for out in resumed:
        assert max_rel_diff(out, ref) < FP32_TOL


def _same_shard(a, b) -> bool:
    def same(p, q):
        return ((p.name, p.start, p.stop, tuple(p.moments)) == (q.name, q.start, q.stop, tuple(q.moments))
                and torch.equal(p.value, q.value) and all(torch.equal(p.moments[m], q.moments[m]) for m in p.moments))

    if (a.step, a.adam_step, len(a.pieces)) != (b.step, b.adam_step, len(b.pieces)):
        return False
    if (a.outer is None) != (b.outer is None):
        return False
    outer = a.outer is None or ((a.outer.dc, a.outer.inner_steps_done, len(a.outer.pieces)) ==
                                (b.outer.dc, b.outer.inner_steps_done, len(b.outer.pieces))
                                and all(same(p, q) for p, q in zip(a.outer.pieces, b.outer.pieces, strict=True)))  # fmt: skip
    return outer and all(same(p, q) for p, q in zip(a.pieces, b.pieces, strict=True))


def test_a_packed_shard_unpacks_to_the_same_pieces(sharded):
    from meridian.workers.state.replica_state import LocalShard, OuterShard, StatePiece, pack, unpack

    for r in sharded:
        desc, flat = pack(r["shard"])
        assert flat.dtype == torch.float32 and flat.numel() == r["shard"].nbytes // 4
        padded = torch.cat([flat, torch.full((5,), float("nan"))])  # what a gather of longer shards hands back
        assert _same_shard(unpack(desc, padded), r["shard"])
    fresh = LocalShard(0, 0, (StatePiece("w", 0, 3, torch.arange(3.0)),))  # before the first step: no moments
    outer = OuterShard("dc-b", 7, (StatePiece("w", 0, 3, torch.ones(3), {"momentum": torch.full((3,), 2.0)}),))
    for shard in (fresh, LocalShard(4, 4, fresh.pieces, outer)):
        assert _same_shard(unpack(*pack(shard)), shard)


def _gather_run(rank, world, shards):
    from meridian.workers.elastic.state_exchange import gather_shards
    from meridian.workers.state.replica_state import pack

    mine = None if shards[rank] is None else pack(shards[rank])
    return gather_shards(mine, [None if s is None else pack(s)[0] for s in shards])


def test_every_rank_gathers_every_rank_s_shard_or_none(sharded):
    shards = [sharded[0]["shard"], None, sharded[2]["shard"]]  # rank 1 holds no snapshot of the step
    for gathered in run_processes(_gather_run, 3, shards):
        assert gathered[1] is None
        assert _same_shard(gathered[0], shards[0]) and _same_shard(gathered[2], shards[2])
    assert run_processes(_gather_run, 2, [None, None]) == [[None, None], [None, None]]


def _offers_run(rank, world, sizes, inline):
    from meridian.workers.elastic.state_exchange import share_offers
    from meridian.workers.state.exchange_plan import Offer

    return share_offers(Offer(f"dc-{rank}", {"blob": "x" * sizes[rank]}, None), inline_bytes=inline)


@pytest.mark.parametrize("sizes", [(10, 20, 30), (10, 5000, 30), (3000, 5000, 4000)], ids=["fit", "one-big", "all-big"])
def test_every_rank_gets_every_offer_whether_or_not_it_fits_the_first_round(sizes):
    for offers in run_processes(_offers_run, 3, sizes, 1024):
        assert [o.dc for o in offers] == ["dc-0", "dc-1", "dc-2"]
        assert [len(o.held["blob"]) for o in offers] == list(sizes)


def _rebuild_run(rank, world, dcs, shards, strategy):
    from meridian.workers.elastic.state_exchange import rebuild_state
    from meridian.workers.state.replica_state import pack

    engine = _engine(rank, dcs, strategy)
    model = engine.model.module if hasattr(engine.model, "module") else engine.model
    state = rebuild_state(None if shards[rank] is None else pack(shards[rank]), dc=dcs[rank],
                          needs=engine.owned_ranges(), shapes={n: p.shape for n, p in model.named_parameters()})
    state.load(model, engine)
    engine.synchronize()
    loaded = params_of(model)
    train_steps(engine, rank, world, STEPS, MICRO, first_step=STEPS)
    engine.synchronize()
    out = {"loaded": loaded, "trained": params_of(model), "sent": state.sent_bytes, "cross": state.cross_dc_bytes}
    engine.close()
    engine.groups.destroy()
    return out


@pytest.mark.parametrize("survivors,dcs", [((0, 2, 3), ("a", "b", "b")), ((0, 1, 3), ("a", "a", "b")),
                                           ((1, 2), ("a", "b")), ((0, 3, None), ("a", "b", "b"))],
                         ids=["2+1-lost-a", "2+1-lost-b", "1+1", "newcomer"])  # fmt: skip
def test_survivors_exchange_only_what_the_new_layout_needs_and_resume_exactly(sharded, survivors, dcs):
    shards = [None if r is None else sharded[r]["shard"] for r in survivors]
    outs = run_processes(_rebuild_run, len(dcs), dcs, shards, SyncStrategy.HIERARCHICAL)
    ref = reference_params(2 * STEPS, OPTIM)
    whole = 4 * sum(p.numel() for p in toy_model(0).parameters())  # one replica's fp32 values
    for out in outs:
        for name, p in sharded[0]["params"].items():
            assert torch.equal(out["loaded"][name], p), name
        assert max_rel_diff(out["trained"], ref) < FP32_TOL
    # Every rank needs the whole values and (of the moments) its new share, and has its own shard already: the
    # exchange sends no rank more than it lacks, and the 3-rank epochs less than gathering every shard on
    # every rank (the whole state, once per datacenter, to each rank).
    sent = outs[0]["sent"]
    assert all(o["sent"] == sent for o in outs)
    held = [0 if r is None else sharded[r]["shard"].nbytes for r in survivors]
    assert sent <= sum(3 * whole - h for h in held)
    gather_all = sum(held) * (len(dcs) - 1)
    assert sent <= gather_all and (len(dcs) < 3 or sent < gather_all), (sent, gather_all)
    if dcs == ("a", "b", "b") and None not in survivors:
        # dc-a's lone rank has half a replica; only the other half (values and moments) crosses to it, and dc-b's
        # ranks take what they lack from each other
        assert outs[0]["cross"] == 3 * whole - held[0]


def test_a_replicated_optimizer_loads_its_own_snapshot_and_sends_only_to_a_newcomer():
    outs = run_processes(_snapshot_run, 2, ("a", "b"), SyncStrategy.FLAT)
    shards = [outs[0]["shard"], None]
    rebuilt = run_processes(_rebuild_run, 2, ("a", "b"), shards, SyncStrategy.FLAT)
    for out in rebuilt:
        for name, p in outs[0]["params"].items():
            assert torch.equal(out["loaded"][name], p), name
    assert rebuilt[0]["sent"] == outs[0]["shard"].nbytes == rebuilt[0]["cross"]  # all of it, once, to the newcomer
    same = run_processes(_rebuild_run, 2, ("a", "b"), [outs[0]["shard"], outs[1]["shard"]], SyncStrategy.FLAT)
    assert same[0]["sent"] == 0 and torch.equal(same[1]["loaded"]["l1.weight"], outs[1]["params"]["l1.weight"])


def _diloco_shard(dc: str, scale: float):
    from meridian.workers.state.replica_state import LocalShard, OuterShard, StatePiece

    def pieces(moment):
        return (StatePiece("w", 0, 5, torch.arange(5.0) * scale, {moment: torch.ones(5) * scale}),
                StatePiece("b", 0, 1, torch.ones(1) * scale, {moment: torch.ones(1)}))  # fmt: skip

    inner = tuple(StatePiece(p.name, p.start, p.stop, p.value, {"exp_avg": m, "exp_avg_sq": m})
                  for p in pieces("x") for m in [p.moments["x"]])  # fmt: skip
    return LocalShard(4, 4, inner, OuterShard(dc, 4, pieces("momentum")))


def _diloco_rebuild_run(rank, world, dcs, scales):
    from meridian.workers.elastic.state_exchange import rebuild_state
    from meridian.workers.state.replica_state import pack

    state = rebuild_state(pack(_diloco_shard(dcs[rank], scales[rank])), dc=dcs[rank], needs=None,
                          shapes={"w": torch.Size([5]), "b": torch.Size([1])})
    return state.weights, state.optimizer["diloco"]["inner_steps_done"], state.sent_bytes, state.cross_dc_bytes


def test_diloco_snapshots_are_pooled_whole_and_their_bytes_counted_as_sent():
    outs = run_processes(_diloco_rebuild_run, 3, ("a", "b", "b"), (1.0, 2.0, 2.0))
    padded = 4 * (3 * 6 + 2 * 6)  # a packed shard: 6 values and 2 moments each, inner and outer (momentum only)
    for weights, done, sent, cross in outs:
        assert torch.equal(weights["w"], torch.arange(5.0))  # the first whole datacenter's inner state: dc a's
        assert done == 4
        assert sent == 6 * padded and cross == 4 * padded  # 3 ranks, 6 ordered pairs, 4 of them across
