"""``meridian bench recovery``: kill a node mid-run; how long until training steps again, how much is lost,
how fast it trains after, and how long until a returning node trains again — Meridian, torchft, Ray Train.

Three sides (a fourth on request), one after the other in the same invocation, the same model, data order and global batch, 2 DCs ×
2 one-CPU workers on gloo by default:

- ``meridian``: a job submitted through the REST API on a Ray cluster: by default an embedded one (the fast
  health checks Meridian sets on clusters it starts); with ``--cluster ray-start`` the path a user runs,
  ``ray start`` head and nodes with Ray's default health checks (:mod:`meridian.bench.recovery_cluster`). At ``--kill-at-step`` (and ``--kill-after-s`` after its first step) the node of a worker in the last datacenter
  is killed with no grace; the survivors re-form and resume from the state they hold in memory.
- ``meridian_new_process`` (not run unless named): the same, with survivors that exit after the failure and hand
  training to their agent's standby process, as they did before CPU survivors re-formed in their own process.
- ``torchft``: torchft 0.2's ``Manager`` with one replica group per worker and its lighthouse, as plain
  processes (no Ray); the same kill is a SIGKILL of that worker's process (:mod:`meridian.bench.recovery_torchft`).
  With ``--cluster ray-start`` its groups run in the lab's namespaces, across the same link as Meridian's side.
- ``ray_train_elastic``: plain DDP under Ray Train's built-in elastic path (``num_workers=(min, max)``,
  ``FailureConfig``), checkpointing to disk every ``--checkpoint-every`` steps; the same node kill.

``--back-after-s`` after the re-formed group's first step the node (process) comes back; each side stops once
the returning worker trained a step, or ``--scale-up-timeout-s`` later (``--steps`` is only a cap). Every
number comes from step records stamped by the workers (:mod:`meridian.bench.recovery_measure` says what each
measures). On a loaded 2-core machine the absolute seconds move; compare sides within one run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

from meridian.bench.recovery_cluster import CLUSTERS, dc_name, make_cluster
from meridian.bench.recovery_measure import WINDOW_S, Phases, recovery_metrics
from meridian.workers.contracts.events import EventKind

NAME = "recovery"
HELP = "node kill → next step, steps lost, throughput after, scale-up: Meridian vs torchft vs Ray Train elastic"
SIDES = ("meridian", "meridian_new_process", "torchft", "ray_train_elastic")
DEFAULT_SIDES = ("meridian", "torchft", "ray_train_elastic")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dcs", type=int, default=2)
    p.add_argument("--nodes-per-dc", type=int, default=2)
    p.add_argument("--model", default="nano", help="model preset (default: nano)")
    p.add_argument("--steps", type=int, default=20_000, help="a cap: each side stops once it measured the scale-up")
    p.add_argument("--kill-at-step", type=int, default=20)
    p.add_argument("--kill-after-s", type=float, default=30.0,
                   help="and no sooner than this long after the first step (the pre-kill throughput's window)")
    p.add_argument("--back-after-s", type=float, default=WINDOW_S,
                   help="the node returns this long after the re-formed group's first step (the throughput window)")
    p.add_argument("--scale-up-timeout-s", type=float, default=180.0)
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--checkpoint-every", type=int, default=10, help="the baseline's disk checkpoint interval")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--sides", nargs="+", choices=SIDES, default=list(DEFAULT_SIDES),
                   help="meridian_new_process: Meridian with survivors that exit and hand over to a standby process "
                        "(MERIDIAN_REFORM=new-process, as before they re-formed in their own process on CPU)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="give up on one side after this long")
    p.add_argument("--cluster", choices=CLUSTERS, default="embedded",
                   help="embedded: a cluster this process starts, with fast health checks; ray-start: `ray start` "
                        "head and nodes as a user runs them (the network lab's, Ray's default health checks; root)")
    p.add_argument("--lab-rtt-ms", type=float, default=1.0, help="ray-start: the delay line's RTT between DCs")
    p.add_argument("--lab-gbps", type=float, default=1.0, help="ray-start: the link's rate between DCs")
    p.add_argument("--torchft-heartbeat-timeout-ms", type=int, default=None,
                   help="the torchft lighthouse's heartbeat timeout (default: torchft's own, 5,000 ms). A dead "
                        "group counts as alive this long, and the lighthouse forms a quorum only from more than half "
                        "of the groups it counts alive, so when a survivor is still blocked in its collective the "
                        "others wait this long; its managers heartbeat every 100 ms, so a user chasing fast failover "
                        "may set it far lower")
    p.add_argument("--torchft-kill-phase", choices=("random", "between-steps"), default="random",
                   help="random (default): the bench SIGKILLs torchft's victim at whatever point of a step it is, as "
                        "Meridian's node is killed; between-steps: the victim SIGKILLs itself right after a committed "
                        "step, before it asks for the next quorum, the one moment at which torchft's lighthouse "
                        "re-forms the quorum without waiting for the dead group's heartbeat to expire (torchft at its "
                        "fastest)")
    p.add_argument("--snapshot-every", type=_cadence, default=1,
                   help="Meridian's checkpoint.snapshot_every: 1 (default) keeps every step's state in memory, as "
                        "torchft does, so a failure loses at most the step in flight; 'auto' is a job's default, "
                        "which widens the cadence when snapshots cost over 5%% of a step and may train up to k - 1 "
                        "steps again")


def _cadence(text: str) -> int | str:
    if text == "auto":
        return text
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"--snapshot-every must be >= 1 or 'auto', got {text!r}")
    return value


def _tokens_per_step(args: argparse.Namespace) -> int:
    from meridian.workers.contracts.model_config import model_preset

    return args.global_batch * model_preset(args.model).seq_len


def job_spec(args: argparse.Namespace) -> dict[str, Any]:
    """The Meridian side's job, as ``POST /v1/jobs`` takes it. Exact per-step sync, named: what the other sides
    run, and what ``auto`` planned here before it armed the look-ahead on guessed figures (whose trial, in every
    re-formed epoch, would put one-step-late steps into the throughput after a loss)."""
    return {"name": "bench-recovery", "model": {"preset": args.model},
            "training": {"steps": args.steps, "global_batch": args.global_batch, "micro_batch": args.micro_batch,
                         "lr": 3e-3},
            "sync": {"strategy": "hierarchical"},
            "checkpoint": {"snapshot_every": args.snapshot_every}}


# -- Meridian -------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def meridian_job(args: argparse.Namespace, spec: dict[str, Any]) -> Iterator[tuple[Any, Any, str, MeridianLog]]:
    """A Ray cluster (:func:`make_cluster`), a service with its REST API, and ``spec`` submitted to it: yields
    ``(cluster, api, job_id, log)``. On leaving, the job is cancelled (its runner removes its snapshots), then
    service, cluster and every file they wrote are gone."""
    import httpx

    from meridian.api.server import serve_in_thread
    from meridian.service.core import MeridianService, ServiceConfig
    from meridian.workers.state.snapshot_paths import remove_snapshot_dirs

    cluster = make_cluster(args)
    full = args.dcs * args.nodes_per_dc
    data_dir = tempfile.mkdtemp(prefix="meridian-bench-")
    service = MeridianService(ServiceConfig(data_dir=data_dir, ray_address=cluster.address, poll_interval_s=0.2)).start()
    job_id = ""
    try:
        with serve_in_thread(service) as url, httpx.Client(base_url=url, timeout=30) as api:
            r = api.post("/v1/jobs", json=spec)
            if r.status_code != 201:
                raise RuntimeError(f"the job was refused: {r.text}")
            job_id = r.json()["id"]
            yield cluster, api, job_id, MeridianLog(api, job_id, full)
    finally:
        service.stop()
        cluster.shutdown()
        if job_id:  # every node is on this host: what a cancel that outran its wait left behind in RAM
            remove_snapshot_dirs(job_id)
        shutil.rmtree(data_dir, ignore_errors=True)  # the service's store and the Train runs' files


def meridian_victim(job: dict[str, Any], dc: str) -> str:
    """The node id of a worker of ``dc`` that is not rank 0, from the job's placement."""
    slots = [p for p in job["placement"] if p["rank"] != 0 and p["datacenter"] == dc]
    if not slots:
        raise RuntimeError(f"the Meridian job has no worker in {dc} other than rank 0 to kill")
    return slots[0]["node_id"]


