"""What model a job trains: the architecture family, its shape, and the named presets; torch-free.

Part of the frozen configuration that crosses the service → workers boundary
(:mod:`meridian.workers.contracts.config`); the parameter and FLOP formulas here feed the planner's cost model.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from meridian.workers.contracts.fields import check_bounds, knob


class ModelFamily(str, enum.Enum):
    """The architecture a :class:`ModelConfig` describes (:func:`meridian.workers.model.build.build_model`)."""

    GPT = "gpt"  # GPT-2 shape: pre-LayerNorm, GELU MLP, learned positions, untied head, biases
    LLAMA = "llama"  # RMSNorm, RoPE, SwiGLU MLP, grouped-query attention, no biases, optionally tied head


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A decoder-only transformer of one :class:`ModelFamily` (``gpt``: GPT-2 shape; ``llama``: Llama shape)."""

    family: ModelFamily = ModelFamily.GPT
    """``gpt`` (GPT-2 shape) or ``llama`` (RoPE, RMSNorm, SwiGLU, grouped-query attention)."""
    n_layers: int = knob(ge=1, le=128)
    """Transformer blocks."""
    d_model: int = knob(ge=8, le=32768)
    """Hidden size; must divide by ``n_heads``."""
    n_heads: int = knob(ge=1, le=256)
    """Attention heads."""
    seq_len: int = knob(ge=8, le=32768)
    """Tokens per training sample (the context length)."""
    vocab_size: int = knob(256, ge=2, le=262144)
    """Byte-level tokens: every text file is valid input without a trained tokenizer."""
    mlp_ratio: int = knob(4, ge=1, le=64)
    """gpt: MLP hidden size as a multiple of ``d_model``."""
    n_kv_heads: int | None = knob(None, ge=1, le=256)
    """llama: key/value heads (grouped-query attention); must divide ``n_heads``. ``None``: ``n_heads``."""
    ffn_hidden: int | None = knob(None, ge=1, le=262144)
    """llama: SwiGLU hidden size. ``None``: 8/3 × ``d_model`` rounded up to a multiple of ``multiple_of``."""
    multiple_of: int = knob(256, ge=1, le=65536)
    """llama: the rounding of the default ``ffn_hidden``."""
    rope_theta: float = knob(10000.0, gt=0, le=1e9)
    """llama: base of the rotary position embedding's frequencies."""
    norm_eps: float = knob(1e-5, gt=0, le=1)
    """llama: epsilon of RMSNorm."""
    tie_embeddings: bool = False
    """llama: the output head shares the token embedding's weight."""
    init_from: str = ""
    """A local Hugging Face checkpoint directory (config.json + *.safetensors) whose weights the job starts
    from; empty: random initialisation from the job's seed."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "family", ModelFamily(self.family))  # "llama" from a plain dict is fine too
        check_bounds(self, "model.")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"model.d_model ({self.d_model}) must be a multiple of model.n_heads ({self.n_heads})"
            )
        if self.family is ModelFamily.GPT:
            for name, value, default in (("n_kv_heads", self.n_kv_heads, None), ("ffn_hidden", self.ffn_hidden, None),
                                         ("tie_embeddings", self.tie_embeddings, False)):
                if value != default:
                    raise ValueError(f"model.{name} applies to family 'llama' only (this model is 'gpt')")
        elif self.n_heads % self.kv_heads:
            raise ValueError(
                f"model.n_heads ({self.n_heads}) must be a multiple of model.n_kv_heads ({self.kv_heads})"
            )
        if (self.d_model // self.n_heads) % 2 and self.family is ModelFamily.LLAMA:
            raise ValueError(f"model.d_model / model.n_heads ({self.d_model // self.n_heads}) must be even for RoPE")

    @property
    def kv_heads(self) -> int:
        """Key/value heads (``n_heads`` without grouped-query attention)."""
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def mlp_width(self) -> int:
        """Hidden size of the MLP (gpt: ``mlp_ratio × d_model``; llama: ``ffn_hidden`` or its default)."""
        if self.family is ModelFamily.GPT:
            return self.mlp_ratio * self.d_model
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return -(-(8 * self.d_model // 3) // self.multiple_of) * self.multiple_of

    @property
    def num_params(self) -> int:
        """Exact parameter count of the family's model (:mod:`meridian.workers.model`) for this config."""
        d, v, t, h = self.d_model, self.vocab_size, self.seq_len, self.mlp_width
        if self.family is ModelFamily.LLAMA:
            kv = self.kv_heads * self.head_dim
            per_block = 2 * d + (d * d + 2 * d * kv + d * d) + 3 * d * h
            return v * d + self.n_layers * per_block + d + (0 if self.tie_embeddings else d * v)
        per_block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * h + h) + (h * d + d)
        return v * d + t * d + self.n_layers * per_block + 2 * d + d * v

    @property
    def flops_per_token(self) -> int:
        """Training FLOPs per token (forward + backward ≈ 3 × forward), PaLM appendix B convention: every
        parameter used in a matmul (the head included, tied or not; not the embedding lookups) costs 6."""
        if self.family is ModelFamily.LLAMA:
            matmul_params = self.num_params - (0 if self.tie_embeddings else self.vocab_size * self.d_model)
        else:
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
    # Llama family. ~1.0 M parameters: the CPU demo size.
    "llama-tiny": ModelConfig(family=ModelFamily.LLAMA, n_layers=5, d_model=128, n_heads=4, n_kv_heads=2,
                              ffn_hidden=384, seq_len=128),
    # ~150 M parameters (GPT-2-small width, GQA 12:4, 32k vocabulary).
    "llama-160m": ModelConfig(family=ModelFamily.LLAMA, n_layers=12, d_model=768, n_heads=12, n_kv_heads=4,
                              ffn_hidden=3072, seq_len=2048, vocab_size=32000),
    # Llama-3.2-1B's shape (tied embeddings, 128k vocabulary; context cut to 2048, no RoPE scaling).
    "llama-1b": ModelConfig(family=ModelFamily.LLAMA, n_layers=16, d_model=2048, n_heads=32, n_kv_heads=8,
                            ffn_hidden=8192, seq_len=2048, vocab_size=128256, rope_theta=500000.0,
                            tie_embeddings=True),
    # Llama-3-8B's shape.
    "llama3-8b": ModelConfig(family=ModelFamily.LLAMA, n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8,
                             ffn_hidden=14336, seq_len=8192, vocab_size=128256, rope_theta=500000.0),
}
