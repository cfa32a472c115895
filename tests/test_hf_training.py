"""A Hugging Face model (Llama 3.2's shape: tied head, llama3 RoPE) and a user factory's module train through the
same loop as the builtin families: across two datacenters with hierarchical sync, like one process."""

from __future__ import annotations

import pytest
import torch
from test_hf_models import save_random

from meridian.workers.contracts.config import OptimConfig, SyncConfig, SyncStrategy, TrainConfig
from meridian.workers.contracts.hf_config import hf_model_config
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.loop.train import ListSink, train

pytest.importorskip("transformers")


def _train(rank, world, cfg, path=""):
    import sys

    if path:
        sys.path.insert(0, path)  # where the user's factory module lives (a spawned process starts without it)
    sink = ListSink()
    result = train(cfg, sink=sink, keep_params=True)
    return result, [r.loss for r in sink.records]


def _cfg(model, dcs):
    return TrainConfig(job_id="hf", model=model, steps=4, global_batch=4, micro_batch=2, datacenters=dcs,
                       sync=SyncConfig(strategy=SyncStrategy.HIERARCHICAL), seed=1,
                       optim=OptimConfig(lr=3e-3, warmup_steps=0))


def _like_one_process(model, path=""):
    (ref, ref_losses), = run_processes(_train, 1, _cfg(model, ("a",)), path, timeout_s=240)
    assert ref_losses[-1] < ref_losses[0]
    out = run_processes(_train, 2, _cfg(model, ("a", "b")), path, timeout_s=240)
    assert out[0][1] == pytest.approx(ref_losses, rel=1e-4)
    for result, _ in out:
        worst = max((p - ref.final_params[n]).abs().max().item() for n, p in result.final_params.items())
        assert worst < 1e-4, worst
    return ref


def test_a_llama_3_2_shaped_checkpoint_continues_training_across_two_datacenters_like_one_process(tmp_path):
    save_random(tmp_path, "llama3")
    cfg = hf_model_config(str(tmp_path), weights=True, seq_len=32)
    ref = _like_one_process(cfg)
    assert "lm_head.weight" not in ref.final_params  # tied: trained once, as the embedding


def test_a_factory_module_trains_across_two_datacenters_like_one_process(tmp_path, monkeypatch):
    from test_model_sources import write_user_models

    from meridian.workers.contracts.model_config import ModelConfig

    write_user_models(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    from mymodels.tiny import build

    cfg = ModelConfig(family="factory", factory="mymodels.tiny:build", factory_args='{"d":32,"seq_len":32}',
                      block="Block", n_layers=2, d_model=32, n_heads=1, seq_len=32, vocab_size=256,
                      param_count=sum(p.numel() for p in build(d=32, seq_len=32).parameters()))
    ref = _like_one_process(cfg, str(tmp_path))
    assert set(ref.final_params) == {n for n, _ in build(d=32, seq_len=32).named_parameters()}
    assert all(torch.isfinite(p).all() for p in ref.final_params.values())


@pytest.mark.parametrize("family", ["qwen2", "llama3"])
def test_a_checkpoint_trains_tensor_parallel_by_its_own_plan_like_one_process(tmp_path, family):
    # transformers' tensor-parallel plan for the family (base_model_tp_plan), tp 2 inside each of two datacenters,
    # one replica each: the losses and final weights of one process.
    from dataclasses import replace

    from meridian.workers.contracts.config import ParallelConfig

    save_random(tmp_path, family)
    cfg = _cfg(hf_model_config(str(tmp_path), weights=True, seq_len=32), ("a",))
    (ref, ref_losses), = run_processes(_train, 1, cfg, timeout_s=240)
    tp = replace(cfg, datacenters=("a", "a", "b", "b"), parallel=ParallelConfig(tp=2))
    out = run_processes(_train, 4, tp, timeout_s=300)
    assert out[0][1] == pytest.approx(ref_losses, rel=1e-4)
    for result, _ in out:
        worst = max((p - ref.final_params[n]).abs().max().item() for n, p in result.final_params.items())
        assert worst < 1e-4, worst