def ended(job: dict[str, Any]) -> bool:
    """Whether the job has ended; raises if it ended in any way but success."""
    if job["state"] in ("failed", "cancelled"):
        raise RuntimeError(f"the Meridian job ended {job['state']}: {job['message']}")
    return job["state"] == "succeeded"


def _meridian(args: argparse.Namespace) -> dict[str, Any]:
    full = args.dcs * args.nodes_per_dc
    with meridian_job(args, job_spec(args)) as (cluster, api, job_id, log):
        phases, deadline = Phases(args, full), time.monotonic() + args.timeout_s
        victim_dc = dc_name(args.dcs - 1)
        while (action := phases.next_action(log.records())) != "done":
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Meridian side did not finish within {args.timeout_s:.0f} s")
            job = api.get(f"/v1/jobs/{job_id}").json()
            if ended(job):
                break
            if action == "kill":
                cluster.kill(meridian_victim(job, victim_dc), at_kill=phases.killed, at_dead=phases.dead)
            elif action == "back":
                phases.came_back()
                cluster.add(victim_dc)
            time.sleep(0.5)
        cancel_s = cancel(api, job_id)
        formed = [e for e in log.epochs if e["epoch"] == 2]
        if phases.kill_time is None or not formed:
            raise RuntimeError("the Meridian job never re-formed after the kill")
        out = recovery_metrics(log.records(), kill_time=phases.kill_time, full_workers=full,
                               survivors=full - 1, tokens_per_step=_tokens_per_step(args),
                               resume_step=formed[0]["resume_step"], back_time=phases.back_time)  # fmt: skip
        out["victim_exited_s"] = phases.victim_exited_s()
        out["after_kill_s"] = log.timeline(phases.kill_time, phases.back_time)
        out["cpu_from_kill_to_return"] = phases.cpu_report()
        out["cancel_to_ended_s"] = cancel_s
        # Each re-formation's rank 0: group and model set up (s), state restored (s), and the bytes its
        # exchange sent, measured by its plan's buffers
        out["state_exchanged"] = [{k: r[k] for k in ("epoch", "setup_s", "restore_s", "state_bytes_sent",
                                                     "state_bytes_cross_dc") if k in r} for r in log.restored]
        if phases.back_time is not None:
            out["after_back_s"] = log.timeline(phases.back_time, None)
        return out


