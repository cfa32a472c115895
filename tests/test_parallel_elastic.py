"""Tensor- and pipeline-parallel jobs are elastic: they re-form on fewer ranks from the survivors' in-memory
snapshots, and their durable checkpoints load into any other layout.

The epochs run over real gloo groups without Ray: a stand-in rendezvous asks every rank to leave at a step boundary
after a few steps (what a newcomer's arrival or a lost peer does), then forms the next epoch over some of the ranks
on a new port (the others are gone). The survivors' state exchange and the checkpoint read see element ranges of
whole parameters, whatever the layout that wrote them (a row-parallel weight's column slice is a range per row), so
the run must end where an uninterrupted one-process run ends (final parameters within 1e-4).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch.distributed as dist

from meridian.workers.contracts.config import ParallelConfig, TrainConfig
from meridian.workers.contracts.model_config import ModelConfig, ModelFamily
from meridian.workers.contracts.rendezvous import Assignment
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.distributed.ports import free_port
from meridian.workers.elastic.rendezvous import JobFinished
from meridian.workers.elastic.trainer import ElasticTrainer
from meridian.workers.loop.train import ListSink, train

STEPS = 16
LLAMA = ModelConfig(family=ModelFamily.LLAMA, n_layers=4, d_model=64, n_heads=8, n_kv_heads=2, ffn_hidden=96,
                    seq_len=16)  # fmt: skip


class _Rendezvous:
    """Epoch 1 over the group ``run_processes`` formed; after ``leave_after`` steps rank 0 reports a pending change,
    so every rank leaves at the next step boundary; epoch 2 (if ``survivors``) over those old ranks, in that order."""

    def __init__(self, rank, cfg, sink, *, leave_after, survivors, datacenters, port):
        self.rank, self.cfg, self.sink, self.leave_after = rank, cfg, sink, leave_after
        self.survivors, self.datacenters, self.port = survivors, datacenters, port
        self.epoch = 0

    def join(self, *, last_step, timeout_s, snapshot_every=1):
        self.epoch += 1
        if self.epoch == 1:
            world = len(self.cfg.datacenters)
            return Assignment.of(epoch=1, rank=self.rank, world_size=world, datacenters=self.cfg.datacenters,
                              master_addr="", master_port=0, resume_step=0, from_checkpoint=False,
                              newcomer_ranks=tuple(range(world)))  # fmt: skip
        if self.epoch > 2 or self.rank not in self.survivors:
            raise JobFinished()
        return Assignment.of(epoch=2, rank=self.survivors.index(self.rank), world_size=len(self.survivors),
                          datacenters=self.datacenters, master_addr="", master_port=0, resume_step=last_step,
                          from_checkpoint=False, newcomer_ranks=())  # fmt: skip

    def form(self, a):
        if a.epoch > 1:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{self.port}", rank=a.rank,
                                    world_size=a.world_size)  # fmt: skip

    def finish(self):
        pass

    def pending_change(self):
        return self.epoch == 1 and self.leave_after is not None and len(self.sink.records) >= self.leave_after


def _elastic(rank, world, cfg, leave_after, survivors, datacenters, port):
    sink, events = ListSink(), []
    rdzv = _Rendezvous(rank, cfg, sink, leave_after=leave_after, survivors=survivors, datacenters=datacenters,
                       port=port)  # fmt: skip
    result = ElasticTrainer(cfg, rdzv, sink=sink, on_event=lambda *e: events.append(e[0]), keep_params=True).run()
    return result, [(r.step, r.epoch) for r in sink.records], events


def _one_process(rank, world, cfg):
    return train(cfg, sink=ListSink(), keep_params=True)


def job(dcs, **par) -> TrainConfig:
    return TrainConfig(job_id="elastic-mp", model=LLAMA, steps=STEPS, global_batch=8, micro_batch=2, datacenters=dcs,
                       seed=1, parallel=ParallelConfig(**par))  # fmt: skip


@pytest.fixture(scope="module")
def reference():
    return run_processes(_one_process, 1, job(("a",)), timeout_s=300)[0]


def _final(out) -> dict:
    return {n: p for result, *_ in out if result is not None for n, p in result.final_params.items()}


def _worst(full, ref) -> float:
    assert sorted(full) == sorted(ref.final_params)
    return max((full[n] - ref.final_params[n]).abs().max().item() for n in full)


@pytest.mark.parametrize("dcs, par, survivors", [
    # tp 2 × dp 2, a replica in each DC; DC b's two ranks go, tp 2 × dp 1 goes on in DC a
    (("a", "a", "b", "b"), {"tp": 2, "sequence_parallel": True}, (0, 1)),
    # pp 2 × dp 2, each replica's two stages in one DC; DC b's ranks (1 and 3) go, pp 2 × dp 1 goes on in DC a
    (("a", "b", "a", "b"), {"pp": 2}, (0, 2)),
], ids=["tp2", "pp2"])
def test_a_model_parallel_job_re_forms_on_the_survivors_from_their_snapshots(dcs, par, survivors, reference):
    cfg = job(dcs, **par)
    after = tuple(dcs[r] for r in survivors)
    out = run_processes(_elastic, len(dcs), cfg, 2, survivors, after, free_port(), timeout_s=900)
    records, events = out[0][1], out[0][2]
    assert [s for s, _ in records] == list(range(1, STEPS + 1))  # every step once: none lost, none trained twice
    assert {e for _, e in records} == {1, 2}  # it did re-form
    assert "epoch_restored" in events and "restarted" not in events and "checkpoint_loaded" not in events
    assert _worst(_final(out), reference) < 1e-4


@pytest.mark.parametrize("after, par", [
    (("a", "b"), {}),  # data parallelism alone, across two DCs
    (("a", "a"), {"tp": 2}),  # another tensor-parallel layout
], ids=["to-dp2", "to-tp2"])
def test_a_checkpoint_of_one_layout_resumes_in_another(tmp_path, after, par, reference):
    """tp 2 × pp 2 writes its checkpoints (every two steps) and stops after a few steps; a job of another layout
    resumes from the newest one and ends where the uninterrupted run does."""
    first = replace(job(("a", "a", "b", "b"), tp=2, pp=2), checkpoint_dir=str(tmp_path), checkpoint_every=2)
    run_processes(_elastic, 4, first, 3, (), (), free_port(), timeout_s=900)
    second = replace(job(after, **par), checkpoint_dir=str(tmp_path), checkpoint_every=2)
    out = run_processes(_elastic, len(after), second, None, (), (), free_port(), timeout_s=900)
    records, events = out[0][1], out[0][2]
    resumed = records[0][0] - 1
    assert resumed >= 2 and resumed % 2 == 0 and "checkpoint_loaded" in events
    assert [s for s, _ in records] == list(range(resumed + 1, STEPS + 1))
    assert _worst(_final(out), reference) < 1e-4
