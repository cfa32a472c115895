"""Streaming DiLoCo at int4, or the sparse outer update: which one a link too slow for the first calls for, and why.

:func:`choose_lowcomm` is :func:`~meridian.service.planning.sync_choice.choose_sync` followed by this check: a pure
function of the link, the model's size, a step's compute and the DiLoCo setting ``choose_sync`` picked, with its
link arithmetic. That setting keeps
the link at most half busy by raising H, up to the papers' largest (500); past that, or where a fragment's sync
outlasts the third of H it may stay in flight, compute waits for the link. Estimated compute utilisation of
streaming DiLoCo: per H steps of compute ``H × c``, what is not hidden is the larger of every fragment's sync beyond
its overlap steps and the link's backlog (the whole model's sync beyond H steps):

    u = H c / (H c + max(fragments × max(0, fragment_s - overlap c), outer_s - H c))

(Plain DiLoCo, for a model that syncs in one piece, is the case of one fragment and no overlap: its sync blocks.)
Below :data:`MIN_UTILISATION` (plain DiLoCo: below the share of a step ``choose_sync`` lets its sync take) the
sparse outer update takes over (SparseLoCo, Sarfi et al. 2025, arXiv:2508.15706:
top-k of each block of the outer delta, 2-bit values, error feedback in each rank's shard), with the same fragments
and an H as small as the evidence floor, the overlap and the link allow; the plan's explanation gives both
utilisations and the bytes. Never reads the cluster or the store.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, replace
from typing import Any

from meridian.service.planning.sync_choice import (
    BYTES_FP32,
    LINK_BUSY_MAX,
    MAX_H,
    MAX_OVERLAP_FRACTION,
    MIN_INNER_STEPS,
    OUTER_BYTES_PER_PARAM,
    WARMUP_FRACTION,
    SyncChoice,
    choose_sync,
    cross_dc_time,
    max_overlap_steps,
    overlap_steps_for,
)
from meridian.workers.contracts.config import Compression, DiLoCoConfig, OuterMerge, SyncStrategy
from meridian.workers.contracts.wire_format import sparse_bytes_per_element
from meridian.workers.sync.diloco_schedule import warmup_cycle

MIN_UTILISATION = 0.97
"""The compute utilisation streaming DiLoCo at int4 must keep on the link; below it ``auto`` goes sparse."""
PER_STEP_LIMIT: float = inspect.signature(choose_sync).parameters["per_step_limit"].default
"""``choose_sync``'s default share of a step per-step sync may cost; plain DiLoCo's outer sync gets half of it."""
SPARSE_DENSITY = 0.02
SPARSE_VALUE_BITS = 2
SPARSE_BLOCK = 4096
SPARSE_EVIDENCE = ("meridian bench lowcomm, nano, 2 datacenters, H 32, 4,096 steps of 64 samples, seeds 0 and 1: "
                   "held-out loss +0.75% and +0.94% of per-step sync's at 3,435x fewer bytes (streaming DiLoCo, one "
                   "fragment, 2-bit), plain DiLoCo +0.33% and +1.26%, with each datacenter keeping its unsent "
                   "residual and an outer lr of 2 without momentum; SparseLoCo's restart from the outer weights was "
                   "+9% to +15% at 2,048 steps; on tiny (875k parameters), 8,192 steps of 16 samples of text read "
                   "1.44 times, with the datacenters' weights averaged in bf16 at the last step, the streaming row "
                   "was -0.76% and -0.18% at 2,862x fewer bytes, torchft's full-precision streaming DiLoCo +1.46% "
                   "and +1.25% (at 4,096 steps without the average: +6.0% and +5.3%, torchft's +2.6% and +1.6%)")
"""What the sparse setting ``auto`` picks measured; the plan's explanation quotes it."""
SPARSE_BYTES_PER_PARAM = sparse_bytes_per_element(SPARSE_DENSITY, SPARSE_VALUE_BITS, SPARSE_BLOCK)
"""What the sparse outer update puts on the wire per parameter (kept values, their positions, the blocks' scales)."""


