"""Tensor, sequence and pipeline parallelism from torch, composed with FSDP2, on real multi-process gloo groups:
every layout trains like one process.

Each layout trains a model on the same data from the same initial weights as a single process, for 20 steps. The
loss curves must agree to 1e-4 relative and the final parameters to 1e-4 absolute (max over every element): TP sums
partial matmuls in another order and the clipping norm is summed in float64 across the replica's ranks, so results
may differ from one process by float32 rounding, never by a missing or double-counted gradient (grad_clip=1.0 acts:
the first norms are well above 1). A layout's replicas must hold the same parameters bit for bit.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from meridian.workers.contracts.config import (
    ActivationCheckpointing,
    ParallelConfig,
    PipelineSchedule,
    SyncConfig,
    SyncStrategy,
    TrainConfig,
)
from meridian.workers.contracts.model_config import ModelConfig, ModelFamily, model_preset
from meridian.workers.contracts.rendezvous import Assignment
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.elastic.trainer import ElasticTrainer
from meridian.workers.loop.train import ListSink, train
from meridian.workers.parallel.dims import ParallelDims
from meridian.workers.parallel.pipeline import rank_stages, stage_layers

STEPS = 20
NANO = model_preset("nano")
LLAMA = ModelConfig(family=ModelFamily.LLAMA, n_layers=4, d_model=64, n_heads=8, n_kv_heads=2, ffn_hidden=96,
                    seq_len=16)  # fmt: skip
MODELS = {"gpt": NANO, "llama": LLAMA}


def _run(rank, world, cfg):
    import torch._dynamo

    sink = ListSink()
    result = train(cfg, sink=sink, keep_params=True)
    dims = ParallelDims(cfg.parallel.tp, cfg.parallel.pp, cfg.datacenters or ("local",) * world)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return dims.coords(rank), result, [r.loss for r in sink.records], [r.grad_norm for r in sink.records], graphs


def config(dcs, model="gpt", *, steps=STEPS, **kw) -> TrainConfig:
    extra = {k: kw.pop(k) for k in ("compile", "activation_checkpointing") if k in kw}
    return TrainConfig(
        job_id="t", model=MODELS[model], steps=steps, global_batch=8, micro_batch=2, datacenters=dcs,
        sync=SyncConfig(strategy=SyncStrategy.HIERARCHICAL), seed=1, parallel=ParallelConfig(**kw), **extra,
    )  # fmt: skip


@pytest.fixture(scope="module")
def one_process():
    """model -> its single-process run, computed once."""
    cache = {}

    def get(model):
        if model not in cache:
            (_, result, losses, norms, _), = run_processes(_run, 1, config(("a",), model), timeout_s=300)
            assert norms[0] > 1.0  # clipping (grad_clip=1.0) acts, so a wrong norm would change the update
            cache[model] = result, losses, norms
        return cache[model]

    return get


GROUPS = [
    # name: (datacenters, model, ParallelConfig and TrainConfig fields)
    ("tp2", ("a", "a"), "gpt", {"tp": 2}),
    ("pp2-one-dc", ("a", "a"), "gpt", {"pp": 2, "activation_checkpointing": ActivationCheckpointing.FULL}),
    ("pp2-across-dcs", ("a", "b"), "gpt", {"pp": 2, "schedule": PipelineSchedule.GPIPE}),
    # tp 2 × pp 2 × dp 2: each replica inside one DC, HAR across them; sequence parallel; 4 stages interleaved
    ("tp2-pp2-dp2", ("a", "a", "b", "b") * 2, "llama",
     {"tp": 2, "pp": 2, "sequence_parallel": True, "schedule": PipelineSchedule.INTERLEAVED_1F1B, "virtual_stages": 2}),
    ("tp2-sp-selective-checkpointing", ("a", "a", "b", "b"), "llama",
     {"tp": 2, "sequence_parallel": True, "activation_checkpointing": ActivationCheckpointing.SELECTIVE}),
    ("tp2-sp-compiled", ("a", "a"), "llama", {"tp": 2, "sequence_parallel": True, "compile": True}),
]


@pytest.mark.parametrize("name, dcs, model, kw", GROUPS, ids=[g[0] for g in GROUPS])
def test_layout_trains_like_one_process(name, dcs, model, kw, one_process):
    ref, ref_losses, ref_norms = one_process(model)
    cfg = config(dcs, model, **dict(kw))
    out = run_processes(_run, len(dcs), cfg, timeout_s=900)
    losses, norms = out[0][2], out[0][3]
    assert len(losses) == STEPS
    assert losses == pytest.approx(ref_losses, rel=1e-4)
    assert norms == pytest.approx(ref_norms, rel=1e-4)  # the norm summed over the replica's ranks
    assert out[0][1].eval_loss == pytest.approx(ref.eval_loss, rel=1e-4)
    full: dict[str, torch.Tensor] = {}
    for c, r, *_ in out:
        if c.replica == 0:
            full.update(r.final_params)
    assert sorted(full) == sorted(ref.final_params)  # every parameter, from the rank that holds it
    worst = max((full[n] - ref.final_params[n]).abs().max().item() for n in full)
    assert worst < 1e-4, worst
    for c, r, *_ in out:  # replicas agree exactly, as the data-parallel sync promises
        twin = next(r0 for c0, r0, *_ in out if c0.replica == 0 and (c0.stage, c0.tp_rank) == (c.stage, c.tp_rank))
        for n, p in r.final_params.items():
            assert torch.equal(p, twin.final_params[n]), (c, n)
    if kw.get("compile"):
        assert all(graphs > 0 for *_, graphs in out)  # the blocks ran compiled
    if name == "pp2-across-dcs":
        # every micro-batch's hidden states cross forward and their gradients back: (2 × 2 × 64 × 64) fp32, 4
        # micro-batches, both ways; DP traffic none (one replica)
        assert out[0][1].inter_dc_bytes_per_step == 2 * 4 * (2 * NANO.seq_len * NANO.d_model) * 4


EDGES = [
    # name: (datacenters, model, global batch, micro-batch, ParallelConfig fields)
    ("pp2-uneven-stages", ("a", "a"), dataclasses.replace(NANO, n_layers=3), 6, 2, {"pp": 2}),
    ("pp4-gpipe-fewer-micro-batches-than-stages", ("a",) * 4, dataclasses.replace(NANO, n_layers=4), 4, 2,
     {"pp": 4, "schedule": PipelineSchedule.GPIPE}),
    ("tp2-uneven-micro-batches", ("a", "a"), NANO, 6, 4, {"tp": 2}),
    ("tp2-sp-llama-tied-head", ("a", "a"), dataclasses.replace(LLAMA, tie_embeddings=True), 4, 2,
     {"tp": 2, "sequence_parallel": True}),
]


@pytest.mark.parametrize("name, dcs, model, batch, micro, kw", EDGES, ids=[e[0] for e in EDGES])
def test_an_edge_layout_matches_one_process_for_three_steps(name, dcs, model, batch, micro, kw):
    def cfg(dcs, **par):
        return TrainConfig(job_id="t", model=model, steps=3, global_batch=batch, micro_batch=micro, datacenters=dcs,
                           seed=1, parallel=ParallelConfig(**par))  # fmt: skip

    (_, ref, ref_losses, _, _), = run_processes(_run, 1, cfg(("a",)), timeout_s=300)
    out = run_processes(_run, len(dcs), cfg(dcs, **kw), timeout_s=600)
    assert out[0][2] == pytest.approx(ref_losses, rel=1e-4)
    full = {n: p for c, r, *_ in out for n, p in r.final_params.items()}
    assert sorted(full) == sorted(ref.final_params)
    assert max((full[n] - ref.final_params[n]).abs().max().item() for n in full) < 1e-4


def _bf16(rank, world, cfg):
    sink = ListSink()
    result = train(cfg, sink=sink, keep_params=True)
    return result, [r.loss for r in sink.records]


def test_bf16_trains_through_fsdp2_mixed_precision_within_bf16_rounding(one_process):
    """precision bf16: bf16 parameters in forward and backward (FSDP2's policy), fp32 reductions and master shards.
    Five steps stay within 2% of fp32's losses, and the parameters the optimizer holds stay fp32."""
    from meridian.workers.contracts.config import Precision

    _, ref_losses, _ = one_process("llama")
    cfg = dataclasses.replace(config(("a", "a", "b", "b"), "llama", steps=5, tp=2, pp=2), precision=Precision.BF16)
    out = run_processes(_bf16, 4, cfg, timeout_s=600)
    losses = next(lo for _, lo in out if lo)
    assert losses == pytest.approx(ref_losses[:5], rel=2e-2)
    assert losses != pytest.approx(ref_losses[:5], rel=1e-6)  # it did compute in bf16
    assert all(p.dtype == torch.float32 for r, _ in out for p in r.final_params.values())


# -- what a layout or a device cannot do is an error naming the field (a 422 at the API) ----------------------


@pytest.mark.parametrize("kw, match", [
    ({"tp": 1, "sequence_parallel": True}, "parallelism.sequence_parallel.*needs parallelism.tp > 1"),
    ({"pp": 2, "virtual_stages": 2}, "parallelism.virtual_stages .* needs parallelism.schedule 'interleaved-1f1b'"),
    ({"pp": 2, "schedule": PipelineSchedule.INTERLEAVED_1F1B}, "needs parallelism.virtual_stages >= 2"),
    ({"pp": 2, "schedule": PipelineSchedule.INTERLEAVED_1F1B, "virtual_stages": 2, "_layers": 3},
     r"parallelism.pp × virtual_stages \(2 × 2\) must be <= model.n_layers"),
    ({"pp": 2, "_micro": 3}, r"training.micro_batch \(3\) must divide each pipeline replica's samples"),
    ({"pp": 4, "_dcs": 4, "_layers": 4, "_micro": 4}, r"'1f1b' needs at least pp \(4\) micro-batches"),
    ({"tp": 3}, r"parallelism.tp \(3\) must divide model.n_heads"),
    ({"tp": 2, "_strategy": "flat"}, "sync.strategy 'flat' cannot run with parallelism.tp = 2"),
    ({"pp": 2, "_strategy": "diloco"}, "sync.strategy 'diloco' cannot run with parallelism.tp = 1, pp = 2"),
])
def test_a_layout_that_cannot_run_is_refused_naming_the_field(kw, match):
    kw = dict(kw)
    layers, micro, dcs = kw.pop("_layers", 2), kw.pop("_micro", 2), kw.pop("_dcs", 2)
    strategy = kw.pop("_strategy", "hierarchical")
    with pytest.raises(ValueError, match=match):
        TrainConfig(job_id="t", model=dataclasses.replace(NANO, n_layers=layers), steps=1, global_batch=8,
                    micro_batch=micro, datacenters=("a",) * dcs, parallel=ParallelConfig(**kw),
                    sync=SyncConfig(strategy=SyncStrategy(strategy)))  # fmt: skip


def test_dims_place_ranks_and_refuse_tp_across_datacenters():
    dims = ParallelDims(2, 2, ("a",) * 4 + ("b",) * 4)
    assert dims.dp == 2
    assert dims.coords(5).__dict__ == {"stage": 1, "replica": 0, "tp_rank": 1}
    assert dims.dp_ranks(1, 1) == (5, 7)
    assert dims.stage_ranks(1, 0) == (2, 6)
    assert [len(stage_layers(5, 2, s)) for s in range(2)] == [3, 2]
    with pytest.raises(ValueError, match="tensor parallelism must stay inside one node"):
        ParallelDims(2, 1, ("a", "b"))


def test_virtual_stages_go_round_robin_over_the_pipeline_ranks():
    par = ParallelConfig(pp=2, schedule=PipelineSchedule.INTERLEAVED_1F1B, virtual_stages=3)
    assert [rank_stages(par, s) for s in range(2)] == [[0, 2, 4], [1, 3, 5]]
    assert rank_stages(ParallelConfig(pp=3), 1) == [1]


@pytest.mark.parametrize("n_layers", range(1, 13))
def test_stage_layers_cover_every_block_once_in_order(n_layers):
    for pp in range(1, n_layers + 1):
        stages = [stage_layers(n_layers, pp, s) for s in range(pp)]
        assert [i for r in stages for i in r] == list(range(n_layers))
        sizes = [len(r) for r in stages]
        assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


# -- the same loop under the elastic trainer -------------------------------------------------------------------


class _FormedRendezvous:
    """Epoch ``epoch`` over the default group that ``run_processes`` already formed: nothing to host or join."""

    def __init__(self, rank, world, cfg, epoch=1, resume_step=0):
        self.epoch = 0
        self.a = Assignment.of(epoch=epoch, rank=rank, world_size=world, datacenters=cfg.datacenters, master_addr="",
                            master_port=0, resume_step=resume_step, from_checkpoint=False,
                            newcomer_ranks=tuple(range(world)))  # fmt: skip

    def join(self, *, last_step, timeout_s, snapshot_every=1):
        return self.a

    def form(self, a):
        pass

    def finish(self):
        pass

    def pending_change(self):
        return False


def _plain_then_elastic(rank, world, cfg):
    plain, elastic = ListSink(), ListSink()
    train(cfg, sink=plain)
    ElasticTrainer(cfg, _FormedRendezvous(rank, world, cfg), sink=elastic, on_event=lambda *e: None).run()
    return plain.records, elastic.records


def test_the_elastic_trainer_runs_a_model_parallel_job_through_the_same_loop():
    plain, elastic = run_processes(_plain_then_elastic, 2, config(("a", "b"), pp=2, steps=8), timeout_s=300)[0]
    assert [r.loss for r in elastic] == [r.loss for r in plain] and len(plain) == 8
    assert {r.epoch for r in plain} == {0} and {r.epoch for r in elastic} == {1}
