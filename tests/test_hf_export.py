"""``meridian export`` writes the model's own family back: a Hugging Face model's own config.json and tensor
names, sharded safetensors in the checkpoint's precision or bf16, a generation config, and the job's tokenizer
with its special tokens in both configs; transformers loads it with Meridian's own logits (fp32, within 1e-4)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from test_hf_models import VOCAB, save_random

from meridian.workers.contracts.fields import to_plain
from meridian.workers.contracts.hf_config import hf_model_config, read_safetensors_header
from meridian.workers.contracts.model_config import model_preset
from meridian.workers.model.build import build_model
from meridian.workers.model.export import export_job
from meridian.workers.state import checkpoint as ckpt_io

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """A prepared dataset whose tokenizer (a BPE trained here, ``VOCAB`` ids) has an end-of-text token."""
    from pydoc_data.topics import topics

    from meridian.workers.data.prepare import PrepareOptions, prepare

    root = tmp_path_factory.mktemp("data")
    (root / "a.txt").write_text("\n\n".join(topics[k] for k in sorted(topics)[:12]))
    prepare([str(root / "a.txt")], str(root / "ds"),
            PrepareOptions(train_tokenizer=True, vocab_size=VOCAB, val_fraction=0.1), progress=False)
    return {"dataset": str(root / "ds")}


def _trained(tmp_path, family):
    """A Meridian checkpoint of ``family`` after "training": the saved model's weights, every one moved."""
    save_random(tmp_path / "start", family)
    cfg = hf_model_config(str(tmp_path / "start"), weights=True, seq_len=32)
    torch.manual_seed(9)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    ckpt_io.save(str(tmp_path / "job"), ckpt_io.Checkpoint(step=3, model=weights, optimizer={}, fingerprint={}))
    return cfg, model, str(tmp_path / "job" / "step-00000003")


@pytest.mark.parametrize("family", ["llama3", "qwen2", "gpt_neox", "mistral"])
def test_an_hf_model_exports_as_its_own_family_and_transformers_gives_meridian_s_logits(tmp_path, family, dataset):
    cfg, ours, checkpoint = _trained(tmp_path, family)
    done = export_job(checkpoint, to_plain(cfg), dataset, str(tmp_path / "out"), max_shard_bytes=40_000)
    out = tmp_path / "out"
    assert "model.safetensors.index.json" in done["weights"] and len(done["weights"]) > 2  # sharded
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(theirs).__name__ == ours.architecture and theirs.dtype == torch.float32
    x = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (theirs(input_ids=x).logits - ours(x)).abs().max().item() < 1e-4
    # Its own config.json, back: the same family and shape (RoPE scaling included), the tokenizer's ids in it.
    start = json.loads((tmp_path / "start" / "config.json").read_text())
    config = json.loads((out / "config.json").read_text())
    for key in ("model_type", "architectures", "hidden_size", "num_hidden_layers", "tie_word_embeddings"):
        assert config[key] == start[key], key
    if family == "llama3":
        assert config["rope_parameters"]["rope_type"] == "llama3"
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert tokenizer.eos_token == tokenizer.bos_token == "<|endoftext|>"  # no template: GPT-2's convention
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (eos, eos, eos)
    generation = transformers.GenerationConfig.from_pretrained(str(out))
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (eos, eos, eos)
    if family == "gpt_neox":  # its family's stored name for the head
        names = {n for f in done["weights"] if f.endswith(".safetensors") for n in read_safetensors_header(str(out / f))}
        assert "embed_out.weight" in names and "lm_head.weight" not in names


