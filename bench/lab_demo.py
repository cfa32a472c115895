"""``meridian bench lab-demo``: a job through the REST API on the network lab, two datacenters against one.

    sudo meridian bench lab-demo --json [--rounds 2] [--rtt-ms 21] [--gbps 1] [--probe] [--spec examples/demo.json]
                                 [--max-wall-s S]

Each run brings up the lab with Ray (:mod:`meridian.lab`): ``two`` puts the workers in two
datacenters, half each, joined over real TCP through the delay line at ``--rtt-ms`` and ``--gbps``; ``one`` puts
them all in the first datacenter, where no link exists. The service runs in this process on the lab's Ray
address, as ``meridian serve --address`` does; with ``--probe`` it first measures the cluster's links and the
spec's compute (``POST /v1/diagnostics/collectives`` and ``/compute``), so that ``sync: auto`` plans from measured
figures, not defaults. Then the spec (by default ``examples/demo.json``, ``sync: auto``) is submitted and followed
to its end, and the lab is brought down. Rounds alternate the order (two, one; one, two; ...), so a drift of this
shared machine's speed falls on both sides.

What each run reports comes from the job's own step records (``GET /v1/jobs/{id}/metrics``) and result:

- ``steady_tokens_per_s``: tokens of the steps after ``--steady-from`` ÷ the time between their records, the
  figure the scaling efficiency is taken from (the job's first steps pay for process and group start-up);
- ``job_tokens_per_s``: the job's own whole-run figure (its result);
- ``final_loss``, ``eval_loss``; the plan's sync choice (``sync_strategy``, ``local_lookahead``, ``compression``);
  with the look-ahead armed (no probe), what the job decided (``sync_decision``: the measured figures and the
  reason) and ``late_steps``, the steps whose sync ran one step late;
- ``median_exposed_ms``: the median step's sync left exposed, as the job reported it;
- ``delay_line_cpu_s``: CPU seconds the lab's delay line used over the job (``/proc``): a real link costs the ranks'
  cores nothing, so on a small machine this is the lab's own distortion.

Each run is also printed to stderr as it ends (``lab-demo run: {...}``, with ``phases``: where its wall time went),
so a bench cut short by a lease or a timeout still leaves what it measured; ``--max-wall-s`` starts no round that
the last one says would end past it.

Each pair of runs gives ``scaling_efficiency`` (two ÷ one, steady tokens/s) and ``final_loss_rel_diff`` (two
against one: the sync two datacenters use may differ from exact sync). Needs root, like the lab.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from meridian.lab import delay_line

NAME = "lab-demo"
HELP = "a job through the REST API on the network lab: two datacenters against one (scaling efficiency, loss)"
LAB_NAME = "bench-demo"
DEFAULT_SPEC = Path(__file__).resolve().parents[1] / "examples" / "demo.json"  # beside the package, or in it


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec", default=None, help="job spec to submit (default: the demo, examples/demo.json)")
    p.add_argument("--rounds", type=int, default=2, help="pairs of runs, in alternating order (default 2)")
    p.add_argument("--rtt-ms", type=float, default=21.0, help="the link's round trip between the datacenters")
    p.add_argument("--gbps", type=float, default=1.0, help="the link's rate between the datacenters")
    p.add_argument("--workers", type=int, default=4, help="one-CPU nodes in all, halved between two datacenters")
    p.add_argument("--probe", action="store_true",
                   help="measure links and compute through the API before submitting, so `auto` plans from them")
    p.add_argument("--steady-from", type=int, default=21, help="steps from this one on give steady_tokens_per_s")
    p.add_argument("--delay-line", choices=delay_line.KINDS, default="auto", help=delay_line.KINDS_HELP)
    p.add_argument("--lock", default="/tmp/meridian-lab.lock", help="the machine's lab lock file")
    p.add_argument("--lock-timeout-s", type=float, default=900.0, help="wait this long for the lab lock")
    p.add_argument("--timeout-s", type=float, default=600.0, help="give up on one job after this long")
    p.add_argument("--max-wall-s", type=float, default=None,
                   help="start no round that the last one's duration says would end after this many seconds "
                        "(a machine lent for minutes still gets its complete rounds printed)")


def run_order(rounds: int) -> list[str]:
    """``two, one, one, two, two, one, ...``: each pair in the other order than the pair before."""
    return [side for r in range(rounds) for side in (("two", "one") if r % 2 == 0 else ("one", "two"))]


def layout(side: str, workers: int) -> dict[str, int]:
    if side == "one":
        return {"dc-a": workers}
    return {"dc-a": workers - workers // 2, "dc-b": workers // 2}


def steady_tokens_per_s(points: list[dict[str, Any]], steady_from: int) -> float | None:
    """Tokens of the steps after the first one at or past ``steady_from``, over the time between the records of
    that step and the last (each record is stamped when its step ends). ``None`` with fewer than two such steps."""
    steady = sorted((p for p in points if p["step"] >= steady_from), key=lambda p: p["step"])
    if len(steady) < 2:
        return None
    first, last = steady[0], steady[-1]
    per_step = statistics.median(p["tokens_per_s"] * p["step_s"] for p in steady)  # every step has as many
    elapsed = last["time"] - first["time"]
    return per_step * (last["step"] - first["step"]) / elapsed if elapsed > 0 else None


PLAN_FIELDS = ("rank_datacenters", "use_gpu", "resources_per_worker", "sync_strategy", "local_lookahead",
               "lookahead_when_exposed", "compression", "bucket_mb", "tp", "pp", "micro_batches", "estimate")
"""The plan's fields a lab-demo run records (a missing one is ``None``)."""


