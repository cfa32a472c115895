"""Where a job's model comes from, through the REST API (a real store and supervisor, a fake cluster): a Hugging
Face config.json alone, a checkpoint, or your own module from a factory the operator allowed. A factory outside
what was allowed is refused naming what is, and nothing of it is ever imported; Hugging Face and factory models
are refused tensor/pipeline parallelism at submit, saying why."""

from __future__ import annotations

import json
import os
import sys

import pytest
from fakes import FakeService
from fastapi.testclient import TestClient

from meridian.api.app import create_app
from meridian.service.core import ServiceConfig
from meridian.service.data_access import DataAccess
from meridian.service.model_access import ModelAccess

TINY_LM = '''
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(self.norm1(x)).split(d, dim=2))
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab, d, layers, heads, seq_len):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq_len, d)
        self.layers = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm, self.out = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.emb(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.layers:
            x = block(x)
        return self.out(self.norm(x))


def build(vocab=256, d=32, layers=2, heads=4, seq_len=32):
    return TinyLM(vocab, d, layers, heads, seq_len)


def broken(**kwargs):
    raise RuntimeError("the factory could not find its weights")


def not_a_module():
    return 42
'''


def write_user_models(root) -> None:
    """A package ``mymodels`` (a tiny transformer and two broken factories), a module ``evilmod`` that leaves a
    mark when imported, and an installed distribution declaring entry point ``tiny-lm`` in ``meridian.models``."""
    (root / "mymodels").mkdir(parents=True)
    (root / "mymodels" / "__init__.py").write_text("")
    (root / "mymodels" / "tiny.py").write_text(TINY_LM)
    (root / "mymodelsevil.py").write_text(f"open({str(root / 'imported-mymodelsevil')!r}, 'w').close()\n"
                                          "def build(**kw):\n    raise SystemExit\n")
    (root / "evilmod.py").write_text(f"open({str(root / 'imported-evilmod')!r}, 'w').close()\n")
    dist = root / "user_models-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: user-models\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[meridian.models]\ntiny-lm = mymodels.tiny:build\n")


@pytest.fixture
def user_models(tmp_path, monkeypatch):
    root = tmp_path / "site"
    write_user_models(root)
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return root


@pytest.fixture
def api(store, supervisor, cluster_view, tmp_path, user_models):
    root = tmp_path / "data"
    root.mkdir()
    supervisor.data_access = DataAccess.for_roots([str(root)])
    fake = FakeService(store, supervisor, cluster_view)
    fake.config = ServiceConfig(data_dir=str(tmp_path), model_modules=("mymodels",))
    with TestClient(create_app(fake.config, service=fake), base_url="http://127.0.0.1") as c:
        c.root, c.store = root, store
        yield c


TRAINING = {"steps": 2, "global_batch": 2, "micro_batch": 1}


def _post(api, model: dict, **extra):
    return api.post("/v1/jobs", json={"name": "m", "model": model, "training": TRAINING, **extra})


def test_an_allowed_factory_and_an_entry_point_build_the_module_admission_describes(api):
    import torch

    sys.modules.pop("mymodels.tiny", None)
    r = _post(api, {"factory": "mymodels.tiny:build", "args": {"d": 32, "layers": 3}, "seq_len": 32})
    assert r.status_code == 201, r.text
    model = api.store.get_job(r.json()["id"]).request.model
    from mymodels.tiny import build

    expected = sum(p.numel() for p in build(d=32, layers=3).parameters())
    assert (model.family.value, model.factory, model.block, model.n_layers) == ("factory", "mymodels.tiny:build",
                                                                                 "Block", 3)
    assert model.param_count == expected and model.num_params == expected
    assert (model.d_model, model.vocab_size, model.seq_len) == (32, 256, 32)
    assert json.loads(model.factory_args) == {"d": 32, "layers": 3}
    # What the workers build from that config: the same module, as a CausalLM.
    from meridian.workers.model.build import build_model

    torch.manual_seed(0)
    lm = build_model(model)
    assert len(lm.transformer_blocks()) == 3 and sum(p.numel() for p in lm.parameters()) == expected
    assert lm(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long)).shape == (2,)

    by_entry_point = _post(api, {"factory": "tiny-lm", "seq_len": 32})
    assert by_entry_point.status_code == 201, by_entry_point.text
    assert api.store.get_job(by_entry_point.json()["id"]).request.model.factory == "mymodels.tiny:build"


