"""The jobs' checkpoint storage is proven one store for every node a job runs on (and the service): each node's
worker writes a token through it and the others read it back. The verdict is decided without Ray; the slow test
runs two Ray nodes whose storage folders differ (one node in a mount namespace of its own, a tmpfs over the
folder), and a job across both is refused with the fix while one on a single node is admitted."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from meridian.service.cluster.storage_proof import SERVICE, SharedStorage, StorageNotShared, Verdict, verdict


def test_a_storage_every_reader_sees_is_shared():
    v = verdict("/s", {"a": "n-a", "b": "n-b"}, {"a": {"n-a": True, "n-b": True}, "b": {"n-a": True, "n-b": True},
                                                  SERVICE: {"n-a": True, "n-b": True}}, {})
    assert v.shared and v.nodes == ("a", "b") and v.unseen == ()


def test_tokens_a_reader_did_not_see_and_a_node_that_failed_make_it_not_shared_with_the_fix():
    v = verdict("/ckpt", {"aaaa": "n-a", "bbbb": "n-b"},
                {"aaaa": {"n-a": True, "n-b": False}, "bbbb": {"n-a": False, "n-b": True},
                 SERVICE: {"n-a": True, "n-b": False}}, {"cccc": "PermissionError: denied"})
    assert not v.shared
    assert v.unseen == (("aaaa", "bbbb"), ("bbbb", "aaaa"), ("bbbb", SERVICE))
    text = v.message()
    assert "the checkpoint storage /ckpt is not shared" in text and "node cccc could not use it (PermissionError" in text
    assert "the service did not see what node(s) bbbb wrote" in text
    assert "meridian serve --storage s3://BUCKET/PREFIX" in text and "mounted at the same path on every node" in text


def test_nodes_proven_once_are_not_asked_again_and_a_new_one_is_proven_beside_one_of_them():
    asked = []

    def prove(root, nodes):
        asked.append(list(nodes))
        return Verdict(root=root, nodes=tuple(nodes), unseen=(("c", "a"),) if "c" in nodes else ())

    shared = SharedStorage("/s", prove=prove)
    shared.require(["a", "b"])
    shared.require(["b", "a"])
    assert asked == [["a", "b"]]
    with pytest.raises(StorageNotShared, match="not shared"):
        shared.require(["a", "c"])
    assert asked[-1] == ["a", "c"] and shared.proven == {"a", "b"} and shared.last is not None


@pytest.mark.parametrize("where", ["local", "s3"])
def test_tokens_read_back_through_the_storage_and_are_removed(tmp_path, where):
    from s3_env import moto_s3

    from meridian.workers.state import storage

    with moto_s3() if where == "s3" else contextlib.nullcontext(str(tmp_path / "ckpt")) as root:
        names = [storage.write_token(root, "n0nce", node) for node in ("a" * 56, "b" * 56)]
        assert storage.read_tokens(root, "n0nce", names) == dict.fromkeys(names, True)
        assert storage.read_tokens(root, "other", names) == dict.fromkeys(names, False)  # another proof's nonce
        storage.remove_tokens(root, names)
        assert storage.read_tokens(root, "n0nce", names) == dict.fromkeys(names, False)
        assert storage.list_files(storage.join(root, storage.PROOF_FOLDER)) == {}


# -- two Ray nodes with separate storage folders ----------------------------------------------------------
@contextlib.contextmanager
def node_with_its_own_folder(address: str, folder: str, dc: str):
    """``ray start`` a node labelled ``dc`` in a mount namespace of its own, where ``folder`` is a fresh tmpfs:
    its workers see another folder at the same path. Yields its node id; its processes are killed after."""
    import ray

    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) for a mount namespace")
    before = {n["NodeID"] for n in ray.nodes()}
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    script = (f'mount -t tmpfs tmpfs "{folder}" && exec "{ray_bin}" start --address {address} --num-cpus 1 '
              f"--num-gpus 0 --labels datacenter={dc} --disable-usage-stats --block")
    proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    node_id = None
    try:
        deadline = time.monotonic() + 60
        while node_id is None:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:] if proc.stderr else ""
            assert time.monotonic() < deadline, "the namespaced node did not join within 60 s"
            new = [n for n in ray.nodes() if n["Alive"] and n["NodeID"] not in before]
            node_id = new[0]["NodeID"] if new else None
            time.sleep(0.5)
        yield node_id
    finally:
        from meridian.lab.lab import kill_ray_node

        if node_id is not None:
            with contextlib.suppress(Exception):
                kill_ray_node(node_id)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@pytest.mark.slow
def test_two_nodes_whose_storage_folders_differ_are_found_not_shared_and_the_job_is_refused_with_the_fix(tmp_path):
    import ray
    from fakes import spec
    from ray_env import local_cluster, service_client

    folder = tmp_path / "storage"
    folder.mkdir()
    with local_cluster(("dc-a",)) as cluster:
        ray.init(address=cluster.address)
        try:
            with node_with_its_own_folder(cluster.address, str(folder), "dc-b") as other:
                ray.shutdown()
                with service_client(cluster.address, str(tmp_path / "data"), storage=str(folder)) as api:
                    both = spec(name="both", topology={"datacenters": ["dc-a", "dc-b"]})
                    r = api.post("/v1/jobs", json=both)
                    assert r.status_code == 409, r.text
                    detail = r.json()["detail"]
                    assert f"the checkpoint storage {folder} is not shared" in detail, detail
                    assert f"node {other[:12]}" in detail and "meridian serve --storage s3://" in detail
                    assert api.get("/v1/jobs").json()["count"] == 0  # refused before anything was stored
                    assert "is not shared" in api.get("/v1/cluster").json()["storage"]["not_shared"]
                    one = spec(name="one", topology={"datacenters": ["dc-a"]},
                               training={"steps": 2, "global_batch": 2, "micro_batch": 1})
                    r = api.post("/v1/jobs", json=one)
                    assert r.status_code == 201, r.text  # dc-a's node shares the folder with the service
        finally:
            ray.shutdown()
    assert not any(p.name.startswith(".meridian-shared") and any(p.iterdir()) for p in folder.iterdir())