def cancel(api: Any, job_id: str, timeout_s: float = 60.0) -> float | None:
    """Cancel the job and wait until it has ended: its runner then removes its workers' snapshots from RAM. (Stopped
    at once, the cluster's shutdown killed runner and workers first, and every round left its folders behind.)
    Returns the seconds from the cancel to the job's end (what a user's ``DELETE`` waits for), ``None`` if it had
    not ended within ``timeout_s``."""
    began = time.monotonic()
    api.delete(f"/v1/jobs/{job_id}")
    while time.monotonic() < began + timeout_s:
        if api.get(f"/v1/jobs/{job_id}").json()["state"] in ("failed", "cancelled", "succeeded"):
            return round(time.monotonic() - began, 2)
        time.sleep(0.2)
    return None


class MeridianLog:
    """The job's step records (from the API, fetched incrementally), each with its epoch's worker count."""

    def __init__(self, api: Any, job_id: str, full: int) -> None:
        self.api, self.job_id, self.full = api, job_id, full
        self._points: dict[tuple[int, int], dict[str, Any]] = {}
        self._event_cursor = 0
        self.epochs: list[dict[str, Any]] = []
        self.events: list[tuple[str, float]] = []
        self.restored: list[dict[str, Any]] = []
        """Rank 0's ``epoch_restored`` data of each re-formed epoch: its times, the state exchange's bytes."""

    def records(self) -> list[dict[str, Any]]:
        after = max((s for _, s in self._points), default=0)
        for p in self.api.get(f"/v1/jobs/{self.job_id}/metrics", params={"after_step": max(0, after - 5)}).json()["points"]:
            self._points[(p.get("epoch", 1), p["step"])] = p
        for e in self.api.get(f"/v1/jobs/{self.job_id}/events", params={"after": self._event_cursor}).json()["events"]:
            self._event_cursor = max(self._event_cursor, e["id"])
            self.events.append((e["kind"], e["time"]))
            if e["kind"] == EventKind.EPOCH_FORMED:
                self.epochs.append({**e["data"], "formed_at": e["time"]})
            if e["kind"] == EventKind.EPOCH_RESTORED:
                self.restored.append(e["data"])
        size = {e["epoch"]: len(e["datacenters"]) for e in self.epochs}
        # (a record's time is the wall clock of the rank that reported it; so is the kill's: one host)
        return [{"step": s, "time": p["time"], "workers": size.get(ep, self.full)} for (ep, s), p in self._points.items()]

    def timeline(self, since: float, until: float | None) -> dict[str, float]:
        """Seconds from ``since`` to the first event of each kind before ``until``: where the time went."""
        out: dict[str, float] = {}
        for kind, at in self.events:
            if at >= since and (until is None or at < until) and kind not in out:
                out[kind] = round(at - since, 2)
        return out


