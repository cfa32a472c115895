"""The training-data path under hostile or unlucky input: what `POST /v1/jobs` answers, and what a worker says,
when a job names data that cannot train it.

A job's data must be refused at submit with a 422 naming what is wrong whenever the service can tell (it reads
every manifest and every text source there), never a hang of the request, never a 500, and never admitted only
for its workers to fail after placement with ``IndexError: index out of range in self`` (or, on a GPU, a
device-side assert): a manifest that is a named pipe or a link to a device, a manifest whose fields are of the
wrong type or disagree with its shards, raw text (token ids 0-255) for a model with fewer embedding rows, a
split too short for one sample. What only a worker can see (a shard's token ids past the vocabulary its manifest
declares) is a ``ValueError`` naming the dataset.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from fakes import FakeService, spec
from fastapi.testclient import TestClient

from meridian.api.app import create_app
from meridian.service.data_access import DataAccess
from meridian.workers.contracts.config import DataConfig
from meridian.workers.data.manifest import Manifest, Shard, Split, write_manifest
from meridian.workers.data.shards import make_dataset

MODEL = {"preset": "nano", "vocab_size": 256}  # seq_len 64


def _dataset(directory, *, vocab: int = 8, train: np.ndarray | None = None) -> str:
    os.makedirs(directory)
    train = np.arange(2000, dtype=np.uint16) % 7 if train is None else train
    train.tofile(os.path.join(directory, "train-00000.bin"))
    val = train[:300]
    val.tofile(os.path.join(directory, "val-00000.bin"))
    write_manifest(str(directory), Manifest(
        key="k", vocab_size=vocab, dtype="uint16", tokenizer_sha256="", tokenizer_trained=False, eos_id=None,
        text_field="text", val_fraction=0.1,
        train=Split(tokens=len(train), documents=1, shards=(Shard("train-00000.bin", len(train)),)),
        val=Split(tokens=len(val), documents=1, shards=(Shard("val-00000.bin", len(val)),))))
    return str(directory)


def _edit(directory: str, edit) -> str:
    path = os.path.join(directory, "manifest.json")
    with open(path) as f:
        m = json.load(f)
    edit(m)
    with open(path, "w") as f:
        json.dump(m, f)
    return directory


@pytest.fixture
def api(store, supervisor, cluster_view, tmp_path):
    """``(post, root)``: ``post(**spec_fields)`` submits to the real API over the fake cluster, with ``root`` as
    the service's data root; it answers ``None`` when the request did not return within 10 s."""
    root = tmp_path / "root"
    root.mkdir()
    supervisor.data_access = DataAccess.for_roots([str(root)])
    fake = FakeService(store, supervisor, cluster_view)
    with TestClient(create_app(fake.config, service=fake), base_url="http://127.0.0.1",
                    raise_server_exceptions=False) as client:
        def post(**fields):
            answer = []
            t = threading.Thread(target=lambda: answer.append(client.post("/v1/jobs", json=spec(**fields))),
                                 daemon=True)
            t.start()
            t.join(10)
            return answer[0] if answer else None

        yield post, root


def _refused(answer, *words: str) -> str:
    assert answer is not None, "the request hung"
    assert answer.status_code == 422, (answer.status_code, answer.text)
    body = answer.json()
    assert body["type"] == "urn:meridian:problem:invalid-job" and "Traceback" not in body["detail"]
    for w in words:
        assert w in body["detail"], body["detail"]
    return body["detail"]


# -- the manifest file itself ------------------------------------------------------------------------------
def test_a_manifest_that_is_a_named_pipe_is_refused_without_hanging_the_request(api):
    """``open(manifest.json)`` blocked until a writer came: the request, and its server thread, hung forever."""
    post, root = api
    ds = _dataset(root / "ds")
    os.remove(os.path.join(ds, "manifest.json"))
    fifo = os.path.join(ds, "manifest.json")
    os.mkfifo(fifo)
    try:
        answer = post(model=MODEL, data={"dataset": ds})
    finally:  # unblock a reader of the old code
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    _refused(answer, "manifest.json", "not a regular file")


