"""Carry out a plan on Ray: create, find, poll, cancel and release a job's runner actor.

The only module of the service that talks to the runner actors. Every Ray call here has a timeout, so a
stuck actor turns into an error the supervisor can report instead of a hung control loop. It carries out,
and never decides: what a poll means is :mod:`meridian.service.supervision.reconcile`'s to say.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from meridian.service.cluster.connect import NAMESPACE
from meridian.service.planning.plan import Plan
from meridian.service.runner.actor import JobRunner, runner_name, sweep_snapshots
from meridian.service.runner.poll import RunnerLost, RunnerPoll
from meridian.service.runner.train_controller import lost_runner, sweep_placement_groups_left_by
from meridian.workers.contracts.config import TrainConfig

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 10.0
LAUNCH_TIMEOUT_S = 60.0
NAME_FREE_WAIT_S = 10.0
"""A runner killed by its release keeps its name until Ray has ended it: a job launched again waits this long."""




def _head_node_id() -> str:
    """The head node (where the GCS runs); a driver's own node may be any node of a local cluster."""
    for n in ray.nodes():
        if n.get("Alive") and "node:__internal_head__" in (n.get("Resources") or {}):
            return n["NodeID"]
    return ray.get_runtime_context().get_node_id()


class Launcher:
    def __init__(self, storage_path: str) -> None:
        self.storage_path = storage_path
        self._actor_cls = ray.remote(JobRunner)

    def launch(self, job_id: str, config: TrainConfig, plan: Plan, *, min_workers: int = 1) -> str:
        name = runner_name(job_id)
        self._wait_name_free(job_id)  # a preempted job's last runner was killed: its name goes with it
        actor = self._actor_cls.options(
            name=name, namespace=NAMESPACE, lifetime="detached", num_cpus=0, max_concurrency=64,
            max_restarts=0,
            # On the head node: the runner holds no training state, only the rendezvous and the Train
            # controller (which Ray places on the runner's node), so it must not share a worker's fate.
            # Hard affinity: measured here, a soft one put the runner on a worker node of a local cluster.
            scheduling_strategy=NodeAffinitySchedulingStrategy(_head_node_id(), soft=False),
        ).remote(job_id, config, plan, self.storage_path, min_workers)  # the frozen config and Plan: Ray pickles them
        try:
            ray.get(actor.start.remote(), timeout=LAUNCH_TIMEOUT_S)
        except BaseException:
            # A runner that did not start in time must not start later, unfollowed: kill it.
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
            raise
        return name

    def _wait_name_free(self, job_id: str, timeout_s: float = NAME_FREE_WAIT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while self.exists(job_id) and time.monotonic() < deadline:
            time.sleep(0.2)

    def _actor(self, job_id: str) -> Any:
        try:
            return ray.get_actor(runner_name(job_id), namespace=NAMESPACE)
        except ValueError:
            raise RunnerLost(runner_name(job_id)) from None

    def poll(self, job_id: str, after: int) -> RunnerPoll:
        try:
            return ray.get(self._actor(job_id).poll.remote(after), timeout=CALL_TIMEOUT_S)
        except ray.exceptions.ActorUnavailableError:
            raise  # unreachable for a moment (a busy node, a lost connection): the next poll retries
        except ray.exceptions.RayActorError as e:
            raise RunnerLost(str(e)) from e

    def resume(self, job_id: str) -> None:
        """Make sure a found runner is training: a service killed between creating the actor and starting
        it leaves one that never starts (``JobRunner.start`` does nothing if it already runs)."""
        try:
            ray.get(self._actor(job_id).start.remote(), timeout=CALL_TIMEOUT_S)
        except ray.exceptions.RayActorError as e:
            raise RunnerLost(str(e)) from e

    def cancel(self, job_id: str) -> None:
        """Ask the runner to abort training (returns once the request is delivered)."""
        with contextlib.suppress(RunnerLost):
            self._actor(job_id).cancel.remote()

    def profile(self, job_id: str, request_id: str, steps: int, ranks: list[int]) -> Any:
        """The runner's :meth:`~meridian.service.runner.actor.JobRunner.profile`: a ``ProfileDelivery``, or the
        message saying which ranks the job lacks."""
        try:
            return ray.get(self._actor(job_id).profile.remote(request_id, steps, ranks), timeout=CALL_TIMEOUT_S)
        except ray.exceptions.RayActorError as e:
            raise RunnerLost(str(e)) from e

    def suspend(self, job_id: str) -> None:
        """Ask the runner to have its workers checkpoint at their next step boundary and stop (returns once the
        request is delivered)."""
        with contextlib.suppress(RunnerLost):
            self._actor(job_id).suspend.remote()

    def release(self, job_id: str) -> threading.Thread:
        """Kill the runner (and with it anything it still owns) once its job is over, and remove the placement
        groups its Train controllers leave, on a thread of its own (returned) that ends once those controllers
        have (:func:`~meridian.service.runner.train_controller.sweep_placement_groups_left_by`): a runner whose
        process died leaves them holding the job's CPUs, and the job relaunched (or the next one) could not be
        placed. The runner is looked up first, so a relaunch that reuses its name is not swept."""
        lost = lost_runner(runner_name(job_id))
        with contextlib.suppress(RunnerLost):
            ray.kill(self._actor(job_id), no_restart=True)

        def sweep() -> None:
            try:
                removed = sweep_placement_groups_left_by(lost)
            except Exception:  # noqa: BLE001 - the GCS busy or gone: Ray Train's own cleaner may still do it
                log.exception("job %s: removing the placement groups its runner left failed", job_id)
                return
            if removed:
                log.info("job %s: removed the placement group(s) its runner's controllers left: %s", job_id, removed)

        thread = threading.Thread(target=sweep, name=f"meridian-release-{job_id}", daemon=True)
        thread.start()
        return thread

    def sweep_snapshots(self, job_id: str, after_s: float = 0.0) -> threading.Thread:
        """Remove the job's in-memory snapshot folders on every live node, ``after_s`` from now, on a thread of its
        own (a task per host, up to 30 s): what the job's runner does at the end of a job, for one whose runner
        is gone or was killed."""

        def sweep() -> None:
            time.sleep(after_s)
            sweep_snapshots(job_id)

        thread = threading.Thread(target=sweep, name=f"meridian-sweep-{job_id}", daemon=True)
        thread.start()
        return thread

    def exists(self, job_id: str) -> bool:
        try:
            self._actor(job_id)
            return True
        except RunnerLost:
            return False
