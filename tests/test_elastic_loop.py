"""The elastic training loop on real processes, without Ray: lose a rank, gain one, keep the maths.

Workers are separate processes; the coordinator runs in a ``multiprocessing`` manager server (standing in
for the job's runner actor). A rank dies with ``os._exit`` right after a step, as a killed node's worker
would: the survivors' collectives fail, they tear down, re-form without it and resume from the shards they
hold in memory. The final parameters must match an uninterrupted run with the same data order.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import threading
import time
import uuid
from dataclasses import replace
from multiprocessing.managers import BaseManager
from statistics import median
from typing import Any

import pytest
import torch

from meridian.service.runner.coordinator import Coordinator
from meridian.workers.contracts.config import OptimConfig, SyncConfig, TrainConfig
from meridian.workers.contracts.model_config import model_preset
from meridian.workers.distributed.multiproc import run_processes
from meridian.workers.distributed.zygote import zygote_context, zygote_process
from meridian.workers.elastic.agent import Agent
from meridian.workers.elastic.protocol import REFORM_ENV
from meridian.workers.loop.train import ListSink, train
from meridian.workers.state.snapshot_paths import remove_snapshot_dirs, snapshot_dir

STEPS = 8
LONG_STEPS = 200
TIMEOUT_S = 240


def job(datacenters=("dc-a", "dc-a", "dc-b", "dc-b"), steps=STEPS, job_id="elastic-test", snapshot_every=1) -> TrainConfig:
    return TrainConfig(
        job_id=job_id, model=model_preset("nano"), steps=steps, global_batch=8, micro_batch=2,
        datacenters=datacenters, optim=OptimConfig(warmup_steps=1), snapshot_every=snapshot_every,
        sync=SyncConfig(overlap=True, bucket_mb=0.05, inter_dc_chunk_mb=0.02),
    )  # fmt: skip


class RecordingCoordinator(Coordinator):
    def __init__(self, **kw) -> None:
        self.log: list[tuple] = []
        super().__init__(on_event=lambda *e: self.log.append(e), **kw)

    def kill_after_step(self, i: int, cfg: TrainConfig, step: int) -> None:
        """SIGKILL worker ``i`` (its agent; the training child dies with it) once it has finished ``step``."""
        _wait_for_step(cfg, f"w{i}", step)
        os.kill(self.procs[i].pid, signal.SIGKILL)

    def events(self) -> list[tuple]:
        return list(self.log)


class TakenStorePortCoordinator(RecordingCoordinator):
    """Hands epoch ``epoch`` a store port that something else holds (once an outgoing connection's ephemeral
    port could take rank 0's; now every joiner binds its store while it joins, but a port mix-up must still not
    hang the job): rank 0 does not host it (it leaves and rejoins), and its peers retry connecting to a port
    where nothing listens until their collective timeout, unless they are told to stop."""

    def __init__(self, *, epoch: int, **kw) -> None:
        super().__init__(**kw)
        self.taken_epoch = epoch
        self.holder = socket.socket()
        self.holder.bind(("", 0))  # bound, never listening: connects are refused, binds fail

    def _assignment_locked(self, wid, known_epoch):
        a = super()._assignment_locked(wid, known_epoch)
        if a is not None and a.epoch == self.taken_epoch:
            a = replace(a, master_port=self.holder.getsockname()[1])
        return a


class HeldFinishCoordinator(RecordingCoordinator):
    """Holds worker ``held``'s first ``finish`` call until :meth:`release_finish`, then drops it: the worker's
    training process is killed in that window (it trained the last step, its finish never arrives)."""

    def __init__(self, *, held: str, **kw) -> None:
        super().__init__(**kw)
        self.held, self._holding, self._released = held, threading.Event(), threading.Event()

    def finish(self, worker_id: str) -> None:
        if worker_id != self.held or self._holding.is_set():
            return super().finish(worker_id)
        self._holding.set()
        self._released.wait(TIMEOUT_S)

    def holding_finish(self) -> bool:
        return self._holding.is_set()

    def release_finish(self) -> None:
        self._released.set()


_SERVER: dict[str, RecordingCoordinator] = {}


def _coordinator(planned: int = 0, taken_store_epoch: int = 0, hold_finish: str = "",
                 grace_s: float = 3.0) -> RecordingCoordinator:
    """The one coordinator of this manager's server process (created by the first call, which names the size)."""
    if "c" not in _SERVER:
        kw = {"planned_workers": planned, "min_workers": 1, "dc_order": ("dc-a", "dc-b")}
        if taken_store_epoch:
            _SERVER["c"] = TakenStorePortCoordinator(epoch=taken_store_epoch, grace_s=REJOIN_GRACE_S, **kw)
        elif hold_finish:
            _SERVER["c"] = HeldFinishCoordinator(held=hold_finish, grace_s=grace_s, **kw)
        else:
            _SERVER["c"] = RecordingCoordinator(grace_s=grace_s, **kw)
    return _SERVER["c"]


