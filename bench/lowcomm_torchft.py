"""torchft's DiLoCo / streaming DiLoCo (``torchft.local_sgd.DiLoCo``) on Meridian's model, data and schedule.

One rank per datacenter, each its own torchft replica group of one: a :class:`torchft.Manager` over a gloo
process group, a lighthouse on rank 0 (torchft's own quorum service). The model, its initial weights (same
seed), the inner AdamW (same parameter groups, learning-rate schedule and gradient clipping), every step's
samples and the held-out evaluation are Meridian's, so the run differs from Meridian's DiLoCo only in the
outer loop: torchft's pseudo-gradient all-reduce, quorum and commit protocol and outer optimizer
(``torch.optim.SGD`` with Nesterov momentum, as the papers and torchft's examples use it).

Measured, not computed:

- inter-DC bytes: every tensor handed to the process group's ``allreduce`` (the transport torchft sends
  through), counted in :class:`CountingGloo`; on CPU torchft sends fp32 (its quantised all-reduce needs Triton
  on a GPU);
- the link: without the lab every all-reduce's result is usable only when an α–β model of the emulated link
  (one-way latency plus bytes over bandwidth, transfers queued FIFO on this rank's outbound link, the model of
  :mod:`meridian.workers.wan.collectives`) says it would have arrived;
- time blocked on communication: ``work.wait()`` of the outer all-reduces plus the quorum and commit RPCs.

torchft's code is used as installed; nothing of it is copied here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meridian.workers.contracts.config import TrainConfig, WanConfig
from meridian.workers.data.shards import make_dataset
from meridian.workers.loop.precision import autocast_context
from meridian.workers.loop.replica import evaluate
from meridian.workers.loop.schedule import lr_at
from meridian.workers.model.build import build_model
from meridian.workers.model.gpt import per_sample_loss
from meridian.workers.optim.adamw import build_adamw, set_lr

TIMEOUT = timedelta(seconds=120)


@dataclass(frozen=True)
class TorchftOuter:
    inner_steps: int
    fragments: int = 1
    sync_delay: int = 0
    """torchft's ``fragment_sync_delay`` (tau): the all-reduce starts this many steps before it is applied."""
    alpha: float = 0.0
    """torchft's ``fragment_update_alpha``: weight of the local parameters in the merge after a sync."""
    outer_lr: float = 0.7
    outer_momentum: float = 0.9


class LinkModel:
    """This rank's outbound inter-DC link as an α–β model: transfers queue FIFO, each arrives one one-way
    latency after its last byte left."""

    def __init__(self, wan: WanConfig | None) -> None:
        self.wan = wan
        self.free_at = 0.0

    def ready_at(self, nbytes: int) -> float:
        now = time.monotonic()
        if self.wan is None:
            return now
        begin = max(now, self.free_at)
        self.free_at = begin + nbytes / (self.wan.gbps * 1e9 / 8)
        return self.free_at + self.wan.rtt_ms / 2000.0


def counting_gloo() -> Any:
    """A torchft gloo process group that counts the bytes of every tensor given to ``allreduce``."""
    from torchft.process_group import ProcessGroupGloo

    class CountingGloo(ProcessGroupGloo):
        def __init__(self) -> None:
            super().__init__(timeout=TIMEOUT)
            self.bytes_sent = 0
            self.calls = 0

        def allreduce(self, tensors: list[torch.Tensor], opts: object) -> Any:
            self.calls += 1
            self.bytes_sent += sum(t.numel() * t.element_size() for t in tensors)
            return super().allreduce(tensors, opts)

    return CountingGloo()


