"""What the inter-DC sync engine costs and saves, on local gloo processes. Prints one JSON object.

    .venv/bin/python -m meridian.bench.sync_engine [--model tiny] [--steps 12] [--layout a,a,b] \
        [--wan-rtt-ms 40 --wan-gbps 1]

- ``optimizer_bytes_per_rank``: the hierarchical engine's AdamW state (sharded inside each DC by FSDP2) against
  flat sync's (DDP: the whole state on every rank) on every rank (ratio ≈ 1/N for N ranks in a DC).
- ``overlap``: mean ``overlap_fraction`` / ``comm_s`` / ``exposed_s`` of the overlapped sharded engine
  (steps after the first): on loopback communication is cheap and there is little to hide; with
  ``--wan-rtt-ms`` every inter-DC collective waits for the emulated link (:mod:`meridian.workers.wan.collectives`).
- ``compression``: final-5-step mean loss and inter-DC bytes per step for none / bf16 / int8.
Timings are this machine's, not assertions; the tests assert the maths.
"""

from __future__ import annotations

import argparse
import json
import statistics

from meridian.workers.contracts.config import (
    Compression,
    OptimConfig,
    SyncConfig,
    SyncStrategy,
    TrainConfig,
    WanConfig,
)
from meridian.workers.contracts.model_config import model_preset
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.loop.train import ListSink, train


def _runs(rank: int, world: int, configs: dict[str, TrainConfig]) -> dict:
    out = {}
    for name, cfg in configs.items():
        sink = ListSink()
        result = train(cfg, sink=sink)
        out[name] = {"records": sink.records, "result": result}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--layout", default="a,a,b")
    ap.add_argument("--wan-rtt-ms", type=float, default=None, help="emulate a WAN with this round trip")
    ap.add_argument("--wan-gbps", type=float, default=1.0)
    args = ap.parse_args()
    wan = WanConfig(rtt_ms=args.wan_rtt_ms, gbps=args.wan_gbps) if args.wan_rtt_ms is not None else None
    dcs = tuple(args.layout.split(","))

    def cfg(**sync) -> TrainConfig:
        return TrainConfig(
            job_id="bench", model=model_preset(args.model), steps=args.steps, global_batch=4 * len(dcs),
            micro_batch=2, datacenters=dcs, sync=SyncConfig(**sync), optim=OptimConfig(warmup_steps=2), wan=wan,
        )  # fmt: skip

    configs = {
        "flat": cfg(strategy=SyncStrategy.FLAT),
        "sharded": cfg(overlap=False),
        "sharded_overlap": cfg(overlap=True, inter_dc_chunk_mb=0.0625),
        **{
            f"compression_{c.value}": cfg(compression=c, inter_dc_chunk_mb=0.0625)
            for c in Compression
        },
    }
    per_rank = run_processes(_runs, len(dcs), configs, timeout_s=1800)
    r0 = per_rank[0]
    timed = r0["sharded_overlap"]["records"][1:]
    tail = {
        c.value: statistics.mean(x.loss for x in r0[f"compression_{c.value}"]["records"][-5:])
        for c in Compression
    }
    print(json.dumps({
        "model": args.model, "params": model_preset(args.model).num_params, "layout": ",".join(dcs),
        "steps": args.steps, "wan": None if wan is None else {"rtt_ms": wan.rtt_ms, "gbps": wan.gbps},
        "optimizer_bytes_per_rank": {
            "flat": [r["flat"]["result"].optimizer_state_bytes for r in per_rank],
            "sharded": [r["sharded"]["result"].optimizer_state_bytes for r in per_rank],
        },
        "overlap": {
            "overlap_fraction": statistics.mean(x.overlap_fraction for x in timed),
            "comm_s": statistics.mean(x.comm_s for x in timed),
            "exposed_s": statistics.mean(x.exposed_s for x in timed),
            "step_s": statistics.mean(x.step_s for x in timed),
        },
        "compression": {
            c: {"final5_loss": tail[c], "delta_vs_none": tail[c] - tail["none"],
                "inter_dc_bytes_per_step": r0[f"compression_{c}"]["result"].inter_dc_bytes_per_step}
            for c in tail
        },
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
