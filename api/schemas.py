"""Wire schemas: ``JobSpec`` in, ``JobPublic`` out (never an internal record).

Every model forbids unknown fields and bounds every number, so a typo or an absurd value is a 422 that
names the field. The numbers are not written here: each default and bound comes from the frozen config
dataclass that owns it (``knob`` fields of :mod:`meridian.workers.contracts.config` and
:mod:`meridian.service.jobs`), read by :func:`config_field`; the sections that mirror a config one to one
(``data``, ``wan``, ``sync.diloco``) are generated from it by :func:`config_model`. :meth:`JobSpec.to_request`
turns a spec into the service's frozen :class:`~meridian.service.jobs.JobRequest`, whose ``__post_init__``
checks are the rest of the validation; their ``ValueError`` (e.g. ``d_model`` not divisible by
``n_heads``) becomes a 422 naming the field.
"""

from __future__ import annotations

import ast
import functools
import inspect
import json
import textwrap
import typing
from collections.abc import Callable
from dataclasses import MISSING, fields, replace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, create_model, field_validator, model_validator

from meridian.service.errors import InvalidJob
from meridian.service.jobs import (
    WORKERS_PER_DC,
    DeclaredLink,
    JobRequest,
    ParallelismRequest,
    ResumeRequest,
    TopologyRequest,
)
from meridian.service.store import Event, JobRecord
from meridian.workers.contracts.config import (
    ActivationCheckpointing,
    BlendEntry,
    Compression,
    DataConfig,
    DiLoCoConfig,
    OptimConfig,
    ParallelConfig,
    PipelineSchedule,
    Precision,
    ResetPart,
    SyncConfig,
    SyncStrategy,
    TrainConfig,
    ValidationConfig,
    WanConfig,
)
from meridian.workers.contracts.fields import bounds_of, default_of
from meridian.workers.contracts.hf_config import hf_model_config, model_config_from_hf
from meridian.workers.contracts.model_config import MODEL_PRESETS, ModelConfig, ModelFamily
from meridian.workers.contracts.tracking import MlflowTracking, TrackingConfig, WandbTracking

