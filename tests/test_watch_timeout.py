"""`meridian submit --watch` and `meridian watch` follow a job until it ends, however long it runs, unless
``--timeout`` is given: a multi-day job is not reported as failed after an hour."""

from __future__ import annotations

import json

import pytest

from meridian.api.client import ApiError
from meridian.cli import main as cli


class SlowJobClient:
    """A job that stays running for ``polls`` reads, then succeeds; the clock moves an hour per read. Its event
    stream ends at once each time (as a dropped stream does), so the watch reads the job between streams."""

    def __init__(self, polls: int, clock: list[float]) -> None:
        self.polls, self.reads, self.clock = polls, 0, clock

    def job(self, job_id: str) -> dict:
        self.reads += 1
        self.clock[0] += 3600.0
        state = "running" if self.reads <= self.polls else "succeeded"
        return {"id": job_id, "state": state, "message": "", "name": "long", "progress": {"step": self.reads,
                "total_steps": self.polls + 1}}

    def events(self, job_id: str, **params) -> dict:
        return {"events": []}

    def stream_events(self, job_id: str, after: int = 0, *, reconnects: int = 5):
        return iter(())


@pytest.fixture
def hours(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(cli.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(cli.time, "sleep", lambda s: None)
    return clock


def test_watch_without_a_timeout_follows_a_job_for_days(hours, capsys):
    client = SlowJobClient(polls=72, clock=hours)  # three days of hourly reads
    job = cli.watch(client, "j1", as_json=True, timeout_s=None)
    assert job["state"] == "succeeded" and client.reads == 73 and hours[0] == 73 * 3600.0
    states = [json.loads(line)["state"] for line in capsys.readouterr().out.splitlines()]
    assert states[0] == "running" and states[-1] == "succeeded"


def test_watch_with_a_timeout_gives_up_saying_the_job_keeps_running(hours):
    client = SlowJobClient(polls=72, clock=hours)
    with pytest.raises(ApiError, match="still running after 7200 s.*keeps running") as e:
        cli.watch(client, "j1", as_json=True, timeout_s=7200)
    assert e.value.problem["type"].endswith("watch-timeout") and client.reads == 3


@pytest.mark.parametrize("argv", [["submit", "job.json", "--watch"], ["watch", "j1"]])
def test_the_verbs_default_to_no_timeout(argv):
    args = cli.build_parser().parse_args(argv)
    assert args.timeout is None
    assert cli.build_parser().parse_args([*argv, "--timeout", "60"]).timeout == 60.0
