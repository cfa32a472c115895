"""A Ray actor that runs the collective benchmark on its node, for the service's link probe.

Two actors on two nodes measure the link between them (rank 0 tells rank 1 where to meet); one actor
alone measures the intra-node tier by spawning two local processes. Runs on any node: imports only
``meridian.workers``.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.distributed.ports import free_port
from meridian.workers.probes.collective_bench import all_reduce_perf


def _local_bench(rank: int, world: int, sizes: list[int]) -> list[dict[str, Any]]:
    return [r.to_dict() for r in all_reduce_perf(sizes)]


class ProbeActor:
    def address(self) -> tuple[str, int]:
        """Where rank 0 listens: this node's IP and a free port on it."""
        import ray

        return ray.util.get_node_ip_address() or socket.gethostbyname(socket.gethostname()), free_port()

    def run(self, master: tuple[str, int], rank: int, world: int, sizes: list[int], timeout_s: float = 120) -> list[dict[str, Any]]:
        """Join a gloo group of ``world`` probe actors and benchmark all-reduce across them."""
        from datetime import timedelta

        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://{master[0]}:{master[1]}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        try:
            return [r.to_dict() for r in all_reduce_perf(sizes)]
        finally:
            dist.destroy_process_group()

    def compute(self, model: dict[str, Any], micro_batch: int, min_seconds: float = 2.0,
                precision: str = "fp32", use_gpu: bool = False) -> dict[str, float]:
        """Forward + backward throughput of this model shape on the device the job's workers train on (a GPU with
        ``use_gpu``, else the CPU), in ``precision``. (It took the GPU wherever the node had one: on a GPU
        workstation a CPU job's compute was measured on the GPU.)"""
        import torch

        from meridian.workers.contracts.config import Precision
        from meridian.workers.contracts.model_config import ModelConfig
        from meridian.workers.probes.compute_bench import training_flops

        if use_gpu and not torch.cuda.is_available():
            raise RuntimeError("the compute probe was placed for a GPU worker but this process sees no CUDA device "
                               f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        device = torch.device("cuda") if use_gpu else torch.device("cpu")
        return training_flops(ModelConfig(**model), micro_batch, min_seconds=min_seconds, device=device, threads=1,
                              precision=Precision(precision))

    def run_intra_node(self, sizes: list[int], procs: int = 2, timeout_s: float = 120) -> list[dict[str, Any]]:
        """Benchmark ``procs`` processes on this node talking over loopback/shared memory."""
        return run_processes(_local_bench, procs, sizes, timeout_s=timeout_s)[0]
