"""Datasets named by URL (``data.dataset: s3://bucket/prefix``, ``file:///path``), against moto's S3 server: a URL
is admitted only under a root the operator declared, refused in the same words whether or not anything is there;
each node reads it into a cache checked against the manifest's shard hashes, a damaged cached shard is fetched
again, a damaged stored one refused. The slow test trains a dataset in S3 across two datacenters through the
REST API, then a second job after a cached shard was corrupted."""

from __future__ import annotations

import hashlib
import os
import shutil
import time

import pytest
from s3_env import moto_s3

from meridian.api.schemas import JobSpec
from meridian.service.data_access import DataAccess
from meridian.service.errors import InvalidJob
from meridian.service.locations import NotUnderRoots, UrlRoot, admit_url
from meridian.workers.contracts.config import DataConfig
from meridian.workers.data.manifest import read_manifest
from meridian.workers.data.prepare import PrepareOptions, prepare
from meridian.workers.data.remote import cache_dir, local_copy
from meridian.workers.data.shards import make_dataset


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    from pydoc_data.topics import topics

    corpus = tmp_path_factory.mktemp("corpus") / "reference.txt"
    corpus.write_text("\n\n".join(topics[k] for k in sorted(topics)[:120]), encoding="utf-8")
    out = str(tmp_path_factory.mktemp("ds") / "ref")
    prepare([str(corpus)], out, PrepareOptions(train_tokenizer=True, vocab_size=300, val_fraction=0.1,
                                               shard_tokens=20_000), progress=False)
    return out


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def upload(directory: str, url: str) -> None:
    from fsspec.core import url_to_fs

    fs, root = url_to_fs(url)
    for name in os.listdir(directory):
        if not name.startswith("."):
            fs.put_file(os.path.join(directory, name), f"{root}/{name}")


def _spec(dataset: str) -> JobSpec:
    return JobSpec.model_validate({"name": "u", "model": {"preset": "nano", "vocab_size": 512},
                                   "data": {"dataset": dataset}, "training": {"steps": 2, "global_batch": 2,
                                                                               "micro_batch": 1}})


# -- the URL rule ---------------------------------------------------------------------------------------------
def test_a_url_is_admitted_only_at_or_under_a_declared_root_written_plainly():
    roots = [UrlRoot.parse("s3://Data-Bucket/corpora/"), UrlRoot.parse("https://mlflow.internal:5000/api")]
    assert admit_url("s3://data-bucket/corpora/web/v1/", roots, field="f", flag="--x") == "s3://data-bucket/corpora/web/v1"
    assert admit_url("s3://data-bucket/corpora", roots, field="f", flag="--x") == "s3://data-bucket/corpora"
    assert admit_url("https://mlflow.internal:5000/api/x", roots, field="f", flag="--x")
    refused = ["s3://data-bucket/corpora-other/x", "s3://data-bucket/corpora/../secrets", "s3://data-bucket/corpora/./x",
               "s3://data-bucket/corpora//x", "s3://other-bucket/corpora/x", "gs://data-bucket/corpora/x",
               "s3://data-bucket/corpora/%2e%2e/x", "s3://key:secret@data-bucket/corpora/x", "s3://data-bucket/corpora/x?v=1",
               "s3://data-bucket/corpora/x#y", "https://mlflow.internal:5001/api/x", "https://169.254.169.254/api",
               "s3://data-bucket/corpora/a b", "s3://data-bucket/corpora\\x", "s3:/data-bucket/corpora/x", "corpora/x"]
    for url in refused:
        with pytest.raises(NotUnderRoots, match="is not under a URL root this service declares") as e:
            admit_url(url, roots, field="data", flag="--data-root")
        assert "--data-root" in str(e.value), url
    with pytest.raises(ValueError, match="root 's3://b/x/../y'"):
        UrlRoot.parse("s3://b/x/../y")


