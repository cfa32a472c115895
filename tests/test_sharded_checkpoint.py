"""DCP checkpoints: every rank writes its own shard (nothing gathered), every element once, and the state
loads into any other layout exactly as the gathered full state would."""

from __future__ import annotations

import random
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp
from sync_helpers import (
    lr_of,
    max_rel_diff,
    micro_batches,
    params_of,
    reference_params,
    share_loss,
    train_steps,
)
from test_replica_state import FP32_TOL, MICRO, OPTIM, STEPS, _resume_run, _shapes

from meridian.workers.contracts.config import SyncConfig, SyncStrategy
from meridian.workers.distributed.layout import DCGroups, DCLayout
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.state.sharded_checkpoint import (
    assign_writers,
    is_sharded,
    load_full,
    open_checkpoint,
    read_ranges,
    save_shard,
)
from meridian.workers.sync.build import build_sync


@pytest.mark.parametrize("seed", range(20))
def test_every_offered_element_is_written_exactly_once_and_evenly(seed):
    rng = random.Random(seed)
    offers = []
    for rank in range(rng.randint(1, 6)):
        for name in ("w", "b"):
            for _ in range(rng.randint(0, 3)):
                a = rng.randint(0, 90)
                offers.append((rank, name, a, a + rng.randint(1, 30)))
    written = assign_writers(offers)
    for name in ("w", "b"):
        offered = {i for _, n, a, b in offers if n == name for i in range(a, b)}
        got = [i for ranges in written.values() for n, a, b in ranges if n == name for i in range(a, b)]
        assert sorted(got) == sorted(offered)  # each element once
    for rank, ranges in written.items():  # a rank writes only what it holds
        for n, a, b in ranges:
            assert any(r == rank and n == m and s <= a and b <= e for r, m, s, e in offers)


def test_a_replicated_tensor_is_split_among_its_holders():
    assert assign_writers([(0, "w", 0, 10), (1, "w", 0, 10)]) == {0: [("w", 0, 5)], 1: [("w", 5, 10)]}
    # 2 + 1 sharded: DC a's halves, DC b's rank holds everything
    assert assign_writers([(0, "w", 0, 6), (1, "w", 6, 12), (2, "w", 0, 12)]) == {
        0: [("w", 0, 3)], 2: [("w", 3, 6), ("w", 9, 12)], 1: [("w", 6, 9)]}


def _engine(rank, dcs, strategy):
    sync = SyncConfig(strategy=strategy, overlap=True, bucket_mb=64 / 2**20, inter_dc_chunk_mb=40 / 2**20)
    from sync_helpers import toy_model

    return build_sync(toy_model(0), DCGroups(DCLayout(dcs), rank), sync, OPTIM)


def trained_shard(engine, rank, world):
    """Train ``STEPS`` steps; the rank's shard of the last one (taken by the step, as the loop takes it)."""
    train_steps(engine, rank, world, STEPS - 1, MICRO)
    batches = micro_batches(STEPS - 1, rank, world, MICRO)
    for i, (x, y) in enumerate(batches):
        last = i == len(batches) - 1
        with engine.micro_batch(last_micro_batch=last):
            engine.backward(share_loss(engine.model, x, y), last_micro_batch=last)
    return engine.step(lr_of(STEPS - 1), snapshot_as=STEPS).shard


def _save_run(rank, world, dcs, strategy, directory):
    engine = _engine(rank, dcs, strategy)
    shard = trained_shard(engine, rank, world)
    written = save_shard(directory, shard, rank=rank, datacenter=dcs[rank], shapes=_shapes(),
                         fingerprint={"toy": [1, 2]})
    full = engine.optimizer_state()  # the gathered state, as the reference
    engine.synchronize()
    params = params_of(engine.model.module if hasattr(engine.model, "module") else engine.model)
    engine.close()
    engine.groups.destroy()
    return {"full": full, "params": params, "written": written}


@pytest.mark.parametrize("strategy, dcs", [(SyncStrategy.HIERARCHICAL, ("a", "a", "b", "b")),
                                           (SyncStrategy.FLAT, ("a", "b"))], ids=["sharded-2+2", "flat-1+1"])
