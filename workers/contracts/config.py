"""The frozen configuration that crosses the service → workers boundary.

The HTTP edge validates a pydantic ``JobSpec``; the service turns it into a :class:`TrainConfig` and hands
that object (pickled by Ray, never a dict) to the job's runner and every Ray Train worker. From here on
nothing reads environment variables or loose dicts: every knob the training loop obeys is a field below,
with its default and bounds declared once (:func:`~meridian.workers.contracts.fields.knob`) and checked in
``__post_init__`` with a message naming it; the HTTP schema reads the same declarations.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar

from meridian.workers.contracts.fields import check_bounds, default_of, knob
from meridian.workers.contracts.hf_shape import FAMILIES, shape_of_json
from meridian.workers.contracts.model_config import ModelConfig, ModelFamily
from meridian.workers.contracts.tracking import TrackingConfig


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
    INT4 = "int4"  # per-128-element absmax, 4 bits, error feedback (meant for DiLoCo's outer deltas)


class FinalAverage(str, enum.Enum):
    """Whether a DiLoCo job's datacenters average their weights at its last step, and in which encoding."""

    OFF = "off"
    FP32 = "fp32"
    BF16 = "bf16"
    INT8 = "int8"
    INT4 = "int4"

    @property
    def compression(self) -> Compression | None:
        """The inter-DC encoding of the average's deltas; ``None`` when off."""
        return None if self is FinalAverage.OFF else \
            Compression.NONE if self is FinalAverage.FP32 else Compression(self.value)  # fmt: skip


class OuterMerge(str, enum.Enum):
    """What a fragment's weights become when its outer sync lands ``overlap_steps`` inner steps after it started."""

    KEEP_PROGRESS = "keep-progress"
    """The new outer weights plus what this replica trained while the sync was in flight:
    ``theta <- outer + (theta - theta_at_start)``, plain DiLoCo applied late. Opt-in: how its loss compares with
    ``mix`` depends on the steps and their size (``docs/benchmarks/history.md``, the DiLoCo runs)."""
    MIX = "mix"
    """Streaming DiLoCo's merge (Douillard et al. 2025, arXiv:2501.18512), the default: ``theta <- alpha * theta +
    (1 - alpha) * outer`` with ``alpha = mix_alpha``."""


class Precision(str, enum.Enum):
    AUTO = "auto"  # bf16 where the device supports it, else fp32 (resolved on the worker)
    FP32 = "fp32"
    BF16 = "bf16"  # bf16 autocast for matmuls; parameters and optimizer state stay fp32


@dataclass(frozen=True, kw_only=True)
class BlendEntry:
    """One prepared dataset of a blend and its share of the samples."""

    dataset: str
    """Absolute path of a directory written by ``meridian data prepare``, or its URL (see ``data.dataset``)."""
    weight: float = knob(1.0, gt=0, le=1e6)
    """Relative share of the samples (weights are normalised over the blend)."""

    def __post_init__(self) -> None:
        check_bounds(self, "data.blend.")
        _check_dataset_path(self.dataset, "data.blend.dataset")


@dataclass(frozen=True, kw_only=True)
class DataPin:
    """What the service found at one of a job's data paths when it admitted the job. The workers refuse data
    that differs (a dataset prepared again in place, a text file rewritten): the sample order is a function of
    the data, so a worker that rebuilt it later (a recovery, a newcomer, a resume) would otherwise repeat or skip
    samples, or read ids of another tokenizer, without a word."""

    path: str
    """The admitted (real) path: a prepared dataset's directory, or the text ``source``."""
    manifest_key: str = ""
    """A prepared dataset's ``manifest.json`` key (the hash of its inputs and options)."""
    tokenizer_sha256: str = ""
    """A prepared dataset's tokenizer hash, as its manifest gives it."""
    sha256: str = ""
    """A text ``source``: the SHA-256 of the bytes the job reads (its first ``max_bytes``)."""


