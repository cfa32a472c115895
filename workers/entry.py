"""What one Ray Train worker runs: learn where it is, join the job's rendezvous, train until the job is done.

Each worker reads its datacenter from its node's ``datacenter`` label (never from its IP or rank: local
simulated nodes share one IP). It does not train in Ray Train's own process group: it runs an
:class:`~meridian.workers.elastic.agent.Agent`, which joins *epochs* formed by the coordinator in the job's runner
actor and trains in a child process, so when a node dies the survivors re-form over each other within
seconds instead of waiting for Ray Train to restart the whole worker group. Progress and events go to the
runner with fire-and-forget calls, so a slow service never slows a step. Must not import ``meridian.api`` or
``meridian.service``: this runs on remote nodes.
"""

from __future__ import annotations

import os
import socket
import time
from typing import TYPE_CHECKING, Any

import ray

from meridian.workers.contracts.config import TrainConfig
from meridian.workers.elastic.standby import start_standby

if TYPE_CHECKING:
    from meridian.workers.contracts.records import StepRecord

DATACENTER_LABEL = "datacenter"
CALL_TIMEOUT_S = 60.0
"""A rendezvous call returns within its poll period (2 s); far longer means the runner is gone."""


class RunnerSink:
    """Sends rank 0's per-step records to the job runner actor without waiting for it."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner

    def step(self, record: StepRecord) -> None:
        self.runner.push_progress.remote([record])  # as itself: Ray pickles the dataclass

    def rank_steps(self, beats: list[dict[str, Any]]) -> None:
        """A batch of one rank's per-step heartbeats (stall detection, per-datacenter step times), one call."""
        self.runner.push_heartbeats.remote(beats)


def _device() -> str:
    """This worker's device, torch-free: the first GPU Ray assigned it, as its index in ``CUDA_VISIBLE_DEVICES``
    (which lists every GPU of the node for Ray Train's workers, and only its own for a replacement), or the CPU
    when it has none, like its standby. Ray Train's ``get_device`` gives the same index, but it lives in
    ``ray.train.torch``: importing it (torch with it, ~3 and ~6 CPU-seconds) was most of a worker's start-up on a
    node it shares with training (``bench recovery``'s ``after_back_s.worker_started``), and the agent never
    uses torch; its training process imports torch anyway, beside it."""
    gpus = [str(g) for g in ray.get_gpu_ids()]
    if not gpus:
        return "cpu"
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d and d != "NoDevFiles"]
    if not visible:  # Ray left CUDA_VISIBLE_DEVICES alone (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES): all are seen
        return f"cuda:{gpus[0]}"
    if gpus[0] not in visible:
        raise RuntimeError(f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')!r} does not list the "
                           f"GPU Ray assigned this worker ({gpus[0]}); leave CUDA_VISIBLE_DEVICES to Ray")
    return f"cuda:{visible.index(gpus[0])}"


def _rendezvous_call(runner: Any) -> Any:
    def call(method: str, *args: Any) -> Any:
        return ray.get(getattr(runner, f"rdzv_{method}").remote(*args), timeout=CALL_TIMEOUT_S)

    return call


def _cache_url_datasets(cfg: TrainConfig, runner: Any, *, worker_id: str, node_id: str, datacenter: str) -> None:
    """Copy the job's datasets named by URL into this host's cache before this worker joins (a node that cannot
    reach them fails the job now, at placement, naming itself, before any step)."""
    from meridian.workers.data.remote import DataUnreachable, cache_url_datasets

    try:
        cache_url_datasets(cfg.data, worker_id=worker_id, node_id=node_id, datacenter=datacenter,
                           host=socket.gethostname(), on_event=runner.push_event.remote)
    except DataUnreachable as e:
        ray.get(runner.fail.remote(str(e)), timeout=CALL_TIMEOUT_S)
        raise RuntimeError(str(e)) from None


def ray_train_entry(loop_config: dict[str, Any], *, replacement: bool = False) -> None:
    """``train_loop_per_worker`` of the job's TorchTrainer; with ``replacement``, the body of a worker the runner
    started outside Ray Train's group."""
    cfg = loop_config["config"]
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"train_loop_config['config'] must be a TrainConfig (pickled as is), got {type(cfg).__name__}")
    rt = ray.get_runtime_context()
    # The first training process starts at once: its imports (seconds; most of a joining worker's start-up) run
    # beside this process's own, which stay torch-free (this module, the agent, the device and backend choice).
    standby = start_standby(rt.get_actor_id() or str(os.getpid()), "cuda" if ray.get_gpu_ids() else "cpu")
    try:
        _run(loop_config, cfg, rt, standby, replacement)
    except BaseException:
        standby.discard()
        raise


def _run(loop_config: dict[str, Any], cfg: TrainConfig, rt: Any, standby: Any, replacement: bool) -> None:
    from meridian.workers.distributed.devices import backend_for
    from meridian.workers.elastic.agent import Agent

    runner = ray.get_actor(loop_config["runner_name"], namespace=loop_config["namespace"])
    node_id = rt.get_node_id()
    dc = rt.get_node_labels().get(DATACENTER_LABEL)
    if not dc:
        message = (f"a worker runs on node {node_id} which has no '{DATACENTER_LABEL}' label; "
                   "start every worker node with `ray start --labels datacenter=<name>`")
        ray.get(runner.fail.remote(message), timeout=CALL_TIMEOUT_S)
        raise RuntimeError(message)
    device = _device()
    worker_id = rt.get_actor_id() or f"{node_id[:12]}-{os.getpid()}"
    runner.push_event.remote("worker_started", f"a worker started in {dc} on node {node_id[:12]}", {
        "worker_id": worker_id, "node_id": node_id, "datacenter": dc, "hostname": socket.gethostname(),
        "pid": os.getpid(), "ray_worker_id": rt.get_worker_id(), "device": device, "time": time.time(),
    })
    _cache_url_datasets(cfg, runner, worker_id=worker_id, node_id=node_id, datacenter=dc)
    on_event = lambda kind, message, data: runner.push_event.remote(kind, message, data)  # noqa: E731
    sink: Any = RunnerSink(runner)
    if cfg.tracking is not None and cfg.tracking.enabled:
        from meridian.workers.tracking.sink import TrackingSink

        sink = TrackingSink(sink, cfg, on_event=on_event)  # opens the trackers only if this worker becomes rank 0
    agent = Agent(
        cfg, _rendezvous_call(runner), worker_id=worker_id, datacenter=dc, node_id=node_id,
        address=ray.util.get_node_ip_address(), backend=backend_for(device), device=device,
        sink=sink, on_event=on_event, standby=standby,
    )  # fmt: skip
    try:
        result = agent.run()
    except Exception as e:
        # A failure that is not a lost peer (bad data path, out of memory...): retrying cannot fix it.
        ray.get(runner.fail.remote(f"{type(e).__name__}: {e}"), timeout=CALL_TIMEOUT_S)
        raise
    finally:
        if hasattr(sink, "close"):
            sink.close()  # the trackers take the last records and close their files before the result is sent
    if result is not None:  # None: the job finished before this (replacement) worker was needed
        summary = {
            "first_loss": result.first_loss, "final_loss": result.final_loss, "eval_loss": result.eval_loss,
            "steps": result.steps, "tokens_per_s": result.tokens_per_s,
            "inter_dc_bytes_per_step": result.inter_dc_bytes_per_step, "recoveries": agent.recoveries,
            **({"eval_skipped": result.eval_skipped} if result.eval_skipped else {}),
        }
        ray.get(runner.push_result.remote(summary), timeout=CALL_TIMEOUT_S)
