"""``meridian data prepare`` and the datasets jobs read from its shards: counts, reuse, bad input, the
sample order (pure in (seed, step, global batch), unchanged by a resize), blend weights, validation."""

from __future__ import annotations

import gzip
import json
import os

import numpy as np
import pytest
import torch

from meridian.cli.main import main as cli_main
from meridian.workers.contracts.config import BlendEntry, DataConfig, TrainConfig, ValidationConfig
from meridian.workers.contracts.model_config import model_preset
from meridian.workers.data.manifest import read_manifest
from meridian.workers.data.prepare import PrepareError, PrepareOptions, is_val_document, prepare
from meridian.workers.data.shards import FeistelPermutation, TokenDataset, make_dataset
from meridian.workers.data.text import TextDataset

BPE = PrepareOptions(train_tokenizer=True, vocab_size=512, val_fraction=0.05)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    from pydoc_data.topics import topics

    path = tmp_path_factory.mktemp("corpus") / "reference.txt"
    path.write_text("\n\n".join(topics[k] for k in sorted(topics)), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def dataset(corpus, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("ds") / "ref")
    prepare([corpus], out, BPE, progress=False)
    return out


def _write_synthetic(directory, tokens: np.ndarray, vocab: int) -> str:
    """A prepared dataset with the given train tokens (and a short validation split), written directly."""
    from meridian.workers.data.manifest import Manifest, Shard, Split, write_manifest

    os.makedirs(directory, exist_ok=True)
    tokens.astype(np.uint16).tofile(os.path.join(directory, "train-00000.bin"))
    tokens[:200].astype(np.uint16).tofile(os.path.join(directory, "val-00000.bin"))
    write_manifest(str(directory), Manifest(
        key="synthetic", vocab_size=vocab, dtype="uint16", tokenizer_sha256="", tokenizer_trained=False, eos_id=None,
        text_field="text", val_fraction=0.0, train=Split(tokens=len(tokens), documents=1,
                                                          shards=(Shard("train-00000.bin", len(tokens)),)),
        val=Split(tokens=200, documents=1, shards=(Shard("val-00000.bin", 200),))))
    return str(directory)


def test_prepare_with_a_trained_bpe_writes_shards_and_a_consistent_manifest(corpus, dataset):
    m = read_manifest(dataset)
    assert m.vocab_size == 512 and m.dtype == "uint16" and m.tokenizer_trained and m.eos_id is not None
    assert m.inputs[0].path == os.path.abspath(corpus)
    docs = m.inputs[0].documents
    assert m.train.documents + m.val.documents == docs
    assert m.val.documents == sum(is_val_document(i, 0.05) for i in range(docs)) > 0
    for split in (m.train, m.val):
        assert split.tokens == sum(s.tokens for s in split.shards)
        on_disk = sum(os.path.getsize(os.path.join(dataset, s.file)) for s in split.shards)
        assert on_disk == 2 * split.tokens
        starts = np.load(os.path.join(dataset, split.doc_index))
        assert len(starts) == split.documents and starts[0] == 0 and (np.diff(starts) > 0).all()
    # Every document ends with the end-of-text token; the ids decode back to the text.
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(dataset, "tokenizer.json"))
    train = np.fromfile(os.path.join(dataset, m.train.shards[0].file), dtype=np.uint16)
    starts = np.load(os.path.join(dataset, m.train.doc_index))
    assert (train[starts[1:] - 1] == m.eos_id).all() and train[-1] == m.eos_id
    first_doc = tok.decode(train[: starts[1] - 1].tolist())
    with open(corpus, encoding="utf-8") as f:
        assert f.read().startswith(first_doc.rstrip("\n"))
    # BPE compresses: fewer tokens than bytes.
    assert m.tokens < 0.6 * m.inputs[0].bytes


def test_rerun_reuses_and_a_change_rebuilds(corpus, dataset, tmp_path):
    before = os.path.getmtime(os.path.join(dataset, "manifest.json"))
    first = read_manifest(dataset)
    again = prepare([corpus], dataset, BPE, progress=False)
    assert again.reused and os.path.getmtime(os.path.join(dataset, "manifest.json")) == before
    other = prepare([corpus], dataset, PrepareOptions(train_tokenizer=True, vocab_size=512, val_fraction=0.1),
                    progress=False)
    assert not other.reused and other.manifest.val.documents > first.val.documents
    # Back to the first options: rebuilt (the key changed), same figures as the first time.
    third = prepare([corpus], dataset, BPE, progress=False)
    assert not third.reused and third.manifest.to_dict() == first.to_dict()