def test_bf16_export_and_the_checkpoint_s_own_precision(tmp_path, dataset):
    cfg, ours, checkpoint = _trained(tmp_path, "qwen2")
    export_job(checkpoint, to_plain(cfg), dataset, str(tmp_path / "bf16"), dtype="bf16")
    header = read_safetensors_header(str(tmp_path / "bf16" / "model.safetensors"))
    assert {dtype for dtype, _ in header.values()} == {"BF16"}
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"), dtype=torch.float32).eval()
    x = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (theirs(input_ids=x).logits - ours(x)).abs().max().item() < 0.1  # bf16 rounding, nothing lost
    export_job(checkpoint, to_plain(cfg), dataset, str(tmp_path / "bf16"))  # again into the same folder: fp32
    assert not (tmp_path / "bf16" / "model.safetensors.index.json").exists()
    assert {d for d, _ in read_safetensors_header(str(tmp_path / "bf16" / "model.safetensors")).values()} == {"F32"}
    with pytest.raises(ValueError, match="--dtype 'fp8'"):
        export_job(checkpoint, to_plain(cfg), dataset, str(tmp_path / "x"), dtype="fp8")


def test_a_builtin_llama_exports_with_its_tokenizer_s_template_bos(tmp_path):
    """A tokenizer whose post-processor puts a begin-of-text token first (Llama 3's) names it as bos."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from meridian.workers.data.prepare import PrepareOptions, prepare

    vocab = {chr(i + 97): i for i in range(26)} | {" ": 26, "<|begin_of_text|>": 27, "<|end_of_text|>": 28}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=" "))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[("<|begin_of_text|>", 27)])
    tok.save(str(tmp_path / "tok.json"))
    (tmp_path / "a.txt").write_text("some words here\n\n" * 200)
    prepare([str(tmp_path / "a.txt")], str(tmp_path / "ds"), PrepareOptions(tokenizer=str(tmp_path / "tok.json"),
                                                                             val_fraction=0.1), progress=False)
    cfg = replace(model_preset("llama-tiny"), n_layers=1, vocab_size=32, seq_len=16)
    weights = {n: p.detach().clone() for n, p in build_model(cfg).named_parameters()}
    ckpt_io.save(str(tmp_path / "job"), ckpt_io.Checkpoint(step=1, model=weights, optimizer={}, fingerprint={}))
    done = export_job(str(tmp_path / "job" / "step-00000001"), to_plain(cfg), {"dataset": str(tmp_path / "ds")},
                      str(tmp_path / "out"))
    assert (done["tokenizer"]["bos_token_id"], done["tokenizer"]["eos_token_id"]) == (27, 28)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (27, 28, 28)
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out")).bos_token == "<|begin_of_text|>"
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text())["bos_token_id"] == 27


def test_a_factory_model_exports_its_weights_under_its_own_names_with_what_rebuilds_it(tmp_path, monkeypatch):
    from safetensors.torch import load_file
    from test_model_sources import write_user_models

    write_user_models(tmp_path / "site")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    from meridian.workers.contracts.model_config import ModelConfig

    cfg = ModelConfig(family="factory", factory="mymodels.tiny:build", factory_args='{"d":32}', block="Block",
                      n_layers=2, d_model=32, n_heads=1, seq_len=32, vocab_size=256, param_count=1)
    model = build_model(cfg)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    ckpt_io.save(str(tmp_path / "job"), ckpt_io.Checkpoint(step=1, model=weights, optimizer={}, fingerprint={}))
    done = export_job(str(tmp_path / "job" / "step-00000001"), to_plain(cfg), {"source": "builtin:python-reference"},
                      str(tmp_path / "out"))
    assert done["weights"] == ["model.safetensors"] and not (tmp_path / "out" / "config.json").exists()
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(saved) == set(weights) and all(torch.equal(saved[n], weights[n]) for n in weights)
    described = json.loads((tmp_path / "out" / "meridian_model.json").read_text())
    assert described["model"]["factory"] == "mymodels.tiny:build" and described["weights"] == ["model.safetensors"]



@pytest.mark.parametrize("max_shard_bytes", [2**40, 4096], ids=["one-file", "sharded"])
def test_exported_weight_files_are_as_readable_as_the_umask_allows(tmp_path, max_shard_bytes):
    import os

    from meridian.workers.model.weights import save_sharded

    tensors = {f"w{i}": torch.ones(1024) for i in range(3)}
    old = os.umask(0o022)
    try:
        names = save_sharded(tensors, tmp_path, max_shard_bytes=max_shard_bytes)
    finally:
        os.umask(old)
    assert [n for n in names if n.endswith(".safetensors")]
    for name in names:
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o644, name