REJOIN_GRACE_S = 9.0
"""The grace for runs where every member is expected back: a stopped member's next process (or a member whose
collective failed when a peer died) needs a few seconds to rejoin on a loaded machine, and one that misses a 3 s
grace is left out of the epoch (seen in CI: a survivor re-formed out of the job after a peer's process was killed).
The wait ends as soon as every member is back, so a quiet machine does not pay it."""


class CoordinatorManager(BaseManager):
    pass


CoordinatorManager.register("coordinator", _coordinator)


def _elastic_worker(i, dc, address, cfg, results, kill_children=(), freeze_after=0, frozen_pids=None,
                    kill_in_finish=False, sample_child=False):
    """One worker's agent. ``kill_children``: SIGKILL its training processes (not the agent), the n-th one it
    starts once that one has trained step ``kill_children[n]`` (``0``: at once, before it trains).
    ``freeze_after``: once it has trained that step, SIGSTOP its training process and then itself, as a host that
    lost its power stops (sockets open, nothing answers); their pids go to ``frozen_pids``. ``kill_in_finish``:
    SIGKILL its training process while the coordinator holds its ``finish`` call (:class:`HeldFinishCoordinator`).
    ``sample_child``: record its training process's open files and threads every 10 ms, by epoch."""
    manager = CoordinatorManager(address=address, authkey=AUTHKEY)
    manager.connect()
    coordinator = manager.coordinator()

    def call(method, *args):
        return getattr(coordinator, method)(*args)

    sink, events = ListSink(), []
    agent = Agent(cfg, call, worker_id=f"w{i}", datacenter=dc, node_id=f"node-{i}", address="127.0.0.1",
                  sink=sink, join_timeout_s=120, collective_timeout_s=60, threads=1, keep_params=True,
                  on_event=lambda *e: events.append(e))  # fmt: skip
    if kill_children:
        threading.Thread(target=_kill_children, args=(agent, cfg, f"w{i}", kill_children), daemon=True).start()
    if freeze_after:
        threading.Thread(target=_freeze, args=(agent, cfg, f"w{i}", freeze_after, frozen_pids), daemon=True).start()
    if kill_in_finish:
        threading.Thread(target=_kill_in_finish, args=(agent, coordinator), daemon=True).start()
    usage: dict[int, dict[str, Any]] = {}
    done = threading.Event()
    if sample_child:
        threading.Thread(target=_sample_child, args=(agent, usage, done), daemon=True).start()
    try:
        result, error = agent.run(), None
    except RuntimeError as e:
        result, error = None, str(e)
    done.set()
    results.put((i, pickle.dumps({"result": result, "records": sink.records, "restarts": agent.restarts,
                                  "recoveries": agent.recoveries, "events": events, "error": error,
                                  "child_usage": dict(usage)})))  # fmt: skip


