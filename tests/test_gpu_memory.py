"""The planner fits layouts into each GPU node's memory as read on the node (``nvidia-smi``), not a 40 GiB guess:
an 80 GB GPU takes what the guess refused, a 24 GB one refuses what the guess let through."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fakes import node

from meridian.service.cluster import gpu_memory
from meridian.service.cluster.gpu_memory import NodeGpuMemory, parse_memory_total, read_here
from meridian.service.cluster.topology import ClusterTopology
from meridian.service.errors import MeridianError
from meridian.service.jobs import JobRequest, TopologyRequest
from meridian.service.planning.figures import figures_for
from meridian.workers.contracts.config import ActivationCheckpointing
from meridian.workers.contracts.model_config import model_preset

MIB = 2**20
H100, RTX_4090 = 81559, 24564  # MiB, as nvidia-smi reports them


def fake_nvidia_smi(folder: Path, out: str, rc: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    exe = folder / "nvidia-smi"
    # It answers only the query read_here makes (anything else exits 9).
    exe.write_text('#!/bin/sh\n[ "$1 $2" = "--query-gpu=memory.total --format=csv,noheader,nounits" ] || exit 9\n'
                   f"printf '{out}'\nexit {rc}\n")
    exe.chmod(0o755)
    return folder


def test_memory_total_is_parsed_per_gpu_in_bytes():
    assert parse_memory_total(f"{H100}\n{RTX_4090}\n[N/A]\n\n") == [H100 * MIB, RTX_4090 * MIB]


def test_a_node_reads_its_smallest_gpu_and_nothing_without_nvidia_smi(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(fake_nvidia_smi(tmp_path / "two", f"{H100}\\n{RTX_4090}\\n")))
    assert read_here() == RTX_4090 * MIB
    monkeypatch.setenv("PATH", str(fake_nvidia_smi(tmp_path / "broken", "NVIDIA-SMI has failed\\n", rc=9)))
    assert read_here() is None
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert read_here() is None


def test_each_live_gpu_node_is_read_once_and_one_without_a_reading_again_later():
    asked: list[list[str]] = []

    def read(ids):
        asked.append(sorted(ids))
        return {i: (None if i == "amd" else H100 * MIB) for i in ids}

    now = [0.0]
    cache = NodeGpuMemory(read, clock=lambda: now[0])
    topo = ClusterTopology((node("g1", "dc-a", gpus=1), node("g2", "dc-a", gpus=8), node("cpu", "dc-a"),
                            node("amd", "dc-b", gpus=1), node("dead", "dc-b", gpus=1, alive=False)))
    assert cache(topo) == {"g1": H100 * MIB, "g2": H100 * MIB}
    now[0] = gpu_memory.RETRY_S - 1
    assert cache(topo) == {"g1": H100 * MIB, "g2": H100 * MIB}
    assert asked == [["amd", "g1", "g2"]]  # not the CPU node, not the dead one, and each only once
    now[0] = gpu_memory.RETRY_S
    cache(topo)
    assert asked == [["amd", "g1", "g2"], ["amd"]]  # the one without a reading, asked again


def _llama(micro_batch: int, dcs=("dc-a",)) -> JobRequest:
    # no recomputation, so what fits is decided by the memory alone
    return JobRequest(name="m", model=model_preset("llama-160m"), steps=2, global_batch=micro_batch,
                      micro_batch=micro_batch, topology=TopologyRequest(datacenters=list(dcs)),
                      activation_checkpointing=ActivationCheckpointing.NONE)


def test_figures_take_the_memory_read_on_every_node_else_say_it_is_guessed():
    topo = ClusterTopology((node("g1", "dc-a", gpus=1), node("g2", "dc-a", gpus=1)))
    fig, sources = figures_for(_llama(8), topo, None, {"g1": H100 * MIB, "g2": RTX_4090 * MIB})
    assert fig.device_memory_bytes == RTX_4090 * MIB and "GPU memory read on the nodes" in sources
    fig, sources = figures_for(_llama(8), topo, None, {"g1": H100 * MIB})
    assert fig.device_memory_bytes == 40 * 2**30
    assert any("guessed at 40 GiB (not read on 1 of 2 nodes" in s for s in sources)
    probed = {"compute": {"shape": {"flops": 1e14, "optimizer_step_s": 0.01, "device_memory_bytes": 16 * 2**30}}}
    fig, sources = figures_for(_llama(8), topo, probed, {"g1": H100 * MIB, "g2": H100 * MIB})
    assert fig.device_memory_bytes == 16 * 2**30  # a compute probe's reading is the device's own
    assert not any("GPU memory" in s for s in sources)


def test_the_supervisor_plans_with_the_memory_it_read(supervisor, cluster_view):
    cluster_view.topo = ClusterTopology((node("head", None, cpus=0), node("g", "dc-a", cpus=8, gpus=1)))
    big = _llama(40)  # ~57 GB a step on one GPU: over the 40 GiB guess, under an H100's 80 GB
    with pytest.raises(MeridianError, match=r"no layout fits in device memory \(40\.0 GB, a guess: no GPU node"):
        supervisor.plan(big)
    supervisor.gpu_memory = lambda topo: {"g": H100 * MIB}
    assert "GPU memory read on the nodes" in supervisor.plan(big).explanation
    supervisor.gpu_memory = lambda topo: {"g": RTX_4090 * MIB}
    supervisor.plan(_llama(8))  # ~14 GB: fits a 24 GB card
    with pytest.raises(MeridianError, match=r"no layout fits in device memory \(24\.0 GB\):"):
        supervisor.plan(_llama(20))  # ~30 GB: under the guess, over the card


@pytest.mark.slow
def test_the_service_reads_a_gpu_node_s_memory_on_the_node(tmp_path, monkeypatch):
    # A real Ray cluster whose node declares one GPU; its nvidia-smi is a script on the PATH the raylet inherits.
    from ray_env import service_client

    fake = fake_nvidia_smi(tmp_path / "bin", f"{H100}\\n")
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1, num_gpus=1, labels={"datacenter": "dc-a"})
        cluster.wait_for_nodes()
        with service_client(cluster.address, str(tmp_path / "svc")) as client:
            spec = {"name": "m", "model": {"preset": "llama-160m"},
                    "training": {"steps": 2, "global_batch": 24, "micro_batch": 24},
                    "topology": {"datacenters": ["dc-a"]}}  # fmt: skip
            r = client.post("/v1/plans", json=spec)
            assert r.status_code == 200, r.text
            assert "GPU memory read on the nodes" in r.json()["explanation"]
    finally:
        cluster.shutdown()


def test_a_node_that_does_not_answer_in_time_gives_no_reading(monkeypatch):
    import ray

    class Ref:
        pass

    cancelled = []
    task = type("T", (), {"options": lambda self, **kw: self, "remote": lambda self: Ref()})()
    monkeypatch.setattr(ray, "remote", lambda **kw: lambda fn: task)
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns, timeout: ([], refs))
    monkeypatch.setattr(ray, "cancel", lambda ref, force: cancelled.append(ref))
    assert gpu_memory.read_on_nodes(["0" * 56], timeout_s=0.01) == {"0" * 56: None}
    assert len(cancelled) == 1
