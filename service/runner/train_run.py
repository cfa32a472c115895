"""The Ray Train wiring of a job's run: the ``TorchTrainer`` the runner starts for each Train run, the backend and
callbacks Meridian gives it, the label selector of each worker, and how a run is stopped (Ray Train's abort, or
the end of its controller when its event loop is held).

The runner (:mod:`meridian.service.runner.actor`) calls these; its controller
(:mod:`meridian.service.runner.controller.decide`) says when. Must never decide a job's outcome.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ray

from meridian.service.cluster.connect import NAMESPACE
from meridian.service.cluster.topology import ClusterTopology, read_topology
from meridian.service.planning.placement import pin_ranks_to_nodes
from meridian.service.planning.plan import Plan
from meridian.service.runner.train_controller import ANSWER_WAIT_S, loop_held, remove_placement_groups_of
from meridian.workers.contracts.events import EventKind

if TYPE_CHECKING:
    from meridian.workers.contracts.config import TrainConfig

NODE_ID_LABEL = "ray.io/node-id"
PLACEABLE_WAIT_S = 30.0
"""How long a new Train run waits for free capacity to place at least one worker before asking for all."""
ABORT_WAIT_S = 10.0
"""How long stopping a run waits for Ray Train's controller to abort before killing it. Its ``abort`` runs on the
controller's event loop, which a blocking wait of its own can hold: seen in ``bench recovery``, the cancel of a job
whose node had died and come back waited behind Ray Train's replacement of the dead worker (a ``ray.get`` in
``WorkerGroup._create_workers``, for a worker the returned node had no room for), and the job had not ended 60 s
after the cancel. Killing the controller ends its workers with it (they are its actors)."""
WORKERS_GONE_WAIT_S = 10.0
"""After killing the controller, how long to wait for the members' processes to be gone, so the snapshot sweep
that ends the run comes after their last write."""


def _controller_hook(name: str, namespace: str) -> Any:
    """A Ray Train controller callback that hands the controller's handle to the runner (for cancel)."""
    from ray.train.v2._internal.execution.callback import ControllerCallback

    class _TellRunner(ControllerCallback):
        def after_controller_start(self, train_run_context: Any) -> None:
            me = ray.get_runtime_context().current_actor
            ray.get_actor(name, namespace=namespace).set_controller.remote(me)

    return _TellRunner()


def _meridian_torch_config(use_gpu: bool) -> Any:
    """The ``torch_config`` of the job's ``TorchTrainer``: a backend that leaves process groups to Meridian and
    declares one-worker replica groups, so Ray Train replaces a dead worker alone instead of restarting every
    worker of the job.

    It is a plain ``BackendConfig``, not a ``TorchConfig`` subclass, so a Train worker never imports torch: each
    worker unpickles this config, and a ``TorchConfig`` brought in ``ray.train.torch`` (torch with it), its
    ``train_func_context`` would set a CUDA device in the worker, and its ``framework`` makes Ray Train import
    torch in every worker to record its version. The Train worker is Meridian's agent, which trains in a child
    process that imports torch itself (:mod:`meridian.workers.elastic.agent`); torch in the agent cost every
    worker an import at every job start (measured in the README's "How a job runs"). ``backend`` is what
    ``TorchTrainer`` reads; the training processes pick their own from their device.
    """
    from ray.train.backend import Backend, BackendConfig

    class _MeridianBackend(Backend):
        has_replica_groups = True  # Ray Train 2.60: replace failing replica groups, keep the others running
        # As Ray Train's torch backend: each GPU worker sees every GPU its node gives the job, so NCCL between
        # workers of one node can use peer-to-peer (NVLink) transfers. Masked to its own GPU per process, NCCL
        # falls back to slower paths and has known bugs on NVSwitch hosts (NVIDIA/nccl#1749, #1906). The worker
        # picks its own device by Ray's GPU id within the list (meridian.workers.entry._device).
        share_cuda_visible_devices = True

        def on_start(self, worker_group: Any, backend_config: Any) -> None:
            pass  # each epoch forms its own process group (meridian.workers.elastic.rendezvous)

        def on_shutdown(self, worker_group: Any, backend_config: Any) -> None:
            pass

    class MeridianBackendConfig(BackendConfig):
        def __init__(self, backend: str) -> None:
            self.backend = backend

        @property
        def backend_cls(self) -> type:
            return _MeridianBackend

    return MeridianBackendConfig("nccl" if use_gpu else "gloo")


