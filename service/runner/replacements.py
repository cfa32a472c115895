"""Replacement workers: when a datacenter runs short of its plan after a loss and has room for a worker again,
the runner starts one there, outside Ray Train's worker group (Train 2.60 does not re-place a lost replica group
once its node is gone); it runs the same entry and joins the rendezvous as a newcomer.

Which datacenter gets one is :func:`~meridian.service.runner.replacement.replacement_datacenter`'s to say (pure);
this module starts, looks up and kills the actors.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any

import ray

from meridian.service.cluster.topology import ClusterTopology
from meridian.service.planning.plan import Plan
from meridian.service.runner.backoff import Backoff
from meridian.service.runner.coordinator import Coordinator
from meridian.service.runner.replacement import replacement_datacenter
from meridian.service.runner.train_run import EventSink, train_loop_config
from meridian.workers.contracts.events import EventKind

if TYPE_CHECKING:
    from meridian.workers.contracts.config import TrainConfig


class Replacements:
    """The replacement workers one job's runner started, and the decision to start the next."""

    def __init__(self, name: str, train_config: TrainConfig, plan: Plan, push_event: EventSink) -> None:
        self.name, self.train_config, self.plan, self.push_event = name, train_config, plan, push_event
        rank_dcs = list(plan.rank_datacenters)
        self.planned_per_dc = {dc: rank_dcs.count(dc) for dc in dict.fromkeys(rank_dcs)}
        self._lock = threading.Lock()
        self._started: dict[str, tuple[str, Any]] = {}  # actor id → (datacenter, handle), not yet in an epoch
        self._asking = Backoff(initial_s=1.0, max_s=10.0)  # how often one still starting is looked up

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._started

    def replace_lost(self, topo: ClusterTopology, coordinator: Coordinator) -> None:
        """Start a worker in the first datacenter that runs short of its plan and has room for one again; none once
        the job is ending (a cancel or the last step: the coordinator is closed; a worker started then held its CPU
        or GPU after the kill loop of :meth:`kill_all` had run)."""
        epoch = coordinator.epoch
        if epoch is None or coordinator.closed:
            return
        members = {m.worker_id for m in epoch.members}
        waiting = set(coordinator.status()["waiting"])
        if not waiting - members:
            with self._lock:
                self._started = {k: a for k, a in self._started.items()
                                 if k not in members and self._still_starting(k, a)}  # started, not yet in an epoch
        dc = replacement_datacenter(
            self.planned_per_dc, epoch.members, alive_nodes={n.node_id for n in topo.alive_nodes},
            pending=[d for d, _ in self._started.values()], newcomer_waiting=bool(waiting - members),
            with_room={d for d in self.planned_per_dc if _has_room(topo, d, self.plan.resources_per_worker)},
        )
        if dc is None:
            return
        dc_, actor = _start_replacement(self.name, self.train_config, dc, self.plan)
        with self._lock:
            self._started[actor._actor_id.hex()] = (dc_, actor)
        if coordinator.closed:  # kill_all closed it before its kill loop: this one was missed
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
            return
        self.push_event(EventKind.WORKER_REPLACING, f"capacity returned in {dc}: starting a worker there", {"datacenter": dc})

    def kill_all(self) -> None:
        with self._lock:
            started = list(self._started.values())
        for _, actor in started:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)

    def _still_starting(self, key: str, handle: tuple[str, Any]) -> bool:
        """Whether a replacement that has not joined yet still lives. Looked up at once, then ever less
        often while it keeps starting (1, 2, 4, 8, 10 s), not every tick."""
        if not self._asking.due(key):
            return True
        self._asking.unchanged(key)
        alive = _actor_alive(handle)
        if not alive:
            self._asking.changed(key)
        return alive


def _actor_alive(handle: tuple[str, Any]) -> bool:
    """Asked of the GCS directly (one actor's row), not through the state API: that goes through the
    dashboard, which clusters may run without and which shares the head's CPU with everything else."""
    from ray._private.state import actors

    try:
        info = actors(actor_id=handle[1]._actor_id.hex())
    except Exception:  # noqa: BLE001 - the GCS is busy: assume it lives, check again later
        return True
    return bool(info) and info.get("State") != "DEAD"


def _has_room(topo: ClusterTopology, dc: str, resources: dict[str, float]) -> bool:
    """A live node of ``dc`` has the free resources of one worker."""
    cpus, gpus = resources.get("CPU", 0.0), resources.get("GPU", 0.0)
    return any(n.available_cpus >= cpus and n.available_gpus >= gpus for n in topo.nodes_in(dc))


class _ReplacementWorker:
    def run(self, loop_config: dict[str, Any]) -> None:
        from meridian.workers.entry import ray_train_entry

        ray_train_entry(loop_config, replacement=True)


def _start_replacement(name: str, train_config: TrainConfig, dc: str, plan: Plan) -> tuple[str, Any]:
    """A worker outside Ray Train's group (Train 2.60 does not re-place a lost replica group once its node is
    gone), pinned by label to ``dc``; it runs the same entry and joins the rendezvous as a newcomer."""
    resources = dict(plan.resources_per_worker)
    cpus = resources.pop("CPU", 1.0)
    gpus = resources.pop("GPU", 0.0)
    actor = ray.remote(_ReplacementWorker).options(
        num_cpus=cpus, num_gpus=gpus, resources=resources or None, label_selector={"datacenter": dc},
        max_restarts=0,
    ).remote()
    actor.run.remote(train_loop_config(name, train_config))
    return (dc, actor)