def _sample_child(agent: Agent, usage: dict[int, dict[str, Any]], done: threading.Event) -> None:
    """Every 10 ms: the training process's open files and threads in each epoch it trained."""
    while not done.wait(0.01):
        child, epoch = agent._child, agent.ids["epoch"]
        if child is None or agent._joining or not epoch:
            continue
        try:
            files = len(os.listdir(f"/proc/{child.pid}/fd"))
            threads = len(os.listdir(f"/proc/{child.pid}/task"))
        except (OSError, ValueError):  # it ended between the lookups
            continue
        seen = usage.setdefault(epoch, {"pid": child.pid, "files": [], "threads": []})
        seen["files"].append(files)
        seen["threads"].append(threads)


def _freeze(agent: Agent, cfg: TrainConfig, worker_id: str, step: int, frozen_pids) -> None:
    _wait_for_step(cfg, worker_id, step)
    child = agent._child
    frozen_pids.put(child.pid)
    frozen_pids.put(os.getpid())
    # Flushed before stopping: a queue's feeder thread stops with its process, and a pid it had not sent yet left
    # the stopped training process (and its zygote) alive after the test; every run of this test leaked ~0.6 GB.
    frozen_pids.close()
    frozen_pids.join_thread()
    os.kill(child.pid, signal.SIGSTOP)
    os.kill(os.getpid(), signal.SIGSTOP)


def _kill_in_finish(agent: Agent, coordinator) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not coordinator.holding_finish():
        assert time.monotonic() < deadline, "the finish call never came"
        time.sleep(0.01)
    os.kill(agent._child.pid, signal.SIGKILL)
    agent._child.join(10)
    coordinator.release_finish()


def _kill_children(agent: Agent, cfg: TrainConfig, worker_id: str, after_steps: tuple[int, ...]) -> None:
    seen = set()
    for step in after_steps:
        while (child := agent._child) is None or child.pid in seen:
            time.sleep(0.001)
        seen.add(child.pid)
        if step:
            _wait_for_step(cfg, worker_id, step)
        os.kill(child.pid, signal.SIGKILL)


AUTHKEY = b"meridian-test"


class ElasticRun:
    """The coordinator server and the worker processes of one test run."""

    def __init__(self, planned: int, taken_store_epoch: int = 0, hold_finish: str = "", grace_s: float = 3.0) -> None:
        self.manager = CoordinatorManager(address=("127.0.0.1", 0), authkey=AUTHKEY)
        self.manager.start()
        self.coordinator = self.manager.coordinator(planned, taken_store_epoch, hold_finish, grace_s)
        self.ctx = zygote_context()  # the workers are forks of the zygote (zygote_process in start)
        self.results = self.ctx.Queue()
        self.frozen = self.ctx.Queue()
        """Pids of processes a test stopped (SIGSTOP): killed by :meth:`close`."""
        self.procs: dict[int, mp.Process] = {}
        self.job_ids: set[str] = set()

    def start(self, i: int, dc: str, cfg: TrainConfig, kill_children: tuple[int, ...] = (), freeze_after: int = 0,
              kill_in_finish: bool = False, sample_child: bool = False) -> None:
        p = zygote_process(_elastic_worker, (i, dc, self.manager.address, cfg, self.results, kill_children,
                                             freeze_after, self.frozen, kill_in_finish, sample_child), daemon=False)
        p.start()
        self.procs[i] = p
        self.job_ids.add(cfg.job_id)

    def collect(self, expected: set[int]) -> dict[int, dict]:
        out: dict[int, dict] = {}
        deadline = time.monotonic() + TIMEOUT_S
        while set(out) < expected:
            try:
                i, value = self.results.get(timeout=1)
                out[i] = pickle.loads(value)
            except queue.Empty:
                died = [i for i in expected - set(out) if self.procs[i].exitcode not in (None, 0)]
                assert not died, f"workers {died} died: {[self.procs[i].exitcode for i in died]}"
                assert time.monotonic() < deadline, f"workers {sorted(expected - set(out))} did not finish"
        return out

    def kill_after_step(self, i: int, cfg: TrainConfig, step: int) -> None:
        """SIGKILL worker ``i`` (its agent; the training child dies with it) once it has finished ``step``."""
        _wait_for_step(cfg, f"w{i}", step)
        os.kill(self.procs[i].pid, signal.SIGKILL)

    def events(self) -> list[tuple]:
        return self.coordinator.events()

    def close(self) -> None:
        while not self.frozen.empty():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.frozen.get(), signal.SIGKILL)
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
            p.join(5)
        self.manager.shutdown()
        for job_id in self.job_ids:
            remove_snapshot_dirs(job_id)  # a killed worker's folder outlives it


