"""What a tensor- and/or pipeline-parallel job (``parallel.tp * parallel.pp > 1``) builds and runs per step.

The loop is the one of :mod:`meridian.workers.loop.train`; this :class:`ModelParallelReplica` is what differs
from data parallelism, who holds what::

    ranks         (stage, replica, tp_rank), tp fastest                    (:mod:`meridian.workers.parallel.dims`)
    model         this stage's blocks, TP-sliced, cut from the seeded GPT   (:mod:`meridian.workers.parallel.tensor_parallel`)
    forward/back  the pipeline schedule over micro-batches                  (:mod:`meridian.workers.parallel.pipeline`)
    gradient sync the usual engine over the data-parallel group (same stage and TP rank in every
                  replica): HAR within and across DCs, norm summed over the replica's ranks

Each replica reads the samples of its data-parallel index, so the step's global batch is the same set of
samples as in single-process training; only TP rank 0 of the last stage adds its loss to the global loss.
Such a job trains in one epoch: its in-memory state is not pooled across a re-formation (yet), so the
elastic trainer refuses to resume it after losing a worker (:class:`~meridian.workers.elastic.trainer.ModelParallelNotElastic`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meridian.workers.data.shards import Dataset
from meridian.workers.distributed.layout import DCLayout
from meridian.workers.loop.precision import autocast_context
from meridian.workers.loop.replica import Batches, Replica, validation_batches
from meridian.workers.model.build import build_model
from meridian.workers.parallel.dims import ParallelDims, ParallelGroups
from meridian.workers.parallel.pipeline import StageRunner
from meridian.workers.parallel.tensor_parallel import GPTStage
from meridian.workers.sync.build import build_sync
from meridian.workers.wan.collectives import WanEmulator, agree_key


class ModelParallelReplica(Replica):
    """This rank's TP slice of one pipeline stage of one data-parallel replica."""

    def build(self) -> None:
        cfg, m, device = self.cfg, self.m, self.device
        dims = ParallelDims(cfg.parallel.tp, cfg.parallel.pp, m.datacenters)
        self.groups = groups = ParallelGroups(dims, m.rank)
        c = groups.coords
        dp_groups = groups.dp
        assert dp_groups is not None
        self.data_rank, self.data_world = c.replica, dims.dp
        self.reports_loss = groups.reports_loss
        self._reports_eval = groups.reports_loss and c.replica == 0

        torch.manual_seed(cfg.seed)
        full = build_model(cfg.model)  # the single-process initial weights, on every rank
        model = GPTStage(full, stage=c.stage, pp=dims.pp, tp_rank=c.tp_rank, tp=dims.tp, tp_group=groups.tp_group)
        self.model = model = model.to(device)
        del full

        dp_emulator = self._stage_emulator = None
        if cfg.wan is not None and len(set(dims.datacenters)) > 1:
            # One set of link files for the job (same key): data-parallel traffic of every group and pipeline
            # traffic between stages share the emulated inter-DC links.
            self.key = agree_key(self.key_prefix)
            dp_emulator = WanEmulator(cfg.wan, dp_groups.layout, c.replica, key=self.key)
            self._stage_emulator = WanEmulator(cfg.wan, DCLayout(dims.datacenters), m.rank, key=self.key)
            self.emulators += [dp_emulator, self._stage_emulator]
        self.engine = engine = build_sync(model, dp_groups, cfg.sync, cfg.optim, emulator=dp_emulator)
        prev, nxt = dims.stage_neighbours(m.rank)
        self.runner = StageRunner(
            engine.model, prev=prev, next=nxt, schedule=cfg.parallel.schedule, pp=dims.pp, stage_index=c.stage,
            d_model=cfg.model.d_model, autocast=lambda: autocast_context(cfg.precision, device),
            emulator=self._stage_emulator,
        )

    def forward_backward(self, batches: Batches) -> torch.Tensor:
        assert self.engine is not None
        return self.runner.train_step(self.engine, batches, self.cfg.global_batch, self.device)

    def extra_inter_dc_bytes(self) -> int:
        return self._stage_emulator.counter.reset().tensor_bytes if self._stage_emulator is not None else 0

    @torch.no_grad()
    def evaluate(self, data: Dataset, batches: int = 4) -> float:
        """Held-out loss as :func:`meridian.workers.loop.replica.evaluate` computes it, through the pipeline."""
        cfg, runner = self.cfg, self.runner
        runner.stage.eval()
        total = torch.zeros(())
        for x, y in validation_batches(data, cfg.micro_batch, batches):
            loss = runner.forward_only(x, y, self.device)
            if self._reports_eval:
                total += loss.float().cpu()
        runner.stage.train()
        dist.all_reduce(total)
        return total.item() / batches