# -- Ray Train's elastic path -----------------------------------------------------------------------------
class _StepLog:
    """Collects (step, end time, worker group) from the baseline's rank 0 across restarts, and the step
    each worker group started from."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.starts: list[int] = []

    def start(self, step: int) -> None:
        self.starts.append(step)

    def step(self, step: int, at: float, world: int) -> None:
        self.records.append({"step": step, "time": at, "group": len(self.starts), "workers": world})

    def get(self) -> tuple[list[dict[str, Any]], list[int]]:
        return self.records, self.starts


def _baseline_loop(config: dict[str, Any]) -> None:
    """Plain DDP on the job's model and data order, as a Ray Train user writes it, checkpointing to disk."""
    import ray
    import ray.train
    import torch
    from ray.train.torch import prepare_model

    from meridian.workers.data.text import TextDataset
    from meridian.workers.model.build import build_model
    from meridian.workers.model.gpt import per_sample_loss

    cfg = config["train"]
    log = ray.get_actor(config["log"], namespace="meridian-bench")
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(cfg.seed)
    model = prepare_model(build_model(cfg.model))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
    start = 0
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=False)
        model.module.load_state_dict(state["model"]) if hasattr(model, "module") else model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    if rank == 0:
        ray.get(log.start.remote(start))
    data = TextDataset(cfg.data, cfg.model.seq_len, cfg.seed)
    for step in range(start, cfg.steps):
        opt.zero_grad(set_to_none=True)
        batches = data.step_batches(step, cfg.global_batch, cfg.micro_batch, rank, world)
        for x, y in batches:
            # DDP averages gradients over ranks: scale each rank's sample sum so the average is the batch mean.
            (per_sample_loss(model(x), y).sum() * world / cfg.global_batch).backward()
        opt.step()
        done = step + 1
        if rank == 0:
            log.step.remote(done, time.time(), world)
        if done % config["every"] == 0:
            with tempfile.TemporaryDirectory() as d:
                if rank == 0:
                    raw = model.module if hasattr(model, "module") else model
                    torch.save({"model": raw.state_dict(), "opt": opt.state_dict(), "step": done}, os.path.join(d, "state.pt"))
                ray.train.report({"step": done}, checkpoint=ray.train.Checkpoint.from_directory(d) if rank == 0 else None)


