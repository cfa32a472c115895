"""A user's whole path, on CPU, through the REST API against a real two-datacenter Ray cluster: prepare a
dataset with a trained BPE, train ``llama-tiny`` across two datacenters with validation on (checkpoints in a
``--storage`` folder of their own), export it, load the
export with ``transformers`` (model and tokenizer), and find transformers' loss on the validation batches the
job evaluated equal to the job's last ``val_loss``."""

from __future__ import annotations

import json
import time

import pytest
import torch
from fakes import spec
from ray_env import service_client

from meridian.cli.main import main
from meridian.workers.contracts.config import DataConfig
from meridian.workers.contracts.fields import from_plain
from meridian.workers.data.shards import make_dataset
from meridian.workers.loop.replica import validation_batches

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

VOCAB = 512
SEQ_LEN, MICRO, SEED, VAL_BATCHES = 64, 2, 7, 4


def _wait_done(api, job_id: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = api.get(f"/v1/jobs/{job_id}").json()
        if job["state"] in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(0.3)
    raise AssertionError(f"job {job_id} did not finish in {timeout_s} s: {job['state']} {job['message']}")


def test_prepare_train_on_two_datacenters_export_and_transformers_agrees_on_validation_loss(
    tmp_path, monkeypatch, capsys, two_nodes
):
    import argparse
    import inspect
    import typing

    # Text files every CPython ships (~0.4 MB, ~1500 blank-line separated documents, ~145k tokens).
    inputs = [argparse.__file__, inspect.__file__, typing.__file__]
    data_dir = tmp_path / "meridian"
    dataset = data_dir / "data" / "stdlib"  # under the service's default data root, <data dir>/data
    assert main(["data", "prepare", *inputs, "--out", str(dataset), "--train-tokenizer",
                 "--vocab-size", str(VOCAB), "--val-fraction", "0.05", "--json"]) == 0
    capsys.readouterr()

    storage = tmp_path / "shared"  # `meridian serve --storage PATH`: checkpoints and final weights go there
    with service_client(two_nodes.address, str(data_dir), storage=str(storage)) as api:
        body = spec(name="e2e", model={"preset": "llama-tiny", "n_layers": 2, "seq_len": SEQ_LEN, "vocab_size": VOCAB},
                    data={"dataset": str(dataset)},
                    training={"steps": 24, "global_batch": 8, "micro_batch": MICRO, "lr": 3e-3, "seed": SEED},
                    topology={"datacenters": ["dc-a", "dc-b"]},
                    validation={"every_steps": 12, "batches": VAL_BATCHES})
        r = api.post("/v1/jobs", json=body)
        assert r.status_code == 201, r.text
        job = _wait_done(api, r.json()["id"], timeout_s=240)
        assert job["state"] == "succeeded", (job["message"], api.get(f"/v1/jobs/{job['id']}/logs").text[-3000:])
        assert sorted(p["datacenter"] for p in job["placement"]) == ["dc-a", "dc-b"]
        points = api.get(f"/v1/jobs/{job['id']}/metrics").json()["points"]
        vals = [(p["step"], p["val_loss"]) for p in points if p.get("val_loss") is not None]
        assert [s for s, _ in vals] == [12, 24], vals
        job_val_loss = vals[-1][1]
        artifacts = api.get(f"/v1/jobs/{job['id']}/artifacts").json()
        assert artifacts["storage"] == str(storage.resolve() / job["id"]), artifacts
        final = artifacts["artifacts"][-1]  # written by both ranks, one shard each (DCP)
        assert final["final"] and {"meridian.json", "__0_0.distcp", "__1_0.distcp"} <= {f["name"] for f in final["files"]}

        monkeypatch.setenv("MERIDIAN_URL", str(api.base_url))
        out = tmp_path / "hf"
        assert main(["export", job["id"], "--out", str(out), "--json"]) == 0
        exported = json.loads(capsys.readouterr().out)
    assert exported["final"] is True and exported["tokenizer"]["written"] is True

    model = transformers.AutoModelForCausalLM.from_pretrained(str(out)).float().eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    # The tokenizer is the dataset's: its vocabulary, and text it decodes encodes back to the same text.
    data = make_dataset(from_plain(DataConfig, artifacts["data"]), SEQ_LEN, SEED, split="eval")
    assert len(tokenizer) == VOCAB and tokenizer.eos_token == "<|endoftext|>"
    text = tokenizer.decode(next(validation_batches(data, MICRO, 1))[0][0].tolist())
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text

    # transformers' loss on exactly the micro-batches the job's evaluation read (the workers' own sampler).
    losses = []
    with torch.no_grad():
        for x, y in validation_batches(data, MICRO, VAL_BATCHES):
            logits = model(input_ids=x).logits
            losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).item())
    theirs = sum(losses) / len(losses)
    assert theirs == pytest.approx(job_val_loss, rel=0.01), (theirs, job_val_loss)
    assert theirs < 0.9 * float(torch.log(torch.tensor(VOCAB)))  # it learned: well below a uniform guess
