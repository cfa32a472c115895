"""``meridian export`` of a checkpoint into a directory that is not empty, and of a checkpoint that is not the
model given, and of a job whose dataset's tokenizer was damaged."""

from __future__ import annotations

import json

import pytest

from meridian.workers.contracts.fields import to_plain
from meridian.workers.contracts.model_config import model_preset
from meridian.workers.model.build import build_model
from meridian.workers.model.export import export_checkpoint, export_job
from meridian.workers.state import checkpoint as ckpt_io


def _checkpoint(tmp_path, preset: str = "nano") -> str:
    weights = {n: p.detach().clone() for n, p in build_model(model_preset(preset)).named_parameters()}
    ckpt_io.save(str(tmp_path / "job"), ckpt_io.Checkpoint(step=1, model=weights, optimizer={}, fingerprint={}))
    return str(tmp_path / "job" / "step-00000001")


def test_an_export_without_a_tokenizer_into_a_folder_holding_one_says_that_one_is_not_this_job_s(tmp_path):
    # Job A's export wrote its tokenizer; job B's into the same folder wrote none ("written": false) and said
    # nothing of A's, which AutoTokenizer.from_pretrained then loaded beside B's weights.
    ckpt, model, out = _checkpoint(tmp_path), to_plain(model_preset("nano")), tmp_path / "hf"
    first = export_job(ckpt, model, {"source": "builtin:python-reference"}, str(out))
    assert first["tokenizer"]["written"] and (out / "tokenizer.json").exists()
    second = export_job(ckpt, model, {"dataset": str(tmp_path / "not-here")}, str(out))["tokenizer"]
    assert not second["written"] and "is not a prepared dataset" in second["reason"]
    assert second["stale_files"] == ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
    assert (f"{out} still holds tokenizer.json, tokenizer_config.json, special_tokens_map.json from before, which "
            "transformers.AutoTokenizer would load for these weights") in second["reason"]  # fmt: skip
    assert "remove them, or export into an empty directory" in second["reason"]
    fresh = export_job(ckpt, model, {"dataset": str(tmp_path / "not-here")}, str(tmp_path / "empty"))["tokenizer"]
    assert "stale_files" not in fresh and "still holds" not in fresh["reason"]


def test_a_checkpoint_of_another_model_is_refused_as_such_not_as_a_model_parallel_slice(tmp_path):
    with pytest.raises(ValueError) as e:
        export_checkpoint(_checkpoint(tmp_path, "nano"), to_plain(model_preset("tiny")), str(tmp_path / "hf"))
    assert "model-parallel" not in str(e.value)
    assert "holds tok_emb.weight as (256, 64), where the model given (gpt, n_layers 4, d_model 128" in str(e.value)
    assert "the checkpoint is of another model; export it with the model of the job that wrote it" in str(e.value)
    assert not (tmp_path / "hf").exists()  # nothing written


def test_export_of_a_job_whose_dataset_tokenizer_is_damaged_is_a_cli_error_not_a_traceback(tmp_path, monkeypatch,
                                                                                           capsys):
    """The tokenizers library raises a bare ``Exception`` on a damaged tokenizer.json; ``meridian export`` let it
    out as a traceback, with and without ``--json``."""
    from dataclasses import replace
    from pydoc_data.topics import topics

    import meridian.cli.main as cli
    from meridian.workers.data.manifest import read_manifest
    from meridian.workers.data.prepare import PrepareOptions, prepare

    (tmp_path / "a.txt").write_text("\n\n".join(topics[k] for k in sorted(topics)[:10]))
    prepare([str(tmp_path / "a.txt")], str(tmp_path / "ds"),
            PrepareOptions(train_tokenizer=True, vocab_size=300, val_fraction=0.1), progress=False)
    manifest = read_manifest(str(tmp_path / "ds"))
    assert manifest.eos_id is not None  # what makes the export read the tokenizer, for its end-of-text token
    (tmp_path / "ds" / manifest.tokenizer_file).write_text("{damaged")
    cfg = replace(model_preset("nano"), vocab_size=300)
    weights = {n: p.detach().clone() for n, p in build_model(cfg).named_parameters()}
    ckpt_io.save(str(tmp_path / "job"), ckpt_io.Checkpoint(step=1, model=weights, optimizer={}, fingerprint={}))
    latest = str(tmp_path / "job" / "step-00000001")

    class Client:
        def __init__(self, url: str | None = None) -> None:
            pass

        def artifacts(self, job_id: str) -> dict:
            return {"latest": latest, "keep_final": True, "storage": str(tmp_path / "job"), "readable_here": True,
                    "artifacts": [{"path": latest, "step": 1, "final": True}], "model": to_plain(cfg),
                    "data": {"dataset": str(tmp_path / "ds")}}

        def close(self) -> None:
            pass

    monkeypatch.setattr(cli, "Client", Client)
    out = tmp_path / "hf"
    assert cli.main(["export", "job-1", "--out", str(out), "--json"]) == 1
    captured = capsys.readouterr()
    problem = json.loads(captured.out)["error"]
    assert problem["type"] == "urn:meridian:problem:tokenizer-unreadable"
    assert problem["detail"].startswith(f"the weights are in {out}, but its tokenizer.json, copied from job job-1's "
                                        "dataset, is not one the tokenizers library can read (")
    assert f"delete it from {out}" in problem["detail"] and "prepare the text again" in problem["detail"]
    assert (out / "model.safetensors").exists()
    assert cli.main(["export", "job-1", "--out", str(tmp_path / "hf2")]) == 1
    assert capsys.readouterr().err == f"error: {problem['detail'].replace(str(out), str(tmp_path / 'hf2'))}\n"