def test_a_factory_outside_the_allowed_list_is_refused_listing_it_and_never_imported(api, user_models):
    for name in ("evilmod:build", "mymodelsevil:build", "os:system", "mymodels", "mymodels.tiny:build;x",
                 "../mymodels.tiny:build", "tiny-lm:build"):
        r = _post(api, {"factory": name, "seq_len": 32})
        assert r.status_code == 422, (name, r.text)
        detail = r.json()["detail"]
        assert f"model.factory {name!r} is not allowed on this service" in detail, detail
        assert "entry points of the meridian.models group (tiny-lm)" in detail
        assert "module:function under mymodels" in detail
    assert not (user_models / "imported-evilmod").exists() and not (user_models / "imported-mymodelsevil").exists()
    assert "evilmod" not in sys.modules and "mymodelsevil" not in sys.modules


def test_a_factory_that_fails_or_returns_no_module_is_a_422_with_its_reason(api):
    cases = {"mymodels.tiny:broken": "RuntimeError: the factory could not find its weights",
             "mymodels.tiny:not_a_module": "it returned a int, not an nn.Module",
             "mymodels.tiny:nope": "AttributeError"}
    for name, words in cases.items():
        r = _post(api, {"factory": name, "seq_len": 32})
        assert r.status_code == 422 and words in r.json()["detail"], (name, r.text)
    wrong_block = _post(api, {"factory": "tiny-lm", "block": "Layer", "seq_len": 32})
    assert wrong_block.status_code == 422 and "no nn.ModuleList of blocks of class Layer" in wrong_block.json()["detail"]
    wrong_vocab = _post(api, {"factory": "tiny-lm", "seq_len": 32, "vocab_size": 512})
    assert wrong_vocab.status_code == 422 and "embedding has 256 rows" in wrong_vocab.json()["detail"]
    for model, words in (({"factory": "tiny-lm"}, "model.factory needs model.seq_len"),
                         ({"factory": "tiny-lm", "seq_len": 32, "args": {"not a name": 1}}, "keyword argument names"),
                         ({"factory": "tiny-lm", "seq_len": 32, "d_model": 64}, "not model.d_model"),
                         ({"preset": "nano", "args": {"d": 1}}, "apply to model.factory only")):
        r = _post(api, model)
        assert r.status_code == 422 and words in r.json()["detail"], (model, r.text)


def test_the_model_access_list_is_decided_on_names_alone():
    access = ModelAccess(("org.models",))
    assert access.resolve("org.models.llm:build") == "org.models.llm:build"
    assert access.resolve("org.models:make.lm") == "org.models:make.lm"
    for name in ("org.modelsx:build", "org:build", "org.models", "org.models.llm:", ":build"):
        with pytest.raises(Exception, match="is not allowed on this service"):
            access.resolve(name)
    with pytest.raises(ValueError, match="--model-module 'org/models' is not a module name"):
        ModelAccess(("org/models",))


def _hf_dir(root, name="qwen", weights=False):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if weights:
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(root / name))
    else:
        config.save_pretrained(str(root / name))
    return root / name