def describe_failure(error: BaseException | str) -> str:
    """The root cause of a Train failure in one readable paragraph (not a wall of Ray internals)."""
    text = str(error)
    for marker in ("RuntimeError: ", "ValueError: ", "MemoryError", "ActorDiedError"):
        if marker in text:
            tail = text[text.rindex(marker):]
            return tail.strip().splitlines()[0][:2000]
    return text.strip().splitlines()[-1][:2000] if text.strip() else type(error).__name__


TRACEBACK_CHARS = 4000
"""A worker's failure is told with the last this many characters of its traceback."""


def failure_with_traceback(message: str) -> str:
    """A worker's failure as the job's error: its root cause first (:func:`describe_failure`), then the end of the
    traceback it came with, so a job that fails with an error Meridian does not know carries where it arose."""
    cause = describe_failure(message)
    trace = message.strip()
    if trace == cause or "\n" not in trace:
        return cause
    tail = trace[-TRACEBACK_CHARS:]
    return f"{cause}\n\n{'…' if len(trace) > TRACEBACK_CHARS else ''}{tail}"


def train_loop_config(runner_name_: str, train_config: TrainConfig) -> dict[str, Any]:
    """Ray Train's ``train_loop_config``: the frozen config itself (pickled), read as is by the workers."""
    return {"config": train_config, "runner_name": runner_name_, "namespace": NAMESPACE}


def worker_label_selectors(plan: Plan, topo: ClusterTopology | None = None) -> list[dict[str, str]]:
    """One label selector per Train worker: its datacenter and its node (Ray's ``ray.io/node-id`` label): the
    node the planner gave a tensor-parallel group, so the group shares one node, and for every other rank one
    with room in its datacenter now (:func:`meridian.service.planning.placement.pin_ranks_to_nodes`: why)."""
    nodes = pin_ranks_to_nodes(plan, topo) if topo is not None else plan.rank_nodes or (None,) * plan.num_workers
    return [{"datacenter": dc, **({NODE_ID_LABEL: node} if node else {})}
            for dc, node in zip(plan.rank_datacenters, nodes, strict=True)]


def train_controller_failed(error: BaseException) -> bool:
    """The Train run ended because Ray Train's control loop raised an error it does not retry, and it shut its
    workers down: not the training, whose own failures end the job through :meth:`JobRunner.fail`. (A controller
    whose process died is not this: its workers may still train, and a second run would compete with them.)"""
    from ray.train.v2.api.exceptions import ControllerError

    return isinstance(error, ControllerError)




