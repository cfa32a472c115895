"""``resume_from`` at submit, through the HTTP API over a real store and a fake cluster: the checkpoint a job
names is found (an ended job of the same owner, or a location under the service's roots), its ``meridian.json``
read, and the job refused with a 422 naming what differs from it, unless the spec resets that part; an
accepted job's training config carries the checkpoint's step folder, step and fingerprint to its workers
(what they do with it: ``test_resume_from.py``)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from conftest import TopologyBox
from fakes import FakeLauncher, FakeService, spec, topology
from fastapi.testclient import TestClient

from meridian.api.app import create_app
from meridian.api.schemas import JobSpec
from meridian.service.data_access import DataAccess
from meridian.service.errors import InvalidJob
from meridian.service.supervision.supervisor import Supervisor
from meridian.workers.contracts.config import ResetPart
from meridian.workers.contracts.fingerprint import fingerprint

TRAINING = {"steps": 8, "global_batch": 4, "micro_batch": 2}


@pytest.fixture
def api(store, tmp_path):
    (tmp_path / "data").mkdir()
    supervisor = Supervisor(store, FakeLauncher(), TopologyBox(topology(dc_a=2, dc_b=2)),
                            checkpoint_root=str(tmp_path / "ckpt"),
                            data_access=DataAccess.for_roots([str(tmp_path / "data"), "s3://bucket/ckpts"]))
    fake = FakeService(store, supervisor, supervisor.read_topology)
    with TestClient(create_app(fake.config, service=fake), base_url="http://127.0.0.1") as client:
        yield client, supervisor


def write_checkpoint(directory: str, step: int, fp: dict) -> str:
    """A complete step folder as far as the service reads one (its ``meridian.json``; no tensors are read at
    submit) and the ``latest`` pointer."""
    folder = os.path.join(directory, f"step-{step:08d}")
    os.makedirs(folder)
    with open(os.path.join(folder, "meridian.json"), "w") as f:
        json.dump({"format": "meridian.dcp/1", "step": step, "adam_step": step, "fingerprint": fp, "shapes": {},
                   "diloco": None}, f)
    with open(os.path.join(directory, "latest"), "w") as f:
        f.write(f"step-{step:08d}")
    return folder


def ended_job_with_a_checkpoint(client, supervisor, step=4):
    a = client.post("/v1/jobs", json=spec(name="a", training=TRAINING, checkpoint={"interval_steps": 2})).json()
    client.delete(f"/v1/jobs/{a['id']}")
    config = supervisor.store.get_job(a["id"]).resolved.config
    return a["id"], write_checkpoint(config.checkpoint_dir, step, fingerprint(config))


def detail(r):
    assert r.status_code == 422, r.text
    return r.json()["detail"]


def test_a_job_resumed_from_an_ended_job_carries_its_newest_checkpoint_to_the_workers(api):
    client, supervisor = api
    a = client.post("/v1/jobs", json=spec(name="a", training=TRAINING, checkpoint={"interval_steps": 2})).json()
    resume = {"resume_from": {"job": a["id"]}}
    assert "is still queued and still replaces its checkpoints" in detail(
        client.post("/v1/jobs", json=spec(training=TRAINING, **resume)))
    client.delete(f"/v1/jobs/{a['id']}")
    assert "holds no complete checkpoint" in detail(client.post("/v1/jobs", json=spec(training=TRAINING, **resume)))
    config = supervisor.store.get_job(a["id"]).resolved.config
    folder = write_checkpoint(config.checkpoint_dir, 4, fingerprint(config))

    r = client.post("/v1/jobs", json=spec(training=TRAINING, topology={"workers_per_datacenter": 1}, **resume))
    assert r.status_code == 201, r.text
    b = supervisor.store.get_job(r.json()["id"]).resolved.config
    assert b.resume is not None and (b.resume.checkpoint, b.resume.step, b.resume.reset) == (folder, 4, ())
    assert json.loads(b.resume.fingerprint) == fingerprint(config) and b.resume.source == f"job {a['id']}"
    assert b.checkpoint_dir != config.checkpoint_dir and len(b.datacenters) == 2  # its own, in its own layout
    assert r.json()["spec"]["resume_from"] == {"job": a["id"], "checkpoint": None, "reset": []}


def test_what_differs_from_the_checkpoint_is_a_422_naming_it_unless_the_spec_resets_it(api, tmp_path):
    client, supervisor = api
    text = tmp_path / "data" / "other.txt"
    text.write_text("def other_corpus():\n    return 42\n" * 2000)
    a, _ = ended_job_with_a_checkpoint(client, supervisor)

    def submit(reset=(), **fields):
        body = spec(**{"training": TRAINING, **fields})
        return client.post("/v1/jobs", json={**body, "resume_from": {"job": a, "reset": list(reset)}})

    said = detail(submit(training={**TRAINING, "global_batch": 8, "seed": 3}))
    assert "global_batch differs (checkpoint 4, this job 8)" in said and "seed differs (checkpoint 0, this job 3)" in said
    assert 'resume_from.reset: ["data"]' in said and f"job {a}'s checkpoint of step 4" in said
    said = detail(submit(data={"source": str(text)}))
    assert f"data differs (checkpoint 'builtin:python-reference', this job '{text}')" in said and "data_pins" in said
    assert submit(["data"], data={"source": str(text)}).status_code == 201
    assert submit(["data"], training={**TRAINING, "global_batch": 8, "seed": 3}).status_code == 201
    for reset in ((), ["optimizer", "schedule", "data"]):  # no reset loads weights into another shape
        said = detail(submit(reset, model={"preset": "nano", "n_layers": 3}))
        assert "the model differs" in said and "give this job the checkpoint's model" in said
    assert "training.steps (4) must be above the step of the checkpoint it resumes from (4)" in detail(
        submit(training={**TRAINING, "steps": 4}))
    r = submit(["schedule"], training={**TRAINING, "steps": 4})
    assert r.status_code == 201 and supervisor.store.get_job(r.json()["id"]).resolved.config.resume.start_step == 0
    r = submit(["optimizer"])
    assert supervisor.store.get_job(r.json()["id"]).resolved.config.resume.reset == (ResetPart.OPTIMIZER,)


def test_another_owners_job_and_a_missing_one_get_the_same_answer(api):
    client, supervisor = api
    a, _ = ended_job_with_a_checkpoint(client, supervisor)
    answers = []
    for job_id, owner in ((a, "mallory"), ("0123456789ab", "")):
        request = JobSpec.model_validate(spec(training=TRAINING, resume_from={"job": job_id})).to_request(owner)
        with pytest.raises(InvalidJob) as e:
            supervisor.submit(request, {})
        answers.append(str(e.value).replace(job_id, "ID"))
    assert answers[0] == answers[1] and "is not a job of yours" in answers[0]


def test_a_checkpoint_location_is_admitted_only_under_the_roots_and_says_nothing_of_others(api, tmp_path):
    client, supervisor = api
    _, folder = ended_job_with_a_checkpoint(client, supervisor)
    outside = tmp_path / "outside"
    shutil.copytree(os.path.dirname(folder), outside / "job")

    def submit(location):
        return client.post("/v1/jobs", json=spec(training=TRAINING, resume_from={"checkpoint": location}))

    there, missing = detail(submit(str(outside / "job"))), detail(submit(str(outside / "nothing")))
    assert there.replace("job", "X") == missing.replace("nothing", "X") and "not a directory under" in there
    for url in ("s3://other-bucket/ckpts/job", "s3://bucket/ckpts/../secrets", "http://169.254.169.254/latest"):
        said = detail(submit(url))
        assert "resume_from.checkpoint" in said and "is not under a URL root this service declares" in said
    # Under the data roots: a job's checkpoint directory (its newest step) or one step folder
    shutil.copytree(os.path.dirname(folder), tmp_path / "data" / "job")
    for location, step_folder in ((tmp_path / "data" / "job", folder), (tmp_path / "data" / "job" / "step-00000004",
                                                                        folder)):
        r = submit(str(location))
        assert r.status_code == 201, r.text
        resume = supervisor.store.get_job(r.json()["id"]).resolved.config.resume
        assert resume.checkpoint == str(tmp_path / "data" / "job" / os.path.basename(step_folder)) and resume.step == 4


def test_the_spec_names_one_source_and_known_parts_to_reset(api):
    client, _ = api
    for resume, field in (({"job": "abc", "checkpoint": "/x"}, "exactly one of resume_from.job"),
                          ({}, "exactly one of resume_from.job"),
                          ({"job": "abc", "reset": ["weights"]}, "reset"),
                          ({"job": "abc", "reset": ["data", "data"]}, "names a part twice"),
                          ({"job": "../x"}, "job")):
        said = json.dumps(client.post("/v1/jobs", json=spec(resume_from=resume)).json())
        assert field in said and "resume_from" in said, said
