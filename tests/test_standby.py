"""Standby training processes: on CPU forked from a zygote that imported the training stack once, so a standby
costs a fork instead of seconds of imports beside training; tied to their agent's life either way."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time

import pytest
from processes import is_gone, process_line, sleep_tied_to_agent

from meridian.workers.elastic.standby import Standby, standby_context

DEATH_TIMEOUT_S = 10.0


def _report_imports(conn) -> None:
    """What a new process of this context has imported before it imports anything itself."""
    conn.send({"torch": "torch" in sys.modules, "trainer": "meridian.workers.elastic.trainer" in sys.modules,
               "parent": os.getppid()})  # fmt: skip
    conn.close()


@pytest.mark.parametrize("device, preloaded", [("cpu", True), ("cuda:0", False)])
def test_a_cpu_standby_starts_with_the_training_stack_imported_and_a_gpu_one_is_spawned(device, preloaded):
    ctx = standby_context(device)
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_report_imports, args=(there,))
    proc.start()
    there.close()
    assert here.poll(120), "the new process never reported"
    seen = here.recv()
    proc.join(10)
    assert seen["torch"] is preloaded and seen["trainer"] is preloaded
    # Forked by the zygote (the fork server), not by this process; a spawned one is this process's child.
    assert (seen["parent"] != os.getpid()) is preloaded


def _agent_with_a_busy_child(conn, device: str) -> None:
    """An agent whose training process (forked from the zygote on CPU, spawned for a GPU) is busy, not reading
    its pipe; the agent waits to be killed."""
    ctx = standby_context(device)
    child = ctx.Process(target=sleep_tied_to_agent, args=(os.getpid(), conn), daemon=True)
    child.start()
    time.sleep(600)


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_a_training_process_dies_with_its_agent(device):
    """Even while it is not reading the pipe that would tell it. A forked one's parent is the fork server, which
    outlives the agent while the processes it forked live: it must watch the agent itself. A spawned one is the
    agent's child, and the kernel ends it."""
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    agent = ctx.Process(target=_agent_with_a_busy_child, args=(there, device))
    agent.start()
    child_pid = None
    try:
        assert here.poll(120), "the training process never said its pid"
        child_pid = here.recv()
        assert not is_gone(child_pid)
        os.kill(agent.pid, signal.SIGKILL)
        deadline = time.monotonic() + DEATH_TIMEOUT_S
        while not is_gone(child_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert is_gone(child_pid), f"the training process outlived its agent: {process_line(child_pid)}"
    finally:
        agent.kill()
        agent.join(5)
        if child_pid is not None and not is_gone(child_pid):
            os.kill(child_pid, signal.SIGKILL)


def test_a_standby_that_could_not_start_says_so_when_told_to_go():
    class NoProcesses:  # a context whose processes cannot start (out of memory, a full process table)
        def Pipe(self):  # noqa: N802 - multiprocessing's name
            return mp.Pipe()

        def Process(self, **kw):  # noqa: N802
            class Refuses:
                def start(self):
                    raise OSError(11, "Resource temporarily unavailable")

            return Refuses()

    standby = Standby(NoProcesses(), "w-test")
    with pytest.raises(OSError, match="did not start"):
        standby.go("anything")
    standby.discard()  # nothing to stop: returns


def test_a_standby_whose_fork_server_died_under_its_start_starts_on_a_new_one():
    class DyingForkServer:  # the first start finds the fork server's connection closed; multiprocessing starts anew
        def __init__(self):
            self.ctx, self.starts = mp.get_context("forkserver"), 0

        def Pipe(self):  # noqa: N802 - multiprocessing's name
            return self.ctx.Pipe()

        def Process(self, **kw):  # noqa: N802
            proc, outer = self.ctx.Process(**kw), self

            class FirstStartFails:
                pid = property(lambda self: proc.pid)

                def start(self):
                    outer.starts += 1
                    if outer.starts == 1:
                        raise EOFError("unexpected EOF")
                    proc.start()

                def join(self, timeout=None):
                    proc.join(timeout)

                def is_alive(self):
                    return proc.is_alive()

            return FirstStartFails()

    ctx = DyingForkServer()
    standby = Standby(ctx, "w-test")
    standby.started()  # no error: the second start worked
    assert ctx.starts == 2 and standby.proc.pid is not None
    standby.discard()  # it reads EOF and exits
    assert not standby.proc.is_alive()


JOINER_START = """
import os
import sys
import ray
from meridian.service.runner.replacements import _ReplacementWorker  # what a replacement actor's process unpickles
from meridian.workers import entry
from meridian.workers.elastic.agent import Agent
from meridian.workers.distributed.devices import backend_for

ray.get_gpu_ids = lambda: {gpus}
if {visible!r} is None:
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
else:
    os.environ["CUDA_VISIBLE_DEVICES"] = {visible!r}
device = entry._device()
print(device, backend_for(device), "torch" in sys.modules, "ray.train" in sys.modules)
"""


@pytest.mark.parametrize("gpus, visible, device, backend", [
    ([], None, "cpu", "gloo"),
    ([3], "3", "cuda:0", "cpu:gloo,cuda:nccl"),  # a replacement: Ray shows it its own GPU
    ([3], "1,3", "cuda:1", "cpu:gloo,cuda:nccl"),  # a Train worker: Ray Train shows it every GPU of its node
    ([2], None, "cuda:2", "cpu:gloo,cuda:nccl"),  # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES: all are seen
])  # fmt: skip
def test_a_worker_picks_its_device_and_agent_without_importing_torch(gpus, visible, device, backend):
    """A worker's own process (a Train worker or a replacement) stays torch-free up to its agent: its training
    process (the zygote) imports torch beside it, and on a node shared with training a second import was most of
    a joiner's start. The device is the index Ray Train's ``get_device`` gives, without ``ray.train.torch``."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", JOINER_START.format(gpus=gpus, visible=visible)], capture_output=True,
                         text=True, timeout=120, check=True)  # fmt: skip
    assert out.stdout.split() == [device, backend, "False", "False"], out.stdout + out.stderr


AGENT_RECEIVES = """
import sys
from ray import cloudpickle
from meridian.workers.elastic.agent import Agent

for blob in {blobs!r}:
    got = cloudpickle.loads(blob)
config = cloudpickle.loads({config!r})
with config.train_func_context():
    pass
print(config.backend, config.framework, config.backend_cls.has_replica_groups, "torch" in sys.modules,
      "ray.train.torch" in sys.modules)
"""


@pytest.mark.parametrize("use_gpu, backend", [(False, "gloo"), (True, "nccl")])
def test_an_agent_unpickles_what_it_is_sent_without_importing_torch(use_gpu, backend):
    """What a Train worker's process unpickles — the job's backend config from Ray Train, then its training process's
    messages (the device peak, step records, the result) — imports no torch: each import cost every worker seconds
    of CPU at the job's start, and every agent again at its end, beside the training."""
    import subprocess

    from fakes import step_record
    from ray import cloudpickle

    from meridian.service.runner.train_run import _meridian_torch_config
    from meridian.workers.contracts.records import DevicePeak, TrainResult

    messages = [("peak", DevicePeak(flops=1e12, source="measured")), ("progress", step_record(3, 4, 2.5)),
                ("done", TrainResult(first_loss=5.0, final_loss=2.0, eval_loss=2.1, steps=4, tokens_per_s=1e3,
                                     inter_dc_bytes_per_step=1e6))]  # fmt: skip
    script = AGENT_RECEIVES.format(blobs=[cloudpickle.dumps(m) for m in messages],
                                   config=cloudpickle.dumps(_meridian_torch_config(use_gpu)))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == [backend, "None", "True", "False", "False"], out.stdout + out.stderr
