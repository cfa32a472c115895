"""Wire schemas: ``JobSpec`` in, ``JobPublic`` out (never an internal record).

Every model forbids unknown fields and bounds every number, so a typo or an absurd value is a 422 that
names the field. :meth:`JobSpec.to_request` turns a spec into the service's frozen
:class:`~meridian.service.jobs.JobRequest`; errors from the typed configs (e.g. ``d_model`` not divisible
by ``n_heads``) surface as validation errors on the right field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from meridian.service.jobs import DeclaredLink, JobRequest, ParallelismRequest, TopologyRequest
from meridian.service.store import Event, JobRecord
from meridian.workers.contracts.config import (
    MODEL_PRESETS,
    Compression,
    DataConfig,
    DiLoCoConfig,
    ModelConfig,
    OptimConfig,
    SyncConfig,
    SyncStrategy,
    WanConfig,
)

DCName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$", description="a datacenter label value")]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSpec(Strict):
    """A preset, optionally with sizes overridden; or all sizes given explicitly (``preset: null``)."""

    preset: Literal[tuple(MODEL_PRESETS)] | None = "tiny"  # type: ignore[valid-type]
    n_layers: int | None = Field(None, ge=1, le=128)
    d_model: int | None = Field(None, ge=8, le=32768)
    n_heads: int | None = Field(None, ge=1, le=256)
    seq_len: int | None = Field(None, ge=8, le=32768)
    vocab_size: int | None = Field(None, ge=2, le=262144)

    def to_config(self) -> ModelConfig:
        sizes = self.model_dump(exclude={"preset"}, exclude_none=True)
        if self.preset is None:
            missing = {"n_layers", "d_model", "n_heads", "seq_len"} - set(sizes)
            if missing:
                raise ValueError(f"model.preset is null, so give model.{', model.'.join(sorted(missing))} too")
            return ModelConfig(**sizes)
        base = MODEL_PRESETS[self.preset]
        return ModelConfig(**{**base.__dict__, **sizes})


class DataSpec(Strict):
    source: str = Field(
        "builtin:python-reference", min_length=1, max_length=4096,
        description="'builtin:python-reference' or an absolute path to a UTF-8 text file on every node",
    )
    max_bytes: int = Field(8_000_000, ge=1024, le=10**10)


class TrainingSpec(Strict):
    steps: int = Field(..., ge=1, le=10_000_000)
    global_batch: int = Field(..., ge=1, le=1_048_576)
    micro_batch: int = Field(..., ge=1, le=65_536)
    lr: float = Field(1e-3, gt=0, le=10)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(10, ge=0, le=10_000_000)
    weight_decay: float = Field(0.1, ge=0, le=10)
    grad_clip: float = Field(1.0, ge=0, le=1e6)
    seed: int = Field(0, ge=0, le=2**31 - 1)
    precision: Literal["auto", "fp32", "bf16"] = "auto"


class LinkSpec(Strict):
    """Declared figures of the link between two datacenters (used when no probe was run)."""

    between: list[DCName] = Field(..., min_length=2, max_length=2)
    rtt_ms: float = Field(..., ge=0, le=10_000)
    gbps: float = Field(..., gt=0, le=10_000)


class TopologySpec(Strict):
    datacenters: list[DCName] | Literal["auto"] = Field("auto", max_length=64)
    workers_per_datacenter: Annotated[int, Field(ge=1, le=4096)] | dict[DCName, Annotated[int, Field(ge=1, le=4096)]] | Literal["auto"] = "auto"
    min_workers: int = Field(1, ge=1, le=65536)
    links: list[LinkSpec] = Field(default_factory=list, max_length=256)


class ParallelismSpec(Strict):
    tp: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = "auto"
    pp: Annotated[int, Field(ge=1, le=128)] | Literal["auto"] = "auto"
    schedule: Literal["1f1b", "gpipe"] = "1f1b"
    stages_span_datacenters: bool | Literal["auto"] = "auto"


class DiLoCoSpec(Strict):
    """Knobs of the 'diloco' / 'streaming-diloco' strategies (defaults: DiLoCoConfig's)."""

    inner_steps: int = Field(50, ge=1, le=100_000, description="H: inner steps between syncs of a fragment")
    fragments: int = Field(1, ge=1, le=1024, description="streaming: fragments synced on a staggered schedule")
    outer_lr: float = Field(0.7, gt=0, le=10)
    outer_momentum: float = Field(0.9, ge=0, lt=1)
    nesterov: bool = True
    overlap_steps: int = Field(0, ge=0, le=100_000, description="streaming: inner steps a sync stays in flight")
    mix_alpha: float = Field(0.5, ge=0, le=1)


class SyncSpec(Strict):
    strategy: Literal["auto", "flat", "hierarchical", "diloco", "streaming-diloco"] = "auto"
    bucket_mb: float = Field(4.0, gt=0, le=1024)
    shard_optimizer: bool = True
    overlap: bool = True
    inter_dc_chunk_mb: float = Field(1.0, gt=0, le=1024)
    compression: Literal["none", "bf16", "int8"] = "none"
    diloco: DiLoCoSpec | None = None


class WanSpec(Strict):
    """Emulate the inter-datacenter link in the application (off unless given)."""

    rtt_ms: float = Field(..., ge=0, le=10_000)
    gbps: float = Field(..., gt=0, le=10_000)


class CheckpointSpec(Strict):
    interval_steps: int = Field(0, ge=0, le=10_000_000, description="0: no periodic checkpoints")


class JobSpec(Strict):
    name: str = Field(..., min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9 _.:-]*$")
    model: ModelSpec = ModelSpec()
    data: DataSpec = DataSpec()
    training: TrainingSpec
    topology: TopologySpec = TopologySpec()
    parallelism: ParallelismSpec = ParallelismSpec()
    sync: SyncSpec = SyncSpec()
    wan: WanSpec | None = None
    checkpoint: CheckpointSpec = CheckpointSpec()
    priority: int = Field(0, ge=-100, le=100, description="higher runs first; FIFO within a priority")

    @model_validator(mode="after")
    def _check(self) -> JobSpec:
        self.to_request()  # any ValueError here becomes a 422 naming the field
        return self

    def to_request(self, owner: str = "") -> JobRequest:
        t = self.training
        if t.micro_batch > t.global_batch:
            raise ValueError(f"training.micro_batch ({t.micro_batch}) must be <= training.global_batch ({t.global_batch})")
        topo = self.topology
        workers = topo.workers_per_datacenter
        if isinstance(workers, dict):
            if topo.datacenters != "auto":
                extra = set(workers) - set(topo.datacenters)
                if extra:
                    raise ValueError(
                        f"topology.workers_per_datacenter names {sorted(extra)} which are not in topology.datacenters"
                    )
            workers_req: int | tuple[tuple[str, int], ...] | None = tuple(workers.items())
        else:
            workers_req = None if workers == "auto" else workers
        for link in topo.links:
            if link.between[0] == link.between[1]:
                raise ValueError(f"topology.links: a link joins two different datacenters, got {link.between}")
        par = self.parallelism
        if par.tp != "auto" and (self.model.to_config().n_heads % par.tp):
            raise ValueError(f"parallelism.tp ({par.tp}) must divide model.n_heads ({self.model.to_config().n_heads})")
        if par.pp != "auto" and par.pp > self.model.to_config().n_layers:
            raise ValueError(f"parallelism.pp ({par.pp}) must be <= model.n_layers ({self.model.to_config().n_layers})")
        if self.sync.strategy == "flat" and self.sync.compression != "none":
            raise ValueError("sync.compression applies only to the 'hierarchical' strategy's inter-DC step")
        forced_diloco = self.sync.strategy in ("diloco", "streaming-diloco")
        if self.sync.diloco is not None and not forced_diloco:
            raise ValueError("sync.diloco needs sync.strategy 'diloco' or 'streaming-diloco' (with 'auto' the "
                             "planner picks H and fragments itself)")
        diloco = DiLoCoConfig(**self.sync.diloco.model_dump()) if self.sync.diloco else None
        return JobRequest(
            name=self.name, model=self.model.to_config(),
            data=DataConfig(source=self.data.source, max_bytes=self.data.max_bytes),
            optim=OptimConfig(lr=t.lr, min_lr_ratio=t.min_lr_ratio, warmup_steps=t.warmup_steps,
                              weight_decay=t.weight_decay, grad_clip=t.grad_clip),
            steps=t.steps, global_batch=t.global_batch, micro_batch=t.micro_batch, seed=t.seed, precision=t.precision,
            topology=TopologyRequest(
                datacenters=None if topo.datacenters == "auto" else tuple(topo.datacenters),
                workers_per_datacenter=workers_req, min_workers=topo.min_workers,
            ),
            parallelism=ParallelismRequest(
                tp=None if par.tp == "auto" else par.tp, pp=None if par.pp == "auto" else par.pp,
                schedule=par.schedule,
                stages_span_dcs=None if par.stages_span_datacenters == "auto" else par.stages_span_datacenters,
            ),
            links=tuple(DeclaredLink(a=lk.between[0], b=lk.between[1], rtt_ms=lk.rtt_ms, gbps=lk.gbps) for lk in topo.links),
            sync_strategy=None if self.sync.strategy == "auto" else SyncStrategy(self.sync.strategy),
            sync=SyncConfig(strategy=SyncStrategy(self.sync.strategy) if forced_diloco else SyncStrategy.HIERARCHICAL,
                            diloco=diloco, bucket_mb=self.sync.bucket_mb, shard_optimizer=self.sync.shard_optimizer,
                            overlap=self.sync.overlap, inter_dc_chunk_mb=self.sync.inter_dc_chunk_mb,
                            compression=Compression(self.sync.compression)),
            wan=WanConfig(rtt_ms=self.wan.rtt_ms, gbps=self.wan.gbps) if self.wan else None,
            checkpoint_every=self.checkpoint.interval_steps, priority=self.priority, owner=owner,
        )


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
        return cls(
            id=job.id, name=job.name, owner=job.owner, priority=job.priority, state=job.status.state.value,
            reason=job.status.reason, message=job.status.message, progress=Progress(**progress),
            placement=[WorkerPlacement(**{k: v for k, v in p.items() if k in WorkerPlacement.model_fields})
                       for p in job.placement or []],
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
