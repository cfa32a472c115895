"""The Llama family: shape and counts, Hugging Face weights in (``init_from``) and out (export), and training
through the same loop as GPT, tensor- and pipeline-parallel included, on real gloo process groups."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from meridian.workers.contracts.config import ParallelConfig, SyncConfig, SyncStrategy, TrainConfig
from meridian.workers.contracts.hf_config import model_config_from_hf
from meridian.workers.contracts.model_config import ModelConfig, ModelFamily, model_preset
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.loop.train import ListSink, train
from meridian.workers.model.build import build_model
from meridian.workers.model.export import save_hf
from meridian.workers.parallel.parallelize import present
from meridian.workers.parallel.tp_plan import tp_styles

transformers = pytest.importorskip("transformers")

SMALL = dict(family=ModelFamily.LLAMA, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=96, seq_len=32)


def test_presets_count_their_parameters_exactly():
    for name in ("llama-tiny", "nano"):
        cfg = model_preset(name)
        torch.manual_seed(0)
        assert sum(p.numel() for p in build_model(cfg).parameters()) == cfg.num_params, name
    tied = ModelConfig(**SMALL, tie_embeddings=True)
    assert sum(p.numel() for p in build_model(tied).parameters()) == tied.num_params
    assert 0.9e6 < model_preset("llama-tiny").num_params < 1.2e6
    assert 7.9e9 < model_preset("llama3-8b").num_params < 8.1e9  # Llama-3-8B: 8.03 B
    assert 1.2e9 < model_preset("llama-1b").num_params < 1.3e9  # Llama-3.2-1B: 1.24 B


def test_config_checks_name_the_field():
    with pytest.raises(ValueError, match="model.n_kv_heads"):
        ModelConfig(**{**SMALL, "n_kv_heads": 3})
    with pytest.raises(ValueError, match="family 'llama' only"):
        ModelConfig(n_layers=2, d_model=64, n_heads=4, seq_len=32, n_kv_heads=2)
    with pytest.raises(ValueError, match="n_kv_heads"):
        ParallelConfig(tp=4).check_model(ModelConfig(**SMALL))
    with pytest.raises(ValueError, match="tie_embeddings"):
        ParallelConfig(pp=2).check_model(ModelConfig(**SMALL, tie_embeddings=True))


def _hf_llama(tmp_path, tie: bool = False):
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, rope_theta=500000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # HF initialises norms to 1: randomise them so a swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path)
    return model


def _tokens():
    return torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("tie", [False, True])
def test_init_from_a_transformers_llama_gives_its_logits(tmp_path, tie):
    ref = _hf_llama(tmp_path, tie)
    cfg = model_config_from_hf(str(tmp_path))
    assert cfg.family is ModelFamily.LLAMA and cfg.kv_heads == 2 and cfg.tie_embeddings is tie
    ours = build_model(cfg).eval()
    x = _tokens()
    with torch.no_grad():
        expected = ref(x).logits
        got = ours(x)
    assert (got - expected).abs().max().item() < 1e-4


def _tp_logits(rank, world, cfg, x):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    model = build_model(cfg).eval()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, present(model, tp_styles(model, cfg.family, world, tied_embeddings=cfg.tie_embeddings)))
    with torch.no_grad():
        return model(x)


def test_init_from_with_tp2_gives_the_same_logits(tmp_path):
    ref = _hf_llama(tmp_path)
    cfg = model_config_from_hf(str(tmp_path))
    x = _tokens()
    with torch.no_grad():
        expected = ref(x).logits
    for logits in run_processes(_tp_logits, 2, cfg, x, timeout_s=120):
        assert (logits - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", ["llama", "llama-tied", "gpt"])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, family):
    if family == "gpt":
        cfg = ModelConfig(n_layers=2, d_model=64, n_heads=4, seq_len=32)
    else:
        cfg = ModelConfig(**SMALL, tie_embeddings=family == "llama-tied")
    torch.manual_seed(5)
    ours = build_model(cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases
        for p in ours.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    save_hf(str(tmp_path), cfg, dict(ours.state_dict()))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).float().eval()
    assert type(theirs).__name__ == ("GPT2LMHeadModel" if family == "gpt" else "LlamaForCausalLM")
    x = _tokens()
    with torch.no_grad():
        assert (theirs(x).logits - ours(x)).abs().max().item() < 1e-4


# -- training through the loop ------------------------------------------------------------------------------
def _train(rank, world, cfg):
    sink = ListSink()
    result = train(cfg, sink=sink, keep_params=True)
    return result, [r.loss for r in sink.records]


def _cfg(dcs, *, tp=1, pp=1, strategy="hierarchical", model=None):
    return TrainConfig(
        job_id="llama", model=model or replace(model_preset("llama-tiny"), n_layers=2, seq_len=32), steps=4,
        global_batch=4, micro_batch=2, datacenters=dcs, sync=SyncConfig(strategy=SyncStrategy(strategy)), seed=1,
        parallel=ParallelConfig(tp=tp, pp=pp),
    )


def test_llama_trains_with_tp_and_pp_like_one_process():
    (ref, ref_losses), = run_processes(_train, 1, _cfg(("a",)), timeout_s=180)
    assert ref_losses[-1] < ref_losses[0]
    for dcs, tp, pp in ((("a", "a"), 2, 1), (("a", "b"), 1, 2)):
        out = run_processes(_train, len(dcs), _cfg(dcs, tp=tp, pp=pp), timeout_s=180)
        assert out[0][1] == pytest.approx(ref_losses, rel=1e-4), (tp, pp)
        full = {n: p for res, _ in out for n, p in res.final_params.items()}  # each stage's own parameters
        worst = max((full[n] - ref.final_params[n]).abs().max().item() for n in full)
        assert worst < 1e-4, (tp, pp, worst)


@pytest.mark.parametrize("strategy", ["hierarchical", "diloco"])
def test_llama_trains_across_datacenters_with_har_and_diloco(strategy):
    out = run_processes(_train, 4, _cfg(("a", "a", "b", "b"), strategy=strategy), timeout_s=180)
    losses = out[0][1]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    # HAR: every replica identical; DiLoCo (H=50 > 4 steps): identical inside each DC, which drift apart.
    twins = [(1, 0), (2, 0), (3, 0)] if strategy == "hierarchical" else [(1, 0), (3, 2)]
    for a, b in twins:
        for n, p in out[a][0].final_params.items():
            assert torch.equal(p, out[b][0].final_params[n]), (strategy, a, b, n)


# -- final weights out: the artifacts endpoint and `meridian export` ----------------------------------------
@pytest.mark.parametrize("data", ["builtin", "dataset"])
def test_every_job_keeps_its_final_weights_and_export_writes_what_transformers_loads(
    store, supervisor, cluster_view, tmp_path, monkeypatch, capsys, data
):
    import json

    from fakes import FakeService, spec

    from meridian.api.auth import AuthSettings
    from meridian.api.server import serve_in_thread
    from meridian.cli.main import main
    from meridian.service.data_access import DataAccess
    from meridian.workers.state import checkpoint as ckpt_io

    model = {"preset": "llama-tiny", "n_layers": 2, "seq_len": 32}
    body: dict = {}
    if data == "dataset":  # a prepared dataset under the service's data roots, with a trained BPE
        from meridian.workers.data.prepare import PrepareOptions, prepare

        (tmp_path / "data").mkdir()
        text = tmp_path / "data" / "text.txt"
        text.write_text(_reference_text(60_000), encoding="utf-8")
        prepare([str(text)], str(tmp_path / "data" / "ds"),
                PrepareOptions(train_tokenizer=True, vocab_size=320, val_fraction=0.1), progress=False)
        supervisor.data_access = DataAccess.for_roots([str(tmp_path / "data")])
        model["vocab_size"] = 320
        body = {"data": {"dataset": str(tmp_path / "data" / "ds")}}
    fake = FakeService(store, supervisor, cluster_view)
    with serve_in_thread(fake, auth=AuthSettings.load(enabled=False, token_file=str(tmp_path / "t.json"))) as url:
        monkeypatch.setenv("MERIDIAN_URL", url)
        assert main(["submit", "--json", _write(tmp_path / "keep.json", spec(name="keep", model=model, **body))]) == 0
        job = json.loads(capsys.readouterr().out)
        optout = spec(name="no", model=model, checkpoint={"keep_final": False}, **body)
        assert main(["submit", "--json", _write(tmp_path / "no.json", optout)]) == 0
        no = json.loads(capsys.readouterr().out)
        supervisor.tick()
        supervisor.tick()
        configs = {job_id: config for job_id, config, _ in supervisor.launcher.launched}
        cfg = configs[job["id"]]
        assert cfg.checkpoint_dir == str(tmp_path / "ckpt" / job["id"])  # (the other job waits for capacity)
        assert cfg.model.family is ModelFamily.LLAMA

        # What the elastic trainer's final save writes (Checkpointer.save: the model's state dict).
        torch.manual_seed(cfg.seed)
        trained = build_model(cfg.model).eval()
        state = {n: t.clone() for n, t in trained.state_dict().items()}
        ckpt_io.save(cfg.checkpoint_dir, ckpt_io.Checkpoint(step=cfg.steps, model=state, optimizer={}, fingerprint={}))

        import httpx

        listing = httpx.get(f"{url}/v1/jobs/{job['id']}/artifacts").json()
        assert listing["latest"] and listing["artifacts"][-1]["final"] and listing["artifacts"][-1]["bytes"] > 0
        assert httpx.get(f"{url}/v1/jobs/{no['id']}/artifacts").json()["artifacts"] == []

        out = tmp_path / "hf"
        assert main(["export", job["id"], "--out", str(out), "--json"]) == 0
        exported = json.loads(capsys.readouterr().out)
        assert exported["final"] is True
        assert main(["export", no["id"], "--out", str(tmp_path / "none"), "--json"]) == 1
        problem = json.loads(capsys.readouterr().out)["error"]
        assert problem["type"] == "urn:meridian:problem:no-checkpoint" and "keep_final: false" in problem["detail"]

    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out)).float().eval()
    x = torch.randint(0, cfg.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (theirs(x).logits - trained(x)).abs().max().item() < 1e-4
    tokenizer = exported["tokenizer"]
    loaded = transformers.AutoTokenizer.from_pretrained(str(out))
    sample = "def f(x):\n    return x ** 2  # Übung: ünïcödé 😀\n"
    if data == "builtin":  # raw text: the byte tokenizer, id = UTF-8 byte, as the workers read the text
        from meridian.workers.contracts.config import DataConfig
        from meridian.workers.data.text import load_text

        assert tokenizer["written"] is True and "bytes" in tokenizer["source"]
        assert loaded(sample)["input_ids"] == list(sample.encode()) and len(loaded) == 256
        text = load_text(DataConfig(max_bytes=4096))
        assert loaded.decode(list(text)) == text.decode("utf-8", errors="replace")
        assert loaded.decode(loaded(sample)["input_ids"]) == sample
        return
    from tokenizers import Tokenizer

    assert tokenizer["written"] is True and tokenizer["reason"] == ""
    ours = Tokenizer.from_file(str(tmp_path / "data" / "ds" / "tokenizer.json"))
    assert loaded(sample)["input_ids"] == ours.encode(sample, add_special_tokens=False).ids
    assert loaded.decode(loaded(sample)["input_ids"]) == sample
    assert loaded.eos_token == "<|endoftext|>" and loaded.eos_token_id == ours.token_to_id("<|endoftext|>")
    assert theirs.config.eos_token_id == loaded.eos_token_id and loaded.model_max_length == 32


def _reference_text(n_chars: int) -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))[:n_chars]


def _write(path, body) -> str:
    import json

    path.write_text(json.dumps(body))
    return str(path)


def _elastic(rank, world, cfg):
    from test_parallel import _FormedRendezvous

    from meridian.workers.elastic.trainer import ElasticTrainer
    from meridian.workers.parallel.dims import ParallelDims

    result = ElasticTrainer(cfg, _FormedRendezvous(rank, world, cfg), sink=ListSink(), keep_params=True,
                            on_event=lambda *e: None).run()
    return ParallelDims(cfg.parallel.tp, cfg.parallel.pp, cfg.datacenters).coords(rank), result.final_params


def test_a_tensor_and_pipeline_parallel_job_writes_its_final_state_from_every_rank_for_export(tmp_path):
    from meridian.workers.contracts.fields import to_plain
    from meridian.workers.model.export import export_checkpoint
    from meridian.workers.state.sharded_checkpoint import load_full, open_checkpoint

    cfg = replace(_cfg(("a", "a", "b", "b"), tp=2, pp=2), checkpoint_dir=str(tmp_path / "ckpt"))
    out = run_processes(_elastic, 4, cfg, timeout_s=240)
    path = tmp_path / "ckpt" / f"step-{cfg.steps:08d}"
    assert (tmp_path / "ckpt" / "latest").read_text() == path.name
    assert len(list(path.glob("*.distcp"))) == 4  # every rank wrote its own slices: nothing was gathered
    ck = open_checkpoint(str(path))
    assert ck.step == cfg.steps and ck.adam_step == cfg.steps  # the whole state: a job of any layout resumes it
    weights, optimizer = load_full(ck)
    held = {n: p for c, params in out if c.replica == 0 for n, p in params.items()}
    assert sorted(weights) == sorted(held) == sorted(optimizer["params"])
    for name, t in held.items():  # the full model, every slice in its place
        assert torch.equal(weights[name], t.float()), name
    ours = build_model(cfg.model).eval()
    ours.load_state_dict(weights)
    export_checkpoint(str(path), to_plain(cfg.model), str(tmp_path / "hf"))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).float().eval()
    x = _tokens()
    with torch.no_grad():
        assert (theirs(x).logits - ours(x)).abs().max().item() < 1e-4


def test_the_planner_uses_the_family_s_formulas_and_limits():
    from fakes import node

    from meridian.service.cluster.topology import ClusterTopology
    from meridian.service.jobs import JobRequest
    from meridian.service.planning.cost_model import activation_bytes
    from meridian.service.planning.planner import default_figures, ranked_layouts

    gpt, llama = model_preset("tiny"), model_preset("llama-tiny")
    # Per layer, split by TP: attention 8·sbh, plus GELU's two 4d-wide tensors (16·sbh) or SwiGLU's four tensors
    # of its width (llama-tiny: 4 × 2 bytes × 3d = 24·sbh); no s × s scores (SDPA); fp32 logits and gradient.
    s, b, d = 128, 2, 128
    logits = 2 * 4 * b * s * 256
    assert activation_bytes(gpt, b, 1, 1) - logits == 2 * s * b * d * (10 + 8 + 16)
    assert activation_bytes(llama, b, 1, 1) - logits == 2 * s * b * d * (10 + 8 + 24)
    topo = ClusterTopology((node("n-a", "dc-a", cpus=4), node("n-b", "dc-b", cpus=4)))
    tied = replace(llama, tie_embeddings=True, n_kv_heads=1)
    request = JobRequest(name="p", model=tied, steps=2, global_batch=8, micro_batch=1)
    ranked = ranked_layouts(request, topo, default_figures(topo, ("dc-a", "dc-b"), False))
    assert ranked and all(c.layout.tp == 1 and c.layout.pp == 1 for c, _ in ranked)  # 1 KV head; tied head


def test_a_spec_with_init_from_takes_the_checkpoint_s_shape_and_survives_the_store(tmp_path):
    from meridian.api.schemas import JobSpec
    from meridian.service.jobs import JobRequest

    _hf_llama(tmp_path)
    training = {"steps": 2, "global_batch": 2, "micro_batch": 1}
    request = JobSpec(name="hf", model={"init_from": str(tmp_path), "seq_len": 16}, training=training).to_request()
    assert request.model.init_from == str(tmp_path.resolve()) and request.model.seq_len == 16
    assert request.model.kv_heads == 2 and request.model.rope_theta == 500000.0 and request.model.norm_eps == 1e-6
    assert JobRequest.from_dict(request.to_dict()) == request
    for bad, field in (({"init_from": str(tmp_path), "n_layers": 3}, "model.n_layers"),
                       ({"init_from": str(tmp_path / "nope")}, "no config.json"),
                       ({"preset": "tiny", "family": "llama"}, "model.family")):
        with pytest.raises(ValueError, match=field):
            JobSpec(name="hf", model=bad, training=training).to_request()


def test_init_from_is_admitted_like_data_under_the_data_roots_before_it_is_read(
    store, supervisor, cluster_view, tmp_path
):
    import os

    from fakes import FakeService
    from fastapi.testclient import TestClient

    from meridian.api.app import create_app
    from meridian.service.data_access import DataAccess

    root, outside = tmp_path / "data", tmp_path / "outside"
    _hf_llama(root / "hf")
    _hf_llama(outside / "hf")
    (root / "link").symlink_to(outside / "hf")
    (root / "empty").mkdir()
    supervisor.data_access = DataAccess.for_roots([str(root)])
    training = {"steps": 2, "global_batch": 2, "micro_batch": 1}
    fake = FakeService(store, supervisor, cluster_view)
    with TestClient(create_app(fake.config, service=fake), base_url="http://127.0.0.1") as client:
        def post(path: str, init_from: str, **extra):
            return client.post(path, json={"name": "hf", "model": {"init_from": init_from}, "training": training,
                                           **extra})

        refused = {name: post("/v1/jobs", str(where)) for name, where in (
            ("outside", outside / "hf"), ("missing", outside / "nope"), ("dotdot", root / ".." / "outside" / "hf"),
            ("symlink_out", root / "link"), ("relative", "data/hf"), ("root_itself", root))}
        assert {n: r.status_code for n, r in refused.items()} == dict.fromkeys(refused, 422)
        for name, r in refused.items():
            detail = r.json()["detail"]
            assert "model.init_from" in detail and str(root) in detail, (name, detail)  # the path and the roots
        words = {r.json()["detail"].split("' is not", 1)[1] for r in refused.values()}
        assert len(words) == 1  # the same answer whether or not the directory exists
        assert post("/v1/plans", str(outside / "hf")).status_code == 422  # the dry-run plan checks it too

        no_checkpoint = post("/v1/jobs", str(root / "empty"))  # under the roots: now it may be read
        assert no_checkpoint.status_code == 422 and "no config.json" in no_checkpoint.json()["detail"]
        wrong_tp = post("/v1/jobs", str(root / "hf"), parallelism={"tp": 4})  # the checkpoint has 2 KV heads
        assert wrong_tp.status_code == 422 and "tp" in wrong_tp.json()["detail"]
        # Fine-tuning reads prepared data (raw text is bytes, which mean nothing to a pretrained vocabulary):
        # here made with the byte tokenizer, 256 ids as the checkpoint has (and no tokenizer.json to match).
        from meridian.workers.data.hf_tokenizer import byte_tokenizer
        from meridian.workers.data.prepare import PrepareOptions, prepare

        byte_tokenizer().save(str(tmp_path / "bytes.json"))
        (tmp_path / "text.txt").write_text("some text to fine-tune on.\n\n" * 200)
        prepare([str(tmp_path / "text.txt")], str(root / "ds"),
                PrepareOptions(tokenizer=str(tmp_path / "bytes.json"), val_fraction=0.1), progress=False)
        ok = post("/v1/jobs", str(root / "empty" / ".." / "hf"), data={"dataset": str(root / "ds")})
        assert ok.status_code == 201, ok.text
    job = store.get_job(ok.json()["id"])
    assert job.request.model.init_from == os.path.realpath(root / "hf") and job.request.model.kv_heads == 2


def test_llama_survives_losing_a_rank_and_matches_an_uninterrupted_run(tmp_path):
    import test_elastic_loop as el

    cfg = replace(el.job(job_id=el._unique_job_id()), model=replace(model_preset("llama-tiny"), n_layers=2, seq_len=32))
    reference = run_processes(el._reference_rank, 4, cfg, timeout_s=el.TIMEOUT_S)[0]
    run = el.ElasticRun(4)
    try:
        for i, dc in enumerate(el.DCS):
            run.start(i, dc, cfg)
        run.kill_after_step(1, cfg, 3)
        out = run.collect({0, 2, 3})
        events = run.events()
        formed = [e[2] for e in events if e[0] == "epoch_formed"]
        assert len(formed) >= 2 and "worker_lost" in [e[0] for e in events]  # (≥: a loaded machine may re-form twice)
        # A survivor that re-joins after the others finished returns None (it trained in no later epoch);
        # every rank that finished holds the same replica.
        finished = [o["result"] for o in out.values() if o["result"] is not None]
        assert finished, "\n".join(map(repr, [out, *events]))
        assert all(el._max_rel(r.final_params, reference) < 1e-4 for r in finished)
    finally:
        run.close()
