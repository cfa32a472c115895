"""The `meridian` CLI against a live HTTP server over the fake cluster: every verb, --json, friendly errors."""

from __future__ import annotations

import json
import time

import pytest
from fakes import FakeService, raw_event, spec, submit

from meridian.api.auth import AuthSettings, create_token
from meridian.api.server import serve_in_thread
from meridian.cli.main import main
from meridian.workers.contracts.events import EventKind, JobEvent
from meridian.workers.contracts.model_config import model_preset


@pytest.fixture
def served(store, supervisor, cluster_view, tmp_path, monkeypatch):
    fake = FakeService(store, supervisor, cluster_view)
    token = create_token(tmp_path / "tokens.json", "dana")
    monkeypatch.setenv("MERIDIAN_TOKEN", token)
    with serve_in_thread(fake, auth=AuthSettings.load(enabled=True, token_file=str(tmp_path / "tokens.json"))) as url:
        monkeypatch.setenv("MERIDIAN_URL", url)
        yield fake


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_verbs_with_json(served, capsys, tmp_path):
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(spec(name="cli")))
    yaml_file = tmp_path / "job.yaml"
    yaml_file.write_text("name: cli-yaml\nmodel: {preset: nano}\ntraining: {steps: 4, global_batch: 4, micro_batch: 2}\n")

    code, out, _ = run(capsys, "submit", str(job_file), "--json")
    job = json.loads(out)
    assert code == 0 and job["owner"] == "dana" and job["state"] == "queued"
    code, out, _ = run(capsys, "submit", str(yaml_file), "--json")
    assert code == 0 and json.loads(out)["name"] == "cli-yaml"
    code, out, _ = run(capsys, "ls", "--json")
    assert code == 0 and json.loads(out)["count"] == 2
    code, out, _ = run(capsys, "get", job["id"], "--json")
    assert json.loads(out)["id"] == job["id"]
    code, out, _ = run(capsys, "plan", str(job_file), "--json")
    assert json.loads(out)["num_workers"] == 4
    code, out, _ = run(capsys, "cluster", "--json")
    assert [dc["name"] for dc in json.loads(out)["datacenters"]] == ["dc-a", "dc-b"]
    code, out, _ = run(capsys, "logs", job["id"], "--json")
    assert code == 0 and json.loads(out)["lines"] == []
    code, out, _ = run(capsys, "cancel", job["id"], "--json")
    assert json.loads(out)["state"] == "cancelled"
    # The job is over, so following its events prints them all and returns.
    code, out, _ = run(capsys, "events", job["id"], "-f", "--json")
    states = [json.loads(line)["data"].get("state") for line in out.splitlines()]
    assert code == 0 and states == ["queued", "cancelled"]
    code, out, _ = run(capsys, "watch", job["id"], "--json")
    assert code == 1 and json.loads(out.splitlines()[-1])["state"] == "cancelled"


def test_probe_runs_the_collective_benchmark_through_the_api(served, capsys):
    code, out, _ = run(capsys, "probe", "--tiers", "inter_dc", "--max-mb", "2", "--json")
    assert code == 0 and served.probes == [(("inter_dc",), 2 * 2**20)]
    assert json.loads(out)["tiers"][0]["summary"]["bandwidth_gbps"] == 0.62
    code, out, _ = run(capsys, "probe", "--tiers", "inter_dc")
    assert code == 0 and "dc-a ↔ dc-b" in out and "10.500" in out and "0.620" in out
    with pytest.raises(SystemExit):  # argparse refuses an unknown tier before anything is sent
        run(capsys, "probe", "--tiers", "wan")
    assert len(served.probes) == 2


