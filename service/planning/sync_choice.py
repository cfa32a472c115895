"""Per-step hierarchical sync, DiLoCo or streaming DiLoCo: which one a link and a model call for, and why.

A pure function of the inter-DC link (RTT, bandwidth), the model's size and the step's compute time, with
the same link arithmetic as :mod:`meridian.service.planning.cost_model`:

- ``hierarchical`` while its inter-DC all-reduce hides behind the last micro-batch's backward (about 2/3 of
  that micro-batch's compute; earlier micro-batches only accumulate, as the cost model counts it) well enough
  that the step slows by at most ``max_slowdown``: it keeps training identical to one process.
  What hides is bounded by what syncs last (``last_sync_mb``: the hierarchical engine's last FSDP2 unit, the
  embedding and head, :func:`~meridian.service.planning.cost_model.last_synced_bytes`): its exchange (its latency
  whole, its share of the transfer) always follows backward, so a model that syncs in one piece hides nothing.
- Otherwise ``hierarchical`` one step late at a local look-ahead (``sync.delay_one_step`` with
  ``sync.local_lookahead``), when the whole sync fits behind one step's compute well enough that the step,
  counting the look-ahead's extra AdamW pass (``optimizer_step_s``), slows by at most ``max_slowdown`` and by
  less than exact sync would: every step's exact global-batch update is still committed, in order; each gradient
  is taken where the datacenter's own update of the step before led instead of where the exact one did
  (loss at equal tokens: :data:`LOOKAHEAD_EVIDENCE`). Only with the sharded optimizer (``lookahead``), and only
  for a job longer than the exact steps it starts with (``lookahead_after``).
- Otherwise ``hierarchical`` with the inter-DC exchange in bf16 (error feedback), when halving the bytes keeps
  the slowdown within ``per_step_limit``: still one sync per step, every step's rounding carried into the
  next (``meridian bench lowcomm --strategies har+bf16 --rtt-ms 21 --inter-dc-gbps 1``, nano, 1,024 steps:
  held-out loss at equal tokens -1.0% and +0.2% of fp32's with seeds 0 and 1, i.e. within the noise).
- Otherwise ``streaming-diloco`` (Douillard et al. 2025, arXiv:2501.18512) with 4-bit outer deltas and
  error feedback, whenever the model syncs in at least two such pieces: ``fragments`` fragments, each
  sync in flight behind ``overlap_steps`` inner steps, enough to cover 1.5× the link's latency plus the
  fragment's transfer (:data:`OVERLAP_MARGIN`), so compute never waits for the WAN. H is the largest of: the evidence floor
  ``min_inner_steps`` (what ``meridian bench lowcomm`` measured to stay near per-step sync's loss while
  cutting bytes 100×+), room for the overlap (a third of H, :data:`MAX_OVERLAP_FRACTION`), and the link's capacity (one
  compressed model per H steps keeps the link at most half busy).
- Plain ``diloco`` (Douillard et al. 2023, arXiv:2311.08105) when the model syncs in one piece (nothing to
  stream): its blocking outer sync is amortised over H steps to under half of ``per_step_limit``.
- Neither DiLoCo for a job shorter than :data:`DILOCO_MIN_STEPS`, where no measurement says its loss stays
  near per-step sync's: such a job gets the per-step sync (exact, the look-ahead, or bf16) that costs its step
  least, over the limit, and the explanation says by how much.

Never the one-step-late variant without the look-ahead (``sync.delay_one_step`` alone): it hides the whole
sync behind the next step, but ``meridian bench lowcomm`` measured its loss at equal tokens 42-44% above
per-step sync's (``har-delayed``, nano, 1,024 steps of 16 samples, lr 5e-3, seeds 0 and 1), so ``auto`` cannot
offer it as "the same training"; a job that accepts stale gradients asks for it.

H is capped at 500 (the papers' range; quality drops beyond). Never reads the cluster or the store: the
planner passes what it measured or was told.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meridian.workers.contracts.config import Compression, DiLoCoConfig, SyncStrategy
from meridian.workers.contracts.wire_format import int4_bytes_per_element
from meridian.workers.sync.diloco_schedule import warmup_cycle

BYTES_FP32 = 4
MAX_H = 500
MIN_H = 4
OUTER_COMPRESSION = Compression.INT4
"""Outer deltas in 4 bits with error feedback: in ``bench lowcomm`` as close to per-step sync's loss as int8."""
OUTER_BYTES_PER_PARAM = int4_bytes_per_element()
"""What the int4 outer deltas put on the wire per parameter (nibbles and the blocks' scales)."""
LOOKAHEAD_EVIDENCE = ("held-out loss at equal tokens -1.4% and +1.0% of exact per-step sync's with seeds 0 and 1, "
                      "against +45% one step late without the look-ahead: meridian bench lowcomm --strategies "
                      "har-lookahead har-delayed --rtt-ms 0 --inter-dc-gbps 100 --steps 1024 --global-batch 16 "
                      "--micro-batch 8, nano, lr 5e-3, the first 50 steps exact")
