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
        """Exact parameter count of :class:`meridian.workers.model.GPT` for this config."""
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
    """Emulated inter-datacenter link (see :mod:`meridian.workers.wan`)."""

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
    """Encoding of the inter-DC step."""

    def __post_init__(self) -> None:
        _positive("sync.bucket_mb", self.bucket_mb)
        _positive("sync.inter_dc_chunk_mb", self.inter_dc_chunk_mb)
        if self.strategy is SyncStrategy.FLAT and self.compression is not Compression.NONE:
            raise ValueError("sync.compression applies to the inter-DC step of 'hierarchical' sync only")


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
        if self.datacenters and len(self.datacenters) > self.global_batch:
            raise ValueError(
                f"training.global_batch ({self.global_batch}) must be at least the number of workers "
                f"({len(self.datacenters)}) so every worker gets a sample"
            )

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
        data["sync"] = SyncConfig(**sync)
        data["wan"] = WanConfig(**data["wan"]) if data.get("wan") else None
        data["precision"] = Precision(data.get("precision", "fp32"))
        data["datacenters"] = tuple(data.get("datacenters", ()))
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
    "MODEL_PRESETS",
    "ModelConfig",
    "OptimConfig",
    "Precision",
    "SyncConfig",
    "SyncStrategy",
    "TrainConfig",
    "WanConfig",
    "model_preset",
]
