"""A fine-tuning checkpoint's ``config.json`` and a data blend as a careless or hostile user gives them.

Before: a ``config.json`` with a key missing, a list for an object or a string for a size made ``POST /v1/jobs`` a
500 (KeyError, AttributeError, TypeError); junk was a 422 that named neither the file nor what to do; a pipe, a
device or a directory in its place was "has no config.json"; a bool, a float or a zero for a size was admitted
(or a ZeroDivisionError). ``data.blend: []`` trained on the built-in corpus without a word, and a blend naming one
dataset twice was admitted."""

from __future__ import annotations

import json
import os

import pytest
from fakes import FakeService, spec
from fastapi.testclient import TestClient

from meridian.api.app import create_app
from meridian.service.data_access import DataAccess

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
         "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
         "hidden_act": "silu"}  # fmt: skip


def _without(key: str) -> dict:
    return {k: v for k, v in LLAMA.items() if k != key}


# name → what config.json holds (a dict/list is written as JSON, a str as is, a callable makes the path itself),
# and a word the 422 must name (the key, or what the file is).
HOSTILE = {
    "missing-key": (_without("hidden_size"), "has no hidden_size"),
    "a-list": ([1, 2], "holds a JSON list"),
    "string-vocab": ({**LLAMA, "vocab_size": "256"}, "vocab_size='256': it must be a whole number"),
    "junk": ("not json at all", "is not valid JSON (Expecting value"),
    "not-utf8": (b"\xff\xfe{}", "is not valid JSON"),
    "nested-too-deep": ("[" * 200_000 + "]" * 200_000, "is not valid JSON"),
    "too-big": (json.dumps(LLAMA) + " " * (2 << 20), "too big for a Hugging Face config.json"),
    "a-fifo": (os.mkfifo, "is not a regular file"),
    "a-directory": (os.mkdir, "is not a regular file"),
    "symlink-to-dev-zero": (lambda p: os.symlink("/dev/zero", p), "not a symlink"),
    "negative-layers": ({**LLAMA, "num_hidden_layers": -1}, "num_hidden_layers=-1"),
    "zero-heads": ({**LLAMA, "num_attention_heads": 0}, "num_attention_heads=0"),
    "zero-kv-heads": ({**LLAMA, "num_key_value_heads": 0}, "num_key_value_heads=0"),
    "bool-layers": ({**LLAMA, "num_hidden_layers": True}, "num_hidden_layers=True: it must be a whole number"),
    "float-hidden": ({**LLAMA, "hidden_size": 64.0}, "hidden_size=64.0: it must be a whole number"),
    "heads-not-dividing": ({**LLAMA, "num_attention_heads": 5}, "hidden_size=64: it must be a multiple of "
                                                                "num_attention_heads (5)"),
    "kv-not-dividing": ({**LLAMA, "num_key_value_heads": 3}, "num_attention_heads=4: it must be a multiple of "
                                                             "num_key_value_heads (3)"),
    "unknown-model-type": ({**LLAMA, "architectures": ["MambaForCausalLM"], "model_type": "mamba"},
                           "names architecture 'MambaForCausalLM', 'mamba'; Meridian builds these Hugging Face "
                           "families: LlamaForCausalLM (llama)"),
    "two-families": ({**LLAMA, "architectures": ["Qwen2ForCausalLM"]},
                     "names architecture 'Qwen2ForCausalLM', 'llama'; Meridian builds"),
    "no-architecture": (_without("architectures") | {"model_type": None}, "names architecture (none"),
    "architectures-a-string": ({**LLAMA, "architectures": "LlamaForCausalLM"}, "it must be a list of class names"),
    "rope-scaling-a-string": ({**LLAMA, "rope_scaling": "linear"}, "rope_scaling='linear': it must be an object"),
    "eps-a-list": ({**LLAMA, "rms_norm_eps": [1]}, "rms_norm_eps=[1]: it must be a finite number"),
    "tie-a-string": ({**LLAMA, "tie_word_embeddings": "no"}, "tie_word_embeddings='no': it must be true or false"),
    "too-many-layers": ({**LLAMA, "num_hidden_layers": 1000}, "Meridian's model.n_layers must be <= 128"),
}


def llama_weights(path, config: dict) -> None:
    """The safetensors file of a random Llama of ``config`` (transformers builds it)."""
    import transformers
    from safetensors.torch import save_file

    body = {k: v for k, v in config.items() if k != "architectures"}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**body))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))


def _fine_tune(init_from) -> dict:
    return {**spec(), "model": {"init_from": str(init_from)}}