def test_a_given_tokenizer_and_json_lines(dataset, tmp_path):
    lines = tmp_path / "docs.jsonl"
    lines.write_text("\n".join(json.dumps({"body": f"document number {i}: def f(x): return x + {i}"})
                               for i in range(40)) + "\n", encoding="utf-8")
    opts = PrepareOptions(tokenizer=os.path.join(dataset, "tokenizer.json"), text_field="body", val_fraction=0.1)
    r = prepare([str(lines)], str(tmp_path / "out"), opts, progress=False)
    m = r.manifest
    assert m.inputs[0].documents == 40 and m.val.documents == 4 and m.train.documents == 36
    assert m.tokenizer_sha256 == read_manifest(dataset).tokenizer_sha256 and not m.tokenizer_trained


@pytest.mark.parametrize("name, content, extra, message", [
    ("binary.txt", b"abc\x00\x01\x02", {}, "binary file"),
    ("latin1.txt", "caf\xe9\n".encode("latin-1"), {}, "not UTF-8"),
    ("empty.txt", b"", {}, "empty file"),
    ("blank.txt", b"\n \n\t\n", {}, "empty file"),
    ("nofield.jsonl", b'{"body": "hello"}\n', {}, "no 'text' field"),
    ("broken.jsonl", b'{"text": "hello"\n', {}, "not a JSON line"),
    ("changelog.gz", gzip.compress(b"some text\n"), {}, r"a compressed file \(gzip\); decompress it first"),
])
def test_bad_input_is_an_error_naming_the_file(tmp_path, name, content, extra, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(PrepareError, match=message) as e:
        prepare([str(path)], str(tmp_path / "out"), BPE, progress=False)
    assert name in str(e.value)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_directory_is_an_error_saying_to_name_its_files(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("some text\n", encoding="utf-8")
    with pytest.raises(PrepareError) as e:
        prepare([str(folder) + "/"], str(tmp_path / "out"), BPE, progress=False)
    assert str(e.value) == f"{folder}/: a directory; name its files instead ({folder}/*)"
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_vocabulary_too_large_for_the_model(dataset, corpus, tmp_path):
    opts = PrepareOptions(tokenizer=os.path.join(dataset, "tokenizer.json"), max_vocab=256)
    with pytest.raises(PrepareError, match=r"tokenizer.json: vocabulary of 512 tokens is too large .* 256"):
        prepare([corpus], str(tmp_path / "out"), opts, progress=False)


def test_cli_exit_codes_and_json_errors(corpus, tmp_path, capsys):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"\x00\xff" * 10)
    assert cli_main(["data", "prepare", str(bad), "--out", str(tmp_path / "o"), "--train-tokenizer",
                     "--vocab-size", "300", "--json"]) == 2
    out, err = capsys.readouterr()
    assert json.loads(out) == {"error": {"type": "urn:meridian:problem:invalid-data", "title": "Invalid data",
                                         "detail": f"{bad}: binary file (NUL bytes); give UTF-8 text or JSON lines",
                                         "file": str(bad)}}
    assert "bad.bin" in err
    assert cli_main(["data", "prepare", corpus, "--out", str(tmp_path / "o"), "--train-tokenizer",
                     "--vocab-size", "300", "--json", "--quiet"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["vocab_size"] == 300 and d["tokens"] == d["train_tokens"] + d["val_tokens"] and not d["reused"]


def test_feistel_order_is_a_permutation():
    for n in (1, 2, 3, 5, 64, 1000, 4097):
        p = FeistelPermutation(n, key=7)(np.arange(n))
        assert sorted(p.tolist()) == list(range(n))
    a, b = FeistelPermutation(1000, 1)(np.arange(1000)), FeistelPermutation(1000, 2)(np.arange(1000))
    assert (a != b).mean() > 0.9


def _samples(ds, step, gb, micro, size):
    parts = [torch.cat([x for x, _ in ds.step_batches(step, gb, micro, r, size)] or [torch.empty(0, ds.seq_len)])
             for r in range(size)]
    return torch.cat(parts)


def test_order_is_pure_and_a_resize_covers_the_same_samples(dataset):
    ds = TokenDataset(((dataset, 1.0),), seq_len=32, seed=3)
    again = TokenDataset(((dataset, 1.0),), seq_len=32, seed=3)
    for step in (0, 5, 123):
        four = _samples(ds, step, 10, 2, 4)
        assert torch.equal(four, _samples(again, step, 10, 2, 4))  # same (seed, step, batch): same samples
        assert torch.equal(four, _samples(ds, step, 10, 3, 3))  # 4 ranks → 3 ranks: same samples, same order
    x, y = ds.batch(0, 4)
    assert x.shape == (4, 32) and torch.equal(x[:, 1:], y[:, :-1])
    other_seed = TokenDataset(((dataset, 1.0),), seq_len=32, seed=4)
    assert not torch.equal(ds.batch(0, 8)[0], other_seed.batch(0, 8)[0])
    # One epoch visits every window exactly once.
    n = ds.num_samples
    ids = [w for _, w in ds.sample_ids(0, n)]
    assert sorted(ids) == list(range(n))


def test_blend_weights_are_honoured(tmp_path):
    a = _write_synthetic(tmp_path / "a", np.full(20_000, 1), vocab=8)
    b = _write_synthetic(tmp_path / "b", np.full(20_000, 2), vocab=8)
    ds = TokenDataset(((a, 0.7), (b, 0.3)), seq_len=16, seed=0)
    x = torch.cat([ds.batch(first, 512)[0] for first in range(0, 8192, 512)])
    share_a = (x[:, 0] == 1).float().mean().item()
    assert share_a == pytest.approx(0.7, abs=1e-3)  # two whole blocks of 4096: exact up to rounding
    early = (ds.batch(0, 400)[0][:, 0] == 1).float().mean().item()
    assert early == pytest.approx(0.7, abs=0.08)  # shuffled within a block: any stretch is mixed
    # The blend's order is pure and resize-proof too.
    assert torch.equal(_samples(ds, 7, 9, 2, 4), _samples(ds, 7, 9, 4, 3))
    cfg = DataConfig(blend=(BlendEntry(dataset=a, weight=7), BlendEntry(dataset=b, weight=3)))
    assert cfg.datasets == ((a, 0.7), (b, 0.3))


def test_factory_and_config_checks(dataset):
    assert isinstance(make_dataset(DataConfig(), 64, 0), TextDataset)
    ds = make_dataset(DataConfig(dataset=dataset), 64, 0, split="eval")
    assert isinstance(ds, TokenDataset) and ds.num_samples == (read_manifest(dataset).val.tokens - 1) // 64
    with pytest.raises(ValueError, match="absolute path"):
        DataConfig(dataset="relative/dir")
    with pytest.raises(ValueError, match="exclusive"):
        DataConfig(dataset=dataset, blend=(BlendEntry(dataset=dataset),))
    with pytest.raises(ValueError, match="validation.every_steps must be >= 1"):
        ValidationConfig(every_steps=0)
    with pytest.raises(ValueError, match="not a prepared dataset"):
        make_dataset(DataConfig(dataset="/nonexistent/ds"), 64, 0)


def test_submit_checks_the_dataset_vocabulary_against_the_model(dataset):
    from meridian.api.schemas import JobSpec
    from meridian.service.data_access import DataAccess
    from meridian.service.errors import InvalidJob

    access = DataAccess.for_roots([os.path.dirname(dataset)])
    spec = {"name": "j", "model": {"preset": "nano"}, "data": {"dataset": dataset},
            "training": {"steps": 2, "global_batch": 2, "micro_batch": 1}}
    with pytest.raises(InvalidJob, match=r"vocabulary of 512 tokens but model.vocab_size is 256"):
        access.admit(JobSpec.model_validate(spec).to_request())
    ok = JobSpec.model_validate({**spec, "model": {"preset": "nano", "vocab_size": 512},
                                 "validation": {"every_steps": 2, "batches": 2}})
    req = access.admit(ok.to_request())
    assert req.data.dataset == os.path.realpath(dataset)
    assert req.validation == ValidationConfig(every_steps=2, batches=2)


def test_validation_on_a_dataset_without_a_validation_sample_is_refused_at_submit(corpus, tmp_path):
    from meridian.api.schemas import JobSpec
    from meridian.service.data_access import DataAccess
    from meridian.service.errors import InvalidJob

    one_paragraph = tmp_path / "one.txt"  # no blank line: one document, so nothing is held out
    one_paragraph.write_text("\n".join(f"line {i} of a text without paragraphs" for i in range(300)))
    out = str(tmp_path / "roots" / "one")
    prepare([str(one_paragraph)], out, BPE, progress=False)
    access = DataAccess.for_roots([str(tmp_path / "roots")])
    spec = {"name": "j", "model": {"preset": "nano", "vocab_size": 512}, "data": {"dataset": out},
            "training": {"steps": 2, "global_batch": 2, "micro_batch": 1}}
    assert access.admit(JobSpec.model_validate(spec).to_request()).validation is None  # fine without validation
    with pytest.raises(InvalidJob, match=r"has 0 validation tokens \(0 documents\).*--val-fraction"):
        access.admit(JobSpec.model_validate({**spec, "validation": {"every_steps": 1}}).to_request())


def test_a_dataset_outside_the_data_roots_is_refused_without_reading_it(dataset, tmp_path):
    from meridian.api.schemas import JobSpec
    from meridian.service.data_access import DataAccess
    from meridian.service.errors import InvalidJob

    elsewhere = DataAccess.for_roots([str(tmp_path / "roots")])
    answers = []
    for directory in (dataset, str(tmp_path / "no-such-dataset")):
        spec = {"name": "j", "model": {"preset": "nano", "vocab_size": 512}, "data": {"dataset": directory},
                "training": {"steps": 2, "global_batch": 2, "micro_batch": 1}}
        with pytest.raises(InvalidJob) as e:
            elsewhere.admit(JobSpec.model_validate(spec).to_request())
        answers.append(str(e.value).replace(directory, "DIR"))
    assert answers[0] == answers[1]  # the same words whether or not a dataset is there


def test_training_on_a_prepared_dataset_reports_validation_loss(dataset):
    from meridian.workers.distributed.multiproc import run_processes

    model = model_preset("nano")
    cfg = TrainConfig(job_id="t", model=type(model)(n_layers=2, d_model=64, n_heads=4, seq_len=64, vocab_size=512),
                      data=DataConfig(dataset=dataset), steps=6, global_batch=4, micro_batch=2, seed=1,
                      datacenters=("a",), validation=ValidationConfig(every_steps=3, batches=2))
    (result, records), = run_processes(_train_records, 1, cfg)
    vals = [r.val_loss for r in records]
    assert vals[:2] == [None, None] and vals[3:5] == [None, None]
    assert vals[2] is not None and vals[5] is not None and vals[5] < vals[2] < 7.0
    assert result.final_loss < result.first_loss


def _train_records(rank, world, cfg):
    from meridian.workers.loop.train import ListSink, train

    sink = ListSink()
    result = train(cfg, sink=sink)
    return result, sink.records


@pytest.mark.parametrize("dcs, tp, pp", [(("a", "b"), 1, 2), (("a", "b"), 1, 1)])
def test_validation_under_pipeline_and_data_parallelism_matches_one_process(dataset, dcs, tp, pp):
    from dataclasses import replace

    from meridian.workers.contracts.config import ParallelConfig
    from meridian.workers.contracts.model_config import ModelConfig
    from meridian.workers.distributed.multiproc import run_processes

    cfg = TrainConfig(job_id="t", model=ModelConfig(n_layers=2, d_model=64, n_heads=4, seq_len=64, vocab_size=512),
                      data=DataConfig(dataset=dataset), steps=4, global_batch=4, micro_batch=2, seed=1,
                      datacenters=("a",), validation=ValidationConfig(every_steps=2, batches=2))
    (_, single), = run_processes(_train_records, 1, cfg)
    multi = run_processes(_train_records, len(dcs), replace(cfg, datacenters=dcs,
                                                            parallel=ParallelConfig(tp=tp, pp=pp)), timeout_s=180)
    got = [r.val_loss for r in multi[0][1]]
    want = [r.val_loss for r in single]
    assert [v is None for v in got] == [True, False, True, False]
    assert [got[1], got[3]] == pytest.approx([want[1], want[3]], rel=1e-4)


def test_a_text_without_blank_lines_is_cut_into_bounded_documents(tmp_path):
    """One sentence per line and no blank line: before, the whole file was one document (held and encoded
    whole, 7.4 GiB for 60 MB of text) and nothing was held out for validation."""
    from meridian.workers.data.hf_tokenizer import byte_tokenizer
    from meridian.workers.data.prepare import MAX_DOCUMENT_BYTES, iter_documents

    lines = [f"sentence {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(40_000)]
    text = "".join(lines)
    path = tmp_path / "lines.txt"
    path.write_text(text, encoding="utf-8")
    docs = [d for d, _ in iter_documents(str(path), "text")]
    assert "".join(docs) == text  # cut at line ends: nothing lost, nothing split inside a line
    assert all(len(d.encode()) < MAX_DOCUMENT_BYTES + len(lines[-1]) for d in docs)
    assert len(docs) == -(-len(text) // MAX_DOCUMENT_BYTES) >= 30
    byte_tok = tmp_path / "bytes.json"
    byte_tokenizer().save(str(byte_tok))
    m = prepare([str(path)], str(tmp_path / "out"), PrepareOptions(tokenizer=str(byte_tok), val_fraction=0.05),
                progress=False).manifest
    assert m.inputs[0].documents == len(docs)
    assert m.val.documents == sum(is_val_document(i, 0.05) for i in range(len(docs))) >= 1
    assert m.val.tokens >= MAX_DOCUMENT_BYTES and m.tokens == len(text.encode())  # byte tokenizer: no end token


@pytest.mark.parametrize("top", [300, 70_000])
def test_a_tokenizer_with_unused_ids_is_sized_by_its_largest_id(tmp_path, top):
    """Six tokens, one of them with id ``top``: the manifest's vocab_size (what admission checks the model
    against, and the shards' dtype) is ``top + 1``, not 6; before, a model of 6 rows was admitted and training
    hit an out-of-range embedding index, and id 70,000 overflowed uint16 with an error naming no file."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from meridian.service.data_access import check_dataset_vocab
    from meridian.service.errors import InvalidJob
    from meridian.workers.contracts.model_config import ModelConfig

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2, "foo": 3, "</s>": 4, "bar": top},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join("hello world foo bar " * 20 for _ in range(50)))
    out = str(tmp_path / "ds")
    m = prepare([str(corpus)], out, PrepareOptions(tokenizer=str(tmp_path / "tok.json"), val_fraction=0.1),
                progress=False).manifest
    assert m.vocab_size == top + 1 and m.dtype == ("uint16" if top < 1 << 16 else "uint32")
    assert int(np.fromfile(os.path.join(out, m.train.shards[0].file), dtype=m.dtype).max()) == top
    small = ModelConfig(n_layers=2, d_model=64, n_heads=4, seq_len=64, vocab_size=6)
    with pytest.raises(InvalidJob, match=f"vocabulary of {top + 1} tokens but model.vocab_size is 6"):
        check_dataset_vocab(DataConfig(dataset=out), small)
    with pytest.raises(PrepareError, match=rf"vocabulary of {top + 1} tokens \(its 6 tokens have ids up to {top}\)"):
        prepare([str(corpus)], str(tmp_path / "other"),
                PrepareOptions(tokenizer=str(tmp_path / "tok.json"), max_vocab=top), progress=False)


def test_max_vocab_is_checked_when_the_directory_is_reused(corpus, dataset, tmp_path):
    again = prepare([corpus], dataset, BPE, progress=False)
    assert again.reused
    with pytest.raises(PrepareError, match=r"vocabulary of 512 tokens, too large for the model's vocab_size 300"):
        prepare([corpus], dataset, PrepareOptions(train_tokenizer=True, vocab_size=512, val_fraction=0.05,
                                                  max_vocab=300), progress=False)
    assert read_manifest(dataset).to_dict() == again.manifest.to_dict()  # the refusal leaves the dataset as it was
    assert prepare([corpus], dataset, PrepareOptions(train_tokenizer=True, vocab_size=512, val_fraction=0.05,
                                                     max_vocab=512), progress=False).reused
