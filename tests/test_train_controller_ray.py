"""A killed actor's placement groups on a real Ray cluster: Ray keeps them (holding their CPUs) while the job that
started the actor lives; the runner removes those of a Train controller it killed, and only those."""

from __future__ import annotations

import time

import pytest
import ray
from ray_env import local_cluster

from meridian.service.runner.train_controller import placement_groups_of, remove_placement_groups_of

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
