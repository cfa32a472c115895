"""``meridian bench gpu``: one GPU, one worker — a Meridian job through the REST API against a plain PyTorch loop.

    meridian bench gpu --json [--model gpt2-124m] [--steps 200] [--global-batch 32] [--micro-batch 16]
                       [--api URL]

Two sides, one after the other on the same GPU, the same model, batch and precision (bf16 autocast, fp32
weights and AdamW state):

- **meridian**: the job goes to ``POST /v1/jobs`` of a service — the one at ``--api`` (e.g. ``meridian serve
  --address auto`` over ``ray start --head --labels datacenter=dc-a``), or, without ``--api``, an embedded
  one-node cluster that owns this host's GPU — and runs as a Ray Train worker with everything a job has
  (elastic agent, sync engine, sharded AdamW, snapshots). Its figures: the job's own ``tokens_per_s`` (the
  mean over the steps after the first) and, from its stored per-step times, the second half's (steady state).
- **plain**: this process trains the same model with ``torch.optim.AdamW(fused=True)``, gradient accumulation
  and clipping, on random tokens already on the GPU (no data loader: the strongest peer); timed the same way,
  from the end of the first step to the end of the last.

MFU of both against one peak, measured here after both sides (:func:`measure_peak_flops`: large bf16
matmuls). Prints the ratio meridian ÷ plain.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

NAME = "gpu"
HELP = "a one-GPU Meridian job through the REST API vs a plain PyTorch loop of the same model (tokens/s, MFU)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt2-124m", help="model preset (default gpt2-124m)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per side (default 200)")
    p.add_argument("--global-batch", type=int, default=32, help="samples per step (default 32)")
    p.add_argument("--micro-batch", type=int, default=16, help="samples per forward/backward (default 16)")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"], help="default bf16")
    p.add_argument("--api", default=None,
                   help="URL of a running service (token from MERIDIAN_TOKEN); default: an embedded one-node cluster")
    p.add_argument("--timeout-s", type=float, default=900.0, help="give up on the job after this long (default 900)")


def job_spec(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "name": f"bench-gpu-{args.model}",
        "model": {"preset": args.model},
        "training": {"steps": args.steps, "global_batch": args.global_batch, "micro_batch": args.micro_batch,
                     "precision": args.precision, "seed": 0},
        "topology": {"datacenters": "auto", "workers_per_datacenter": 1},
        "checkpoint": {"interval_steps": 0},
    }


def run_job(url: str, spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Submit ``spec`` to the service at ``url`` and wait for it to end; the job as the API returns it, with its
    step records (``points``) and each step's time (``step_s``)."""
    from meridian.api.client import ApiError, Client

    client = Client(url, token=os.environ.get("MERIDIAN_TOKEN"))
    job = client.submit(spec)
    try:
        job = client.wait(job["id"], timeout_s=timeout_s)
    except ApiError as e:
        if e.status == 0:  # still running at the deadline: a benchmark leaves nothing behind
            client.cancel(job["id"])
        raise
    if job["state"] != "succeeded":
        raise RuntimeError(f"job {job['id']} {job['state']}: {job['message']}")
    job["events"] = [e["message"] for e in client.events(job["id"])["events"] if e["kind"] == "snapshot_cadence"]
    job["points"] = client.metrics(job["id"])["points"]
    job["step_s"] = {p["step"]: p["step_s"] for p in job["points"] if p.get("step_s")}
    return job