def test_admission_reads_an_s3_dataset_under_the_root_and_refuses_others_alike(dataset):
    with moto_s3() as bucket:
        upload(dataset, f"{bucket}/data/ref")
        access = DataAccess.for_roots([f"{bucket}/data"])
        request = access.admit(_spec(f"{bucket}/data/ref/").to_request())
        manifest = read_manifest(dataset)
        assert request.data.dataset == f"{bucket}/data/ref"
        assert [(p.path, p.manifest_key) for p in request.data.pins] == [(f"{bucket}/data/ref", manifest.key)]
        # Under the root but not a dataset: said plainly (the operator allowed that prefix).
        with pytest.raises(InvalidJob, match="is not a prepared dataset"):
            access.admit(_spec(f"{bucket}/data/none").to_request())
        # Outside every root: the same words whether or not the dataset is there, and nothing is read.
        upload(dataset, f"{bucket}/private/ref")
        answers = []
        for url in (f"{bucket}/private/ref", f"{bucket}/private/none", "s3://another-bucket/x"):
            with pytest.raises(InvalidJob) as e:
                access.admit(_spec(url).to_request())
            answers.append(str(e.value).replace(url, "URL"))
        assert answers[0] == answers[1] == answers[2] and "not under a URL root" in answers[0]
        # A stored shard cut short is refused at admission, naming it.
        from fsspec.core import url_to_fs

        fs, root = url_to_fs(f"{bucket}/data/ref")
        shard = read_manifest(dataset).train.shards[0].file
        fs.pipe_file(f"{root}/{shard}", b"short")
        with pytest.raises(InvalidJob, match=f"shard {shard} has 5 bytes"):
            access.admit(_spec(f"{bucket}/data/ref").to_request())


def test_a_file_url_is_a_path_under_the_data_roots(dataset, tmp_path):
    inside = DataAccess.for_roots([os.path.dirname(dataset)])
    request = inside.admit(_spec(f"file://{dataset}").to_request())
    assert request.data.dataset == f"file://{os.path.realpath(dataset)}"
    with pytest.raises(InvalidJob, match="not a prepared dataset directory under this service's data roots"):
        DataAccess.for_roots([str(tmp_path)]).admit(_spec(f"file://{dataset}").to_request())


