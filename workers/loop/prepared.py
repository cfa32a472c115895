"""What a training process can build before it knows its epoch: the job's datasets and its model's initial
weights.

A re-formed epoch waited for both after its group formed (traced in ``meridian bench recovery``: the nano
model 10-15 ms, the text dataset 6-16 ms, of a 0.23 s recovery), though neither depends on the epoch. A standby
(:mod:`meridian.workers.elastic.standby`) calls :func:`prepare` while it waits for its ``go``; the loop then
takes them from here. Built ahead or not, the result is the same: :func:`initial_model` leaves the model's
weights and torch's generators as ``torch.manual_seed(seed); build_model(cfg)`` would.
"""

from __future__ import annotations

import gc

import torch
from torch import nn

from meridian.workers.contracts.config import DataConfig, TrainConfig
from meridian.workers.contracts.model_config import ModelConfig
from meridian.workers.data.shards import Dataset, make_dataset
from meridian.workers.model.build import build_model

PREBUILD_MAX_BYTES = 1 << 30
"""A standby builds the model ahead only if its fp32 weights take at most this: the copy sits in the standby's
host memory beside the training process for as long as it waits (for a 7B model, 28 GB per worker). A larger
model is built after the ``go``, as before."""

_datasets: dict[tuple[DataConfig, int, int, str], Dataset] = {}
_model: tuple[tuple[ModelConfig, int], nn.Module, torch.Tensor] | None = None
"""A model built ahead: its (config, seed), the model, and the CPU generator's state right after building it."""


def dataset(cfg: DataConfig, seq_len: int, seed: int, split: str = "train") -> Dataset:
    """``make_dataset``'s dataset: the one :func:`prepare` made (taken: nothing stays here once used), else made
    now."""
    ahead = _datasets.pop((cfg, seq_len, seed, split), None)
    return ahead if ahead is not None else make_dataset(cfg, seq_len, seed, split=split)


def initial_model(cfg: ModelConfig, seed: int) -> nn.Module:
    """The model of ``cfg`` initialised from ``seed``, on the CPU: the one :func:`prepare` built, the first time
    it is asked for (a model is trained in place: never handed out twice), else built now."""
    global _model
    ahead, _model = _model, None
    torch.manual_seed(seed)  # every generator, as the build would find them
    if ahead is not None and ahead[0] == (cfg, seed):
        torch.set_rng_state(ahead[2])  # and the CPU's where building it left it
        return ahead[1]
    return build_model(cfg)


_frozen = False


def freeze_long_lived() -> None:
    """Move what lives now into the collector's permanent generation (:func:`gc.freeze`), once per process: torch,
    the training stack and the datasets live as long as the process, so the collections after a re-formation need
    not walk them. An epoch's model must not be among them: what it holds in cycles (FSDP2's state, its meshes and
    their process groups) would never be freed."""
    global _frozen
    if not _frozen:
        gc.freeze()
        _frozen = True


def prepare(cfg: TrainConfig) -> None:
    """Make the job's datasets and (a data-parallel job's, up to :data:`PREBUILD_MAX_BYTES`) its initial model
    now, for the epochs this process will train."""
    global _model
    for split in ("train", "eval") if cfg.validation is not None else ("train",):
        _datasets[(cfg.data, cfg.model.seq_len, cfg.seed, split)] = make_dataset(cfg.data, cfg.model.seq_len, cfg.seed,
                                                                                  split=split)
    freeze_long_lived()  # before the model: it is the first epoch's, not the process's
    if cfg.parallel.model_parallel > 1 or 4 * cfg.model.num_params > PREBUILD_MAX_BYTES:
        return  # a tensor/pipeline-parallel rank builds its slice of the model, not the whole
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model)
    _model = ((cfg.model, cfg.seed), model, torch.get_rng_state())