def test_probe_compute_measures_a_job_files_model_through_the_api(served, capsys, tmp_path):
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(spec(training={"micro_batch": 1})))
    code, out, _ = run(capsys, "probe", "--compute", str(job_file), "--json")
    assert code == 0 and served.probes == [(("compute", model_preset("nano").d_model), 1)] and json.loads(out)["flops"] == 2.5e9
    code, out, _ = run(capsys, "probe", "--compute", str(job_file))
    assert code == 0 and "2.50 GFLOP/s per worker slot (median of 2; 2.00–3.00)" in out and "4.0 ms" in out
    job_file.write_text(json.dumps(spec(training={"micro_batch": 0})))  # a bad spec: 422, nothing measured
    code, _, err = run(capsys, "probe", "--compute", str(job_file))
    assert code == 1 and "micro_batch" in err and len(served.probes) == 2


def test_friendly_errors(served, capsys, monkeypatch):
    code, _, err = run(capsys, "get", "nope")
    assert code == 1 and err.startswith("error: no job with id 'nope'")
    monkeypatch.setenv("MERIDIAN_TOKEN", "mrd_wrong")
    code, _, err = run(capsys, "ls")
    assert code == 1 and "not valid" in err
    code, _, err = run(capsys, "ls", "--url", "http://127.0.0.1:9")
    assert code == 1 and "cannot reach the Meridian service at http://127.0.0.1:9" in err and "Traceback" not in err
    code, _, err = run(capsys, "logs", "x", "-f", "--url", "http://127.0.0.1:9")
    assert code == 1 and "cannot reach" in err


def test_with_json_an_error_is_the_problem_on_stdout_and_the_line_on_stderr(served, capsys, tmp_path):
    # The service's problem as it sent it: what a script needs to act (type, status, request id, field errors).
    code, out, err = run(capsys, "get", "nope", "--json")
    problem = json.loads(out)["error"]
    assert code == 1 and err.startswith("error: no job with id 'nope'")
    assert problem["type"] == "urn:meridian:problem:job-not-found" and problem["status"] == 404
    assert problem["detail"] in err and problem["request_id"] and problem["instance"] == "/v1/jobs/nope"
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(spec(training={"micro_batch": 0})))
    code, out, _ = run(capsys, "submit", str(job_file), "--json")
    problem = json.loads(out)["error"]
    assert code == 1 and problem["status"] == 422 and "micro_batch" in {e["field"].split(".")[-1] for e in problem["errors"]}
    assert json.loads(run(capsys, "ls", "--json")[1])["count"] == 0  # nothing was queued
    # Errors on this side have the same shape, without a status.
    code, out, err = run(capsys, "ls", "--json", "--url", "http://127.0.0.1:9")
    assert code == 1 and json.loads(out) == {"error": {
        "type": "urn:meridian:problem:service-unreachable", "title": "Service unreachable", "detail": err[7:].strip()}}
    code, out, err = run(capsys, "submit", str(tmp_path / "missing.json"), "--json")
    assert code == 2 and json.loads(out)["error"]["type"] == "urn:meridian:problem:invalid-spec-file"
    assert "missing.json" in json.loads(out)["error"]["detail"] and "missing.json" in err
    # Without --json, stdout stays empty.
    assert run(capsys, "get", "nope")[1] == ""


def test_every_example_job_file_is_a_valid_spec():
    from pathlib import Path

    from meridian.api.schemas import JobSpec
    from meridian.cli.main import load_spec

    files = sorted(p for p in (Path(__file__).parents[1] / "examples").iterdir() if p.suffix in (".json", ".yaml"))
    assert len(files) >= 2
    for path in files:
        JobSpec.model_validate(load_spec(str(path)))  # raises naming the field if an example went stale


def test_serve_storage_puts_checkpoints_on_the_given_path_and_refuses_what_it_cannot_use(tmp_path, capsys, monkeypatch):
    from meridian.service.core import ServiceConfig

    shared = tmp_path / "shared"
    assert ServiceConfig(data_dir=str(tmp_path), storage=str(shared)).checkpoint_root == str(shared.resolve())
    assert ServiceConfig(data_dir=str(tmp_path)).checkpoint_root == str((tmp_path / "checkpoints").resolve())
    monkeypatch.setenv("MERIDIAN_TOKEN_FILE", str(tmp_path / "tokens.json"))
    for bad, why in (("nosuch://bucket/ckpt", "knows no scheme"), ("relative/dir", "absolute path")):
        assert main(["serve", "--data-dir", str(tmp_path), "--storage", bad]) == 2
        assert why in capsys.readouterr().err


