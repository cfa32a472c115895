"""What the training runtime can run: the one place the planner learns which layouts it may offer a job.

The planner models more layouts than the workers run today (FSDP sharding, sequence parallelism, activation
checkpointing, interleaved pipeline stages, bf16 compute weights): a layout that needs a feature missing here is
*plan-only*, estimated and shown by ``meridian plan`` but never offered to a job. As the training core lands a
feature (FSDP2, DTensor tensor/sequence parallelism, ``torch.distributed.pipelining``, activation checkpointing),
flip its flag in :data:`RUNTIME`; nothing else in the planner changes. Pure data: never imports torch or the
workers' engines.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from meridian.service.planning.cost_model import Layout, Recompute


@dataclass(frozen=True, kw_only=True)
class RuntimeSupport:
    """The layout features a training runtime runs (``False``: a layout that needs it is plan-only)."""

    fsdp: bool = False
    """Parameters, gradients and optimizer state sharded inside a datacenter (FSDP2 per block)."""
    sequence_parallel: bool = False
    """Sequence parallelism with tensor parallelism (norms and dropout split along the sequence; DTensor)."""
    activation_checkpointing: bool = False
    """Selective or full activation recomputation per block."""
    interleaved_pipeline: bool = False
    """More than one pipeline stage per device (interleaved 1F1B)."""
    bf16_weights: bool = False
    """Blocks compute with bf16 copies of the weights (FSDP2 ``MixedPrecisionPolicy``), so activations are saved
    at 16 bits; without it the weights stay fp32 under autocast."""
    tied_embeddings_across_stages: bool = False
    """A tied output head on a pipeline's last stage (its weight kept in step with the first stage's embedding)."""


RUNTIME = RuntimeSupport(fsdp=True, sequence_parallel=True, activation_checkpointing=True, interleaved_pipeline=True,
                         bf16_weights=True)
"""Today's training core (:mod:`meridian.workers.parallel`): FSDP2 per block inside each datacenter under the
hierarchical engine, DTensor tensor and sequence parallelism, ``torch.distributed.pipelining`` (GPipe, 1F1B,
interleaved 1F1B), activation checkpointing per block, bf16 compute weights through FSDP2's policy. A tied head
on a pipeline's last stage is not run (``ParallelConfig`` refuses tied embeddings with pp > 1)."""

def current_runtime() -> RuntimeSupport:
    """:data:`RUNTIME` as it is now (read at each call, so a test may set the module's ``RUNTIME``)."""
    return RUNTIME


EVERYTHING = RuntimeSupport(**{f.name: True for f in fields(RuntimeSupport)})
"""Every feature the planner models: what ``meridian plan`` searches for plan-only layouts."""

FEATURE_WORDS = {
    "fsdp": "FSDP sharding of parameters and gradients",
    "sequence_parallel": "sequence parallelism",
    "activation_checkpointing": "activation checkpointing",
    "interleaved_pipeline": "interleaved pipeline stages",
    "bf16_weights": "bf16 compute weights",
    "tied_embeddings_across_stages": "a tied head across pipeline stages",
}
"""Each feature in the words a plan uses for it."""


def needs(lay: Layout, *, tied_embeddings: bool) -> tuple[str, ...]:
    """The features (names of :class:`RuntimeSupport` fields) running ``lay`` takes."""
    wanted = {
        "fsdp": lay.fsdp,
        "sequence_parallel": lay.sequence_parallel,
        "activation_checkpointing": lay.recompute is not Recompute.NONE,
        "interleaved_pipeline": lay.virtual_stages > 1,
        "bf16_weights": lay.bf16_weights,
        "tied_embeddings_across_stages": tied_embeddings and lay.pp > 1,
    }
    return tuple(name for name, used in wanted.items() if used)


def missing(lay: Layout, support: RuntimeSupport | None = None, *, tied_embeddings: bool = False) -> tuple[str, ...]:
    """The features ``lay`` needs that ``support`` (default: :data:`RUNTIME`) lacks: empty when it can run it."""
    support = support or current_runtime()
    return tuple(name for name in needs(lay, tied_embeddings=tied_embeddings) if not getattr(support, name))


def missing_words(names: tuple[str, ...]) -> str:
    """'sequence parallelism and activation checkpointing'."""
    words = [FEATURE_WORDS[n] for n in names]
    return ", ".join(words[:-1]) + (" and " if len(words) > 1 else "") + words[-1] if words else ""
