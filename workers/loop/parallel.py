"""What a tensor- and/or pipeline-parallel job (``parallelism.tp * parallelism.pp > 1``) builds and runs per step.

The loop is the one of :mod:`meridian.workers.loop.train`; this :class:`ModelParallelReplica` is what differs
from data parallelism, who holds what::

    ranks          (stage, replica, tp_rank), tp fastest; groups and (dp, tp) meshes  (:mod:`meridian.workers.parallel.dims`)
    model          this rank's pipeline chunks of the seeded model, the whole model's names
                                                                         (:mod:`meridian.workers.parallel.pipeline`);
                   a Hugging Face or factory model whole (no pipeline), split by its own tensor-parallel plan
                                                                         (:mod:`meridian.workers.parallel.tp_plan`)
    parallelised   TP → activation checkpointing → compile → FSDP2 over the datacenter's replicas of this
                   (stage, TP rank)                                      (:mod:`meridian.workers.parallel.parallelize`)
    forward/back   pp = 1: the micro-batches one after another; pp > 1: torch.distributed.pipelining's schedule
    gradient sync  the hierarchical engine over the data-parallel group (same stage and TP rank in every replica):
                   FSDP2's reduce-scatter inside the DC, the inter-DC sum of each rank's rows on top, the norm
                   added over the replica's ranks              (:class:`~meridian.workers.sync.fsdp_har.FSDPHierarchicalSync`)

Each replica reads the samples of its data-parallel index, so the step's global batch is the same set of
samples as in single-process training; only TP rank 0 of the rank holding the last stage adds its loss to the
global loss. The engine's state is element ranges of whole parameters like a data-parallel job's, so snapshots,
the survivors' exchange and durable checkpoints work across layouts: a re-formed epoch of another layout (or a
data-parallel one) resumes from them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meridian.workers.contracts.config import FsdpUnits
from meridian.workers.data.shards import Dataset
from meridian.workers.loop.precision import mixed_precision
from meridian.workers.loop.replica import Batches, Replica, evaluate, validation_batches
from meridian.workers.model.build import build_model
from meridian.workers.model.causal_lm import per_sample_loss
from meridian.workers.parallel.dims import ParallelDims, ParallelGroups
from meridian.workers.parallel.parallelize import Parallelize
from meridian.workers.parallel.pipeline import (
    CountingStage,
    StageModel,
    build_schedule,
    forward_only,
    rank_stages,
)
from meridian.workers.parallel.tp_plan import tp_styles
from meridian.workers.sync.fsdp_har import FSDPHierarchicalSync
from meridian.workers.wan.collectives import WanEmulator, agree_key


class ModelParallelReplica(Replica):
    """This rank's TP slice of its pipeline chunks of one data-parallel replica."""

    def build(self) -> None:
        cfg, m, device = self.cfg, self.m, self.device
        par = cfg.parallel
        dims = ParallelDims(par.tp, par.pp, m.datacenters)
        par.check_batches(cfg.global_batch, cfg.micro_batch, dims.dp)  # this epoch's replicas (a re-formed one's too)
        self.groups = groups = ParallelGroups(dims, m.rank, device=device)
        c = groups.coords
        dp_groups = groups.dp
        assert dp_groups is not None
        self.dims = dims
        self.data_rank, self.data_world = c.replica, dims.dp
        torch.manual_seed(cfg.seed)
        full = build_model(cfg.model)  # the single-process initial weights, on every rank
        self._shapes = {n: p.shape for n, p in full.named_parameters()}
        self.stage_ids = rank_stages(par, c.stage)
        if cfg.model.family.is_builtin:
            model = StageModel(full, self.stage_ids, par.stages).to(device)
            roots = model.chunks
        else:  # a Hugging Face or factory model: tensor parallelism by its own plan, no pipeline (refused at submit)
            if par.pp > 1:
                raise ValueError(f"parallelism.pp={par.pp}: a {cfg.model.family.value} model has no pipeline stages "
                                 "here; set parallelism.pp to 1")
            model, roots = full.to(device), None
        styles = tp_styles(full, cfg.model.family, par.tp, sequence_parallel=par.sequence_parallel,
                           tied_embeddings=cfg.model.tie_embeddings) if par.tp > 1 else {}  # fmt: skip
        self.model = model
        del full
        self.reports_loss = (roots is None or model.has_last) and c.tp_rank == 0
        self._reports_eval = self.reports_loss and c.replica == 0
        self.mp_policy = mixed_precision(cfg.precision, device)
        plan = Parallelize(
            dp_mesh=groups.dp_mesh, tp_mesh=groups.tp_mesh, tp_plan=styles,
            activation_checkpointing=cfg.activation_checkpointing, compile=cfg.compile, mp_policy=self.mp_policy,
            # under pipelining the schedule gathers once per step, not per micro-batch, and each block is a unit
            reshard_after_forward=par.pp == 1 and par.reshard_after_forward,
            fsdp_units=par.fsdp_units if par.pp == 1 else FsdpUnits.BLOCK,
        )  # fmt: skip
        emulator = None
        if cfg.wan is not None and len(set(dims.datacenters)) > 1:
            self.key = agree_key(self.key_prefix)
            if dp_groups.num_dcs > 1:
                emulator = WanEmulator(cfg.wan, dp_groups.layout, c.replica, key=self.key)
                self.emulators.append(emulator)
        self.engine = FSDPHierarchicalSync(
            model, dp_groups, cfg.sync, cfg.optim, emulator=emulator, broadcast_params=m.epoch <= 1,
            shard=lambda module, reduce_scatter: plan(module, roots=roots, reduce_scatter=reduce_scatter),
            reshard_after_forward=plan.reshard_after_forward or par.pp > 1,  # the schedule's own under pipelining
        )  # fmt: skip
        self.stages: list[CountingStage] = []
        self.schedule = None
        if par.pp > 1:
            assert groups.pp_group is not None
            self.stages = [CountingStage(chunk, g, par.stages, device, group=groups.pp_group,
                                         datacenters=dims.datacenters)
                           for g, chunk in zip(self.stage_ids, roots or (), strict=True)]  # fmt: skip
            n_micro = cfg.global_batch // dims.dp // cfg.micro_batch
            self.schedule = build_schedule(self.stages, par, n_micro, self._loss_share)

    def _loss_share(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One micro-batch's share of the step's global-batch mean loss."""
        return per_sample_loss(logits, targets).sum() / self.cfg.global_batch

    def forward_backward(self, batches: Batches) -> torch.Tensor:
        engine, device = self.engine, self.device
        assert engine is not None
        loss_sum = torch.zeros((), device=device)
        if self.schedule is None:  # tensor parallelism alone: micro-batches one after another
            for i, (x, y) in enumerate(batches):
                last = i == len(batches) - 1
                share = self._loss_share(engine.model(x.to(device)), y.to(device))
                engine.backward(share, last_micro_batch=last)
                loss_sum += share.detach()
            return loss_sum
        x = torch.cat([x for x, _ in batches]).to(device)
        y = torch.cat([y for _, y in batches]).to(device)
        losses: list[torch.Tensor] = []
        self.schedule.step(x, target=y, losses=losses)
        for share in losses:
            loss_sum += share.detach()
        return loss_sum

    def extra_inter_dc_bytes(self) -> int:
        sent = sum(s.cross_dc_bytes for s in self.stages)
        for s in self.stages:
            s.cross_dc_bytes = 0
        return sent

    def parameters(self) -> dict[str, torch.Tensor]:
        if isinstance(self.model, StageModel):
            for chunk in self.model.chunks:  # the FSDP2 roots, not submodules of the model: their own reshard
                chunk.reshard()
        return super().parameters()

    def full_shapes(self) -> dict[str, torch.Size]:
        """Every parameter of the whole model (not only this rank's stages) and its shape."""
        return dict(self._shapes)

    def evaluate(self, data: Dataset, batches: int = 4) -> float:
        """Held-out loss as :func:`meridian.workers.loop.replica.evaluate` computes it, through the pipeline."""
        assert self.engine is not None and self.model is not None
        cfg, par, model = self.cfg, self.cfg.parallel, self.model
        if self.schedule is None:
            loss = evaluate(self.engine.model, data, cfg, self.device, batches)
            return loss  # every TP rank computed the same
        groups = self.groups
        assert isinstance(groups, ParallelGroups) and groups.pp_group is not None
        t = cfg.model.seq_len // par.tp if par.sequence_parallel else cfg.model.seq_len
        dtype = self.mp_policy.param_dtype or torch.float32
        model.eval()
        total = torch.zeros((), dtype=torch.float64)
        with torch.no_grad():
            for x, y in validation_batches(data, cfg.micro_batch, batches):
                logits = forward_only(model, x, n_stages=par.stages, pp=par.pp, pp_rank=groups.coords.stage,
                                      group=groups.pp_group, hidden=(x.shape[0], t, cfg.model.d_model), dtype=dtype,
                                      device=self.device)  # fmt: skip
                if logits is not None and self._reports_eval:
                    total += per_sample_loss(logits, y.to(self.device)).mean().double().cpu()
        model.train()
        dist.all_reduce(total)
        return total.item() / batches
