"""What the runner asks of Ray Train's controller when it ends a run: is its event loop held, and what did a
controller the runner killed leave behind.

Ray Train 2.60's controller is an async actor: every call to it waits for its event loop, which its own blocking
waits can hold (a ``ray.get`` while it replaces a worker the cluster has no room for, or while it places its
workers). A call for its state that gets no answer in a second says the loop is held.

A controller that is killed leaves the placement group it made for its workers unless Ray Train's own cleaner
knows it, and the cleaner learns of a group only once the workers in it have started
(``PlacementGroupCleanerCallback.after_worker_group_start``). Ray keeps the group of a dead actor while the job
that started it lives, and the job is the service's: the group would hold its CPUs until the service stops.
:func:`remove_placement_groups_of` removes the groups a dead controller made, and
:func:`sweep_placement_groups_left_by` those of every controller a released runner owned.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import ray

ANSWER_WAIT_S = 1.0
"""How long ending a run first waits for Ray Train's controller to answer a cheap call (its state). One that does
not answer in this time has its loop held: it is killed at once instead of being asked to abort and waited for,
and a job that trained its last step does not wait for a ``fit()`` that cannot return. (It answered in 3.1 and
6.5 ms at a job's end and at a cancel of a training job on this 2-core machine.)"""


SWEEP_TIMEOUT_S = 60.0
"""How long the sweep of a released runner's placement groups waits for the actors it owned to end (Ray ends
them within seconds of their owner; a GCS too busy to say so is not waited on longer)."""


def loop_held(controller: Any) -> bool:
    """The controller does not answer a call for its state within :data:`ANSWER_WAIT_S`. A controller that has
    ended (the call fails) is not held: there is nothing to wait for."""
    try:
        ray.get(controller.get_state.remote(), timeout=ANSWER_WAIT_S)
    except ray.exceptions.GetTimeoutError:
        return True
    except Exception:  # noqa: BLE001 - the controller's process has ended
        return False
    return False


def placement_groups_of(actor_id: str) -> list[str]:
    """Ids (hex) of the placement groups the actor ``actor_id`` (hex) created that Ray has not removed; read from
    the GCS's table, which names each group's creator (``ray.util.placement_group_table`` leaves it out)."""
    from ray._private.state import state
    from ray.core.generated import gcs_pb2

    found = []
    for raw in state._connect_and_get_accessor().get_placement_group_table():
        data = gcs_pb2.PlacementGroupTableData.FromString(raw)
        if data.creator_actor_id.hex() == actor_id and data.state != gcs_pb2.PlacementGroupTableData.REMOVED:
            found.append(data.placement_group_id.hex())
    return found


@dataclass(frozen=True)
class LostRunner:
    """A runner actor that is gone or being killed, as the GCS's actor table knew it when it was looked up: the ids
    (hex) of every actor ever named so, and the workers (processes) they ran in, which own its Train controllers."""

    name: str
    actor_ids: tuple[str, ...]
    worker_ids: frozenset[bytes]


def lost_runner(runner: str) -> LostRunner:
    """The actors named ``runner`` in any state (the GCS may free a dead actor's name before it marks the actor
    dead). Look it up before a relaunched job's new runner takes the name: the sweep must not touch that one's."""
    lost = [a for a in _actor_table() if a.name == runner]
    return LostRunner(runner, tuple(a.actor_id.hex() for a in lost), frozenset(a.address.worker_id for a in lost))


def sweep_placement_groups_left_by(runner: LostRunner, *, timeout_s: float = SWEEP_TIMEOUT_S,
                                   interval_s: float = 0.5) -> list[str]:
    """Remove the placement groups of the actors the runner owned (its Ray Train controllers) and of the runner
    itself, again every ``interval_s`` until every such actor is dead (or ``timeout_s`` passed); their ids.

    Once: a controller that outlives its runner for a moment (Ray ends an owner's actors after it learns the
    owner died) and that never gives up on its workers (``FailureConfig(max_failures=-1)``) makes a new group
    for them when the one removed under them goes, and that group, registered with no cleaner, would hold the
    job's CPUs while the service's Ray job lives: the relaunched job would stay placing."""
    from ray.core.generated import gcs_pb2

    deadline = time.monotonic() + timeout_s
    removed: list[str] = []
    while True:
        owned = [a for a in _actor_table() if a.owner_address.worker_id in runner.worker_ids]
        for actor_id in [a.actor_id.hex() for a in owned] + list(runner.actor_ids):
            removed += remove_placement_groups_of(actor_id)
        if all(a.state == gcs_pb2.ActorTableData.DEAD for a in owned) or time.monotonic() >= deadline:
            return removed
        time.sleep(interval_s)


def _actor_table() -> list[Any]:
    from ray._private.state import state
    from ray.core.generated import gcs_pb2

    return [gcs_pb2.ActorTableData.FromString(raw) for raw in state._connect_and_get_accessor().get_actor_table(None, None)]


def remove_placement_groups_of(actor_id: str) -> list[str]:
    """Remove every placement group the (dead) actor ``actor_id`` created; their ids. A group removed meanwhile
    (by Ray Train's cleaner) is skipped."""
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    removed = []
    for pg_id in placement_groups_of(actor_id):
        try:
            remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(pg_id))))
        except Exception:  # noqa: BLE001, S112 - removed by the cleaner between the read and here
            continue
        removed.append(pg_id)
    return removed
