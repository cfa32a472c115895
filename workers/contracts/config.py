"""The frozen configuration that crosses the service → workers boundary.

The HTTP edge validates a pydantic ``JobSpec``; the service turns it into a :class:`TrainConfig` and hands
that to every Ray Train worker. From here on nothing reads environment variables or loose dicts: every
knob the training loop obeys is a field below, checked once in ``__post_init__`` with a message naming it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any


class SyncStrategy(str, enum.Enum):
    """How gradients travel between data-parallel replicas."""

    FLAT = "flat"  # one all-reduce over every rank, as plain DDP does
    HIERARCHICAL = "hierarchical"  # reduce-scatter in DC → all-reduce shard across DCs → all-gather in DC
    DILOCO = "diloco"  # per-step HAR inside each DC; every H steps an outer Nesterov step across DCs
    STREAMING_DILOCO = "streaming-diloco"  # DiLoCo with fragments synced on a staggered, overlapped schedule

    @property
    def is_diloco(self) -> bool:
        return self in (SyncStrategy.DILOCO, SyncStrategy.STREAMING_DILOCO)


class Compression(str, enum.Enum):
    """Encoding of the inter-DC step only; intra-DC traffic always stays in full precision."""

    NONE = "none"
    BF16 = "bf16"
    INT8 = "int8"  # per-chunk absmax quantisation with error feedback


class Precision(str, enum.Enum):
    AUTO = "auto"  # bf16 where the device supports it, else fp32 (resolved on the worker)
    FP32 = "fp32"
    BF16 = "bf16"  # bf16 autocast for matmuls; parameters and optimizer state stay fp32


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A decoder-only transformer (GPT-2 shape: pre-LayerNorm, GELU MLP, learned positions)."""

    n_layers: int
    """Transformer blocks."""
    d_model: int
    """Hidden size; must divide by ``n_heads``."""
    n_heads: int
    """Attention heads."""
    seq_len: int
    """Tokens per training sample (the context length)."""
    vocab_size: int = 256
    """Byte-level tokens: every text file is valid input without a trained tokenizer."""
    mlp_ratio: int = 4
    """MLP hidden size as a multiple of ``d_model``."""

    def __post_init__(self) -> None:
        for f in ("n_layers", "d_model", "n_heads", "seq_len", "vocab_size", "mlp_ratio"):
            _positive(f"model.{f}", getattr(self, f))
        if self.d_model % self.n_heads:
            raise ValueError(
                f"model.d_model ({self.d_model}) must be a multiple of model.n_heads ({self.n_heads})"
            )

    @property
    def num_params(self) -> int:
        """Exact parameter count of :class:`meridian.workers.model.gpt.GPT` for this config."""
        d, v, t, h = self.d_model, self.vocab_size, self.seq_len, self.mlp_ratio * self.d_model
        per_block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * h + h) + (h * d + d)
        return v * d + t * d + self.n_layers * per_block + 2 * d + d * v

    @property
    def flops_per_token(self) -> int:
        """Training FLOPs per token (forward + backward ≈ 3 × forward), PaLM appendix B convention."""
        matmul_params = self.num_params - self.vocab_size * self.d_model - self.seq_len * self.d_model
        attention = self.n_layers * 2 * self.seq_len * self.d_model
        return 6 * matmul_params + 6 * attention


def model_preset(name: str) -> ModelConfig:
    """Named model sizes shared by the API, the demo, the benchmarks and the tests."""
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(MODEL_PRESETS)}") from None