@pytest.fixture
def elastic_run():
    runs: list[ElasticRun] = []

    def make(planned: int, **kw) -> ElasticRun:
        runs.append(ElasticRun(planned, **kw))
        return runs[-1]

    yield make
    for r in runs:
        r.close()


def _unique_job_id() -> str:
    """Snapshot folders are named by job and worker id: a fresh id per run keeps a folder that an earlier,
    killed run left behind from passing for this run's progress."""
    return f"elastic-test-{uuid.uuid4().hex[:8]}"


def _wait_for_step(cfg: TrainConfig, worker_id: str, step: int) -> None:
    shard = os.path.join(snapshot_dir(cfg.job_id, worker_id), f"shard-{step:010d}.pt")
    deadline = time.monotonic() + TIMEOUT_S
    while not os.path.exists(shard):
        assert time.monotonic() < deadline, f"{worker_id} never reached step {step}"
        time.sleep(0.005)


def _reference_rank(rank, world, cfg):
    return train(cfg, sink=ListSink(), keep_params=True).final_params


@pytest.fixture(scope="module")
def reference():
    return run_processes(_reference_rank, 4, job(), timeout_s=TIMEOUT_S)[0]


def _max_rel(a, b):
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in b)


DCS = ("dc-a", "dc-a", "dc-b", "dc-b")


def _lose_w1_after_step_3(run: ElasticRun) -> tuple[dict[int, dict], list[tuple]]:
    """Four workers over two DCs; w1 (dc-a) is SIGKILLed after step 3. The survivors' results and the events."""
    cfg = job(job_id=_unique_job_id())
    for i, dc in enumerate(DCS):
        run.start(i, dc, cfg)
    run.kill_after_step(1, cfg, 3)
    return run.collect({0, 2, 3}), run.events()


def test_losing_a_rank_mid_run_reforms_on_the_survivors_and_matches_an_uninterrupted_run(
    elastic_run, reference
):
    out, events = _lose_w1_after_step_3(elastic_run(4))
    formed = [e[2] for e in events if e[0] == "epoch_formed"]
    # One re-formation for the loss, the last epoch. (On a loaded machine a first group that failed to connect
    # forms once more before any step: seen with 12 test processes on 16 cores.)
    after = next((f for f in formed if "w1" in f["lost"]), None)
    assert after is formed[-1] and "worker_lost" in [e[0] for e in events], events
    assert after["datacenters"] == ["dc-a", "dc-b", "dc-b"]
    assert after["resume_step"] >= 3  # nothing lost: the survivors held the latest step in memory
    finished = [o for o in out.values() if o["result"] is not None]
    assert len(finished) == 3 and all(o["recoveries"] == len(formed) - 1 for o in finished)
    # On CPU each survivor re-formed in its own training process: none was started again.
    assert all(o["restarts"] == 0 for o in finished), [o["restarts"] for o in finished]
    assert _max_rel(out[0]["result"].final_params, reference) < 1e-4
    # Rank 0 of the new epoch reported every step after the resume point (the victim's reports died with it).
    steps = {r.step for o in out.values() for r in o["records"] if r.epoch == after["epoch"]}
    assert steps == set(range(after["resume_step"] + 1, STEPS + 1))


