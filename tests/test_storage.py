"""``meridian serve --storage``: where checkpoints and final weights go, checked writable before any job is
accepted (URLs and relative paths: tests/test_cli.py)."""

from __future__ import annotations

import pytest

from meridian.cli.main import main as cli_main
from meridian.service.core import ServiceConfig, StorageUnusable


def test_the_default_storage_is_the_data_dirs_checkpoints_folder_and_storage_moves_it(tmp_path):
    assert ServiceConfig(data_dir=str(tmp_path)).checkpoint_root == str(tmp_path / "checkpoints")
    shared = ServiceConfig(data_dir=str(tmp_path), storage=str(tmp_path / "shared" / "ckpt"))
    shared.check_storage()  # made if missing, and writable
    assert shared.checkpoint_root == str(tmp_path / "shared" / "ckpt") and (tmp_path / "shared" / "ckpt").is_dir()
    assert list((tmp_path / "shared" / "ckpt").iterdir()) == []  # the write test leaves nothing behind


def test_storage_that_cannot_be_written_is_refused_at_start_with_what_to_do(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    cfg = ServiceConfig(data_dir=str(tmp_path / "data"), storage=str(tmp_path / "file" / "sub"))
    with pytest.raises(StorageUnusable, match="is not writable .* give --storage a folder"):
        cfg.check_storage()


def test_meridian_serve_with_unusable_storage_exits_2_before_starting_anything(tmp_path, capsys):
    (tmp_path / "file").write_text("not a folder")
    code = cli_main(["serve", "--data-dir", str(tmp_path / "data"), "--storage", str(tmp_path / "file" / "x"),
                     "--port", "1", "--local-datacenters", "dc-a:1"])
    err = capsys.readouterr().err
    assert code == 2 and "is not writable" in err and "--storage" in err
    assert not (tmp_path / "data" / "meridian.db").exists()  # refused before the database was opened
