"""Experiment tracking from rank 0 through the real libraries: TensorBoard event files, an MLflow file store and a
W&B offline run read back, with each library's own reader, the loss series that was logged (and, in the slow
test, the series ``GET /v1/jobs/{id}/metrics`` serves for a job trained on a Ray cluster). Admission: a tracker
whose library is missing is a 422 naming the package; an MLflow URI outside the tracking roots is refused."""

from __future__ import annotations

import glob
import json
import os
import struct
import subprocess
import sys
import time

import pytest

from meridian.api.schemas import JobSpec
from meridian.service.data_access import DataAccess
from meridian.service.errors import InvalidJob
from meridian.service.tracking import with_job_dir
from meridian.workers.contracts.config import TrainConfig
from meridian.workers.contracts.model_config import model_preset
from meridian.workers.contracts.records import StepRecord
from meridian.workers.contracts.tracking import MlflowTracking, TrackingConfig, WandbTracking
from meridian.workers.tracking.sink import TrackingSink

pytest.importorskip("tensorboard")
pytest.importorskip("mlflow")
pytest.importorskip("wandb")


def f32(x: float) -> float:
    """What TensorBoard keeps of a float (its scalars are float32)."""
    return struct.unpack("f", struct.pack("f", x))[0]


# -- readers, one per library ------------------------------------------------------------------------------
def tensorboard_series(folder: str, tag: str = "loss") -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(folder)
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def mlflow_series(uri: str, job_id: str, experiment: str = "meridian") -> tuple[list[tuple[int, float]], dict]:
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    import mlflow

    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=[experiment], filter_string=f"tags.`meridian.job_id` = '{job_id}'",
                              output_format="list")
    assert len(runs) == 1, runs
    history = mlflow.MlflowClient(uri).get_metric_history(runs[0].info.run_id, "loss")
    return sorted((m.step, m.value) for m in history), runs[0].data.params


def wandb_series(folder: str, job_id: str) -> tuple[list[tuple[int, float]], dict]:
    """The history and config of the offline run's files, as `wandb leet inspect` reads them."""
    files = sorted(glob.glob(os.path.join(folder, "wandb", f"offline-run-*-{job_id}", f"run-{job_id}.wandb")))
    assert files, os.listdir(folder)
    series, config = [], {}
    wandb_cli = os.path.join(os.path.dirname(sys.executable), "wandb")
    for path in files:
        out = subprocess.run([wandb_cli, "leet", "inspect", "--json", path], capture_output=True, text=True,
                             timeout=120, check=True).stdout
        for line in out.splitlines():
            rec = json.loads(line)
            if rec.get("type") == "history":
                item = rec["history"]["item"]
                if "loss" in item:
                    series.append((int(item["_step"]), float(item["loss"])))
            elif rec.get("type") == "run":
                config.update(rec["run"].get("config", {}).get("update", {}))
    return series, config


def _cfg(job_dir: str, tracking: TrackingConfig) -> TrainConfig:
    return TrainConfig(job_id="job-t1", model=model_preset("nano"), steps=5, global_batch=2, micro_batch=1,
                       tracking=tracking, job_dir=job_dir)


def _record(step: int) -> StepRecord:
    return StepRecord(step=step, total_steps=5, loss=4.0 / step + 0.123456789, lr=1e-3 * step, step_s=0.1,
                      tokens_per_s=1000.0 + step, grad_norm=1.5, inter_dc_bytes=4096 * step, data_s=0.01,
                      compute_s=0.08, sync_wait_s=0.01, mfu=0.02, val_loss=3.5 if step == 5 else None)


class Runner:
    def __init__(self):
        self.records, self.events = [], []

    def step(self, record):
        self.records.append(record)