DCName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$", description="a datacenter label value")]
AUTO = "auto"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- defaults and bounds from the config dataclasses ----------------------------------------------------
@functools.cache
def _attribute_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass's source (the schema's descriptions)."""
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
    except (OSError, TypeError):
        return {}
    docs = {}
    for node, after in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


def config_field(cls: type, name: str, **overrides: Any) -> Any:
    """A pydantic ``Field`` with the default, bounds and description that dataclass ``cls`` declares for its
    field ``name``; ``overrides`` (e.g. ``default=None`` for an optional override) take precedence."""
    default = default_of(cls, name)
    kwargs: dict[str, Any] = {"default": ... if default is MISSING else default, **bounds_of(cls, name).as_kwargs()}
    if doc := _attribute_docs(cls).get(name):
        kwargs["description"] = doc
    return Field(**{**kwargs, **overrides})


def bounded(cls: type, name: str) -> Any:
    """``Annotated[int, <cls.name's bounds>]``: one branch of a union such as ``int | 'auto'``."""
    return Annotated[int, Field(**bounds_of(cls, name).as_kwargs())]


class ConfigModel(Strict):
    """A wire section generated from a config dataclass (:func:`config_model`): same fields, defaults and
    bounds; its ``__post_init__`` checks run on validation, so their errors name this section."""

    def to_config(self) -> Any:
        return _CONFIG_OF[type(self)](**{k: getattr(self, k) for k in type(self).model_fields})

    @model_validator(mode="after")
    def _check(self) -> ConfigModel:
        self.to_config()
        return self


_CONFIG_OF: dict[type[ConfigModel], type] = {}


def config_model(cls: type, name: str, base: type[ConfigModel] = ConfigModel,
                 **overrides: dict[str, Any]) -> type[ConfigModel]:
    """A wire model of every field of dataclass ``cls`` (checks of the wire's own in ``base``);
    ``overrides[field]``: extra ``Field`` arguments."""
    hints = typing.get_type_hints(cls)
    model = create_model(name, __base__=base, __doc__=" ".join((cls.__doc__ or "").split()), __module__=__name__,
                         **{f.name: (hints[f.name], config_field(cls, f.name, **overrides.get(f.name, {})))
                            for f in fields(cls)})
    _CONFIG_OF[model] = cls
    return model


def _or_auto(value: Any) -> Any:
    return None if value == AUTO else value


# -- the job spec ----------------------------------------------------------------------------------------
CheckpointGate = Callable[[str], str]
"""A user's ``model.init_from`` (or ``model.config``) → the real directory the service may read, or an error (a
4xx) if none."""
FactoryGate = Callable[..., ModelConfig]
"""A job's ``model.factory`` (with its ``args``, ``block``, ``seq_len``, ``vocab_size``) → the
:class:`ModelConfig` of the module it builds, or an error (a 4xx) naming what is allowed
(:meth:`meridian.service.model_access.ModelAccess.admit_factory`)."""

FACTORY_ARGS_MAX_BYTES = 64 * 1024
"""A factory's arguments are a handful of sizes and names; more than 64 KiB of them is not one."""


class ModelSpec(Strict):
    """A preset, optionally with sizes overridden; or all sizes given explicitly (``preset: null``); or a local
    Hugging Face checkpoint (``init_from``) whose shape and weights the job starts from; or a Hugging Face
    ``config.json`` alone (``config``), its model randomly initialised; or an operator-allowed factory of your own
    module (``factory``)."""

    preset: Literal[tuple(MODEL_PRESETS)] | None = "tiny"  # type: ignore[valid-type]
    family: ModelFamily | None = Field(None, description="gpt or llama (hf and factory are what model.init_from, "
                                       "model.config and model.factory build); omitted: the preset's family (a family "
                                       "without a preset picks '<family>-tiny', or 'tiny' for gpt). With init_from: "
                                       "omitted or 'hf' builds the checkpoint's own transformers family; 'llama' "
                                       "loads a Llama checkpoint into Meridian's llama (which pipeline stages can "
                                       "also cut)")
    init_from: str | None = Field(None, min_length=1, max_length=4096, description="A local Hugging Face checkpoint "
                                  "directory (config.json + *.safetensors, sharded with an index or not) under the "
                                  "service's data roots, whose model and weights the job starts from")
    config: str | None = Field(None, min_length=1, max_length=4096, description="A directory under the service's "
                               "data roots holding a Hugging Face config.json: that model, randomly initialised from "
                               "the job's seed")
    factory: str | None = Field(None, min_length=1, max_length=300, description="Your own nn.Module: an entry point "
                                "name of the meridian.models group, or module:function under a module the service "
                                "allows (meridian serve --model-module PKG)")
    args: dict[str, Any] | None = Field(None, description="The factory's keyword arguments (plain JSON values)")
    block: str | None = Field(None, min_length=1, max_length=200, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
                              description="The factory module's repeated block class; omitted: found")
    n_layers: int | None = config_field(ModelConfig, "n_layers", default=None)
    d_model: int | None = config_field(ModelConfig, "d_model", default=None)
    n_heads: int | None = config_field(ModelConfig, "n_heads", default=None)
    seq_len: int | None = config_field(ModelConfig, "seq_len", default=None)
    vocab_size: int | None = config_field(ModelConfig, "vocab_size", default=None)
    n_kv_heads: int | None = config_field(ModelConfig, "n_kv_heads", default=None)
    ffn_hidden: int | None = config_field(ModelConfig, "ffn_hidden", default=None)
    rope_theta: float | None = config_field(ModelConfig, "rope_theta", default=None)
    norm_eps: float | None = config_field(ModelConfig, "norm_eps", default=None)
    tie_embeddings: bool | None = config_field(ModelConfig, "tie_embeddings", default=None)

    def _sizes(self) -> dict[str, Any]:
        return self.model_dump(exclude={"preset", "family", "init_from", "config", "factory", "args", "block"},
                               exclude_none=True)

    @property
    def source(self) -> str | None:
        """The field naming where the model comes from (``init_from``, ``config``, ``factory``), if any."""
        return next((name for name in ("init_from", "config", "factory") if getattr(self, name) is not None), None)

    def check_source(self) -> None:
        """What can be said of a checkpoint, config or factory spec without reading or running anything."""
        given = [n for n in ("init_from", "config", "factory") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(f"model.{' and model.'.join(given)} exclude each other: name one source of the model")
        if (self.args is not None or self.block is not None) and self.factory is None:
            raise ValueError("model.args and model.block apply to model.factory only")
        source = self.source
        if source is None:
            return
        if "preset" in self.model_fields_set and self.preset is not None:
            raise ValueError(f"model.preset and model.{source} exclude each other: the {source} gives the shape")
        sizes = set(self._sizes())
        if source == "factory":
            if self.family not in (None, ModelFamily.FACTORY):
                raise ValueError(f"model.factory builds your own module; model.family is {self.family.value!r}")
            if "seq_len" not in sizes:
                raise ValueError("model.factory needs model.seq_len: the tokens of each training sample")
            if sizes - {"seq_len", "vocab_size"}:
                raise ValueError("model.factory's module has its own shape; only model.seq_len (and model.vocab_size, "
                                 "checked against its embedding) may be given with it, not model."
                                 + ", model.".join(sorted(sizes - {"seq_len", "vocab_size"})))
            if self.args is not None:
                _check_factory_args(self.args)
            return
        allowed = (None, ModelFamily.HF, ModelFamily.LLAMA) if source == "init_from" else (None, ModelFamily.HF)
        if self.family not in allowed:
            raise ValueError(f"model.{source} loads Hugging Face models (family 'hf'"
                             + (", or 'llama' for Meridian's own llama" if source == "init_from" else "")
                             + f"); model.family is {self.family.value!r}")
        if sizes - {"seq_len"}:
            raise ValueError(f"model.{source} fixes the shape; only model.seq_len may be given with it, not "
                             f"model.{', model.'.join(sorted(sizes - {'seq_len'}))}")

    def to_config(self, admit_checkpoint: CheckpointGate | None = None,
                  admit_factory: FactoryGate | None = None) -> ModelConfig:
        """``admit_checkpoint``: maps ``init_from`` / ``config`` to the directory the service allows it to read
        (raising if it may not), before anything there is read; ``None`` reads it as given (local use, tests).
        ``admit_factory``: resolves and describes ``factory`` (``None``: a factory is refused)."""
        sizes = self._sizes()
        self.check_source()
        if self.factory is not None:
            if admit_factory is None:
                raise ValueError("model.factory: only a service resolves factories (the operator's allowed modules "
                                 "and entry points); submit the job to one")
            return admit_factory(factory=self.factory, args=self.args or {}, block=self.block or "",
                                 seq_len=sizes["seq_len"], vocab_size=sizes.get("vocab_size"))
        for source in ("init_from", "config"):
            path = getattr(self, source)
            if path is None:
                continue
            directory = admit_checkpoint(path) if admit_checkpoint is not None else path
            if source == "init_from" and self.family is ModelFamily.LLAMA:
                return model_config_from_hf(directory, **sizes)
            return hf_model_config(directory, weights=source == "init_from", **sizes)
        preset = self.preset
        if self.family in (ModelFamily.HF, ModelFamily.FACTORY):
            raise ValueError(f"model.family {self.family.value!r} needs "
                             + ("model.init_from or model.config" if self.family is ModelFamily.HF else "model.factory"))
        if self.family is not None and "preset" not in self.model_fields_set:
            preset = "tiny" if self.family is ModelFamily.GPT else f"{self.family.value}-tiny"
        if preset is None:
            missing = {"n_layers", "d_model", "n_heads", "seq_len"} - set(sizes)
            if missing:
                raise ValueError(f"model.preset is null, so give model.{', model.'.join(sorted(missing))} too")
            return ModelConfig(family=self.family or ModelFamily.GPT, **sizes)
        base = MODEL_PRESETS[preset]
        if self.family is not None and self.family is not base.family:
            raise ValueError(f"model.family is {self.family.value!r} but model.preset {preset!r} is a "
                             f"{base.family.value!r} model")
        return replace(base, **sizes)


def _check_factory_args(args: dict[str, Any]) -> None:
    bad = [k for k in args if not k.isidentifier()]
    if bad:
        raise ValueError(f"model.args: {bad[:3]} are not keyword argument names")
    if len(json.dumps(args)) > FACTORY_ARGS_MAX_BYTES:
        raise ValueError(f"model.args is over {FACTORY_ARGS_MAX_BYTES} bytes of JSON; a factory takes a few sizes "
                         "and names")


class _DataChecks(ConfigModel):
    """What only the wire can tell of ``data``: a ``blend`` given but empty (the config reads ``()`` as none),
    and one naming a dataset twice as written (two names of one directory are found at admission, by
    :class:`~meridian.service.data_access.DataAccess`)."""

    @field_validator("blend", check_fields=False)
    @classmethod
    def _blend_names_datasets_once(cls, blend: tuple[BlendEntry, ...]) -> tuple[BlendEntry, ...]:
        if not blend:
            raise ValueError('an empty blend names no data: give at least one prepared dataset ({"dataset": DIR, '
                             '"weight": W}), or leave data.blend out to train on data.source')
        seen: set[str] = set()
        for entry in blend:
            path = entry.dataset.rstrip("/") or "/"
            if path in seen:
                raise ValueError(f"names dataset {entry.dataset!r} twice; name each dataset once, with the weight "
                                 "of all the samples it should give")
            seen.add(path)
        return blend


DataSpec = config_model(DataConfig, "DataSpec", _DataChecks, source={"min_length": 1, "max_length": 4096})
WanSpec = config_model(WanConfig, "WanSpec")
ValidationSpec = config_model(ValidationConfig, "ValidationSpec")
DiLoCoSpec = config_model(DiLoCoConfig, "DiLoCoSpec")


class TrainingSpec(Strict):
    """How long and how to train: steps, batch sizes, AdamW's schedule, the seed and the precision."""

    steps: int = config_field(TrainConfig, "steps")
    global_batch: int = config_field(TrainConfig, "global_batch")
    micro_batch: int = config_field(TrainConfig, "micro_batch")
    lr: float = config_field(OptimConfig, "lr")
    min_lr_ratio: float = config_field(OptimConfig, "min_lr_ratio")
    warmup_steps: int = config_field(OptimConfig, "warmup_steps")
    weight_decay: float = config_field(OptimConfig, "weight_decay")
    grad_clip: float = config_field(OptimConfig, "grad_clip")
    seed: int = config_field(TrainConfig, "seed")
    precision: Precision = config_field(JobRequest, "precision")
    compile: bool = config_field(TrainConfig, "compile")
    activation_checkpointing: ActivationCheckpointing | Literal["auto"] = Field(
        AUTO, description="Per transformer block: 'none', 'selective' (matmul and attention outputs kept), 'full' "
        "(the block recomputed in backward), or 'auto': none where the layout fits in device memory, else the "
        "planner's choice.")

    def optim(self) -> OptimConfig:
        return OptimConfig(lr=self.lr, min_lr_ratio=self.min_lr_ratio, warmup_steps=self.warmup_steps,
                           weight_decay=self.weight_decay, grad_clip=self.grad_clip)


class LinkSpec(Strict):
    """Declared figures of the link between two datacenters (used when no probe was run)."""

    between: list[DCName] = Field(..., min_length=2, max_length=2, description="The two datacenters it joins.")
    rtt_ms: float = config_field(DeclaredLink, "rtt_ms", description="Round-trip time between them, in ms.")
    gbps: float = config_field(DeclaredLink, "gbps", description="Bandwidth per direction, in Gbit/s.")

    def to_request(self) -> DeclaredLink:
        return DeclaredLink(a=self.between[0], b=self.between[1], rtt_ms=self.rtt_ms, gbps=self.gbps)


WorkersPerDC = Annotated[int, Field(**WORKERS_PER_DC.as_kwargs())]


class TopologySpec(Strict):
    """Where the job runs: which datacenters, how many workers in each, and what the links between them are."""

    datacenters: list[DCName] | Literal["auto"] = Field(
        AUTO, max_length=64, description="Datacenters to run in, by their nodes' `datacenter` label, in order; "
        "'auto': every datacenter with live nodes.")
    workers_per_datacenter: WorkersPerDC | dict[DCName, WorkersPerDC] | Literal["auto"] = Field(
        AUTO, description="Workers in each datacenter: one number for all, or a number per datacenter; 'auto': as "
        "many as fit.")
    min_workers: int = config_field(TopologyRequest, "min_workers")
    links: list[LinkSpec] = Field(default_factory=list, max_length=256, description="Declared figures of the links "
                                  "between datacenters, for the planner where no probe has measured them.")

    def to_request(self) -> TopologyRequest:
        workers = self.workers_per_datacenter
        return TopologyRequest(
            datacenters=None if self.datacenters == AUTO else tuple(self.datacenters),
            workers_per_datacenter=tuple(workers.items()) if isinstance(workers, dict) else _or_auto(workers),
            min_workers=self.min_workers,
        )


class ParallelismSpec(Strict):
    """Model parallelism inside each data-parallel replica; 'auto' leaves a size to the planner."""

    tp: bounded(ParallelConfig, "tp") | Literal["auto"] = Field(  # type: ignore[valid-type]
        AUTO, description="Tensor-parallel size: ranks of one node that split every layer; 'auto': the planner "
        "chooses.")
    pp: bounded(ParallelConfig, "pp") | Literal["auto"] = Field(  # type: ignore[valid-type]
        AUTO, description="Pipeline stages: consecutive groups of layers, micro-batches flowing between them; "
        "'auto': the planner chooses.")
    schedule: PipelineSchedule = config_field(ParallelismRequest, "schedule")
    virtual_stages: bounded(ParallelConfig, "virtual_stages") | Literal["auto"] = Field(  # type: ignore[valid-type]
        AUTO, description="Model chunks per pipeline rank (the 'interleaved-1f1b' schedule when > 1); 'auto': the "
        "planner chooses (1 with the 'gpipe' schedule).")
    sequence_parallel: bool | Literal["auto"] = Field(
        AUTO, description="With tensor parallelism: norms and the residual stream sharded along the sequence; "
        "'auto': on wherever tp > 1.")
    stages_span_datacenters: bool | Literal["auto"] = Field(
        AUTO, description="true: pipeline stages may sit in different datacenters; false: each replica stays "
        "inside one; 'auto': the planner decides.")

    def to_request(self) -> ParallelismRequest:
        return ParallelismRequest(tp=_or_auto(self.tp), pp=_or_auto(self.pp), schedule=self.schedule,
                                  virtual_stages=_or_auto(self.virtual_stages),
                                  sequence_parallel=_or_auto(self.sequence_parallel),
                                  stages_span_dcs=_or_auto(self.stages_span_datacenters))


_REQUEST_SYNC: SyncConfig = default_of(JobRequest, "sync")


class SyncSpec(Strict):
    """How gradients (or, for DiLoCo, parameters) travel between the datacenters' replicas."""

    strategy: Literal[(AUTO, *(s.value for s in SyncStrategy))] = Field(  # type: ignore[valid-type]
        _REQUEST_SYNC.strategy.value if _REQUEST_SYNC.strategy else AUTO,
        description="flat: one all-reduce over every rank, as DDP; hierarchical: reduce-scatter in each datacenter, "
        "all-reduce of the shards across, all-gather; diloco and streaming-diloco: each datacenter trains on its own "
        "between outer steps; 'auto': the planner chooses and the plan's explanation says why.")
    bucket_mb: float | None = config_field(
        SyncConfig, "bucket_mb", default=_REQUEST_SYNC.bucket_mb,
        description="Flat sync's (DDP's) gradient buckets, about this many MiB (fp32). The hierarchical engine syncs "
                    "per FSDP2 unit (a transformer block) and DiLoCo per fragment, so a job naming either refuses it. "
                    "Omitted or null: for a flat plan the planner sizes them so backward has several to overlap (the "
                    "plan's bucket_mb says what it chose; null for every other strategy)",
    )
    shard_optimizer: bool = Field(
        True, description="Optional, and only true: the optimizer state is always sharded inside each datacenter by "
        "FSDP2 and replicated across datacenters. false (a replicated optimizer) is refused: it would send the "
        "same inter-DC bytes and hold more memory.")
    overlap: bool = config_field(SyncConfig, "overlap")
    inter_dc_chunk_mb: float = config_field(SyncConfig, "inter_dc_chunk_mb")
    compression: Compression = config_field(SyncConfig, "compression")
    delay_one_step: bool = config_field(SyncConfig, "delay_one_step")
    local_lookahead: bool = config_field(SyncConfig, "local_lookahead")
    lookahead_after: int | None = config_field(SyncConfig, "lookahead_after")
    lookahead_when_exposed: float | None = config_field(SyncConfig, "lookahead_when_exposed")
    diloco: DiLoCoSpec | None = Field(None, description="Knobs of the diloco and streaming-diloco strategies; "  # type: ignore[valid-type]
                                      "null: their defaults (with 'auto', the planner's choice).")

    @field_validator("shard_optimizer")
    @classmethod
    def _sharded_only(cls, value: bool) -> bool:
        if not value:
            raise ValueError("sync.shard_optimizer=false (a replicated optimizer) is no longer offered: the optimizer "
                             "state is sharded inside each datacenter by FSDP2 and replicated across datacenters, "
                             "which sends the same inter-DC bytes with less memory; remove the field")
        return value

    @model_validator(mode="after")
    def _per_step_knobs(self) -> SyncSpec:
        """A job that names its strategy cannot set what only another uses: DDP's bucket size with hierarchical sync
        or DiLoCo, per-step sync's overlap switch with DiLoCo (an ``auto`` job reads in the plan's explanation why
        they go unused)."""
        if self.strategy == SyncStrategy.HIERARCHICAL.value and self.bucket_mb is not None:
            raise ValueError("sync.bucket_mb does not apply with sync.strategy 'hierarchical': it syncs each FSDP2 unit "
                             "(a transformer block) as backward completes it, in sync.inter_dc_chunk_mb chunks across "
                             "datacenters; remove sync.bucket_mb (it sizes flat sync's DDP buckets)")
        if self.strategy not in (SyncStrategy.DILOCO.value, SyncStrategy.STREAMING_DILOCO.value):
            return self
        why = (f"with sync.strategy {self.strategy!r}: DiLoCo syncs each block inside the datacenter with FSDP2 and "
               "exchanges parameter deltas across datacenters every H steps, in sync.inter_dc_chunk_mb chunks")
        if self.bucket_mb is not None:
            raise ValueError(f"sync.bucket_mb does not apply {why}; remove sync.bucket_mb")
        if not self.overlap:
            raise ValueError(f"sync.overlap=false does not apply {why} (streaming DiLoCo overlaps its outer sync "
                             "with sync.diloco.overlap_steps); remove sync.overlap")
        return self

    def to_config(self) -> SyncConfig:
        """``auto`` is ``strategy=None``: the planner chooses (and picks the DiLoCo knobs itself)."""
        strategy = _or_auto(self.strategy)
        return SyncConfig(
            strategy=None if strategy is None else SyncStrategy(strategy), bucket_mb=self.bucket_mb,
            overlap=self.overlap, inter_dc_chunk_mb=self.inter_dc_chunk_mb,
            compression=self.compression, delay_one_step=self.delay_one_step, local_lookahead=self.local_lookahead,
            lookahead_after=self.lookahead_after, lookahead_when_exposed=self.lookahead_when_exposed,
            diloco=None if self.diloco is None else self.diloco.to_config(),
        )


class CheckpointSpec(Strict):
    """Durable checkpoints in the job's storage, and the in-memory snapshots recovery resumes from."""

    interval_steps: int = config_field(TrainConfig, "checkpoint_every", description="0: no periodic checkpoints")
    keep_final: bool = config_field(JobRequest, "keep_final")
    snapshot_every: bounded(TrainConfig, "snapshot_every") | Literal["auto"] = Field(  # type: ignore[valid-type]
        AUTO, description="Steps between the elastic ranks' in-memory state snapshots: a failure trains up to k - 1 "
        "steps again. 'auto': every step while a snapshot costs the loop under 5% of its time (or under 10 ms), "
        "else widened as measured (a GPU's multi-GB shard), each widening announced as a job event.")


MlflowSpec = config_model(MlflowTracking, "MlflowSpec", uri={"max_length": 4096})
WandbSpec = config_model(WandbTracking, "WandbSpec")


class TrackingSpec(Strict):
    """Experiment trackers rank 0 logs every step to, with the config and plan as hyperparameters (each needs its
    library installed where the job runs: ``pip install 'meridian-train[tracking]'``)."""

    tensorboard: bool = config_field(TrackingConfig, "tensorboard")
    mlflow: MlflowSpec | None = None  # type: ignore[valid-type]
    wandb: WandbSpec | None = None  # type: ignore[valid-type]

    def to_config(self) -> TrackingConfig:
        return TrackingConfig(tensorboard=self.tensorboard,
                              mlflow=None if self.mlflow is None else self.mlflow.to_config(),
                              wandb=None if self.wandb is None else self.wandb.to_config())


class ResumeSpec(Strict):
    """Start from another job's checkpoint: its weights, optimizer state, schedule position and data position, in
    whatever layout this job is given; the model, the tokenizer and the data must match it unless reset."""

    job: str | None = Field(None, min_length=1, max_length=32, pattern=r"^[A-Za-z0-9_-]+$",
                            description="The id of an ended job of yours whose newest checkpoint this job starts from")
    checkpoint: str | None = Field(None, min_length=1, max_length=4096,
                                   description="A checkpoint folder (step-N) or a job's checkpoint directory (its "
                                   "newest step): a path under the service's data roots or a URL under its URL roots")
    reset: list[ResetPart] = Field(default_factory=list, max_length=len(ResetPart),
                                   description="Start these afresh, a new phase: 'optimizer' (AdamW from zero), "
                                   "'schedule' (steps and learning rate from step 0), 'data' (the sample order from "
                                   "its start; the data, tokenizer, seed and global batch may then differ)")

    @model_validator(mode="after")
    def _check(self) -> ResumeSpec:
        self.to_request()
        return self

    def to_request(self) -> ResumeRequest:
        return ResumeRequest(job=self.job or "", checkpoint=self.checkpoint or "", reset=tuple(self.reset))


class JobSpec(Strict):
    """A training job: what to train (model, data), how (training, sync, parallelism) and where (topology)."""

    name: str = Field(..., min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9 _.:-]*$",
                      description="A name for people, shown in listings, events and the summary; need not be unique.")
    model: ModelSpec = ModelSpec()
    data: DataSpec = DataSpec()  # type: ignore[valid-type]
    training: TrainingSpec
    topology: TopologySpec = TopologySpec()
    parallelism: ParallelismSpec = ParallelismSpec()
    sync: SyncSpec = SyncSpec()
    wan: WanSpec | None = Field(None, description="Emulate the link between datacenters inside the application, "  # type: ignore[valid-type]
                                "for tests and benchmarks on one host; null: the links as they are.")
    checkpoint: CheckpointSpec = CheckpointSpec()
    validation: ValidationSpec | None = Field(None, description="Evaluate on the held-out split while "  # type: ignore[valid-type]
                                              "training; null: only the final evaluation.")
    tracking: TrackingSpec | None = Field(None, description="Experiment trackers rank 0 logs to (TensorBoard, "
                                          "MLflow, W&B); null: none.")
    priority: int = config_field(JobRequest, "priority")
    resume_from: ResumeSpec | None = Field(None, description="Start from another job's checkpoint instead of step 0 "
                                           "(weights, optimizer, schedule and data position); null: from scratch.")

    @model_validator(mode="after")
    def _check(self) -> JobSpec:
        # Any ValueError here becomes a 422 naming the field. A checkpoint (init_from) is not read here: the
        # service reads it only once its path is admitted (the routes' to_request), which checks the rest.
        if self.model.source is None:
            self.to_request()
        else:
            self.model.check_source()
        return self

    def to_request(self, owner: str = "", *, admit_checkpoint: CheckpointGate | None = None,
                   admit_factory: FactoryGate | None = None) -> JobRequest:
        """The one conversion at the edge; every check beyond a single field's bounds is the request's own.
        ``admit_checkpoint``, ``admit_factory``: see :meth:`ModelSpec.to_config` (the service's routes always pass
        them). A Hugging Face or factory model's ``auto`` tensor/pipeline sizes are 1: Meridian's own tensor and
        pipeline parallelism splits its builtin families only."""
        t = self.training
        model = self.model.to_config(admit_checkpoint, admit_factory)
        parallelism = self.parallelism.to_request()
        if not model.family.is_builtin:
            parallelism = replace(parallelism, tp=parallelism.tp or 1, pp=parallelism.pp or 1)
        return JobRequest(
            name=self.name, model=model, data=self.data.to_config(), optim=t.optim(),
            steps=t.steps, global_batch=t.global_batch, micro_batch=t.micro_batch, seed=t.seed, precision=t.precision,
            compile=t.compile, activation_checkpointing=_or_auto(t.activation_checkpointing),
            topology=self.topology.to_request(), parallelism=parallelism,
            links=tuple(link.to_request() for link in self.topology.links), sync=self.sync.to_config(),
            wan=None if self.wan is None else self.wan.to_config(),
            checkpoint_every=self.checkpoint.interval_steps, keep_final=self.checkpoint.keep_final,
            snapshot_every=_or_auto(self.checkpoint.snapshot_every),
            priority=self.priority, owner=owner,
            validation=None if self.validation is None else self.validation.to_config(),
            tracking=None if self.tracking is None else self.tracking.to_config(),
            resume_from=None if self.resume_from is None else self.resume_from.to_request(),
        )


def admitted_request(spec: JobSpec, owner: str, admit_checkpoint: CheckpointGate,
                     admit_factory: FactoryGate | None = None) -> JobRequest:
    """``spec`` as the service's routes convert it: ``init_from`` / ``config`` admitted before they are read, a
    factory only from what the operator allowed, and what the model's shape then makes invalid (e.g. tp not
    dividing its heads) a 422 like any other spec error."""
    try:
        return spec.to_request(owner, admit_checkpoint=admit_checkpoint, admit_factory=admit_factory)
    except ValueError as e:
        raise InvalidJob(str(e)) from None


# -- responses -----------------------------------------------------------------------------------------
class Progress(BaseModel):
    step: int = 0
    total_steps: int = 0
    loss: float | None = None
    first_loss: float | None = None
    tokens_per_s: float | None = None
    lr: float | None = None
    inter_dc_bytes: float | None = None
    eta_s: float | None = None
    data_s: float | None = None
    """Seconds of the last step spent waiting for the data loader (rank 0)."""
    compute_s: float | None = None
    """Seconds of the last step spent computing (rank 0): step time minus data and communication waits."""
    step_s: float | None = None
    mfu: float | None = None
    """Model FLOPs utilisation vs the measured matmul peak of the workers' devices."""
    updated_at: float | None = None


class WorkerPlacement(BaseModel):
    rank: int
    node_id: str
    datacenter: str
    hostname: str = ""
    pid: int = 0
    device: str = ""


_PLACEMENT = TypeAdapter(list[WorkerPlacement])


@functools.lru_cache(maxsize=64)
def _stored_placement(text: str) -> tuple[WorkerPlacement, ...]:
    """A job's stored placement, validated once per distinct text: every GET of a job of N ranks built N models
    (most of such a GET's time at 3,072 ranks). The models are shared between responses, which only read them."""
    return tuple(_PLACEMENT.validate_json(text))


class JobPublic(BaseModel):
    id: str
    name: str
    owner: str
    priority: int
    state: str
    reason: str
    message: str
    progress: Progress
    placement: list[WorkerPlacement]
    plan: dict[str, Any] | None
    result: dict[str, Any] | None
    spec: dict[str, Any]
    created_at: float
    updated_at: float
    started_at: float | None
    finished_at: float | None

    @classmethod
    def from_record(cls, job: JobRecord) -> JobPublic:
        progress = {k: v for k, v in (job.progress or {}).items() if k in Progress.model_fields}
        if job.placement_json is not None and job.placement:
            placement = list(_stored_placement(job.placement_json))
        else:
            keep = WorkerPlacement.model_fields.keys()
            placement = [WorkerPlacement(**{k: v for k, v in p.items() if k in keep}) for p in job.placement or []]
        return cls(
            id=job.id, name=job.name, owner=job.owner, priority=job.priority, state=job.status.state.value,
            reason=job.status.reason, message=job.status.message, progress=Progress(**progress),
            placement=placement,
            plan=job.plan, result=job.result, spec=job.spec, created_at=job.created_at,
            updated_at=job.updated_at, started_at=job.started_at, finished_at=job.finished_at,
        )


class JobList(BaseModel):
    jobs: list[JobPublic]
    count: int


class EventPublic(BaseModel):
    id: int
    time: float
    kind: str
    message: str
    data: dict[str, Any]

    @classmethod
    def from_event(cls, e: Event) -> EventPublic:
        return cls(id=e.id, time=e.time, kind=e.kind, message=e.message, data=e.data)


class EventList(BaseModel):
    events: list[EventPublic]
    earlier: int | None = None
    """With ``newest``: how many of the job's events (after ``after``) come before the first one listed."""


class ErrorBody(BaseModel):
    detail: str


class LogLine(BaseModel):
    rank: int
    stream: Literal["out", "err"]
    line: str


class LogList(BaseModel):
    job_id: str
    lines: list[LogLine]

    @classmethod
    def from_entries(cls, job_id: str, entries: list[Any]) -> LogList:
        return cls(job_id=job_id, lines=[LogLine(rank=e.rank, stream=e.stream, line=e.line) for e in entries])
