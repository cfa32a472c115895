"""A job that a worker fails (an error restarting cannot fix) leaves no snapshot folder in RAM: the runner stops
the other workers first and sweeps after, as a cancel does.

Why: the runner swept the job's folders, then stopped the others. Meanwhile their collectives had failed with the
failing rank and their next training processes had each made their folder again, which the stop (a kill) left
behind. Reproduced through ``meridian serve`` on the embedded cluster: one of four ranks' snapshot folder replaced
by a file, so its next snapshot write failed; the job failed and two empty ``meridian-snapshots.<job>.<worker>``
folders, made 0.3 s after the sweep, were still in ``/dev/shm`` 18 s later.
"""

from __future__ import annotations

import ray
from ray.exceptions import RayActorError

from meridian.service.runner import actor
from meridian.service.runner.actor import JobRunner
from meridian.service.runner.poll import RunnerState


class _Ref:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def remote(self) -> _Ref:
        self.log.append(self.name)
        return self


class _Controller:
    """A controller handle whose ``abort`` the runner asks for (and which ends its process, so the call fails)."""

    def __init__(self, log: list[str]) -> None:
        self.abort, self.get_state = _Ref(log, "abort"), _Ref(log, "get_state")
        self._actor_id = bytes.fromhex("c0ffee")


def test_a_failed_job_is_swept_after_its_workers_were_stopped(monkeypatch) -> None:
    log: list[str] = []
    plan = type("P", (), {"rank_datacenters": ("dc-a", "dc-b")})()
    runner = JobRunner("j1", {}, plan, "/tmp/unused")

    def get(ref, timeout=None):
        if ref.name == "abort":
            raise RayActorError()  # abort() ends the controller's process: the call "fails"
        return "RunningState"

    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "kill", lambda handle, no_restart=True: log.append("kill"))
    monkeypatch.setattr(actor, "sweep_snapshots", lambda job_id: log.append("sweep") or [])
    runner.set_controller(_Controller(log))

    runner.fail("OSError: [Errno 28] No space left on device")

    assert "abort" in log and "sweep" in log
    assert log.index("abort") < log.index("sweep"), f"swept before the other workers were stopped: {log}"
    assert runner.coordinator.closed
    poll = runner.poll(0)
    assert poll.state is RunnerState.FAILED and "No space left on device" in poll.error


def test_the_run_ending_after_the_stop_keeps_the_workers_error(monkeypatch) -> None:
    """The aborted run's own end (its fit thread) must not replace the failing worker's error with its own."""
    plan = type("P", (), {"rank_datacenters": ("dc-a",)})()
    runner = JobRunner("j2", {}, plan, "/tmp/unused")
    monkeypatch.setattr(actor, "sweep_snapshots", lambda job_id: [])
    monkeypatch.setattr(runner, "_stop_training", lambda: runner._run())  # the run ends while fail() stops it
    monkeypatch.setattr(runner, "_fit", lambda attempt: RuntimeError("the Train run was aborted"))

    runner.fail("ValueError: bad data")

    poll = runner.poll(0)
    assert poll.state is RunnerState.FAILED and "bad data" in poll.error, poll.error