def test_the_three_trackers_read_back_what_rank_0_logged(tmp_path):
    tracking = TrackingConfig(tensorboard=True, mlflow=MlflowTracking(uri=f"file:{tmp_path / 'mlruns'}"),
                              wandb=WandbTracking(project="meridian-test"))
    cfg = with_job_dir(_cfg("", tracking), str(tmp_path / "job"), {"sync_strategy": "hierarchical",
                                                                  "datacenters": ["dc-a", "dc-b"]})
    inner, events = Runner(), []
    sink = TrackingSink(inner, cfg, on_event=lambda *e: events.append(e))
    for step in range(1, 6):
        sink.step(_record(step))
    sink.close()
    assert events == [] and [r.step for r in inner.records] == [1, 2, 3, 4, 5]  # the runner got every record too
    want = [(r.step, r.loss) for r in inner.records]

    assert tensorboard_series(str(tmp_path / "job" / "tensorboard")) == [(s, f32(v)) for s, v in want]
    assert tensorboard_series(str(tmp_path / "job" / "tensorboard"), "val_loss") == [(5, 3.5)]
    series, params = mlflow_series(f"file:{tmp_path / 'mlruns'}", "job-t1")
    assert series == want
    assert params["plan.sync_strategy"] == "hierarchical" and params["plan.datacenters"] == "dc-a,dc-b"
    assert params["config.steps"] == "5" and params["config.model.d_model"] == str(model_preset("nano").d_model)
    series, config = wandb_series(str(tmp_path / "job" / "wandb"), "job-t1")
    assert series == want and config["plan.sync_strategy"] == "hierarchical"


def test_a_worker_that_never_becomes_rank_0_opens_no_tracker(tmp_path):
    opened = []
    sink = TrackingSink(Runner(), _cfg(str(tmp_path), TrackingConfig(tensorboard=True)), on_event=lambda *e: None,
                        open_fn=lambda cfg: opened.append(cfg) or [])
    sink.close()
    assert opened == [] and not (tmp_path / "tensorboard").exists()


def test_a_failing_tracker_is_one_event_and_training_goes_on(tmp_path):
    class Broken:
        def log(self, step, metrics):
            raise OSError("disk full")

        def flush(self):
            pass

        def close(self):
            pass

    events, inner = [], Runner()
    sink = TrackingSink(inner, _cfg(str(tmp_path), TrackingConfig(tensorboard=True)),
                        on_event=lambda *e: events.append(e), open_fn=lambda cfg: [("tensorboard", Broken())])
    for step in range(1, 4):
        sink.step(_record(step))
    sink.close()
    assert len(inner.records) == 3 and [e[0] for e in events] == ["tracking_failed"]
    assert "tensorboard failed at step 1 (OSError: disk full)" in events[0][1]


# -- admission --------------------------------------------------------------------------------------------
def _request(tracking: dict):
    return JobSpec.model_validate({"name": "t", "training": {"steps": 2, "global_batch": 2, "micro_batch": 1},
                                   "tracking": tracking}).to_request()


