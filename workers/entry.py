"""What one Ray Train worker runs: learn where it is, build the groups from that, train, report.

Each worker reads its datacenter from its node's ``datacenter`` label (never from its IP or rank: local
simulated nodes share one IP). The layout the process groups are built from is what the labels say; the
plan's intended layout is only checked against it. Progress goes to the job's runner actor (named
``runner_name`` in namespace ``namespace``) with fire-and-forget calls, so a slow service never slows a
step. Must not import ``meridian.api`` or ``meridian.service``: this runs on remote nodes.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import replace
from typing import Any

import ray
import ray.train
import torch
import torch.distributed as dist

from meridian.workers.config import TrainConfig
from meridian.workers.train_loop import train

DATACENTER_LABEL = "datacenter"


class RunnerSink:
    """Sends rank 0's per-step records to the job runner actor without waiting for it."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner

    def step(self, record: dict[str, Any]) -> None:
        self.runner.push_progress.remote([record])


def _device() -> torch.device:
    try:
        from ray.train.torch import get_device

        return get_device()
    except Exception:  # noqa: BLE001 - no accelerator assigned: train on CPU
        return torch.device("cpu")


def ray_train_entry(loop_config: dict[str, Any]) -> None:
    """``train_loop_per_worker`` of the job's TorchTrainer."""
    cfg = TrainConfig.from_dict(loop_config["config"])
    runner = ray.get_actor(loop_config["runner_name"], namespace=loop_config["namespace"])
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    rt = ray.get_runtime_context()
    dc = rt.get_node_labels().get(DATACENTER_LABEL)
    if not dc:
        raise RuntimeError(
            f"worker {rank} runs on node {rt.get_node_id()} which has no '{DATACENTER_LABEL}' label; "
            "start every worker node with `ray start --labels datacenter=<name>`"
        )
    device = _device()
    placed = [None] * dist.get_world_size()
    dist.all_gather_object(placed, dc)
    if cfg.datacenters and tuple(placed) != cfg.datacenters:
        raise RuntimeError(
            f"workers landed in datacenters {placed} but the plan placed them in {list(cfg.datacenters)}; "
            "the label selectors were not honoured — check the nodes' 'datacenter' labels"
        )
    runner.push_event.remote("worker_started", f"rank {rank} started in {dc} on node {rt.get_node_id()[:12]}", {
        "rank": rank, "node_id": rt.get_node_id(), "datacenter": dc, "hostname": socket.gethostname(),
        "pid": os.getpid(), "device": str(device), "time": time.time(),
    })
    result = train(replace(cfg, datacenters=tuple(placed)), sink=RunnerSink(runner), device=device)
    summary = {
        "first_loss": result.first_loss, "final_loss": result.final_loss, "eval_loss": result.eval_loss,
        "steps": result.steps, "tokens_per_s": result.tokens_per_s,
        "inter_dc_bytes_per_step": result.inter_dc_bytes_per_step,
    }
    if rank == 0:
        ray.get(runner.push_result.remote(summary))
    ray.train.report(summary)
