"""``meridian bench goodput``: the share of an uninterrupted job's training that a job keeps while a node is
killed every ``--kill-every-s`` seconds and brought back — Meridian beside torchft, in the same invocation.

Each side runs twice, one after the other, each run in a fresh process, on the same model, data order and global
batch as ``bench recovery`` (2 DCs × 2 one-CPU workers on gloo by default): once uninterrupted, once with the kills.
Each run trains for ``--wall-s`` seconds from its first step; its tokens are the steps it completed in that window
(the step it reached, minus the step of its first record: steps trained again after a loss count once) times the
tokens of a step (the same on every side: the global batch never changes). A side's goodput is its run with kills
over its own uninterrupted run, since the two sides' step rates differ; the report also gives Meridian's tokens/s
over torchft's for both kinds of run.

The kills: ``--kill-every-s`` after the first step, and every ``--kill-every-s`` after that, a worker of the last
datacenter dies with no grace (Meridian: its Ray node, every process of it; torchft: its replica group's process),
as in ``bench recovery``. It comes back ``--back-after-s`` after the kill, and no sooner than the survivors'
first step without it. A kill falls due only once every worker trains again (the report says by how long a kill
was late). Per kill, from the step records the workers stamp (:func:`kill_metrics`): the survivors' stall, the
newcomer's time to rejoin (its state transfer included), and the steps lost. A run trains on past its window
until its last kill is over (re-formed, node back, every worker training), for up to ``--settle-timeout-s``: those
steps give that kill's figures and no tokens.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from meridian.bench.recovery import SIDES as _RECOVERY_SIDES
from meridian.bench.recovery import isolated, job_spec, loadavg
from meridian.bench.recovery_cluster import CLUSTERS, dc_name

NAME = "goodput"
HELP = "goodput under a node kill every T seconds (tokens trained ÷ an uninterrupted run's): Meridian vs torchft"
SIDES = tuple(s for s in _RECOVERY_SIDES if s in ("meridian", "torchft"))
STEP_CAP = 1_000_000
"""Each run's ``--steps``: more than any run trains in its wall window, which is what ends it."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--wall-s", type=float, default=300.0, help="how long each run trains, from its first step")
    p.add_argument("--kill-every-s", type=float, default=60.0, help="a node is killed this often")
    p.add_argument("--back-after-s", type=float, default=10.0,
                   help="the killed node comes back this long after its kill (and once the survivors trained)")
    p.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    p.add_argument("--dcs", type=int, default=2)
    p.add_argument("--nodes-per-dc", type=int, default=2)
    p.add_argument("--model", default="nano", help="model preset (default: nano)")
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--snapshot-every", type=int, default=1, help="Meridian's checkpoint.snapshot_every")
    p.add_argument("--cluster", choices=CLUSTERS, default="embedded", help="as bench recovery's --cluster")
    p.add_argument("--lab-rtt-ms", type=float, default=1.0, help="ray-start: the delay line's RTT between DCs")
    p.add_argument("--lab-gbps", type=float, default=1.0, help="ray-start: the link's rate between DCs")
    p.add_argument("--torchft-heartbeat-timeout-ms", type=int, default=None,
                   help="the torchft lighthouse's heartbeat timeout (default: torchft's own, 5,000 ms)")
    p.add_argument("--start-timeout-s", type=float, default=600.0,
                   help="give up on a run whose first step has not come this long after it started")
    p.add_argument("--settle-timeout-s", type=float, default=120.0,
                   help="after the window, wait up to this long for the last kill's survivors to re-form and its "
                        "node to rejoin (its figures; the tokens count only inside the window)")


# -- what is reported (pure) -----------------------------------------------------------------------------------
def tokens_in_window(records: list[dict[str, Any]], wall_s: float, tokens_per_step: int) -> dict[str, Any]:
    """The steps and tokens a run completed in ``wall_s`` from its first record: the step reached by then minus
    the first record's step (a step trained twice counts once)."""
    if not records:
        raise RuntimeError("the run stamped no step")
    records = sorted(records, key=lambda r: r["time"])
    t0, end = records[0]["time"], records[0]["time"] + wall_s
    inside = [r for r in records if r["time"] <= end]
    steps = inside[-1]["step"] - records[0]["step"]
    return {"first_step": records[0]["step"], "last_step": inside[-1]["step"], "steps": steps,
            "tokens": steps * tokens_per_step, "window_s": round(inside[-1]["time"] - t0, 2),
            "tokens_per_s": round(steps * tokens_per_step / wall_s, 1)}  # fmt: skip