def test_a_tracker_whose_library_is_missing_is_refused_naming_the_package(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    access = DataAccess.for_roots([str(tmp_path)], tracking_roots=[str(tmp_path)], storage_root=str(tmp_path))
    with pytest.raises(InvalidJob, match=r"tracking asks for wandb, which is not installed.*pip install wandb"):
        access.admit(_request({"wandb": {"project": "p"}}))
    assert access.admit(_request({"tensorboard": True})).tracking == TrackingConfig(tensorboard=True)


def test_an_mlflow_uri_must_be_under_a_tracking_root(tmp_path):
    root = tmp_path / "tracking"
    root.mkdir()
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", root / "link")
    access = DataAccess.for_roots([str(tmp_path)], tracking_roots=[str(root), "https://mlflow.example.org/team-a"],
                                  storage_root=str(tmp_path / "ckpt"))

    def uri(value: str) -> str:
        return access.admit(_request({"mlflow": {"uri": value}})).tracking.mlflow.uri  # type: ignore[union-attr]

    assert uri(f"file:{root}/mlruns") == f"file:{root}/mlruns"
    assert uri(f"file://{root}/mlruns") == f"file:{root}/mlruns"
    assert uri(f"sqlite:///{root}/m.db") == f"sqlite:///{root}/m.db"
    assert uri("https://mlflow.example.org/team-a/") == "https://mlflow.example.org/team-a"
    answers = []
    for bad in (f"file:{root}/link/mlruns", f"file:{root}/../x", f"file:{tmp_path}/elsewhere", "file:relative",
                f"sqlite:///{tmp_path}/m.db", "sqlite://relative.db", "https://mlflow.example.org/team-b",
                "http://169.254.169.254/latest", "databricks", f"file:{root}"):
        with pytest.raises(InvalidJob, match="is not a file:, sqlite: or http") as e:
            uri(bad)
        answers.append(str(e.value).replace(bad, "URI"))
    assert len(set(answers)) == 1  # the same words for every refusal
    # No URI: a file store in the job's folder, set at launch; an object store cannot hold one.
    assert access.admit(_request({"mlflow": {}})).tracking.mlflow.uri == ""  # type: ignore[union-attr]
    cfg = with_job_dir(_cfg("", TrackingConfig(mlflow=MlflowTracking())), str(tmp_path / "ckpt" / "j"), {})
    assert cfg.tracking.mlflow.uri == f"file:{tmp_path / 'ckpt' / 'j' / 'mlflow'}"  # type: ignore[union-attr]
    on_s3 = DataAccess.for_roots([str(tmp_path)], storage_root="s3://bucket/ckpt")
    with pytest.raises(InvalidJob, match="tracking.mlflow.uri is needed"):
        on_s3.admit(_request({"mlflow": {}}))


def test_the_launched_config_carries_the_jobs_tracking_its_folder_and_the_plan(supervisor, tmp_path):
    from fakes import spec

    from meridian.service.supervision.supervisor import Supervisor

    sup = Supervisor(supervisor.store, supervisor.launcher, supervisor.read_topology,
                     checkpoint_root=str(tmp_path / "ckpt"),
                     data_access=DataAccess.for_roots([str(tmp_path)], storage_root=str(tmp_path / "ckpt")))
    s = JobSpec.model_validate(spec(tracking={"tensorboard": True, "mlflow": {}}))
    job, _ = sup.submit(s.to_request(), s.model_dump(mode="json"))
    sup.tick()
    (job_id, config, plan), = sup.launcher.launched
    assert job_id == job.id and config.job_dir == str(tmp_path / "ckpt" / job.id)
    assert config.tracking.tensorboard and config.tracking.mlflow.uri == f"file:{tmp_path / 'ckpt' / job.id / 'mlflow'}"
    params = dict(config.tracking.params)
    assert params["plan.num_workers"] == str(plan.num_workers) and "plan.sync_strategy" in params


# -- through the service, on an embedded Ray cluster -------------------------------------------------------
@pytest.mark.slow
def test_a_finished_jobs_loss_reads_back_from_every_tracker_equal_to_its_metrics(tmp_path, two_nodes):
    from fakes import spec
    from ray_env import service_client

    mlruns = tmp_path / "tracking" / "mlruns"
    with service_client(two_nodes.address, str(tmp_path / "data"), tracking_roots=(str(tmp_path / "tracking"),)) as api:
        body = spec(name="tracked", training={"steps": 6, "global_batch": 4, "micro_batch": 2},
                    topology={"datacenters": ["dc-a", "dc-b"]}, validation={"every_steps": 3, "batches": 1},
                    tracking={"tensorboard": True, "mlflow": {"uri": f"file:{mlruns}", "experiment": "e2e"},
                              "wandb": {"project": "meridian-e2e"}})
        r = api.post("/v1/jobs", json=body)
        assert r.status_code == 201, r.text
        job_id, deadline = r.json()["id"], time.monotonic() + 240
        while (job := api.get(f"/v1/jobs/{job_id}").json())["state"] not in ("succeeded", "failed", "cancelled"):
            assert time.monotonic() < deadline, f"job did not finish in 240 s: {job['state']}"
            time.sleep(0.3)
        assert job["state"] == "succeeded", (job["message"], api.get(f"/v1/jobs/{job_id}/logs").text[-3000:])
        points = api.get(f"/v1/jobs/{job_id}/metrics").json()["points"]
        artifacts = api.get(f"/v1/jobs/{job_id}/artifacts").json()
        events = [e["kind"] for e in api.get(f"/v1/jobs/{job_id}/events").json()["events"]]
    want = [(p["step"], p["loss"]) for p in points]
    assert [s for s, _ in want] == [1, 2, 3, 4, 5, 6] and "tracking_failed" not in events

    tb = artifacts["tracking"]["tensorboard"]
    assert tb["path"] == os.path.join(str(tmp_path / "data" / "checkpoints"), job_id, "tensorboard")
    assert any(f["name"].startswith("events.out.tfevents.") for f in tb["files"])
    assert tensorboard_series(tb["path"]) == [(s, f32(v)) for s, v in want]
    assert tensorboard_series(tb["path"], "val_loss") == [(p["step"], f32(p["val_loss"])) for p in points
                                                          if p.get("val_loss") is not None]
    series, params = mlflow_series(f"file:{mlruns}", job_id, "e2e")
    assert series == want and params["plan.num_workers"] == "2" and params["config.steps"] == "6"
    assert artifacts["tracking"]["mlflow"] == {"uri": f"file:{mlruns}", "experiment": "e2e"}
    series, config = wandb_series(artifacts["tracking"]["wandb"]["path"], job_id)
    assert series == want and config["plan.num_workers"] == "2"


def _job_record(job_id: str, tracking: dict):
    import json as json_

    from meridian.service.jobs import JobState, JobStatus
    from meridian.service.store import JobRecord

    request = _request(tracking)
    return JobRecord(id=job_id, seq=1, name="t", owner="", priority=0, status=JobStatus(JobState.SUCCEEDED, "", ""),
                     request_json=json_.dumps(request.to_dict()), spec={}, plan=None, placement=None, progress=None,
                     result=None, runner=None, created_at=0.0, updated_at=0.0, started_at=None, finished_at=None)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_the_logs_in_the_jobs_folder_are_listed_in_its_artifacts_on_a_folder_or_an_object_store(tmp_path, where):
    import contextlib

    from s3_env import moto_s3

    from meridian.service.artifacts import list_artifacts
    from meridian.workers.state import storage

    with moto_s3() if where == "s3" else contextlib.nullcontext(str(tmp_path / "ckpt")) as root:
        job_dir = storage.join(root, "job-t1")
        cfg = with_job_dir(_cfg("", TrackingConfig(tensorboard=True, wandb=WandbTracking(project="p"))), job_dir, {})
        sink = TrackingSink(Runner(), cfg, on_event=lambda *e: pytest.fail(str(e)))
        for step in range(1, 6):
            sink.step(_record(step))
        sink.close()
        listing = list_artifacts(root, _job_record("job-t1", {"tensorboard": True, "wandb": {"project": "p"}}))
        tb = listing["tracking"]["tensorboard"]
        assert tb["path"] == storage.join(job_dir, "tensorboard") and tb["bytes"] > 0
        assert any(f["name"].startswith("events.out.tfevents.") for f in tb["files"])
        assert any(f["name"].endswith("run-job-t1.wandb") for f in listing["tracking"]["wandb"]["files"])
        if where == "s3":  # mirrored whole: the copy reads back as what was logged
            from fsspec.core import url_to_fs

            fs, path = url_to_fs(tb["path"])
            fs.get(path, str(tmp_path / "tb"), recursive=True)
            folder = str(tmp_path / "tb")
        else:
            folder = tb["path"]
        assert tensorboard_series(folder) == [(s, f32(4.0 / s + 0.123456789)) for s in range(1, 6)]
