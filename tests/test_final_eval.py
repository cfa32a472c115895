"""A job without ``validation`` is admitted whatever its held-out split holds; when that split cannot give one
sample (``--val-fraction 0``, a short raw text), the run keeps its final checkpoint and skips the final
evaluation with the reason, instead of failing after its last step."""

from __future__ import annotations

import os

import numpy as np
import pytest

from meridian.workers.contracts.config import DataConfig, TrainConfig
from meridian.workers.contracts.model_config import ModelConfig
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.loop.train import ListSink, train

MODEL = ModelConfig(n_layers=2, d_model=64, n_heads=4, seq_len=64, vocab_size=64)


def _elastic(rank, world, cfg):
    from test_parallel import _FormedRendezvous

    from meridian.workers.elastic.trainer import ElasticTrainer
    from meridian.workers.state import storage

    events = []
    result = ElasticTrainer(cfg, _FormedRendezvous(rank, world, cfg), sink=ListSink(),
                            on_event=lambda *e: events.append(e)).run()
    return result, events, storage.latest(cfg.checkpoint_dir)


def _plain(rank, world, cfg):
    sink = ListSink()
    return train(cfg, sink=sink), len(sink.records)


def test_a_short_raw_text_keeps_its_final_checkpoint_and_says_why_it_was_not_evaluated(tmp_path):
    text = tmp_path / "small.txt"  # 1,140 bytes train (17 windows of 64), a 60-byte held-out tail
    text.write_text(("the quick brown fox jumps over the lazy dog. " * 50)[:1200])
    cfg = TrainConfig(job_id="t", model=ModelConfig(n_layers=2, d_model=64, n_heads=4, seq_len=64),
                      data=DataConfig(source=str(text), max_bytes=4096), steps=3, global_batch=2, micro_batch=1,
                      seed=1, datacenters=("a",), checkpoint_dir=str(tmp_path / "ckpt"))
    (result, events, latest), = run_processes(_elastic, 1, cfg)
    assert latest is not None and latest.endswith("3")  # the final checkpoint, at the last step
    assert result.steps == 3 and np.isfinite(result.final_loss)
    assert result.eval_loss is None
    assert result.eval_skipped.startswith("final evaluation skipped: data.source has 1200 bytes, too few")
    assert [(kind, message) for kind, message, _ in events if kind == "final_eval_skipped"] == [
        ("final_eval_skipped", result.eval_skipped)]


def _dataset(directory, val_tokens: int) -> str:
    from meridian.workers.data.manifest import Manifest, Shard, Split, write_manifest

    os.makedirs(directory, exist_ok=True)
    tokens = (np.arange(5000) * 7 % 61).astype(np.uint16)
    tokens.tofile(os.path.join(directory, "train-00000.bin"))
    tokens[:val_tokens].tofile(os.path.join(directory, "val-00000.bin"))
    write_manifest(str(directory), Manifest(
        key="k", vocab_size=64, dtype="uint16", tokenizer_sha256="", tokenizer_trained=False, eos_id=None,
        text_field="text", val_fraction=0.0, train=Split(tokens=5000, documents=1, shards=(Shard("train-00000.bin", 5000),)),
        val=Split(tokens=val_tokens, documents=0, shards=(Shard("val-00000.bin", val_tokens),))))
    return str(directory)


@pytest.mark.parametrize("val_tokens", [0, 64])
def test_a_dataset_without_a_held_out_sample_trains_every_step_and_reports_no_eval_loss(tmp_path, val_tokens):
    cfg = TrainConfig(job_id="t", model=MODEL, data=DataConfig(dataset=_dataset(tmp_path / "ds", val_tokens)),
                      steps=3, global_batch=2, micro_batch=1, seed=1, datacenters=("a",))
    (result, records), = run_processes(_plain, 1, cfg)
    assert records == 3 and result.eval_loss is None
    assert f"has {val_tokens} val tokens, too few for one sample of model.seq_len=64" in result.eval_skipped


def test_a_held_out_sample_is_still_evaluated(tmp_path):
    cfg = TrainConfig(job_id="t", model=MODEL, data=DataConfig(dataset=_dataset(tmp_path / "ds", 65)),
                      steps=3, global_batch=2, micro_batch=1, seed=1, datacenters=("a",))
    (result, _), = run_processes(_plain, 1, cfg)
    assert result.eval_skipped == "" and 0 < result.eval_loss < 10