def test_each_rank_writes_its_share_and_the_checkpoint_equals_the_gathered_state(tmp_path, strategy, dcs):
    outs = run_processes(_save_run, len(dcs), dcs, strategy, str(tmp_path))
    path = outs[0]["written"]
    assert path is not None and all(o["written"] is None for o in outs[1:])
    assert (tmp_path / "latest").read_text() == path.name and is_sharded(str(path))
    # Every rank wrote its own file, and together one replica: values + 2 moments of every element, once.
    md = dcp.FileSystemReader(str(path)).read_metadata()
    per_file: dict[str, int] = {}
    for index, info in md.storage_data.items():
        n = next(c.sizes[0] for c in md.state_dict_metadata[index.fqn].chunks if c.offsets == index.offset)
        per_file[info.relative_path] = per_file.get(info.relative_path, 0) + n
    replica = 3 * sum(s.numel() for s in _shapes().values())
    assert len(per_file) == len(dcs) and sum(per_file.values()) == replica
    assert min(per_file.values()) >= replica / (2 * len(dcs)), per_file  # spread over the ranks

    ck = open_checkpoint(str(path))
    assert ck.step == ck.adam_step == STEPS and ck.fingerprint == {"toy": [1, 2]}
    params, optimizer = load_full(ck)
    full = outs[0]["full"]
    assert optimizer["step"] == full["step"] == STEPS
    for name, p in outs[0]["params"].items():
        assert torch.equal(params[name], p), name
        for m in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer["params"][name][m], full["params"][name][m]), (name, m)
    # Any element range reads alone, without the rest (what a rank of another layout needs).
    name = max(_shapes(), key=lambda n: _shapes()[n].numel())
    part = read_ranges(ck, [(name, 3, 17)]).pieces[0]
    assert torch.equal(part.value, params[name].reshape(-1)[3:17])
    assert torch.equal(part.moments["exp_avg"], full["params"][name]["exp_avg"].reshape(-1)[3:17])


def test_a_2_plus_2_checkpoint_resumes_on_3_plus_1_like_an_uninterrupted_run(tmp_path):
    run_processes(_save_run, 4, ("a", "a", "b", "b"), SyncStrategy.HIERARCHICAL, str(tmp_path))
    params, optimizer = load_full(open_checkpoint(str(tmp_path / f"step-{STEPS:08d}")))
    resumed = run_processes(_resume_run, 4, ("a", "a", "a", "b"), params, optimizer)
    ref = reference_params(2 * STEPS, OPTIM)
    for out in resumed:
        assert max_rel_diff(out, ref) < FP32_TOL


def _restore_run(rank, world, dcs, directory):
    from meridian.workers.elastic.durable import restore_latest

    engine = _engine(rank, dcs, SyncStrategy.HIERARCHICAL)
    done = restore_latest(directory, {"toy": [1, 2]}, engine.model, engine)
    owned = sum(b - a for _, a, b in engine.owned_ranges())
    restored = engine.optimizer_state()  # gathered inside the DC, to compare with the checkpoint's
    train_steps(engine, rank, world, STEPS, MICRO, first_step=STEPS)
    engine.synchronize()
    out = params_of(engine.model)
    engine.close()
    engine.groups.destroy()
    return done, owned, restored, out


def test_each_rank_of_another_layout_reads_the_weights_and_only_its_own_optimizer_state(tmp_path):
    run_processes(_save_run, 4, ("a", "a", "b", "b"), SyncStrategy.HIERARCHICAL, str(tmp_path))
    ck = open_checkpoint(str(tmp_path / f"step-{STEPS:08d}"))
    params, full = load_full(ck)
    dcs = ("a", "a", "a", "b")
    resumed = run_processes(_restore_run, 4, dcs, str(tmp_path))
    numel = sum(s.numel() for s in _shapes().values())
    for rank, (done, owned, restored, _) in enumerate(resumed):
        assert done.step == STEPS and done.bytes_stored == 3 * 4 * numel
        # the whole weights (every rank holds them) and the two moments of what it owns, nothing else
        assert owned == numel or dcs[rank] == "a"
        assert done.bytes_read == 4 * numel + 2 * 4 * owned
        assert restored["step"] == full["step"]
        for name in params:  # the state each DC holds after the load is the checkpoint's, exactly
            for m in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(restored["params"][name][m], full["params"][name][m]), (rank, name, m)
    assert sum(resumed[r][1] for r in (0, 1, 2)) == numel  # DC a's three ranks own it all, once
    assert resumed[3][0].bytes_read == resumed[3][0].bytes_stored  # DC b's single rank holds everything
    # (FSDP2 cuts each parameter's rows: on this toy's 1- to 7-row parameters DC a's first rank owns 45%)
    assert all(resumed[r][0].bytes_read < 0.75 * resumed[r][0].bytes_stored for r in (0, 1, 2))
    ref = reference_params(2 * STEPS, OPTIM)
    for *_, out in resumed:
        assert max_rel_diff(out, ref) < FP32_TOL


# -- through the elastic trainer ---------------------------------------------------------------------------
def _elastic_run(rank, world, cfg):
    from test_parallel import _FormedRendezvous

    from meridian.workers.elastic.trainer import ElasticTrainer
    from meridian.workers.loop.train import ListSink

    events: list = []
    result = ElasticTrainer(cfg, _FormedRendezvous(rank, world, cfg), sink=ListSink(), keep_params=True,
                            on_event=lambda *e: events.append(e[:2])).run()
    return result.final_params, events