def test_a_manifest_linked_to_an_endless_device_is_refused_at_once(tmp_path):
    """A ``manifest.json`` linked to ``/dev/zero`` was read to the end, which never comes: a request that hung while
    the service's memory grew without bound. Read in a child process with capped memory and time, so the old
    code fails this test instead of eating the machine."""
    ds = _dataset(tmp_path / "ds")
    os.remove(os.path.join(ds, "manifest.json"))
    os.symlink("/dev/zero", os.path.join(ds, "manifest.json"))
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30));"
            "from meridian.workers.data.manifest import read_manifest\n"
            "try:\n read_manifest(sys.argv[1])\nexcept ValueError as e:\n print('REFUSED', e)")
    try:
        out = subprocess.run([sys.executable, "-c", code, ds], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("reading a manifest linked to /dev/zero did not end")
    assert out.stdout.startswith("REFUSED"), out.stdout + out.stderr[-2000:]
    assert "manifest.json" in out.stdout and "symlink" in out.stdout


# -- the manifest's fields -----------------------------------------------------------------------------------
def _set(**values):
    return lambda m: m.update(values)


def _split(split, **values):
    return lambda m: m[split].update(values)


def _shard(**values):
    return lambda m: m["train"]["shards"][0].update(values)


@pytest.mark.parametrize(("edit", "words"), [
    (_set(vocab_size="300"), "vocab_size"),
    (_set(vocab_size=None), "vocab_size"),
    (_set(vocab_size=0), "vocab_size"),
    (_set(vocab_size=True), "vocab_size"),
    (_set(dtype="bogus"), "dtype"),
    (_set(dtype="float32"), "dtype"),
    (_set(key=5), "key"),
    (_split("val", tokens="x"), "val.tokens"),
    (_split("val", tokens=10**6, shards=[]), "val.tokens"),
    (_shard(tokens=-5), "train shard"),
    (_shard(tokens=2.5), "train shard"),
], ids=["vocab-str", "vocab-null", "vocab-0", "vocab-bool", "dtype-bogus", "dtype-float", "key-int",
        "val-tokens-str", "val-tokens-not-its-shards", "shard-negative", "shard-float"])
def test_a_manifest_with_a_field_of_the_wrong_type_or_value_is_a_422_naming_it(api, edit, words):
    """A mistyped field was a 500 (``TypeError`` comparing it, ``vocab_size`` a string, ``val.tokens`` one), or was
    admitted and failed on the workers after placement (``data type 'bogus' not understood``; a ``float32``
    shard read as token ids; a validation split the manifest said was there and its shards were not)."""
    post, root = api
    ds = _edit(_dataset(root / "ds"), edit)
    _refused(post(model=MODEL, validation={"every_steps": 2}, data={"dataset": ds}),
             "manifest.json", words, "prepare the dataset again")


def test_a_shard_whose_size_disagrees_with_the_manifest_is_a_422(api):
    """A truncated shard (a copy cut short) was admitted; every worker then refused it after placement."""
    post, root = api
    ds = _dataset(root / "ds")
    with open(os.path.join(ds, "train-00000.bin"), "r+b") as f:
        f.truncate(1000)
    _refused(post(model=MODEL, data={"dataset": ds}), "train-00000.bin", "1000 bytes", "4000",
             "prepare the dataset again")


# -- token ids and the model's embedding ---------------------------------------------------------------------
@pytest.mark.parametrize("source", ["file", "builtin"])
def test_raw_text_needs_a_model_with_a_row_for_every_byte(api, source):
    """Raw text is tokenised as bytes (ids 0-255); a model with ``vocab_size`` 100 was admitted and its workers
    failed on the first batch with ``IndexError: index out of range in self`` (a device-side assert on a GPU)."""
    post, root = api
    text = root / "t.txt"
    text.write_text("hello world " * 1000)
    data = {"source": str(text)} if source == "file" else {}
    _refused(post(model={"preset": "nano", "vocab_size": 100}, data=data), "model.vocab_size", "256")
    ok = post(model={"preset": "nano", "vocab_size": 256}, data=data)
    assert ok.status_code == 201, ok.text


def test_token_ids_past_the_manifests_vocabulary_fail_naming_the_dataset(tmp_path):
    """The service admits a dataset by its manifest's ``vocab_size``; shards holding larger ids (a manifest edited
    or copied from another dataset) were handed to the model, which fails with ``IndexError: index out of range in
    self`` on a CPU and a device-side assert on a GPU, or trains on them silently where the model is larger."""
    ds = _dataset(tmp_path / "ds", train=np.full(2000, 300, dtype=np.uint16))
    data = make_dataset(DataConfig(dataset=ds), 64, 0)
    with pytest.raises(ValueError, match=r"token id 300 .* vocab_size of 8") as failed:
        data.batch(0, 2)
    assert ds in str(failed.value) and "prepare the dataset again" in str(failed.value)


# -- too little data for one sample --------------------------------------------------------------------------
def test_a_text_too_short_for_one_training_sample_is_a_422(api):
    """An empty or tiny text file was admitted; every worker then failed after placement (``too few for one train
    sample``)."""
    post, root = api
    for name, body in (("empty.txt", ""), ("tiny.txt", "hi")):
        (root / name).write_text(body)
        _refused(post(data={"source": str(root / name)}), name, "model.seq_len")


def test_a_text_whose_held_out_part_is_too_short_for_validation_is_a_422(api):
    """With ``validation`` the workers build the held-out split first; 5 % of a 1,200-byte text is 60 bytes, not one
    sample of 64 tokens, and the job failed on its workers (a dataset's short validation split was a 422 already).
    Without ``validation`` the same text is admitted (the final evaluation is skipped, saying why)."""
    post, root = api
    text = root / "small.txt"
    text.write_text(("the quick brown fox jumps over the lazy dog. " * 50)[:1200])
    _refused(post(validation={"every_steps": 2}, data={"source": str(text)}), "validation", "held-out")
    assert post(data={"source": str(text)}).status_code == 201


def test_a_dataset_too_short_for_one_training_sample_is_a_422(api):
    post, root = api
    ds = _dataset(root / "ds", train=np.arange(40, dtype=np.uint16) % 7)
    _refused(post(model=MODEL, data={"dataset": ds}), "40 train tokens", "model.seq_len")


# -- two `meridian data prepare` into one directory ------------------------------------------------------------
def test_a_second_prepare_into_a_directory_being_written_is_refused_and_the_first_one_finishes(tmp_path, monkeypatch):
    """Two `meridian data prepare --out DIR` at once (two people, a retried script) each deleted and rewrote the
    other's files: the first then failed with a bare ``FileNotFoundError`` (``train-00000.bin.tmp`` gone) or wrote a
    manifest over shards the other had just replaced. Now the second is refused at once, naming the directory."""
    from meridian.workers.data import prepare as prep

    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(f"document {i}: the quick brown fox jumps over the lazy dog" for i in range(400)))
    out, opts = str(tmp_path / "ds"), prep.PrepareOptions(train_tokenizer=True, vocab_size=300, val_fraction=0.1)
    writing, go_on = threading.Event(), threading.Event()
    encode = prep._encode

    def paused(*args, **kwargs):  # the first run stops halfway through writing its shards
        if threading.current_thread().name == "first":
            writing.set()
            go_on.wait(30)
        return encode(*args, **kwargs)

    monkeypatch.setattr(prep, "_encode", paused)
    first: list = []
    t = threading.Thread(name="first", target=lambda: first.append(_outcome(prep.prepare, [str(corpus)], out, opts)))
    t.start()
    try:
        assert writing.wait(30)
        second = _outcome(prep.prepare, [str(corpus)], out, opts)
    finally:
        go_on.set()
        t.join(60)
    assert isinstance(second, prep.PrepareError), second
    assert out in str(second) and "another `meridian data prepare`" in str(second)
    assert isinstance(first[0], prep.PrepareResult), first[0]
    again = prep.prepare([str(corpus)], out, opts, progress=False)  # the first run's dataset is whole
    assert again.reused and again.manifest.tokens == first[0].manifest.tokens
    x, _ = make_dataset(DataConfig(dataset=out), 16, 0).batch(0, 2)
    assert x.shape == (2, 16)


