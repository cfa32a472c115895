"""The tokenizer half of ``meridian export``: the files ``transformers.AutoTokenizer.from_pretrained`` reads.

A job trained on a prepared dataset (:mod:`meridian.workers.data.manifest`) carries its tokenizer: the export
copies that ``tokenizer.json`` and writes a ``tokenizer_config.json`` (class ``PreTrainedTokenizerFast``, its
special tokens, the model's context length) and a ``special_tokens_map.json``. A blend exports the
tokenizer only when every dataset of it was made with the same one (same file hash); otherwise none, and the
export says why. A job trained on raw text (``data.source``: token id = byte value) gets the exact byte
tokenizer: 256 tokens, id = UTF-8 byte, no merges (GPT-2's byte-to-character table, so ``tokenizers``'
byte-level pre-tokenizer and decoder do the work). Torch-free.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

from meridian.workers.contracts.config import DataConfig
from meridian.workers.data.manifest import open_dataset_file, read_manifest

CONFIG_FILE = "tokenizer_config.json"
SPECIALS_FILE = "special_tokens_map.json"


def export_tokenizer(data: DataConfig, out: str, *, model_max_length: int) -> dict[str, Any]:
    """Write the tokenizer of the job whose data was ``data`` into ``out``. Returns ``{"written": bool, "files",
    "source", "reason"}``: ``reason`` says, when nothing was written, why."""
    if not data.datasets:
        os.makedirs(out, exist_ok=True)
        byte_tokenizer().save(os.path.join(out, "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
                  "clean_up_tokenization_spaces": False}
        _write_json(os.path.join(out, CONFIG_FILE), config)
        _write_json(os.path.join(out, SPECIALS_FILE), {})
        return {"written": True, "files": ["tokenizer.json", CONFIG_FILE, SPECIALS_FILE],
                "source": f"UTF-8 bytes of {data.source} (token id = byte value)", **_NO_SPECIALS, "reason": ""}
    try:
        manifests = [(d, read_manifest(d)) for d, _ in data.datasets]
    except ValueError as e:
        return _not_written(f"the job's dataset cannot be read here: {e}")
    hashes = {m.tokenizer_sha256 for _, m in manifests}
    if len(hashes) > 1:
        return _not_written("the job's blend mixes datasets made with different tokenizers ("
                            + ", ".join(f"{d}: {m.tokenizer_sha256[:12]}" for d, m in manifests) + ")")
    directory, manifest = manifests[0]
    pin = data.pin(directory)
    if pin is not None and pin.tokenizer_sha256 and pin.tokenizer_sha256 != manifest.tokenizer_sha256:
        return _not_written(f"the job's dataset {directory!r} was prepared again with another tokenizer after the "
                            "job was submitted: the tokenizer there is not the one the job trained with")
    src = os.path.join(directory, manifest.tokenizer_file)
    try:  # a regular file of the dataset's own directory, never a symlink's target
        fd = open_dataset_file(directory, manifest.tokenizer_file)
    except ValueError as e:
        return _not_written(f"the job's dataset's tokenizer cannot be read: {e}")
    os.makedirs(out, exist_ok=True)
    with os.fdopen(fd, "rb") as f, open(os.path.join(out, "tokenizer.json"), "wb") as dst:
        shutil.copyfileobj(f, dst)
    specials, ids = _special_tokens(os.path.join(out, "tokenizer.json"), manifest.eos_id)  # the copy just made
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
              "clean_up_tokenization_spaces": False, **specials}
    _write_json(os.path.join(out, CONFIG_FILE), config)
    _write_json(os.path.join(out, SPECIALS_FILE), specials)
    return {"written": True, "files": ["tokenizer.json", CONFIG_FILE, SPECIALS_FILE], "source": src, **ids,
            "reason": ""}


def _byte_to_char() -> dict[int, str]:
    """GPT-2's table: printable bytes stand for themselves, the others for the characters from U+0100 on."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def byte_tokenizer():
    """The ``tokenizers`` tokenizer of raw-text jobs: UTF-8 bytes as ids ``0..255``, and back."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab={c: b for b, c in _byte_to_char().items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


_NO_SPECIALS: dict[str, Any] = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def _special_tokens(tokenizer_json: str, eos_id: int | None) -> tuple[dict[str, str], dict[str, Any]]:
    """The special tokens by name (``tokenizer_config.json``'s) and by id (``config.json``'s): the end-of-text
    token the dataset put after every document as ``eos``; as ``bos`` the token the tokenizer's post-processor
    puts first (Llama 3's ``<|begin_of_text|>``), else that same end-of-text token (GPT-2's convention: every
    document of the training data followed one); as ``pad`` the tokenizer's padding token, else none in the
    tokenizer and the end-of-text id in the model's configs (what generation pads with)."""
    if eos_id is None:
        return {}, dict(_NO_SPECIALS)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_json)
    eos = tok.id_to_token(eos_id)
    if not eos:
        return {}, dict(_NO_SPECIALS)
    bos_id = _leading_special(tokenizer_json, tok)
    bos_id = eos_id if bos_id is None else bos_id
    pad_id = tok.padding["pad_id"] if tok.padding else None
    names = {"bos_token": tok.id_to_token(bos_id), "eos_token": eos,
             **({"pad_token": tok.id_to_token(pad_id)} if pad_id is not None else {})}
    return names, {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": eos_id if pad_id is None else pad_id}


def _leading_special(tokenizer_json: str, tok: Any) -> int | None:
    """The id of the special token the post-processor's single-sequence template starts with, if any."""
    with open(tokenizer_json, encoding="utf-8") as f:
        post = json.load(f).get("post_processor") or {}
    processors = post.get("processors", [post]) if isinstance(post, dict) else []
    for proc in processors:
        single = proc.get("single") if isinstance(proc, dict) and proc.get("type") == "TemplateProcessing" else None
        first = single[0] if isinstance(single, list) and single else {}
        name = first.get("SpecialToken", {}).get("id") if isinstance(first, dict) else None
        if isinstance(name, str) and tok.token_to_id(name) is not None:
            return tok.token_to_id(name)
    return None


def _not_written(reason: str) -> dict[str, Any]:
    return {"written": False, "files": [], "source": "", **_NO_SPECIALS, "reason": reason}


def _write_json(path: str, body: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(body, f, indent=2)
        f.write("\n")
