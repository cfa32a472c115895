"""Bring your own model, through the REST API against a real two-datacenter Ray cluster, on CPU: a Qwen2-shaped
and a Llama-3.2-shaped (tied head, RoPE scaling ``llama3``) random checkpoint, saved by transformers with the
dataset's tokenizer, each continue pre-training across two datacenters with validation, are exported, and
transformers' loss on the validation batches the job evaluated is within 2% of the job's last ``val_loss``; a user
factory's module (allowed with ``--model-module``) trains too."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from fakes import spec
from ray_env import local_cluster, service_client
from test_end_to_end_hf import _wait_done
from test_model_sources import write_user_models

from meridian.cli.main import main
from meridian.workers.contracts.config import DataConfig
from meridian.workers.contracts.fields import from_plain
from meridian.workers.data.shards import make_dataset
from meridian.workers.loop.replica import validation_batches

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

VOCAB, SEQ_LEN, MICRO, SEED, VAL_BATCHES, STEPS = 512, 64, 2, 7, 4, 16
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
CHECKPOINTS = {
    "qwen2": lambda: transformers.Qwen2Config(**SHAPE),
    "llama3.2": lambda: transformers.LlamaConfig(**SHAPE, tie_word_embeddings=True, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
}


def test_hf_checkpoints_and_a_factory_module_train_across_two_datacenters_and_export(tmp_path, monkeypatch, capsys):
    import argparse
    import inspect
    import typing

    data_dir = tmp_path / "meridian"
    root = data_dir / "data"  # the service's default data root
    dataset = root / "stdlib"
    assert main(["data", "prepare", argparse.__file__, inspect.__file__, typing.__file__, "--out", str(dataset),
                 "--train-tokenizer", "--vocab-size", str(VOCAB), "--val-fraction", "0.05", "--json"]) == 0
    capsys.readouterr()
    tokenizer_file = next(dataset.glob("tokenizer*.json"))
    for name, config in CHECKPOINTS.items():
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config()).save_pretrained(str(root / name),
                                                                                max_shard_size="200KB")
        shutil.copy(tokenizer_file, root / name / "tokenizer.json")  # the checkpoint's tokenizer is the data's
    site = tmp_path / "site"
    write_user_models(site)
    # The factory's package must import in the service's describing child and in every Ray worker.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))

    training = {"steps": STEPS, "global_batch": 8, "micro_batch": MICRO, "lr": 3e-3, "seed": SEED}
    common = dict(data={"dataset": str(dataset)}, training=training, topology={"datacenters": ["dc-a", "dc-b"]},
                  validation={"every_steps": 8, "batches": VAL_BATCHES})
    models = {name: {"init_from": str(root / name), "seq_len": SEQ_LEN} for name in CHECKPOINTS}
    models["factory"] = {"factory": "mymodels.tiny:build", "args": {"vocab": VOCAB, "d": 32, "seq_len": SEQ_LEN},
                         "seq_len": SEQ_LEN}
    storage = tmp_path / "shared"
    with local_cluster(("dc-a", "dc-b")) as cluster, \
            service_client(cluster.address, str(data_dir), storage=str(storage), model_modules=("mymodels",)) as api:  # fmt: skip
        ids = {}
        for name, model in models.items():
            r = api.post("/v1/jobs", json={**spec(name=name, **common), "model": model})
            assert r.status_code == 201, r.text
            ids[name] = r.json()["id"]
        jobs = {name: _wait_done(api, job_id, timeout_s=600) for name, job_id in ids.items()}
        vals, artifacts = {}, {}
        for name, job in jobs.items():
            logs = api.get(f"/v1/jobs/{job['id']}/logs").text[-3000:]
            assert job["state"] == "succeeded", (name, job["message"], logs)
            assert sorted(p["datacenter"] for p in job["placement"]) == ["dc-a", "dc-b"]
            points = api.get(f"/v1/jobs/{job['id']}/metrics").json()["points"]
            vals[name] = [(p["step"], p["val_loss"]) for p in points if p.get("val_loss") is not None]
            assert [s for s, _ in vals[name]] == [8, 16], (name, vals[name])
            losses = [p["loss"] for p in points if p.get("loss") is not None]
            assert losses[-1] < losses[0], (name, losses)
            artifacts[name] = api.get(f"/v1/jobs/{job['id']}/artifacts").json()
        monkeypatch.setenv("MERIDIAN_URL", str(api.base_url))
        exported = {}
        for name in CHECKPOINTS:
            assert main(["export", ids[name], "--out", str(tmp_path / "hf" / name), "--max-shard-mb", "0.2",
                         "--json"]) == 0
            exported[name] = json.loads(capsys.readouterr().out)

    data = make_dataset(from_plain(DataConfig, artifacts["qwen2"]["data"]), SEQ_LEN, SEED, split="eval")
    for name, done in exported.items():
        out = tmp_path / "hf" / name
        assert done["final"] and done["tokenizer"]["written"] and "model.safetensors.index.json" in done["weights"]
        model = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
        config = json.loads((out / "config.json").read_text())
        assert config["model_type"] == ("qwen2" if name == "qwen2" else "llama")
        if name == "llama3.2":
            assert config["rope_parameters"]["rope_type"] == "llama3" and config["tie_word_embeddings"] is True
        eos = transformers.AutoTokenizer.from_pretrained(str(out)).eos_token_id
        assert config["eos_token_id"] == config["bos_token_id"] == eos is not None
        losses = []
        with torch.no_grad():  # transformers' loss on exactly the micro-batches the job's evaluation read
            for x, y in validation_batches(data, MICRO, VAL_BATCHES):
                logits = model(input_ids=x).logits
                losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).item())
        theirs, job_val = sum(losses) / len(losses), vals[name][-1][1]
        print(f"{name}: transformers' validation loss {theirs:.5f}, the job's {job_val:.5f} ({theirs / job_val:.5f}x)")
        assert theirs == pytest.approx(job_val, rel=0.02), (name, theirs, job_val)
        assert theirs < 0.9 * float(torch.log(torch.tensor(VOCAB)))  # it learned: well below a uniform guess
