"""The data a job trains on is pinned at submit: each prepared dataset's manifest key and tokenizer hash, a
text source's hash. A worker that builds its dataset later (a recovery, a newcomer, a resume) refuses data
prepared again or rewritten in place since, and a checkpoint of other data does not resume: before, the sample
order silently changed (repeated and skipped samples) or the ids meant another tokenizer's tokens."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import pytest

from meridian.api.schemas import JobSpec
from meridian.service.data_access import DataAccess
from meridian.service.jobs import JobRequest
from meridian.workers.contracts.config import DataConfig, DataPin, TrainConfig
from meridian.workers.contracts.model_config import ModelConfig
from meridian.workers.data.hf_tokenizer import byte_tokenizer, export_tokenizer
from meridian.workers.data.manifest import read_manifest
from meridian.workers.data.prepare import PrepareOptions, prepare
from meridian.workers.data.shards import make_dataset
from meridian.workers.data.text import load_text
from meridian.workers.elastic.trainer import fingerprint
from meridian.workers.state.checkpoint import check_fingerprint

TRAINING = {"steps": 2, "global_batch": 2, "micro_batch": 1}


@pytest.fixture
def root(tmp_path):
    (tmp_path / "root").mkdir()
    byte_tokenizer().save(str(tmp_path / "bytes.json"))
    for name, n in (("a.txt", 300), ("b.txt", 600)):
        (tmp_path / name).write_text("\n\n".join(f"paragraph {i}: some text to train on." for i in range(n)))
    return tmp_path


def _prepare(root, inputs, tokenizer=None) -> str:
    opts = PrepareOptions(tokenizer=str(tokenizer or root / "bytes.json"), val_fraction=0.1)
    return prepare([str(root / i) for i in inputs], str(root / "root" / "ds"), opts, progress=False).directory


def _admit(root, data) -> JobRequest:
    spec = {"name": "j", "model": {"preset": "nano", "vocab_size": 512}, "data": data, "training": TRAINING}
    return DataAccess.for_roots([str(root / "root")]).admit(JobSpec.model_validate(spec).to_request())


def test_admission_pins_each_dataset_and_what_a_user_sends_is_replaced(root):
    ds = _prepare(root, ["a.txt"])
    m = read_manifest(ds)
    forged = (DataPin(path=ds, manifest_key="forged"),)
    req = _admit(root, {"dataset": ds, "pins": [{"path": ds, "manifest_key": "forged"}]})
    assert req.data.pins == (DataPin(path=ds, manifest_key=m.key, tokenizer_sha256=m.tokenizer_sha256),) != forged
    assert JobRequest.from_dict(req.to_dict()) == req  # the pins survive the store
    x, _ = make_dataset(req.data, 32, 0).batch(0, 2)  # unchanged data: read as before
    assert x.shape == (2, 32)


@pytest.mark.parametrize("other_tokenizer", [False, True])
def test_a_worker_refuses_a_dataset_prepared_again_since_submit(root, other_tokenizer):
    ds = _prepare(root, ["a.txt"])
    req = _admit(root, {"dataset": ds})
    cfg = TrainConfig(job_id="t", model=ModelConfig(n_layers=2, d_model=64, n_heads=4, seq_len=32, vocab_size=512),
                      data=req.data, steps=2, global_batch=2, micro_batch=1, seed=1)
    before = fingerprint(cfg)
    tokenizer = None
    if other_tokenizer:
        from meridian.workers.data.prepare import train_bpe

        tokenizer = root / "bpe.json"
        train_bpe([str(root / "a.txt")], 300, "text").save(str(tokenizer))
    _prepare(root, ["a.txt", "b.txt"], tokenizer)  # in place, with more text (and maybe another tokenizer)
    words = "with another tokenizer" if other_tokenizer else r"\(same tokenizer, other inputs or options\)"
    for split in ("train", "eval"):
        with pytest.raises(ValueError, match=rf"dataset '{ds}' was prepared again {words} after this job was "
                                             r"submitted .*Put the dataset back as it was"):
            make_dataset(req.data, 32, 0, split=split)
    # A job submitted now pins the new data, and its fingerprint does not match the old job's checkpoint.
    now = replace(cfg, data=_admit(root, {"dataset": ds}).data)
    with pytest.raises(ValueError, match="belongs to a different job .*data_pins"):
        check_fingerprint(before, fingerprint(now), "/ckpt")
    exported = export_tokenizer(req.data, str(root / "export"), model_max_length=32)
    assert exported["written"] is not other_tokenizer


def test_a_worker_refuses_a_text_source_rewritten_since_submit(root):
    text = root / "root" / "text.txt"
    text.write_bytes(b"hello world, " * 200)
    req = _admit(root, {"source": str(text), "max_bytes": 2048})
    assert req.data.pins == (DataPin(path=str(text), sha256=hashlib.sha256((b"hello world, " * 200)[:2048])
                                     .hexdigest()),)
    with open(text, "ab") as f:  # appended past max_bytes: not what the job reads, not a change
        f.write(b"more")
    assert load_text(req.data) == (b"hello world, " * 200)[:2048]
    text.write_bytes(b"HELLO world, " * 200)
    with pytest.raises(ValueError, match=rf"data.source '{text}' changed after this job was submitted"):
        load_text(req.data)


def test_fingerprints_without_pins_are_unchanged():
    """A job admitted before pins existed resumes from its checkpoints as before."""
    cfg = TrainConfig(job_id="t", model=ModelConfig(n_layers=2, d_model=64, n_heads=4, seq_len=32),
                      data=DataConfig(dataset="/d"), steps=2, global_batch=2, micro_batch=1, seed=1)
    assert set(fingerprint(cfg)) == {"model", "global_batch", "seed", "data"}
    pinned = replace(cfg, data=DataConfig(dataset="/d", pins=(DataPin(path="/d", manifest_key="k"),)))
    assert fingerprint(pinned)["data_pins"] == [["/d", "k", "", ""]]