def _ray_train_elastic(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from meridian.workers.contracts.config import DataConfig, OptimConfig, TrainConfig
    from meridian.workers.contracts.model_config import model_preset

    cluster = make_cluster(args)
    storage = tempfile.mkdtemp(prefix="meridian-bench-ray-")  # the baseline's disk checkpoints
    try:
        ray.init(address=cluster.address, namespace="meridian-bench")
        # On the head node, which the bench never kills: unpinned, the log once landed on the victim node and
        # the run ended with ActorUnavailableError instead of a measurement.
        head = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        log = ray.remote(_StepLog).options(name="steplog", namespace="meridian-bench", num_cpus=0,
                                           scheduling_strategy=head).remote()  # fmt: skip
        workers = args.dcs * args.nodes_per_dc
        cfg = TrainConfig(job_id="bench-baseline", model=model_preset(args.model), data=DataConfig(),
                          optim=OptimConfig(lr=3e-3), steps=args.steps, global_batch=args.global_batch,
                          micro_batch=args.micro_batch)
        trainer = TorchTrainer(
            _baseline_loop, train_loop_config={"train": cfg, "log": "steplog", "every": args.checkpoint_every},
            scaling_config=ScalingConfig(num_workers=(1, workers), resources_per_worker={"CPU": 1}),
            run_config=RunConfig(storage_path=storage,
                                 failure_config=FailureConfig(max_failures=3),
                                 checkpoint_config=CheckpointConfig(num_to_keep=2)),
        )
        outcome: dict[str, Any] = {}
        fit = threading.Thread(target=lambda: outcome.setdefault("result", trainer.fit()), daemon=True)
        fit.start()
        phases, deadline = Phases(args, workers), time.monotonic() + args.timeout_s
        while (action := phases.next_action(ray.get(log.get.remote())[0])) != "done":
            if time.monotonic() > deadline:
                raise RuntimeError(f"Ray Train's elastic side did not finish within {args.timeout_s:.0f} s")
            if not fit.is_alive():
                result = outcome.get("result")
                if result is not None and result.error is not None:
                    raise RuntimeError(f"Ray Train's elastic run failed: {result.error}")
                break
            if action == "kill":
                last_dc = dc_name(args.dcs - 1)
                everyone = [i for d in range(args.dcs) for i in cluster.node_ids(dc_name(d))]
                victim = _node_of_a_worker(everyone, cluster.node_ids(last_dc))
                cluster.kill(victim, at_kill=phases.killed, at_dead=phases.dead)
            elif action == "back":
                phases.came_back()
                cluster.add(dc_name(args.dcs - 1))
            time.sleep(0.5)
        records, starts = ray.get(log.get.remote())
        if phases.kill_time is None or len(starts) < 2:
            raise RuntimeError("Ray Train's run finished without restarting its worker group after the kill")
        out = recovery_metrics(records, kill_time=phases.kill_time, full_workers=workers, survivors=workers - 1,
                               tokens_per_step=_tokens_per_step(args), resume_step=starts[1],
                               back_time=phases.back_time)  # fmt: skip
        out["victim_exited_s"] = phases.victim_exited_s()
        out["cpu_from_kill_to_return"] = phases.cpu_report()
        return out
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(storage, ignore_errors=True)


def _node_of_a_worker(nodes: list[str], preferred: list[str]) -> str:
    """A node running a training worker but not the Train controller (whose loss ends any Train run), one of
    ``preferred`` (the last datacenter's) if one is such a node: the baseline does not pin workers."""
    from ray.util.state import list_actors

    alive = list_actors(filters=[("state", "=", "ALIVE")], limit=10_000)
    busy = {a.node_id for a in alive if a.class_name == "RayTrainWorker"}
    controller = {a.node_id for a in alive if "Controller" in a.class_name}
    candidates = [n for n in nodes if n in busy - controller]
    return next((n for n in candidates if n in preferred), candidates[0])


def run(args: argparse.Namespace) -> dict[str, Any]:
    if not 0 < args.kill_at_step < args.steps:
        raise ValueError(f"--kill-at-step must be between 1 and --steps - 1 (got {args.kill_at_step})")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    args.tokens_per_step = _tokens_per_step(args)
    load_at_start = loadavg()
    sides: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES if side in args.sides}
    for _ in range(args.rounds):
        for side in sides:
            sides[side].append(_isolated(side, args))
    report: dict[str, Any] = {
        "setup": {"cluster": args.cluster, "datacenters": args.dcs, "nodes_per_dc": args.nodes_per_dc, "model": args.model,
                  "global_batch": args.global_batch, "kill_at_step": args.kill_at_step, "kill_after_s": args.kill_after_s,
                  "node_back_after_first_reformed_step_s": args.back_after_s,
                  "baseline_checkpoint_every": args.checkpoint_every, "meridian_snapshot_every": args.snapshot_every,
                  "torchft_heartbeat_timeout_ms": args.torchft_heartbeat_timeout_ms or "torchft's default (5000)",
                  "torchft_kill_phase": args.torchft_kill_phase,
                  "loadavg_at_start": load_at_start,
                  **({"lab": {"rtt_ms": args.lab_rtt_ms, "gbps": args.lab_gbps}} if args.cluster == "ray-start" else {})},
        "measures": {
            "kill_to_next_step_s": "node kill → end of the first step trained by the re-formed (smaller) group",
            "steps_lost": "last step completed before the re-formation − step the re-formed group resumed from",
            "post_recovery_throughput_ratio": f"steps/s of the re-formed group over the {WINDOW_S:.0f} s after its first "
                                              "step (or until the node returned: post_recovery_window_s) ÷ (steps/s "
                                              "before the kill × surviving fraction); same tokens per step everywhere",
            "scale_up_s": "node back → end of the first step trained by every worker again",
            "victim_exited_s": "kill → the last killed process seen exited (its sockets closed): the kernel's part, "
                               "before any survivor can see the victim gone (a node's ~10 processes for Meridian and "
                               "Ray Train, one process for torchft)",
            "lighthouse": "torchft only, from its lighthouse's log: the first quorum smaller than the job after the "
                          "kill, how long after the kill it formed, how many groups still counted as alive then, the "
                          "lighthouse's reason and what held it until then; waited_for_heartbeat_timeout: it formed "
                          "only once the dead group's heartbeat had expired",
        },
    }
    for side, all_runs in sides.items():
        runs = [r for r in all_runs if "error" not in r]
        if not runs:
            report[side] = {"error": all_runs[0]["error"], "runs": all_runs}
            continue
        report[side] = {key: _median([r[key] for r in runs]) for key in
                        ("kill_to_next_step_s", "post_recovery_throughput_ratio", "scale_up_s")}
        report[side]["steps_lost"] = max(r["steps_lost"] for r in runs)
        report[side]["runs"] = runs
    report["setup"]["loadavg_at_end"] = loadavg()
    return report


