"""Any Hugging Face causal LM of the families Meridian builds, each a random tiny model transformers builds and
saves here (no hub): its shape read torch-free from config.json, its module built by transformers and filled
shard by shard, its logits transformers' own, nothing dropped or left unset without an error naming it."""

from __future__ import annotations

import json
import weakref

import pytest
import torch
from safetensors.torch import load_file, save_file

from meridian.workers.contracts.hf_config import checkpoint_files, hf_model_config
from meridian.workers.contracts.hf_shape import FAMILIES, shape_of
from meridian.workers.contracts.model_config import ModelFamily
from meridian.workers.model.build import build_model
from meridian.workers.model.causal_lm import chunked_loss, per_sample_loss
from meridian.workers.model.hf_lm import build_hf, load_hf_weights

transformers = pytest.importorskip("transformers")

VOCAB = 320
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=128)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}

FAMILY_CONFIGS = {
    # Llama 3.2's shape: tied embeddings, GQA, RoPE scaling "llama3"
    "llama3": lambda: transformers.LlamaConfig(**SHAPE, num_key_value_heads=2, tie_word_embeddings=True,
                                               rope_scaling=LLAMA3_ROPE, rope_theta=500000.0),
    "qwen2": lambda: transformers.Qwen2Config(**SHAPE, num_key_value_heads=2),  # q/k/v biases
    "mistral": lambda: transformers.MistralConfig(**SHAPE, num_key_value_heads=1, head_dim=16),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(**SHAPE, rotary_pct=0.25),  # Pythia: fused qkv, LayerNorm
    "qwen3": lambda: transformers.Qwen3Config(**SHAPE, num_key_value_heads=2),  # q/k norms, head_dim 128
}


