"""Plain-text views of API responses for the CLI and the demo (no colours, no dependencies)."""

from __future__ import annotations

from typing import Any


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "--:--"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def si(x: float | None, unit: str = "") -> str:
    if x is None:
        return "-"
    for factor, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.1f}{prefix}{unit}"
    return f"{x:.0f}{unit}"


def progress_line(job: dict[str, Any], width: int = 24) -> str:
    p = job["progress"]
    total, step = p.get("total_steps") or 0, p.get("step") or 0
    if job["state"] in ("queued", "placing") or not total:
        return f"{job['state']:<9} {job['message']}"
    filled = int(width * step / total)
    loss = f"{p['loss']:.3f}" if p.get("loss") is not None else "-"
    return (
        f"[{'#' * filled}{'.' * (width - filled)}] step {step}/{total}  loss {loss}  "
        f"{si(p.get('tokens_per_s'), ' tok/s')}  ETA {duration(p.get('eta_s'))}{step_split(p)}"
    )


def step_split(p: dict[str, Any]) -> str:
    """Where the last step went: a large data share means the devices sit idle waiting for input."""
    if not p.get("step_s") or p.get("data_s") is None:
        return ""
    out = f"  data {100 * p['data_s'] / p['step_s']:.0f}% compute {100 * (p.get('compute_s') or 0) / p['step_s']:.0f}%"
    return out + (f"  MFU {100 * p['mfu']:.1f}%" if p.get("mfu") is not None else "")


def table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def placement_table(job: dict[str, Any]) -> str:
    rows = [[p["rank"], p["datacenter"], p["node_id"][:12], p.get("hostname", ""), p.get("pid", ""), p.get("device", "")]
            for p in job["placement"]]
    return table(rows, ["rank", "datacenter", "node", "host", "pid", "device"])


def job_table(jobs: list[dict[str, Any]]) -> str:
    rows = []
    for j in jobs:
        p = j["progress"]
        rows.append([j["id"], j["name"][:24], j["state"], f"{p.get('step') or 0}/{p.get('total_steps') or '-'}",
                     f"{p['loss']:.3f}" if p.get("loss") is not None else "-", j["reason"]])
    return table(rows, ["id", "name", "state", "step", "loss", "reason"])


def cluster_view(cluster: dict[str, Any]) -> str:
    rows = []
    for dc in cluster["datacenters"]:
        for n in dc["nodes"]:
            r = n["resources"]
            rows.append([dc["name"], n["node_id"][:12], "alive" if n["alive"] else "DEAD", r["CPU"], r["GPU"],
                         f"{n['available']['CPU']:g}", n["address"]])
    for n in cluster.get("unlabelled_nodes", []):
        rows.append(["(none)", n["node_id"][:12], "alive" if n["alive"] else "DEAD", n["resources"]["CPU"],
                     n["resources"]["GPU"], f"{n['available']['CPU']:g}", n["address"] + (" head" if n["is_head"] else "")])
    return table(rows, ["datacenter", "node", "state", "CPUs", "GPUs", "free CPUs", "address"])


def probe_view(report: dict[str, Any]) -> str:
    rows = [[t["tier"], " ↔ ".join(dict.fromkeys(d or "?" for d in t["datacenters"])),
             f"{t['summary']['latency_us'] / 1e3:.3f}", f"{t['summary']['bandwidth_gbps']:.3f}"]
            for t in report.get("tiers", [])]
    text = table(rows, ["tier", "datacenters", "latency ms (per round)", "bus Gbit/s"]) if rows else "no tier measured"
    skipped = report.get("skipped") or []
    return text + ("\nskipped: " + "; ".join(map(str, skipped)) if skipped else "")


def compute_probe_view(entry: dict[str, Any]) -> str:
    slots = entry["per_slot_flops"]
    return (f"compute probe {entry['key']}: {entry['flops'] / 1e9:.2f} GFLOP/s per worker slot (median of "
            f"{entry['slots']}; {min(slots) / 1e9:.2f}–{max(slots) / 1e9:.2f}), optimizer step "
            f"{entry['optimizer_step_s'] * 1e3:.1f} ms; later plans of this model shape and micro-batch use it")


def held_out(result: dict[str, Any]) -> str:
    """The final held-out loss, or why there is none (a held-out split too small for one sample)."""
    if result.get("eval_loss") is None:
        return f"no held-out loss: {result.get('eval_skipped') or 'not measured'}"
    return f"held-out {result['eval_loss']:.3f}"


def _loss(value: Any) -> str:
    """A loss as ``3.142``, or ``-`` where there is none (``null``: a NaN the workers reported)."""
    return f"{value:.3f}" if isinstance(value, (int, float)) else "-"


def summary(job: dict[str, Any], wall_s: float | None = None, sync_decisions: tuple[str, ...] = ()) -> str:
    """``sync_decisions``: the messages of the job's ``sync_decided`` events (an armed look-ahead's decision)."""
    r, p = job.get("result") or {}, job["progress"]
    lines = [f"job {job['id']} ({job['name']}): {job['state']} — {job['message']}"]
    if r:
        lines += [
            f"  loss            {_loss(r.get('first_loss'))} → {_loss(r.get('final_loss'))} ({held_out(r)})",
            f"  throughput      {si(r['tokens_per_s'], ' tokens/s')} over {r['steps']} steps",
            f"  inter-DC bytes  {si(r['inter_dc_bytes_per_step'], 'B')} per step (all ranks)",
        ]
    elif p.get("step"):
        lines.append(f"  reached step {p['step']}/{p['total_steps']}, loss {p.get('loss')}")
    if wall_s is not None:
        lines.append(f"  wall time       {duration(wall_s)}")
    if job.get("plan"):
        lines += ["  plan"] + ["    " + line for line in plan_block(job["plan"]).splitlines()]
    lines += [f"  sync decided    {m}" for m in sync_decisions]
    if job["placement"]:
        lines += ["", placement_table(job)]
    return "\n".join(lines)


def plan_block(plan: dict[str, Any]) -> str:
    """A plan's short block (at most eight lines; :func:`meridian.service.planning.explain.summary_block` words it),
    or its explanation where the service sent no block (an older service)."""
    return plan.get("summary") or plan["explanation"]


def plan_view(plan: dict[str, Any], *, explain: bool = False) -> str:
    """``meridian plan``'s text: the block, and with ``explain`` the planner's whole reasoning."""
    return plan_block(plan) + (f"\n\nwhy: {plan['explanation']}" if explain else "")


def offline_plan_view(data: dict[str, Any], summary: str, *, explain: bool = False) -> str:
    """``meridian plan --cluster``'s text: what the cluster computes at, the plan's block with what it is compared
    with, and with ``explain`` the reasoning of the plan (and of the offered one, where they differ)."""
    c = data["cluster"]
    head = (f"{c['gpus']} GPUs in {', '.join(f'{dc} ({n})' for dc, n in c['datacenters'].items())}; compute at "
            f"{c['efficiency']:.3f} of peak, {c['calibration']}")
    text = f"{head}\n{summary}"
    if explain:
        text += f"\n\nwhy: {data['plan']['explanation']}"
        if data["plan_only"] and data["offered"]:
            text += f"\n\nwhy today's: {data['offered']['explanation']}"
        elif data["plan_only"]:
            text += f"\n\nwhy none today: {data['refusal']}"
    return text