MODEL_PRESETS: dict[str, ModelConfig] = {
    # ~0.1 M parameters: unit tests and CI integration runs.
    "nano": ModelConfig(n_layers=2, d_model=64, n_heads=4, seq_len=64),
    # ~0.8 M parameters: the demo and the sync benchmark on a 2-core CPU machine.
    "tiny": ModelConfig(n_layers=4, d_model=128, n_heads=4, seq_len=128),
    # ~3.3 M parameters: a heavier CPU benchmark.
    "small": ModelConfig(n_layers=6, d_model=256, n_heads=8, seq_len=128),
    # GPU-sized presets for real workstations.
    "gpt2-124m": ModelConfig(n_layers=12, d_model=768, n_heads=12, seq_len=1024, vocab_size=50304),
    "gpt2-350m": ModelConfig(n_layers=24, d_model=1024, n_heads=16, seq_len=1024, vocab_size=50304),
}


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the training text comes from."""

    source: str = "builtin:python-reference"
    """``builtin:python-reference`` (the Python Language Reference shipped with every CPython as
    ``pydoc_data.topics``) or an absolute path to a UTF-8 text file readable on every node."""
    max_bytes: int = 8_000_000
    """Read at most this many bytes of the source (keeps start-up fast on big files)."""

    def __post_init__(self) -> None:
        if not self.source:
            raise ValueError("data.source must not be empty")
        _positive("data.max_bytes", self.max_bytes)


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW with linear warm-up and cosine decay."""

    lr: float = 1e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of ``lr``."""
    warmup_steps: int = 10
    """Steps of linear warm-up from 0 to ``lr``."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only (not to biases, norms)."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""

    def __post_init__(self) -> None:
        _positive("training.lr", self.lr)
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"training.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps < 0:
            raise ValueError(f"training.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.weight_decay < 0:
            raise ValueError(f"training.weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"training.{name} must be in [0, 1), got {getattr(self, name)}")
        _positive("training.eps", self.eps)
        if self.grad_clip < 0:
            raise ValueError(f"training.grad_clip must be >= 0, got {self.grad_clip}")


@dataclass(frozen=True, kw_only=True)
class WanConfig:
    """Emulated inter-datacenter link (see :mod:`meridian.workers.wan.collectives`)."""

    rtt_ms: float
    """Round-trip time between datacenters; each message pays RTT/2 one way."""
    gbps: float
    """Link bandwidth per direction between two datacenters, shared by all their ranks."""

    def __post_init__(self) -> None:
        if self.rtt_ms < 0:
            raise ValueError(f"wan.rtt_ms must be >= 0, got {self.rtt_ms}")
        _positive("wan.gbps", self.gbps)

    @property
    def one_way_s(self) -> float:
        return self.rtt_ms / 2000.0

    @property
    def bytes_per_s(self) -> float:
        return self.gbps * 1e9 / 8.0


@dataclass(frozen=True, kw_only=True)
class DiLoCoConfig:
    """DiLoCo (Douillard et al. 2023, arXiv:2311.08105) and its streaming variant (Douillard et al. 2025,
    arXiv:2501.18512). Defaults are the papers': H in the hundreds on real models, outer Nesterov with lr 0.7
    and momentum 0.9; a smaller H here because CPU runs are short."""

    inner_steps: int = 50
    """H: inner optimizer steps between two syncs of the same parameters across DCs."""
    fragments: int = 1
    """Streaming: the parameters are cut into this many fragments (groups of whole buckets, so whole
    parameters), each synced once per H steps at its own offset. 1 is plain DiLoCo."""
    outer_lr: float = 0.7
    """Learning rate of the outer SGD step on the averaged parameter delta (1 with no momentum: plain
    averaging of the DC replicas)."""
    outer_momentum: float = 0.9
    """Nesterov momentum of the outer step; 0 disables momentum."""
    nesterov: bool = True
    """Nesterov (the papers' choice) or heavy-ball momentum."""
    overlap_steps: int = 0
    """Streaming: inner steps a fragment's all-reduce stays in flight before it is applied (tau)."""
    mix_alpha: float = 0.5
    """Streaming with overlap: the fragment becomes ``alpha * local + (1 - alpha) * outer`` when the
    all-reduce lands (the paper's merge); ignored when ``overlap_steps`` is 0."""

    def __post_init__(self) -> None:
        if self.inner_steps < 1:
            raise ValueError(f"sync.diloco.inner_steps (H) must be >= 1, got {self.inner_steps}")
        if self.fragments < 1:
            raise ValueError(f"sync.diloco.fragments must be >= 1, got {self.fragments}")
        if self.fragments > self.inner_steps:
            raise ValueError(
                f"sync.diloco.fragments ({self.fragments}) must be <= inner_steps ({self.inner_steps}): each "
                "fragment needs its own step in the H-step cycle; raise inner_steps or lower fragments"
            )
        _positive("sync.diloco.outer_lr", self.outer_lr)
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"sync.diloco.outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if self.overlap_steps < 0:
            raise ValueError(f"sync.diloco.overlap_steps must be >= 0, got {self.overlap_steps}")
        spacing = self.inner_steps // self.fragments
        if self.overlap_steps >= spacing:
            raise ValueError(
                f"sync.diloco.overlap_steps ({self.overlap_steps}) must be < inner_steps // fragments "
                f"({spacing}) so a fragment's sync lands before its next one starts; lower overlap_steps or "
                "raise inner_steps"
            )
        if not 0 <= self.mix_alpha <= 1:
            raise ValueError(f"sync.diloco.mix_alpha must be in [0, 1], got {self.mix_alpha}")


@dataclass(frozen=True, kw_only=True)
class SyncConfig:
    """The gradient-sync engine's knobs."""

    strategy: SyncStrategy = SyncStrategy.HIERARCHICAL
    bucket_mb: float = 4.0
    """Gradients are reduced in buckets of about this many MiB (fp32)."""
    shard_optimizer: bool = True
    """Partial distributed optimizer: AdamW state sharded inside a DC, replicated across DCs."""
    overlap: bool = True
    """Start each bucket's sync from autograd hooks while backward still runs."""
    inter_dc_chunk_mb: float = 1.0
    """The inter-DC all-reduce of a shard is split in chunks of this size, all in flight together."""
    compression: Compression = Compression.NONE
    """Encoding of the inter-DC step (for the DiLoCo strategies: of the outer parameter delta)."""
    diloco: DiLoCoConfig | None = None
    """Knobs of the ``diloco`` / ``streaming-diloco`` strategies; ``None`` takes :class:`DiLoCoConfig`'s
    defaults for them and is required for the others."""

    def __post_init__(self) -> None:
        _positive("sync.bucket_mb", self.bucket_mb)
        _positive("sync.inter_dc_chunk_mb", self.inter_dc_chunk_mb)
        if self.strategy is SyncStrategy.FLAT and self.compression is not Compression.NONE:
            raise ValueError("sync.compression applies to the inter-DC step of 'hierarchical' sync only")
        if self.strategy is SyncStrategy.DILOCO and self.diloco is not None and (
            self.diloco.fragments != 1 or self.diloco.overlap_steps
        ):
            raise ValueError(
                "sync.diloco.fragments > 1 or overlap_steps > 0 is streaming DiLoCo: set sync.strategy to "
                "'streaming-diloco'"
            )
        if self.diloco is not None and not self.strategy.is_diloco:
            raise ValueError(
                f"sync.diloco is set but sync.strategy is {self.strategy.value!r}; use 'diloco' or "
                "'streaming-diloco', or drop sync.diloco"
            )

    @property
    def outer(self) -> DiLoCoConfig:
        """The DiLoCo knobs in force (defaults for the strategy when none were given)."""
        if self.diloco is not None:
            return self.diloco
        if self.strategy is SyncStrategy.STREAMING_DILOCO:
            return DiLoCoConfig(fragments=4, overlap_steps=1)
        return DiLoCoConfig()


class PipelineSchedule(str, enum.Enum):
    """Order of micro-batch forwards and backwards on a pipeline stage."""

    GPIPE = "gpipe"  # every forward, then every backward: pp micro-batches' worth of bubble, m activations kept
    ONE_F_ONE_B = "1f1b"  # warm-up forwards, then one forward / one backward: same bubble, <= pp activations


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Model parallelism of every replica (:mod:`meridian.workers.parallel.dims` turns it into process groups).

    World ranks are ordered (pipeline stage, data-parallel replica, tensor-parallel rank), tensor-parallel
    fastest, the order the planner places them in."""

    tp: int = 1
    """Tensor-parallel size: ranks of one node that split every attention and MLP layer (Megatron-style)."""
    pp: int = 1
    """Pipeline stages: consecutive groups of transformer blocks, micro-batches flowing between them."""
    schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    """Pipeline schedule (ignored with ``pp=1``)."""

    def __post_init__(self) -> None:
        _positive("parallelism.tp", self.tp)
        _positive("parallelism.pp", self.pp)

    @property
    def model_parallel(self) -> int:
        """Ranks holding one replica of the model."""
        return self.tp * self.pp

    def check(self, model: ModelConfig, world: int) -> None:
        """Raise ``ValueError`` naming the field when ``model`` cannot be split this way over ``world`` ranks."""
        if model.n_heads % self.tp:
            raise ValueError(f"parallelism.tp ({self.tp}) must divide model.n_heads ({model.n_heads})")
        if (model.mlp_ratio * model.d_model) % self.tp:
            raise ValueError(
                f"parallelism.tp ({self.tp}) must divide the MLP width ({model.mlp_ratio * model.d_model})"
            )
        if self.pp > model.n_layers:
            raise ValueError(f"parallelism.pp ({self.pp}) must be <= model.n_layers ({model.n_layers})")
        if world % self.model_parallel:
            raise ValueError(
                f"{world} workers cannot be split into replicas of tp × pp = {self.tp} × {self.pp} ranks"
            )


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything a worker needs to train one job. Built by the service, read by every rank."""

    job_id: str
    model: ModelConfig
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    wan: WanConfig | None = None
    """Emulate a WAN between datacenters; ``None`` leaves the links as they are."""
    steps: int
    """Optimizer steps to run."""
    global_batch: int
    """Samples per optimizer step, summed over every data-parallel rank."""
    micro_batch: int
    """Samples per forward/backward on one rank; more samples per rank are accumulated."""
    seed: int = 0
    precision: Precision = Precision.FP32
    checkpoint_every: int = 0
    """Write a durable checkpoint every N steps (0: only at the end)."""
    checkpoint_dir: str = ""
    """Directory for durable checkpoints; empty disables them."""
    datacenters: tuple[str, ...] = ()
    """Datacenter of each world rank, in rank order (the plan's placement)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Tensor and pipeline parallelism inside each data-parallel replica."""

    def __post_init__(self) -> None:
        _positive("training.steps", self.steps)
        _positive("training.global_batch", self.global_batch)
        _positive("training.micro_batch", self.micro_batch)
        if self.micro_batch > self.global_batch:
            raise ValueError(
                f"training.micro_batch ({self.micro_batch}) must be <= training.global_batch ({self.global_batch})"
            )
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")
        replicas = len(self.datacenters) // self.parallel.model_parallel
        if self.datacenters and replicas > self.global_batch:
            raise ValueError(
                f"training.global_batch ({self.global_batch}) must be at least the number of data-parallel "
                f"replicas ({replicas}) so every replica gets a sample"
            )
        if self.datacenters:
            self.parallel.check(self.model, len(self.datacenters))
        if self.parallel.pp > 1 and self.sync.strategy is SyncStrategy.FLAT:
            # DDP decides in each forward whether the next backward syncs; a pipeline schedule runs several
            # forwards before their backwards, which DDP cannot follow.
            raise ValueError("sync.strategy 'flat' cannot run with parallelism.pp > 1; use 'hierarchical'")

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.model.seq_len

    def to_dict(self) -> dict[str, Any]:
        return to_plain(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        data = dict(data)
        data["model"] = ModelConfig(**data["model"])
        data["data"] = DataConfig(**data.get("data", {}))
        data["optim"] = OptimConfig(**data.get("optim", {}))
        sync = dict(data.get("sync", {}))
        if "strategy" in sync:
            sync["strategy"] = SyncStrategy(sync["strategy"])
        if "compression" in sync:
            sync["compression"] = Compression(sync["compression"])
        if sync.get("diloco"):
            sync["diloco"] = DiLoCoConfig(**sync["diloco"])
        data["sync"] = SyncConfig(**sync)
        data["wan"] = WanConfig(**data["wan"]) if data.get("wan") else None
        data["precision"] = Precision(data.get("precision", "fp32"))
        data["datacenters"] = tuple(data.get("datacenters", ()))
        par = dict(data.get("parallel", {}))
        if "schedule" in par:
            par["schedule"] = PipelineSchedule(par["schedule"])
        data["parallel"] = ParallelConfig(**par)
        return cls(**data)


def to_plain(obj: Any) -> Any:
    if is_dataclass(obj):
        return {f.name: to_plain(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, tuple | list):
        return [to_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj


__all__ = [
    "Compression",
    "DataConfig",
    "DiLoCoConfig",
    "MODEL_PRESETS",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "PipelineSchedule",
    "Precision",
    "SyncConfig",
    "SyncStrategy",
    "TrainConfig",
    "WanConfig",
    "model_preset",
]
