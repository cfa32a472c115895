"""data.source is checked against the service's data roots at submit (issue 19): realpath, regular files
only, a byte cap, and the same answer for a refused path whether or not it exists; workers open regular
files only (a named pipe must not hang them)."""

from __future__ import annotations

import os
import threading
from dataclasses import replace

import pytest
from fakes import FakeService, spec
from fastapi.testclient import TestClient

from meridian.api.app import create_app
from meridian.service.jobs import JobRequest
from meridian.workers.contracts.config import DataConfig
from meridian.workers.contracts.model_config import model_preset
from meridian.workers.data.text import load_text


def admit(access, source, max_bytes=2048):
    from meridian.service.errors import InvalidJob  # noqa: F401 - what a refusal raises

    return access.check(DataConfig(source=source, max_bytes=max_bytes))


@pytest.fixture
def roots(tmp_path):
    from meridian.service.data_access import DataAccess

    root = tmp_path / "data"
    root.mkdir()
    (root / "text.txt").write_text("hello " * 100)
    outside = tmp_path / "secret.txt"
    outside.write_text("secret")
    (root / "link.txt").symlink_to(outside)
    os.mkfifo(root / "pipe")
    (root / "dir").mkdir()
    return DataAccess.for_roots([str(root)], max_bytes=10_000), root, outside


def test_a_file_under_a_root_is_admitted_resolved(roots):
    access, root, _ = roots
    assert admit(access, str(root / "dir" / ".." / "text.txt")).source == os.path.realpath(root / "text.txt")
    assert admit(access, "builtin:python-reference").source == "builtin:python-reference"


@pytest.mark.parametrize("where", ["outside", "missing_outside", "dotdot", "symlink_out", "relative", "fifo",
                                   "directory", "missing_inside", "etc_shadow"])
def test_anything_else_is_refused_without_saying_whether_it_exists(roots, where):
    from meridian.service.errors import InvalidJob

    access, root, outside = roots
    source = {"outside": str(outside), "missing_outside": str(outside) + ".nope",
              "dotdot": str(root / ".." / "secret.txt"), "symlink_out": str(root / "link.txt"),
              "relative": "data/text.txt", "fifo": str(root / "pipe"), "directory": str(root / "dir"),
              "missing_inside": str(root / "nope.txt"), "etc_shadow": "/etc/shadow"}[where]
    with pytest.raises(InvalidJob) as refused:
        admit(access, source)
    message = str(refused.value).replace(repr(source), "SOURCE")
    assert message.startswith("data.source SOURCE is not a readable regular file under this service's data roots")
    assert "No such file" not in message and "Permission" not in message


def test_max_bytes_over_the_cap_is_refused(roots):
    from meridian.service.errors import InvalidJob

    access, root, _ = roots
    with pytest.raises(InvalidJob, match="over this service's limit of 10000"):
        admit(access, str(root / "text.txt"), max_bytes=10**10)


def test_submit_outside_the_roots_is_a_422_and_the_job_keeps_the_resolved_path(store, supervisor, cluster_view, roots):
    access, root, outside = roots
    supervisor.data_access = replace(access, max_bytes=8_000_000)
    with TestClient(create_app(FakeService(store, supervisor, cluster_view).config,
                               service=FakeService(store, supervisor, cluster_view)),
                    base_url="http://127.0.0.1") as client:
        answers = [client.post("/v1/jobs", json=spec(data={"source": src})) for src in (str(outside), "/etc/shadow",
                                                                                      "/no/such/file")]
        assert [r.status_code for r in answers] == [422, 422, 422]
        details = {r.json()["detail"].split("' is not", 1)[1] for r in answers}
        assert len(details) == 1  # the same words for a file that exists and one that does not
        ok = client.post("/v1/jobs", json=spec(data={"source": str(root / "dir" / ".." / "text.txt")}))
        assert ok.status_code == 201
    assert store.get_job(ok.json()["id"]).request.data.source == os.path.realpath(root / "text.txt")


def test_the_default_service_admits_only_the_builtin_corpus(supervisor):
    from meridian.service.errors import InvalidJob

    request = JobRequest(name="j", model=model_preset("nano"), steps=3, global_batch=4, micro_batch=2,
                         data=DataConfig(source="/etc/passwd"))
    with pytest.raises(InvalidJob):
        supervisor.submit(request, {})


def test_a_worker_refuses_a_named_pipe_instead_of_hanging(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    outcome = []

    def read():
        try:
            load_text(DataConfig(source=str(fifo)))
        except ValueError as e:
            outcome.append(str(e))

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(5)
    if t.is_alive():  # unblock the reader of the old code, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
        pytest.fail("load_text blocked on a named pipe")
    assert outcome and "not a regular file" in outcome[0]


def test_a_nul_byte_in_a_data_path_is_a_422_like_any_other_refused_path(store, supervisor, cluster_view, roots):
    """``realpath`` raises ValueError on a NUL byte: it was a 500 for data.source and data.dataset."""
    access, root, _ = roots
    supervisor.data_access = access
    fake = FakeService(store, supervisor, cluster_view)
    with TestClient(create_app(fake.config, service=fake), base_url="http://127.0.0.1") as client:
        answers = {what: client.post("/v1/jobs", json=spec(data=data, model={"preset": "nano", "vocab_size": 512}))
                   for what, data in (("source", {"source": f"{root}/text.txt\x00.png", "max_bytes": 2048}),
                                      ("dataset", {"dataset": f"{root}/dir\x00"}),
                                      ("blend", {"blend": [{"dataset": f"{root}\x00/dir"}]}))}
        checkpoint = client.post("/v1/jobs", json=spec(model={"init_from": f"{root}/hf\x00"}))
    assert {w: r.status_code for w, r in answers.items()} == dict.fromkeys(answers, 422)
    assert answers["source"].json()["detail"].endswith("is not a readable regular file under this service's data "
                                                       f"roots ({root}); copy the text there, or start the service "
                                                       "with `meridian serve --data-root PATH`. Built-in: "
                                                       "builtin:python-reference")
    for what in ("dataset", "blend"):
        assert "is not a prepared dataset directory under this service's data roots" in answers[what].json()["detail"]
    assert checkpoint.status_code == 422 and "model.init_from" in checkpoint.json()["detail"]
