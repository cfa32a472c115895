"""A prepared dataset is admitted by its directory under the data roots, so the files its manifest names must
stay inside it: a shard, document index or tokenizer named with ``..`` or an absolute path, or a symlink in the
directory, is refused at submit (a 422 naming the file) and again by the workers as they open it."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from meridian.service.data_access import DataAccess
from meridian.service.errors import InvalidJob
from meridian.workers.contracts.config import DataConfig
from meridian.workers.data.hf_tokenizer import export_tokenizer
from meridian.workers.data.manifest import Manifest, Shard, Split, write_manifest
from meridian.workers.data.shards import make_dataset

SECRET = b"TOP-SECRET api_key=hunter2 " * 40


@pytest.fixture
def layout(tmp_path):
    """A data root holding one small dataset, and a secret file outside the root."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    ds = root / "ds"
    ds.mkdir(parents=True)
    outside.mkdir()
    (outside / "secret.bin").write_bytes(SECRET)
    tokens = np.arange(2000, dtype=np.uint16) % 7
    tokens.tofile(ds / "train-00000.bin")
    tokens[:300].tofile(ds / "val-00000.bin")
    np.save(ds / "train-docs.npy", np.zeros(1, dtype=np.int64))
    (ds / "tokenizer.json").write_text("{}")
    write_manifest(str(ds), Manifest(
        key="k", vocab_size=8, dtype="uint16", tokenizer_sha256="", tokenizer_trained=False, eos_id=None,
        text_field="text", val_fraction=0.1,
        train=Split(tokens=2000, documents=1, shards=(Shard("train-00000.bin", 2000),), doc_index="train-docs.npy"),
        val=Split(tokens=300, documents=1, shards=(Shard("val-00000.bin", 300),))))
    return DataAccess.for_roots([str(root)]), ds, outside / "secret.bin"


def _edit_manifest(ds, edit) -> None:
    path = ds / "manifest.json"
    m = json.loads(path.read_text())
    edit(m)
    path.write_text(json.dumps(m))


def _shard(name: str, tokens: int):
    def edit(m):
        m["train"]["shards"] = [{"file": name, "tokens": tokens}]
        m["train"]["tokens"] = tokens
    return edit


def test_the_untouched_dataset_is_admitted_and_read(layout):
    access, ds, _ = layout
    cfg = access.check(DataConfig(dataset=str(ds)))
    x, _ = make_dataset(cfg, 16, 0).batch(0, 2)
    assert x.shape == (2, 16) and int(x.max()) < 7


@pytest.mark.parametrize("kind", ["dotdot", "absolute"])
def test_a_shard_named_outside_the_directory_is_refused_at_submit_and_by_the_workers(layout, kind):
    access, ds, secret = layout
    name = os.path.relpath(secret, ds) if kind == "dotdot" else str(secret)
    _edit_manifest(ds, _shard(name, len(SECRET) // 2))
    with pytest.raises(InvalidJob, match="not a plain file name") as refused:
        access.check(DataConfig(dataset=str(ds)))
    assert name in str(refused.value) and "train shard" in str(refused.value)
    with pytest.raises(ValueError, match="not a plain file name"):
        make_dataset(DataConfig(dataset=str(ds)), 16, 0)


@pytest.mark.parametrize("field", ["doc_index", "tokenizer_file"])
def test_the_other_named_files_must_be_plain_names_too(layout, field):
    access, ds, secret = layout

    def edit(m):
        if field == "doc_index":
            m["train"]["doc_index"] = "../../outside/secret.bin"
        else:
            m["tokenizer_file"] = str(secret)
    _edit_manifest(ds, edit)
    with pytest.raises(InvalidJob, match=f"{field.split('_')[0]}.*not a plain file name"):
        access.check(DataConfig(dataset=str(ds)))


def test_a_symlinked_shard_is_refused_at_submit_and_by_the_workers(layout):
    access, ds, secret = layout
    (ds / "train-00001.bin").symlink_to(secret)
    _edit_manifest(ds, _shard("train-00001.bin", len(SECRET) // 2))
    with pytest.raises(InvalidJob, match=r"train shard train-00001.bin is a symlink"):
        access.check(DataConfig(dataset=str(ds)))
    # Swapped in after admission: the worker's open does not follow it either.
    with pytest.raises(ValueError, match=r"train-00001.bin cannot be opened .*not a symlink"):
        make_dataset(DataConfig(dataset=str(ds)), 16, 0)


def test_a_shard_that_is_a_fifo_is_refused_without_blocking(layout):
    access, ds, _ = layout
    os.mkfifo(ds / "train-00001.bin")
    _edit_manifest(ds, _shard("train-00001.bin", 0))
    with pytest.raises(InvalidJob, match="train-00001.bin is not a regular file"):
        access.check(DataConfig(dataset=str(ds)))
    with pytest.raises(ValueError, match="train-00001.bin is not a regular file"):
        make_dataset(DataConfig(dataset=str(ds)), 16, 0)


def test_export_does_not_copy_a_symlinked_tokenizer(layout, tmp_path):
    _, ds, secret = layout
    plain = export_tokenizer(DataConfig(dataset=str(ds)), str(tmp_path / "plain"), model_max_length=16)
    assert plain["written"] and (tmp_path / "plain" / "tokenizer.json").read_text() == "{}"
    os.remove(ds / "tokenizer.json")
    (ds / "tokenizer.json").symlink_to(secret)
    out = export_tokenizer(DataConfig(dataset=str(ds)), str(tmp_path / "export"), model_max_length=16)
    assert not out["written"] and "not a symlink" in out["reason"]
    assert not (tmp_path / "export" / "tokenizer.json").exists()


@pytest.mark.parametrize("content", ['{"format": 1}', '[1, 2]', '{"format": 1, "key": "k", "vocab_size": 8, '
                                     '"dtype": "uint16", "tokenizer_sha256": "", "tokenizer_trained": false, '
                                     '"eos_id": null, "text_field": "text", "val_fraction": 0.1, "train": 5, "val": {}}'],
                         ids=["fields-missing", "a-list", "a-split-of-another-shape"])
def test_a_manifest_of_another_shape_is_refused_at_submit_saying_so(layout, content):
    """A manifest that parsed as JSON but was not a manifest's shape made `POST /v1/jobs` a 500 (a TypeError
    from rebuilding it) instead of a 422 naming the file."""
    access, ds, _ = layout
    (ds / "manifest.json").write_text(content)
    with pytest.raises(InvalidJob, match="manifest") as refused:
        access.check(DataConfig(dataset=str(ds)))
    assert "manifest.json" in str(refused.value) and "prepare the dataset again" in str(refused.value)