class Blocked:
    """Seconds this rank spent blocked on the outer sync's communication (waits and torchft's RPCs)."""

    def __init__(self) -> None:
        self.s = 0.0

    def timed(self, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.s += time.perf_counter() - t0

        return wrapper


def emulate_and_time(manager: Any, link: LinkModel, blocked: Blocked) -> None:
    """Each all-reduce's ``wait()`` returns no earlier than the link model allows, and is timed; so are the
    quorum and the commit vote (both talk to the other replica group through torchft's servers)."""
    allreduce = manager.allreduce

    def emulated(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        ready = link.ready_at(tensor.numel() * tensor.element_size())
        work = allreduce(tensor, *args, **kwargs)
        real_wait = work.wait

        def wait(*a: Any, **kw: Any) -> Any:
            out = real_wait(*a, **kw)
            delay = ready - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            return out

        work.wait = blocked.timed(wait)
        return work

    manager.allreduce = emulated
    manager.start_quorum = blocked.timed(manager.start_quorum)
    manager.should_commit = blocked.timed(manager.should_commit)


def fragments_of(model: nn.Module, count: int) -> list[nn.Module]:
    """``count`` modules holding the model's parameters in order, as even in elements as whole parameters
    allow (the same rule as Meridian's fragments, by parameter instead of by bucket)."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    total = sum(p.numel() for _, p in params)
    out: list[nn.Module] = [nn.Module() for _ in range(count)]
    done, f = 0, 0
    for i, (name, p) in enumerate(params):
        out[f].register_parameter(name.replace(".", "__"), p)
        done += p.numel()
        left_params, left_frags = len(params) - i - 1, count - f - 1
        if left_frags and (done >= total * (f + 1) / count or left_params == left_frags):
            f += 1
    return out


def _lighthouse(rank: int) -> tuple[Any, str]:
    """Rank 0 starts torchft's lighthouse; every rank learns its address over the default group."""
    server, addr = None, [""]
    if rank == 0:
        from torchft._torchft import LighthouseServer

        server = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=10_000, quorum_tick_ms=10)
        addr = [server.address()]
    dist.broadcast_object_list(addr, src=0)
    return server, addr[0]


def run_torchft(rank: int, cfg: TrainConfig, outer: TorchftOuter, val_batches: int) -> dict[str, Any]:
    """Train ``cfg`` on this rank as replica group ``rank`` of torchft's DiLoCo; every rank calls it."""
    from torchft import Manager
    from torchft.local_sgd import DiLoCo

    world = dist.get_world_size()
    server, lighthouse = _lighthouse(rank)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model)
    inner = build_adamw(model, cfg.optim)
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    pg = counting_gloo()
    manager = Manager(
        pg=pg, load_state_dict=None, state_dict=None, min_replica_size=world, use_async_quorum=False,
        replica_id=f"dc{rank}", store_addr="localhost", store_port=store.port, rank=0, world_size=1,
        lighthouse_addr=lighthouse, timeout=TIMEOUT, quorum_timeout=TIMEOUT, connect_timeout=TIMEOUT,
        init_sync=False,  # same seed, same initial weights: nothing to heal at step 0
    )  # fmt: skip
    link, blocked = LinkModel(cfg.wan), Blocked()
    emulate_and_time(manager, link, blocked)
    frags = fragments_of(model, outer.fragments)
    outer_opts = [
        torch.optim.SGD(f.parameters(), lr=outer.outer_lr, momentum=outer.outer_momentum, nesterov=True) for f in frags
    ]
    data = make_dataset(cfg.data, cfg.model.seq_len, cfg.seed)
    val = make_dataset(cfg.data, cfg.model.seq_len, cfg.seed, split="eval")
    device = torch.device("cpu")
    step_s, blocked_s, losses = [], [], []
    try:
        with DiLoCo(manager, frags, inner, outer_opts, sync_every=outer.inner_steps, pin_memory=False,
                    fragment_sync_delay=outer.sync_delay, fragment_update_alpha=outer.alpha):  # fmt: skip
            loop_start = time.perf_counter()
            for step in range(cfg.steps):
                t0, b0 = time.perf_counter(), blocked.s
                inner.zero_grad(set_to_none=True)
                loss_sum = 0.0
                for x, y in data.step_batches(step, cfg.global_batch, cfg.micro_batch, rank, world):
                    with autocast_context(cfg.precision, device):
                        share = per_sample_loss(model(x), y).sum() * world / cfg.global_batch  # the DC's mean
                    share.backward()
                    loss_sum += float(share.detach())
                if cfg.optim.grad_clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
                set_lr(inner, lr_at(step, cfg))
                inner.step()  # torchft's hooks: the outer sync when one is due
                step_s.append(time.perf_counter() - t0)
                blocked_s.append(blocked.s - b0)
                losses.append(loss_sum)
            loop_wall = time.perf_counter() - loop_start
        val_loss = evaluate(model, val, cfg, device, val_batches)
        sent, calls, commits = pg.bytes_sent, pg.calls, manager.current_step()
    finally:
        manager.shutdown(wait=False)
        dist.barrier()
        if server is not None:
            server.shutdown()
    totals = torch.tensor([float(sent), float(calls)])
    dist.all_reduce(totals)  # summed over ranks, as Meridian's inter-DC bytes are
    mean_losses = torch.tensor(losses)
    dist.all_reduce(mean_losses)  # the DCs' mean of each step's training loss
    return {
        "step_s": step_s, "blocked_s": blocked_s, "loop_wall_s": loop_wall, "val_loss": val_loss,
        "losses": (mean_losses / world).tolist(), "inter_dc_bytes": totals[0].item(), "collective_calls": int(totals[1]),
        "commits": commits,
    }  # fmt: skip