"""What the one-step-late look-ahead costs, measured; the plan's explanation quotes it."""
MIN_INNER_STEPS = 32
"""Evidence floor for H (``bench lowcomm``): fewer inner steps buy little loss and cost bytes."""
FRAGMENTS = 4
LINK_BUSY_MAX = 0.5
OVERLAP_MARGIN = 1.5
"""Streaming: each fragment's sync gets inner steps covering 1.5× its modelled time. The ranks drift a few steps
apart between syncs, and a real link adds what the model leaves out (``meridian bench lowcomm --lab``, 100 ms /
0.1 Gbit/s: fragments modelled at ~55 ms behind 7 steps of 8 ms waited 12-25 ms each; 10 steps waited for
nothing, at the same loss). With 31 ms steps (64 samples) the rule gives 3 steps; 4 waited no less: what is left
is the faster rank waiting for the slower one."""
MAX_OVERLAP_FRACTION = 1 / 3
"""Streaming: a fragment's sync lands within the first third of its H steps; H grows to keep it so. ``bench
lowcomm`` (nano, 4,096 steps of 16 samples, H 32, 4 fragments, the keep-progress merge, int8 and int4, seeds 0
and 1): overlap 7 and 10 stayed within 1.3% of per-step sync's held-out loss, 13 reached +2.9% (with the default
mix merge: 7 gave +1.9-3.3%, longer overlaps not measured)."""
DILOCO_MIN_STEPS = 1024
"""The shortest job ``auto`` may hand to (streaming) DiLoCo. ``meridian bench lowcomm`` measured its loss near
per-step sync's on jobs of 1,024 to 4,096 steps (H 32, a warm-up of 40% of the steps); on the 60-step demo job
over the lab's 21 ms link (``meridian bench lab-demo --probe``, 2026-11-28) ``auto`` picked streaming DiLoCo with
int4 deltas, and its final loss was 3.2% above exact sync's: with H = 32, a 60-step job syncs its outer model
about twice."""
EXACT_PREFERRED_WITHIN = 0.01
"""A job too short for DiLoCo keeps exact fp32 sync unless another per-step sync saves this share of a step."""
WARMUP_FRACTION = 0.4
"""Share of the job's steps synced on the short warm-up cycle (``bench lowcomm``: of 0, 100, 200 and 400 warm-up
steps in 1,024, 400 came closest to per-step sync's loss, for +25% bytes; over 2,048 steps of 64 samples, 400
warm-up steps against none: int8 +0.8% against +1.7% of per-step sync's loss, int4 +0.7% against +0.6%)."""


MAX_SLOWDOWN = 0.05
"""The most exact fp32 sync (or its one-step-late look-ahead) may slow a step before another sync is chosen."""


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
    compression: Compression = Compression.NONE
    """Encoding of what crosses DCs (for DiLoCo: the outer deltas)."""
    local_lookahead: bool = False
    """``hierarchical`` one step late at a local look-ahead (``sync.delay_one_step`` + ``sync.local_lookahead``)."""


def cross_dc_time(nbytes: float, *, rtt_ms: float, gbps: float, num_dcs: int) -> float:
    """One all-reduce of ``nbytes`` per DC across ``num_dcs`` DCs over the shared link (cost_model's HAR step 2)."""
    if num_dcs < 2:
        return 0.0
    one_way = rtt_ms / 2000.0
    bps = gbps * 1e9 / 8
    if num_dcs == 2:
        return one_way + nbytes / bps
    return 2 * (num_dcs - 1) * one_way + 2 * (num_dcs - 1) / num_dcs * nbytes / bps


