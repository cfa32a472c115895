"""The sustained efficiency a kind of GPU computes a transformer at: fitted to one published training run per GPU,
never to the runs the planner is then tested against (``tests/test_published_tables.py``).

A published run gives a model, a cluster, the layout it used and the throughput it measured. The efficiency is
the share of the device's dense bf16 peak at which the planner's own cost model
(:func:`~meridian.service.planning.cost_model.estimate`) reproduces that throughput for that layout, with what the
source leaves unstated (micro-batch, virtual stages) chosen as the planner chooses it. Everything else of the step
(the bubble, tensor-parallel and data-parallel communication) is the cost model's, so the one fitted number is
what the devices sustain on the layers' matrix multiplications. Fitted once per process, when first asked.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

from meridian.service.planning.cost_model import Figures, Recompute, estimate, hardware_flops_per_token
from meridian.service.planning.described import ClusterSpec, DatacenterSpec, GpuSpec, NodeSpec
from meridian.service.planning.runtime_support import EVERYTHING, RuntimeSupport
from meridian.workers.contracts.config import Precision, SyncConfig
from meridian.workers.contracts.model_shape import MlpKind, ModelShape, NormKind


@dataclass(frozen=True, kw_only=True)
class PublishedRun:
    """A training run as its source published it: the model, the machine, the layout and the throughput."""

    source: str
    """Where the figures come from (paper, table, row)."""
    shape: ModelShape
    nodes: int
    gpus_per_node: int
    gpu: str
    memory_gb: float
    bf16_tflops: float
    nvlink_gbps: float
    nic_gbps: float
    """Per node, one direction."""
    tp: int
    pp: int
    global_batch: int
    micro_batch: int | None = None
    """``None``: not published (the planner's choice)."""
    recompute: Recompute | None = None
    """``None``: not published (the least that fits)."""
    mfu: float | None = None
    """Published model FLOPs utilisation (PaLM's FLOPs, no recomputation, over the bf16 peak)."""
    tflops_per_gpu: float | None = None
    """Published TFLOP/s per GPU counting recomputation's FLOPs (Narayanan et al. 2021's convention)."""
    overlap: bool = True
    """The data-parallel gradient sync overlaps the backward pass (Megatron-LM of 2021 ran it after)."""
    runtime: RuntimeSupport = field(default_factory=lambda: replace(EVERYTHING, fsdp=False))
    """What the software of the run could do (no FSDP: Megatron shards the optimizer state only)."""

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def cluster(self, efficiency: float) -> ClusterSpec:
        gpu = GpuSpec(name=self.gpu, memory_gb=self.memory_gb, bf16_tflops=self.bf16_tflops, efficiency=efficiency)
        node = NodeSpec(gpus=self.gpus_per_node, cpus=8 * self.gpus_per_node, gpu=gpu, nvlink_gbps=self.nvlink_gbps,
                        nic_gbps=self.nic_gbps)
        return ClusterSpec(datacenters=(DatacenterSpec(name="published", nodes=self.nodes, node=node),))

    def request(self):  # -> PlanRequest
        from meridian.service.jobs import ParallelismRequest
        from meridian.service.planning.request import PlanRequest

        return PlanRequest(shape=self.shape, global_batch=self.global_batch, micro_batch=self.micro_batch,
                           steps=10_000, precision=Precision.BF16, recompute=self.recompute,
                           parallelism=ParallelismRequest(tp=self.tp, pp=self.pp, stages_span_dcs=False),
                           sync=SyncConfig(strategy=None, bucket_mb=None, overlap=self.overlap))

    def throughput(self, step_s: float) -> float:
        """The run's figure of merit for a step of ``step_s``: MFU, or hardware TFLOP/s per GPU."""
        tokens = self.global_batch * self.shape.seq_len
        if self.mfu is not None:
            return tokens * self.shape.flops_per_token / (step_s * self.gpus * self.bf16_tflops * 1e12)
        return tokens * hardware_flops_per_token(self.shape, self.recompute or Recompute.NONE) / (step_s * self.gpus) / 1e12

    @property
    def published(self) -> float:
        value = self.mfu if self.mfu is not None else self.tflops_per_gpu
        assert value is not None, "a published run gives its MFU or its TFLOP/s per GPU"
        return value


@dataclass(frozen=True)
class Calibration:
    efficiency: float
    """Sustained share of the dense bf16 peak."""
    source: str
    """What it was fitted to, in words."""


def gpt_shape(*, layers: int, hidden: int, heads: int, seq_len: int = 2048, vocab: int = 51200) -> ModelShape:
    """Megatron-LM's GPT as Narayanan et al. 2021 trained it: MHA, a 4h GELU MLP, biases, LayerNorm, learned
    positions, the head tied to the embedding (their parameter count, eq. 2, counts V·h once)."""
    return ModelShape(n_layers=layers, hidden=hidden, n_heads=heads, kv_heads=heads, head_dim=hidden // heads,
                      ffn_hidden=4 * hidden, mlp=MlpKind.GELU, norm=NormKind.LAYERNORM, vocab_size=vocab,
                      tie_embeddings=True, seq_len=seq_len, qkv_bias=True, out_bias=True, mlp_bias=True,
                      learned_positions=seq_len, name="megatron-gpt")


NEMOTRON4_340B = ModelShape(
    n_layers=96, hidden=18432, n_heads=96, kv_heads=8, head_dim=192, ffn_hidden=73728, mlp=MlpKind.SQUARED_RELU,
    norm=NormKind.LAYERNORM, vocab_size=256000, tie_embeddings=False, seq_len=4096, name="nemotron",
)
"""Nemotron-4 340B (NVIDIA 2024, *Nemotron-4 340B Technical Report*, §2.1): 96 layers, hidden 18,432, 96 query and 8
key/value heads, squared-ReLU MLP of 73,728, vocabulary 256,000, untied, no biases, sequence 4,096."""

DGX_A100 = dict(gpus_per_node=8, gpu="A100-SXM-80GB", memory_gb=80, bf16_tflops=312, nvlink_gbps=2400, nic_gbps=1600)
"""Selene's nodes (Narayanan et al. 2021 §5): 8 A100 80 GB, NVLink 3 (300 GB/s a direction), 8 x 200 Gbit/s HDR."""
DGX_H100 = dict(gpus_per_node=8, gpu="H100-SXM", memory_gb=80, bf16_tflops=989, nvlink_gbps=3600, nic_gbps=3200)
"""DGX H100 (the Nemotron-4 report's nodes): 8 H100 80 GB, NVLink 4 (450 GB/s a direction), 8 x 400 Gbit/s."""

MEGATRON_2021 = replace(EVERYTHING, fsdp=False, sequence_parallel=False)
"""What Megatron-LM ran in 2021 (Narayanan et al.): interleaved 1F1B and recomputation, 16-bit weights, no sequence
parallelism (Korthikanti et al. 2022 added it), no sharding; its data-parallel all-reduce followed the backward
pass (``overlap=False``)."""

CALIBRATION_RUNS: dict[str, PublishedRun] = {
    "A100": PublishedRun(
        source="Narayanan et al. 2021 (SC'21), Table 2, PTD-P: GPT-3 175B on 384 A100 80 GB, tensor x pipeline "
               "8 x 12, batch 1536, micro-batch 1, full recomputation, 153 TFLOP/s per GPU",
        shape=gpt_shape(layers=96, hidden=12288, heads=96), nodes=48, **DGX_A100, tp=8, pp=12, global_batch=1536,
        micro_batch=1, recompute=Recompute.FULL, tflops_per_gpu=153, overlap=False, runtime=MEGATRON_2021),
    "H100": PublishedRun(
        source="NVIDIA 2024, Nemotron-4 340B Technical Report, Table 2, first row: 1,536 H100 (192 DGX H100), tensor "
               "x pipeline 8 x 12, data-parallel 16, batch 768, MFU 42.4%",
        shape=NEMOTRON4_340B, nodes=192, **DGX_H100, tp=8, pp=12, global_batch=768, mfu=0.424),
}
"""One published run per GPU kind; the published tables the planner is tested against are other runs."""

GPU_KINDS = {"A100": "A100", "H100": "H100", "H200": "H100"}
"""A device name's family → the calibration it uses (an H200 has the H100's compute and peak)."""


def kind_of(gpu_name: str) -> str | None:
    upper = gpu_name.upper()
    return next((kind for key, kind in GPU_KINDS.items() if key in upper), None)


def calibrated_figures(cluster: ClusterSpec) -> tuple[Figures, Calibration]:
    """``cluster``'s figures at the efficiency its slowest GPU declares, or else the one fitted for its family."""
    gpu = cluster.slowest_gpu
    if gpu.efficiency is not None:
        cal = Calibration(efficiency=gpu.efficiency, source=f"declared for {gpu.name} in the cluster file")
    else:
        cal = calibration_for(gpu.name)
    return cluster.figures(cal.efficiency), cal


@functools.cache
def calibration_for(gpu_name: str) -> Calibration:
    """The fitted efficiency of ``gpu_name``'s family; ``ValueError`` naming what to declare for another."""
    kind = kind_of(gpu_name)
    if kind is None:
        raise ValueError(f"gpu.name {gpu_name!r} has no calibrated efficiency (calibrated: "
                         f"{', '.join(sorted(GPU_KINDS))}); declare gpu.efficiency, the share of its bf16 peak it "
                         "sustains on a large transformer (about 0.45 for an H100)")
    run = CALIBRATION_RUNS[kind]
    return Calibration(efficiency=fit_efficiency(run), source=f"fitted to {run.source}")


def predicted_step(run: PublishedRun, efficiency: float):  # -> Candidate
    """The planner's best layout for ``run``'s model, cluster and published layout at ``efficiency``."""
    from meridian.service.planning.planner import fitting_layouts

    cluster = run.cluster(efficiency)
    fits = fitting_layouts(run.request(), cluster.topology(), cluster.figures(efficiency), runtime=run.runtime)
    if not fits:
        raise ValueError(f"no layout of the published run fits in the model ({run.source})")
    return fits[0]


def fit_efficiency(run: PublishedRun) -> float:
    """The efficiency at which the planner's estimate of ``run`` reproduces its published throughput: the best
    layout is chosen at a first guess, the efficiency solved on it, and the layout chosen again until it stays."""
    efficiency = 0.5
    for _ in range(4):
        best = predicted_step(run, efficiency)
        lo, hi = 0.01, 1.0
        for _ in range(60):  # throughput rises with the efficiency: bisect
            mid = (lo + hi) / 2
            fig = run.cluster(mid).figures(mid)
            step = estimate(run.shape, best.layout, fig, run.global_batch).step_s
            lo, hi = (mid, hi) if run.throughput(step) < run.published else (lo, mid)
        if abs(lo - efficiency) < 1e-6:
            break
        efficiency = lo
    if efficiency >= 0.99:
        raise ValueError(f"the cost model cannot reproduce {run.source} at any efficiency up to the peak")
    return efficiency