# -- the node's cache -----------------------------------------------------------------------------------------
def test_a_node_caches_the_dataset_and_fetches_a_damaged_shard_again(dataset, cache):
    manifest = read_manifest(dataset)
    with moto_s3() as bucket:
        url = f"{bucket}/data/ref"
        upload(dataset, url)
        pin = DataAccess.for_roots([f"{bucket}/data"]).admit(_spec(url).to_request()).data.pins[0]
        first = local_copy(url, pin)
        names = [sh.file for s in (manifest.train, manifest.val) for sh in s.shards]
        assert first.directory == cache_dir(url, manifest.key) and first.directory.startswith(str(cache))
        assert sorted(first.fetched) == sorted(names) and first.refetched == ()
        for name in names:
            with open(os.path.join(dataset, name), "rb") as a, open(os.path.join(first.directory, name), "rb") as b:
                assert a.read() == b.read(), name
        assert local_copy(url, pin) == type(first)(first.directory)  # all there and whole: nothing fetched

        damaged = os.path.join(first.directory, names[0])
        with open(damaged, "r+b") as f:  # one byte flipped in place: same size
            b = f.read(1)
            f.seek(0)
            f.write(bytes([b[0] ^ 0xFF]))
        again = local_copy(url, pin)
        assert again.refetched == (names[0],) and again.fetched == ()
        with open(damaged, "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == manifest.train.shards[0].sha256

        # The training process trusts an unchanged copy (its stamp), and reads the same samples as from the path.
        data = DataConfig(dataset=url, pins=(pin,))
        here = make_dataset(DataConfig(dataset=dataset), 32, 0).batch(0, 4)
        there = make_dataset(data, 32, 0).batch(0, 4)
        assert all((a == b).all() for a, b in zip(here, there, strict=True))

        # A stored shard whose bytes changed (same size) is refused, naming it; the cache keeps nothing of it.
        from fsspec.core import url_to_fs

        fs, root = url_to_fs(url)
        with open(os.path.join(dataset, names[1]), "rb") as f:
            body = bytearray(f.read())
        body[0] ^= 0xFF
        fs.pipe_file(f"{root}/{names[1]}", bytes(body))
        os.unlink(os.path.join(first.directory, names[1]))
        with pytest.raises(ValueError, match=f"shard {names[1]} as fetched hashes to .*damaged or changed copy"):
            local_copy(url, pin)
        assert not os.path.exists(os.path.join(first.directory, names[1]))


def test_a_dataset_prepared_again_after_admission_is_refused_by_the_node(dataset, cache, tmp_path):
    with moto_s3() as bucket:
        url = f"{bucket}/data/ref"
        upload(dataset, url)
        pin = DataAccess.for_roots([f"{bucket}/data"]).admit(_spec(url).to_request()).data.pins[0]
        other = str(tmp_path / "other")
        shutil.copytree(dataset, other)
        prepare([_text(tmp_path)], other, PrepareOptions(train_tokenizer=True, vocab_size=300, val_fraction=0.1),
                progress=False)
        upload(other, url)
        with pytest.raises(ValueError, match="was prepared again"):
            local_copy(url, pin)


def test_a_node_that_cannot_reach_the_dataset_says_which_node_and_why(dataset, cache):
    from s3_env import aws_env

    from meridian.workers.data.remote import DataUnreachable, cache_url_datasets

    with moto_s3() as bucket:
        url = f"{bucket}/data/ref"
        upload(dataset, url)
        data = DataAccess.for_roots([f"{bucket}/data"]).admit(_spec(url).to_request()).data
        events = []
        cache_url_datasets(data, worker_id="w1", node_id="ab" * 28, datacenter="dc-a", host="h1",
                           on_event=lambda *e: events.append(e))
        assert [e[0] for e in events] == ["dataset_cached"] and events[0][2]["datacenter"] == "dc-a"
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    with aws_env(AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="y", AWS_DEFAULT_REGION="us-east-1",
                 AWS_ENDPOINT_URL=f"http://127.0.0.1:{closed}", AWS_MAX_ATTEMPTS="1"), \
            pytest.raises(DataUnreachable, match=r"node abababababab \(h2, datacenter dc-b\) cannot read the job's "
                                                 r"dataset s3://.*Could not connect to the endpoint"):
        cache_url_datasets(data, worker_id="w2", node_id="ab" * 28, datacenter="dc-b", host="h2",
                           on_event=lambda *e: None)


def _text(tmp_path) -> str:
    path = tmp_path / "other.txt"
    path.write_text("\n\n".join(f"paragraph {i} of another text, " * 20 for i in range(200)))
    return str(path)


# -- through the service, on an embedded Ray cluster ----------------------------------------------------------
@pytest.mark.slow
def test_a_dataset_in_s3_trains_across_two_datacenters_and_a_corrupted_cached_shard_is_fetched_again(
        dataset, tmp_path, monkeypatch):
    from fakes import spec
    from ray_env import local_cluster, service_client

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # before the cluster: its workers inherit it
    manifest = read_manifest(dataset)
    with moto_s3() as bucket:
        url = f"{bucket}/corpora/ref"
        upload(dataset, url)
        with local_cluster(("dc-a", "dc-b")) as cluster, \
                service_client(cluster.address, str(tmp_path / "data"), data_roots=(f"{bucket}/corpora",)) as api:

            def run(name: str) -> tuple[dict, list[dict]]:
                body = spec(name=name, model={"preset": "nano", "vocab_size": 512, "seq_len": 32}, data={"dataset": url},
                            training={"steps": 3, "global_batch": 4, "micro_batch": 2},
                            topology={"datacenters": ["dc-a", "dc-b"]})
                r = api.post("/v1/jobs", json=body)
                assert r.status_code == 201, r.text
                job_id, deadline = r.json()["id"], time.monotonic() + 240
                while (job := api.get(f"/v1/jobs/{job_id}").json())["state"] not in ("succeeded", "failed", "cancelled"):
                    assert time.monotonic() < deadline, f"job did not finish in 240 s: {job['state']}"
                    time.sleep(0.3)
                assert job["state"] == "succeeded", (job["message"], api.get(f"/v1/jobs/{job_id}/logs").text[-3000:])
                events = api.get(f"/v1/jobs/{job_id}/events").json()["events"]
                return job, [e for e in events if e["kind"] == "dataset_cached"]

            job, cached = run("s3-data")
            dcs = {p["datacenter"] for p in job["placement"]}
            assert dcs == {"dc-a", "dc-b"} and job["progress"]["step"] == 3
            assert len(cached) == 2 and {e["data"]["datacenter"] for e in cached} == {"dc-a", "dc-b"}
            names = sorted(sh.file for s in (manifest.train, manifest.val) for sh in s.shards)
            # One host, one cache: the first worker fetched every shard, the other found them whole.
            assert sorted(f for e in cached for f in e["data"]["fetched"]) == names

            directory = cache_dir(url, manifest.key)
            shard = manifest.train.shards[0].file
            with open(os.path.join(directory, shard), "r+b") as f:
                f.write(b"\0\0\0\0")
            _, cached = run("s3-data-again")
            assert sorted(f for e in cached for f in e["data"]["refetched"]) == [shard]
            assert sum(len(e["data"]["fetched"]) for e in cached) == 0
            with open(os.path.join(directory, shard), "rb") as f:
                assert hashlib.sha256(f.read()).hexdigest() == manifest.train.shards[0].sha256
