"""What model a job trains: the architecture family, its shape, and the named presets; torch-free.

Part of the frozen configuration that crosses the service → workers boundary
(:mod:`meridian.workers.contracts.config`); the parameter and FLOP formulas here feed the planner's cost model.
Besides Meridian's own two families, a job trains a Hugging Face causal LM (``hf``: its ``config.json`` travels
in :attr:`ModelConfig.hf_config`) or an operator-allowed factory's module (``factory``); the shape fields then
hold what admission read of them (:mod:`meridian.workers.contracts.hf_config`,
:mod:`meridian.service.model_access`).
"""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass

from meridian.workers.contracts.fields import check_bounds, knob
from meridian.workers.contracts.hf_shape import shape_of_json
from meridian.workers.contracts.model_shape import MlpKind, ModelShape, NormKind


class ModelFamily(str, enum.Enum):
    """The architecture a :class:`ModelConfig` describes (:func:`meridian.workers.model.build.build_model`)."""

    GPT = "gpt"  # GPT-2 shape: pre-LayerNorm, GELU MLP, learned positions, untied head, biases
    LLAMA = "llama"  # RMSNorm, RoPE, SwiGLU MLP, grouped-query attention, no biases, optionally tied head
    HF = "hf"  # a transformers AutoModelForCausalLM, built from its config.json (ModelConfig.hf_config)
    FACTORY = "factory"  # the nn.Module of a factory the operator allowed (ModelConfig.factory)

    @property
    def is_builtin(self) -> bool:
        """Meridian's own modules (gpt, llama), the ones Meridian's pipeline stages can cut."""
        return self in (ModelFamily.GPT, ModelFamily.LLAMA)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A decoder-only transformer of one :class:`ModelFamily` (``gpt``: GPT-2 shape; ``llama``: Llama shape;
    ``hf``: a Hugging Face causal LM, whose shape fields admission read from its ``config.json``; ``factory``: an
    allowed factory's module, whose shape fields admission found on it)."""

    family: ModelFamily = ModelFamily.GPT
    """``gpt`` (GPT-2 shape), ``llama`` (RoPE, RMSNorm, SwiGLU, grouped-query attention), ``hf`` (transformers'
    module of ``hf_config``) or ``factory`` (the module ``factory`` returns)."""
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
    hf_config: str = ""
    """hf: the model's ``config.json`` as compact JSON with sorted keys, read when the job was admitted; the
    workers build it with transformers' ``AutoModelForCausalLM`` (and load ``init_from``'s weights into it)."""
    factory: str = ""
    """factory: ``module:function`` returning the ``nn.Module``, as admission resolved it (an entry point of the
    ``meridian.models`` group, or a function under a module allowed with ``meridian serve --model-module``)."""
    factory_args: str = ""
    """factory: the factory's keyword arguments as compact JSON with sorted keys (plain JSON values only)."""
    block: str = ""
    """factory: class name of the repeated transformer block; empty: found (the module's ``_no_split_modules``,
    else the ``nn.ModuleList`` of one class holding the most parameters)."""
    param_count: int = knob(0, ge=0, le=10**13)
    """factory: the parameters admission counted on the module (built on the meta device); 0 for the other
    families, whose count follows from their shape."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "family", ModelFamily(self.family))  # "llama" from a plain dict is fine too
        check_bounds(self, "model.")
        self._check_family_fields()
        if self.d_model % self.n_heads:
            raise ValueError(
                f"model.d_model ({self.d_model}) must be a multiple of model.n_heads ({self.n_heads})"
            )
        if self.family in (ModelFamily.GPT, ModelFamily.FACTORY):
            for name, value, default in (("n_kv_heads", self.n_kv_heads, None), ("ffn_hidden", self.ffn_hidden, None),
                                         ("tie_embeddings", self.tie_embeddings, False)):
                if value != default and not (name == "tie_embeddings" and self.family is ModelFamily.FACTORY):
                    raise ValueError(f"model.{name} applies to family 'llama' only (or to what an hf model's "
                                     f"config.json says); this model is {self.family.value!r}")
        elif self.n_heads % self.kv_heads:
            raise ValueError(
                f"model.n_heads ({self.n_heads}) must be a multiple of model.n_kv_heads ({self.kv_heads})"
            )
        if (self.d_model // self.n_heads) % 2 and self.family is ModelFamily.LLAMA:
            raise ValueError(f"model.d_model / model.n_heads ({self.d_model // self.n_heads}) must be even for RoPE")

    def _check_family_fields(self) -> None:
        """Each family's own fields are set, and only its own."""
        own = {ModelFamily.HF: ("hf_config",), ModelFamily.FACTORY: ("factory", "factory_args", "block",
                                                                      "param_count")}.get(self.family, ())
        for name in ("hf_config", "factory", "factory_args", "block", "param_count"):
            if name not in own and getattr(self, name):
                raise ValueError(f"model.{name} applies to family "
                                 f"{'hf' if name == 'hf_config' else 'factory'!r} only (this model is "
                                 f"{self.family.value!r})")
        if self.family is ModelFamily.HF and not self.hf_config:
            raise ValueError("model.hf_config: an hf model needs its config.json (give model.init_from or "
                             "model.config)")
        if self.family is ModelFamily.FACTORY:
            if not self.factory or not self.param_count:
                raise ValueError("model.factory: a factory model needs its resolved factory and its parameter "
                                 "count (admission fills both)")
            if self.init_from:
                raise ValueError("model.init_from loads Hugging Face checkpoints; a factory builds its own module")

    @property
    def architecture_key(self) -> str:
        """What, beyond the shape fields, says which module this is: a hash of an hf model's config.json or of a
        factory and its arguments (``""`` for the builtin families, whose fields say it all)."""
        if self.family is ModelFamily.HF:
            return hashlib.sha256(self.hf_config.encode()).hexdigest()[:16]
        if self.family is ModelFamily.FACTORY:
            return hashlib.sha256(f"{self.factory} {self.factory_args} {self.block}".encode()).hexdigest()[:16]
        return ""

    @property
    def kv_heads(self) -> int:
        """Key/value heads (``n_heads`` without grouped-query attention)."""
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def mlp_width(self) -> int:
        """Hidden size of the MLP (gpt: ``mlp_ratio × d_model``; llama: ``ffn_hidden`` or its default; hf: its
        ``intermediate_size``; factory: unknown to Meridian, ``mlp_ratio × d_model`` as the planner's guess)."""
        if self.family in (ModelFamily.GPT, ModelFamily.FACTORY):
            return self.mlp_ratio * self.d_model
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return -(-(8 * self.d_model // 3) // self.multiple_of) * self.multiple_of

    @property
    def shape(self) -> ModelShape:
        """This model's torch-free shape, what the planner reads (:mod:`meridian.workers.contracts.model_shape`)."""
        common = dict(n_layers=self.n_layers, hidden=self.d_model, n_heads=self.n_heads, head_dim=self.head_dim,
                      ffn_hidden=self.mlp_width, vocab_size=self.vocab_size, seq_len=self.seq_len)
        if self.family is ModelFamily.LLAMA:
            return ModelShape(**common, kv_heads=self.kv_heads, mlp=MlpKind.SWIGLU, norm=NormKind.RMSNORM,
                              tie_embeddings=self.tie_embeddings, name="llama")
        if self.family is ModelFamily.GPT:
            return ModelShape(**common, kv_heads=self.n_heads, mlp=MlpKind.GELU, norm=NormKind.LAYERNORM,
                              tie_embeddings=False, qkv_bias=True, out_bias=True, mlp_bias=True,
                              learned_positions=self.seq_len, name="gpt")
        if self.family is ModelFamily.HF:
            return ModelShape.from_hf_config(json.loads(self.hf_config), seq_len=self.seq_len)
        # a factory's module: what admission found on it; its parameter count is exact, the rest approximate
        return ModelShape(**common, kv_heads=self.kv_heads, mlp=MlpKind.GELU, norm=NormKind.LAYERNORM,
                          tie_embeddings=self.tie_embeddings, counted_params=self.param_count, name="factory")

    @property
    def num_params(self) -> int:
        """Exact parameter count of the family's model (:mod:`meridian.workers.model`) for this config."""
        if self.family is ModelFamily.HF:
            return shape_of_json(self.hf_config).num_params
        if self.family is ModelFamily.FACTORY:
            return self.param_count
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
        if self.family is not ModelFamily.GPT:  # a factory's embedding is its first nn.Embedding (admission's)
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
