"""Why a plan is what it is, in words: the explanation a plan carries and the reasons a job cannot run.

Text only, from decisions already made (the chosen candidate, the others, the sync strategy); nothing
here chooses anything, so changing a sentence never changes a plan.
"""

from __future__ import annotations

from meridian.service.jobs import JobRequest
from meridian.service.planning.candidates import Candidate
from meridian.service.planning.cost_model import Figures
from meridian.workers.contracts.config import SyncStrategy


def explain(best: Candidate, others: list[Candidate], rejected: list[Candidate], unit: str) -> str:
    lay, e = best.layout, best.estimate
    where = ", ".join(f"{r} replica(s) in {dc}" if not lay.pp_spans_dcs else f"{r} stage(s) in {dc}"
                      for dc, r in zip(best.datacenters, best.replicas_per_dc, strict=True))
    text = (f"{lay.devices} worker(s), one per {unit}: {best.name} ({where}); estimated {e.step_s * 1e3:.0f} ms/step, "
            f"{e.memory_bytes / 2**20:.0f} MiB per device, {e.inter_dc_bytes / 2**20:.1f} MiB across datacenters per step.")
    if others:
        nxt = others[0]
        text += f" Next best: {nxt.name} at {nxt.estimate.step_s * 1e3:.0f} ms/step ({_why_slower(best, nxt)})."
    if rejected:
        text += f" Rejected {len(rejected)} layout(s) that do not fit in memory (e.g. {rejected[0].name}: {rejected[0].rejected})."
    return text


def _why_slower(best: Candidate, other: Candidate) -> str:
    a, b = best.estimate, other.estimate
    diffs = {
        "pipeline bubble and transfers": (b.compute_s + b.pp_comm_s) - (a.compute_s + a.pp_comm_s),
        "tensor-parallel all-reduces": b.tp_comm_s - a.tp_comm_s,
        "exposed gradient sync": b.exposed_dp_s - a.exposed_dp_s,
    }
    reason, delta = max(diffs.items(), key=lambda kv: kv[1])
    return f"+{delta * 1e3:.0f} ms of {reason}" if delta > 0 else "slower overall"


def sync_reason(strategy: SyncStrategy, *, requested: bool, num_dcs: int, pp: int = 1, spans: bool = True,
                encoded: bool = False) -> str:
    if requested:
        return f" Sync '{strategy.value}' (as requested)."
    if strategy is SyncStrategy.HIERARCHICAL and pp > 1 and num_dcs == 1:
        return (" Sync 'hierarchical' inside the datacenter (chosen: pipeline stages need it; in one datacenter "
                "it is a reduce-scatter + all-gather, the traffic of a flat all-reduce).")
    if strategy is SyncStrategy.HIERARCHICAL and encoded and num_dcs == 1:
        return (" Sync 'hierarchical' inside the datacenter (chosen: sync.compression applies to hierarchical sync "
                "only; with one datacenter no gradient crosses a datacenter link, so nothing is encoded; in one "
                "datacenter it is a reduce-scatter + all-gather, the traffic of a flat all-reduce).")
    if strategy is SyncStrategy.HIERARCHICAL:
        return (" Sync 'hierarchical' (chosen: reduce-scatter inside each datacenter, all-reduce of 1/N of the "
                "gradients across, all-gather inside).")
    if num_dcs == 1:
        return " Sync 'flat' (chosen: one datacenter, so a flat all-reduce is the shortest path)."
    if not spans:
        return " Sync 'flat' (chosen: its estimated step time beat hierarchical sync for this layout)."
    return " Sync 'flat' inside each datacenter (chosen: pipeline stages, not gradients, cross datacenters)."


def no_layout_reason(request: JobRequest, devices: dict[str, list[int]], unit: str) -> str:
    par = request.parallelism
    if par.tp and all(s < par.tp for v in devices.values() for s in v):
        biggest = max((s for v in devices.values() for s in v), default=0)
        return f"parallelism.tp={par.tp} needs {par.tp} devices on one node; the largest node has {biggest} {unit} slot(s)"
    return (f"no (tp, pp, dp) layout of {request.model.n_layers} layers / {request.model.n_heads} heads fits "
            f"{sum(sum(v) for v in devices.values())} workers with global_batch={request.global_batch}")


def no_fit_in_memory_reason(cands: list[Candidate], figures: Figures) -> str:
    """Why no candidate layout fits in device memory, with the smallest footprint and what to change."""
    smallest = min(cands, key=lambda c: c.estimate.memory_bytes)
    guessed = "" if figures.device_memory_known else (
        ", a guess: no GPU node's memory could be read; `meridian probe --compute` measures it")
    lay = smallest.layout
    gpipe = (f"parallelism.schedule '1f1b' (GPipe holds the activations of all {lay.micro_batches} micro-batches "
             f"at once, 1F1B at most {min(lay.pp, lay.micro_batches)}), "
             if lay.schedule == "gpipe" and lay.tp * lay.pp > 1 and lay.micro_batches > lay.pp else "")
    return (
        f"no layout fits in device memory ({figures.device_memory_bytes / 2**30:.1f} GB{guessed}): "
        + "; ".join(f"{c.name} {c.rejected.split(',')[0]}" for c in sorted(cands, key=lambda c: c.layout.tp)[:4])
        + f". The smallest footprint is {smallest.name} at {smallest.estimate.memory_bytes / 2**30:.1f} GB; "
        f"use {gpipe}a smaller model, a smaller micro_batch, or devices with more memory"
    )
