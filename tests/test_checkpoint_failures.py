"""Durable checkpoints when things go wrong: a save killed mid-commit, a save the storage refuses, a damaged
checkpoint, a folder someone copied beside the job's checkpoints."""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_sharded_checkpoint import _engine, _save_run

from meridian.service import artifacts
from meridian.workers.contracts.config import SyncStrategy
from meridian.workers.distributed.multiproc import RankFailed, run_processes
from meridian.workers.state import checkpoint as ckpt_io
from meridian.workers.state import storage
from meridian.workers.state.sharded_checkpoint import load_full, open_checkpoint

FINGERPRINT = {"toy": [1, 2]}


def _save(root: str, step: int) -> None:
    ckpt_io.save(root, ckpt_io.Checkpoint(step=step, model={"w": torch.full((3,), float(step))}, optimizer={},
                                          fingerprint=FINGERPRINT))  # fmt: skip


def _job(job_id: str, steps: int) -> SimpleNamespace:
    request = SimpleNamespace(steps=steps, keep_final=True, model={}, data={}, tracking=None)
    return SimpleNamespace(id=job_id, request=request)


def _listing(root: Path, steps: int = 9) -> dict:
    return artifacts.list_artifacts(str(root.parent), _job(root.name, steps))  # type: ignore[arg-type]


# -- a commit killed halfway -------------------------------------------------------------------------------
def test_a_save_killed_between_removing_its_step_and_renaming_the_new_one_resumes_from_the_newest_whole_one(
    tmp_path, monkeypatch
):
    # A resume from an older snapshot writes a step again: the commit removes the old step-3 and renames the
    # new one into place. Killed in between, `latest` named a folder that was gone, and every resume (and the
    # artifacts listing, and so export) failed on it, though step-2 was whole.
    root = tmp_path / "job"
    for step in (1, 2, 3):
        _save(str(root), step)
    real = os.replace

    def killed(src, dst):
        if os.path.isdir(src):
            raise KeyboardInterrupt("SIGKILL between the rmtree and the rename")
        return real(src, dst)

    monkeypatch.setattr(storage.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        _save(str(root), 3)
    monkeypatch.setattr(storage.os, "replace", real)
    assert (root / "latest").read_text() == "step-00000003" and not (root / "step-00000003").exists()

    assert storage.latest(str(root)) == "step-00000002"
    ck = ckpt_io.load_latest(str(root))
    assert ck is not None and ck.step == 2 and torch.equal(ck.model["w"], torch.full((3,), 2.0))
    listing = _listing(root)
    assert listing["latest"] == str(root / "step-00000002") and listing["readable_here"]
    assert [a["step"] for a in listing["artifacts"]] == [2]
    _save(str(root), 3)  # the step written again commits, and cleans up what the killed save left
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000002", "step-00000003"]
    assert ckpt_io.load_latest(str(root)).step == 3  # type: ignore[union-attr]

    (root / "latest").unlink()  # a lost pointer: the newest whole checkpoint is still the one trusted
    assert storage.latest(str(root)) == "step-00000003"
    (root / "latest").write_text("")
    assert ckpt_io.load_latest(str(root)).step == 3  # type: ignore[union-attr]


def test_a_copy_of_a_checkpoint_folder_beside_the_job_s_is_neither_listed_nor_counted_nor_deleted(tmp_path):
    # An operator's `cp -r step-00000002 step-00000002.bak`: the listing failed (int('00000002.bak'): the
    # artifacts endpoint, and so export, broke), and the next save counted the copy as a checkpoint and
    # deleted the real step-2 instead.
    root = tmp_path / "job"
    _save(str(root), 1)
    _save(str(root), 2)
    shutil.copytree(root / "step-00000002", root / "step-00000002.bak")
    assert [a["step"] for a in _listing(root)["artifacts"]] == [1, 2]
    _save(str(root), 3)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000002", "step-00000002.bak",
                                                      "step-00000003"]  # fmt: skip
    assert storage.latest(str(root)) == "step-00000003"


# -- a save the storage refuses ----------------------------------------------------------------------------
def _full_disk_run(rank, world, cfg, fail_on):
    from test_parallel import _FormedRendezvous

    from meridian.workers.elastic.trainer import ElasticTrainer
    from meridian.workers.loop.train import ListSink

    real = storage.write_text

    def full(location: str, text: str) -> None:
        if location.endswith(fail_on):
            raise OSError(errno.ENOSPC, "No space left on device", location)
        real(location, text)

    storage.write_text = full
    result = ElasticTrainer(cfg, _FormedRendezvous(rank, world, cfg), sink=ListSink(), on_event=lambda *e: None).run()
    return result.final_loss


def test_a_final_checkpoint_the_storage_refuses_fails_the_job_saying_what_to_do(tmp_path):
    # Every job keeps its final weights: when their save failed (a full disk), the job still succeeded, with
    # nothing in its storage to export; the error went to the worker's stderr only.
    import test_elastic_loop as el

    cfg = replace(el.job(datacenters=("dc-a",), job_id=el._unique_job_id(), steps=3), checkpoint_dir=str(tmp_path))
    with pytest.raises(RankFailed) as failed:
        run_processes(_full_disk_run, 1, cfg, "meridian.json", timeout_s=180)
    message = str(failed.value)
    assert "CheckpointNotWritten: the durable checkpoint of step 3 was not written to" in message
    assert "No space left on device" in message and "make room there" in message
    assert storage.latest(str(tmp_path)) is None