def kill_metrics(records: list[dict[str, Any]], *, kill_time: float, back_time: float | None, full: int,
                 resume_step: int | None = None) -> dict[str, Any]:  # fmt: skip
    """One kill, from a run's step records (``{"step", "time", "workers"}``):

    - ``stall_s``: the last step stamped before the kill → the first step trained without the victim;
    - ``steps_lost``: the highest step completed before that first step − the step it resumed from
      (``resume_step``; by default the step before it);
    - ``rejoin_s``: the node's return → the first step trained by all ``full`` workers again (the newcomer's
      start, its state transfer, the re-formation); ``None`` if none came before the records end;
    - ``rejoin_stall_s``: what that re-formation cost the survivors: their last step before it → that first
      step of every worker (only when it came)."""
    records = sorted(records, key=lambda r: r["time"])
    before = [r for r in records if r["time"] <= kill_time]
    reformed = [r for r in records if r["time"] > kill_time and r["workers"] < full]
    out: dict[str, Any] = {"stall_s": None, "steps_lost": None, "rejoin_s": None}
    if not reformed:
        return out
    first = reformed[0]
    resume = first["step"] - 1 if resume_step is None else resume_step
    last_old = max([r["step"] for r in records if r["time"] < first["time"]] + [resume])
    out["stall_s"] = round(first["time"] - before[-1]["time"], 2) if before else None
    out["steps_lost"] = max(0, last_old - resume)
    if back_time is not None:
        again = [r for r in records if r["time"] > max(back_time, first["time"]) and r["workers"] == full]
        out["rejoin_s"] = round(again[0]["time"] - back_time, 2) if again else None
        if again:
            last_small = [r for r in records if r["time"] < again[0]["time"]][-1]
            out["rejoin_stall_s"] = round(again[0]["time"] - last_small["time"], 2)
    return out


# -- one run ------------------------------------------------------------------------------------------------
class _Meridian:
    """A Meridian job through the REST API on a Ray cluster (:func:`meridian.bench.recovery.meridian_job`)."""

    def __init__(self, args: argparse.Namespace) -> None:
        from meridian.bench.recovery import meridian_job

        spec = job_spec(argparse.Namespace(**{**vars(args), "steps": STEP_CAP}))
        spec["name"] = "bench-goodput"
        self._job = meridian_job(args, spec)
        self.cluster, self.api, self.job_id, self.log = self._job.__enter__()
        self.victim_dc = dc_name(args.dcs - 1)

    def records(self) -> list[dict[str, Any]]:
        return self.log.records()

    def check(self) -> None:
        from meridian.bench.recovery import ended

        if ended(self.api.get(f"/v1/jobs/{self.job_id}").json()):
            raise RuntimeError(f"the Meridian job finished its {STEP_CAP} steps inside the wall window")

    def kill(self, stamp: dict[str, Any]) -> None:
        from meridian.bench.recovery import meridian_victim

        victim = meridian_victim(self.api.get(f"/v1/jobs/{self.job_id}").json(), self.victim_dc)
        self.cluster.kill(victim, at_kill=lambda: stamp.__setitem__("kill_time", time.time()))

    def back(self) -> None:
        self.cluster.add(self.victim_dc)

    def resume_step(self, kill_time: float, full: int) -> int | None:
        formed = [e for e in self.log.epochs if e["formed_at"] > kill_time and len(e["datacenters"]) < full]
        return formed[0]["resume_step"] if formed else None

    def rejoin_state(self, back_time: float, full: int) -> dict[str, Any] | None:
        """The epoch the newcomer re-formed with: when it formed and what its state exchange took and sent."""
        formed = [e for e in self.log.epochs if e["formed_at"] > back_time and len(e["datacenters"]) == full]
        if not formed:
            return None
        restored = [r for r in self.log.restored if r["epoch"] == formed[0]["epoch"]]
        out = {"formed_s": round(formed[0]["formed_at"] - back_time, 2)}
        if restored:
            out.update({k: restored[0][k] for k in ("setup_s", "restore_s", "state_bytes_sent") if k in restored[0]})
        return out

    def close(self) -> None:
        from meridian.bench.recovery import cancel

        try:
            cancel(self.api, self.job_id)
        finally:
            self._job.__exit__(None, None, None)


