"""A killed actor's placement groups on a real Ray cluster: Ray keeps them (holding their CPUs) while the job that
started the actor lives; the runner removes those of a Train controller it killed, and only those; the service
removes those of every controller a released runner owned, until they have ended."""

from __future__ import annotations

import threading
import time

import pytest
import ray
from ray_env import local_cluster

from meridian.service.runner.train_controller import (
    lost_runner,
    placement_groups_of,
    remove_placement_groups_of,
    sweep_placement_groups_left_by,
)

pytestmark = pytest.mark.slow


@ray.remote(num_cpus=0)
class GroupMaker:
    """Stands in for Ray Train's controller: an actor that makes a placement group for its workers."""

    def make(self) -> str:
        from ray.util.placement_group import placement_group

        pg = placement_group([{"CPU": 1}])
        ray.get(pg.ready(), timeout=60)
        return pg.id.hex()


def free_cpus() -> float:
    return ray.available_resources().get("CPU", 0.0)


def test_the_groups_a_killed_actor_made_are_removed_and_no_others():
    with local_cluster(("dc-a", "dc-a")) as cluster:
        ray.init(address=cluster.address)
        try:
            killed, kept = GroupMaker.remote(), GroupMaker.remote()
            killed_pg, kept_pg = ray.get(killed.make.remote()), ray.get(kept.make.remote())
            killed_id = killed._actor_id.hex()
            assert placement_groups_of(killed_id) == [killed_pg]
            ray.kill(killed, no_restart=True)
            time.sleep(3)
            # What the runner cleans up after: the dead actor's group still holds its CPU.
            assert placement_groups_of(killed_id) == [killed_pg] and free_cpus() == 0

            assert remove_placement_groups_of(killed_id) == [killed_pg]
            deadline = time.monotonic() + 30
            while free_cpus() < 1 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert free_cpus() == 1 and placement_groups_of(killed_id) == []
            assert placement_groups_of(kept._actor_id.hex()) == [kept_pg]  # another actor's group is untouched
            assert remove_placement_groups_of(killed_id) == []  # nothing left to remove
        finally:
            ray.shutdown()


@ray.remote(num_cpus=0)
class Runner:
    """Stands in for a job's runner: a named actor that owns a controller (which Ray ends when the runner ends)."""

    def controller(self):
        self.made = GroupMaker.remote()
        return [self.made]  # (in a list: a handle returned bare would be owned by the caller)


def test_a_released_runners_groups_are_removed_until_its_controllers_have_ended():
    with local_cluster(("dc-a", "dc-a")) as cluster:
        ray.init(address=cluster.address, namespace="sweep-test")
        try:
            runner = Runner.options(name="runner-x", lifetime="detached").remote()
            (controller,) = ray.get(runner.controller.remote())
            first = ray.get(controller.make.remote())
            lost = lost_runner("runner-x")

            swept: list[list[str]] = []
            sweep = threading.Thread(target=lambda: swept.append(sweep_placement_groups_left_by(lost, interval_s=0.2)))
            sweep.start()
            deadline = time.monotonic() + 30
            while placement_groups_of(controller._actor_id.hex()) and time.monotonic() < deadline:
                time.sleep(0.1)
            # The controller, still alive, makes its workers a new group once the first is gone: removed too.
            second = ray.get(controller.make.remote())
            while placement_groups_of(controller._actor_id.hex()) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert sweep.is_alive()  # it waits for the controller to end
            ray.kill(runner, no_restart=True)  # and Ray ends the controller with its owner
            sweep.join(60)
            assert not sweep.is_alive() and sorted(swept[0]) == sorted([first, second]), (swept, first, second)
            while free_cpus() < 2 and time.monotonic() < deadline + 30:
                time.sleep(0.2)
            assert free_cpus() == 2
            # A runner that reuses the name is another actor: the sweep of the lost one never touches its groups.
            again = Runner.options(name="runner-x", lifetime="detached").remote()
            (kept_by,) = ray.get(again.controller.remote())
            kept = ray.get(kept_by.make.remote())
            assert sweep_placement_groups_left_by(lost, timeout_s=0) == [] and placement_groups_of(kept_by._actor_id.hex()) == [kept]
            ray.kill(again, no_restart=True)
        finally:
            ray.shutdown()
