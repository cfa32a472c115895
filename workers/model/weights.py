"""Safetensors checkpoints in and out, one tensor at a time.

In (:func:`load_checkpoint`): every tensor's name and shape are read from the files' headers and matched against
the model's parameters *before* any data is read, so a checkpoint tensor the model does not consume, a parameter
the checkpoint lacks or a shape that differs is an error naming it, not a silent drop. The model may still have
its parameters on the meta device (:func:`parameters_on_meta`); they are allocated here (tied weights stay
tied), then filled file by file, tensor by tensor, so a rank holds the model plus one checkpoint tensor, never
the whole checkpoint. Out (:func:`save_sharded`): shards of at most a given size and the index transformers
reads (``model.safetensors.index.json``), or one ``model.safetensors``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from meridian.workers.contracts.hf_config import INDEX_FILE, checkpoint_files, read_safetensors_header

OpenFile = Callable[[str], Any]
"""A safetensors file → a context manager whose value has ``get_tensor(name)`` (``safe_open``'s shape)."""

SHARD_PATTERN = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")
"""The weight file names transformers' ``save_pretrained`` and :func:`save_sharded` write."""


def _safe_open(path: str) -> Any:
    return safe_open(path, framework="pt", device="cpu")


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Build modules with their parameters on the meta device (no memory, no initialisation cost) and their
    buffers real: a rotary embedding's frequencies are computed in ``__init__`` and never stored in a
    checkpoint, so they must not be left empty."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def materialize(model: nn.Module, device: torch.device | str = "cpu") -> None:
    """Allocate (uninitialised) every parameter still on the meta device; a tensor shared by several modules
    (tied weights) becomes one new tensor shared by them all."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                module._parameters[name] = made[id(p)]
    meta = [n for n, b in model.named_buffers() if b.is_meta]
    if meta:
        raise ValueError(f"buffers {meta[:3]} are on the meta device: build the model with parameters_on_meta()")


@dataclass
class LoadReport:
    """What :func:`load_checkpoint` read."""

    files: int = 0
    tensors: int = 0
    bytes: int = 0
    ignored: list[str] = field(default_factory=list)
    """Checkpoint tensors the model's family declares obsolete (transformers' ``_keys_to_ignore_on_load_unexpected``,
    e.g. a stored rotary ``inv_freq``): listed, not loaded."""


def _targets(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every parameter and persistent buffer by its first name, and each other name of a tied one → that name."""
    targets: dict[str, torch.Tensor] = {}
    alias: dict[str, str] = {}
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            alias[name] = first[id(p)]
        else:
            first[id(p)] = name
            targets[name] = p
    for mod_name, module in model.named_modules():
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                targets[f"{mod_name}.{name}" if mod_name else name] = b
    return targets, alias


def _some(names: list[str], n: int = 5) -> str:
    shown = ", ".join(repr(x) for x in names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")


@torch.no_grad()
def load_checkpoint(model: nn.Module, directory: str, *, rename: Callable[[str], str] = lambda k: k,
                    ignore: tuple[str, ...] = (), open_file: OpenFile = _safe_open,
                    describe: str = "the model") -> LoadReport:
    """Fill ``model``'s parameters (and persistent buffers) from the safetensors checkpoint in ``directory``.
    ``rename``: a checkpoint name → the model's name for it (the family's own renames); ``ignore``: regular
    expressions of checkpoint names to skip; ``describe``: the model, for the errors. Raises ``ValueError`` naming
    every tensor the model does not consume, every parameter the checkpoint lacks, every shape that differs."""
    files = checkpoint_files(directory)
    if not files:
        raise ValueError(f"model.init_from: {directory} holds no *.safetensors file")
    targets, alias = _targets(model)
    # 1) names and shapes from the headers, before any data is read
    plan: list[tuple[str, list[tuple[str, str]]]] = []
    unexpected, wrong_shape, twice, ignored, tied_copies = [], [], [], [], []
    seen: dict[str, str] = {}  # parameter → the checkpoint key it loads from
    for path in files:
        reads = []
        for key, (_, shape) in read_safetensors_header(path).items():
            name = rename(key)
            target = alias.get(name, name)
            if target not in targets:
                (ignored if any(re.search(p, key) for p in ignore) else unexpected).append(key)
                continue
            if tuple(targets[target].shape) != shape:
                wrong_shape.append(f"{key} {shape} (the model's {target}: {tuple(targets[target].shape)})")
            elif target in seen:
                (tied_copies if name != target or rename(seen[target]) != target else twice).append((key, target))
            else:
                seen[target] = key
                reads.append((key, target))
        plan.append((path, reads))
    missing = [n for n in targets if n not in seen]
    problems = []
    if unexpected:
        problems.append(f"tensor(s) {describe} has no parameter for: {_some(unexpected)} (the config does not "
                        "describe these weights: a config.json of another family, or without the biases the "
                        "weights have, would drop them)")
    if missing:
        problems.append(f"no tensor for parameter(s) {_some(missing)} of {describe}")
    if wrong_shape:
        problems.append(f"tensor(s) of another shape: {_some(wrong_shape, 3)}")
    if twice:
        problems.append(f"tensor(s) stored twice: {_some([k for k, _ in twice])}")
    if problems:
        raise ValueError(f"model.init_from: {directory} does not hold the weights of {describe}: "
                         + "; ".join(problems) + "; give init_from the directory save_pretrained wrote, with its "
                         "own config.json")
    # 2) allocate what is on the meta device, 3) copy tensor by tensor, file by file
    materialize(model)
    targets, _ = _targets(model)
    report = LoadReport(files=len(files), ignored=ignored)
    for path, reads in plan:
        with open_file(path) as f:
            for key, target in reads:
                tensor = f.get_tensor(key)
                targets[target].copy_(tensor)
                report.tensors += 1
                report.bytes += tensor.numel() * tensor.element_size()
                del tensor
    # 4) a tied weight the checkpoint stores under both names must hold one value
    for path in files:
        copies = [(k, t) for k, t in tied_copies if k in read_safetensors_header(path)]
        if not copies:
            continue
        with open_file(path) as f:
            for key, target in copies:
                if not torch.equal(f.get_tensor(key).to(targets[target].dtype), targets[target]):
                    raise ValueError(f"model.init_from: {directory} stores the tied weights {seen[target]!r} and "
                                     f"{key!r} with different values (tie_word_embeddings is true)")
    return report


def save_sharded(tensors: dict[str, torch.Tensor], directory: str | Path, *, max_shard_bytes: int) -> list[str]:
    """Write ``tensors`` as safetensors shards of at most ``max_shard_bytes`` each (a bigger tensor gets a shard of
    its own) with transformers' index file, or as one ``model.safetensors`` when they fit in one; weight files of
    an earlier export there are removed first. Returns the file names written."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        if SHARD_PATTERN.match(old.name) or old.name == INDEX_FILE:
            old.unlink()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += n
    if len(shards) == 1:
        _save(shards[0], out / "model.safetensors")
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards, strict=True):
        _save(shard, out / name)
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": {k: name for name, shard in zip(names, shards, strict=True) for k in shard}}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return [*names, INDEX_FILE]


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """One safetensors file, readable as the process's umask allows like the export's other files (safetensors
    itself creates it 0600, which hides the weights from the other users of a shared folder)."""
    save_file(tensors, str(path), metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


__all__ = ["LoadReport", "load_checkpoint", "materialize", "parameters_on_meta", "save_sharded"]