class _Torchft:
    """torchft's lighthouse and replica groups as plain processes (:func:`meridian.bench.recovery_torchft.torchft_groups`)."""

    def __init__(self, args: argparse.Namespace) -> None:
        from meridian.bench.recovery_torchft import torchft_groups

        self._groups = torchft_groups(argparse.Namespace(**{**vars(args), "steps": STEP_CAP,
                                                            "timeout_s": args.start_timeout_s}))
        self.workers, self.lighthouse, self.folder, _ = self._groups.__enter__()
        self.victim = args.dcs * args.nodes_per_dc - 1  # a worker of the last datacenter

    def records(self) -> list[dict[str, Any]]:
        from meridian.bench.recovery_torchft import records

        return records(self.folder / "replica-0.jsonl")  # a group that is never killed: the job's step log

    def check(self) -> None:
        if (why := self.workers.failed()) is not None:
            raise RuntimeError(why)

    def kill(self, stamp: dict[str, Any]) -> None:
        stamp["kill_time"] = time.time()
        self.workers.kill(self.victim)  # returns once the process has exited

    def back(self) -> None:
        self.workers.start(self.victim)

    def resume_step(self, kill_time: float, full: int) -> int | None:
        return None  # torchft resumes from the step after the last one its quorum committed

    def rejoin_state(self, back_time: float, full: int) -> dict[str, Any] | None:
        return None  # the newcomer heals from a peer inside its first quorum: part of rejoin_s

    def close(self) -> None:
        self._groups.__exit__(None, None, None)