def test_survivors_told_to_leave_their_process_hand_over_to_their_standbys_and_match_too(
    elastic_run, reference, monkeypatch
):
    # What every survivor does on a GPU (OnPeerFailure.EXIT), here on CPU with MERIDIAN_REFORM=new-process.
    monkeypatch.setenv(REFORM_ENV, "new-process")
    out, events = _lose_w1_after_step_3(elastic_run(4))
    formed = [e[2] for e in events if e[0] == "epoch_formed"]
    finished = [o for o in out.values() if o["result"] is not None]
    assert len(finished) == 3 and all(o["restarts"] >= 1 for o in finished), [o["restarts"] for o in finished]
    # a survivor's recoveries are its process restarts here: it sent no "recovered" message
    assert all(o["recoveries"] == o["restarts"] == len(formed) - 1 for o in finished), (formed, finished)
    assert _max_rel(out[0]["result"].final_params, reference) < 1e-4


def test_members_stuck_on_a_store_that_never_came_up_are_stopped_and_everyone_re_forms(elastic_run, reference):
    # The failure CI met: after a loss, the new rank 0 could not bind its store port (taken), left and rejoined;
    # its peers kept retrying that port, alive and silent, and were counted lost when the grace ran out.
    out, events = _lose_w1_after_step_3(elastic_run(4, taken_store_epoch=2))
    print("events:", *events, sep="\n  ")  # the whole sequence in the report, should this fail
    formed = [e[2] for e in events if e[0] == "epoch_formed"]
    stuck = [(e[2]["worker_id"], e[2]["epoch"]) for e in events if e[0] == "worker_stuck"]
    assert len(stuck) == len(set(stuck)), stuck  # each worker is told once per epoch
    # Rank 0 of epoch 2 rejoined by itself; the others were told. (On a loaded machine survivors slow to leave
    # epoch 1 after the kill may be told too: that is the same rule, and harmless.)
    assert sorted(w for w, epoch in stuck if epoch == 2) == ["w2", "w3"], stuck
    assert len(formed) == 3 and formed[2]["datacenters"] == ["dc-a", "dc-b", "dc-b"], formed
    assert formed[2]["lost"] == [] and formed[2]["resume_step"] == formed[1]["resume_step"]
    # Re-formed within seconds, not after the 60 s collective timeout the stuck ranks would otherwise wait out.
    assert formed[2]["time"] - formed[1]["time"] < 30
    finished = [o for o in out.values() if o["result"] is not None]
    assert len(finished) == 3 and all(o["recoveries"] == 2 for o in finished)
    # A stopped member's training process is started again; every other recovery stays in its process (the first
    # for all three, the store refusal for rank 0 of epoch 2).
    told = {f"w{i}": sum(1 for w, _ in stuck if w == f"w{i}") for i in out}
    assert {f"w{i}": o["restarts"] for i, o in out.items()} == told, (told, stuck)
    assert _max_rel(out[0]["result"].final_params, reference) < 1e-4


def test_snapshots_every_two_steps_resume_from_the_last_snapshot_and_train_the_rest_again(elastic_run, reference):
    run = elastic_run(4)
    cfg = job(job_id=_unique_job_id(), snapshot_every=2)
    for i, dc in enumerate(DCS):
        run.start(i, dc, cfg)
    run.kill_after_step(1, cfg, 4)  # shards exist for steps 2, 4, 6…; the survivors stop at step 4 or 5
    out = run.collect({0, 2, 3})
    formed = [e[2] for e in run.events() if e[0] == "epoch_formed"]
    # The epoch that formed without the killed worker (on a loaded machine the first epoch's group can fail to
    # connect and form again before any step, so it is not always the second).
    after = next((f for f in formed if "w1" in f["lost"]), None)
    # 4, or 2 if a survivor failed in step 4's last gather: never 3 or 5, no shard of an odd step exists. (On a
    # loaded machine a slow survivor can miss the re-formation and join the epoch after as a newcomer.)
    assert after is not None and after["resume_step"] in (2, 4), formed
    # The steps trained again change nothing; from step 2 on, 3 ranks sum in another order than 4 (measured
    # 1.1e-4 relative after 6 steps), while a lost or doubled step would be off by far more.
    finished = [o["result"] for o in out.values() if o["result"] is not None]  # a late joiner may return None
    assert finished and all(_max_rel(r.final_params, reference) < 5e-4 for r in finished)
    steps = {r.step for o in out.values() for r in o["records"] if r.epoch >= 2}
    assert steps >= set(range(after["resume_step"] + 1, STEPS + 1))