@dataclass(frozen=True)
class SparseChoice:
    diloco: DiLoCoConfig
    """Streaming DiLoCo with the sparse knobs set."""
    explanation: str
    outer_sync_s: float
    """Estimated seconds one whole-model sparse sync takes on the link."""
    int4_utilisation: float
    """Estimated compute utilisation of the int4 streaming setting it replaces."""
    utilisation: float
    """Estimated compute utilisation of the sparse setting."""


def streaming_utilisation(cfg: DiLoCoConfig, *, wire_bytes: float, compute_s: float, rtt_ms: float, gbps: float,
                          num_dcs: int) -> float:  # fmt: skip
    """Estimated share of the wall streaming DiLoCo ``cfg`` computes when a whole model's sync puts ``wire_bytes``
    on the link (module docstring)."""
    frag_s = cross_dc_time(wire_bytes / cfg.fragments, rtt_ms=rtt_ms, gbps=gbps, num_dcs=num_dcs)
    outer_s = cross_dc_time(wire_bytes, rtt_ms=rtt_ms, gbps=gbps, num_dcs=num_dcs)
    cycle = cfg.inner_steps * compute_s
    waited = max(cfg.fragments * max(0.0, frag_s - cfg.overlap_steps * compute_s), outer_s - cycle, 0.0)
    return cycle / (cycle + waited)


def sparse_instead(dense: DiLoCoConfig, *, rtt_ms: float, gbps: float, num_params: int, compute_s: float,
                   num_dcs: int, steps: int | None, head: str,
                   target: float = MIN_UTILISATION) -> SparseChoice | None:  # fmt: skip
    """The sparse setting where ``dense`` (streaming DiLoCo, or plain DiLoCo for a model that syncs in one piece, with int4
    outer deltas) is estimated to compute less than ``target`` of the time; ``None`` where it keeps up. ``target``:
    :data:`MIN_UTILISATION` for streaming; plain DiLoCo's own, the share of a step its blocking sync may take
    (:func:`~meridian.service.planning.sync_choice.choose_sync`), so the sparse update replaces it only where H cannot
    grow enough to amortise the int4 sync. ``steps``: the job's length, for the streaming warm-up (as
    :func:`~meridian.service.planning.sync_choice.choose_sync` sizes it); ``head``: the explanation's start (why not
    per-step sync)."""
    link = dict(rtt_ms=rtt_ms, gbps=gbps, num_dcs=num_dcs)
    int4_wire = OUTER_BYTES_PER_PARAM * num_params
    u4 = streaming_utilisation(dense, wire_bytes=int4_wire, compute_s=compute_s, **link)
    if u4 >= target - 1e-9:
        return None
    wire = SPARSE_BYTES_PER_PARAM * num_params
    fragments = dense.fragments
    streaming = fragments > 1 or dense.overlap_steps > 0
    outer_s = cross_dc_time(wire, **link)
    frag_s = cross_dc_time(wire / fragments, **link)
    if streaming:  # as choose_sync sizes streaming DiLoCo: the overlap covers a fragment, the link half busy
        overlap = overlap_steps_for(frag_s, compute_s)
        wanted = max(MIN_INNER_STEPS, math.ceil(overlap / MAX_OVERLAP_FRACTION),
                     math.ceil(outer_s / (LINK_BUSY_MAX * compute_s)))  # fmt: skip
        h = min(MAX_H - MAX_H % fragments, math.ceil(wanted / fragments) * fragments)
        overlap = min(overlap, max_overlap_steps(h))
        cycle = warmup_cycle(h, fragments, overlap)
        warmup = int(WARMUP_FRACTION * steps) // cycle * cycle if steps and cycle < h else 0
    else:  # plain DiLoCo's sync blocks: H amortises it to the utilisation it must keep
        overlap, warmup, cycle = 0, 0, 0
        h = min(MAX_H, max(MIN_INNER_STEPS, math.ceil(outer_s / ((1 / target - 1) * compute_s))))
    # each datacenter keeps what it has not sent, and the outer step adds every datacenter's sent progress whole
    # (outer lr = the number of datacenters, no momentum; measured with 2: SPARSE_EVIDENCE)
    cfg = replace(dense, inner_steps=h, overlap_steps=overlap, warmup_steps=warmup, sparse_density=SPARSE_DENSITY,
                  sparse_value_bits=SPARSE_VALUE_BITS, sparse_block=SPARSE_BLOCK, sparse_keep_unsent=True,
                  outer_lr=float(num_dcs), outer_momentum=0.0, merge=OuterMerge.KEEP_PROGRESS)  # fmt: skip
    u = streaming_utilisation(cfg, wire_bytes=wire, compute_s=compute_s, **link)
    int4_frag_s = cross_dc_time(int4_wire / fragments, **link)
    kind = "streaming DiLoCo" if streaming else "DiLoCo"
    each = f"per fragment, H={dense.inner_steps}, overlap {dense.overlap_steps}" if streaming else \
        f"a blocking sync every H={dense.inner_steps} steps"  # fmt: skip
    behind = f", each in flight behind {overlap} inner step(s)" if streaming else ""
    why = (f"{head}; {kind} with 4-bit outer deltas ({int4_wire / fragments / 1e6:.3g} MB, {int4_frag_s * 1e3:.0f} ms "
           f"{each}) would compute about {u4:.1%} of the time, under the {target:.0%} it must keep, so the "
           f"sparse outer update: each sync sends the top {SPARSE_DENSITY:.0%} of every {SPARSE_BLOCK:,}-element "
           f"block in {SPARSE_VALUE_BITS} bits with error feedback ({SPARSE_BYTES_PER_PARAM:.4f} bytes per parameter, "
           f"{wire / fragments / 1e6:.3g} MB, {frag_s * 1e3:.0f} ms{' per fragment' if streaming else ''}) over H={h} "
           f"steps{behind}, each datacenter keeping what it has not sent: about {u:.1%} computing, "
           f"{BYTES_FP32 * h / SPARSE_BYTES_PER_PARAM:.0f}x fewer inter-DC bytes than per-step sync ({SPARSE_EVIDENCE})")
    if warmup:
        assert steps is not None
        ratio = BYTES_FP32 * steps / (SPARSE_BYTES_PER_PARAM * (warmup / cycle + (steps - warmup) / h))
        why += (f"; the first {warmup} steps sync every {cycle} steps (warm-up), so {ratio:.0f}x fewer over the "
                f"whole {steps}-step job")
    name = "streaming-diloco" if streaming else "diloco"
    return SparseChoice(cfg, f"Sync '{name}' sparse (chosen: {why}).", outer_s, u4, u)


