"""The agent hands over to the next training process as soon as the failed one says it leaves, not when its
exit completes (a torch process takes ~30 ms to exit: on the critical path of every re-formation). On a GPU it
waits for the exit, which frees the old process's device memory."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from types import SimpleNamespace

import pytest
from processes import is_gone

from meridian.workers.contracts.config import TrainConfig
from meridian.workers.contracts.model_config import model_preset
from meridian.workers.elastic.agent import Agent
from meridian.workers.elastic.pipe import send
from meridian.workers.elastic.protocol import LEAVING, RESTART_EXIT_CODE


def _fails_and_exits_slowly(conn) -> None:
    send(conn, (LEAVING,))
    time.sleep(3.0)  # a slow exit (a big process's takes tens of ms; this leaves a wide margin)
    os._exit(RESTART_EXIT_CODE)


def _finishes(conn, first_pid: int) -> None:
    send(conn, ("done", not is_gone(first_pid)))  # was the failed process still exiting?


def _fails_slowly_then(ctx, then):
    """A ``_take_standby`` for the agent whose first process fails and exits slowly and whose next ones run
    ``then(conn, first_pid)``; each "standby" starts when the agent takes it, the moment of the handover. Also
    returns the list of the processes started."""
    started: list = []

    def take_standby():
        parent, child = ctx.Pipe()
        target, args = (_fails_and_exits_slowly, (child,)) if not started else (then, (child, started[0].pid))
        proc = ctx.Process(target=target, args=args)
        proc.start()
        child.close()
        started.append(proc)
        return SimpleNamespace(conn=parent, proc=proc)

    return take_standby, started


@pytest.mark.parametrize("device, handed_over_early", [("cpu", True), ("cuda:0", False)])
def test_the_next_process_starts_while_the_failed_one_still_exits(device, handed_over_early):
    ctx = mp.get_context("fork")
    cfg = TrainConfig(job_id="handover-test", model=model_preset("nano"), steps=2, global_batch=2, micro_batch=1,
                      datacenters=("a",))  # fmt: skip
    agent = Agent(cfg, lambda *a: None, worker_id="w0", datacenter="a",
                  node_id="n0", address="127.0.0.1", device=device, threads=1)  # fmt: skip
    agent._take_standby, started = _fails_slowly_then(ctx, _finishes)
    still_exiting = agent.run()
    assert still_exiting is handed_over_early
    assert agent.restarts == 1 and started[0].exitcode == RESTART_EXIT_CODE  # reaped either way


def _joins_and_times_the_reply(conn, first_pid: int) -> None:
    from meridian.workers.elastic.pipe import recv

    began = time.monotonic()
    send(conn, ("call", "join", ()))
    recv(conn)
    send(conn, ("done", {"reply_s": time.monotonic() - began, "first_still_exiting": not is_gone(first_pid)}))


def test_the_next_process_is_served_while_the_failed_one_still_exits():
    ctx = mp.get_context("fork")
    cfg = TrainConfig(job_id="serve-test", model=model_preset("nano"), steps=2, global_batch=2, micro_batch=1,
                      datacenters=("a",))  # fmt: skip
    agent = Agent(cfg, lambda *a: "assigned", worker_id="w0", datacenter="a", node_id="n0", address="127.0.0.1",
                  threads=1)  # fmt: skip
    agent._take_standby, started = _fails_slowly_then(ctx, _joins_and_times_the_reply)
    out = agent.run()
    # its join was relayed at once (the failed process takes 3 s to exit), not after the agent had reaped it
    assert out["first_still_exiting"] and out["reply_s"] < 1.5, out
    assert started[0].exitcode == RESTART_EXIT_CODE  # and it was reaped all the same


def _fails_with(conn, text: str) -> None:
    send(conn, ("error", text))
    os._exit(1)


NESTED = """Traceback (most recent call last):
  File "/x/child.py", line 87, in main
    result = trainer.run()
  File "/x/shards.py", line 12, in read
    raise OSError(28, "No space left on device")
OSError: [Errno 28] No space left on device
"""


def test_a_training_failure_names_the_exception_first_and_the_job_says_it(tmp_path):
    from meridian.service.runner.train_run import describe_failure as _describe_failure
    from meridian.workers.elastic.agent import raised

    ctx = mp.get_context("fork")
    cfg = TrainConfig(job_id="error-test", model=model_preset("nano"), steps=2, global_batch=2, micro_batch=1,
                      datacenters=("a",))  # fmt: skip
    agent = Agent(cfg, lambda *a: None, worker_id="w0", datacenter="a", node_id="n0", address="127.0.0.1", threads=1)

    def take_standby():
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_fails_with, args=(child, NESTED))
        proc.start()
        child.close()
        return SimpleNamespace(conn=parent, proc=proc)

    agent._take_standby = take_standby
    with pytest.raises(RuntimeError) as failure:
        agent.run()
    first = str(failure.value).splitlines()[0]
    assert first == "training failed: OSError: [Errno 28] No space left on device"
    # what the job's message says (the runner's one paragraph): the cause, not "training failed:" alone
    assert "No space left on device" in _describe_failure(f"RuntimeError: {failure.value}")
    assert raised("Traceback (most recent call last):\n  File 'x'\nValueError: bad\n  more of it\n") == "ValueError: bad"
    assert raised("KeyboardInterrupt") == "KeyboardInterrupt" and raised("") == "(no message)"


def _widens_then_finishes(conn, every: int) -> None:
    send(conn, ("cadence", every))
    send(conn, ("done", None))


def test_the_agent_keeps_the_snapshot_cadence_for_the_next_training_process():
    ctx = mp.get_context("fork")
    cfg = TrainConfig(job_id="cadence-test", model=model_preset("nano"), steps=2, global_batch=2, micro_batch=1,
                      datacenters=("a",))  # fmt: skip
    agent = Agent(cfg, lambda *a: None, worker_id="w0", datacenter="a", node_id="n0", address="127.0.0.1", threads=1)
    assert agent.ids["snapshot_every"] == 1  # what its first training process joins with

    def take_standby():
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_widens_then_finishes, args=(child, 17))
        proc.start()
        child.close()
        return SimpleNamespace(conn=parent, proc=proc)

    agent._take_standby = take_standby
    agent.run()
    assert agent.ids["snapshot_every"] == 17  # a restarted process would join with it
