"""The layouts a job could run with: every (tp, pp, stages across datacenters, sync) combination the
cluster can hold, each with its cost-model estimate and, if it cannot fit in device memory, why.

Pure: enumerating never raises and never chooses; :mod:`meridian.service.planning.planner` picks among the
candidates and :mod:`meridian.service.planning.explain` puts the choice into words.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from meridian.service.jobs import JobRequest
from meridian.service.planning.buckets import bucket_mb_for
from meridian.service.planning.cost_model import Estimate, Figures, Layout, estimate, grad_bytes_per_device
from meridian.workers.contracts.config import (
    Compression,
    ParallelConfig,
    Precision,
    SyncStrategy,
    check_model_parallel_sync,
)

TP_SIZES = (1, 2, 4, 8)
MAX_PP = 8


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    datacenters: tuple[str, ...]
    replicas_per_dc: tuple[int, ...]
    """Model replicas placed in each datacenter (stage-spanning layouts: stages per datacenter)."""
    estimate: Estimate
    rejected: str = ""

    @property
    def name(self) -> str:
        lay = self.layout
        parts = [f"tp={lay.tp}", f"pp={lay.pp}" + (" across DCs" if lay.pp_spans_dcs else ""), f"dp={lay.dp}"]
        if lay.dp > 1 and not lay.pp_spans_dcs and lay.num_dcs > 1:
            parts.append("hierarchical" if lay.hierarchical else "flat")
        return " ".join(parts)

    def summary(self) -> dict[str, Any]:
        e = self.estimate
        return {"layout": self.name, "tp": self.layout.tp, "pp": self.layout.pp, "dp": self.layout.dp,
                "stages_span_dcs": self.layout.pp_spans_dcs, "hierarchical": self.layout.hierarchical,
                "est_step_s": round(e.step_s, 6), "memory_gb": round(e.memory_bytes / 2**30, 3),
                "inter_dc_bytes_per_step": int(e.inter_dc_bytes), "rejected": self.rejected}


def enumerate_candidates(request: JobRequest, dcs: tuple[str, ...], devices: dict[str, list[int]],
                         figures: Figures) -> list[Candidate]:
    """Every layout the cluster can run for this request, each with its estimate (unsorted).

    The order is tp, then pp, then stages-within / stages-across, then hierarchical before flat: the
    planner's stable sort keeps it among layouts with equal estimates."""
    tps, pps = _model_parallel_sizes(request)
    spans = (False, True) if request.parallelism.stages_span_dcs is None else (request.parallelism.stages_span_dcs,)
    used = tuple(dc for dc in dcs if devices[dc])
    out: list[Candidate] = []
    for tp, pp, across in itertools.product(tps, pps, spans):
        if not _sync_runs_with(request, tp, pp):
            continue  # the workers refuse it (tensor/pipeline parallelism runs on FSDP2 under hierarchical sync)
        groups = {dc: sum(s // tp for s in devices[dc]) for dc in used}  # TP groups that fit per DC
        if not any(groups.values()):
            continue
        shape = _replicas(groups, used, pp, across, request.global_batch)
        if shape is None:
            continue
        dcs_here, replicas, dp = shape
        for hierarchical in _sync_options(request, across=across, num_dcs=len(dcs_here), pp=pp, tp=tp):
            out.append(_candidate(request, figures, tp=tp, pp=pp, dp=dp, across=across, dcs=dcs_here,
                                  replicas=replicas, hierarchical=hierarchical))
    return out


def _model_parallel_sizes(request: JobRequest) -> tuple[list[int], list[int]]:
    """Tensor-parallel sizes that divide the model's heads and MLP width, and pipeline depths that divide
    its layers (or what the request fixed). A job that asks for periodic checkpoints is left ``tp = pp = 1``
    where it leaves them to the planner: only a data-parallel job writes checkpoints it can resume from."""
    model, par = request.model, request.parallelism
    if request.checkpoint_every:
        return [par.tp or 1], [par.pp or 1]
    tps = [par.tp] if par.tp else [t for t in TP_SIZES
                                   if model.n_heads % t == 0 and model.kv_heads % t == 0 and model.mlp_width % t == 0]
    pps = [par.pp] if par.pp else [1] if model.tie_embeddings else _divisors(model.n_layers, MAX_PP)
    return tps, pps


def _replicas(groups: dict[str, int], used: tuple[str, ...], pp: int, across: bool,
              global_batch: int) -> tuple[tuple[str, ...], tuple[int, ...], int] | None:
    """(datacenters used, replicas — or stages — per datacenter, dp) of a layout, or ``None`` if it cannot run."""
    if across:
        if len(used) < 2 or pp % len(used):
            return None
        per_dc = pp // len(used)
        dp = min(groups[dc] // per_dc for dc in used)
        dcs_here, replicas = used, tuple(per_dc for _ in used)
    else:
        full = _shrink({dc: groups[dc] // pp for dc in used}, global_batch)
        dcs_here = tuple(dc for dc in used if full[dc] > 0)
        replicas = tuple(full[dc] for dc in dcs_here)
        dp = sum(replicas)
    if dp < 1 or dp > global_batch:
        return None
    return dcs_here, replicas, dp


def _sync_runs_with(request: JobRequest, tp: int, pp: int) -> bool:
    """Whether the request's sync knobs can run with ``tp`` × ``pp`` (:func:`check_model_parallel_sync`)."""
    try:
        check_model_parallel_sync(ParallelConfig(tp=tp, pp=pp), request.sync)
    except ValueError:
        return False
    return True


def _sync_options(request: JobRequest, *, across: bool, num_dcs: int, pp: int, tp: int = 1) -> list[bool]:
    """Hierarchical (``True``) and/or flat (``False``) data-parallel sync for a layout."""
    if request.sync.strategy is not None and not across and num_dcs > 1:
        return [request.sync.strategy is SyncStrategy.HIERARCHICAL]
    # tp or pp > 1 runs the hierarchical engine only (on FSDP2; DDP cannot follow a pipeline schedule), and so does
    # a job with an inter-DC encoding: flat sync has no inter-DC step to encode, and its config refuses
    # sync.compression
    only_hierarchical = (across or num_dcs == 1 or pp > 1 or tp > 1
                         or request.sync.compression is not Compression.NONE)
    return [True] if only_hierarchical else [True, False]


def bucket_mb(request: JobRequest, *, tp: int, pp: int) -> float:
    """The job's ``sync.bucket_mb``, or the planner's size for the gradients one device of this layout holds."""
    if request.sync.bucket_mb is not None:
        return request.sync.bucket_mb
    return bucket_mb_for(grad_bytes_per_device(request.model, tp, pp))


def _candidate(request: JobRequest, figures: Figures, *, tp: int, pp: int, dp: int, across: bool,
               dcs: tuple[str, ...], replicas: tuple[int, ...], hierarchical: bool) -> Candidate:
    micro_batches = max(1, -(-request.global_batch // dp // request.micro_batch))
    lay = Layout(
        tp=tp, pp=pp, dp=dp, num_dcs=len(dcs), dp_per_dc=0 if across else min(replicas), pp_spans_dcs=across,
        micro_batch=request.micro_batch, micro_batches=micro_batches, hierarchical=hierarchical,
        shard_optimizer=request.sync.shard_optimizer, overlap=request.sync.overlap,
        schedule=request.parallelism.schedule, bucket_bytes=bucket_mb(request, tp=tp, pp=pp) * 2**20,
        fp32=request.precision is Precision.FP32 or (request.precision is Precision.AUTO and not figures.bf16_autocast),
        encoded=request.sync.strategy is None and request.sync.compression is not Compression.NONE,
    )
    est = estimate(request.model, lay, figures, request.global_batch)
    rejected = ""
    if est.memory_bytes > figures.device_memory_bytes:
        rejected = (f"needs {est.memory_bytes / 2**30:.1f} GB per device, "
                    f"devices have {figures.device_memory_bytes / 2**30:.1f} GB")
    return Candidate(lay, dcs, replicas, est, rejected)


def _shrink(counts: dict[str, int], limit: int) -> dict[str, int]:
    """Remove replicas from the largest datacenter first until at most ``limit`` remain (every replica
    needs at least one sample per step)."""
    counts = dict(counts)
    while sum(counts.values()) > limit:
        biggest = max(counts, key=lambda dc: counts[dc])
        counts[biggest] -= 1
    return counts


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]
