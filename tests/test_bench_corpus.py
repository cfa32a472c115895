"""The corpora ``meridian bench lowcomm --data-source`` trains on: the standard library's source is the same
bytes every time, capped where asked, and read by a job exactly as written."""

from __future__ import annotations

from pathlib import Path

import pytest

from meridian.bench import corpus
from meridian.workers.contracts.config import DataConfig
from meridian.workers.data.text import load_text


def test_the_standard_librarys_source_is_fixed_capped_and_what_a_job_reads(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = corpus.prepare(corpus.PYTHON_STDLIB, 300_000, str(tmp_path / "a"))
    b = corpus.prepare(corpus.PYTHON_STDLIB, 300_000, str(tmp_path / "b"))
    assert a.sha256 == b.sha256 and a.name == corpus.PYTHON_STDLIB
    text = load_text(DataConfig(source=a.source, max_bytes=300_000))
    assert len(text) == 300_000 and a.train_bytes == 285_000
    assert b"import " in text and b"def " in text


def test_more_of_the_standard_library_starts_with_the_same_files(tmp_path):
    (tmp_path / "small").mkdir()
    (tmp_path / "big").mkdir()
    small = corpus.prepare(corpus.PYTHON_STDLIB, 100_000, str(tmp_path / "small"))
    big = corpus.prepare(corpus.PYTHON_STDLIB, 2_000_000, str(tmp_path / "big"))
    assert Path(big.source).read_bytes()[:100_000] == Path(small.source).read_bytes()


def test_the_built_in_text_and_a_relative_path(tmp_path):
    c = corpus.prepare("builtin:python-reference", 10**7, str(tmp_path))
    size = len(load_text(DataConfig()))
    assert c.train_bytes == int(size * 0.95) and 400_000 < size < 10**7
    with pytest.raises(ValueError, match="absolute path"):
        corpus.prepare("corpus.txt", 10**6, str(tmp_path))