def _side(side: str, args: argparse.Namespace) -> dict[str, Any]:
    if side == "meridian":
        return _meridian(args)
    if side == "meridian_new_process":
        from meridian.workers.elastic.protocol import REFORM_ENV

        os.environ[REFORM_ENV] = "new-process"  # this side's own process: its cluster's workers inherit it
        return _meridian(args)
    if side == "torchft":
        from meridian.bench.recovery_torchft import run_torchft

        return run_torchft(args)
    return _ray_train_elastic(args)


def _isolated(side: str, args: argparse.Namespace) -> dict[str, Any]:
    return isolated(f"recovery bench, {side}", _side, side, args, timeout_s=args.timeout_s + 120)


def isolated(label: str, fn: Any, *fn_args: Any, timeout_s: float) -> dict[str, Any]:
    """``fn(*fn_args)`` in a fresh process: a Ray driver that crashes (measured once here: a segfault after the
    baseline's kill) or torchft's native runtime cannot take the other sides' results with it. A failure comes
    back as ``{"error": ...}``; the result also goes to stderr, after ``label``, as soon as it is known."""
    import json
    import sys
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool
    from multiprocessing import get_context

    try:
        with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
            result = pool.submit(fn, *fn_args).result(timeout=timeout_s)
    except BrokenProcessPool as e:
        result = {"error": f"the process running this side died ({e})"}
    except Exception as e:  # noqa: BLE001 - one side failing must not lose the others' numbers
        result = {"error": f"{type(e).__name__}: {e}"}
    print(f"{label}: {json.dumps(result)}", file=sys.stderr, flush=True)
    return result


def _median(values: list[Any]) -> Any:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def render(r: dict[str, Any]) -> str:
    def fmt(v: Any) -> str:
        return "—" if v is None else f"{v}"

    lines = [f"{'side':<20} {'kill→next step (s)':>19} {'steps lost':>11} {'throughput ratio':>17} {'scale-up (s)':>13}"]
    for side in SIDES:
        if side in r and "error" in r[side]:
            lines.append(f"{side:<20} failed: {r[side]['error']}")
        elif side in r:
            x = r[side]
            lines.append(f"{side:<20} {fmt(x['kill_to_next_step_s']):>19} {x['steps_lost']:>11} "
                         f"{fmt(x['post_recovery_throughput_ratio']):>17} {fmt(x['scale_up_s']):>13}")
    return "\n".join(lines)