@pytest.mark.slow  # three 3-4 process runs: 57 s measured at load average ~20
def test_the_elastic_trainer_checkpoints_every_rank_s_shard_and_resumes_on_other_dc_sizes(tmp_path):
    import shutil
    from dataclasses import replace

    import test_elastic_loop as el

    cfg = replace(el.job(job_id=el._unique_job_id(), steps=6), checkpoint_dir=str(tmp_path), checkpoint_every=3)
    uninterrupted = run_processes(_elastic_run, 4, cfg, timeout_s=180)[0][0]
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000003", "step-00000006"]
    assert len(list((tmp_path / "step-00000006").glob("*.distcp"))) == 4  # every rank wrote its shard
    shutil.rmtree(tmp_path / "step-00000006")  # as if the job had died after step 5
    (tmp_path / "latest").write_text("step-00000003")
    saved = tmp_path.parent / f"{tmp_path.name}-step3"
    shutil.copytree(tmp_path, saved)

    # The same layout resumes bit for bit: the checkpoint lost nothing.
    same = run_processes(_elastic_run, 4, cfg, timeout_s=180)
    for params, _ in same:
        assert all(torch.equal(params[n], p) for n, p in uninterrupted.items())
    assert ("checkpoint_loaded", "resumed from the durable checkpoint of step 3") in same[0][1]

    # 2 + 1: the same state, resharded (sums over other groupings round differently: within fp32 noise).
    shutil.rmtree(tmp_path)
    shutil.copytree(saved, tmp_path)
    resumed = run_processes(_elastic_run, 3, replace(cfg, datacenters=("dc-a", "dc-a", "dc-b")), timeout_s=180)
    for params, _ in resumed:
        assert max_rel_diff(params, uninterrupted) < 1e-4
    assert ("checkpoint_loaded", "resumed from the durable checkpoint of step 3") in resumed[0][1]
    ck = open_checkpoint(str(tmp_path / "step-00000006"))  # written again by the 2 + 1 layout
    assert ck.step == 6 and len(list((tmp_path / "step-00000006").glob("*.distcp"))) == 3


def test_a_checkpoint_of_another_job_is_refused_in_either_format_naming_what_differs(tmp_path):
    from meridian.workers.elastic.durable import restore_latest
    from meridian.workers.state import checkpoint as ckpt_io

    run_processes(_save_run, 2, ("a", "b"), SyncStrategy.FLAT, str(tmp_path / "sharded"))
    ckpt_io.save(str(tmp_path / "single"), ckpt_io.Checkpoint(step=1, model={}, optimizer={},
                                                              fingerprint={"toy": (1, 2)}))
    for folder, differs in (("sharded", "([1, 2], [1, 3])"), ("single", "((1, 2), (1, 3))")):
        with pytest.raises(ValueError, match=re.escape(f"different job (checkpoint vs job: {{'toy': {differs}}})")):
            restore_latest(str(tmp_path / folder), {"toy": (1, 3)}, None, None)


def _load_final(rank, world, cfg):
    """A fresh replica of the same layout, loading the job's final checkpoint: its step and its weights."""
    from meridian.workers.elastic.durable import restore_latest
    from meridian.workers.elastic.trainer import fingerprint
    from meridian.workers.loop.replica import DataParallelReplica, Membership

    rep = DataParallelReplica(cfg, Membership(epoch=1, rank=rank, world_size=world, datacenters=cfg.datacenters),
                              torch.device("cpu"))
    rep.build()
    done = restore_latest(cfg.checkpoint_dir, fingerprint(cfg), rep.model, rep.engine)
    loaded = rep.parameters()
    rep.close(ok=True)
    return done.step, loaded


@pytest.mark.parametrize("lookahead", [False, True])
def test_the_final_checkpoint_holds_the_weights_the_job_ended_with_in_the_one_step_late_modes_too(tmp_path, lookahead):
    # A one-step-late engine commits the last step's update in the loop's synchronize(), after the last snapshot:
    # the final checkpoint reused that snapshot, one AdamW update behind final_params (4.8e-4 here) and eval_loss.
    from dataclasses import replace

    from meridian.workers.contracts.config import OptimConfig, TrainConfig
    from meridian.workers.contracts.model_config import model_preset

    cfg = TrainConfig(job_id="final-ckpt", model=model_preset("nano"), steps=6, global_batch=4, micro_batch=2,
                      datacenters=("a", "b"), seed=1, checkpoint_dir=str(tmp_path),
                      optim=OptimConfig(warmup_steps=0, lr=3e-3))
    cfg = replace(cfg, sync=SyncConfig(strategy=SyncStrategy.HIERARCHICAL, delay_one_step=lookahead,
                                       local_lookahead=lookahead, lookahead_after=0 if lookahead else None))
    ended = run_processes(_elastic_run, 2, cfg, timeout_s=180)
    loaded = run_processes(_load_final, 2, cfg, timeout_s=180)
    for (final, _), (step, weights) in zip(ended, loaded, strict=True):
        assert step == cfg.steps and all(torch.equal(weights[n], final[n]) for n in weights)
