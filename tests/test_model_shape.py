"""ModelShape: the planner's view of a model, from Meridian's presets and from Hugging Face config.json objects,
checked against the parameters the real model holds."""

from __future__ import annotations

import pytest

from meridian.workers.contracts.model_config import MODEL_PRESETS
from meridian.workers.contracts.model_shape import MlpKind, ModelShape

TINY = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, vocab_size=300,
            max_position_embeddings=128)
HF_TINY = {
    "llama": dict(TINY, num_key_value_heads=2, attention_bias=True, mlp_bias=True),
    "qwen2": dict(TINY, num_key_value_heads=2),
    "mistral": dict(TINY, num_key_value_heads=1, head_dim=32),
    "gpt_neox": dict(TINY),
    "nemotron": dict(TINY, num_key_value_heads=2, hidden_act="relu2", head_dim=8),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_inner=96, vocab_size=300, n_positions=128),
}


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_a_preset_s_shape_counts_what_its_config_counts(name):
    cfg = MODEL_PRESETS[name]
    shape = ModelShape.of(cfg)
    assert (shape.num_params, shape.flops_per_token) == (cfg.num_params, cfg.flops_per_token)
    assert (shape.n_layers, shape.hidden, shape.kv_heads, shape.ffn_hidden) == (cfg.n_layers, cfg.d_model, cfg.kv_heads,
                                                                               cfg.mlp_width)


@pytest.mark.parametrize("model_type", sorted(HF_TINY))
def test_a_hugging_face_config_s_shape_counts_the_parameters_transformers_builds(model_type):
    # transformers builds the random model from the same dict (nothing downloaded): the parameter count of the
    # real module is the check, biases, tied heads and learned positions included.
    import torch
    import transformers

    hf = {"model_type": model_type, **HF_TINY[model_type]}
    config = transformers.AutoConfig.for_model(**hf)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    counted = sum(p.numel() for p in model.parameters())  # a tied head is one parameter, counted once
    shape = ModelShape.from_hf_config(hf)
    assert shape.num_params == counted, (shape, counted)
    assert shape.name == model_type and shape.seq_len == 128
    assert ModelShape.from_hf_config(hf, seq_len=64).seq_len == 64


def test_published_sizes_of_real_checkpoints():
    # Parameter counts from the models' cards / papers: Llama-3-8B 8,030,261,248; Mistral-7B-v0.1 7,241,732,096;
    # Qwen2-7B 7,615,616,512; Pythia-160M (GPT-NeoX) 162,322,944; GPT-2 124,439,808; Nemotron-4 340B "340B".
    llama3 = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=128256)
    assert ModelShape.from_hf_config({"model_type": "llama", **llama3}).num_params == 8_030_261_248
    mistral = dict(llama3, vocab_size=32000)
    assert ModelShape.from_hf_config({"model_type": "mistral", **mistral}).num_params == 7_241_732_096
    qwen2 = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=152064)
    assert ModelShape.from_hf_config({"model_type": "qwen2", **qwen2}).num_params == 7_615_616_512
    pythia = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, vocab_size=50304)
    assert ModelShape.from_hf_config({"model_type": "gpt_neox", **pythia}).num_params == 162_322_944
    gpt2 = dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024)
    assert ModelShape.from_hf_config({"model_type": "gpt2", **gpt2}).num_params == 124_439_808
    nemotron = ModelShape.from_hf_config({"model_type": "nemotron", "hidden_size": 18432, "intermediate_size": 73728,
                                          "num_hidden_layers": 96, "num_attention_heads": 96, "num_key_value_heads": 8,
                                          "vocab_size": 256000, "max_position_embeddings": 4096})
    assert nemotron.mlp is MlpKind.SQUARED_RELU and not nemotron.mlp.gated and not nemotron.tie_embeddings
    assert 340e9 <= nemotron.num_params <= 342e9 and nemotron.head_dim == 192


@pytest.mark.parametrize("hf, message", [
    ({"model_type": "bert"}, r"model.hf_config.model_type is 'bert'; the planner knows gpt2, gpt_neox, llama"),
    ({"model_type": "llama", **dict(TINY, num_attention_heads=0)}, r"model.hf_config.num_attention_heads must be a whole"),
    ({"model_type": "llama", **{k: v for k, v in TINY.items() if k != "hidden_size"}}, r"model.hf_config has no hidden_size"),
    ({"model_type": "llama", **dict(TINY, tie_word_embeddings="yes")}, r"model.hf_config.tie_word_embeddings must be true"),
    ({"model_type": "llama", **dict(TINY, num_attention_heads=3)}, r"num_attention_heads \(3\) must divide the hidden"),
    ({"model_type": "llama", **dict(TINY, num_key_value_heads=3)}, r"model.n_heads \(4\) must be a multiple of the key"),
    ({"model_type": "nemotron", **dict(TINY, hidden_act="gelu")}, r"Nemotron's MLP is 'relu2'"),
    ([1, 2], r"must be the JSON object of a config.json"),
])
def test_a_bad_config_names_its_key(hf, message):
    with pytest.raises(ValueError, match=message):
        ModelShape.from_hf_config(hf)
