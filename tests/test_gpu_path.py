"""The GPU workstation path, checked on CPU: what a CUDA rank would call, with CUDA mocked.

No GPU here: these tests pin the decisions (backend per device type, the bound device, the communication
stream, pinned prefetch, fused AdamW, snapshot cadence, refusing a WAN emulator
across hosts); running them on CUDA tensors is a GPU check (docs/benchmarks/gpu.md).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from meridian.workers.contracts.rendezvous import Assignment
from meridian.workers.distributed.devices import PER_DEVICE_BACKEND, backend_for, bind_device, init_kwargs
from meridian.workers.elastic.rendezvous import Rendezvous


def test_backend_is_chosen_per_device_never_hard_coded():
    assert backend_for(torch.device("cpu")) == "gloo"
    assert backend_for("cuda:1") == PER_DEVICE_BACKEND == "cpu:gloo,cuda:nccl"
    assert init_kwargs("cpu") == {"backend": "gloo"}
    assert init_kwargs("cuda:1") == {"backend": "cpu:gloo,cuda:nccl", "device_id": torch.device("cuda", 1)}


def _assignment() -> Assignment:
    return Assignment.of(epoch=1, rank=1, world_size=2, master_addr="127.0.0.1", master_port=1234,
                      datacenters=("a", "a"), resume_step=0, from_checkpoint=False, newcomer_ranks=())  # fmt: skip


def _formed(monkeypatch, device: str) -> tuple[dict, list]:
    seen: dict = {}
    bound: list = []
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: seen.update(kw))
    monkeypatch.setattr(dist, "TCPStore", lambda *a, **kw: "rank 0's store")  # (rank 1 connects to it)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: bound.append(torch.device(d)))
    rdzv = Rendezvous(lambda *a: None, worker_id="w", datacenter="a", node_id="n", address="127.0.0.1", device=device)
    rdzv.form(_assignment())
    return seen, bound


def test_a_cuda_rank_binds_its_device_and_inits_per_device_type(monkeypatch):
    seen, bound = _formed(monkeypatch, "cuda:1")
    assert bound == [torch.device("cuda", 1)]  # set_device before the group exists
    assert seen["backend"] == "cpu:gloo,cuda:nccl" and seen["device_id"] == torch.device("cuda", 1)
    assert seen["rank"] == 1 and seen["world_size"] == 2 and seen["store"] == "rank 0's store"


def test_a_cpu_rank_inits_gloo_without_a_device(monkeypatch):
    seen, bound = _formed(monkeypatch, "cpu")
    assert bound == [] and seen["backend"] == "gloo" and "device_id" not in seen


def test_bind_device_takes_the_local_rank_when_the_device_has_no_index(monkeypatch):
    bound: list = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: bound.append(d))
    assert bind_device("cuda", local_rank=3) == torch.device("cuda", 3) and bound == [torch.device("cuda", 3)]
    assert bind_device("cpu", local_rank=3) == torch.device("cpu") and bound == [torch.device("cuda", 3)]


def test_adamw_is_fused_on_cuda_and_single_tensor_on_cpu():
    from meridian.workers.contracts.config import OptimConfig
    from meridian.workers.optim.adamw import adamw_impl, make_adamw

    assert adamw_impl(torch.device("cuda", 0)) == {"fused": True}
    assert adamw_impl(torch.device("cpu")) == {"foreach": False}  # the bit-equality with the reference
    opt = make_adamw([{"params": [torch.nn.Parameter(torch.ones(3))], "weight_decay": 0.0}], OptimConfig())
    assert opt.defaults["foreach"] is False and not opt.defaults["fused"]


def _wan_key_rank(rank, world):
    from meridian.workers.wan import link

    link.host_identity = lambda: f"host-{rank}"  # as if each rank ran on its own machine
    try:
        link.agree_key("job")
    except link.NotOneHost as e:
        return str(e)
    return None


def test_the_wan_emulator_refuses_ranks_on_different_hosts():
    from meridian.workers.distributed.multiproc import run_processes
    from meridian.workers.wan.link import check_one_host

    check_one_host(["h", "h", "h"])  # one host: fine
    messages = run_processes(_wan_key_rank, 2)
    assert all(m is not None for m in messages)  # every rank refuses, none trains alone
    assert "meridian lab" in messages[0] and "/dev/shm" in messages[0] and "2 hosts" in messages[0]


def test_device_memory_comes_from_the_device_and_reaches_the_planner(monkeypatch):
    from fakes import node

    from meridian.service.cluster.topology import ClusterTopology
    from meridian.service.jobs import JobRequest, TopologyRequest
    from meridian.service.planning.figures import figures_for
    from meridian.workers.contracts.model_config import model_preset
    from meridian.workers.probes.compute_bench import device_memory_bytes

    assert device_memory_bytes(torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * 2**30, 80 * 2**30))
    assert device_memory_bytes(torch.device("cuda", 0)) == 80 * 2**30

    request = JobRequest(name="p", model=model_preset("nano"), steps=2, global_batch=8, micro_batch=1,
                         topology=TopologyRequest(datacenters=["dc-a"]))
    topo = ClusterTopology((node("g", "dc-a", cpus=8, gpus=1),))
    assert figures_for(request, topo, None)[0].device_memory_bytes == 40 * 2**30  # the guess, unmeasured
    other_shape = {"flops": 1e14, "optimizer_step_s": 0.01, "device_memory_bytes": 80 * 2**30}
    fig, sources = figures_for(request, topo, {"compute": {"another-shape": other_shape}})
    assert fig.device_memory_bytes == 80 * 2**30 and "device memory reported by the devices" in sources


def test_a_gpu_job_plans_on_the_compute_rate_of_its_own_precision(monkeypatch):
    # The compute probe ran fp32 while a GPU job with precision 'auto' trains in bf16 autocast (several times
    # faster): every GPU plan after a probe used a rate several times too slow.
    from dataclasses import replace

    from fakes import node

    import meridian.workers.probes.compute_bench as compute_bench
    from meridian.service.cluster.link_probe import compute_key, training_precision
    from meridian.service.cluster.topology import ClusterTopology
    from meridian.service.jobs import JobRequest, TopologyRequest
    from meridian.service.planning.figures import figures_for
    from meridian.workers.contracts.config import Precision
    from meridian.workers.contracts.fields import to_plain
    from meridian.workers.contracts.model_config import model_preset

    assert [training_precision(p, gpu) for p in ("auto", "fp32", "bf16") for gpu in (True, False)] == [
        "bf16", "fp32", "fp32", "fp32", "bf16", "bf16"]
    request = JobRequest(name="p", model=model_preset("nano"), steps=2, global_batch=8, micro_batch=1,
                         topology=TopologyRequest(datacenters=["dc-a"]))
    model = to_plain(request.model)
    probed = {"compute": {compute_key(model, 1): {"flops": 1e13, "optimizer_step_s": 0.01},
                          compute_key(model, 1, "bf16"): {"flops": 6e13, "optimizer_step_s": 0.01}}}
    gpus = ClusterTopology((node("g", "dc-a", cpus=8, gpus=1),))
    assert figures_for(request, gpus, probed)[0].device_flops == 6e13
    fp32 = replace(request, precision=Precision.FP32)
    assert figures_for(fp32, gpus, probed)[0].device_flops == 1e13
    cpus = ClusterTopology((node("c", "dc-a", cpus=8),))
    assert figures_for(request, cpus, probed)[0].device_flops == 1e13

    # and the probe itself computes in the precision it is given
    used = []
    real = compute_bench.autocast_context
    monkeypatch.setattr(compute_bench, "autocast_context",
                        lambda precision, device: used.append(precision) or real(precision, device))
    compute_bench.training_flops(model_preset("nano"), 1, min_seconds=0.01, warmup=0, precision=Precision.BF16)
    assert used and set(used) == {Precision.BF16}


def test_auto_precision_is_bf16_only_on_gpus_that_run_it_natively(monkeypatch):
    # torch's is_bf16_supported() says yes for a Volta or Turing GPU, which only emulates bf16 (slower than fp32)
    from meridian.workers.contracts.config import Precision
    from meridian.workers.loop.precision import resolve_precision

    native = {"volta": False, "ampere": True}
    for gpu, has_native in native.items():
        monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                            lambda including_emulation=True, n=has_native: n or including_emulation)
        expected = Precision.BF16 if has_native else Precision.FP32
        assert resolve_precision(Precision.AUTO, torch.device("cuda", 0)) is expected, gpu
    assert resolve_precision(Precision.AUTO, torch.device("cpu")) is Precision.FP32
    assert resolve_precision(Precision.BF16, torch.device("cpu")) is Precision.BF16


class _Event:
    """Stands in for a CUDA event: the snapshot store writes only after ``synchronize`` returned."""

    def __init__(self) -> None:
        import threading

        self.release = threading.Event()
        self.synchronized = False

    def synchronize(self) -> None:
        self.release.wait(10)
        self.synchronized = True


def test_a_snapshot_with_copies_in_flight_is_written_off_the_training_thread(tmp_path):
    from meridian.workers.state.replica_state import LocalShard, StatePiece
    from meridian.workers.state.snapshots import SnapshotStore

    store = SnapshotStore(3, str(tmp_path))
    store.append(LocalShard(1, 1, (StatePiece("w", 0, 2, torch.ones(2)),)))  # CPU: written now
    assert list(tmp_path.glob("shard-*.pt"))
    ready = _Event()
    store.append(LocalShard(2, 2, (StatePiece("w", 0, 2, torch.full((2,), 2.0)),)), ready)
    assert not (tmp_path / "shard-0000000002.pt").exists()  # the copies have not landed: nothing written yet
    ready.release.set()
    assert store.last_step == 2 and ready.synchronized  # every read waits for the write
    assert torch.equal(store.get(2).pieces[0].value, torch.full((2,), 2.0))


def test_the_cpu_path_has_no_prefetch():
    from meridian.workers.loop.step import BatchPrefetch

    class _Replica:
        device = torch.device("cpu")

    assert BatchPrefetch.for_replica(None, None, _Replica()) is None


def test_the_embedded_cluster_hands_each_node_its_own_gpus_or_none():
    from meridian.service.cluster.connect import gpu_shares

    assert gpu_shares(["0"], 1) == [["0"]]  # `meridian demo --datacenters dc-a:1` on a one-GPU workstation
    assert gpu_shares(["0"], 4) == [[], [], [], []]  # four ranks cannot share one GPU under NCCL: CPU workers
    assert gpu_shares(["0", "1", "2", "3", "4"], 2) == [["0", "1"], ["2", "3"]]  # equal slices, the rest unused
    assert gpu_shares(["3", "5"], 2) == [["3"], ["5"]]  # CUDA_VISIBLE_DEVICES' ids, as given
    assert gpu_shares([], 3) == [[], [], []]



def test_gpu_workers_of_a_node_see_its_gpus_and_each_picks_the_one_ray_gave_it(monkeypatch):
    # Ray Train masks each worker to its own GPU unless the backend shares them; NCCL between workers of one node
    # then loses peer-to-peer transfers (and hits NCCL bugs on NVSwitch hosts). Its torch backend shares them.
    import ray

    from meridian.service.runner.train_run import _meridian_torch_config
    from meridian.workers import entry

    assert _meridian_torch_config(True).backend_cls.share_cuda_visible_devices is True
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # the node's GPUs of this job, shared
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [6])
    assert entry._device() == "cuda:2"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6")  # a replacement worker, started outside the shared group
    assert entry._device() == "cuda:0"


def test_the_compute_probe_of_a_cpu_job_measures_the_cpu_on_a_node_with_a_gpu(monkeypatch):
    # On a GPU workstation a CPU job's compute probe (POST /v1/diagnostics/compute) ran on the GPU, and `auto`
    # planned the job from the GPU's rate.
    from dataclasses import asdict

    import meridian.workers.probes.compute_bench as compute_bench
    from meridian.workers.contracts.model_config import model_preset
    from meridian.workers.probes.probe_actor import ProbeActor

    devices = []
    real = compute_bench.training_flops
    monkeypatch.setattr(compute_bench, "training_flops",
                        lambda *a, device=None, **kw: devices.append(device) or real(*a, device=device, **kw))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    row = ProbeActor().compute(asdict(model_preset("nano")), 1, min_seconds=0.01)
    assert devices == [torch.device("cpu")] and row["flops"] > 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="placed for a GPU worker but this process sees no CUDA device"):
        ProbeActor().compute(asdict(model_preset("nano")), 1, min_seconds=0.01, use_gpu=True)