@pytest.fixture(scope="module")
def long_reference():
    return run_processes(_reference_rank, 4, job(steps=LONG_STEPS), timeout_s=TIMEOUT_S)[0]


def test_a_newcomer_joins_at_a_step_boundary_and_gets_the_state(elastic_run, long_reference):
    # Long enough that the newcomer (two interpreters and torch to start) arrives before the end.
    run = elastic_run(3)
    cfg = job(steps=LONG_STEPS, job_id=_unique_job_id())
    for i, dc in enumerate(("dc-a", "dc-b", "dc-b")):
        run.start(i, dc, cfg)
    _wait_for_step(cfg, "w0", 2)
    run.start(3, "dc-a", cfg)
    out = run.collect({0, 1, 2, 3})
    formed = [e[2] for e in run.events() if e[0] == "epoch_formed"]
    assert len(formed) == 2 and formed[1]["datacenters"] == ["dc-a", "dc-a", "dc-b", "dc-b"], formed
    assert formed[1]["newcomers"] == ["w3"] and 2 <= formed[1]["resume_step"] < LONG_STEPS
    assert all(o["result"] is not None for o in out.values())
    params = {i: out[i]["result"].final_params for i in (0, 3)}
    for name, p in params[0].items():  # the newcomer trains the same replica as everyone
        assert torch.equal(params[3][name], p), name
    # 200 steps of fp32 sums in another order (3 then 4 ranks) drift apart slowly: measured 1.5e-3
    # relative; a newcomer that started from its own initial weights would be off by O(1).
    assert _max_rel(params[0], long_reference) < 1e-2


def test_new_workers_resume_from_the_snapshots_of_a_whole_run_that_ended(elastic_run, reference):
    # Every worker ends at once while the host lives (Ray Train's controller failed and shut its workers down);
    # the runner starts new ones (a new Train run: new worker ids) and tells the coordinator to probe the old
    # members. Each new agent takes over a dead one's RAM folder, so the job resumes from those shards instead
    # of from step 0, and ends where an uninterrupted run does.
    run = elastic_run(4)
    cfg = job(job_id=_unique_job_id())
    for i, dc in enumerate(DCS):
        run.start(i, dc, cfg)
    _wait_for_step(cfg, "w0", 3)
    for i in range(4):
        os.kill(run.procs[i].pid, signal.SIGKILL)
    for i in range(4):
        run.procs[i].join(10)
    assert run.coordinator.probe_members() == {"w0", "w1", "w2", "w3"}
    for i, dc in enumerate(DCS, start=4):
        run.start(i, dc, cfg)
    out = run.collect({4, 5, 6, 7})
    formed = [e[2] for e in run.events() if e[0] == "epoch_formed"]
    resumed = next(f for f in formed if f["lost"])
    assert sorted(resumed["lost"]) == ["w0", "w1", "w2", "w3"] and sorted(resumed["newcomers"]) == ["w4", "w5", "w6", "w7"]
    assert resumed["resume_step"] >= 3 and not resumed["from_checkpoint"]
    assert all(o["result"] is not None for o in out.values())
    assert _max_rel(out[4]["result"].final_params, reference) < 1e-4


