"""A new job resumed from another job's checkpoint (``resume_from``) trains on as if never interrupted, in another
layout; each part a new phase resets (``resume_from.reset``) starts afresh, and only that part.

Job A trains 8 steps on three ranks in two datacenters (hierarchical sync, AdamW sharded in the two-rank DC, a
warm-up and a cosine decay), checkpointing at step 4; its step-8 checkpoint is dropped, as if it had been
cancelled after step 4. Job B, on two ranks, starts from that checkpoint as the service resolves it (the
``meridian.json`` read and checked against B's fingerprint at submit) and must give A's losses for steps 5..8
within 1e-4 relative: the weights, the moments, the schedule position and the data position all came back.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace

import pytest
from test_parallel import _FormedRendezvous

from meridian.service.errors import InvalidJob
from meridian.service.resolved import resuming
from meridian.service.resume_source import read_checkpoint
from meridian.workers.contracts.config import (
    OptimConfig,
    ResetPart,
    SyncConfig,
    SyncStrategy,
    TrainConfig,
)
from meridian.workers.contracts.model_config import model_preset
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.elastic.trainer import ElasticTrainer
from meridian.workers.loop.schedule import lr_at
from meridian.workers.loop.train import ListSink
from meridian.workers.state import storage

STEPS = 8
AT = 4
REL = 1e-4


def config(directory: str, dcs: tuple[str, ...], steps: int = STEPS, **kw) -> TrainConfig:
    return TrainConfig(
        job_id=os.path.basename(directory), model=model_preset("nano"), steps=steps, global_batch=4, micro_batch=2,
        datacenters=dcs, seed=1, checkpoint_dir=directory, checkpoint_every=AT,
        optim=OptimConfig(warmup_steps=2, lr=3e-3), sync=SyncConfig(strategy=SyncStrategy.HIERARCHICAL), **kw,
    )  # fmt: skip


def _train(rank, world, cfg):
    sink, events = ListSink(), []
    ElasticTrainer(cfg, _FormedRendezvous(rank, world, cfg), sink=sink,
                   on_event=lambda kind, message, data: events.append((kind, data))).run()
    return [(r.step, r.loss, r.lr) for r in sink.records], events


def adam_step(directory: str) -> int:
    """AdamW's step count in the newest checkpoint of ``directory``."""
    return json.loads(storage.read_text(storage.join(directory, storage.latest(directory), "meridian.json")))["adam_step"]


@pytest.fixture(scope="module")
def job_a(tmp_path_factory):
    """Job A's records and its checkpoint directory, left with the checkpoint of step ``AT`` as its newest."""
    directory = str(tmp_path_factory.mktemp("ckpt") / "job-a")
    records, _ = run_processes(_train, 3, config(directory, ("a", "a", "b")), timeout_s=300)[0]
    assert [s for s, _, _ in records] == list(range(1, STEPS + 1))
    shutil.rmtree(os.path.join(directory, f"step-{STEPS:08d}"))
    with open(os.path.join(directory, "latest"), "w") as f:
        f.write(f"step-{AT:08d}")
    return records, directory


def resumed(job_a, tmp_path, reset=(), steps=STEPS):
    """Job B (two ranks, one per DC) resumed from A's directory as the service resolves it."""
    _, directory = job_a
    cfg = config(str(tmp_path / "job-b"), ("a", "b"), steps=steps)
    cfg = resuming(cfg, read_checkpoint(directory, "job a"), tuple(reset))
    assert cfg.resume is not None and cfg.resume.step == AT and cfg.resume.checkpoint.endswith(f"step-{AT:08d}")
    records, events = run_processes(_train, 2, cfg, timeout_s=300)[0]
    return cfg, records, events


def close(a: float, b: float) -> bool:
    return abs(a - b) <= REL * abs(b)