def _abandoned_then_saved(rank, world, directory):
    """A save of an epoch that failed is abandoned (its error is not this epoch's); a save that fails raises at
    the next wait, once."""
    import threading

    from meridian.workers.elastic import durable
    from meridian.workers.state.replica_state import LocalShard, StatePiece

    shard = LocalShard(2, 2, (StatePiece("w", 0, 4, torch.arange(4.0)),))
    ck = durable.Checkpointer(directory, {"toy": 1})
    release = threading.Event()
    real = durable.save_shard

    def stuck_then_fails(*args, **kwargs):
        release.wait(30)
        raise RuntimeError("Connection closed by peer")

    durable.save_shard = stuck_then_fails
    ck.save(shard, rank=0, datacenter="a", shapes={"w": torch.Size([4])})
    ck.new_epoch()  # the epoch re-forms while that save hangs on its dead peer
    release.set()
    durable.save_shard = real
    ck.save(replace(shard, step=4), rank=0, datacenter="a", shapes={"w": torch.Size([4])})
    ck.wait()  # the new epoch's save is written; the abandoned one's error is not raised here
    written = storage.latest(directory)
    durable.save_shard = lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EACCES, "Permission denied"))
    ck.save(replace(shard, step=6), rank=0, datacenter="a", shapes={"w": torch.Size([4])})
    try:
        ck.wait()
        raised = None
    except durable.CheckpointNotWritten as e:
        raised = str(e)
    ck.wait()  # raised once
    return written, raised


def test_an_abandoned_save_s_error_is_not_raised_in_the_next_epoch_and_a_failed_save_is_raised_once(tmp_path):
    written, raised = run_processes(_abandoned_then_saved, 1, str(tmp_path), timeout_s=120)[0]
    assert written == "step-00000004"
    assert raised is not None and "checkpoint of step 6 was not written" in raised and "Permission denied" in raised