def test_a_training_process_killed_on_a_live_node_is_restarted_and_the_job_goes_on(elastic_run, reference):
    # The kernel's OOM killer, NCCL's watchdog aborting a rank whose peer died, someone's kill: the agent and
    # its node live on. The agent restarts the process, which rejoins; the job resumes from the snapshots.
    run = elastic_run(4, grace_s=REJOIN_GRACE_S)
    cfg = job(job_id=_unique_job_id())
    for i, dc in enumerate(DCS):
        run.start(i, dc, cfg, kill_children=(3,) if i == 1 else ())
    out = run.collect({0, 1, 2, 3})
    killed = [e for e in out[1]["events"] if e[0] == "training_process_killed"]
    assert len(killed) == 1 and killed[0][2]["signal"] == "SIGKILL", out[1]["events"]
    formed = [e[2] for e in run.events() if e[0] == "epoch_formed"]
    said = {i: (o["events"], o["error"]) for i, o in out.items()}
    # The restarted process rejoined: an epoch after the kill holds all four. (On a loaded machine a later break can
    # leave a slow member out of the last epoch: seen once in CI, after it; the job still ends as one process does.)
    assert any(f["datacenters"] == ["dc-a", "dc-a", "dc-b", "dc-b"] and f["resume_step"] >= 3 for f in formed), \
        (run.events(), said)
    assert all(o["result"] is not None for o in out.values()), said
    assert _max_rel(out[1]["result"].final_params, reference) < 1e-4


REPEAT_STEPS = 60


@pytest.fixture(scope="module")
def repeat_reference():
    return run_processes(_reference_rank, 4, job(steps=REPEAT_STEPS), timeout_s=TIMEOUT_S)[0]


@pytest.mark.xfail(reason="on FSDP2 each re-formation leaves ~4 files and ~3 native threads in a survivor: a model "
                          "sharded with fully_shard over a DeviceMesh keeps its gloo group's sockets and threads after "
                          "the model and the group are gone, held from C++ where gc cannot see it (reproduced with "
                          "fully_shard alone, no training step); the flat-bucket engine did not", strict=False)
