"""Carry out a plan on Ray: create, find, poll, cancel and release a job's runner actor.

The only module of the service that talks to the runner actors. Every Ray call here has a timeout, so a
stuck actor turns into an error the supervisor can report instead of a hung control loop.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from meridian.service.jobs import JobRequest
from meridian.service.planner import Plan
from meridian.service.runner import NAMESPACE, JobRunner, runner_name
from meridian.workers.config import Precision, TrainConfig

CALL_TIMEOUT_S = 10.0


class RunnerLost(RuntimeError):
    """The job's runner actor no longer exists (its node died, or the cluster was restarted)."""


def build_train_config(job_id: str, request: JobRequest, plan: Plan, checkpoint_dir: str) -> TrainConfig:
    """The service → workers boundary: a frozen config with everything a rank needs."""
    return TrainConfig(
        job_id=job_id, model=request.model, data=request.data, optim=request.optim,
        sync=replace(request.sync, strategy=plan.sync_strategy), wan=request.wan,
        steps=request.steps, global_batch=request.global_batch, micro_batch=request.micro_batch,
        seed=request.seed, precision=Precision(request.precision), checkpoint_every=request.checkpoint_every,
        checkpoint_dir=checkpoint_dir, datacenters=plan.rank_datacenters,
    )


class Launcher:
    def __init__(self, storage_path: str) -> None:
        self.storage_path = storage_path
        self._actor_cls = ray.remote(JobRunner)

    def launch(self, job_id: str, config: TrainConfig, plan: Plan) -> str:
        name = runner_name(job_id)
        actor = self._actor_cls.options(
            name=name, namespace=NAMESPACE, lifetime="detached", num_cpus=0, max_concurrency=16,
            max_restarts=0,
            # Next to the service (the head node on a workstation): the runner holds no training state,
            # only the Train controller, which Ray places on the runner's node.
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True),
        ).remote(job_id, config.to_dict(), plan.to_dict(), self.storage_path)
        ray.get(actor.start.remote(), timeout=60)
        return name

    def _actor(self, job_id: str) -> Any:
        try:
            return ray.get_actor(runner_name(job_id), namespace=NAMESPACE)
        except ValueError:
            raise RunnerLost(runner_name(job_id)) from None

    def poll(self, job_id: str, after: int) -> dict[str, Any]:
        try:
            return ray.get(self._actor(job_id).poll.remote(after), timeout=CALL_TIMEOUT_S)
        except ray.exceptions.RayActorError as e:
            raise RunnerLost(str(e)) from e

    def cancel(self, job_id: str) -> None:
        """Ask the runner to abort training (returns once the request is delivered)."""
        with contextlib.suppress(RunnerLost):
            self._actor(job_id).cancel.remote()

    def release(self, job_id: str) -> None:
        """Kill the runner (and with it anything it still owns) once its job is over."""
        with contextlib.suppress(RunnerLost):
            ray.kill(self._actor(job_id), no_restart=True)

    def exists(self, job_id: str) -> bool:
        try:
            self._actor(job_id)
            return True
        except RunnerLost:
            return False
