"""Heartbeats leave a training process in batches, and reach the runner in one call per batch.

Two heartbeats per rank per step, each its own pipe message and Ray call, cost the job's runner and agents
~19% of the CPU of a job with 50 ms steps on two cores (``bench recovery``)."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from types import SimpleNamespace

from meridian.workers.contracts.config import TrainConfig
from meridian.workers.contracts.model_config import model_preset
from meridian.workers.elastic.agent import Agent
from meridian.workers.elastic.child import PipeClient, PipeSink
from meridian.workers.elastic.pipe import recv, send


class Told:
    """A PipeClient stand-in that records what the sink tells, with when."""

    def __init__(self) -> None:
        self.messages: list[tuple[float, tuple]] = []
        self.lock = threading.Lock()

    def tell(self, kind, *payload) -> None:
        with self.lock:
            self.messages.append((time.monotonic(), (kind, *payload)))


def beat(step: int, phase: str = "done") -> dict:
    return {"rank": 0, "phase": phase, "step": step, "time": float(step)}


def test_beats_of_many_steps_leave_as_one_message_and_none_is_lost():
    told = Told()
    sink = PipeSink(told, beats_every_s=0.2)
    started = time.monotonic()
    for step in range(1, 41):  # 40 steps' beats well within one period
        sink.rank_step(beat(step, "computed"))
        sink.rank_step(beat(step))
    deadline = time.monotonic() + 5
    while not told.messages and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(told.messages) == 1
    at, (kind, beats) = told.messages[0]
    assert kind == "beats" and len(beats) == 80 and beats[-1] == beat(40)
    assert 0.15 <= at - started < 2.0  # sent by the period, not at once and not held back
    sink.rank_step(beat(41))
    sink.close()  # what is left goes before the process says it is done
    assert [m[1][0] for m in told.messages] == ["beats", "beats"] and told.messages[1][1][1] == [beat(41)]
    sink.rank_step(beat(42))
    time.sleep(0.3)
    assert len(told.messages) == 2  # closed: no thread sends any more


def test_an_idle_sink_sends_nothing():
    told = Told()
    sink = PipeSink(told, beats_every_s=0.05)
    time.sleep(0.3)
    sink.close()
    assert told.messages == []


def _child_sends_beats(conn) -> None:
    sink = PipeSink(PipeClient(conn), beats_every_s=0.05)
    for step in range(1, 6):
        sink.rank_step(beat(step))
    sink.close()
    send(conn, ("done", None))


class BatchSink:
    def __init__(self) -> None:
        self.calls: list[list[dict]] = []

    def step(self, record) -> None:
        pass

    def rank_steps(self, beats) -> None:
        self.calls.append(beats)


class OneByOneSink:
    def __init__(self) -> None:
        self.beats: list[dict] = []

    def step(self, record) -> None:
        pass

    def rank_step(self, b) -> None:
        self.beats.append(b)


def _agent(sink) -> Agent:
    cfg = TrainConfig(job_id="beats-test", model=model_preset("nano"), steps=2, global_batch=2, micro_batch=1,
                      datacenters=("a",))  # fmt: skip
    return Agent(cfg, lambda *a: None, worker_id="w0", datacenter="a", node_id="n0", address="127.0.0.1",
                 sink=sink, threads=1)  # fmt: skip


def test_the_agent_relays_a_training_process_batch_in_one_call():
    ctx = mp.get_context("fork")
    for sink in (BatchSink(), OneByOneSink()):
        agent = _agent(sink)
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_child_sends_beats, args=(child,))
        proc.start()
        child.close()
        agent._take_standby = lambda: SimpleNamespace(conn=parent, proc=proc)  # noqa: B023 - used at once
        agent._standby = SimpleNamespace(discard=lambda: None)  # no next process to start for this test
        assert agent.run() is None
        proc.join(10)
        if isinstance(sink, BatchSink):
            assert sum(len(c) for c in sink.calls) == 5 and len(sink.calls) <= 2, sink.calls
            assert [b["step"] for c in sink.calls for b in c] == [1, 2, 3, 4, 5]
        else:  # a sink without batches still gets every beat, in order
            assert [b["step"] for b in sink.beats] == [1, 2, 3, 4, 5]


def test_a_pipe_message_carries_the_whole_batch():
    parent, child = mp.Pipe()
    sink = PipeSink(PipeClient(child), beats_every_s=60)
    for step in range(3):
        sink.rank_step(beat(step))
    sink.flush()
    assert recv(parent) == ("beats", [beat(0), beat(1), beat(2)])
    sink.close()


class CountingExport:
    def __init__(self) -> None:
        self.exports = 0

    def export(self, _state) -> None:
        self.exports += 1


def _runner():
    from fakes import job_runner

    return job_runner(CountingExport())


def test_the_runner_takes_a_rank_s_batch_and_stamps_it_with_its_own_clock():
    r = _runner()
    before = time.time()
    r.push_heartbeats([{"rank": 1, "phase": "computed", "step": 7, "time": 5.0},
                       {"rank": 1, "phase": "done", "step": 7, "step_s": 0.05, "data_s": 0.0, "compute_s": 0.04,
                        "sync_wait_s": 0.01, "time": 5.1}])  # fmt: skip
    view = r._reports.metrics.beats()[1]
    assert view.step == 7 and view.computed == 7 and view.at >= before and view.compute_s == (0.04,)
    assert r._reports.metrics.recent_step_s() == [0.05]


def test_step_records_push_the_metrics_at_most_every_half_second():
    from fakes import step_record

    from meridian.service.runner.reports import EXPORT_EVERY_S

    r = _runner()
    for s in range(1, 21):  # 20 records of 50 ms steps, arriving at once
        r.push_progress([step_record(s, 10, 0.05)])
    assert r._reports._exporter.exports == 1
    time.sleep(EXPORT_EVERY_S)
    r.push_progress([step_record(21, 10, 0.05)])
    assert r._reports._exporter.exports == 2
    r.poll(0)  # the service's poll exports whatever is newer
    assert r._reports._exporter.exports == 3
