"""The shape of a decoder-only transformer as the planner reads it: sizes, parameter count, FLOPs; torch-free.

Built from a :class:`~meridian.workers.contracts.model_config.ModelConfig` (what Meridian trains) with
:meth:`ModelShape.of`, or from a Hugging Face ``config.json`` object with :meth:`ModelShape.from_hf_config` (any
model the planner is asked about, whether this runtime can train it or not). The planner's memory and time model
(:mod:`meridian.service.planning.cost_model`) reads nothing else of a model. This module never imports torch and
never reads a file: callers pass the parsed JSON.
"""

from __future__ import annotations

import enum
import reprlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meridian.workers.contracts.model_config import ModelConfig



class MlpKind(str, enum.Enum):
    """The feed-forward block of every layer."""

    GELU = "gelu"  # up, GELU, down (GPT-2, GPT-NeoX, Megatron's GPT)
    SWIGLU = "swiglu"  # gate and up, SiLU(gate) * up, down (Llama, Mistral, Qwen2)
    SQUARED_RELU = "squared_relu"  # up, ReLU(x)^2, down (Nemotron-4)

    @property
    def gated(self) -> bool:
        """Two input projections (gate and up) instead of one."""
        return self is MlpKind.SWIGLU

    @property
    def saved_tensors(self) -> int:
        """Tensors of the MLP's width a layer keeps for backward: the up projection's output and the activation's
        (non-gated), or gate, up, SiLU(gate) and their product (gated)."""
        return 4 if self.gated else 2


