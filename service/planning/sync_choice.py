"""Per-step hierarchical sync, DiLoCo or streaming DiLoCo: which one a link and a model call for, and why.

A pure function of the inter-DC link (RTT, bandwidth), the model's size and the step's compute time, with
the same link arithmetic as :mod:`meridian.service.planning.cost_model`:

- ``hierarchical`` while its inter-DC all-reduce hides behind backward (about 2/3 of the step's compute)
  well enough that the step slows by at most ``max_slowdown``: it keeps training identical to one process.
- Otherwise ``diloco`` (Douillard et al. 2023, arXiv:2311.08105): an outer sync moves the same bytes as one
  HAR step (each DC's fp32 copy of the model), but only every H steps; H is the smallest that brings the
  averaged cost under half of ``max_slowdown`` (at most 500: the papers' range; quality drops beyond).
- ``streaming-diloco`` (Douillard et al. 2025, arXiv:2501.18512) when one blocking outer sync would stall
  for longer than a whole step: the model is cut into fragments whose all-reduce runs behind the next
  inner step(s), so the link carries one fragment at a time instead of stalling compute.

Never reads the cluster or the store: the planner passes what it measured or was told.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meridian.workers.contracts.config import DiLoCoConfig, SyncStrategy

BYTES_FP32 = 4
MAX_H = 500
MIN_H = 4


@dataclass(frozen=True)
class SyncChoice:
    strategy: SyncStrategy
    diloco: DiLoCoConfig | None
    """H, fragments, overlap for the DiLoCo strategies; ``None`` for ``hierarchical``."""
    explanation: str
    har_exposed_s: float
    """Estimated seconds per step the per-step inter-DC all-reduce would not hide."""
    outer_sync_s: float
    """Estimated seconds one whole-model sync across DCs takes on the link."""


def cross_dc_time(nbytes: float, *, rtt_ms: float, gbps: float, num_dcs: int) -> float:
    """One all-reduce of ``nbytes`` per DC across ``num_dcs`` DCs over the shared link (cost_model's HAR step 2)."""
    if num_dcs < 2:
        return 0.0
    one_way = rtt_ms / 2000.0
    bps = gbps * 1e9 / 8
    if num_dcs == 2:
        return one_way + nbytes / bps
    return 2 * (num_dcs - 1) * one_way + 2 * (num_dcs - 1) / num_dcs * nbytes / bps


def choose_sync(
    *,
    rtt_ms: float,
    gbps: float,
    num_params: int,
    compute_s: float,
    num_dcs: int = 2,
    overlap: bool = True,
    bucket_mb: float = 4.0,
    max_slowdown: float = 0.10,
) -> SyncChoice:
    """Pick the data-parallel sync across DCs. ``compute_s``: one optimizer step's forward+backward time."""
    for name, value in (("gbps", gbps), ("num_params", num_params), ("compute_s", compute_s), ("max_slowdown", max_slowdown)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    if rtt_ms < 0:
        raise ValueError(f"rtt_ms must be >= 0, got {rtt_ms!r}")
    model_bytes = BYTES_FP32 * num_params
    sync_s = cross_dc_time(model_bytes, rtt_ms=rtt_ms, gbps=gbps, num_dcs=num_dcs)
    hidden = compute_s * 2 / 3 if overlap else 0.0
    exposed = max(sync_s - hidden, rtt_ms / 2000.0 if overlap and num_dcs > 1 else 0.0) if num_dcs > 1 else 0.0
    link = f"{rtt_ms:g} ms RTT / {gbps:g} Gbit/s"
    size = f"{model_bytes / 1e6:.1f} MB of fp32 parameters"
    step = f"{compute_s * 1e3:.1f} ms of compute per step"
    if num_dcs < 2 or exposed <= max_slowdown * compute_s:
        why = (f"per-step sync costs about {exposed * 1e3:.1f} ms per step not hidden behind backward "
               f"({exposed / compute_s:.0%} of {step}; limit {max_slowdown:.0%}) on {link} for {size}, so "
               "training stays step-for-step identical to one process")
        return SyncChoice(SyncStrategy.HIERARCHICAL, None, f"Sync 'hierarchical' (chosen: {why}).", exposed, sync_s)

    budget = max_slowdown / 2 * compute_s
    h = min(MAX_H, max(MIN_H, math.ceil(sync_s / budget)))
    capped = " (capped at the papers' largest H; the link stays the bottleneck)" if sync_s / budget > MAX_H else ""
    head = (f"per-step sync would leave {exposed * 1e3:.0f} ms per step exposed ({exposed / compute_s:.0%} of "
            f"{step}) on {link} for {size}")
    if sync_s <= compute_s:
        cfg = DiLoCoConfig(inner_steps=h)
        why = (f"{head}; DiLoCo syncs the whole model once every H={h} steps ({sync_s * 1e3:.0f} ms each, "
               f"{sync_s / h / compute_s:.1%} of a step on average){capped}")
        return SyncChoice(SyncStrategy.DILOCO, cfg, f"Sync 'diloco' (chosen: {why}).", exposed, sync_s)

    buckets = max(1, math.ceil(model_bytes / (bucket_mb * 2**20)))
    fragments = max(1, min(math.ceil(sync_s / compute_s), buckets, h // 2))
    # fragments <= H/2 leaves room for at least one step of overlap before a fragment's next sync
    overlap_steps = min(max(1, math.ceil(sync_s / fragments / compute_s)), h // fragments - 1)
    cfg = DiLoCoConfig(inner_steps=h, fragments=fragments, overlap_steps=overlap_steps)
    spread = (f"sends {fragments} fragments on a staggered schedule over H={h} steps" if fragments > 1 else
              f"syncs every H={h} steps as one fragment (the model fills {buckets} gradient bucket(s); a smaller "
              "sync.bucket_mb allows more fragments)")
    why = (f"{head}; a whole-model sync would take {sync_s * 1e3:.0f} ms, longer than a step, so streaming "
           f"DiLoCo {spread}, each sync in flight behind {overlap_steps} inner step(s){capped}")
    return SyncChoice(SyncStrategy.STREAMING_DILOCO, cfg, f"Sync 'streaming-diloco' (chosen: {why}).", exposed, sync_s)