def _outcome(fn, *args):
    try:
        return fn(*args, progress=False)
    except Exception as e:  # noqa: BLE001 - the test looks at what it was
        return e


# -- on a real cluster ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_job_on_shards_past_their_vocabulary_fails_saying_so(tmp_path, two_nodes):
    """End to end on a real Ray cluster: the job's reason names the dataset and the id, where it was ``IndexError:
    index out of range in self`` from inside the model (a device-side assert on a GPU)."""
    import time

    from ray_env import service_client

    root = tmp_path / "data"
    ds = _dataset(root / "ds", train=np.full(2000, 300, dtype=np.uint16))
    with service_client(two_nodes.address, str(tmp_path / "svc"), data_roots=(str(root),)) as client:
        answer = client.post("/v1/jobs", json=spec(model=MODEL, data={"dataset": ds}))
        assert answer.status_code == 201, answer.text
        deadline = time.monotonic() + 240
        while (job := client.get(f"/v1/jobs/{answer.json()['id']}").json())["state"] not in (
                "failed", "succeeded", "cancelled") and time.monotonic() < deadline:
            time.sleep(0.5)
        events = client.get(f"/v1/jobs/{job['id']}/events").text
    assert job["state"] == "failed", job
    assert "holds token id 300" in job["message"] + events and ds in job["message"] + events, (job, events[-3000:])