class NormKind(str, enum.Enum):
    LAYERNORM = "layernorm"  # weight and bias
    RMSNORM = "rmsnorm"  # weight only


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A decoder-only transformer's sizes: everything the planner's memory and time model needs."""

    n_layers: int
    """Transformer blocks."""
    hidden: int
    """Width of the residual stream (``d_model``)."""
    n_heads: int
    """Query heads."""
    kv_heads: int
    """Key/value heads (grouped-query attention); ``n_heads`` without it."""
    head_dim: int
    """Width of one head (usually ``hidden / n_heads``)."""
    ffn_hidden: int
    """Width of the MLP's hidden layer."""
    mlp: MlpKind
    """The MLP's kind: gated (SwiGLU) or not (GELU, squared ReLU)."""
    norm: NormKind
    """LayerNorm (weight and bias) or RMSNorm (weight)."""
    vocab_size: int
    """Tokens of the vocabulary (rows of the embedding and of the output head)."""
    tie_embeddings: bool
    """The output head is the token embedding's weight."""
    seq_len: int
    """Tokens per training sample."""
    qkv_bias: bool = False
    """The query, key and value projections have biases."""
    out_bias: bool = False
    """The attention's output projection has a bias."""
    mlp_bias: bool = False
    """The MLP's projections have biases."""
    learned_positions: int = 0
    """Rows of a learned position embedding (GPT-2); 0 for rotary positions."""
    qk_norm: bool = False
    """A per-head RMSNorm on queries and on keys (Qwen3)."""
    counted_params: int = 0
    """The parameters counted on the module itself, for a module whose structure the fields above only approximate
    (a user's factory); 0: counted from the fields."""
    name: str = ""
    """What the shape came from (a preset, a ``model_type``), for the plan's words."""

    def __post_init__(self) -> None:
        for key in ("n_layers", "hidden", "n_heads", "kv_heads", "head_dim", "ffn_hidden", "vocab_size", "seq_len"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model.{key} must be a whole number >= 1, got {reprlib.repr(value)}")
        if self.learned_positions < 0:
            raise ValueError(f"model.learned_positions must be >= 0, got {self.learned_positions}")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"model.n_heads ({self.n_heads}) must be a multiple of the key/value heads "
                             f"({self.kv_heads})")
        object.__setattr__(self, "mlp", MlpKind(self.mlp))
        object.__setattr__(self, "norm", NormKind(self.norm))

    # -- parameters ---------------------------------------------------------------------------------------
    @property
    def attention_width(self) -> int:
        """Width of all query heads together (``n_heads x head_dim``)."""
        return self.n_heads * self.head_dim

    @property
    def norm_params(self) -> int:
        """Parameters of one norm."""
        return self.hidden * (2 if self.norm is NormKind.LAYERNORM else 1)

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one block's matrix multiplications (q, k, v, out, and the MLP's projections)."""
        h, q, kv, f = self.hidden, self.attention_width, self.kv_heads * self.head_dim, self.ffn_hidden
        return h * q + 2 * h * kv + q * h + (3 if self.mlp.gated else 2) * h * f

    @property
    def layer_params(self) -> int:
        """Every parameter of one transformer block."""
        q, kv, f = self.attention_width, self.kv_heads * self.head_dim, self.ffn_hidden
        biases = ((q + 2 * kv) if self.qkv_bias else 0) + (self.hidden if self.out_bias else 0)
        if self.mlp_bias:
            biases += (2 if self.mlp.gated else 1) * f + self.hidden
        return self.layer_matmul_params + biases + 2 * self.norm_params + (2 * self.head_dim if self.qk_norm else 0)

    @property
    def embedding_params(self) -> int:
        """The first stage's parameters outside the blocks: token (and learned position) embeddings."""
        return (self.vocab_size + self.learned_positions) * self.hidden

    @property
    def head_params(self) -> int:
        """The last stage's parameters outside the blocks: the final norm and an untied output head."""
        return self.norm_params + (0 if self.tie_embeddings else self.hidden * self.vocab_size)

    @property
    def num_params(self) -> int:
        """Every parameter of the model (a tied head counted once)."""
        if self.counted_params:
            return self.counted_params
        return self.embedding_params + self.n_layers * self.layer_params + self.head_params

    # -- FLOPs --------------------------------------------------------------------------------------------
    @property
    def layer_forward_flops_per_token(self) -> int:
        """One block's forward FLOPs per token: 2 per matmul weight, and the attention scores and their product
        with the values (2 x 2 x seq_len x attention width; causal masking not subtracted, as PaLM counts)."""
        return 2 * self.layer_matmul_params + 4 * self.seq_len * self.attention_width

    @property
    def attention_core_flops_per_token(self) -> int:
        """The part of :attr:`layer_forward_flops_per_token` that selective recomputation does again in backward
        (scores, softmax, their product with the values)."""
        return 4 * self.seq_len * self.attention_width

    @property
    def head_forward_flops_per_token(self) -> int:
        """The output head's forward FLOPs per token (the logits; tied or not)."""
        return 2 * self.hidden * self.vocab_size

    @property
    def flops_per_token(self) -> int:
        """Training FLOPs per token without recomputation (forward + backward = 3 x forward), PaLM appendix B's
        convention: 6 per parameter used in a matmul (the head included, the embedding lookups not) and
        12 x layers x seq_len x attention width for attention. Model FLOPs: what MFU divides."""
        matmul_params = self.num_params - self.embedding_params + (self.vocab_size * self.hidden if self.tie_embeddings else 0)
        return 6 * matmul_params + 12 * self.n_layers * self.seq_len * self.attention_width

    # -- builders -----------------------------------------------------------------------------------------
    @classmethod
    def of(cls, cfg: ModelConfig) -> ModelShape:
        """The shape of a model Meridian trains (:attr:`ModelConfig.shape`)."""
        return cfg.shape

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], *, seq_len: int | None = None, where: str = "model.hf_config") -> ModelShape:
        """The shape of the model a Hugging Face ``config.json`` describes (``model_type`` one of
        :data:`HF_MODEL_TYPES`); ``seq_len`` replaces its ``max_position_embeddings``. A key that is missing or
        wrong is a ``ValueError`` naming it (``where.key``)."""
        if not isinstance(hf, dict):
            raise ValueError(f"{where} must be the JSON object of a config.json, got a {type(hf).__name__}")
        model_type = hf.get("model_type")
        if model_type not in HF_MODEL_TYPES:
            raise ValueError(f"{where}.model_type is {reprlib.repr(model_type)}; the planner knows "
                             f"{', '.join(sorted(HF_MODEL_TYPES))}")
        read = _Keys(hf, where)
        if model_type == "gpt2":
            hidden = read.whole("n_embd")
            positions = read.whole("n_positions", 1024)
            return cls(n_layers=read.whole("n_layer"), hidden=hidden, n_heads=read.whole("n_head"),
                       kv_heads=read.whole("n_head"), head_dim=read.divides(hidden, "n_head"),
                       ffn_hidden=read.whole("n_inner", 4 * hidden), mlp=MlpKind.GELU, norm=NormKind.LAYERNORM,
                       vocab_size=read.whole("vocab_size"), tie_embeddings=read.flag("tie_word_embeddings", True),
                       seq_len=seq_len or positions, qkv_bias=True, out_bias=True, mlp_bias=True,
                       learned_positions=positions, name="gpt2")
        hidden, heads = read.whole("hidden_size"), read.whole("num_attention_heads")
        common: dict[str, Any] = dict(
            n_layers=read.whole("num_hidden_layers"), hidden=hidden, n_heads=heads,
            head_dim=read.whole("head_dim", None) or read.divides(hidden, "num_attention_heads"),
            ffn_hidden=read.whole("intermediate_size"), vocab_size=read.whole("vocab_size"),
            seq_len=seq_len or read.whole("max_position_embeddings", 2048), name=model_type,
        )
        if model_type == "gpt_neox":
            bias = read.flag("attention_bias", True)
            return cls(**common, kv_heads=heads, mlp=MlpKind.GELU, norm=NormKind.LAYERNORM,
                       tie_embeddings=read.flag("tie_word_embeddings", False), qkv_bias=bias, out_bias=bias,
                       mlp_bias=True)
        kv = read.whole("num_key_value_heads", heads)
        if model_type == "nemotron":
            act = hf.get("hidden_act", "relu2")
            if act != "relu2":
                raise ValueError(f"{where}.hidden_act is {reprlib.repr(act)}; Nemotron's MLP is 'relu2' (squared ReLU)")
            bias = read.flag("attention_bias", False)
            return cls(**common, kv_heads=kv, mlp=MlpKind.SQUARED_RELU, norm=NormKind.LAYERNORM,
                       tie_embeddings=read.flag("tie_word_embeddings", False), qkv_bias=bias, out_bias=bias,
                       mlp_bias=read.flag("mlp_bias", False))
        if model_type == "qwen3":  # a norm on each head's queries and keys; head_dim 128 unless given
            bias = read.flag("attention_bias", False)
            return cls(**{**common, "head_dim": read.whole("head_dim", 128)}, kv_heads=kv, mlp=MlpKind.SWIGLU,
                       norm=NormKind.RMSNORM, tie_embeddings=read.flag("tie_word_embeddings", False), qkv_bias=bias,
                       out_bias=bias, qk_norm=True)
        if model_type == "qwen2":  # q, k and v have biases, the output projection none
            return cls(**common, kv_heads=kv, mlp=MlpKind.SWIGLU, norm=NormKind.RMSNORM,
                       tie_embeddings=read.flag("tie_word_embeddings", False), qkv_bias=True)
        bias = read.flag("attention_bias", False) if model_type == "llama" else False
        return cls(**common, kv_heads=kv, mlp=MlpKind.SWIGLU, norm=NormKind.RMSNORM,
                   tie_embeddings=read.flag("tie_word_embeddings", False), qkv_bias=bias, out_bias=bias,
                   mlp_bias=read.flag("mlp_bias", False) if model_type == "llama" else False)


HF_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gpt_neox", "gpt2", "nemotron"})
"""The ``model_type`` values :meth:`ModelShape.from_hf_config` reads."""


class _Keys:
    """Typed reads of a ``config.json`` object: a wrong value is a ``ValueError`` naming ``where.key``."""

    def __init__(self, hf: dict[str, Any], where: str) -> None:
        self.hf, self.where = hf, where

    def whole(self, key: str, default: Any = ...) -> Any:
        value = self.hf.get(key)
        if value is None:
            if default is ...:
                raise ValueError(f"{self.where} has no {key}, which a {self.hf.get('model_type')} config.json gives")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{self.where}.{key} must be a whole number >= 1, got {reprlib.repr(value)}")
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self.hf.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ValueError(f"{self.where}.{key} must be true or false, got {reprlib.repr(value)}")
        return value

    def divides(self, hidden: int, key: str) -> int:
        heads = self.whole(key)
        if hidden % heads:
            raise ValueError(f"{self.where}.{key} ({heads}) must divide the hidden size ({hidden}), or give head_dim")
        return hidden // heads
