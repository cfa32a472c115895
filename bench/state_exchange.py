"""``meridian bench state-exchange``: what a re-formed epoch moves to rebuild its state, targeted vs gathered.

    meridian bench state-exchange --json [--params-m 50] [--ranks-per-dc 2] [--repeats 3]

Two datacenters of ``--ranks-per-dc`` ranks each held a sharded state (each rank 1/k of every parameter's values
and AdamW moments, as the hierarchical engine shards it); the last rank of dc-b died. The survivors (one process
each, spawned, gloo on this host) rebuild the epoch's state for the re-formed layout (dc-b re-sharded over one rank
fewer), alternately in two ways, from the same snapshots:

- ``gather_all``: every rank all-gathers every survivor's whole shard and pools them (Meridian before this
  bench: two collectives, the descriptions and then the numbers);
- ``targeted``: :func:`~meridian.workers.elastic.state_exchange.rebuild_state` (each rank receives what it lacks
  of the values and of its new ranges' moments, once; what dc-b lacks crosses once and is relayed inside dc-b).

Per way: wall seconds (the slowest rank's, median over repeats) and the bytes that arrived at each rank, in all
and from the other datacenter, read from the buffers that received them. There is no inter-DC link here (one host):
the times say what the work and the local copies cost; the bytes are what a link between datacenters would carry.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

NAME = "state-exchange"
HELP = "bytes and time to rebuild a re-formed epoch's state: every shard to every rank vs only what each lacks"
MOMENTS = ("exp_avg", "exp_avg_sq")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params-m", type=float, default=50.0, help="model parameters, millions (default 50)")
    p.add_argument("--tensors", type=int, default=48, help="parameter tensors the model is split into")
    p.add_argument("--ranks-per-dc", type=int, default=2, help="ranks per datacenter before the loss (≥ 2)")
    p.add_argument("--repeats", type=int, default=3)


def _numels(params: int, tensors: int) -> dict[str, int]:
    return {f"p{i:03d}": params * (i + 1) // tensors - params * i // tensors for i in range(tensors)}


def _share(numel: int, i: int, k: int) -> tuple[int, int]:
    return numel * i // k, numel * (i + 1) // k


def _rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from meridian.workers.elastic.state_exchange import gather_shards, rebuild_state, share_offers
    from meridian.workers.state.exchange_plan import Offer
    from meridian.workers.state.replica_state import LocalShard, StatePiece, assemble, pack

    k = cfg["ranks_per_dc"]
    dcs = ["dc-a"] * k + ["dc-b"] * (k - 1)
    index, before, after = (rank, k, k) if rank < k else (rank - k, k, k - 1)
    numels = _numels(cfg["params"], cfg["tensors"])
    pieces = []
    for name, numel in numels.items():
        a, b = _share(numel, index, before)
        g = torch.Generator().manual_seed(hash((name, a)) % 2**31)  # the same numbers in both DCs
        pieces.append(StatePiece(name, a, b, torch.randn(b - a, generator=g),
                                 {m: torch.randn(b - a, generator=g) for m in MOMENTS}))  # fmt: skip
    mine = pack(LocalShard(7, 7, tuple(pieces)))
    needs = [(name, *_share(numel, index, after)) for name, numel in numels.items()]
    shapes = {name: torch.Size([numel]) for name, numel in numels.items()}
    out: dict[str, list] = {"gather_all": [], "targeted": []}
    for _ in range(cfg["repeats"]):
        for way in ("gather_all", "targeted"):
            dist.barrier()
            began = time.perf_counter()
            if way == "targeted":
                state = rebuild_state(mine, dc=dcs[rank], needs=needs, shapes=shapes)
                received = state.received
            else:  # the descriptions and the sizes in one collective, then the numbers: two, as before
                held = [o.held for o in share_offers(Offer(dcs[rank], mine[0], None))]
                shards = gather_shards(mine, held)
                assemble([s for s in shards if s is not None], shapes)
                padded = 4 * max(h["numel"] for h in held)  # what each rank's buffer in the all-gather holds
                received = {r: padded for r in range(world) if r != rank}
            wall = time.perf_counter() - began
            out[way].append({"wall_s": wall, "received": sum(received.values()),
                             "received_cross_dc": sum(b for r, b in received.items() if dcs[r] != dcs[rank])})
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from meridian.workers.distributed.multiproc import run_processes

    if args.ranks_per_dc < 2:
        raise ValueError("--ranks-per-dc must be at least 2 (dc-b loses one rank and keeps the rest)")
    cfg = {"params": int(args.params_m * 1e6), "tensors": args.tensors, "ranks_per_dc": args.ranks_per_dc,
           "repeats": args.repeats}  # fmt: skip
    world = 2 * args.ranks_per_dc - 1
    per_rank = run_processes(_rank, world, cfg, timeout_s=1800)
    result: dict[str, Any] = {"params": cfg["params"], "state_bytes_per_replica": 12 * cfg["params"],
                              "survivors": world, "datacenters": {"dc-a": args.ranks_per_dc,
                                                                  "dc-b": args.ranks_per_dc - 1}}  # fmt: skip
    for way in ("gather_all", "targeted"):
        walls = [max(r[way][i]["wall_s"] for r in per_rank) for i in range(args.repeats)]
        got = [r[way][0]["received"] for r in per_rank]
        cross = [r[way][0]["received_cross_dc"] for r in per_rank]
        result[way] = {"wall_s": round(statistics.median(walls), 3), "wall_s_each": [round(w, 3) for w in walls],
                       "received_bytes_max_rank": max(got), "received_bytes_all_ranks": sum(got),
                       "cross_dc_bytes_all_ranks": sum(cross)}  # fmt: skip
    g, t = result["gather_all"], result["targeted"]
    result["ratio_targeted_vs_gather_all"] = {
        "wall_s": round(t["wall_s"] / g["wall_s"], 3) if g["wall_s"] else None,
        "received_bytes_all_ranks": round(t["received_bytes_all_ranks"] / g["received_bytes_all_ranks"], 4),
        "cross_dc_bytes_all_ranks": round(t["cross_dc_bytes_all_ranks"] / g["cross_dc_bytes_all_ranks"], 4),
    }
    return result


def render(r: dict[str, Any]) -> str:
    lines = [f"{r['params'] / 1e6:.0f}M parameters ({r['state_bytes_per_replica'] / 1e9:.2f} GB of fp32 state per "
             f"replica), survivors {r['datacenters']}", f"{'way':<12}{'wall s':>9}{'max rank GB':>13}"
             f"{'all ranks GB':>14}{'cross-DC GB':>13}"]  # fmt: skip
    for way in ("gather_all", "targeted"):
        w = r[way]
        lines.append(f"{way:<12}{w['wall_s']:>9.3f}{w['received_bytes_max_rank'] / 1e9:>13.3f}"
                     f"{w['received_bytes_all_ranks'] / 1e9:>14.3f}{w['cross_dc_bytes_all_ranks'] / 1e9:>13.3f}")
    return "\n".join(lines)