def _checkpoint(directory, content) -> None:
    directory.mkdir(parents=True)
    # Admission reads a config before the weights' headers; only the sound config needs weights of its model.
    if content is LLAMA:
        llama_weights(directory / "model.safetensors", LLAMA)
    else:
        (directory / "model.safetensors").write_bytes(b"")
    config = directory / "config.json"
    if callable(content):
        content(str(config))
    elif isinstance(content, bytes):
        config.write_bytes(content)
    else:
        config.write_text(content if isinstance(content, str) else json.dumps(content))


@pytest.fixture
def client(store, supervisor, cluster_view, tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    supervisor.data_access = DataAccess.for_roots([str(root)])
    fake = FakeService(store, supervisor, cluster_view)
    with TestClient(create_app(fake.config, service=fake), base_url="http://127.0.0.1") as c:
        c.root = root
        yield c


@pytest.mark.timeout(120)  # a pipe or /dev/zero read as the config must not hang the request
def test_a_hostile_checkpoint_config_is_a_422_naming_the_file_and_the_key(client):
    for name, (content, _) in HOSTILE.items():
        _checkpoint(client.root / name, content)
    _checkpoint(client.root / "good", LLAMA)
    answers = {name: client.post("/v1/jobs", json=_fine_tune(client.root / name))
               for name in HOSTILE}
    assert {n: r.status_code for n, r in answers.items()} == dict.fromkeys(HOSTILE, 422)
    for name, (_, words) in HOSTILE.items():
        detail = answers[name].json()["detail"]
        assert detail.startswith(f"model.init_from: {client.root / name / 'config.json'} "), (name, detail)
        assert words in detail, (name, detail)
        assert "; " in detail and len(detail) < 1000, (name, detail)  # says what to do, echoes no megabytes
    # The dry-run plan reads the checkpoint the same way, and a sound one is still admitted.
    assert client.post("/v1/plans", json=_fine_tune(client.root / "a-list")).status_code == 422
    plan = client.post("/v1/plans", json=_fine_tune(client.root / "good"))
    assert plan.status_code == 200, plan.text


@pytest.fixture
def datasets(client):
    """Two prepared datasets (the byte tokenizer: 256 ids, as the nano model has) under the data roots."""
    from meridian.workers.data.hf_tokenizer import byte_tokenizer
    from meridian.workers.data.prepare import PrepareOptions, prepare

    root = client.root
    byte_tokenizer().save(str(root.parent / "bytes.json"))
    for name in ("a", "b"):
        (root.parent / f"{name}.txt").write_text(f"text {name} to train on, paragraph after paragraph.\n\n" * 300)
        prepare([str(root.parent / f"{name}.txt")], str(root / name),
                PrepareOptions(tokenizer=str(root.parent / "bytes.json"), val_fraction=0.1), progress=False)
    (root / "also-a").symlink_to(root / "a")
    return root


def test_an_empty_blend_is_refused_not_read_as_the_builtin_corpus(client):
    for path in ("/v1/jobs", "/v1/plans"):
        r = client.post(path, json=spec(data={"blend": []}))
        assert r.status_code == 422, (path, r.text)
        assert r.json()["detail"] == ('data.blend: an empty blend names no data: give at least one prepared dataset '
                                      '({"dataset": DIR, "weight": W}), or leave data.blend out to train on '
                                      'data.source')
    assert client.post("/v1/jobs", json=spec(data={})).status_code == 201  # no blend at all: data.source


def test_a_blend_naming_one_dataset_twice_is_refused_naming_it(client, datasets):
    a, b = str(datasets / "a"), str(datasets / "b")
    twice = client.post("/v1/jobs", json=spec(data={"blend": [{"dataset": a, "weight": 2}, {"dataset": b},
                                                              {"dataset": a + "/"}]}))
    assert twice.status_code == 422
    assert twice.json()["detail"] == (f"data.blend: names dataset '{a}/' twice; name each dataset once, with the "
                                      "weight of all the samples it should give")
    # Two names of one directory (a symlink under the roots): only its real path shows it, at admission.
    aliased = client.post("/v1/jobs", json=spec(data={"blend": [{"dataset": a}, {"dataset": b},
                                                                {"dataset": str(datasets / "also-a")}]}))
    assert aliased.status_code == 422
    assert aliased.json()["detail"] == (f"data.blend names dataset '{a}' twice ('{a}' and "
                                        f"'{datasets / 'also-a'}'); name each dataset once, with the weight of all "
                                        "the samples it should give")
    ok = client.post("/v1/jobs", json=spec(data={"blend": [{"dataset": a, "weight": 3}, {"dataset": b}]}))
    assert ok.status_code == 201, ok.text