# -- a damaged checkpoint ----------------------------------------------------------------------------------
def _damage(step: Path, how: str) -> None:
    if how == "meridian.json empty":
        (step / "meridian.json").write_text("")
    elif how == "meridian.json cut":
        text = (step / "meridian.json").read_text()
        (step / "meridian.json").write_text(text[: len(text) // 2])
    elif how == "meridian.json without shapes":
        (step / "meridian.json").write_text('{"format": "meridian.dcp/1", "step": 3, "adam_step": 3}')
    elif how == ".metadata cut":
        os.truncate(step / ".metadata", os.path.getsize(step / ".metadata") // 2)
    elif how == "shard cut":
        shard = sorted(step.glob("*.distcp"))[0]
        os.truncate(shard, os.path.getsize(shard) // 2)
    elif how == "shard missing":
        sorted(step.glob("*.distcp"))[-1].unlink()


def _restore_damaged(rank, world, directory):
    from meridian.workers.elastic.durable import restore_latest

    engine = _engine(rank, ("a",), SyncStrategy.HIERARCHICAL)
    try:
        restore_latest(directory, FINGERPRINT, engine.model, engine)
    except Exception as e:  # what the training loop's failure handling catches (DCP's own is a BaseException)
        return type(e).__name__, str(e)
    finally:
        engine.close()
        engine.groups.destroy()
    return None


HOWS = ["meridian.json empty", "meridian.json cut", "meridian.json without shapes", ".metadata cut", "shard cut",
        "shard missing"]  # fmt: skip


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    run_processes(_save_run, 2, ("a", "b"), SyncStrategy.FLAT, str(root / "job"))
    return root / "job"


@pytest.mark.parametrize("how", HOWS)
def test_a_damaged_sharded_checkpoint_is_refused_naming_the_folder_and_what_to_do(tmp_path, sharded_checkpoint,
                                                                                  how):
    root = tmp_path / "job"
    shutil.copytree(sharded_checkpoint, root)
    step = root / storage.latest(str(root))  # type: ignore[operator]
    _damage(step, how)
    with pytest.raises(ValueError) as e:  # (storage.CheckpointUnreadable)
        load_full(open_checkpoint(str(step)))  # what export reads
    assert f"the checkpoint {step} cannot be read" in str(e.value)
    assert "restore the folder from a copy, or delete it (there is no older checkpoint: a resume then starts at " \
           "step 0)" in str(e.value)  # fmt: skip
    if how in ("shard cut", ".metadata cut"):  # on a rank, as a resume meets it
        kind, message = run_processes(_restore_damaged, 1, str(root), timeout_s=120)[0]
        assert kind == "CheckpointUnreadable" and f"the checkpoint {step} cannot be read" in message


def test_a_damaged_single_file_checkpoint_is_refused_by_resume_and_export_naming_the_older_one(tmp_path):
    from meridian.workers.contracts.model_config import model_preset
    from meridian.workers.model.build import build_model
    from meridian.workers.model.export import export_checkpoint

    model = model_preset("nano")
    weights = {n: p.detach().clone() for n, p in build_model(model).named_parameters()}
    root = tmp_path / "job"
    for step in (4, 8):
        ckpt_io.save(str(root), ckpt_io.Checkpoint(step=step, model=weights, optimizer={}, fingerprint=FINGERPRINT))
    export_checkpoint(str(root / "step-00000008"), _plain(model), str(tmp_path / "hf"))  # whole: exports
    state = root / "step-00000008" / "state.pt"
    os.truncate(state, os.path.getsize(state) // 2)
    for read in (lambda: ckpt_io.load_latest(str(root)),
                 lambda: export_checkpoint(str(root / "step-00000008"), _plain(model), str(tmp_path / "hf2"))):
        with pytest.raises(ValueError, match="cut short, missing or garbled") as e:  # (CheckpointUnreadable)
            read()
        assert f"the checkpoint {root / 'step-00000008'} cannot be read" in str(e.value)
        assert "delete it (a resume then starts from step-00000004)" in str(e.value)


def _plain(model):
    from meridian.workers.contracts.fields import to_plain

    return to_plain(model)


# -- a step snapshot its RAM folder has no room for --------------------------------------------------------
class _Copied:
    """A CUDA event's stand-in: the shard's copies are done (the store then writes on its writer thread)."""

    def synchronize(self) -> None:
        pass


@pytest.mark.parametrize("on_writer_thread", [True, False], ids=["gpu-writer-thread", "cpu-synchronous"])
def test_a_snapshot_its_ram_folder_has_no_room_for_stops_the_job_saying_what_to_do_and_leaves_no_partial_file(
    tmp_path, monkeypatch, on_writer_thread
):
    # A container's 64 MB /dev/shm: on a GPU the write failed on the writer thread, printed there and nowhere
    # else, and the step's snapshot was silently missing (a failure then resumed from an older step or the
    # checkpoint); on CPU it raised a bare ENOSPC. Both left the half-written file, holding RAM.
    from meridian.workers.state import snapshots
    from meridian.workers.state.replica_state import LocalShard, StatePiece

    def shard(step: int) -> LocalShard:
        return LocalShard(step, step, (StatePiece("w", 0, 4, torch.arange(4.0) + step),))

    store = snapshots.SnapshotStore(3, str(tmp_path))
    ready = _Copied() if on_writer_thread else None
    store.append(shard(1), ready)
    store.wait()
    real = snapshots.write_packed

    def full(path, desc, tensors):
        Path(path).write_bytes(b"MRDS" + b"\0" * 10)
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(snapshots, "write_packed", full)
    with pytest.raises(OSError) as e:  # (snapshots.SnapshotNotWritten)
        store.append(shard(2), ready)
        store.last_step  # noqa: B018  (what the training thread calls next: it waits for the write)
    message = str(e.value)
    assert f"the state snapshot of step 2 could not be written to {tmp_path}" in message
    assert "No space left on device" in message and "it needs 16 bytes" in message and "--shm-size" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-0000000001.pt"]
    monkeypatch.setattr(snapshots, "write_packed", real)
    store.append(shard(3), ready)  # raised once; room again: kept as before
    assert store.last_step == 3 and store.get(3) is not None


# -- two saves committing at once --------------------------------------------------------------------------
def test_two_saves_committing_at_once_each_replace_latest_whole(tmp_path):
    # Both wrote `latest.tmp` and renamed it: one renamed the other's file away (FileNotFoundError: its save
    # failed) or a half-written one into place. Each writer now has its own temporary file.
    import threading

    errors: list[BaseException] = []

    def commit(name: str) -> None:
        for _ in range(1500):
            try:
                storage.write_text(str(tmp_path / "latest"), name)
            except Exception as e:
                errors.append(e)

    writers = [threading.Thread(target=commit, args=(n,)) for n in ("step-00000005", "step-00000006")]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    assert errors == [] and (tmp_path / "latest").read_text() in ("step-00000005", "step-00000006")
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]


def test_listing_the_checkpoints_while_a_commit_deletes_an_old_one_does_not_fail(tmp_path, monkeypatch):
    # The artifacts listing (and so `meridian export`) of a job that checkpoints often failed now and then with
    # FileNotFoundError, reported as storage the service "cannot list ... check the service's credentials":
    # the commit had deleted an old checkpoint between the listing's glob and its reading of that folder.
    root = tmp_path / "job"
    for step in (1, 2):
        _save(str(root), step)
    real = Path.iterdir

    def deleted_meanwhile(self):
        if self.name == "step-00000001":
            shutil.rmtree(self)  # what the next commit's clean-up does, at this moment
        return real(self)

    monkeypatch.setattr(Path, "iterdir", deleted_meanwhile)
    listing = _listing(root)
    assert [a["step"] for a in listing["artifacts"]] == [2] and listing["latest"] == str(root / "step-00000002")