def test_a_config_json_alone_is_admitted_under_the_data_roots_with_tensor_but_no_pipeline_parallelism(api, tmp_path):
    directory = _hf_dir(api.root)
    r = _post(api, {"config": str(directory), "seq_len": 32})
    assert r.status_code == 201, r.text
    r0_id = r.json()["id"]
    model = api.store.get_job(r0_id).request.model
    assert model.family.value == "hf" and model.init_from == "" and json.loads(model.hf_config)["model_type"] == "qwen2"
    assert api.store.get_job(r.json()["id"]).request.parallelism.tp == 1  # 'auto' is 1 for an hf model
    outside = _hf_dir(tmp_path, "outside")
    refused = _post(api, {"config": str(outside)})
    assert refused.status_code == 422 and "is not a directory under this service's data roots" in refused.json()["detail"]
    r = _post(api, {"config": str(directory), "seq_len": 32}, parallelism={"pp": 2})
    detail = r.json()["detail"]
    assert r.status_code == 422 and detail.startswith("parallelism.pp=2: pipeline stages cut Meridian's builtin"), detail
    # tensor parallelism follows transformers' plan for the family, where tp divides what the plan splits
    from meridian.workers.contracts.config import ParallelConfig

    model = api.store.get_job(r0_id).request.model
    ParallelConfig(tp=2).check_model(model)
    with pytest.raises(ValueError, match=r"parallelism.tp=3 must divide its 4 attention heads"):
        ParallelConfig(tp=3).check_model(model)
    with pytest.raises(ValueError, match="parallelism.sequence_parallel: a Hugging Face model"):
        ParallelConfig(tp=2, sequence_parallel=True).check_model(model)
    plan = api.post("/v1/plans", json={"name": "m", "model": {"config": str(directory), "seq_len": 32},
                                       "training": TRAINING})
    assert plan.status_code == 200 and plan.json()["parallelism"]["tp"] == 1, plan.text
    factory_tp = _post(api, {"factory": "tiny-lm", "seq_len": 32}, parallelism={"tp": 2})
    assert factory_tp.status_code == 422 and "a factory's module is split only by the plan" in factory_tp.json()["detail"]
    for model, words in (({"config": str(directory), "init_from": str(directory)}, "exclude each other"),
                         ({"config": str(directory), "family": "llama"}, "model.family is 'llama'"),
                         ({"config": str(directory), "n_layers": 3}, "only model.seq_len may be given")):
        r = _post(api, model)
        assert r.status_code == 422 and words in r.json()["detail"], (model, r.text)


def test_a_checkpoint_is_an_hf_model_by_default_and_meridian_s_llama_on_request(api):
    transformers = pytest.importorskip("transformers")
    llama = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(llama).save_pretrained(str(api.root / "llama"))
    data = _dataset(api.root)
    hf = _post(api, {"init_from": str(api.root / "llama"), "seq_len": 32}, data={"dataset": data})
    builtin = _post(api, {"init_from": str(api.root / "llama"), "family": "llama", "seq_len": 32},
                    data={"dataset": data})
    assert hf.status_code == 201 and builtin.status_code == 201, (hf.text, builtin.text)
    assert api.store.get_job(hf.json()["id"]).request.model.family.value == "hf"
    assert api.store.get_job(builtin.json()["id"]).request.model.family.value == "llama"  # pipeline stages too


def _dataset(root) -> str:
    from meridian.workers.data.hf_tokenizer import byte_tokenizer
    from meridian.workers.data.prepare import PrepareOptions, prepare

    byte_tokenizer().save(str(root.parent / "bytes.json"))
    (root.parent / "text.txt").write_text("some text to train on.\n\n" * 400)
    prepare([str(root.parent / "text.txt")], str(root / "ds"),
            PrepareOptions(tokenizer=str(root.parent / "bytes.json"), val_fraction=0.1), progress=False)
    return str(root / "ds")



def test_admitting_a_model_loads_neither_torch_nor_transformers_in_the_service():
    import subprocess

    code = ("import sys; import meridian.api.schemas, meridian.service.model_access, meridian.service.core; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_tutorial_s_factory_is_one_the_service_admits(tmp_path, monkeypatch):
    """docs/tutorials/your-model.md's module, as written there, is described and admitted."""
    from pathlib import Path

    page = (Path(__file__).parents[1] / "docs" / "tutorials" / "your-model.md").read_text()
    code = page.split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "mymodels").mkdir()
    (tmp_path / "mymodels" / "__init__.py").write_text("")
    (tmp_path / "mymodels" / "tiny.py").write_text(code)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    model = ModelAccess(("mymodels",)).admit_factory(factory="mymodels.tiny:build", args={"vocab": 512, "d": 64,
                                                                                         "layers": 4},
                                                    block="", seq_len=256, vocab_size=None)
    assert (model.block, model.n_layers, model.vocab_size, model.d_model) == ("Block", 4, 512, 64)
