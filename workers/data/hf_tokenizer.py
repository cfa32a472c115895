"""The tokenizer half of ``meridian export``: the files ``transformers.AutoTokenizer.from_pretrained`` reads.

A job trained on a prepared dataset (:mod:`meridian.workers.data.manifest`) carries its tokenizer: the export
copies that ``tokenizer.json`` and writes a ``tokenizer_config.json`` (class ``PreTrainedTokenizerFast``, the
end-of-text token, the model's context length) and a ``special_tokens_map.json``. A blend exports the
tokenizer only when every dataset of it was made with the same one (same file hash). A job trained on raw
text (``data.source``: token id = byte value, no tokenizer file) gets no tokenizer, and the export says why.
Torch-free.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

from meridian.workers.contracts.config import DataConfig
from meridian.workers.data.manifest import read_manifest

CONFIG_FILE = "tokenizer_config.json"
SPECIALS_FILE = "special_tokens_map.json"


def export_tokenizer(data: DataConfig, out: str, *, model_max_length: int) -> dict[str, Any]:
    """Write the tokenizer of the job whose data was ``data`` into ``out``. Returns ``{"written": bool, "files",
    "source", "reason"}``: ``reason`` says, when nothing was written, why."""
    if not data.datasets:
        return _not_written(
            f"the job trained on the raw bytes of {data.source!r} (token id = byte value, vocabulary 256), "
            "which no tokenizer file describes; encode text as UTF-8 bytes to use the model, or train on a "
            "dataset made by `meridian data prepare`, whose tokenizer is exported with the weights")
    try:
        manifests = [(d, read_manifest(d)) for d, _ in data.datasets]
    except ValueError as e:
        return _not_written(f"the job's dataset cannot be read here: {e}")
    hashes = {m.tokenizer_sha256 for _, m in manifests}
    if len(hashes) > 1:
        return _not_written("the job's blend mixes datasets made with different tokenizers ("
                            + ", ".join(f"{d}: {m.tokenizer_sha256[:12]}" for d, m in manifests) + ")")
    directory, manifest = manifests[0]
    src = os.path.join(directory, manifest.tokenizer_file)
    if not os.path.isfile(src):
        return _not_written(f"the job's dataset {directory!r} has no {manifest.tokenizer_file}")
    os.makedirs(out, exist_ok=True)
    shutil.copyfile(src, os.path.join(out, "tokenizer.json"))
    specials = _special_tokens(src, manifest.eos_id)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
              "clean_up_tokenization_spaces": False, **specials}
    _write_json(os.path.join(out, CONFIG_FILE), config)
    _write_json(os.path.join(out, SPECIALS_FILE), specials)
    return {"written": True, "files": ["tokenizer.json", CONFIG_FILE, SPECIALS_FILE], "source": src,
            "eos_token_id": manifest.eos_id, "reason": ""}


def _special_tokens(tokenizer_json: str, eos_id: int | None) -> dict[str, str]:
    """The end-of-text token (the one the dataset put after every document) as ``eos_token``."""
    if eos_id is None:
        return {}
    from tokenizers import Tokenizer

    name = Tokenizer.from_file(tokenizer_json).id_to_token(eos_id)
    return {"eos_token": name} if name else {}


def _not_written(reason: str) -> dict[str, Any]:
    return {"written": False, "files": [], "source": "", "eos_token_id": None, "reason": reason}


def _write_json(path: str, body: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(body, f, indent=2)
        f.write("\n")
