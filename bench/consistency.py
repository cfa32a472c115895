"""``meridian bench consistency``: the replica consistency check on local gloo processes.

Every rank builds the model from one seed and runs forward + backward on the same micro-batch; the report
gives, per rank, the loss, gradient norm and the largest difference of its parameter and gradient checksums
from the replica most ranks agree with. ``--perturb-rank K`` adds ``--perturb-eps`` to the token embedding on rank K
first, to see the check catch a bad replica.

    meridian bench consistency --workers 4 --perturb-rank 2 --json
"""

from __future__ import annotations

import argparse
import functools

import torch

from meridian.workers.contracts.config import TrainConfig
from meridian.workers.contracts.model_config import model_preset
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.probes.consistency import check_consistency

NAME = "consistency"
HELP = "same seed on every replica: identical initial loss and gradients per rank? (flags a perturbed one)"


def nudge_first_weight(model: torch.nn.Module, eps: float) -> None:
    """Shift the first feature of every row of the first parameter (the token embedding) by ``eps``: a replica
    that drifted. Every row, because one alone may belong to a token the batch never uses; one feature, because
    shifting all of a row's features alike is invisible to the model (LayerNorm subtracts the mean), which
    left loss and gradients equal up to rounding."""
    with torch.no_grad():
        next(model.parameters())[..., 0].add_(eps)


def _rank(rank: int, world: int, cfg: TrainConfig, perturb_rank: int | None, eps: float) -> dict:
    perturb = functools.partial(nudge_first_weight, eps=eps) if rank == perturb_rank else None
    return check_consistency(cfg, perturb=perturb).to_dict()


def run(args: argparse.Namespace) -> dict:
    if args.perturb_rank is not None and not 0 <= args.perturb_rank < args.workers:
        raise ValueError(f"--perturb-rank must be in [0, {args.workers}), got {args.perturb_rank}")
    cfg = TrainConfig(job_id="consistency", model=model_preset(args.model), steps=1, global_batch=args.micro_batch,
                      micro_batch=args.micro_batch, seed=args.seed)
    reports = run_processes(_rank, args.workers, cfg, args.perturb_rank, args.perturb_eps, timeout_s=300)
    report = reports[0]
    report.update(model=args.model, perturbed_rank=args.perturb_rank, perturb_eps=args.perturb_eps,
                  all_ranks_agree_on_report=all(r == report for r in reports))
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--model", default="nano")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--perturb-rank", type=int, default=None)
    p.add_argument("--perturb-eps", type=float, default=1e-3)


def render(result: dict) -> str:
    rows = [f"{result['model']} on {result['world_size']} ranks; reference rank {result['reference_rank']}",
            f"{'rank':>4} {'loss':>12} {'grad norm':>12} {'max Δparam':>12} {'max Δgrad':>12}  ok"]
    for r in result["ranks"]:
        rows.append(f"{r['rank']:>4} {r['loss']:>12.6f} {r['grad_norm']:>12.6f} {r['max_param_diff']:>12.3g} "
                    f"{r['max_grad_diff']:>12.3g}  {'yes' if r['consistent'] else 'NO'}")
    bad = result["inconsistent_ranks"]
    rows.append(f"inconsistent ranks: {bad}" if bad else "all replicas identical")
    return "\n".join(rows)
