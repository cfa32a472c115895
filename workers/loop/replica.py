"""What one rank builds for one epoch, how it runs a step's micro-batches, and how it closes it all again.

The training loop (:mod:`meridian.workers.loop.train`) is the same for every job. What differs between a
data-parallel job and a tensor/pipeline-parallel one lives behind :class:`Replica`::

    build             groups, model (or this rank's stage), WAN emulator(s), sync engine, in this order on
                      every rank (group creation and the emulator's key are collectives)
    data_rank/world   which share of each step's global batch this rank reads
    forward_backward  this rank's micro-batches of one step; returns its share of the loss
    reports_loss      whether that share counts in the step's global loss
    evaluate          the held-out loss
    close             the one clean-up path, after the last step or after a failure

:class:`DataParallelReplica` is here; the tensor/pipeline-parallel one is
:class:`meridian.workers.loop.parallel.ModelParallelReplica`.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from meridian.workers.contracts.config import TrainConfig
from meridian.workers.data.shards import Dataset
from meridian.workers.distributed.layout import DCGroups, DCLayout
from meridian.workers.loop.precision import autocast_context, mixed_precision
from meridian.workers.loop.prepared import initial_model
from meridian.workers.parallel.fsdp import dc_mesh
from meridian.workers.parallel.parallelize import Parallelize, prepare_blocks
from meridian.workers.sync.build import GradientSync, build_sync, runs_on_fsdp
from meridian.workers.wan.collectives import WanEmulator, agree_key, cleanup
from meridian.workers.wan.file_names import job_key_prefix

Batches = list[tuple[torch.Tensor, torch.Tensor]]


class ProcessGroups(Protocol):
    """The epoch's process groups besides the default one (:class:`DCGroups`, or ``ParallelGroups``)."""

    def destroy(self) -> None: ...


@dataclass(frozen=True)
class Membership:
    """Who trains in one epoch, as the loop needs to know it."""

    epoch: int
    """The elastic epoch (0: a run without a rendezvous, one epoch over the default process group)."""
    rank: int
    world_size: int
    datacenters: tuple[str, ...]
    """Each rank's datacenter, in rank order."""
    snapshot_every: int = 1
    """The snapshot cadence the epoch starts with, the same on every rank (an adaptive job's, from the
    rendezvous: the widest a member had agreed)."""

    @classmethod
    def of_default_group(cls, cfg: TrainConfig) -> Membership:
        """No rendezvous: the ranks of the existing default process group, in the job's datacenters."""
        world = dist.get_world_size()
        return cls(epoch=0, rank=dist.get_rank(), world_size=world, datacenters=cfg.datacenters or ("local",) * world)


class Replica(ABC):
    """This rank's part of the model and everything that trains it, for one epoch."""

    reports_loss: bool = True
    uniform_micro_batches: bool = False
    """Every rank runs as many micro-batches a step (some shorter, or empty): sharded parameters are gathered
    and reduced inside a datacenter once per micro-batch (FSDP2)."""

    def __init__(self, cfg: TrainConfig, membership: Membership, device: torch.device) -> None:
        self.cfg, self.m, self.device = cfg, membership, device
        self.data_rank, self.data_world = membership.rank, membership.world_size
        self.model: nn.Module | None = None
        """This rank's model or stage, unwrapped (parameter names as in the checkpoint)."""
        self.engine: GradientSync | None = None
        self.groups: ProcessGroups | None = None
        self.emulators: list[WanEmulator] = []
        self.key = ""
        """The emulated links' shared-file key, once agreed ("" without emulated links)."""

    @property
    def key_prefix(self) -> str:
        return job_key_prefix(self.cfg.job_id, self.m.epoch)

    @abstractmethod
    def build(self) -> None:
        """Create this epoch's groups, model, emulators and engine (collective: every rank calls it)."""

    @abstractmethod
    def forward_backward(self, batches: Batches) -> torch.Tensor:
        """Forward and backward of this rank's micro-batches of one step, through the engine; returns this
        rank's share of the step's global mean loss."""

    @abstractmethod
    def evaluate(self, data: Dataset, batches: int = 4) -> float:
        """The held-out loss of this rank's current parameters: the same value on every rank of a datacenter, and on
        every rank where the replicas are equal (per-step sync; DiLoCo right after a sync of every fragment, or its
        ``final_average``). Rank 0 reports it."""

    def extra_inter_dc_bytes(self) -> int:
        """Inter-DC bytes of the last step that the engine's stats do not count (pipeline traffic)."""
        return 0

    def full_shapes(self) -> dict[str, torch.Size]:
        """Every parameter of the whole model and its shape (what snapshots and checkpoints cover), the same on
        every rank."""
        assert self.model is not None
        return {name: p.shape for name, p in self.model.named_parameters()}

    def parameters(self) -> dict[str, torch.Tensor]:
        """CPU copies of this rank's parameters, whole where they are sharded (synchronize the engine first;
        collective inside the DC then: every rank calls it)."""
        assert self.model is not None
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()  # a unit still gathered since its forward (the root) shows its compute-dtype copy
        return {name: _whole(p).detach().cpu().clone() for name, p in self.model.named_parameters()}

    def close(self, *, ok: bool) -> None:
        """The one clean-up path: after the last step (``ok``) or after a failure, whatever was built so far."""
        if ok:
            assert self.engine is not None and self.groups is not None
            self.engine.close()
            for emulator in self.emulators:
                emulator.close()
            if self.key:
                dist.barrier()  # every rank is done with the shared link files
                if self.m.rank == 0:
                    cleanup(self.key)
            self.groups.destroy()
            return
        # A peer is gone (or this rank failed): close every socket first, so nothing blocks on it and ranks
        # waiting on this one fail fast too (:mod:`meridian.workers.elastic.rendezvous`), then drop the rest.
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.engine is not None:
            with contextlib.suppress(Exception):  # its collectives failed with the peer
                self.engine.close()
        for emulator in self.emulators:
            emulator.close()
        if self.key:
            cleanup(self.key)


