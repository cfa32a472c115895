"""``meridian bench memory``: one training step's peak device memory against the planner's estimate.

    meridian bench memory --json [--models gpt2-124m,llama-160m] [--micro-batches 4,16] [--precisions bf16,fp32]

For each model × precision × micro-batch on this host's GPU: build the model, run a warm-up step (forward,
backward, fused AdamW, so the optimizer state exists), set the gradients to None, then measure one more step's
peak (``torch.cuda.max_memory_allocated``). Beside it, the planner's figure for the same layout
(:func:`meridian.service.planning.cost_model.memory_per_device`: weights, gradients, AdamW state and the
activations of one micro-batch) and the ratio estimate ÷ measured. A ratio under 1 means the planner would
place a layout that does not fit. ``tests/data/h100_step_memory.json`` holds an H100's rows, which the tests
hold the estimate to.

    meridian bench memory --cpu-layouts [NAMES] --json

instead runs multi-rank layouts on this host's CPUs (gloo) and compares each rank's peak live tensor bytes in one
FSDP2 step with the planner's per-rank figure (:mod:`meridian.bench.memory_cpu`).
"""

from __future__ import annotations

import argparse
from typing import Any

NAME = "memory"
HELP = "one training step's peak GPU memory per model, precision and micro-batch vs the planner's estimate"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default="gpt2-124m,llama-160m", help="comma-separated presets")
    p.add_argument("--micro-batches", default="2,8", help="comma-separated micro-batch sizes (default 2,8)")
    p.add_argument("--precisions", default="bf16,fp32", help="comma-separated: bf16 (autocast) and/or fp32")
    p.add_argument("--cpu-layouts", nargs="?", const="all", default=None, metavar="NAMES",
                   help="instead: multi-rank layouts on CPU (gloo), each rank's peak live tensor bytes vs the "
                        "planner (all, or comma-separated: fsdp-4, hsdp-2x2, fsdp-4-full-ckpt)")
    p.add_argument("--cpu-micro-batch", type=int, default=4, help="--cpu-layouts: samples per rank (default 4)")
    p.add_argument("--cpu-seq-len", type=int, default=256, help="--cpu-layouts: tokens per sample (default 256)")


def measure_step(model_name: str, precision: str, micro_batch: int, device) -> dict[str, Any]:
    """Bytes before (weights + AdamW state) and at the peak of one training step, after a warm-up step."""
    import torch

    from meridian.workers.contracts.config import OptimConfig
    from meridian.workers.contracts.model_config import model_preset
    from meridian.workers.model.build import build_model
    from meridian.workers.model.gpt import per_sample_loss
    from meridian.workers.optim.adamw import build_adamw

    cfg = model_preset(model_name)
    torch.manual_seed(0)
    model = build_model(cfg).to(device)
    opt = build_adamw(model, OptimConfig())
    x = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len + 1), device=device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = per_sample_loss(model(x[:, :-1]), x[:, 1:]).mean()
        loss.backward()
        opt.step()

    step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    params = sum(p.numel() for p in model.parameters())
    return {"model": model_name, "precision": precision, "micro_batch": micro_batch, "params": params,
            "base_bytes": base, "peak_bytes": peak}


def planner_estimate(model_name: str, micro_batch: int, precision: str = "bf16") -> float:
    """The planner's bytes per device for one unsharded replica on one device, ``micro_batch`` at a time, in
    ``precision`` (``bf16`` autocast or ``fp32``)."""
    from meridian.service.planning.cost_model import Layout, memory_per_device
    from meridian.workers.contracts.model_config import model_preset

    lay = Layout(tp=1, pp=1, dp=1, num_dcs=1, dp_per_dc=1, pp_spans_dcs=False, micro_batch=micro_batch,
                 micro_batches=1, hierarchical=False, overlap=False, fp32=precision == "fp32")
    return memory_per_device(model_preset(model_name), lay, 1)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    if args.cpu_layouts is not None:
        from meridian.bench import memory_cpu

        names = None if args.cpu_layouts == "all" else args.cpu_layouts.split(",")
        return memory_cpu.run(args.cpu_micro_batch, args.cpu_seq_len, names)
    if not torch.cuda.is_available():
        raise RuntimeError("bench memory measures a GPU's allocator; this host has no CUDA device")
    device = torch.device("cuda", 0)
    rows = []
    for model_name in args.models.split(","):
        for precision in args.precisions.split(","):
            if precision not in ("bf16", "fp32"):
                raise ValueError(f"precision {precision!r}: use bf16 or fp32")
            for b in (int(v) for v in args.micro_batches.split(",")):
                row = measure_step(model_name, precision, b, device)
                torch.cuda.empty_cache()  # the step's model and optimizer are gone: start the next from nothing
                row["estimate_bytes"] = planner_estimate(model_name, b, precision)
                row["estimate_over_measured"] = row["estimate_bytes"] / row["peak_bytes"]
                rows.append(row)
    return {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "rows": rows}


def render(r: dict[str, Any]) -> str:
    if "gpu" not in r:
        lines = [f"{r['host']} ({r['cpus']} CPUs) · torch {r['torch']} · {r['precision']}",
                 f"{'layout':18s} {'b':>3s} {'s':>5s} {'measured MB':>12s} {'estimate MB':>12s} {'ratio':>6s} "
                 f"{'rss/peak':>8s}"]
        for row in r["rows"]:
            lines.append(f"{row['layout']:18s} {row['micro_batch']:>3d} {row['seq_len']:>5d} "
                         f"{row['measured_peak_bytes'] / 1e6:>12.1f} {row['estimate_bytes'] / 1e6:>12.1f} "
                         f"{row['estimate_over_measured']:>6.3f} {row['rss_growth_over_peak']:>8.3f}")
        return "\n".join(lines)
    lines = [f"{r['gpu']} · torch {r['torch']}", f"{'model':12s} {'prec':5s} {'b':>3s} {'measured GB':>12s} "
                                                 f"{'estimate GB':>12s} {'ratio':>6s}"]
    for row in r["rows"]:
        lines.append(f"{row['model']:12s} {row['precision']:5s} {row['micro_batch']:>3d} "
                     f"{row['peak_bytes'] / 1e9:>12.2f} {row['estimate_bytes'] / 1e9:>12.2f} "
                     f"{row['estimate_over_measured']:>6.3f}")
    return "\n".join(lines)