def fit_run(run_name: str, runner_name: str, train_config: TrainConfig, plan: Plan, storage_path: str, attempt: int,
            *, cancelled: Callable[[], bool], expect_run: Callable[[int], None]) -> BaseException | None:
    """One Ray Train run of the job's workers; the error it ended with (``None``: it ended cleanly). A new run
    after the first asks only for the workers the cluster can place now (the runner replaces the rest when
    their datacenters have room, as after any loss). ``run_name``: unique to the runner (a preempted job's next
    runner starts runs of its own)."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2.api.exceptions import TrainingFailedError

    from meridian.workers.entry import ray_train_entry

    labels = worker_label_selectors(plan, read_topology())
    deadline = time.monotonic() + PLACEABLE_WAIT_S
    while attempt > 1 and time.monotonic() < deadline and not cancelled():
        placeable = [sel for sel in labels if NODE_ID_LABEL in sel]  # pinned: a node has a free slot for it
        if placeable:
            labels = placeable
            break
        time.sleep(1.0)  # the ended run's workers are still releasing their slots
        labels = worker_label_selectors(plan, read_topology())
    if attempt > 1:
        expect_run(len(labels))
    trainer = TorchTrainer(
        ray_train_entry,
        train_loop_config=train_loop_config(runner_name, train_config),
        torch_config=_meridian_torch_config(plan.use_gpu),
        scaling_config=ScalingConfig(
            num_workers=len(labels), use_gpu=plan.use_gpu, label_selector=labels,
            resources_per_worker=dict(plan.resources_per_worker),
        ),
        run_config=RunConfig(
            name=run_name if attempt == 1 else f"{run_name}-run{attempt}",
            storage_path=storage_path,
            # Never give up on a lost worker: the survivors carry on and the runner decides the outcome.
            failure_config=FailureConfig(max_failures=-1),
            callbacks=[_controller_hook(runner_name, NAMESPACE)],
        ),
    )
    try:
        return trainer.fit().error
    except TrainingFailedError as e:  # Ray Train 2.60's fit() raises the error that ended the run
        return e


EventSink = Callable[[str, str, dict[str, Any]], None]


class RunStopper:
    """Ends Train runs: each run's controller is asked to abort once, or ended when its event loop is held."""

    def __init__(self, push_event: EventSink, members_gone: Callable[[], bool]) -> None:
        self.push_event = push_event
        self.members_gone = members_gone
        self.controller: Any = None
        """The current run's controller (handed over by its callback)."""
        self.stopped: Any = None
        """The controller already stopped (the service repeats a cancel until the job ends)."""
        self.workers_started = False
        """A worker of the current Train run has joined: Ray Train starts the train function only once its worker
        group has started. Until then the controller places the workers, which keeps its loop busy for seconds
        without holding it, and its abort is the clean end: it is not killed fast then (a kill after ABORT_WAIT_S
        also removes the placement group it leaves)."""

    def set_controller(self, controller: Any) -> None:
        self.controller = controller
        self.workers_started = False

    def take(self) -> Any:
        """The controller to stop now, once each; ``None`` if there is none or it was stopped (call under the
        runner's lock)."""
        c = self.controller
        if c is None or c is self.stopped:
            return None
        self.stopped = c
        return c

    def stop(self, controller: Any) -> None:
        """Ray Train's abort; the controller's end instead if its event loop is held (it does not answer within
        :data:`ANSWER_WAIT_S`, once the run's workers have started) or it does not get to the abort within
        :data:`ABORT_WAIT_S`."""
        if self.workers_started and loop_held(controller):
            self._kill(controller, f"did not answer within {ANSWER_WAIT_S:.0f} s", ANSWER_WAIT_S)
            return
        try:
            ray.get(controller.abort.remote(), timeout=ABORT_WAIT_S)
        except ray.exceptions.GetTimeoutError:
            self._kill(controller, f"did not abort within {ABORT_WAIT_S:.0f} s", ABORT_WAIT_S)
        except Exception:  # noqa: BLE001, S110 - abort() ends the controller's process, so the call "fails": success
            pass

    def _kill(self, controller: Any, why: str, waited_s: float) -> None:
        with contextlib.suppress(Exception):
            ray.kill(controller, no_restart=True)
        removed: list[str] = []
        with contextlib.suppress(Exception):  # best effort: the GCS may be busy; Ray Train's cleaner may do it
            removed = remove_placement_groups_of(controller._actor_id.hex())
        self.push_event(EventKind.TRAIN_CONTROLLER_KILLED,
                        f"Ray Train's controller {why} (its event loop is held, e.g. by its replacement of a worker "
                        "on a dead node): killed it, and its workers with it"
                        + (f"; removed the placement group it left ({len(removed)})" if removed else ""),
                        {"waited_s": waited_s, "placement_groups_removed": removed})  # fmt: skip
        deadline = time.monotonic() + WORKERS_GONE_WAIT_S
        while time.monotonic() < deadline and not self.members_gone():
            time.sleep(0.2)