def _whole(p: torch.Tensor) -> torch.Tensor:
    """``p`` itself, or the whole tensor of a sharded (DTensor) parameter."""
    return p.full_tensor() if isinstance(p, DTensor) else p


class DataParallelReplica(Replica):
    """The whole model on every rank; the engine syncs gradients over all of them (:mod:`meridian.workers.sync`)."""

    def build(self) -> None:
        cfg, m = self.cfg, self.m
        layout = DCLayout(m.datacenters)
        # FSDP2's inter-DC pieces are its own (per parameter row): it makes the groups for them
        fsdp = runs_on_fsdp(cfg.sync)
        self.uniform_micro_batches = fsdp
        self.groups = groups = DCGroups(layout, m.rank, segment_groups=False)
        self.model = initial_model(cfg.model, cfg.seed).to(self.device)  # built ahead by a standby, or now
        emulator = None
        if cfg.wan is not None and layout.num_dcs > 1:  # every inter-DC collective waits for the emulated link
            self.key = agree_key(self.key_prefix)
            emulator = WanEmulator(cfg.wan, layout, m.rank, key=self.key)
            self.emulators.append(emulator)
        # A re-formed epoch's restore sets every rank's weights (the survivors' shards or the checkpoint; failing
        # both, every rank restarts from the same seeded build): rank 0's broadcast would only cost a round of the
        # whole job, across the inter-DC link too (a 1B model: 4 GB through it).
        # Activation checkpointing and compile per block, then FSDP2 with the job's mixed precision
        # (:mod:`meridian.workers.parallel.parallelize`); the engines not on FSDP2 take the blocks as prepared here
        shard = None
        if fsdp:
            shard = Parallelize(dp_mesh=dc_mesh(groups.intra_dc, self.device), compile=cfg.compile,
                                activation_checkpointing=cfg.activation_checkpointing,
                                mp_policy=mixed_precision(cfg.precision, self.device),
                                reshard_after_forward=cfg.parallel.reshard_after_forward,
                                fsdp_units=cfg.parallel.fsdp_units)  # fmt: skip
        else:
            prepare_blocks(self.model, cfg.activation_checkpointing, cfg.compile)
        self.engine = build_sync(self.model, groups, cfg.sync, cfg.optim, emulator=emulator,
                                 broadcast_params=m.epoch <= 1, shard=shard,
                                 reshard_after_forward=cfg.parallel.reshard_after_forward)

    def forward_backward(self, batches: Batches) -> torch.Tensor:
        cfg, device, engine = self.cfg, self.device, self.engine
        assert engine is not None
        loss_sum = torch.zeros((), device=device)
        for i, (x, y) in enumerate(batches):
            last = i == len(batches) - 1
            with engine.micro_batch(last_micro_batch=last):
                with autocast_context(cfg.precision, device):
                    losses = engine.model(x.to(device), y.to(device))  # each sample's mean loss (CausalLM)
                share = losses.sum() / cfg.global_batch
                engine.backward(share, last_micro_batch=last)
            loss_sum += share.detach()
        return loss_sum

    def evaluate(self, data: Dataset, batches: int = 4) -> float:
        assert self.engine is not None
        return evaluate(self.engine.model, data, self.cfg, self.device, batches)


def validation_batches(data: Dataset, micro_batch: int, batches: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """What an evaluation reads: the first ``batches`` micro-batches of the held-out split ``data``, in order,
    the same ones at every evaluation and on every rank. Its loss is the mean over these batches of each
    batch's mean token loss."""
    for b in range(batches):
        yield data.batch(b * micro_batch, micro_batch)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, data: Dataset, cfg: TrainConfig, device: torch.device, batches: int = 4
) -> float:
    model.eval()
    losses = []
    for x, y in validation_batches(data, cfg.micro_batch, batches):
        with autocast_context(cfg.precision, device):
            losses.append(model(x.to(device), y.to(device)).mean().item())
    model.train()
    return sum(losses) / len(losses)
