"""What a durable checkpoint must share with a job to be loaded by it, as plain JSON: :func:`fingerprint`.

Every checkpoint stores its job's fingerprint; a job resuming its own checkpoint needs all of it equal, and
one resuming another job's (``resume_from``) needs the parts :func:`resume_mismatches` names equal, unless
the job resets them. Torch-free: the service compares fingerprints at submit.
"""

from __future__ import annotations

import json
from typing import Any

from meridian.workers.contracts.config import ResetPart, TrainConfig
from meridian.workers.contracts.model_config import ModelFamily

DATA_KEYS = ("global_batch", "seed", "data", "data_pins")
"""The fingerprint's parts that fix the sample order of each step (the data position)."""


def fingerprint(cfg: TrainConfig) -> dict[str, Any]:
    """What a checkpoint must share with the job to resume it, as JSON values (tuples are lists)."""
    m = cfg.model
    shape: list[Any] = [m.n_layers, m.d_model, m.n_heads, m.seq_len, m.vocab_size]
    if m.family is not ModelFamily.GPT:  # (gpt's fingerprint stays as before: older checkpoints still load)
        shape += [m.family.value, m.kv_heads, m.mlp_width, m.tie_embeddings]
    if m.architecture_key:  # an hf model's config.json, a factory and its arguments
        shape.append(m.architecture_key)
    fp: dict[str, Any] = {"model": shape, "global_batch": cfg.global_batch,
                          "seed": cfg.seed, "data": [list(d) for d in cfg.data.datasets] or cfg.data.source}  # fmt: skip
    if cfg.data.pins:  # (a job admitted before pins existed keeps its fingerprint: its checkpoints still load)
        fp["data_pins"] = [[p.path, p.manifest_key, p.tokenizer_sha256, p.sha256] for p in cfg.data.pins]
    return json.loads(json.dumps(fp))


def _tokenizers(fp: dict[str, Any]) -> list[str]:
    return sorted({pin[2] for pin in fp.get("data_pins") or () if pin[2]})


def resume_mismatches(found: dict[str, Any], job: dict[str, Any], reset: tuple[ResetPart, ...]) -> list[str]:
    """What keeps a job with fingerprint ``job`` from continuing a checkpoint whose fingerprint is ``found``, each
    a phrase naming the part and both values; empty: it may. The model must always match (the weights load into
    it); the tokenizer, the data, its pins, the seed and the global batch only while the data position carries
    over (``data`` not in ``reset``)."""
    problems = []
    if found.get("model") != job.get("model"):
        problems.append(f"the model differs (checkpoint {found.get('model')}, this job {job.get('model')}): its "
                        "weights cannot load into this job's model")
    if ResetPart.DATA in reset:
        return problems
    if _tokenizers(found) != _tokenizers(job):
        problems.append(f"the tokenizer differs (checkpoint {_tokenizers(found) or 'none (bytes)'}, this job "
                        f"{_tokenizers(job) or 'none (bytes)'})")
    for key in DATA_KEYS:
        if found.get(key) != job.get(key):
            problems.append(f"{key} differs (checkpoint {found.get(key)!r}, this job {job.get(key)!r})")
    return problems
