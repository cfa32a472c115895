"""The embedded cluster of ``meridian bench recovery`` kills a node the way a machine dies: every process of it
at once, so no process of the "dead" node trains on while the clock already runs."""

from __future__ import annotations

import argparse
import os
import subprocess

import pytest
from processes import is_gone, process_line


@pytest.mark.slow
def test_an_embedded_node_dies_whole_at_once():
    import ray

    from meridian.bench.recovery_cluster import EmbeddedCluster

    cluster = EmbeddedCluster(argparse.Namespace(dcs=2, nodes_per_dc=1))
    try:
        ray.init(address=cluster.address)

        @ray.remote(num_cpus=1)
        class Holder:
            def start(self) -> tuple[int, int]:
                self.child = subprocess.Popen(["sleep", "600"])  # stands in for a worker's training process
                return os.getpid(), self.child.pid

        (node,) = cluster.node_ids("dc-b")
        holder = Holder.options(label_selector={"datacenter": "dc-b"}).remote()
        worker, child = ray.get(holder.start.remote(), timeout=60)
        assert not is_gone(worker) and not is_gone(child)
        at_kill: list[bool] = []
        at_dead: list[bool] = []
        # The bench's clock starts at the first signal, after the node's processes are found, as the torchft
        # side's starts right before its one SIGKILL: called once, while everything still lived. ``at_dead`` is
        # called once, when both are gone.
        cluster.kill(node, at_kill=lambda: at_kill.append(is_gone(worker) or is_gone(child)),
                     at_dead=lambda: at_dead.append(is_gone(worker) and is_gone(child)))
        assert at_kill == [False]
        assert at_dead == [True]
        # Already dead when kill() returns. Ray's remove_node alone kills only the node's Ray processes: its
        # workers (and what they started) lived on until they noticed, ~0.7 s of training after the "kill".
        assert is_gone(worker) and is_gone(child), [process_line(pid) for pid in (worker, child)]
    finally:
        ray.shutdown()
        cluster.shutdown()
