"""``meridian bench lab``: the same job over real TCP between datacenters, under the app's emulator, in one DC.

For every link (``--links``, RTT ms : Gbit/s) and strategy (``--strategies``: ``flat``, ``hierarchical``,
``hierarchical-delayed`` — the same sync applied one step late —, ``hierarchical-lookahead`` — one step late,
each step computed at the datacenter's own look-ahead — and ``diloco``) the same training job (model,
data, seed, steps) runs three ways, and one row reports them side by side:

- ``step_ms_lab``: the ranks run as processes inside the lab's datacenter namespaces (``meridian lab``,
  brought up here without Ray), their inter-DC traffic crossing the delay line and ``tbf``; nothing is
  emulated inside Meridian;
- ``step_ms_emulated``: the same ranks on this host's loopback, behind the app's WAN emulator
  (:mod:`meridian.workers.wan.collectives`) with the same RTT and rate;
- ``sync_wait_ms_lab``, ``sync_wait_ms_emulated``: of the step, what rank 0 waited for communication (the
  same statistic as the step time), to see where lab and emulator part;
- ``step_ms_one_dc``: the same ranks all in the first datacenter's namespace, the job's layout one DC: no
  inter-DC link at all;
- ``scaling_efficiency``: ``step_ms_one_dc / step_ms_lab``;
- ``inter_dc_bytes_kernel``: what the kernel counted leaving every datacenter's end of the link
  (``tx_bytes`` of its TUN device, read by the datacenter's first rank after each step), per step;
- ``inter_dc_bytes_reported``: what the engines reported for the same steps (summed over ranks);
- ``har_min_bytes``: the HAR minimum, every rank's 1/N shard once: ``dcs × params × 4`` per step
  (divided by H for DiLoCo);
- ``overlap_saving`` (hierarchical): what overlapping the sync with backward saves, measured:
  ``1 − step_ms_lab / step_ms_lab_no_overlap``, the same job run again on the lab with overlap off;
- ``ranks_cpu_ms_per_step_lab``, ``_one_dc``, ``_emulated``: the CPU time all ranks used per timed step
  (each process's, every thread included), summed: on a machine with fewer cores than ranks a step cannot take
  less than that ÷ the cores; ``ranks_system_cpu_ms_per_step_*``: of it, the time in the kernel;
- ``delay_line_cpu_ms_per_step``, ``delay_line_cpu_share``: the CPU time the lab's delay line (a process
  that forwards every inter-DC packet) used during the lab job (``/proc``; start-up included, divided by all the
  job's steps), and that as a share of all this machine's cores over a lab step (``step_ms_lab``). On a small
  machine the datacenters share their cores with the link: the one-DC job pays none of it, so
  ``scaling_efficiency`` carries it.

With ``--rounds N`` every strategy's three jobs run N times, interleaved with the other strategies', their
order rotated each round (:func:`round_order`); a row's step times are the medians over its rounds, its ratios
(``emulated_vs_lab``, ``scaling_efficiency``, ``overlap_saving``) the medians of each round's own ratio, listed
per round beside them (``emulated_vs_lab_rounds``, ``scaling_efficiency_rounds``), its bytes the means.

Step times are over the steps after ``--warmup`` (the median for per-step strategies; for DiLoCo the mean over
whole cycles of H steps after the first outer sync, since its median step has no sync and its first sync also
sets up the inter-DC connections); bytes over the same steps. The lab is held under the machine's lab lock
(``--lock``) for one link at a time and always brought down before the lock is released.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import meridian
from meridian.bench.cpu_sample import process_cpu_s
from meridian.bench.lab_worker import run_rank
from meridian.bench.sync import add_job_shape_arguments, count_params
from meridian.lab import delay_line
from meridian.lab import lab as lab_mod
from meridian.workers.contracts.config import (
    DiLoCoConfig,
    OptimConfig,
    SyncConfig,
    SyncStrategy,
    TrainConfig,
    WanConfig,
)
from meridian.workers.contracts.model_config import model_preset
from meridian.workers.distributed.multiproc import run_processes

NAME = "lab"
HELP = "the same job on the network lab (real TCP), behind the app's emulator, and in one DC: step time, bytes"

LAB_NAME = "bench"
MASTER_PORT = 29710


def parse_links(text: str) -> list[tuple[float, float]]:
    """``"21:1,100:0.1"`` → ``[(21.0, 1.0), (100.0, 0.1)]`` (RTT ms, Gbit/s)."""
    try:
        links = [(float(a), float(b)) for a, b in (part.split(":") for part in text.split(",") if part)]
    except ValueError as e:
        raise ValueError(f"--links takes RTT_MS:GBPS pairs separated by commas, e.g. 21:1,100:0.1; got {text!r}") from e
    if not links:
        raise ValueError("--links names no link")
    return links


def sync_of(strategy: str, args: argparse.Namespace) -> SyncConfig:
    common = {"bucket_mb": args.bucket_mb, "inter_dc_chunk_mb": args.chunk_mb}
    if strategy == "flat":
        return SyncConfig(strategy=SyncStrategy.FLAT, bucket_mb=args.bucket_mb)
    if strategy in ("hierarchical", "hierarchical-no-overlap"):
        return SyncConfig(overlap=strategy == "hierarchical", **common)
    if strategy == "hierarchical-delayed":  # the same sync, applied one step late
        return SyncConfig(delay_one_step=True, **common)
    if strategy == "hierarchical-lookahead":  # one step late, each step computed at the DC's own look-ahead;
        # its exact first steps are the untimed warm-up, so every timed step looks ahead
        return SyncConfig(delay_one_step=True, local_lookahead=True, lookahead_after=args.warmup,
                          **common)
    if strategy == "diloco":
        return SyncConfig(strategy=SyncStrategy.DILOCO, diloco=DiLoCoConfig(inner_steps=args.diloco_h), **common)
    raise ValueError(f"unknown strategy {strategy!r}; choose from flat, hierarchical, hierarchical-delayed, "
                     "hierarchical-lookahead, diloco")


def job(args: argparse.Namespace, strategy: str, datacenters: tuple[str, ...], wan: WanConfig | None) -> TrainConfig:
    return TrainConfig(
        job_id=f"bench-lab-{strategy}", model=model_preset(args.model), steps=args.steps,
        global_batch=args.global_batch or 8 * len(datacenters), micro_batch=args.micro_batch,
        datacenters=datacenters, sync=sync_of(strategy, args), optim=OptimConfig(warmup_steps=2), wan=wan,
        seed=args.seed,
    )  # fmt: skip


@contextlib.contextmanager
def lab_lock(path: str, timeout_s: float) -> Iterator[None]:
    """The machine's one-lab-at-a-time lock (``flock``), waited for up to ``timeout_s``."""
    with open(path, "a+") as f:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"another session held the lab lock {path} for {timeout_s:.0f} s; try later") from None
                time.sleep(1.0)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run_in_lab(state: lab_mod.LabState, cfg: TrainConfig, placement: list[str], workdir: Path,
               timeout_s: float, count_at: tuple[int, ...] | None = None) -> list[dict]:  # fmt: skip
    """Run ``cfg``'s ranks as processes, rank ``i`` in datacenter ``placement[i]``'s namespace; each
    datacenter's first rank reads the link's counter after the steps ``count_at`` names (default: every step)."""
    dcs = {dc.name: dc for dc in state.layout.datacenters}
    master = f"{dcs[placement[0]].nodes[0].ip}:{MASTER_PORT}"
    config_path = workdir / "config.pkl"
    config_path.write_bytes(pickle.dumps(cfg))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(meridian.__file__).resolve().parent.parent),
                                                         os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    procs, outputs, first_of_dc = [], [], set()
    for rank, dc_name in enumerate(placement):
        dc = dcs[dc_name]
        output = workdir / f"rank{rank}.json"
        output.unlink(missing_ok=True)
        spec = {"rank": rank, "world": len(placement), "master": master, "config": str(config_path),
                "output": str(output), "link_device": dc.tun if dc_name not in first_of_dc else None,
                "count_at": None if count_at is None else list(count_at)}  # fmt: skip
        first_of_dc.add(dc_name)
        (workdir / f"rank{rank}.spec.json").write_text(json.dumps(spec))
        cmd = ["ip", "netns", "exec", dc.netns, "env", f"GLOO_SOCKET_IFNAME={dc.dc_veth}", sys.executable, "-m",
               "meridian.bench.lab_worker", str(workdir / f"rank{rank}.spec.json")]  # fmt: skip
        log = open(workdir / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
        outputs.append(output)
    deadline = time.monotonic() + timeout_s
    try:
        for rank, (proc, _) in enumerate(procs):
            try:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"rank {rank} of {cfg.job_id} did not finish within {timeout_s:.0f} s; "
                                   f"see {workdir}/rank{rank}.log") from None  # fmt: skip
            if code != 0:
                tail = (workdir / f"rank{rank}.log").read_text(errors="replace")[-1500:]
                when = "after writing its result" if outputs[rank].exists() else "before writing its result"
                raise RuntimeError(f"rank {rank} of {cfg.job_id} exited with {code} {when}: {tail}")
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
            log.close()
    return [json.loads(p.read_text()) for p in outputs]