def steady_breakdown_ms(points: list[dict[str, Any]], steady_from: int) -> dict[str, float]:
    """The median of each per-step time (``step_s``, ``compute_s``, ``exposed_s``, ...) over the steps from
    ``steady_from`` on, in ms."""
    steady = [p for p in points if p.get("step", 0) >= steady_from]
    keys = sorted({k for p in steady for k, v in p.items()
                   if k.endswith("_s") and k != "tokens_per_s" and isinstance(v, (int, float))})  # fmt: skip
    return {k.removesuffix("_s"): round(1000 * statistics.median(p[k] for p in steady if isinstance(p.get(k), (int, float))), 1)
            for k in keys}  # fmt: skip


def sync_sentence(explanation: str) -> str | None:
    """The plan's reason for its sync (``Sync '…' (chosen: …).``), out of its whole explanation."""
    start = explanation.find("Sync '")
    if start < 0:
        return None
    end = explanation.find(").", start)
    return explanation[start:end + 2 if end >= 0 else None]


def sync_decision(points: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What an armed look-ahead decided (``sync.lookahead_when_exposed``), from the step record that carries it
    (the last, if a re-formed epoch decided again); ``None`` when nothing was armed, or it never decided."""
    decided = [p["sync_decision"] for p in points if p.get("sync_decision")]
    return decided[-1] if decided else None


def round_would_overrun(elapsed_s: float, last_round_s: float, max_wall_s: float | None) -> str | None:
    """Why another round should not start (it would end past ``max_wall_s``, if it lasts as long as the last
    one), or ``None``."""
    if max_wall_s is None or elapsed_s + last_round_s <= max_wall_s:
        return None
    return f"another would end near {elapsed_s + last_round_s:.0f} s, past --max-wall-s {max_wall_s:g}"


def pairs(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each round's two runs side by side: ``scaling_efficiency`` (two ÷ one, steady tokens/s), the same of the
    whole jobs, and the final loss of two against one."""
    out = []
    for r in range(len(runs) // 2):
        by_side = {run["side"]: run for run in runs[2 * r:2 * r + 2]}
        two, one = by_side["two"], by_side["one"]
        ratio = (two["steady_tokens_per_s"] / one["steady_tokens_per_s"]
                 if two["steady_tokens_per_s"] and one["steady_tokens_per_s"] else None)  # fmt: skip
        out.append({
            "round": r + 1,
            "scaling_efficiency": round(ratio, 3) if ratio is not None else None,
            "job_tokens_per_s_ratio": round(two["job_tokens_per_s"] / one["job_tokens_per_s"], 3),
            "final_loss_rel_diff": round(two["final_loss"] / one["final_loss"] - 1, 5),
        })
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import os

    from meridian.bench.lab import lab_lock

    if os.geteuid() != 0:
        raise RuntimeError("the lab creates network namespaces: run `meridian bench lab-demo` as root")
    if args.rounds < 1 or args.workers < 2:
        raise ValueError(f"--rounds must be >= 1 and --workers >= 2, got {args.rounds} and {args.workers}")
    spec = json.loads(Path(args.spec or DEFAULT_SPEC).read_text())
    runs: list[dict[str, Any]] = []
    started = time.monotonic()
    stopped_early = None
    with lab_lock(args.lock, args.lock_timeout_s):
        order = run_order(args.rounds)
        round_started = started
        for i, side in enumerate(order):
            if i % 2 == 0 and i:
                now = time.monotonic()
                stopped_early = round_would_overrun(now - started, now - round_started, args.max_wall_s)
                if stopped_early:
                    stopped_early = f"stopped after {i // 2} of {args.rounds} rounds: {stopped_early}"
                    print(stopped_early, file=sys.stderr, flush=True)
                    break
                round_started = now
            runs.append(_one_run(args, side, spec))
            # each run as it ends, so a bench cut short (a lease, a timeout) still leaves what it measured
            print("lab-demo run: " + json.dumps(runs[-1]), file=sys.stderr, flush=True)
    rounds = pairs(runs)
    efficiencies = [r["scaling_efficiency"] for r in rounds if r["scaling_efficiency"] is not None]
    return {
        "setup": {"spec": spec, "rtt_ms": args.rtt_ms, "gbps": args.gbps, "workers": args.workers,
                  "probe": args.probe, "steady_from": args.steady_from, "wall_s": round(time.monotonic() - started, 1),
                  "stopped_early": stopped_early},
        "runs": runs,
        "rounds": rounds,
        "median_scaling_efficiency": round(statistics.median(efficiencies), 3) if efficiencies else None,
    }


def _one_run(args: argparse.Namespace, side: str, spec: dict[str, Any]) -> dict[str, Any]:
    from meridian.api.client import Client
    from meridian.api.server import serve_in_thread
    from meridian.bench.cpu_sample import cpu_between, machine_busy_cpu_s, process_cpu_s, snapshot
    from meridian.bench.gpu import run_job
    from meridian.lab import lab
    from meridian.service.core import MeridianService, ServiceConfig

    lab.down_if_up(LAB_NAME)
    phases: dict[str, float] = {}  # where a run's wall time goes (a lease of minutes must fit whole rounds)
    mark = time.monotonic()

    def phase(name: str) -> None:
        nonlocal mark
        now = time.monotonic()
        phases[name] = round(now - mark, 2)
        mark = now

    state = lab.up(layout(side, args.workers), rtt_ms=args.rtt_ms, gbps=args.gbps, name=LAB_NAME,
                   line=args.delay_line)
    phase("lab_up_s")
    data_dir = tempfile.mkdtemp(prefix="meridian-bench-lab-demo-")
    service = None
    try:
        service = MeridianService(ServiceConfig(data_dir=data_dir, ray_address=state.ray_address,
                                                poll_interval_s=0.3)).start()  # fmt: skip
        with serve_in_thread(service) as url:
            phase("service_up_s")
            if args.probe:
                client = Client(url)
                try:
                    client.probe_links(["intra_dc", "inter_dc"] if side == "two" else ["intra_dc"], 16 * 2**20)
                    client.probe_compute(spec)
                finally:
                    client.close()
                phase("probe_s")
            cpu_before, processes_before, job_began = process_cpu_s(state.delay_line_pid), snapshot(), time.monotonic()
            busy_before = machine_busy_cpu_s()
            job = run_job(url, spec, args.timeout_s)  # raises unless it succeeded
            line_cpu_s = process_cpu_s(state.delay_line_pid) - cpu_before
            # Who used the machine's CPU while the job ran: a run far slower than its pair is read from this. The
            # processes listed are those alive at both ends (not the training processes, gone by then); the
            # machine's busy CPU counts everything, so the difference is mostly the job's own.
            processes = cpu_between(processes_before, snapshot(), time.monotonic() - job_began)
            processes["machine_busy_cpu_s"] = round(machine_busy_cpu_s() - busy_before, 1)
            processes["machine_cores"] = os.cpu_count()
            phase("job_s")
        plan, result, points = job["plan"], job["result"], job["points"]
        if job.get("started_at") and job.get("created_at"):
            phases["job_queued_s"] = round(job["started_at"] - job["created_at"], 2)  # submit → workers placed
        steady = steady_tokens_per_s(points, args.steady_from)
        return {
            "side": side, "datacenters": plan["datacenters"], "sync_strategy": plan["sync_strategy"],
            "local_lookahead": plan["local_lookahead"], "compression": plan["compression"],
            "sync_explanation": sync_sentence(plan["explanation"]),
            "sync_decision": sync_decision(points), "late_steps": sum(1 for p in points if p.get("sync_late")),
            "steady_tokens_per_s": round(steady, 1) if steady is not None else None,
            "job_tokens_per_s": round(result["tokens_per_s"], 1),
            "final_loss": result["final_loss"], "eval_loss": result.get("eval_loss"),
            "median_exposed_ms": round(1000 * statistics.median(p["exposed_s"] for p in points), 1) if points else None,
            "delay_line": state.delay_line, "delay_line_cpu_s": round(line_cpu_s, 2),
            "phases": phases,
            # What `auto` planned and where the steady steps' time went: a ratio far from the bench lab's (same
            # link, engine and model, jobs started directly) is read from these, not guessed
            "plan": {k: plan.get(k) for k in PLAN_FIELDS},
            "steady_step_ms": steady_breakdown_ms(points, args.steady_from),
            "cpu_during_job": processes, "loadavg": os.getloadavg(),
        }
    finally:
        if service is not None:
            service.stop()
        lab.down(LAB_NAME)
        shutil.rmtree(data_dir, ignore_errors=True)
        phase("down_s")  # the returned run holds this same dict, so its line includes the lab's teardown


def render(result: dict[str, Any]) -> str:
    lines = [f"{'side':<5} {'sync':<14} {'steady tok/s':>12} {'job tok/s':>10} {'final loss':>10} {'line CPU s':>10}"]
    for r in result["runs"]:
        decided = r.get("sync_decision") or {}
        sync = r["sync_strategy"] + ("+lookahead" if r["local_lookahead"] or decided.get("lookahead") else "")
        lines.append(f"{r['side']:<5} {sync:<14} {r['steady_tokens_per_s'] or float('nan'):>12.0f} "
                     f"{r['job_tokens_per_s']:>10.0f} {r['final_loss']:>10.4f} {r['delay_line_cpu_s']:>10.2f}")
    for p in result["rounds"]:
        lines.append(f"round {p['round']}: scaling efficiency {p['scaling_efficiency']}, whole jobs "
                     f"{p['job_tokens_per_s_ratio']}, final loss {100 * p['final_loss_rel_diff']:+.2f}%")
    lines.append(f"median scaling efficiency: {result['median_scaling_efficiency']}")
    return "\n".join(lines)
