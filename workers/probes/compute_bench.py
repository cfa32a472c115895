"""Measure a device's sustained training throughput on the model's own shape.

Runs forward + backward of the GPT for a few micro-batches and divides the model's FLOPs
(:attr:`ModelConfig.flops_per_token`) by the time: the planner's ``device_flops``. Run it on every worker
slot at once (as the service's probe does), since devices that share a host's cores or memory bandwidth
are slower together than alone — exactly the condition training runs in.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from meridian.workers.contracts.config import Precision
from meridian.workers.contracts.model_config import ModelConfig
from meridian.workers.loop.precision import autocast_context
from meridian.workers.model.build import build_model


def device_memory_bytes(device: torch.device) -> int | None:
    """The device's memory as the device reports it (``mem_get_info``'s total; the free part at probe time
    is less than what training gets, the probe's own model being resident); ``None`` on CPU."""
    if device.type != "cuda":
        return None
    _free, total = torch.cuda.mem_get_info(device)
    return int(total)


def training_flops(model_cfg: ModelConfig, micro_batch: int, *, min_seconds: float = 2.0, warmup: int = 2,
                   device: torch.device | None = None, threads: int | None = None,
                   precision: Precision = Precision.FP32) -> dict[str, float]:
    """FLOP/s of forward + backward on ``device`` (no optimizer step), over at least ``min_seconds``, in
    ``precision`` as training runs it (bf16 autocast: several times fp32's rate on a GPU)."""
    if threads:
        torch.set_num_threads(threads)
    device = device or torch.device("cpu")
    torch.manual_seed(0)
    model = build_model(replace(model_cfg, init_from="")).to(device)  # timing only: random weights
    x = torch.randint(0, model_cfg.vocab_size, (micro_batch, model_cfg.seq_len), device=device)

    def one() -> None:
        with autocast_context(precision, device):
            loss = model(x, x).mean()  # as the loop asks for the loss
        loss.backward()

    for _ in range(warmup):
        one()
    n, t0 = 0, time.perf_counter()
    while True:
        one()
        n += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - t0
        if elapsed >= min_seconds:
            break
    tokens = n * micro_batch * model_cfg.seq_len
    # The optimizer step is per step, not per token: the planner adds it as a fixed overhead.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    opt.step()
    t1, steps = time.perf_counter(), 0
    while steps < 3 or time.perf_counter() - t1 < min(0.5, min_seconds / 4):
        opt.step()
        steps += 1
    out = {"flops": tokens * model_cfg.flops_per_token / elapsed, "seconds_per_micro_batch": elapsed / n,
           "micro_batches": n, "optimizer_step_s": (time.perf_counter() - t1) / steps}
    memory = device_memory_bytes(device)
    if memory is not None:  # the planner's device_memory_bytes, instead of its 40 GiB guess
        out["device_memory_bytes"] = memory
    return out