def test_survivors_that_re_form_again_and_again_in_their_own_process_leak_no_files_or_threads(
    elastic_run, repeat_reference
):
    # w1's training process is killed three times; each time the others re-form with its next process in their
    # own processes (their sockets shut down, their groups and engine dropped). A group, pair
    # or thread left behind by those re-formations would add up epoch after epoch: before the collection after a
    # re-formation (ElasticTrainer.collect_last_epoch) each left 9 threads and ~10 files. Compared: each epoch's
    # steady state (the last quarter of its samples: the last epoch's groups go after the next epoch's first step)
    # against the first epoch's.
    run = elastic_run(4)
    cfg = job(steps=REPEAT_STEPS, job_id=_unique_job_id())
    for i, dc in enumerate(DCS):
        run.start(i, dc, cfg, kill_children=(3, 15, 30) if i == 1 else (), sample_child=i == 0)
    out = run.collect({0, 1, 2, 3})
    assert all(o["result"] is not None for o in out.values()), [o["error"] for o in out.values()]
    killed = [e for e in out[1]["events"] if e[0] == "training_process_killed"]
    assert len(killed) >= 2, out[1]["events"]  # (the third may come after the job's last step on a fast machine)
    formed = [e[2] for e in run.events() if e[0] == "epoch_formed"]
    last = formed[-1]["epoch"]  # (w1's agent lives: each epoch has its next process)
    survivor = out[0]
    assert survivor["restarts"] == 0 and survivor["recoveries"] >= 2, survivor
    usage = survivor["child_usage"]
    assert len({u["pid"] for u in usage.values()}) == 1, usage  # one training process throughout

    def steady(epoch: int, what: str) -> float:
        samples = usage[epoch][what]
        return median(samples[len(samples) * 3 // 4:])

    report = {e: (steady(e, "files"), steady(e, "threads")) for e in usage}
    # Measured with the collection: +8 files and +1 thread (the state exchange's) in every epoch after the first.
    # Without it (its collection and gc.freeze both taken out): +20 files and +10 threads in the second epoch, +32
    # and +19 in the third, until Python's own collector ran.
    later = [e for e in usage if e > 1]
    assert len(later) >= 2 and last in later, (report, formed)
    assert max(steady(e, "files") for e in later) <= steady(1, "files") + 12, report
    assert max(steady(e, "threads") for e in later) <= steady(1, "threads") + 3, report
    # (27+ of the 60 steps summed over three ranks, in another order than four: fp32 drift, far below O(1))
    assert _max_rel(out[0]["result"].final_params, repeat_reference) < 1e-3


def test_a_worker_whose_training_processes_die_before_training_gives_up_saying_why(elastic_run):
    run = elastic_run(1)
    run.start(0, "dc-a", job(datacenters=("dc-a",), job_id=_unique_job_id()), kill_children=(0, 0, 0))
    out = run.collect({0})[0]
    assert out["result"] is None and "killed by SIGKILL: 3 in a row died before training a step" in out["error"]
    assert [e[2]["killed_before_training"] for e in out["events"] if e[0] == "training_process_killed"] == [1, 2]


def test_a_host_that_stops_answering_is_left_behind_once_ray_reports_its_node_dead(elastic_run, reference):
    # Power or network lost: w1's processes stop with their sockets open, so its peers' collectives fail only at
    # the collective timeout (60 s here, 300 s by default). Once Ray reports its node dead (the runner's ticks do
    # that; here the test ticks), the others are told to stop and re-form without it.
    run = elastic_run(4)
    cfg = job(job_id=_unique_job_id())
    for i, dc in enumerate(DCS):
        run.start(i, dc, cfg, freeze_after=3 if i == 1 else 0)
    deadline = time.monotonic() + TIMEOUT_S
    while run.frozen.qsize() < 2:  # w1's training process and agent
        assert time.monotonic() < deadline, "w1 never reached step 3"
        time.sleep(0.01)
    frozen_at = time.time()
    stop = threading.Event()

    def ray_ticks():  # Ray has declared node-1 dead
        while not stop.wait(0.5):
            run.coordinator.tick({"node-0", "node-2", "node-3"})

    ticker = threading.Thread(target=ray_ticks, daemon=True)
    ticker.start()
    try:
        out = run.collect({0, 2, 3})
    finally:
        stop.set()
        ticker.join(5)
    events = run.events()
    stranded = sorted(e[2]["worker_id"] for e in events if e[0] == "worker_stranded")
    after = next(e[2] for e in events if e[0] == "epoch_formed" and "w1" in e[2]["lost"])
    assert stranded == ["w0", "w2", "w3"], events
    assert after["datacenters"] == ["dc-a", "dc-b", "dc-b"] and after["resume_step"] >= 3
    assert after["time"] - frozen_at < 20  # not after the 60 s collective timeout
    assert all(o["result"] is not None for o in out.values())
    assert _max_rel(out[0]["result"].final_params, reference) < 1e-4


def test_a_rank_killed_between_its_last_step_and_its_finish_does_not_train_the_job_again(elastic_run, reference):
    # w1 trained the last step with the others; its training process is killed before its finish reaches the
    # coordinator (out of memory in the final evaluation, a kill). The others finished. Its next process must
    # not train the job again on its own (it holds a quarter of the state: without a checkpoint it restarted
    # from step 0, alone).
    run = elastic_run(4, hold_finish="w1")
    cfg = job(job_id=_unique_job_id())
    for i, dc in enumerate(DCS):
        run.start(i, dc, cfg, kill_in_finish=i == 1)
    out = run.collect({0, 1, 2, 3})
    assert [e[0] for e in out[1]["events"]].count("training_process_killed") == 1, out[1]["events"]
    formed = [e[2] for e in run.events() if e[0] == "epoch_formed"]
    assert len(formed) == 1, formed
    assert not [e for e in run.events() if e[0] == "restarted"], run.events()
    assert all(out[i]["result"] is not None for i in (0, 2, 3)), [o["error"] for o in out.values()]
    assert out[1]["error"] is None and out[1]["result"] is None
    assert _max_rel(out[0]["result"].final_params, reference) < 1e-4