def choose_lowcomm(*, sparse: bool = True, **kwargs: Any) -> SyncChoice:
    """:func:`~meridian.service.planning.sync_choice.choose_sync` (``kwargs``: its arguments), with the sparse outer
    update in place of an int4 DiLoCo choice that cannot keep compute busy on the link (:func:`sparse_instead`).
    ``sparse``: whether it may (not for a job that set its own ``sync.compression``)."""
    choice = choose_sync(**kwargs)
    if not sparse or not choice.strategy.is_diloco or choice.compression is not Compression.INT4:
        return choice
    assert choice.diloco is not None
    compute_s, rtt_ms, gbps = kwargs["compute_s"], kwargs["rtt_ms"], kwargs["gbps"]
    head = (f"per-step sync would leave {choice.har_exposed_s * 1e3:.0f} ms per step exposed "
            f"({choice.har_exposed_s / compute_s:.0%} of {compute_s * 1e3:.1f} ms of compute per step) on "
            f"{rtt_ms:g} ms RTT / {gbps:g} Gbit/s for {BYTES_FP32 * kwargs['num_params'] / 1e6:.1f} MB of fp32 "
            "parameters")  # fmt: skip
    plain = choice.strategy is SyncStrategy.DILOCO
    # plain DiLoCo is sized so its blocking sync takes half the per-step limit of a step; streaming must keep 97%
    target = 1 / (1 + kwargs.get("per_step_limit", PER_STEP_LIMIT) / 2) if plain else MIN_UTILISATION
    chosen = sparse_instead(choice.diloco, rtt_ms=rtt_ms, gbps=gbps, num_params=kwargs["num_params"],
                            compute_s=compute_s, num_dcs=kwargs.get("num_dcs", 2), steps=kwargs.get("steps"),
                            head=head, target=target)  # fmt: skip
    if chosen is None:
        return choice
    return SyncChoice(choice.strategy, chosen.diloco, chosen.explanation, choice.har_exposed_s, chosen.outer_sync_s)
