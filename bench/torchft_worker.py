"""One replica group of the recovery benchmark's torchft side: a plain process (no Ray), one worker.

``python -m meridian.bench.torchft_worker --replica N --datacenter dc-b --lighthouse ADDR --out FILE ...``
trains the same model, data order and global batch as the other sides: each committed step's samples
depend only on the step, split over the replica groups taking part in its quorum (so a shrunk quorum
trains exactly the samples a full one would). torchft's ``Manager`` (synchronous quorum: the step,
participant count and rank are known before the forward pass), ``Manager.allreduce`` of the flattened
gradients and its ``OptimizerWrapper``, over ``ProcessGroupGloo``. (Not torchft's ``DistributedDataParallel``:
in torchft 0.2 its comm hook asserts — ``assert fut._fut`` — on the next bucket after an all-reduce failed,
so a peer's death crashed the survivors instead of skipping the step.) a group that joins late is healed by torchft (the state of
a peer is streamed to it over HTTP). Every committed step appends ``{"step", "time", "workers", "replica"}``
to ``--out`` (JSON lines), stamped when the optimizer step is done. With ``--die-on FILE`` the process kills
itself with SIGKILL right after the first step it commits once FILE exists, before it asks for the next quorum
(``bench recovery --torchft-kill-phase between-steps``: torchft's fastest outcome, on purpose).
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--replica", type=int, required=True)
    p.add_argument("--datacenter", required=True)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="nano")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--micro-batch", type=int, required=True)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=30.0, help="torchft's timeout for collectives and RPCs")
    p.add_argument("--die-on", default=None,
                   help="a file: once it exists, this process SIGKILLs itself right after its next committed step, "
                        "before it asks for the next quorum (after stamping the time in --died-at)")
    p.add_argument("--died-at", default=None, help="where to write the wall-clock time right before that kill")
    p.add_argument("--host", default=None,
                   help="the address this group's store and manager listen on and advertise (a lab node's, inside "
                        "its datacenter's namespace); default: the store on 127.0.0.1, the manager on the hostname")
    args = p.parse_args()
    if (args.die_on is None) != (args.died_at is None):
        p.error("--die-on and --died-at go together")

    import torch
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo
    from torchft.optim import OptimizerWrapper

    from meridian.workers.contracts.config import DataConfig
    from meridian.workers.contracts.model_config import model_preset
    from meridian.workers.data.text import TextDataset
    from meridian.workers.model.build import build_model
    from meridian.workers.model.gpt import per_sample_loss

    torch.set_num_threads(1)  # one CPU per worker, as the Ray sides reserve
    cfg = model_preset(args.model)
    torch.manual_seed(args.seed)
    raw = build_model(cfg)
    inner = torch.optim.AdamW(raw.parameters(), lr=args.lr)
    # One replica group of one process: it hosts its own store (torchft's per-group rendezvous).
    host = args.host or "127.0.0.1"
    advertised: dict[str, Any] = {}  # torchft's defaults name this process by the hostname
    if args.host:  # which another namespace cannot reach: the manager and the checkpoint server say the address
        from torchft.checkpointing.http_transport import HTTPTransport

        class _AtHost(HTTPTransport):
            def address(self) -> str:
                return f"http://{args.host}:{self._server.socket.getsockname()[1]}/checkpoint/"

        advertised = {"hostname": args.host,
                      "checkpoint_transport": _AtHost(timeout=timedelta(seconds=args.timeout_s), num_chunks=0)}
    store = dist.TCPStore(host_name=host, port=0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=args.timeout_s)), min_replica_size=1,
        load_state_dict=lambda s: (raw.load_state_dict(s["model"]), inner.load_state_dict(s["optim"])),
        state_dict=lambda: {"model": raw.state_dict(), "optim": inner.state_dict()},
        use_async_quorum=False, timeout=timedelta(seconds=args.timeout_s),
        replica_id=f"{args.datacenter}-{args.replica}", store_addr=host, store_port=store.port,
        rank=0, world_size=1, lighthouse_addr=args.lighthouse, **advertised,
    )  # fmt: skip
    model = raw
    _start_together(Path(args.out).parent, args.replica, args.timeout_s * 10)
    opt = OptimizerWrapper(manager, inner)
    data = TextDataset(DataConfig(), cfg.seq_len, args.seed)
    with open(args.out, "a", buffering=1) as out:
        while manager.current_step() < args.steps:
            opt.zero_grad()  # the quorum (and healing from a peer, if this group is behind)
            step, rank, n = manager.current_step(), manager.participating_rank(), manager.num_participants()
            if rank is not None:
                for x, y in data.step_batches(step, args.global_batch, args.micro_batch, rank, n):
                    # torchft averages gradients over the participants: scale so the average is the batch mean.
                    (per_sample_loss(model(x), y).sum() * n / args.global_batch).backward()
            _allreduce_grads(manager, model)
            opt.step()  # commits only if every participant's all-reduce succeeded
            if manager.current_step() > step:
                out.write(json.dumps({"step": manager.current_step(), "time": time.time(), "workers": n,
                                      "replica": args.replica}) + "\n")  # fmt: skip
                if args.die_on is not None and Path(args.die_on).exists():
                    _die(Path(args.died_at))
    manager.shutdown(wait=False)


def _die(stamp: Path) -> None:
    """SIGKILL this process, as a node's death would, once the time is written where the launcher reads it."""
    import os
    import signal

    stamp.write_text(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def _start_together(folder: Path, replica: int, timeout_s: float) -> None:
    """Announce this group (its manager heartbeats to the lighthouse now) and wait for the launcher's go, so
    the first quorum has every group: with ``min_replicas=1`` the lighthouse would start with the first few
    that finished importing torch and heal the others later. A group started again later finds the go."""
    (folder / f"ready-{replica}").touch()
    deadline = time.monotonic() + timeout_s
    while not (folder / "go").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no go from the launcher within {timeout_s:.0f} s")
        time.sleep(0.05)


def _allreduce_grads(manager: Any, model: Any) -> None:
    """One fault-tolerant all-reduce of every gradient, flattened (``Manager.allreduce`` averages over the
    quorum's participants and turns a peer's failure into "do not commit this step")."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    manager.allreduce(flat).wait()
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
        offset += p.numel()


if __name__ == "__main__":
    main()
