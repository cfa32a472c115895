"""Checkpoints in an object store (``meridian serve --storage s3://…``), against moto's S3 server on a local
port: a sharded save over two gloo ranks reads back exactly what the same save to a local folder does; the
``latest`` pointer is the commit point, so a save that died (or a re-save of the committed step) is never read
and is cleaned up by the next commit, on S3 as on a local folder; and storage the service cannot use is a
clear error at start, not a traceback. The slow test trains a job on an embedded Ray cluster into S3 and
exports it for transformers."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import socket
import time
from pathlib import Path

import pytest
import torch
from s3_env import aws_env, moto_s3
from sync_helpers import params_of
from test_replica_state import STEPS, _shapes
from test_sharded_checkpoint import _engine, trained_shard

from meridian.cli.main import main as cli_main
from meridian.service.artifacts import list_artifacts
from meridian.service.core import ServiceConfig, StorageUnusable
from meridian.workers.contracts.config import SyncStrategy
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.optim.adamw import MOMENTS
from meridian.workers.state import checkpoint as ckpt_io
from meridian.workers.state import storage
from meridian.workers.state.sharded_checkpoint import is_sharded, load_full, open_checkpoint, save_shard

FINGERPRINT = {"toy": [1, 2]}


@pytest.fixture
def bucket():
    with moto_s3() as url:
        yield url


def _save_both(rank, world, dcs, local_dir, url):
    """Train the toy model, then save the very same shard to a local folder and to S3."""
    engine = _engine(rank, dcs, SyncStrategy.FLAT)
    shard = trained_shard(engine, rank, world)
    written = [save_shard(d, shard, rank=rank, datacenter=dcs[rank], shapes=_shapes(), fingerprint=FINGERPRINT)
               for d in (local_dir, url)]  # fmt: skip
    engine.synchronize()
    params = params_of(engine.model.module if hasattr(engine.model, "module") else engine.model)
    engine.close()
    engine.groups.destroy()
    return {"written": written, "params": params}


def _restore(rank, world, dcs, url):
    """What a resuming rank does: load the newest checkpoint under ``url`` into a fresh engine."""
    from meridian.workers.elastic.durable import restore_latest

    engine = _engine(rank, dcs, SyncStrategy.FLAT)
    model = engine.model.module if hasattr(engine.model, "module") else engine.model  # DDP's wrapped module
    done = restore_latest(url, FINGERPRINT, model, engine)
    state = engine.optimizer_state()
    engine.synchronize()
    params = params_of(model)
    engine.close()
    engine.groups.destroy()
    return done.step if done else None, params, state


def _job(steps: int):
    """A stored job of ``steps`` steps (what the artifacts listing reads of it)."""
    from fakes import spec

    from meridian.api.schemas import JobSpec
    from meridian.service.jobs import JobState, JobStatus
    from meridian.service.store import JobRecord

    request = JobSpec.model_validate(spec(training={"steps": steps})).to_request()
    return JobRecord(id="job", seq=1, name="t", owner="", priority=0, status=JobStatus(JobState.SUCCEEDED, "", ""),
                     request_json=json.dumps(request.to_dict()), spec={}, plan=None, placement=None, progress=None,
                     result=None, runner=None, created_at=0.0, updated_at=0.0, started_at=None, finished_at=None)


def test_a_sharded_save_over_two_ranks_to_s3_reads_back_exactly_as_the_local_one(tmp_path, bucket):
    url = f"{bucket}/job"
    outs = run_processes(_save_both, 2, ("a", "b"), str(tmp_path), url)
    local, remote = outs[0]["written"]
    assert remote == f"{url}/step-{STEPS:08d}" and outs[1]["written"] == [None, None]
    assert storage.latest(url) == f"step-{STEPS:08d}" and is_sharded(remote)
    files = storage.step_folders(url)[f"step-{STEPS:08d}"]
    assert {".metadata", "meridian.json", "__0_0.distcp", "__1_0.distcp"} == set(files), files  # each rank's shard

    mine, theirs = load_full(open_checkpoint(str(local))), load_full(open_checkpoint(remote))
    assert mine[1]["step"] == theirs[1]["step"] == STEPS
    for name, p in outs[0]["params"].items():
        assert torch.equal(theirs[0][name], p) and torch.equal(mine[0][name], p), name
        for m in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(theirs[1]["params"][name][m], mine[1]["params"][name][m]), (name, m)

    # A save of step 9 that died before its marker: every shard and DCP's metadata there, no meridian.json.
    fs, root = storage._fs(url)
    for name in files:
        if name != "meridian.json":
            fs.copy(f"{root}/step-{STEPS:08d}/{name}", f"{root}/step-00000009/{name}")
    assert not is_sharded(f"{url}/step-00000009")
    # Two ranks resume from S3 (what a restarted job's workers do): step 3, not the dead step 9, exactly.
    for step, params, state in run_processes(_restore, 2, ("a", "b"), url):
        assert step == STEPS and all(torch.equal(params[n], p) for n, p in outs[0]["params"].items())
        assert all(torch.equal(state["params"][n][m], mine[1]["params"][n][m]) for n in params for m in MOMENTS)
    listing = list_artifacts(bucket, _job(steps=10))
    assert [a["step"] for a in listing["artifacts"]] == [STEPS] and listing["latest"] == remote
    assert listing["storage"] == url and listing["readable_here"]
    # The next commit (step 10, keeping 2) deletes what the dead save left.
    ckpt_io.save(url, ckpt_io.Checkpoint(step=10, model=outs[0]["params"], optimizer={}, fingerprint=FINGERPRINT))
    assert sorted(storage.step_folders(url)) == [f"step-{STEPS:08d}", "step-00000010"]
    listing = list_artifacts(bucket, _job(steps=10))
    assert [a["step"] for a in listing["artifacts"]] == [STEPS, 10] and listing["artifacts"][-1]["final"]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_latest_is_the_commit_point_and_an_unfinished_save_is_never_read(tmp_path, where):
    with moto_s3() if where == "s3" else contextlib.nullcontext("") as bucket:
        root = f"{bucket}/job" if where == "s3" else str(tmp_path / "job")
        model = {"w": torch.arange(6.0)}

        def save(step: int) -> None:
            ckpt_io.save(root, ckpt_io.Checkpoint(step=step, model={"w": model["w"] * step}, optimizer={},
                                                  fingerprint=FINGERPRINT), keep=2)  # fmt: skip

        for step in (1, 2, 3):
            save(step)
        assert storage.complete(storage.step_folders(root)) == ["step-00000002", "step-00000003"]  # pruned
        ck = ckpt_io.load_latest(root)
        assert ck is not None and ck.step == 3 and torch.equal(ck.model["w"], model["w"] * 3)

        # A re-save of the committed step starts (after a resume from an older one) and dies. Locally it
        # writes beside step 3, which stays whole until the rename; on S3 it writes in place, so latest is
        # taken back to step 2 before anything of step 3 is touched.
        kept = "step-00000003" if where == "local" else "step-00000002"
        storage.prepare(root, "step-00000003")
        ck = ckpt_io.load_latest(root)
        assert ck is not None and f"step-{ck.step:08d}" == kept == storage.latest(root)
        assert storage.complete(storage.step_folders(root))[-1] == kept
        # A save of step 4 that dies midway: its files, no marker.
        folder = storage.prepare(root, "step-00000004")
        if where == "local":
            Path(folder).mkdir()
        with storage.open_file(storage.join(folder, "__0_0.distcp"), "wb") as f:
            f.write(b"half a shard")
        assert storage.complete(storage.step_folders(root))[-1] == kept and storage.latest(root) == kept
        assert f"step-{ckpt_io.load_latest(root).step:08d}" == kept  # type: ignore[union-attr]

        save(5)  # the next commit cleans up what the dead saves left
        assert sorted(storage.step_folders(root)) == [kept, "step-00000005"]
        assert storage.latest(root) == "step-00000005" and ckpt_io.load_latest(root).step == 5  # type: ignore[union-attr]
        if where == "local":
            assert sorted(p.name for p in (tmp_path / "job").iterdir()) == ["latest", kept, "step-00000005"]


# -- storage the service cannot use: a clear error at start ------------------------------------------------
def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_url_the_service_cannot_use_is_refused_with_what_to_do(tmp_path, capsys):
    missing = next((p for p, pkg in (("gs", "gcsfs"), ("az", "adlfs"), ("oci", "ocifs"))
                    if importlib.util.find_spec(pkg) is None), None)  # fmt: skip
    cases = [("nosuch://bucket/x", "knows no scheme 'nosuch'"), ("s3://", "names no bucket")]
    if missing is not None:
        cases.append((f"{missing}://bucket/x", "needs a package that is not installed"))
    for bad, why in cases:
        with pytest.raises(ValueError, match=why):
            ServiceConfig(data_dir=str(tmp_path), storage=bad)
        assert cli_main(["serve", "--data-dir", str(tmp_path), "--storage", bad]) == 2
        assert why in capsys.readouterr().err

    with moto_s3() as bucket:
        ServiceConfig(data_dir=str(tmp_path), storage=f"{bucket}/ckpt").check_storage()  # writable
        assert storage.step_folders(f"{bucket}/ckpt") == {} and storage._fs(bucket)[0].ls(bucket[5:]) == []
        with pytest.raises(StorageUnusable, match="not writable .*bucket does not exist.*AWS_ACCESS_KEY_ID"):
            ServiceConfig(data_dir=str(tmp_path), storage="s3://no-such-bucket/ckpt").check_storage()
        code = cli_main(["serve", "--data-dir", str(tmp_path / "d"), "--storage", "s3://no-such-bucket/x",
                         "--port", "1", "--local-datacenters", "dc-a:1"])  # fmt: skip
        err = capsys.readouterr().err
        assert code == 2 and "AWS_ENDPOINT_URL" in err and "Traceback" not in err
        assert not (tmp_path / "d" / "meridian.db").exists()  # refused before anything started
    unreachable = aws_env(AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="y", AWS_DEFAULT_REGION="us-east-1",
                          AWS_ENDPOINT_URL=f"http://127.0.0.1:{_closed_port()}", AWS_MAX_ATTEMPTS="1")
    with unreachable, pytest.raises(StorageUnusable, match="not writable .*Could not connect to the endpoint"):
        ServiceConfig(data_dir=str(tmp_path), storage="s3://bucket/ckpt").check_storage()


# -- through the service, on an embedded Ray cluster -------------------------------------------------------
@pytest.mark.slow
def test_a_job_trains_into_s3_lists_its_artifacts_there_and_exports_for_transformers(tmp_path, monkeypatch, capsys):
    transformers = pytest.importorskip("transformers")
    from fakes import spec
    from ray_env import local_cluster, service_client

    with moto_s3() as bucket:  # before the cluster: its workers inherit the AWS_* variables
        url = f"{bucket}/checkpoints"
        with local_cluster(("dc-a", "dc-b")) as cluster, \
                service_client(cluster.address, str(tmp_path / "data"), storage=url) as api:  # fmt: skip
            body = spec(name="s3", model={"preset": "llama-tiny", "n_layers": 1, "seq_len": 32},
                        training={"steps": 4, "global_batch": 4, "micro_batch": 2},
                        topology={"datacenters": ["dc-a", "dc-b"]}, checkpoint={"interval_steps": 2})
            r = api.post("/v1/jobs", json=body)
            assert r.status_code == 201, r.text
            job_id, deadline = r.json()["id"], time.monotonic() + 240
            while (job := api.get(f"/v1/jobs/{job_id}").json())["state"] not in ("succeeded", "failed", "cancelled"):
                assert time.monotonic() < deadline, f"job did not finish in 240 s: {job['state']}"
                time.sleep(0.3)
            assert job["state"] == "succeeded", (job["message"], api.get(f"/v1/jobs/{job_id}/logs").text[-3000:])
            artifacts = api.get(f"/v1/jobs/{job_id}/artifacts").json()
            assert artifacts["storage"] == f"{url}/{job_id}" and artifacts["latest"] == f"{url}/{job_id}/step-00000004"
            assert [a["step"] for a in artifacts["artifacts"]] == [2, 4] and artifacts["artifacts"][-1]["final"]
            names = {f["name"] for f in artifacts["artifacts"][-1]["files"]}
            assert {"meridian.json", "__0_0.distcp", "__1_0.distcp"} <= names, names  # both ranks wrote to S3
            assert artifacts["artifacts"][-1]["path"].startswith("s3://")

            monkeypatch.setenv("MERIDIAN_URL", str(api.base_url))
            out = tmp_path / "hf"
            assert cli_main(["export", job_id, "--out", str(out), "--json"]) == 0
            exported = json.loads(capsys.readouterr().out)
            assert exported["final"] is True and exported["step"] == 4
            final = load_full(open_checkpoint(artifacts["latest"]))[0]
    # What transformers loads computes what Meridian's model computes with the weights read back from S3.
    from meridian.workers.contracts.fields import from_plain
    from meridian.workers.contracts.model_config import ModelConfig
    from meridian.workers.model.build import build_model

    ours = build_model(from_plain(ModelConfig, artifacts["model"])).eval()
    missing, unexpected = ours.load_state_dict(final, strict=False)
    assert not unexpected and set(missing) <= {n for n, _ in ours.named_buffers()}, (missing, unexpected)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out)).float().eval()
    x = torch.randint(0, int(artifacts["model"]["vocab_size"]), (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (theirs(input_ids=x).logits - ours(x)).abs().max().item() < 1e-4