def test_get_prints_what_an_armed_look_ahead_decided(served, capsys, tmp_path, store):
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(spec(name="armed")))
    code, out, _ = run(capsys, "submit", str(job_file), "--json")
    job_id = json.loads(out)["id"]
    decided = "Sync at epoch 1: exact sync kept: exact sync left 1.0 ms a step waiting for the sync (1% of 100.0 ms)"
    # past the first page of events (a re-formed epoch decides again, long after the job began)
    filler = [JobEvent(kind=EventKind.WAITING, message=f"event {i}", time=1.0) for i in range(1500)]
    store.record_poll(job_id, records=[], events=filler)
    raw_event(store, job_id, "sync_decided", decided, {"lookahead": False})
    code, out, _ = run(capsys, "get", job_id)
    assert code == 0 and f"  sync decided    {decided}" in out.splitlines()
    code, out, _ = run(capsys, "get", job_id, "--json")
    assert "sync decided" not in out and json.loads(out)["id"] == job_id  # --json prints the job as it is


def test_watch_follows_the_job_over_its_event_stream_and_reads_the_job_only_at_its_ends(served, capsys, monkeypatch):
    import threading

    from fakes import step_record

    from meridian.api.client import Client

    supervisor = served.supervisor
    job = submit(supervisor, owner="dana", training={"steps": 3})  # straight to the supervisor, no HTTP
    supervisor.tick()
    runner = supervisor.launcher.runners[job]
    reads = []
    real_job = Client.job
    monkeypatch.setattr(Client, "job", lambda self, job_id: reads.append(job_id) or real_job(self, job_id))
    monkeypatch.setattr("meridian.service.supervision.supervisor.PROGRESS_EVENT_EVERY_S", 0.0)  # every poll's

    def train():
        time.sleep(1.0)  # the watch is following by now
        runner.state = "running"
        for step in (1, 2, 3):
            runner.push("record", step_record(step, 3, 5.0 - step))
            supervisor.tick()
            time.sleep(0.6)
        runner.state = "succeeded"
        supervisor.tick()

    trainer = threading.Thread(target=train)
    trainer.start()
    code, out, _ = run(capsys, "watch", job, "--json", "--timeout", "60")
    trainer.join()
    updates = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and updates[-1]["state"] == "succeeded"
    assert [u["progress"]["step"] for u in updates if u["state"] == "running" and u["progress"].get("step")] == [1, 2, 3]
    assert len(reads) == 2, f"the watch read the job {len(reads)} times: at its start and its end only"


def test_serve_on_a_port_in_use_is_refused_before_anything_starts(tmp_path, capsys):
    """Refused at once, naming the port and what to do: uvicorn's own error came after an embedded cluster's start
    and after the line saying where the API listens, so a tutorial's wait loop found some other service there."""
    import socket

    for listen_on in ("127.0.0.1", "0.0.0.0"):
        with socket.socket() as other:
            other.bind((listen_on, 0))
            other.listen()
            port = other.getsockname()[1]
            started = time.monotonic()
            code = main(["serve", "--data-dir", str(tmp_path), "--port", str(port), "--local-datacenters", "dc-a:1"])
            err = capsys.readouterr().err
        assert code == 2 and f"port {port} on 127.0.0.1 is in use" in err and "--port N" in err, err
        assert "MERIDIAN_URL=http://127.0.0.1:N" in err and time.monotonic() - started < 10
        assert not (tmp_path / "meridian.db").exists()  # the service did not start