def test_a_job_resumed_in_another_layout_continues_the_loss_curve_of_the_uninterrupted_run(job_a, tmp_path):
    full, _ = job_a
    cfg, records, events = resumed(job_a, tmp_path)
    assert [s for s, _, _ in records] == list(range(AT + 1, STEPS + 1))  # its metrics continue at step 5
    for (step, loss, lr), (_, want_loss, want_lr) in zip(records, full[AT:], strict=True):
        assert close(loss, want_loss), (step, loss, want_loss)
        assert lr == want_lr  # the schedule's position, not restarted
    (kind, data), = [(k, d) for k, d in events if k == "resumed_from"]
    assert data["step"] == AT and data["start_step"] == AT and data["reset"] == [] and data["source"] == "job a"
    assert adam_step(cfg.checkpoint_dir) == STEPS  # AdamW's count went on from A's 4 steps


def test_reset_optimizer_loads_the_weights_and_starts_adamw_from_zero(job_a, tmp_path):
    full, _ = job_a
    cfg, records, _ = resumed(job_a, tmp_path, reset=[ResetPart.OPTIMIZER])
    assert [s for s, _, _ in records] == list(range(AT + 1, STEPS + 1))
    assert close(records[0][1], full[AT][1])  # the same weights on the same batch: the loss before any update
    assert not close(records[1][1], full[AT + 1][1])  # fresh moments update differently
    assert adam_step(cfg.checkpoint_dir) == STEPS - AT  # AdamW counted only this job's steps


def test_reset_schedule_counts_steps_from_zero_on_the_data_that_comes_next(job_a, tmp_path):
    full, _ = job_a
    cfg, records, _ = resumed(job_a, tmp_path, reset=[ResetPart.SCHEDULE], steps=4)
    assert [s for s, _, _ in records] == [1, 2, 3, 4]
    assert [lr for _, _, lr in records] == [lr_at(s, cfg) for s in range(4)]  # warm-up again, decay over 4 steps
    assert records[0][2] != full[AT][2]
    assert close(records[0][1], full[AT][1])  # A's weights on A's next batch (the data position carried over)


def test_reset_data_starts_the_sample_order_afresh_and_keeps_the_schedule(job_a, tmp_path):
    full, _ = job_a
    _, data_reset, _ = resumed(job_a, tmp_path, reset=[ResetPart.DATA])
    _, everything, _ = resumed(job_a, tmp_path / "all", steps=4,
                               reset=[ResetPart.OPTIMIZER, ResetPart.SCHEDULE, ResetPart.DATA])
    assert [s for s, _, _ in data_reset] == list(range(AT + 1, STEPS + 1))
    assert [lr for _, _, lr in data_reset] == [lr for _, _, lr in full[AT:]]
    assert not close(data_reset[0][1], full[AT][1])  # another batch than A's step 5
    # the same weights on the first batch of the sample order, whatever the schedule and the optimizer
    assert close(data_reset[0][1], everything[0][1])
    assert [s for s, _, _ in everything] == [1, 2, 3, 4]


def test_what_differs_from_the_checkpoint_is_refused_naming_it_unless_the_data_is_reset(job_a, tmp_path):
    _, directory = job_a
    found = read_checkpoint(directory, "job a")
    b = config(str(tmp_path / "b"), ("a", "b"))
    with pytest.raises(InvalidJob, match=r"global_batch differs \(checkpoint 4, this job 8\)"):
        resuming(replace(b, global_batch=8), found, ())
    with pytest.raises(InvalidJob, match=r"seed differs .*reset: \[\"data\"\]"):
        resuming(replace(b, seed=2), found, ())
    assert resuming(replace(b, seed=2, global_batch=8), found, (ResetPart.DATA,)).resume is not None
    bigger = replace(b, model=replace(b.model, n_layers=b.model.n_layers + 1))
    for reset in ((), tuple(ResetPart)):
        with pytest.raises(InvalidJob, match="the model differs .* cannot load"):
            resuming(bigger, found, reset)
    with pytest.raises(InvalidJob, match=r"training.steps \(4\) must be above the step of the checkpoint"):
        resuming(replace(b, steps=AT), found, ())
    assert resuming(replace(b, steps=AT), found, (ResetPart.SCHEDULE,)).resume.start_step == 0