def _check_dataset_path(path: str, name: str) -> None:
    if "://" in path:
        return  # a URL: the service admits it only under a root its operator declared
    if not path or not path.startswith("/"):
        raise ValueError(f"{name} must be the absolute path of a prepared dataset directory, or its URL "
                         f"(s3://bucket/prefix, file:///path), got {path!r}")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the training text comes from."""

    source: str = "builtin:python-reference"
    """``builtin:python-reference`` (the Python Language Reference shipped with every CPython as
    ``pydoc_data.topics``) or an absolute path to a UTF-8 text file readable on every node."""
    max_bytes: int = knob(8_000_000, ge=1024, le=10**10)
    """Read at most this many bytes of the source (keeps start-up fast on big files)."""
    dataset: str = ""
    """Absolute path of a dataset written by ``meridian data prepare`` (memory-mapped token shards), or its URL
    (``s3://bucket/prefix``, ``file:///path``, under a root the service declares), which each node copies into its
    cache and checks against the manifest's hashes; when set it replaces ``source``."""
    blend: tuple[BlendEntry, ...] = ()
    """Several prepared datasets mixed by weight (instead of ``dataset``)."""
    pins: tuple[DataPin, ...] = ()
    """Set by the service when it admits the job (whatever was sent is replaced): what each data path held
    then. The workers refuse a dataset or text that has changed since."""

    def __post_init__(self) -> None:
        if not self.source:
            raise ValueError("data.source must not be empty")
        check_bounds(self, "data.")
        if self.dataset and self.blend:
            raise ValueError("data.dataset and data.blend are exclusive: name one dataset or a blend")
        if self.dataset:
            _check_dataset_path(self.dataset, "data.dataset")
        if len(self.blend) > 64:
            raise ValueError(f"data.blend has {len(self.blend)} datasets; at most 64")

    def pin(self, path: str) -> DataPin | None:
        """The pin of ``path``, if the service pinned it."""
        return next((p for p in self.pins if p.path == path), None)

    @property
    def datasets(self) -> tuple[tuple[str, float], ...]:
        """The prepared datasets this config trains on, with their normalised weights; ``()`` for a text
        ``source``."""
        if self.dataset:
            return ((self.dataset, 1.0),)
        total = sum(b.weight for b in self.blend)
        return tuple((b.dataset, b.weight / total) for b in self.blend)


@dataclass(frozen=True, kw_only=True)
class ValidationConfig:
    """Evaluate on the held-out split while training; the loss goes into the step's record as ``val_loss``."""

    every_steps: int = knob(ge=1, le=10_000_000)
    """Evaluate after every N optimizer steps (and after the last one)."""
    batches: int = knob(4, ge=1, le=100_000)
    """Micro-batches of the validation split per evaluation (always the same ones)."""

    def __post_init__(self) -> None:
        check_bounds(self, "validation.")


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW with linear warm-up and cosine decay."""

    lr: float = knob(1e-3, gt=0, le=10)
    """Peak learning rate."""
    min_lr_ratio: float = knob(0.1, ge=0, le=1)
    """Final learning rate as a fraction of ``lr``."""
    warmup_steps: int = knob(10, ge=0, le=10_000_000)
    """Steps of linear warm-up from 0 to ``lr``."""
    weight_decay: float = knob(0.1, ge=0, le=10)
    """Decoupled weight decay, applied to matrices only (not to biases, norms)."""
    beta1: float = knob(0.9, ge=0, lt=1)
    beta2: float = knob(0.95, ge=0, lt=1)
    eps: float = knob(1e-8, gt=0)
    grad_clip: float = knob(1.0, ge=0, le=1e6)
    """Clip the global gradient norm to this value; 0 disables clipping."""

    def __post_init__(self) -> None:
        check_bounds(self, "training.")


@dataclass(frozen=True, kw_only=True)
class WanConfig:
    """Emulated inter-datacenter link (see :mod:`meridian.workers.wan.collectives`)."""

    rtt_ms: float = knob(ge=0, le=10_000)
    """Round-trip time between datacenters; each message pays RTT/2 one way."""
    gbps: float = knob(gt=0, le=10_000)
    """Link bandwidth per direction between two datacenters, shared by all their ranks."""

    def __post_init__(self) -> None:
        check_bounds(self, "wan.")

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

    inner_steps: int = knob(50, ge=1, le=100_000)
    """H: inner optimizer steps between two syncs of the same parameters across DCs."""
    fragments: int = knob(1, ge=1, le=1024)
    """Streaming: the parameters are cut into this many fragments (groups of whole buckets, so whole
    parameters), each synced once per H steps at its own offset. 1 is plain DiLoCo."""
    outer_lr: float = knob(0.7, gt=0, le=10)
    """Learning rate of the outer SGD step on the averaged parameter delta (1 with no momentum: plain
    averaging of the DC replicas)."""
    outer_momentum: float = knob(0.9, ge=0, lt=1)
    """Nesterov momentum of the outer step; 0 disables momentum."""
    nesterov: bool = True
    """Nesterov (the papers' choice) or heavy-ball momentum."""
    overlap_steps: int = knob(0, ge=0, le=100_000)
    """Streaming: inner steps a fragment's all-reduce stays in flight before it is applied (tau), under H. Above
    H / fragments several fragments are in flight at once (each on its own buckets)."""
    merge: OuterMerge = OuterMerge.MIX
    """With overlap: what a fragment's weights become when its sync lands (:class:`OuterMerge`); ignored when
    ``overlap_steps`` is 0 (both are then plain DiLoCo's ``theta <- outer``)."""
    mix_alpha: float = knob(0.5, ge=0, le=1)
    """``merge`` "mix": the fragment becomes ``alpha * local + (1 - alpha) * outer`` when the all-reduce lands
    (the paper's merge); ignored by "keep-progress" and when ``overlap_steps`` is 0."""
    warmup_steps: int = knob(0, ge=0, le=10_000_000)
    """Inner steps at the start synced on a short cycle, ``max(fragments × (overlap_steps + 1), H // 4)``
    steps, before H takes over (a multiple of that cycle); 0: none."""
    sparse_density: float | None = knob(None, gt=0, le=0.5)
    """SparseLoCo (Sarfi et al. 2025, arXiv:2508.15706): send only this share of each block of the outer delta (the
    largest magnitudes, top-k per ``sparse_block`` elements), each value in ``sparse_value_bits`` bits, and keep what
    was not sent in each rank's error-feedback residual for the next sync (:mod:`meridian.workers.sync.sparse_codec`);
    with ``sync.compression`` "none". 0.01–0.03 is the paper's range. ``None``: the whole delta is sent."""
    sparse_value_bits: int = knob(2, ge=2, le=8)
    """With ``sparse_density``: bits per value sent (2, 4 or 8): a sign bit and a magnitude level between the least and
    the largest magnitude kept in the block."""
    sparse_block: int = knob(4096, ge=16, le=65536)
    """With ``sparse_density``: elements per top-k block; a kept value's position takes ceil(log2(block)) bits."""
    sparse_error_decay: float = knob(1.0, gt=0, le=1)
    """With ``sparse_density``: what is left of the residual at the next sync before the new delta is added (the
    paper's beta; 1: plain error feedback, nothing fades)."""
    sparse_keep_unsent: bool = False
    """With ``sparse_density``: when a sync lands, each datacenter's weights become the new outer weights *plus what
    it has not sent yet* (its residual, times ``sparse_error_decay``), instead of the outer weights alone, so no
    datacenter drops its own unsent progress; the next delta, measured from the outer weights, then carries the
    residual itself (CHOCO-SGD's consensus step at the outer level, Koloskova et al. 2019, arXiv:1902.00340). False:
    SparseLoCo's, every datacenter restarts from the outer weights and the residual waits in error feedback."""
    final_average: FinalAverage = FinalAverage.OFF
    """At the job's last step, after landing every sync in flight, the datacenters average their weights, each rank
    sending its rows' delta from the outer weights (with what error feedback still holds) in this encoding, so the
    job ends with one model: its evaluation, final checkpoint and weights are the average. The bytes count in the
    last step's. "off": every datacenter ends with its own weights and the job's are the first datacenter's (they
    differ from the others' where fragments were in flight, and with ``sparse_keep_unsent`` by what was not sent)."""

    def __post_init__(self) -> None:
        check_bounds(self, "sync.diloco.")
        if self.sparse_value_bits not in (2, 4, 8):
            raise ValueError(f"sync.diloco.sparse_value_bits must be 2, 4 or 8, got {self.sparse_value_bits!r}")
        if self.sparse_density is None:
            for name in ("sparse_value_bits", "sparse_block", "sparse_error_decay", "sparse_keep_unsent"):
                if getattr(self, name) != default_of(DiLoCoConfig, name):
                    raise ValueError(f"sync.diloco.{name} applies to the sparse outer update only: set "
                                     "sync.diloco.sparse_density (e.g. 0.02), or drop it")
        if self.fragments > self.inner_steps:
            raise ValueError(
                f"sync.diloco.fragments ({self.fragments}) must be <= inner_steps ({self.inner_steps}): each "
                "fragment needs its own step in the H-step cycle; raise inner_steps or lower fragments"
            )
        if self.overlap_steps >= self.inner_steps:
            raise ValueError(
                f"sync.diloco.overlap_steps ({self.overlap_steps}) must be < inner_steps ({self.inner_steps}) so a "
                "fragment's sync lands before that fragment's next one starts; lower overlap_steps or raise inner_steps"
            )
        cycle = max(self.fragments * (self.overlap_steps + 1), self.inner_steps // 4)
        if self.warmup_steps and cycle > self.inner_steps:
            raise ValueError(
                f"sync.diloco.warmup_steps ({self.warmup_steps}) needs a warm-up cycle no longer than inner_steps, but "
                f"max(fragments × (overlap_steps + 1), inner_steps // 4) = {cycle} > {self.inner_steps}: it would sync "
                "less often than after it; set warmup_steps to 0, or lower overlap_steps or fragments"
            )
        if self.warmup_steps % cycle:
            raise ValueError(
                f"sync.diloco.warmup_steps ({self.warmup_steps}) must be a multiple of the warm-up's sync cycle, "
                f"max(fragments × (overlap_steps + 1), inner_steps // 4) = {cycle}; round it to one"
            )


LOOKAHEAD_AFTER_MIN = 20
"""Exact steps before the look-ahead takes over, at least: while AdamW's moments are young an update is mostly the
newest gradient, and a look-ahead strays furthest from the exact update (the replay that set this figure:
``docs/benchmarks/history.md``)."""


LOOKAHEAD_DECISION_SKIP = 2
"""An armed look-ahead (``sync.lookahead_when_exposed``) does not measure the first steps after its engine was
built (the first pays for warm-up, a re-formation's for its restore)."""
LOOKAHEAD_DECISION_MEASURE = 8
"""An armed look-ahead decides on this many exact steps' figures."""
LOOKAHEAD_DECISION_STEPS = LOOKAHEAD_DECISION_SKIP + LOOKAHEAD_DECISION_MEASURE
"""An armed look-ahead checks its exact steps after this many steps of its engine (at the earliest), and a trial of
the look-ahead lasts this many steps plus one (its first commits nothing)."""


def lookahead_decided_by(lookahead_after: int) -> int:
    """The steps a fresh armed engine needs before every check is done (a trial's included), with the exact
    steps checked at ``lookahead_after`` committed updates (:func:`lookahead_start`) at the earliest."""
    return max(lookahead_after, LOOKAHEAD_DECISION_STEPS) + LOOKAHEAD_DECISION_STEPS + 1


def lookahead_start(lookahead_after: int | None, lr_warmup_steps: int) -> int:
    """The steps a look-ahead job syncs exactly before the look-ahead takes over: ``sync.lookahead_after``, or
    the learning-rate warm-up's ``lr_warmup_steps``, at least :data:`LOOKAHEAD_AFTER_MIN`."""
    return lookahead_after if lookahead_after is not None else max(LOOKAHEAD_AFTER_MIN, lr_warmup_steps)


@dataclass(frozen=True, kw_only=True)
class SyncConfig:
    """The gradient-sync engine's knobs."""

    strategy: SyncStrategy | None = SyncStrategy.HIERARCHICAL
    """How gradients travel. ``None`` ("auto") exists only in a job request: the planner then picks the
    strategy (and the DiLoCo knobs), its choice is the plan's ``sync_strategy``, and the :class:`TrainConfig`
    built from request and plan always carries the resolved strategy."""
    bucket_mb: float | None = knob(4.0, gt=0, le=1024)
    """Flat sync's (DDP's) gradient buckets, about this many MiB (fp32); the hierarchical engine syncs per FSDP2
    unit (a transformer block) instead, and DiLoCo does not use it. ``None`` in a job request (its default): the
    planner sizes the buckets (:func:`meridian.service.planning.buckets.bucket_mb_for`), and the
    :class:`TrainConfig` built from request and plan carries the plan's size, or ``None`` for another strategy."""
    overlap: bool = True
    """Hierarchical sync: start each FSDP2 unit's sum across datacenters from FSDP2's all-reduce hook while backward
    still runs (off: in the optimizer step). DDP always overlaps; DiLoCo does not use it."""
    inter_dc_chunk_mb: float = knob(1.0, gt=0, le=1024)
    """The inter-DC all-reduce of a shard is split in chunks of this size, all in flight together."""
    compression: Compression = Compression.NONE
    """Encoding of the inter-DC step (for the DiLoCo strategies: of the outer parameter delta)."""
    delay_one_step: bool = False
    """``hierarchical`` only: apply each step's averaged gradients one step later, so their sync runs behind
    the whole next step (forward included) instead of behind backward alone. Every replica still applies the
    exact global-batch gradient, in the same order; the update simply uses gradients one step stale (the
    first step applies none, and the gradient in flight at a checkpoint or re-formation is not kept). Staleness
    costs loss (``docs/benchmarks/sync.md``), so ``auto`` sets it only together with ``local_lookahead``."""
    local_lookahead: bool = False
    """With ``delay_one_step``: while step t's exact sync is in flight, step t+1
    computes at parameters that already took step t's update from *this datacenter's* gradients (scaled to the
    global batch); when the exact sync lands, the committed parameters take the exact update instead. Every
    datacenter commits the same exact global-batch updates in the same order (optimizer state included); only
    the point where each gradient is evaluated moves, by the difference between the local and the exact
    update, instead of by a whole step as with ``delay_one_step`` alone. The engine's ``synchronize`` (evaluation, the
    end of the job, leaving an epoch at a step boundary) lands the sync in flight and commits it, so nothing is
    dropped there; a snapshot taken inside a step (the elastic run's every ``snapshot_every`` steps) holds the
    committed state without the sync still in flight. Its loss against per-step sync: ``docs/benchmarks/sync.md``."""
    lookahead_after: int | None = knob(None, ge=0, le=10_000_000)
    """With ``local_lookahead``: the steps synced exactly (not late) first, while AdamW's moments are young and
    a look-ahead's error is largest; ``None``: the learning-rate warm-up's steps, at least
    :data:`LOOKAHEAD_AFTER_MIN`."""
    lookahead_when_exposed: float | None = knob(None, ge=0, le=100)
    """With ``local_lookahead``: the look-ahead is *armed*, not set. Where it would take over, the exact steps just
    before are measured; if they waited for the sync more than this share of a step's compute, the look-ahead is
    tried for a few steps and stays only if its steps were faster (by 1%); otherwise the job stays exact. Every
    rank decides the same, on the slowest rank's figures; each epoch decides again
    (:mod:`meridian.workers.sync.lookahead_decision`). ``auto`` arms it (at 0.05) when it planned exact sync on
    figures nobody measured; ``None``: the look-ahead is set."""
    diloco: DiLoCoConfig | None = None
    """Knobs of the ``diloco`` / ``streaming-diloco`` strategies; ``None`` takes :class:`DiLoCoConfig`'s
    defaults for them and is required for the others."""

    RETIRED_FIELDS: ClassVar[frozenset[str]] = frozenset({"shard_optimizer"})
    """Keys that configs stored by earlier versions may carry and that mean nothing now; reading such a config
    (:func:`~meridian.workers.contracts.fields.from_plain`) drops them. ``shard_optimizer``: the optimizer state is
    always sharded inside each datacenter by FSDP2 and replicated across datacenters, so a stored ``false``
    (a replicated optimizer) and ``true`` read the same, with the same inter-DC bytes."""

    def __post_init__(self) -> None:
        check_bounds(self, "sync.")
        if self.strategy is SyncStrategy.FLAT and self.compression is not Compression.NONE:
            raise ValueError("sync.compression applies to the inter-DC step of 'hierarchical' sync only")
        if self.delay_one_step and self.strategy is not SyncStrategy.HIERARCHICAL:
            raise ValueError(
                f"sync.delay_one_step applies to 'hierarchical' sync only, not "
                f"{self.strategy.value if self.strategy else 'auto'!r} (with 'auto' the planner decides it)"
            )
        if self.lookahead_after is not None and not self.local_lookahead and self.strategy is not None:
            raise ValueError("sync.lookahead_after applies with sync.local_lookahead=true (or 'auto', which may "
                             "pick the look-ahead) only")
        if self.lookahead_when_exposed is not None and not self.local_lookahead and self.strategy is not None:
            raise ValueError("sync.lookahead_when_exposed applies with sync.local_lookahead=true (or 'auto', which "
                             "may arm the look-ahead) only")
        if self.local_lookahead and not self.delay_one_step:
            raise ValueError(
                "sync.local_lookahead needs sync.delay_one_step=true (it steers the step that runs while the "
                "delayed sync is in flight)"
            )
        if self.strategy is SyncStrategy.DILOCO and self.diloco is not None and (
            self.diloco.fragments != 1 or self.diloco.overlap_steps
        ):
            raise ValueError(
                "sync.diloco.fragments > 1 or overlap_steps > 0 is streaming DiLoCo: set sync.strategy to "
                "'streaming-diloco'"
            )
        if self.diloco is not None and self.diloco.sparse_density is not None and self.compression is not Compression.NONE:
            raise ValueError(
                f"sync.compression {self.compression.value!r} and sync.diloco.sparse_density exclude each other: the "
                "sparse outer update encodes its own values (sync.diloco.sparse_value_bits); set sync.compression to "
                "'none'"
            )
        if self.diloco is not None and (self.strategy is None or not self.strategy.is_diloco):
            raise ValueError(
                f"sync.diloco is set but sync.strategy is {self.strategy.value if self.strategy else 'auto'!r}; "
                "use 'diloco' or 'streaming-diloco', or drop sync.diloco (with 'auto' the planner picks H and "
                "fragments itself)"
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
    """Order of micro-batch forwards and backwards on the pipeline stages (``torch.distributed.pipelining``)."""

    GPIPE = "gpipe"  # every forward, then every backward: m micro-batches' activations kept
    ONE_F_ONE_B = "1f1b"  # warm-up forwards, then one forward / one backward: <= pp micro-batches' activations
    INTERLEAVED_1F1B = "interleaved-1f1b"  # 1F1B over virtual_stages chunks per rank: a bubble virtual_stages× smaller

    @property
    def is_interleaved(self) -> bool:
        return self is PipelineSchedule.INTERLEAVED_1F1B


class ActivationCheckpointing(str, enum.Enum):
    """What each transformer block keeps of its forward for the backward (:mod:`meridian.workers.parallel.checkpointing`)."""

    NONE = "none"  # every activation kept
    SELECTIVE = "selective"  # matmul and attention outputs kept, the cheap element-wise ops recomputed
    FULL = "full"  # only the block's input kept, the whole block recomputed in backward


class FsdpUnits(str, enum.Enum):
    """What FSDP2 shards as one unit: one all-gather and one reduce-scatter each (:func:`~meridian.workers.parallel.
    fsdp.apply_fsdp`)."""

    BLOCK = "block"  # each transformer block, then the root: the sync of each block overlaps the backward before it
    MODEL = "model"  # the whole model: one gather and one reduce-scatter a step, none of it overlapped


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Model parallelism of every replica (:mod:`meridian.workers.parallel.dims` turns it into process groups
    and device meshes). World ranks are ordered (pipeline stage, data-parallel replica, tensor-parallel rank),
    tensor-parallel fastest, the order the planner places them in."""

    tp: int = knob(1, ge=1, le=64)
    """Tensor-parallel size: ranks of one node that split every attention and MLP layer (DTensor)."""
    pp: int = knob(1, ge=1, le=128)
    """Pipeline stages: consecutive groups of transformer blocks, micro-batches flowing between them."""
    schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    """Pipeline schedule (ignored with ``pp=1``)."""
    virtual_stages: int = knob(1, ge=1, le=64, name="parallelism.virtual_stages")
    """Model chunks per pipeline rank (``interleaved-1f1b`` only): ``pp × virtual_stages`` stages, rank ``s``
    holding stages ``s, s + pp, …``."""
    sequence_parallel: bool = False
    """With ``tp > 1``: norms and residual stream sharded along the sequence across the TP ranks (their
    all-reduces become reduce-scatter + all-gather, activations between layers ``tp`` times smaller)."""
    reshard_after_forward: bool = True
    """FSDP2 frees each block's gathered parameters after its forward and gathers them again for its backward, in
    every micro-batch. ``False`` keeps them gathered from a step's first forward to its last backward: one
    all-gather per unit and step, at the memory of the unsharded parameters (the planner's choice where that
    fits). Under pipelining the schedule gathers once per step either way."""

    fsdp_units: FsdpUnits = FsdpUnits.BLOCK
    """FSDP2's units: each block (the default), or the whole model as one, for a model whose blocks are so small
    that each collective's fixed cost outweighs what overlapping it with backward saves (the planner's choice).
    Pipeline stages keep one unit per block."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedule", PipelineSchedule(self.schedule))  # "1f1b" from a plain value too
        object.__setattr__(self, "fsdp_units", FsdpUnits(self.fsdp_units))
        check_bounds(self, "parallelism.")
        if self.virtual_stages > 1 and not self.schedule.is_interleaved:
            raise ValueError(f"parallelism.virtual_stages ({self.virtual_stages}) needs parallelism.schedule "
                             f"'interleaved-1f1b' (got {self.schedule.value!r}); set virtual_stages to 1 or change "
                             "the schedule")
        if self.schedule.is_interleaved and self.pp > 1 and self.virtual_stages < 2:
            raise ValueError("parallelism.schedule 'interleaved-1f1b' needs parallelism.virtual_stages >= 2 (the "
                             "chunks each rank interleaves); use '1f1b' for one stage per rank")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("parallelism.sequence_parallel shards along the sequence across the tensor-parallel "
                             "ranks: it needs parallelism.tp > 1")

    @property
    def model_parallel(self) -> int:
        """Model-parallel size: the ranks holding one replica of the model (tp × pp); 1 is pure data
        parallelism. The only meaning of "model_parallel" in Meridian."""
        return self.tp * self.pp

    @property
    def stages(self) -> int:
        """Pipeline stages of a replica (``pp × virtual_stages``)."""
        return self.pp * (self.virtual_stages if self.schedule.is_interleaved else 1)

    def check(self, model: ModelConfig, world: int) -> None:
        """Raise ``ValueError`` naming the field when ``model`` cannot be split this way over ``world`` ranks."""
        self.check_model(model)
        if world % self.model_parallel:
            raise ValueError(
                f"{world} workers cannot be split into replicas of tp × pp = {self.tp} × {self.pp} ranks"
            )

    def _check_model_of_its_own(self, model: ModelConfig) -> None:
        refusal = model_parallel_refusal(model, self.tp, self.pp)
        if refusal:
            raise ValueError(refusal)
        if self.sequence_parallel:
            raise ValueError("parallelism.sequence_parallel: a Hugging Face model's tensor-parallel plan keeps the "
                             "sequence whole; set it to false (or 'auto')")

    def check_model(self, model: ModelConfig) -> None:
        """Raise ``ValueError`` naming the field when ``model`` cannot be split into these slices and stages."""
        if not model.family.is_builtin:
            self._check_model_of_its_own(model)
            return
        if model.n_heads % self.tp:
            raise ValueError(f"parallelism.tp ({self.tp}) must divide model.n_heads ({model.n_heads})")
        if model.kv_heads % self.tp:
            raise ValueError(f"parallelism.tp ({self.tp}) must divide model.n_kv_heads ({model.kv_heads})")
        if model.mlp_width % self.tp:
            raise ValueError(f"parallelism.tp ({self.tp}) must divide the MLP width ({model.mlp_width})")
        if self.sequence_parallel and model.seq_len % self.tp:
            raise ValueError(f"parallelism.sequence_parallel needs parallelism.tp ({self.tp}) to divide "
                             f"model.seq_len ({model.seq_len})")
        if model.tie_embeddings and self.pp > 1:
            raise ValueError(f"model.tie_embeddings needs parallelism.pp = 1 (got {self.pp}): the first and last "
                             "stages would both hold the shared weight")
        if self.stages > model.n_layers:
            what = f"parallelism.pp × virtual_stages ({self.pp} × {self.virtual_stages})" if self.virtual_stages > 1 \
                else f"parallelism.pp ({self.pp})"  # fmt: skip
            raise ValueError(f"{what} must be <= model.n_layers ({model.n_layers}): every stage needs a block")

    def check_batches(self, global_batch: int, micro_batch: int, replicas: int) -> None:
        """Raise ``ValueError`` naming the field when a pipeline cannot cut each replica's samples of a step into
        equal micro-batches its schedule can run (``torch.distributed.pipelining`` sends fixed shapes)."""
        if self.pp == 1:
            return
        per_replica, rest = divmod(global_batch, replicas)
        if rest or per_replica % micro_batch:
            raise ValueError(
                f"training.micro_batch ({micro_batch}) must divide each pipeline replica's samples per step "
                f"(training.global_batch {global_batch} / {replicas} replicas): the stages exchange micro-batches of "
                "one shape; choose a global_batch that is a multiple of micro_batch × replicas"
            )
        n = per_replica // micro_batch
        if self.schedule is PipelineSchedule.ONE_F_ONE_B and n < self.pp:
            raise ValueError(f"parallelism.schedule '1f1b' needs at least pp ({self.pp}) micro-batches per step, each "
                             f"replica has {n} (training.global_batch / replicas / training.micro_batch); lower "
                             "micro_batch or use 'gpipe'")
        if self.schedule.is_interleaved and n % max(1, n // self.pp):
            raise ValueError(f"parallelism.schedule 'interleaved-1f1b' runs micro-batches in rounds of pp ({self.pp}): "
                             f"{n} micro-batches per replica and step is not a multiple of {max(1, n // self.pp)} "
                             "rounds; change training.micro_batch or training.global_batch")


def model_parallel_refusal(model: ModelConfig, tp: int, pp: int) -> str | None:
    """Why a Hugging Face or factory model cannot be split ``tp`` × ``pp`` ways, naming the fields; ``None`` where
    it can. Tensor parallelism follows the model's own plan (transformers' ``base_model_tp_plan``); pipeline stages
    cut Meridian's builtin families only."""
    if pp > 1:
        return (f"parallelism.pp={pp}: pipeline stages cut Meridian's builtin gpt and llama families only, not a "
                f"{model.family.value} model; set parallelism.pp to 1 (tensor and data parallelism still apply)")
    if tp == 1:
        return None
    if model.family is not ModelFamily.HF:
        return (f"parallelism.tp={tp}: a factory's module is split only by the plan it declares, which the service "
                "cannot check before it runs; set parallelism.tp to 1")
    shape = shape_of_json(model.hf_config)
    if not FAMILIES[shape.model_type].declares_tp_plan:
        return (f"parallelism.tp={tp}: transformers declares no tensor-parallel plan for {shape.architecture} "
                "(base_model_tp_plan), so it cannot be split across ranks; set parallelism.tp to 1")
    widths = {"attention heads": shape.n_heads, "key/value heads": shape.n_kv_heads, "MLP width": shape.ffn_hidden,
              "vocabulary": shape.vocab_size}
    odd = [f"its {n} {what}" for what, n in widths.items() if n % tp]
    if odd:
        return f"parallelism.tp={tp} must divide {' and '.join(odd)} ({shape.architecture})"
    return None


class ResetPart(str, enum.Enum):
    """What a job resumed from another's checkpoint starts afresh instead of continuing (a new phase)."""

    OPTIMIZER = "optimizer"
    """AdamW's moments and step count (and DiLoCo's outer state) start at zero; the weights still load."""
    SCHEDULE = "schedule"
    """The job's steps count from 0 again: warm-up and decay over its own ``steps``."""
    DATA = "data"
    """The sample order starts at its first batch (the data, seed, global batch and tokenizer may differ)."""


@dataclass(frozen=True, kw_only=True)
class ResumeFrom:
    """The checkpoint of another job (or one named by its location) that a new job starts from, fixed at submit."""

    checkpoint: str
    """The checkpoint's step folder (a path or URL), read by every rank when the job has none of its own yet."""
    step: int = knob(ge=0, le=10_000_000, name="resume_from.step")
    """The steps that checkpoint holds."""
    fingerprint: str = ""
    """The checkpoint's fingerprint as admitted (JSON): a folder that holds another since is refused."""
    reset: tuple[ResetPart, ...] = ()
    """What starts afresh (:class:`ResetPart`); empty: the job continues as if never interrupted."""
    source: str = ""
    """What the job named (``job <id>`` or the location), for its events."""

    def __post_init__(self) -> None:
        check_bounds(self, "")
        if len(set(self.reset)) != len(self.reset):
            raise ValueError(f"resume_from.reset names a part twice: {[r.value for r in self.reset]}")

    @property
    def start_step(self) -> int:
        """The step the new job trains first: the checkpoint's, or 0 with the schedule reset."""
        return 0 if ResetPart.SCHEDULE in self.reset else self.step

    @property
    def data_offset(self) -> int:
        """Added to a step to give its batch's position in the sample order: the data continues where the
        checkpoint left it (unless reset) whichever step the schedule starts at."""
        return (0 if ResetPart.DATA in self.reset else self.step) - self.start_step

    @property
    def loads_optimizer(self) -> bool:
        return ResetPart.OPTIMIZER not in self.reset


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
    steps: int = knob(ge=1, le=10_000_000)
    """Optimizer steps to run."""
    global_batch: int = knob(ge=1, le=1_048_576)
    """Samples per optimizer step, summed over every data-parallel rank."""
    micro_batch: int = knob(ge=1, le=65_536)
    """Samples per forward/backward on one rank; more samples per rank are accumulated."""
    seed: int = knob(0, ge=0, le=2**31 - 1)
    """Seeds the model's initialisation and the sample order (a pure function of the seed, the step and the global
    batch)."""
    precision: Precision = Precision.FP32
    checkpoint_every: int = knob(0, ge=0, le=10_000_000, name="checkpoint.interval_steps")
    """Write a durable checkpoint every N steps (0: only at the end)."""
    checkpoint_dir: str = ""
    """Directory for durable checkpoints; empty disables them."""
    snapshot_every: int = knob(1, ge=1, le=10_000, name="checkpoint.snapshot_every")
    """An elastic rank keeps its in-memory shard of the state every k steps (and where an epoch starts or
    leaves for a newcomer). The recovery promise: after a failure the job resumes from the last step every
    survivor snapshotted, so with k > 1 up to k - 1 steps are trained again (each shard copy costs ~3/N of the
    model's bytes; k = 1 loses no step)."""
    snapshot_adaptive: bool = False
    """Widen ``snapshot_every`` as measured: to the fewest steps that keep what snapshots cost the loop under 5%
    of its time and let each one's background write finish before the next (a GPU's multi-GB shard); a
    snapshot that costs the loop under 10 ms is taken every ``snapshot_every`` steps as given. Every rank
    widens at the same step (:class:`~meridian.workers.loop.report.ReportWindows`); a job says when."""
    datacenters: tuple[str, ...] = ()
    """Datacenter of each world rank, in rank order (the plan's placement)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Tensor and pipeline parallelism inside each data-parallel replica."""
    validation: ValidationConfig | None = None
    """Periodic evaluation on the held-out split; ``None``: only the final evaluation."""
    tracking: TrackingConfig | None = None
    """The experiment trackers rank 0 logs to; ``None``: none."""
    job_dir: str = ""
    """The job's folder in the service's storage (a path or URL): tracker logs and profiler traces go there;
    empty: neither is written."""
    compile: bool = knob(False, name="training.compile")
    """Compile every transformer block with ``torch.compile`` (once per block, after tensor parallelism and
    activation checkpointing, before FSDP2): the first steps pay the compilation."""
    activation_checkpointing: ActivationCheckpointing = knob(ActivationCheckpointing.NONE,
                                                             name="training.activation_checkpointing")
    """Per transformer block: ``none``, ``selective`` (matmul and attention outputs kept) or ``full``
    (the block recomputed in backward)."""
    resume: ResumeFrom | None = None
    """Another job's checkpoint this job starts from while it has none of its own; ``None``: step 0."""

    def __post_init__(self) -> None:
        check_batches(self)
        if self.resume is not None and self.resume.start_step >= self.steps:
            raise ValueError(f"training.steps ({self.steps}) must be above the step of the checkpoint it resumes "
                             f"from ({self.resume.step}): steps counts the whole run, the steps before the resume "
                             "included; give more, or reset the schedule (resume_from.reset: [\"schedule\"]) to "
                             "count this job's steps from 0")
        if self.sync.strategy is None:
            raise ValueError("sync.strategy is 'auto' (None): build a TrainConfig from a plan, whose "
                             "sync_strategy resolves it")
        if self.sync.bucket_mb is None and self.sync.strategy is SyncStrategy.FLAT:
            raise ValueError("sync.bucket_mb is 'auto' (None) for flat sync: build a TrainConfig from a plan, whose "
                             "bucket_mb resolves it")
        replicas = len(self.datacenters) // self.parallel.model_parallel
        if self.datacenters and replicas > self.global_batch:
            raise ValueError(
                f"training.global_batch ({self.global_batch}) must be at least the number of data-parallel "
                f"replicas ({replicas}) so every replica gets a sample"
            )
        if self.datacenters:
            self.parallel.check(self.model, len(self.datacenters))
            self.parallel.check_batches(self.global_batch, self.micro_batch, replicas)
        check_model_parallel_sync(self.parallel, self.sync)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.model.seq_len

    @property
    def data_offset(self) -> int:
        """Step ``s`` trains the batch at position ``s + data_offset`` of the sample order (non-zero only for a
        resume that resets the schedule or the data but not both: :attr:`ResumeFrom.data_offset`)."""
        return 0 if self.resume is None else self.resume.data_offset


def check_model_parallel_sync(parallel: ParallelConfig, sync: SyncConfig) -> None:
    """Tensor and pipeline parallelism run on FSDP2 and DTensor (:mod:`meridian.workers.loop.parallel`), under the
    hierarchical engine with its optimizer sharded (:class:`~meridian.workers.sync.fsdp_har.FSDPHierarchicalSync`):
    a ``ValueError`` naming the field for a sync that does not run there (``auto``, ``strategy=None``: the planner
    picks hierarchical sync for such a layout, and arms no look-ahead)."""
    if parallel.model_parallel == 1:
        return
    if sync.strategy is not None and sync.strategy is not SyncStrategy.HIERARCHICAL:
        raise ValueError(
            f"sync.strategy {sync.strategy.value!r} cannot run with parallelism.tp = {parallel.tp}, pp = {parallel.pp}: "
            "tensor and pipeline parallelism train on FSDP2 under 'hierarchical' sync only (DDP cannot follow a "
            "pipeline schedule, and DiLoCo's engine flattens plain parameters, not DTensor shards); use "
            "'hierarchical', or tp = pp = 1")
    if sync.local_lookahead:
        # The look-ahead steers a whole replica's parameters from its DC's gradients; with its state cut across
        # stages and tensor-parallel ranks it is not tested, so it is refused here rather than once workers run.
        raise ValueError(
            f"sync.local_lookahead applies to data parallelism only, not parallelism.tp={parallel.tp}, "
            f"pp={parallel.pp}; set sync.local_lookahead=false or parallelism.tp and pp to 1"
        )
    if sync.lookahead_when_exposed is not None and sync.strategy is not None:
        raise ValueError("sync.lookahead_when_exposed cannot run with parallelism.tp or pp > 1 yet: each stage and "
                         "tensor-parallel rank would decide on its own group's figures; set sync.local_lookahead "
                         "without it, or leave the look-ahead off")


def check_batches(config: Any) -> None:
    """The training knobs a job request shares with :class:`TrainConfig`: bounds, and micro <= global batch."""
    check_bounds(config, "training.")
    if config.micro_batch > config.global_batch:
        raise ValueError(
            f"training.micro_batch ({config.micro_batch}) must be <= training.global_batch ({config.global_batch})"
        )


__all__ = [
    "ActivationCheckpointing",
    "BlendEntry",
    "Compression",
    "DataConfig",
    "DiLoCoConfig",
    "OptimConfig",
    "ParallelConfig",
    "PipelineSchedule",
    "Precision",
    "SyncConfig",
    "SyncStrategy",
    "TrainConfig",
    "ValidationConfig",
    "WanConfig",
    "check_batches",
    "check_model_parallel_sync",
]