def overlap_steps_for(frag_s: float, compute_s: float) -> int:
    """Streaming: the inner steps a fragment's sync stays in flight, ``OVERLAP_MARGIN`` × its modelled time
    ``frag_s`` over a step's compute ``compute_s`` (at least 1)."""
    return max(1, math.ceil(OVERLAP_MARGIN * frag_s / compute_s))


def max_overlap_steps(inner_steps: int) -> int:
    """The most inner steps a fragment's sync may stay in flight at this H (:data:`MAX_OVERLAP_FRACTION`)."""
    return max(1, min(inner_steps - 1, int(inner_steps * MAX_OVERLAP_FRACTION)))


def choose_sync(
    *,
    rtt_ms: float,
    gbps: float,
    num_params: int,
    compute_s: float,
    num_dcs: int = 2,
    overlap: bool = True,
    last_sync_mb: float = 4.0,
    max_slowdown: float = MAX_SLOWDOWN,
    per_step_limit: float = 0.10,
    min_inner_steps: int = MIN_INNER_STEPS,
    steps: int | None = None,
    lookahead: bool = True,
    lookahead_after: int = 20,
    optimizer_step_s: float = 0.0,
    micro_batches: int = 1,
) -> SyncChoice:
    """Pick the data-parallel sync across DCs. ``compute_s``: one optimizer step's forward+backward time;
    ``last_sync_mb``: the MiB of fp32 gradients that sync last, after backward (the hierarchical engine's root
    FSDP2 unit: :func:`~meridian.service.planning.cost_model.last_synced_bytes`);
    ``max_slowdown``: the most exact fp32 sync (or its one-step-late look-ahead) may slow a step;
    ``per_step_limit``: the most per-step sync in bf16 may, before DiLoCo takes over; ``steps``: the job's
    length, for the DiLoCo warm-up (none when unknown); ``lookahead``: whether the job's engine can run the
    look-ahead (it needs the sharded optimizer); ``lookahead_after``: the exact steps it starts with (a job no
    longer than that never looks ahead, so it is not offered); ``optimizer_step_s``: one AdamW pass over a
    rank's optimizer shard, what the look-ahead adds to every step (from the compute probe; 0 when unknown);
    ``micro_batches``: a replica's micro-batches per step, of which only the last one's backward can hide exact
    sync (gradients sync while it runs; the earlier ones only accumulate); one step late the sync has the whole
    next step."""
    for name, value in (("gbps", gbps), ("num_params", num_params), ("compute_s", compute_s), ("last_sync_mb", last_sync_mb),
                        ("max_slowdown", max_slowdown), ("per_step_limit", per_step_limit),
                        ("micro_batches", micro_batches)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    if rtt_ms < 0:
        raise ValueError(f"rtt_ms must be >= 0, got {rtt_ms!r}")
    model_bytes = BYTES_FP32 * num_params
    pieces = max(1, math.ceil(model_bytes / (last_sync_mb * 2**20)))  # the sync, in pieces of what syncs last
    backward_s = compute_s * 2 / 3 / micro_batches  # the last micro-batch's backward: cost_model.estimate's window

    def exposed_s(wire_bytes: float) -> tuple[float, float]:
        """(seconds per step the per-step sync of ``wire_bytes`` leaves exposed, its whole duration)."""
        if num_dcs < 2:
            return 0.0, 0.0
        total = cross_dc_time(wire_bytes, rtt_ms=rtt_ms, gbps=gbps, num_dcs=num_dcs)
        if not overlap:
            return total, total
        one_way = rtt_ms / 2000.0  # what syncs last pays its latency whole and its share of the transfer
        last = one_way + (total - one_way) / pieces
        return max(total - backward_s, last), total

    exposed, sync_s = exposed_s(model_bytes)
    link = f"{rtt_ms:g} ms RTT / {gbps:g} Gbit/s"
    size = f"{model_bytes / 1e6:.1f} MB of fp32 parameters"
    step = f"{compute_s * 1e3:.1f} ms of compute per step"
    if num_dcs < 2 or exposed <= max_slowdown * compute_s:
        behind = "backward" if micro_batches == 1 else f"the last of {micro_batches} micro-batches' backward"
        why = (f"per-step sync costs about {exposed * 1e3:.1f} ms per step not hidden behind {behind} "
               f"({exposed / compute_s:.0%} of {step}; limit {max_slowdown:.0%}) on {link} for {size}, so "
               "training stays step-for-step identical to one process")
        return SyncChoice(SyncStrategy.HIERARCHICAL, None, f"Sync 'hierarchical' (chosen: {why}).", exposed, sync_s)

    head = (f"per-step sync would leave {exposed * 1e3:.0f} ms per step exposed ({exposed / compute_s:.0%} of "
            f"{step}) on {link} for {size}")
    # one step late the sync has a whole step to land; the look-ahead adds one AdamW pass to every step
    behind_a_step = max(0.0, sync_s - compute_s) + optimizer_step_s
    long_enough = steps is None or steps > lookahead_after
    if lookahead and long_enough and behind_a_step <= max_slowdown * compute_s and behind_a_step < exposed:
        why = (f"{head}, over the {max_slowdown:.0%} that exact sync may cost; after the first {lookahead_after} "
               f"steps, synced exactly while AdamW's moments are young, each step's sync ({sync_s * 1e3:.0f} ms) is "
               f"applied one step late and runs behind the next step ({behind_a_step * 1e3:.0f} ms a step exposed or "
               "spent on the look-ahead's extra AdamW pass); that "
               "step computes at this datacenter's own update of the step before (a local look-ahead) while "
               f"every datacenter commits the exact global update of every step, in order ({LOOKAHEAD_EVIDENCE})")
        return SyncChoice(SyncStrategy.HIERARCHICAL, None, f"Sync 'hierarchical' one step late (chosen: {why}).",
                          behind_a_step, sync_s, local_lookahead=True)
    exposed_bf16, sync_bf16_s = exposed_s(model_bytes / 2)
    if exposed_bf16 <= per_step_limit * compute_s:
        why = (f"{head}, over the {max_slowdown:.0%} that exact fp32 sync may cost; with the inter-DC exchange in "
               f"bf16 (half the bytes, each step's rounding carried into the next by error feedback) "
               f"{exposed_bf16 * 1e3:.0f} ms ({exposed_bf16 / compute_s:.0%}; limit {per_step_limit:.0%}), still one "
               "sync per step")
        return SyncChoice(SyncStrategy.HIERARCHICAL, None, f"Sync 'hierarchical' (chosen: {why}).", exposed_bf16,
                          sync_bf16_s, Compression.BF16)
    head += f", {exposed_bf16 * 1e3:.0f} ms even in bf16"
    if steps is not None and steps < DILOCO_MIN_STEPS:
        return _cheapest_per_step(head, steps, compute_s, lookahead_after, (exposed, sync_s),
                                  (behind_a_step, sync_s) if lookahead and long_enough else None,
                                  (exposed_bf16, sync_bf16_s))  # fmt: skip
    wire = OUTER_BYTES_PER_PARAM * num_params
    outer_s = cross_dc_time(wire, rtt_ms=rtt_ms, gbps=gbps, num_dcs=num_dcs)
    fragments = min(FRAGMENTS, pieces)
    if fragments < 2:
        budget = per_step_limit / 2 * compute_s
        h = min(MAX_H, max(min_inner_steps, math.ceil(outer_s / budget)))
        capped = " (capped at the papers' largest H; the link stays the bottleneck)" if outer_s / budget > MAX_H else ""
        cfg = DiLoCoConfig(inner_steps=h)
        why = (f"{head}; the model syncs in one piece, so nothing can stream: DiLoCo syncs 4-bit outer "
               f"deltas ({wire / 1e6:.2f} MB, {outer_s * 1e3:.0f} ms) once every H={h} steps, "
               f"{outer_s / h / compute_s:.1%} of a step on average{capped}")
        return SyncChoice(SyncStrategy.DILOCO, cfg, f"Sync 'diloco' (chosen: {why}).", exposed, outer_s,
                          OUTER_COMPRESSION)
    frag_s = cross_dc_time(wire / fragments, rtt_ms=rtt_ms, gbps=gbps, num_dcs=num_dcs)
    overlap_steps = overlap_steps_for(frag_s, compute_s)
    h_overlap = math.ceil(overlap_steps / MAX_OVERLAP_FRACTION)
    h_link = math.ceil(outer_s / (LINK_BUSY_MAX * compute_s))
    wanted = max(min_inner_steps, h_overlap, h_link)
    h = min(MAX_H - MAX_H % fragments, math.ceil(wanted / fragments) * fragments)
    capped = (f"; capped at H={h}, the papers' largest (H={wanted} would keep up): the link stays the "
              "bottleneck and compute will wait for it" if h < wanted else "")
    overlap_steps = min(overlap_steps, max_overlap_steps(h))
    cycle = warmup_cycle(h, fragments, overlap_steps)
    # a warm-up cycle as long as H itself would sync no more often: none then
    warmup = int(WARMUP_FRACTION * steps) // cycle * cycle if steps and cycle < h else 0
    if warmup:
        assert steps is not None
        job_ratio = model_bytes * steps / (wire * (warmup / cycle + (steps - warmup) / h))
        warm = (f"; the first {warmup} steps sync every {cycle} steps (warm-up: replicas drift apart fastest early), "
                f"so {job_ratio:.0f}x fewer over the whole {steps}-step job")
    else:
        warm = ""
    bounds = [(h_link, f"keeping the link at most {LINK_BUSY_MAX:.0%} busy"), (h_overlap, "room for the overlap"),
              (min_inner_steps, f"the evidence floor H >= {min_inner_steps}")]
    binding = max(bounds, key=lambda b: b[0])[1]
    cfg = DiLoCoConfig(inner_steps=h, fragments=fragments, overlap_steps=overlap_steps, warmup_steps=warmup)
    why = (f"{head}; streaming DiLoCo sends {fragments} fragments of 4-bit outer deltas with error feedback "
           f"({wire / fragments / 1e6:.3f} MB, {frag_s * 1e3:.0f} ms each) on a staggered schedule over H={h} steps "
           f"(set by {binding}), each in flight behind {overlap_steps} inner step(s) ({OVERLAP_MARGIN:g}x its "
           f"time, so compute does not wait for the link); {model_bytes * h / wire:.0f}x fewer inter-DC bytes than "
           f"per-step sync{warm}{capped}")
    return SyncChoice(SyncStrategy.STREAMING_DILOCO, cfg, f"Sync 'streaming-diloco' (chosen: {why}).", exposed,
                      outer_s, OUTER_COMPRESSION)


def _cheapest_per_step(head: str, steps: int, compute_s: float, lookahead_after: int,
                       exact: tuple[float, float], lookahead: tuple[float, float] | None,
                       bf16: tuple[float, float]) -> SyncChoice:  # fmt: skip
    """A job too short for DiLoCo's evidence: the per-step sync whose cost per step (exposed, or spent on the
    look-ahead's extra AdamW pass) is least, exact fp32 unless another saves at least
    :data:`EXACT_PREFERRED_WITHIN` of a step. Each pair: (seconds a step, the sync's whole duration)."""
    options = [("exact fp32", exact, Compression.NONE, False)]
    if lookahead is not None:
        options.append((f"one step late at a local look-ahead after the first {lookahead_after} steps", lookahead,
                        Compression.NONE, True))  # fmt: skip
    options.append(("with the inter-DC exchange in bf16 (error feedback)", bf16, Compression.BF16, False))
    cheapest = min(options, key=lambda o: o[1][0])
    if exact[0] - cheapest[1][0] < EXACT_PREFERRED_WITHIN * compute_s:
        cheapest = options[0]  # saving under 1% of a step is not worth changing the numbers
    name, (cost_s, sync_s), compression, local_lookahead = cheapest
    why = (f"{head}; a {steps}-step job is shorter than the {DILOCO_MIN_STEPS} steps DiLoCo's loss was measured "
           f"on, so training stays per-step: {name}, the cheapest of them here at about {cost_s * 1e3:.0f} ms a "
           f"step ({cost_s / compute_s:.0%} of a step, over the limit)")
    if local_lookahead:
        why += f" ({LOOKAHEAD_EVIDENCE})"
    label = "hierarchical' one step late" if local_lookahead else "hierarchical'"
    return SyncChoice(SyncStrategy.HIERARCHICAL, None, f"Sync '{label} (chosen: {why}).", cost_s, sync_s,
                      compression, local_lookahead=local_lookahead)
