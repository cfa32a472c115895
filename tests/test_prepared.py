"""A standby builds the job's datasets and initial model before its ``go``; the training it then runs is the same
as one that built them after it."""

from __future__ import annotations

import multiprocessing as mp
import os
from dataclasses import replace
from multiprocessing.connection import Connection

import pytest
import torch

from meridian.workers.contracts.config import TrainConfig, ValidationConfig
from meridian.workers.contracts.model_config import model_preset
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.loop import prepared
from meridian.workers.loop.train import ListSink, train
from meridian.workers.model.build import build_model


def config(**kw) -> TrainConfig:
    return TrainConfig(job_id="prep", model=model_preset("nano"), steps=6, global_batch=4, micro_batch=2, seed=3,
                       datacenters=("a",), **kw)  # fmt: skip


@pytest.fixture(autouse=True)
def nothing_prepared():
    yield
    prepared._model = None
    prepared._datasets.clear()


def _fresh(cfg: TrainConfig) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """What the loop did before: seed, build; the weights and the generator's next draw."""
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model)
    return {k: v.clone() for k, v in model.state_dict().items()}, torch.rand(4)


def test_a_model_built_ahead_is_the_seeded_model_and_leaves_the_generator_where_building_it_would():
    cfg = config()
    weights, next_draw = _fresh(cfg)
    prepared.prepare(cfg)
    torch.manual_seed(12345)  # what ran between the standby's prepare and the go does not matter
    torch.rand(100)
    model = prepared.initial_model(cfg.model, cfg.seed)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert torch.equal(torch.rand(4), next_draw)
    # Handed out once: a second epoch of the same process builds its own (the first was trained in place)
    again = prepared.initial_model(cfg.model, cfg.seed)
    assert again is not model
    assert all(torch.equal(weights[k], v) for k, v in again.state_dict().items())


def test_a_model_built_for_another_seed_or_shape_is_not_handed_out():
    cfg = config()
    prepared.prepare(replace(cfg, seed=4))
    weights, _ = _fresh(cfg)
    model = prepared.initial_model(cfg.model, cfg.seed)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert prepared._model is None  # and the stale one is dropped


def test_a_model_over_the_host_memory_cap_is_not_built_ahead(monkeypatch):
    cfg = config()
    monkeypatch.setattr(prepared, "PREBUILD_MAX_BYTES", 4 * cfg.model.num_params - 1)
    prepared.prepare(cfg)
    assert prepared._model is None
    monkeypatch.setattr(prepared, "PREBUILD_MAX_BYTES", 4 * cfg.model.num_params)
    prepared.prepare(cfg)
    assert prepared._model is not None


def test_datasets_made_ahead_are_taken_once():
    cfg = config(validation=ValidationConfig(every_steps=3, batches=1))
    prepared.prepare(cfg)
    train_data = prepared.dataset(cfg.data, cfg.model.seq_len, cfg.seed)
    val_data = prepared.dataset(cfg.data, cfg.model.seq_len, cfg.seed, "eval")
    assert not prepared._datasets
    again = prepared.dataset(cfg.data, cfg.model.seq_len, cfg.seed)
    assert again is not train_data
    for a, b in zip(train_data.batch(5, 3), again.batch(5, 3), strict=True):
        assert torch.equal(a, b)
    assert val_data.batch(0, 1)[0].shape == (1, cfg.model.seq_len)


def _losses(rank, world, cfg, ahead):
    if ahead:
        prepared.prepare(cfg)
    sink = ListSink()
    result = train(cfg, sink=sink)
    return [r.loss for r in sink.records], result.eval_loss, prepared._model is None


def test_training_from_a_prepared_process_is_the_training_without():
    cfg = config(validation=ValidationConfig(every_steps=3, batches=1))
    (without,) = run_processes(_losses, 1, cfg, False)
    (ahead,) = run_processes(_losses, 1, cfg, True)
    assert ahead[2], "the loop built its own model instead of the one made ahead"
    assert ahead[:2] == without[:2]


def test_a_standby_is_told_to_prepare_before_it_is_told_to_go():
    from meridian.workers.elastic.pipe import recv
    from meridian.workers.elastic.standby import Standby

    class Started:  # a context whose process "starts": this test reads its end of the pipe
        def Pipe(self):  # noqa: N802 - multiprocessing's name
            return mp.Pipe()

        def Process(self, args, **kw):  # noqa: N802
            ctx.there = Connection(os.dup(args[0].fileno()))  # what a started process inherits

            class Nothing:
                def start(self):
                    pass

            return Nothing()

    ctx, cfg = Started(), config()
    standby = Standby(ctx, "w-test", cfg)
    standby.go("the ids")
    there = ctx.there
    assert recv(there) == ("prepare", cfg)
    assert recv(there) == ("go", "the ids")
