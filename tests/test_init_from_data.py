"""A fine-tuning job (``model.init_from``) trains the checkpoint's embeddings on the dataset's token ids, so they
must mean what they meant to it: a prepared dataset made with the checkpoint's tokenizer (when its directory has
a ``tokenizer.json``), never raw text read as bytes, never a blend of datasets made with different tokenizers.
Before, only the vocabulary sizes were compared."""

from __future__ import annotations

import json

import pytest
from test_init_from_and_blend_hostile import llama_weights

from meridian.api.schemas import JobSpec
from meridian.service.data_access import DataAccess
from meridian.service.errors import InvalidJob
from meridian.workers.data.prepare import PrepareOptions, prepare, train_bpe

VOCAB = 300


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A data root with a checkpoint (config.json, and its tokenizer.json written compactly, as a hub download
    may be: not byte for byte what ``tokenizers`` saves) and a text to prepare."""
    from pydoc_data.topics import topics

    root = tmp_path_factory.mktemp("roots")
    keys = sorted(topics)
    (root / "a.txt").write_text("\n\n".join(topics[k] for k in keys[:15]))
    (root / "b.txt").write_text("\n\n".join(topics[k] for k in keys[15:30]))
    for name, text in (("hf", "a.txt"), ("other", "b.txt")):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
            "hidden_act": "silu"}))
        llama_weights(root / name / "model.safetensors", json.loads((root / name / "config.json").read_text()))
        tok = json.loads(train_bpe([str(root / text)], VOCAB, "text").to_str())
        (root / name / "tokenizer.json").write_text(json.dumps(tok, separators=(",", ":")))
    (root / "bare").mkdir()  # a checkpoint without a tokenizer
    for f in ("config.json", "model.safetensors"):
        (root / "bare" / f).write_bytes((root / "hf" / f).read_bytes())
    for name, ckpt in (("ds-hf", "hf"), ("ds-other", "other")):
        prepare([str(root / "a.txt")], str(root / name),
                PrepareOptions(tokenizer=str(root / ckpt / "tokenizer.json"), val_fraction=0.1), progress=False)
    return root


def _admit(root, init_from: str, data: dict):
    access = DataAccess.for_roots([str(root)])
    spec = JobSpec.model_validate({"name": "ft", "model": {"init_from": str(root / init_from), "seq_len": 32},
                                   "data": data, "training": {"steps": 2, "global_batch": 2, "micro_batch": 1}})
    return access.admit(spec.to_request(admit_checkpoint=access.admit_checkpoint))


def test_data_made_with_the_checkpoint_s_tokenizer_is_admitted(root):
    assert _admit(root, "hf", {"dataset": str(root / "ds-hf")}).data.dataset == str(root / "ds-hf")
    assert _admit(root, "bare", {"dataset": str(root / "ds-other")}).model.vocab_size == VOCAB  # nothing to compare


def test_data_made_with_another_tokenizer_is_refused_with_the_command_that_fixes_it(root):
    with pytest.raises(InvalidJob, match="made with another tokenizer than model.init_from's") as e:
        _admit(root, "hf", {"dataset": str(root / "ds-other")})
    assert f"meridian data prepare FILES --out NEW_DIR --tokenizer {root / 'hf' / 'tokenizer.json'}" in str(e.value)


@pytest.mark.parametrize("init_from", ["hf", "bare"])
def test_raw_text_is_refused(root, init_from):
    with pytest.raises(InvalidJob, match=r"data.source 'builtin:python-reference' is read as raw bytes"):
        _admit(root, init_from, {"source": "builtin:python-reference"})


def test_a_blend_of_two_tokenizers_is_refused(root):
    blend = {"blend": [{"dataset": str(root / "ds-hf")}, {"dataset": str(root / "ds-other")}]}
    with pytest.raises(InvalidJob, match="data.blend mixes datasets made with different tokenizers"):
        _admit(root, "bare", blend)


def test_a_symlinked_checkpoint_tokenizer_is_refused(root):
    link = root / "linked"
    link.mkdir()
    for f in ("config.json", "model.safetensors"):
        (link / f).write_bytes((root / "hf" / f).read_bytes())
    (link / "tokenizer.json").symlink_to(root / "hf" / "tokenizer.json")
    with pytest.raises(InvalidJob, match="tokenizer.json cannot be read .*not a symlink"):
        _admit(root, "linked", {"dataset": str(root / "ds-hf")})
