"""``meridian bench recovery``: kill a node mid-run; how long until training steps again, how much is lost.

Runs on an embedded Ray cluster of ``--dcs`` datacenters × ``--nodes-per-dc`` one-CPU nodes, with the fast
health checks Meridian sets on clusters it starts (the same for both sides), twice, each on a fresh cluster:

- ``meridian``: a job submitted through the REST API; at ``--kill-at-step`` the node of a worker in the
  first datacenter (not rank 0) is killed with no grace. The survivors re-form and resume from the state
  they hold in memory.
- ``ray_train_elastic``: the same model, data order and batch as plain DDP under Ray Train's built-in
  elastic path (``num_workers=(min, max)``, ``FailureConfig``), checkpointing to disk every
  ``--checkpoint-every`` steps (what it needs to resume); the same kill at the same step.

For each: ``kill_to_next_step_s`` = wall time from the kill to the end of the first step completed by the
re-formed group (Meridian: the first step of the next epoch; Ray Train: the first step of the restarted
worker group) — not merely the first step stamped after the kill, since the victim's processes can outlive
the kill of their node by a few steps; step end times are stamped by the workers. ``steps_lost`` = the last
step completed before the re-formation minus the step training resumed from (steps trained twice). Sides run
one after the other, so their timings share the machine's state; on a loaded 2-core machine the absolute
seconds move, the ratio less.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from typing import Any

NAME = "recovery"
HELP = "seconds from a node kill to the next training step, and steps lost: Meridian vs Ray Train's elastic path"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dcs", type=int, default=2)
    p.add_argument("--nodes-per-dc", type=int, default=2)
    p.add_argument("--model", default="nano", help="model preset (default: nano)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--kill-at-step", type=int, default=20)
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--checkpoint-every", type=int, default=10, help="the baseline's disk checkpoint interval")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument("--timeout-s", type=float, default=600.0, help="give up on one side after this long")


def _cluster(args: argparse.Namespace):
    from ray.cluster_utils import Cluster

    from meridian.service.cluster.connect import FAST_FAILURE_DETECTION

    # The dashboard is on for both sides: the baseline finds a worker's node through the state API.
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": True, "_system_config": FAST_FAILURE_DETECTION})
    nodes = [cluster.add_node(num_cpus=1, labels={"datacenter": f"dc-{chr(ord('a') + d)}"})
             for d in range(args.dcs) for _ in range(args.nodes_per_dc)]
    cluster.wait_for_nodes()
    return cluster, nodes


def _measure(old: list[dict[str, Any]], new: list[dict[str, Any]], kill_time: float, resume_step: int) -> dict[str, Any]:
    """``old``: the step records of the group that lost a node; ``new``: those of the group formed after,
    which resumed from ``resume_step`` — a step the old group completed even where its record is missing
    (Meridian's rank 0 reports a step one step late, so a break can swallow the last record)."""
    if not new:
        raise RuntimeError("no training step completed after the re-formation")
    first = min(new, key=lambda r: r["time"])
    last_old = max([r["step"] for r in old] + [resume_step])
    return {
        "kill_to_next_step_s": round(first["time"] - kill_time, 2),
        "last_step_before_kill": max((r["step"] for r in old if r["time"] <= kill_time), default=0),
        "last_step_before_reforming": last_old,
        "resumed_from_step": resume_step,
        "steps_lost": max(0, last_old - resume_step),
    }


# -- Meridian -------------------------------------------------------------------------------------------------
def _meridian(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    from meridian.api.server import serve_in_thread
    from meridian.service.core import MeridianService, ServiceConfig

    cluster, nodes = _cluster(args)
    service = MeridianService(ServiceConfig(data_dir=tempfile.mkdtemp(prefix="meridian-bench-"),
                                            ray_address=cluster.address, poll_interval_s=0.2)).start()
    try:
        with serve_in_thread(service) as url, httpx.Client(base_url=url, timeout=30) as api:
            spec = {"name": "bench-recovery", "model": {"preset": args.model},
                    "training": {"steps": args.steps, "global_batch": args.global_batch,
                                 "micro_batch": args.micro_batch, "lr": 3e-3}}
            r = api.post("/v1/jobs", json=spec)
            if r.status_code != 201:
                raise RuntimeError(f"the job was refused: {r.text}")
            job_id = r.json()["id"]
            deadline = time.monotonic() + args.timeout_s
            job = _wait(api, job_id, lambda j: (j["progress"]["step"] or 0) >= args.kill_at_step, deadline)
            victim = next(p for p in job["placement"] if p["rank"] != 0 and p["datacenter"] == "dc-a")
            kill_time = time.time()
            cluster.remove_node(next(n for n in nodes if n.node_id == victim["node_id"]), allow_graceful=False)
            job = _wait(api, job_id, lambda j: j["state"] in ("succeeded", "failed", "cancelled"), deadline)
            if job["state"] != "succeeded":
                raise RuntimeError(f"the Meridian job ended {job['state']}: {job['message']}")
            events = api.get(f"/v1/jobs/{job_id}/events").json()["events"]
            formed = [e["data"] for e in events if e["kind"] == "epoch_formed" and e["data"]["epoch"] == 2]
            records = api.get(f"/v1/jobs/{job_id}/metrics").json()["points"]
            old = [r for r in records if r.get("epoch", 1) < 2]
            new = [r for r in records if r.get("epoch", 1) >= 2]
            out = _measure(old, new, kill_time, formed[0]["resume_step"])
            out["workers_after"] = formed[0]["datacenters"]
            out["final_loss"] = job["result"]["final_loss"]
            return out
    finally:
        service.stop()
        cluster.shutdown()


def _wait(api: Any, job_id: str, ok: Any, deadline: float) -> dict[str, Any]:
    while time.monotonic() < deadline:
        job = api.get(f"/v1/jobs/{job_id}").json()
        if ok(job) or job["state"] in ("failed", "cancelled"):
            return job
        time.sleep(0.2)
    raise RuntimeError(f"timed out waiting for job {job_id} ({job['state']}, step {job['progress']['step']})")


# -- Ray Train's elastic path -----------------------------------------------------------------------------
class _StepLog:
    """Collects (step, end time, worker group) from the baseline's rank 0 across restarts, and the step
    each worker group started from."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.starts: list[int] = []

    def start(self, step: int) -> None:
        self.starts.append(step)

    def step(self, step: int, at: float) -> None:
        self.records.append({"step": step, "time": at, "group": len(self.starts)})

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
            log.step.remote(done, time.time())
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

    from meridian.workers.contracts.config import DataConfig, OptimConfig, TrainConfig
    from meridian.workers.contracts.model_config import model_preset

    cluster, nodes = _cluster(args)
    try:
        ray.init(address=cluster.address, namespace="meridian-bench")
        log = ray.remote(_StepLog).options(name="steplog", namespace="meridian-bench", num_cpus=0).remote()
        workers = args.dcs * args.nodes_per_dc
        cfg = TrainConfig(job_id="bench-baseline", model=model_preset(args.model), data=DataConfig(),
                          optim=OptimConfig(lr=3e-3), steps=args.steps, global_batch=args.global_batch,
                          micro_batch=args.micro_batch)
        trainer = TorchTrainer(
            _baseline_loop, train_loop_config={"train": cfg, "log": "steplog", "every": args.checkpoint_every},
            scaling_config=ScalingConfig(num_workers=(1, workers), resources_per_worker={"CPU": 1}),
            run_config=RunConfig(storage_path=tempfile.mkdtemp(prefix="meridian-bench-ray-"),
                                 failure_config=FailureConfig(max_failures=3),
                                 checkpoint_config=CheckpointConfig(num_to_keep=2)),
        )
        outcome: dict[str, Any] = {}
        fit = threading.Thread(target=lambda: outcome.setdefault("result", trainer.fit()), daemon=True)
        fit.start()
        deadline = time.monotonic() + args.timeout_s
        while time.monotonic() < deadline:
            records, _ = ray.get(log.get.remote())
            if records and records[-1]["step"] >= args.kill_at_step:
                break
            time.sleep(0.2)
        victim = _node_of_a_worker(nodes)
        kill_time = time.time()
        cluster.remove_node(victim, allow_graceful=False)
        fit.join(max(1.0, deadline - time.monotonic()))
        if fit.is_alive():
            raise RuntimeError(f"Ray Train's elastic run did not finish within {args.timeout_s:.0f} s")
        if outcome["result"].error is not None:
            raise RuntimeError(f"Ray Train's elastic run failed: {outcome['result'].error}")
        records, starts = ray.get(log.get.remote())
        if len(starts) < 2:
            raise RuntimeError("Ray Train's run finished without restarting its worker group after the kill")
        old = [r for r in records if r["group"] < len(starts)]
        new = [r for r in records if r["group"] == len(starts)]
        return _measure(old, new, kill_time, starts[-1])
    finally:
        ray.shutdown()
        cluster.shutdown()


def _node_of_a_worker(nodes: list[Any]) -> Any:
    """A node running a training worker but not the Train controller (whose loss ends any Train run)."""
    from ray.util.state import list_actors

    alive = list_actors(filters=[("state", "=", "ALIVE")], limit=10_000)
    busy = {a.node_id for a in alive if a.class_name == "RayTrainWorker"}
    controller = {a.node_id for a in alive if "Controller" in a.class_name}
    return next(n for n in nodes if n.node_id in busy - controller)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if not 0 < args.kill_at_step < args.steps:
        raise ValueError(f"--kill-at-step must be between 1 and --steps - 1 (got {args.kill_at_step})")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    sides: dict[str, list[dict[str, Any]]] = {"meridian": []}
    if not args.skip_baseline:
        sides["ray_train_elastic"] = []
    for _ in range(args.rounds):
        sides["meridian"].append(_meridian(args))
        if not args.skip_baseline:
            sides["ray_train_elastic"].append(_ray_train_elastic(args))
    report: dict[str, Any] = {
        "setup": {"datacenters": args.dcs, "nodes_per_dc": args.nodes_per_dc, "model": args.model, "steps": args.steps,
                  "kill_at_step": args.kill_at_step, "baseline_checkpoint_every": args.checkpoint_every},
    }
    for side, runs in sides.items():
        report[side] = {
            "kill_to_next_step_s": statistics.median(r["kill_to_next_step_s"] for r in runs),
            "steps_lost": max(r["steps_lost"] for r in runs), "runs": runs,
        }
    if "ray_train_elastic" in report:
        report["speedup"] = round(report["ray_train_elastic"]["kill_to_next_step_s"]
                                  / report["meridian"]["kill_to_next_step_s"], 2)
    return report


def render(r: dict[str, Any]) -> str:
    lines = [f"{'path':<20} {'kill→next step (s)':>19} {'steps lost':>11}"]
    for side in ("meridian", "ray_train_elastic"):
        if side in r:
            lines.append(f"{side:<20} {r[side]['kill_to_next_step_s']:>19.2f} {r[side]['steps_lost']:>11}")
    if "speedup" in r:
        lines.append(f"Meridian recovers {r['speedup']}× faster")
    return "\n".join(lines)