def _emulated(rank: int, world: int, cfg: TrainConfig) -> dict:
    return run_rank(rank, world, cfg)


def window(args: argparse.Namespace, strategy: str) -> tuple[int, int]:
    """The timed steps as (steps done before, steps done at the end). DiLoCo's steps differ (every H-th one
    syncs), so its window is whole cycles after a warm-up that includes the first sync, which also pays for
    setting up the inter-DC connections (on the lab at 100 ms: 0.95 s against 0.56 s for each later sync). Its
    ends fall a step after a sync, not on one: the link counters are read when a rank finishes a step, and
    right after a sync some of its bytes may still wait in the socket (0.88 of the kernel's count at 21 ms)."""
    if strategy != "diloco":
        return args.warmup, args.steps
    h = args.diloco_h
    first = h * -(-max(args.warmup, 1) // h) + 1
    last = first + h * ((args.steps - first) // h)
    if last <= first:
        raise ValueError(f"diloco needs --steps >= {first + h} (a whole cycle of H = {h} after the warm-up and the "
                         f"first sync), got {args.steps}")  # fmt: skip
    return first, last


def summarise(ranks: list[dict], timed_window: tuple[int, int], use_mean: bool) -> dict:
    """Step time of rank 0 and per-step bytes (reported; and the kernel's, when counters were read) over
    the steps of ``timed_window``."""
    first, last = timed_window
    r0 = ranks[0]
    timed = r0["step_s"][first:last]
    stat = statistics.mean if use_mean else statistics.median
    out = {"step_ms": 1000 * stat(timed), "sync_wait_ms": 1000 * stat(r0["sync_wait_s"][first:last]),
           "steps_timed": len(timed), "timed_steps": [first + 1, last],
           "reported": statistics.mean(r0["inter_dc_bytes"][first:last])}  # fmt: skip
    # every rank's CPU time over the same steps (its threads included), summed: what the job asked of the cores
    # (from the end of step ``first``, or of the first step when nothing is left out: a process's CPU time at its
    # first step's start is not read)
    since = max(first, 1)
    for key, series in (("ranks_cpu_ms", "cpu_s"), ("ranks_system_cpu_ms", "system_cpu_s")):
        out[key] = 1000 * sum(r[series][last - 1] - r[series][since - 1] for r in ranks) / (last - since)
    counted = [r["counters"] for r in ranks if r["counters"]]
    if counted:
        out["kernel"] = sum(c[str(last)] - c[str(first)] for c in counted) / (last - first)
    return out


WAYS = ("lab", "emulated", "one_dc")
"""The three ways every round runs a strategy's job, in this order rotated by one each round (round 1: the lab
first, round 2: the emulator first, ...), so that a machine that slows down or speeds up over a run does not favour
one way."""


def round_order(round_index: int) -> tuple[str, ...]:
    k = round_index % len(WAYS)
    return WAYS[k:] + WAYS[:k]


def measure_round(args: argparse.Namespace, state: lab_mod.LabState, strategy: str, wan: WanConfig,
                  multi: list[str], one: list[str], workdir: Path, round_index: int) -> dict[str, dict]:
    """One round of ``strategy``: its job on the lab, behind the emulator (on loopback, beside the idle lab) and
    in one datacenter, in :func:`round_order`; with ``overlap_saving``, hierarchical's job with overlap off
    right after its lab run."""
    timed, mean = window(args, strategy), strategy == "diloco"
    out: dict[str, dict] = {}
    for way in round_order(round_index):
        if way == "lab":
            cpu_before = process_cpu_s(state.delay_line_pid)
            out["lab"] = summarise(run_in_lab(state, job(args, strategy, tuple(multi), None), multi, workdir,
                                              args.timeout_s, timed), timed, mean)  # fmt: skip
            out["lab"]["delay_line_cpu_ms"] = 1000 * (process_cpu_s(state.delay_line_pid) - cpu_before) / args.steps
            if strategy == "hierarchical" and args.overlap_saving:
                off = "hierarchical-no-overlap"
                out["no_overlap"] = summarise(run_in_lab(state, job(args, off, tuple(multi), None), multi, workdir,
                                                         args.timeout_s, window(args, off)), window(args, off), False)  # fmt: skip
        elif way == "emulated":
            out["emulated"] = summarise(run_processes(_emulated, len(multi), job(args, strategy, tuple(multi), wan),
                                                      timeout_s=args.timeout_s), timed, mean)  # fmt: skip
        else:
            out["one_dc"] = summarise(run_in_lab(state, job(args, strategy, tuple(one), None), one, workdir,
                                                 args.timeout_s, timed), timed, mean)  # fmt: skip
    return out


def row_of(rtt_ms: float, gbps: float, strategy: str, line_kind: str, rounds: list[dict[str, dict]],
           har_min: float) -> dict:
    """One row from a strategy's rounds: each step time the median over the rounds; each ratio the median of
    the rounds' own ratios (a round's three jobs ran minutes apart at most, so a ratio inside a round is what
    this machine can compare), with every round's ratio beside it; bytes the mean over the rounds."""
    def med(way: str, key: str) -> float:
        return statistics.median(r[way][key] for r in rounds)

    def mean(way: str, key: str) -> float:
        return statistics.mean(r[way][key] for r in rounds)

    vs_lab = [r["emulated"]["step_ms"] / r["lab"]["step_ms"] for r in rounds]
    efficiency = [r["one_dc"]["step_ms"] / r["lab"]["step_ms"] for r in rounds]
    kernel, reported = mean("lab", "kernel"), mean("lab", "reported")
    row = {
        "rtt_ms": rtt_ms, "gbps": gbps, "strategy": strategy, "delay_line": line_kind, "rounds": len(rounds),
        "step_ms_lab": round(med("lab", "step_ms"), 1), "step_ms_emulated": round(med("emulated", "step_ms"), 1),
        "step_ms_one_dc": round(med("one_dc", "step_ms"), 1),
        "emulated_vs_lab": round(statistics.median(vs_lab), 3),
        "emulated_vs_lab_rounds": [round(x, 3) for x in vs_lab],
        # of which rank 0 waited for communication (the same statistic): where the two differ
        "sync_wait_ms_lab": round(med("lab", "sync_wait_ms"), 1),
        "sync_wait_ms_emulated": round(med("emulated", "sync_wait_ms"), 1),
        "scaling_efficiency": round(statistics.median(efficiency), 3),
        "scaling_efficiency_rounds": [round(x, 3) for x in efficiency],
        "inter_dc_bytes_kernel": round(kernel),
        "inter_dc_bytes_reported": round(reported),
        "reported_vs_kernel": round(reported / kernel, 4) if kernel else None,
        "inter_dc_bytes_reported_emulated": round(mean("emulated", "reported")),
        "har_min_bytes": round(har_min),
        "step_stat": "mean" if strategy == "diloco" else "median", "steps_timed": rounds[0]["lab"]["steps_timed"],
        "timed_steps": rounds[0]["lab"]["timed_steps"],
        "ranks_cpu_ms_per_step_lab": round(med("lab", "ranks_cpu_ms"), 1),
        "ranks_cpu_ms_per_step_one_dc": round(med("one_dc", "ranks_cpu_ms"), 1),
        "ranks_cpu_ms_per_step_emulated": round(med("emulated", "ranks_cpu_ms"), 1),
        # of which in the kernel (system time: the sockets, the lab's devices)
        "ranks_system_cpu_ms_per_step_lab": round(med("lab", "ranks_system_cpu_ms"), 1),
        "ranks_system_cpu_ms_per_step_one_dc": round(med("one_dc", "ranks_system_cpu_ms"), 1),
        "delay_line_cpu_ms_per_step": round(med("lab", "delay_line_cpu_ms"), 1),
        "delay_line_cpu_share": round(med("lab", "delay_line_cpu_ms") / (med("lab", "step_ms") * (os.cpu_count() or 1)), 4),
    }  # fmt: skip
    if all("no_overlap" in r for r in rounds):  # overlap as what it saves: step time with it off minus with it on
        row["step_ms_lab_no_overlap"] = round(med("no_overlap", "step_ms"), 1)
        row["overlap_saving"] = round(statistics.median(1 - r["lab"]["step_ms"] / r["no_overlap"]["step_ms"]
                                                        for r in rounds), 3)  # fmt: skip
    return row


def run(args: argparse.Namespace) -> dict:
    links = parse_links(args.links)
    strategies = [s for s in args.strategies.split(",") if s]
    for s in strategies:
        sync_of(s, args)  # unknown names fail before anything starts
    if os.geteuid() != 0:
        raise RuntimeError("the lab creates network namespaces: run `meridian bench lab` as root")
    if args.steps <= args.warmup + 1:
        raise ValueError(f"--steps must exceed --warmup + 1 ({args.warmup + 1}), got {args.steps}")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
    for s in strategies:
        window(args, s)
    names = [f"dc-{chr(ord('a') + i)}" for i in range(args.dcs)]
    multi = [dc for dc in names for _ in range(args.workers_per_dc)]
    one = [names[0]] * len(multi)
    params = count_params(args.model)
    rows = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="meridian-bench-lab-") as tmp:
        workdir = Path(tmp)
        for rtt_ms, gbps in links:
            wan = WanConfig(rtt_ms=rtt_ms, gbps=gbps)
            rounds: dict[str, list[dict[str, dict]]] = {s: [] for s in strategies}
            with lab_lock(args.lock, args.lock_timeout_s):
                state = lab_mod.up({dc: args.workers_per_dc for dc in names}, rtt_ms=rtt_ms, gbps=gbps,
                                   name=LAB_NAME, ray=False, line=args.delay_line)  # fmt: skip
                line_kind = state.delay_line  # native or python: one line per link, for every row of it
                try:
                    for i in range(args.rounds):
                        for s in strategies:
                            rounds[s].append(measure_round(args, state, s, wan, multi, one, workdir, i))
                finally:
                    lab_mod.down(LAB_NAME)
            for s in strategies:
                har_min = args.dcs * params * 4 / (args.diloco_h if s == "diloco" else 1)
                rows.append(row_of(rtt_ms, gbps, s, line_kind, rounds[s], har_min))
    return {
        "model": args.model, "params": params, "workers": len(multi), "datacenters": args.dcs,
        "steps": args.steps, "warmup": args.warmup, "bucket_mb": args.bucket_mb, "chunk_mb": args.chunk_mb,
        "diloco_h": args.diloco_h, "rounds": args.rounds, "wall_s": round(time.monotonic() - started, 1),
        "loadavg": Path("/proc/loadavg").read_text().split()[:3], "rows": rows,
    }  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--links", default="21:1,100:0.1", help="RTT_MS:GBPS pairs (default 21:1,100:0.1)")
    p.add_argument("--strategies", default="flat,hierarchical,hierarchical-delayed,hierarchical-lookahead,diloco",
                   help="comma-separated (default all five)")
    add_job_shape_arguments(p)
    p.add_argument("--steps", type=int, default=14, help="optimizer steps per job (default 14)")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the figures (default 2)")
    p.add_argument("--diloco-h", type=int, default=4, help="DiLoCo inner steps between syncs (default 4)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every strategy's three jobs this many times, interleaved, their order rotated each round; "
                        "a row gives the median (default 1)")
    p.add_argument("--no-overlap-saving", dest="overlap_saving", action="store_false",
                   help="skip the hierarchical job with overlap off (its step time gives overlap_saving)")
    p.add_argument("--delay-line", choices=delay_line.KINDS, default="auto", help=delay_line.KINDS_HELP)
    p.add_argument("--lock", default="/tmp/meridian-lab.lock", help="the machine's lab lock file")
    p.add_argument("--lock-timeout-s", type=float, default=900.0, help="wait this long for the lab lock")
    p.add_argument("--timeout-s", type=float, default=300.0, help="give up on one job after this long")


def render(result: dict) -> str:
    head = (f"{result['model']}, {result['workers']} workers in {result['datacenters']} DCs, "
            f"{result['steps']} steps ({result['warmup']} warm-up), load {' '.join(result['loadavg'])}")  # fmt: skip
    cols = f"{'link':<12}{'strategy':<22}{'lab ms':>9}{'emul ms':>9}{'1-DC ms':>9}{'eff':>7}{'kernel B':>13}{'reported B':>13}{'HAR min B':>12}{'ranks CPU ms':>13}{'line CPU ms':>12}"
    rows = [head, cols]
    for r in result["rows"]:
        link = f"{r['rtt_ms']:g}/{r['gbps']:g}"
        rows.append(f"{link:<12}{r['strategy']:<22}{r['step_ms_lab']:>9.1f}{r['step_ms_emulated']:>9.1f}"
                    f"{r['step_ms_one_dc']:>9.1f}{r['scaling_efficiency']:>7.3f}{r['inter_dc_bytes_kernel']:>13,}"
                    f"{r['inter_dc_bytes_reported']:>13,}{r['har_min_bytes']:>12,}"
                    f"{r['ranks_cpu_ms_per_step_lab']:>13.1f}{r['delay_line_cpu_ms_per_step']:>12.1f}")  # fmt: skip
    return "\n".join(rows)