def save_random(directory, family: str, *, seed: int = 0, shard: str | None = "60KB"):
    """A random model of ``family`` saved by transformers into ``directory`` (sharded with an index when
    ``shard``), its norms randomised so a swapped or unloaded norm would show."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(FAMILY_CONFIGS[family]()).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(str(directory), **kwargs)
    return model


def _tokens(t: int = 24) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, t), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_each_family_loads_shard_by_shard_with_transformers_logits_and_its_exact_shape(tmp_path, family):
    ref = save_random(tmp_path, family)
    assert len(checkpoint_files(str(tmp_path))) > 1  # sharded, with an index
    cfg = hf_model_config(str(tmp_path), weights=True, seq_len=32)
    assert cfg.family is ModelFamily.HF and cfg.seq_len == 32 and cfg.vocab_size == VOCAB
    # The torch-free count is the module's own (a tied head once), for the planner.
    assert cfg.num_params == sum(p.numel() for p in ref.parameters()), family
    assert cfg.n_layers == 2 and cfg.d_model == 64
    assert cfg.kv_heads == getattr(ref.config, "num_key_value_heads", None) or ref.config.num_attention_heads
    ours = build_model(cfg).eval()
    assert type(ours).__name__ == "HFCausalLM" and ours.architecture == type(ref).__name__
    assert len(ours.transformer_blocks()) == 2
    assert type(ours.transformer_blocks()[0]).__name__ in ref._no_split_modules
    x = _tokens()
    with torch.no_grad():
        expected = ref(input_ids=x).logits
        got = ours(x)
        assert (got - expected).abs().max().item() < 1e-5
        assert torch.allclose(ours(x, x), per_sample_loss(expected, x), atol=1e-6)  # the loss the loop asks for
        assert ours(x, hidden=True).shape == (2, 24, 64)
    # Parameter names are transformers' own (checkpoints and the tensor-parallel plan use them).
    assert set(ours.state_dict()) == set(ref.state_dict())


def test_config_json_alone_is_transformers_random_init_from_the_job_s_seed(tmp_path):
    FAMILY_CONFIGS["qwen2"]().save_pretrained(str(tmp_path))
    assert not list(tmp_path.glob("*.safetensors"))
    cfg = hf_model_config(str(tmp_path), weights=False, seq_len=32)
    assert cfg.init_from == "" and cfg.family is ModelFamily.HF

    def params(seed):
        torch.manual_seed(seed)
        return {n: p.detach().clone() for n, p in build_model(cfg).named_parameters()}

    torch.manual_seed(3)
    theirs = transformers.AutoModelForCausalLM.from_config(FAMILY_CONFIGS["qwen2"]())
    a, b, other = params(3), params(3), params(4)
    assert all(torch.equal(a[n], b[n]) for n in a)  # every rank builds the same weights from the seed
    assert all(torch.equal(a[n], p) for n, p in theirs.named_parameters())  # transformers' own initialisation
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"], other["model.layers.0.self_attn.q_proj.weight"])
    with pytest.raises(ValueError, match="has no \\*.safetensors file .*model.config"):
        hf_model_config(str(tmp_path), weights=True)


def test_a_qwen2_config_renamed_to_llama_is_refused_naming_the_biases_not_loaded_without_them(tmp_path):
    save_random(tmp_path / "qwen2", "qwen2", shard=None)
    config = json.loads((tmp_path / "qwen2" / "config.json").read_text())
    config.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (tmp_path / "qwen2" / "config.json").write_text(json.dumps(config))
    # At admission, torch-free: the tensors do not add up to the model the config describes.
    with pytest.raises(ValueError, match="holds 102,976 weights .* describes a LlamaForCausalLM of 102,720 "
                                         "parameters: these are not that model's weights"):  # 256 biases apart
        hf_model_config(str(tmp_path / "qwen2"), weights=True)
    from meridian.workers.contracts.hf_config import model_config_from_hf

    with pytest.raises(ValueError, match="not that model's weights"):  # nor as Meridian's own llama
        model_config_from_hf(str(tmp_path / "qwen2"))
    # And the worker's loader, handed them anyway, names every tensor the model would not consume.
    llama = build_hf(hf_model_config(str(tmp_path / "qwen2"), weights=False), meta=True)
    with pytest.raises(ValueError) as e:
        load_hf_weights(llama, str(tmp_path / "qwen2"))
    assert "'model.layers.0.self_attn.q_proj.bias'" in str(e.value) and "has no parameter for" in str(e.value)


def test_a_missing_tensor_a_stray_tensor_and_a_wrong_shape_are_each_named(tmp_path):
    save_random(tmp_path, "mistral", shard=None)
    cfg = hf_model_config(str(tmp_path), weights=False)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    cases = {
        "missing": ({k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"},
                    "no tensor for parameter(s) 'model.layers.1.mlp.up_proj.weight'"),
        "stray": ({**tensors, "model.layers.0.extra.weight": torch.zeros(3)},
                  "has no parameter for: 'model.layers.0.extra.weight'"),
        "shape": ({**tensors, "model.norm.weight": torch.zeros(65)},
                  "model.norm.weight (65,) (the model's model.norm.weight: (64,))"),
    }
    for name, (body, words) in cases.items():
        save_file(body, str(tmp_path / "model.safetensors"))
        with pytest.raises(ValueError) as e:
            load_hf_weights(build_hf(cfg, meta=True), str(tmp_path))
        assert words in str(e.value), (name, str(e.value))


def test_tied_weights_load_once_and_a_stored_copy_must_agree(tmp_path):
    ref = save_random(tmp_path, "llama3", shard=None)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert "lm_head.weight" not in tensors  # transformers stores a tied head once
    cfg = hf_model_config(str(tmp_path), weights=True)
    ours = build_model(cfg)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight  # still tied after loading
    assert torch.equal(ours.lm_head.weight, ref.lm_head.weight)
    save_file({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"].clone()},
              str(tmp_path / "model.safetensors"))
    build_model(cfg)  # both names stored, equal: fine
    save_file({**tensors, "lm_head.weight": torch.zeros_like(tensors["model.embed_tokens.weight"])},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="stores the tied weights 'lm_head.weight' and 'model.embed_tokens.weight' "
                                         "with different values"):
        build_model(cfg)


def test_no_rank_holds_the_whole_checkpoint_one_tensor_at_a_time(tmp_path):
    save_random(tmp_path, "qwen2", shard="40KB")
    files = checkpoint_files(str(tmp_path))
    cfg = hf_model_config(str(tmp_path), weights=True)
    lm = build_hf(cfg, meta=True)
    assert all(p.is_meta for p in lm.parameters())  # built on the meta device
    live, most, opened = set(), [0], []

    class Counting:
        def __init__(self, path):
            from safetensors import safe_open

            opened.append(path)
            self.f = safe_open(path, framework="pt")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def get_tensor(self, key):
            t = self.f.get_tensor(key)
            live.add(key)
            most[0] = max(most[0], len(live))
            weakref.finalize(t, live.discard, key)
            return t

    report = load_hf_weights(lm, str(tmp_path), open_file=Counting)
    assert most[0] == 1  # never two checkpoint tensors alive at once
    assert opened == files and report.files == len(files) > 2  # each shard opened once, in order
    assert report.tensors == len(list(lm.parameters()))
    assert not any(p.is_meta for p in lm.parameters())


def test_gpt_neox_s_renamed_head_loads_and_exports_under_its_checkpoint_name(tmp_path):
    save_random(tmp_path, "gpt_neox", shard=None)
    assert "embed_out.weight" in load_file(str(tmp_path / "model.safetensors"))  # transformers' stored name
    lm = build_model(hf_model_config(str(tmp_path), weights=True))
    assert "lm_head.weight" in dict(lm.named_parameters())
    assert lm.export_name("lm_head.weight") == "embed_out.weight"
    assert lm.export_name("gpt_neox.layers.0.attention.dense.weight") == "gpt_neox.layers.0.attention.dense.weight"


def test_the_loss_in_chunks_equals_the_whole_micro_batch_s_values_and_gradients():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    h = torch.randn(3, 20, 16, requires_grad=True)
    y = torch.randint(0, 50, (3, 20))
    whole = per_sample_loss(head(h), y)
    whole.sum().backward()
    g_h, g_w = h.grad.clone(), head.weight.grad.clone()
    h.grad = None
    head.weight.grad = None
    parts = chunked_loss(h, head, y, 50, chunk_bytes=3 * 50 * 4 * 6)  # 6 positions per chunk: 4 chunks
    parts.sum().backward()
    assert torch.allclose(parts, whole, atol=1e-6)
    assert torch.allclose(h.grad, g_h, atol=1e-6) and torch.allclose(head.weight.grad, g_w, atol=1e-6)
    assert torch.equal(chunked_loss(h, head, y, 50), per_sample_loss(head(h), y))  # fits: the same ops exactly


def test_the_family_table_agrees_with_transformers():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from meridian.workers.contracts.hf_config import ROPE_TYPES

    for model_type, fam in FAMILIES.items():
        assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type] == fam.architecture
        assert bool(getattr(CONFIG_MAPPING[model_type], "base_model_tp_plan", None)) == fam.declares_tp_plan
        assert CONFIG_MAPPING[model_type]().tie_word_embeddings is False  # the default hf_model_config assumes
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    assert set(ROPE_TYPES) == {"default", *ROPE_INIT_FUNCTIONS}
    # The count is exact for the flags each family reads (biases on and off, tied or not).
    for family, extra in (("llama3", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": False}),
                          ("gpt_neox", {"attention_bias": False, "tie_word_embeddings": True}),
                          ("qwen3", {"attention_bias": True, "head_dim": 8})):
        config = FAMILY_CONFIGS[family]()
        for k, v in extra.items():
            setattr(config, k, v)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        assert shape_of(config.to_dict()).num_params == sum(p.numel() for p in model.parameters()), family


# -- the tensor-parallel plan ------------------------------------------------------------------------------
def _tp_logits(rank, world, directory, builtin, x):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from meridian.workers.parallel.tp_plan import tp_styles

    cfg = _tp_config(directory, builtin)
    model = build_model(cfg).eval()
    styles = tp_styles(model, cfg.family, world)
    parallelize_module(model, init_device_mesh("cpu", (world,)), styles)
    with torch.no_grad():
        return model(x)


def _tp_config(directory, builtin):
    from meridian.workers.contracts.hf_config import model_config_from_hf

    return model_config_from_hf(directory) if builtin else hf_model_config(directory, weights=True)


@pytest.mark.parametrize("builtin", [False, True], ids=["transformers-llama", "meridian-llama"])
def test_the_tp_plan_splits_the_model_over_two_gloo_ranks_with_the_same_logits(tmp_path, builtin):
    from meridian.workers.distributed.multiproc import run_processes

    if builtin:  # Meridian's llama reads a Llama checkpoint with the default RoPE
        torch.manual_seed(0)
        ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, num_key_value_heads=2)).eval()
        ref.save_pretrained(str(tmp_path))
    else:
        ref = save_random(tmp_path, "llama3", shard=None)
    x = _tokens()
    with torch.no_grad():
        expected = ref(input_ids=x).logits
    for logits in run_processes(_tp_logits, 2, str(tmp_path), builtin, x, timeout_s=180):
        assert (logits - expected).abs().max().item() < 1e-5


def test_a_tp_plan_is_checked_against_the_module_and_a_model_without_one_is_refused(tmp_path):
    from meridian.workers.contracts.model_config import model_preset
    from meridian.workers.parallel.tp_plan import check_tp_plan

    save_random(tmp_path, "qwen2", shard=None)
    lm = build_hf(hf_model_config(str(tmp_path), weights=False), meta=True)
    assert lm.tp_plan == transformers.AutoModelForCausalLM.from_config(FAMILY_CONFIGS["qwen2"]())._tp_plan
    assert check_tp_plan(lm, 2)["model.layers.*.self_attn.q_proj"] == "colwise"
    with pytest.raises(ValueError, match="tp=4 does not divide its 4 attention heads and 2 key/value heads"):
        check_tp_plan(lm, 4)
    lm._tp_plan = {**lm._tp_plan, "model.layers.*.self_attn.qkv": "colwise", "lm_head": "diagonal"}
    with pytest.raises(ValueError) as e:
        check_tp_plan(lm, 2)
    assert "'model.layers.*.self_attn.qkv' matches no module" in str(e.value)
    assert "'lm_head': style 'diagonal' is none of" in str(e.value)
    with pytest.raises(ValueError, match="parallelism.tp=2: GPT declares no tensor-parallel plan"):
        check_tp_plan(build_model(model_preset("nano")), 2)


def test_the_blocks_stay_the_blocks_once_wrapped_and_are_not_registered_twice(tmp_path):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from meridian.workers.model.causal_lm import alias_groups

    save_random(tmp_path, "llama3", shard=None)
    lm = build_model(hf_model_config(str(tmp_path), weights=True))
    blocks = lm.transformer_blocks()
    assert all(not n.startswith("_blocks") for n, _ in lm.named_modules())
    assert alias_groups(lm) == [["model.embed_tokens.weight", "lm_head.weight"]]  # the tied head only
    x = _tokens()
    with torch.no_grad():
        before = lm(x)
    for i, block in enumerate(blocks):  # what activation checkpointing per block does
        blocks[i] = checkpoint_wrapper(block)
    assert lm.transformer_blocks() is blocks and type(blocks[0]).__name__ == "CheckpointWrapper"
    with torch.no_grad():
        assert torch.equal(lm(x), before)