def one_run(side: str, args: argparse.Namespace, kills: bool) -> dict[str, Any]:
    """Train ``side``'s job for ``--wall-s`` from its first step; with ``kills``, kill and bring back a node on
    the schedule. Returns the window's tokens and, with kills, each kill's figures."""
    full = args.dcs * args.nodes_per_dc
    load_at_start = loadavg()
    run = _Meridian(args) if side == "meridian" else _Torchft(args)
    try:
        deadline = time.monotonic() + args.start_timeout_s
        while not (records := run.records()):
            run.check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"{side}: no step within {args.start_timeout_s:.0f} s of the start")
            time.sleep(0.5)
        t0 = min(r["time"] for r in records)
        end, due = t0 + args.wall_s, t0 + args.kill_every_s
        done: list[dict[str, Any]] = []
        pending: dict[str, Any] | None = None  # the kill whose node is not back yet
        settle_until = end + getattr(args, "settle_timeout_s", 120.0)
        while (now := time.time()) < end or (kills and now < settle_until and not _settled(records, done, pending, full)):
            records = run.records()
            run.check()
            now = time.time()
            if kills and pending is None and now >= due and now < end and _all_train(records, done, full):
                pending = {"due": due}
                run.kill(pending)
                pending["late_s"] = round(pending["kill_time"] - due, 2)
                due += args.kill_every_s * (1 + int((pending["kill_time"] - due) // args.kill_every_s))
            elif pending is not None and now >= pending["kill_time"] + args.back_after_s and \
                    any(r["time"] > pending["kill_time"] and r["workers"] < full for r in records):  # fmt: skip
                pending["back_time"] = time.time()
                run.back()
                done.append(pending)
                pending = None
            time.sleep(0.25)
        if pending is not None:
            done.append(pending)
        records = run.records()
        out: dict[str, Any] = tokens_in_window(records, args.wall_s, args.tokens_per_step)
        out["loadavg"] = {"at_start": load_at_start, "at_end": loadavg()}
        if kills:
            out["kills"] = []
            for k in done:
                row = kill_metrics(records, kill_time=k["kill_time"], back_time=k.get("back_time"), full=full,
                                   resume_step=run.resume_step(k["kill_time"], full))  # fmt: skip
                row["at_s"] = round(k["kill_time"] - t0, 2)
                row["late_s"] = k["late_s"]
                if k.get("back_time") is not None:
                    row["back_at_s"] = round(k["back_time"] - t0, 2)
                    if (state := run.rejoin_state(k["back_time"], full)) is not None:
                        row["rejoin_state"] = state
                out["kills"].append(row)
        return out
    finally:
        run.close()


def _settled(records: list[dict[str, Any]], done: list[dict[str, Any]], pending: dict[str, Any] | None,
             full: int) -> bool:
    """Whether the last kill is over: its node came back and every worker trains again."""
    return pending is None and _all_train(records, done, full)


def _all_train(records: list[dict[str, Any]], done: list[dict[str, Any]], full: int) -> bool:
    """Whether every worker trains again since the last node came back (always, before the first kill)."""
    if not done:
        return True
    return any(r["time"] > done[-1]["back_time"] and r["workers"] == full for r in records)


# -- the report ---------------------------------------------------------------------------------------------
def _summary(clean: dict[str, Any], broken: dict[str, Any]) -> dict[str, Any]:
    kills = broken["kills"]

    def stats(key: str) -> dict[str, Any]:
        values = [k[key] for k in kills if k[key] is not None]
        return {"median": round(sorted(values)[len(values) // 2], 2) if values else None,
                "max": max(values) if values else None, "measured": len(values)}  # fmt: skip

    return {
        "goodput": round(broken["tokens"] / clean["tokens"], 4) if clean["tokens"] else None,
        "tokens_uninterrupted": clean["tokens"], "tokens_with_kills": broken["tokens"],
        "tokens_per_s_uninterrupted": clean["tokens_per_s"], "tokens_per_s_with_kills": broken["tokens_per_s"],
        "kills": len(kills), "stall_s": stats("stall_s"), "rejoin_s": stats("rejoin_s"),
        "steps_lost": sum(k["steps_lost"] for k in kills if k["steps_lost"] is not None),
    }  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.kill_every_s >= args.wall_s:
        raise ValueError(f"--kill-every-s ({args.kill_every_s:g}) must be under --wall-s ({args.wall_s:g}): "
                         "no kill would fall in the window")  # fmt: skip
    if args.back_after_s >= args.kill_every_s:
        raise ValueError(f"--back-after-s ({args.back_after_s:g}) must be under --kill-every-s "
                         f"({args.kill_every_s:g}): the node must come back before the next kill")  # fmt: skip
    from meridian.workers.contracts.model_config import model_preset

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    args.tokens_per_step = args.global_batch * model_preset(args.model).seq_len
    args.torchft_kill_phase = "random"
    report: dict[str, Any] = {"setup": {
        "cluster": args.cluster, "datacenters": args.dcs, "nodes_per_dc": args.nodes_per_dc, "model": args.model,
        "global_batch": args.global_batch, "tokens_per_step": args.tokens_per_step, "wall_s": args.wall_s,
        "kill_every_s": args.kill_every_s, "back_after_s": args.back_after_s,
        "meridian_snapshot_every": args.snapshot_every,
        "torchft_heartbeat_timeout_ms": args.torchft_heartbeat_timeout_ms or "torchft's default (5000)",
        "loadavg_at_start": loadavg()}}  # fmt: skip
    report["measures"] = {
        "goodput": "tokens trained in the wall window with the kills ÷ tokens the same side's uninterrupted run "
                   "trained in the same window (from each run's first step)",
        "stall_s": "per kill: last step before the kill → first step trained without the victim",
        "rejoin_s": "per kill: node back → first step trained by every worker again (the newcomer's start and "
                    "state transfer included)",
        "steps_lost": "per kill: steps completed before the re-formation − the step it resumed from (summed)",
        "late_s": "per kill: how long after its due time it came (a kill waits until every worker trains again)",
    }
    timeout_s = args.start_timeout_s + args.wall_s + args.settle_timeout_s + 300
    for side in args.sides:
        clean = isolated(f"goodput bench, {side} uninterrupted", one_run, side, args, False, timeout_s=timeout_s)
        broken = isolated(f"goodput bench, {side} with kills", one_run, side, args, True, timeout_s=timeout_s)
        entry: dict[str, Any] = {"uninterrupted": clean, "with_kills": broken}
        if "error" in clean or "error" in broken:
            entry["error"] = clean.get("error") or broken.get("error")
        else:
            entry.update(_summary(clean, broken))
        report[side] = entry
    m, t = report.get("meridian", {}), report.get("torchft", {})
    if "goodput" in m and "goodput" in t:
        report["meridian_vs_torchft"] = {
            "tokens_per_s_uninterrupted": _ratio(m["tokens_per_s_uninterrupted"], t["tokens_per_s_uninterrupted"]),
            "tokens_per_s_with_kills": _ratio(m["tokens_per_s_with_kills"], t["tokens_per_s_with_kills"]),
            "goodput": _ratio(m["goodput"], t["goodput"]),
        }
    report["setup"]["loadavg_at_end"] = loadavg()
    return report


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def render(r: dict[str, Any]) -> str:
    def fmt(v: Any) -> str:
        return "—" if v is None else f"{v}"

    lines = [f"{'side':<10} {'goodput':>8} {'tok/s clean':>12} {'tok/s kills':>12} {'kills':>6} "
             f"{'stall med/max (s)':>18} {'rejoin med/max (s)':>19} {'steps lost':>11}"]
    for side in SIDES:
        if side not in r:
            continue
        x = r[side]
        if "error" in x:
            lines.append(f"{side:<10} failed: {x['error']}")
            continue
        lines.append(f"{side:<10} {fmt(x['goodput']):>8} {x['tokens_per_s_uninterrupted']:>12} "
                     f"{x['tokens_per_s_with_kills']:>12} {x['kills']:>6} "
                     f"{fmt(x['stall_s']['median']) + ' / ' + fmt(x['stall_s']['max']):>18} "
                     f"{fmt(x['rejoin_s']['median']) + ' / ' + fmt(x['rejoin_s']['max']):>19} {x['steps_lost']:>11}")
    if "meridian_vs_torchft" in r:
        v = r["meridian_vs_torchft"]
        lines.append(f"Meridian ÷ torchft: tokens/s uninterrupted {fmt(v['tokens_per_s_uninterrupted'])}, "
                     f"with kills {fmt(v['tokens_per_s_with_kills'])}; goodput {fmt(v['goodput'])}")
    return "\n".join(lines)