def second_half_tokens_per_s(step_s: dict[int, float], tokens_per_step: int) -> float | None:
    """Tokens/s over the second half of the job's steps: its steady state, without the first steps' start (the
    snapshot cadence widening, the allocator warming up)."""
    late = [s for step, s in sorted(step_s.items()) if step > max(step_s, default=0) // 2]
    return tokens_per_step * len(late) / sum(late) if late and sum(late) > 0 else None


def meridian_side(args: argparse.Namespace) -> dict[str, Any]:
    from meridian.workers.contracts.model_config import model_preset

    spec = job_spec(args)
    if args.api:
        job = run_job(args.api, spec, args.timeout_s)
    else:
        from meridian.api.server import serve_in_thread
        from meridian.service.core import MeridianService, ServiceConfig

        with tempfile.TemporaryDirectory(prefix="meridian-bench-gpu-") as data_dir:
            service = MeridianService(ServiceConfig(data_dir=data_dir, local_datacenters={"dc-a": 1},
                                                    cpus_per_node=4)).start()
            try:
                with serve_in_thread(service, host="127.0.0.1", port=0) as url:
                    job = run_job(url, spec, args.timeout_s)
            finally:
                service.stop()
    result, progress = job["result"] or {}, job["progress"]
    tokens_per_step = args.global_batch * model_preset(args.model).seq_len
    return {"job_id": job["id"], "tokens_per_s": result.get("tokens_per_s"), "final_loss": result.get("final_loss"),
            "tokens_per_s_second_half": second_half_tokens_per_s(job["step_s"], tokens_per_step),
            "device": [p["device"] for p in job["placement"]], "mfu_reported": progress.get("mfu"),
            "step_s_last": progress.get("step_s"), "wall_s": (job["finished_at"] or 0) - (job["started_at"] or 0),
            "snapshot_cadence": job["events"]}


def plain_side(args: argparse.Namespace, device) -> dict[str, Any]:
    """The plain loop: the same module, optimizer settings and clipping as a job's defaults."""
    import torch

    from meridian.workers.contracts.config import OptimConfig
    from meridian.workers.contracts.model_config import model_preset
    from meridian.workers.model.build import build_model
    from meridian.workers.model.gpt import per_sample_loss
    from meridian.workers.optim.adamw import build_adamw

    cfg, opt_cfg = model_preset(args.model), OptimConfig()
    torch.manual_seed(0)
    model = build_model(cfg).to(device)
    opt = build_adamw(model, opt_cfg)  # torch's AdamW, the job's groups; fused on a GPU
    accum = args.global_batch // args.micro_batch
    tokens = torch.randint(0, cfg.vocab_size, (accum, args.micro_batch, cfg.seq_len + 1), device=device)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    losses, t_first = [], 0.0
    for step in range(args.steps):
        for k in range(accum):
            x, y = tokens[k, :, :-1], tokens[k, :, 1:]
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                loss = per_sample_loss(model(x), y).mean() / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt_cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if step == 0:
            _synchronize(device)
            t_first = time.perf_counter()
    _synchronize(device)
    elapsed = time.perf_counter() - t_first
    tokens_per_s = (args.steps - 1) * args.global_batch * cfg.seq_len / elapsed
    del model, opt, tokens
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"tokens_per_s": tokens_per_s, "final_loss": float(losses[-1]) * accum, "timed_s": elapsed}


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from meridian.workers.contracts.model_config import model_preset
    from meridian.workers.loop.observe import measure_peak_flops, mfu

    if not torch.cuda.is_available():
        raise RuntimeError("bench gpu needs a CUDA device; this host has none")
    if args.global_batch % args.micro_batch:
        raise ValueError("--global-batch must be a multiple of --micro-batch")
    device = torch.device("cuda", 0)
    cfg = model_preset(args.model)
    job = meridian_side(args)  # first: the job's worker gets the whole GPU
    plain = plain_side(args, device)
    peak = measure_peak_flops(device)
    for side in (job, plain):
        side["mfu"] = mfu(cfg.flops_per_token, side["tokens_per_s"], 1, peak) if side["tokens_per_s"] else None
    return {
        "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "model": args.model,
        "params": cfg.num_params, "flops_per_token": cfg.flops_per_token, "steps": args.steps,
        "global_batch": args.global_batch, "micro_batch": args.micro_batch, "seq_len": cfg.seq_len,
        "precision": args.precision, "peak_flops": peak.flops, "peak_source": peak.source,
        "meridian": job, "plain": plain,
        "ratio": job["tokens_per_s"] / plain["tokens_per_s"] if job["tokens_per_s"] else None,
        "ratio_second_half": (job["tokens_per_s_second_half"] / plain["tokens_per_s"]
                              if job["tokens_per_s_second_half"] else None),
    }


def render(r: dict[str, Any]) -> str:
    lines = [f"{r['gpu']} · {r['model']} ({r['params'] / 1e6:.0f} M) · {r['precision']} · batch {r['global_batch']}"
             f"×{r['seq_len']} · peak {r['peak_flops'] / 1e12:.0f} TFLOP/s ({r['peak_source']})"]
    for name in ("meridian", "plain"):
        s = r[name]
        lines.append(f"  {name:9s} {s['tokens_per_s']:>10,.0f} tokens/s  MFU {100 * (s['mfu'] or 0):.1f}%  "
                     f"final loss {s['final_loss']:.3f}")
    lines.append(f"  meridian ÷ plain: {r['ratio']:.3f} (second half of the job's steps: {r['ratio_second_half'] or 0:.3f})")
    return "\n".join(lines)
