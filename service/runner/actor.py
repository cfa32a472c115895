"""The job runner: a detached Ray actor that owns one job's Ray Train runs and its elastic membership.

It runs each ``TorchTrainer.fit()`` in a thread and buffers what the workers push (per-step records, events, the
final result) under increasing sequence numbers (:mod:`~meridian.service.runner.reports`). The service polls it
with a cursor, so a restarted service picks up exactly where the stored cursor says — nothing dropped, nothing
twice. Because the actor is detached and named ``meridian-job-<id>``, training outlives the service process.

It also hosts the job's :class:`~meridian.service.runner.coordinator.Coordinator` (workers call ``rdzv_*``) and
watches the cluster every ``TICK_S``: Ray's node states (a node that dies or joins is reported on the job) and the
ranks' heartbeats go to the coordinator, which judges every rank in the job's one liveness path
(:mod:`~meridian.service.runner.liveness`); the verdicts come back here as an observation for the controller,
and the coordinator carries out what it decides. When a datacenter has capacity again and the job runs short
there, a replacement worker starts on it (:mod:`~meridian.service.runner.replacements`), which joins at the next
step boundary.

Ray Train's own reaction to a dead worker would restart the whole worker group (34–85 s measured here, from the
last disk checkpoint). The job's backend declares *replica groups* of one worker each
(:mod:`~meridian.service.runner.train_run`): a dead worker is then replaced alone and the survivors keep running,
so Meridian's re-formation over the survivors is what the job sees.

This is the controller's executor: what happens (a step, a cancel, a worker's failure, a run's end, the last
step) is an observation for :func:`~meridian.service.runner.controller.decide.decide`, and this module carries
out the actions it returns. It must never decide the job's life itself.
"""

from __future__ import annotations

import threading
import time
import traceback
import uuid
from typing import TYPE_CHECKING, Any

from meridian.service.cluster.topology import ClusterTopology, read_topology
from meridian.service.planning.plan import Plan
from meridian.service.runner.backoff import Backoff
from meridian.service.runner.controller.decide import (
    MAX_TRAIN_RUNS,
    Action,
    CancelAsked,
    ControllerStarted,
    Finish,
    LastStepSeen,
    LeaveBehind,
    NameRanks,
    Observation,
    RanksJudged,
    RunEnded,
    StartRun,
    Stepped,
    StopStuck,
    StopTraining,
    Suspend,
    SuspendAsked,
    SuspendWritten,
    WorkerFailed,
    decide,
    fit_grace_s,
)
from meridian.service.runner.controller.state import (
    ControllerState,
    Training,
    error_of,
    runner_state,
    suspended_step,
)
from meridian.service.runner.coordinator import Coordinator
from meridian.service.runner.poll import RunnerPoll
from meridian.service.runner.profiling import NoSuchRank, ProfileDelivery, deliver
from meridian.service.runner.replacements import Replacements
from meridian.service.runner.reports import Reports
from meridian.service.runner.snapshots import sweep_snapshots
from meridian.service.runner.train_controller import loop_held
from meridian.service.runner.train_run import (
    RunStopper,
    describe_failure,
    failure_with_traceback,
    fit_run,
    train_controller_failed,
)
from meridian.workers.contracts.events import EventKind
from meridian.workers.contracts.records import StepRecord
from meridian.workers.contracts.rendezvous import JoinReply, JoinRequest

if TYPE_CHECKING:
    from meridian.workers.contracts.config import TrainConfig

TICK_S = 0.5
GRACE_S = 30.0
"""How long re-forming waits for a member whose node is alive but which has not rejoined. Survivors restart
their training process to rejoin (2 s on an idle machine, over 10 s on a loaded one); a member that is
known dead (its node is gone) is never waited for."""
RDZV_WAITERS = 48
"""Join calls the coordinator holds open at once: under the actor's ``max_concurrency`` (the launcher's 64
threads), so polls, heartbeats and step records always find a thread; further joins are told to call back."""
START_TIMEOUT_S = 300.0
"""The first epoch waits this long for every planned worker before starting with those present."""
__all__ = ["MAX_TRAIN_RUNS", "JobRunner", "runner_name", "sweep_snapshots"]


def runner_name(job_id: str) -> str:
    return f"meridian-job-{job_id}"


class JobRunner:
    def __init__(self, job_id: str, train_config: TrainConfig, plan: Plan, storage_path: str,
                 min_workers: int = 1) -> None:
        self.job_id = job_id
        self.name = runner_name(job_id)
        self.train_config = train_config
        self.plan = plan
        self.storage_path = storage_path
        self._run_name = f"meridian-{job_id}-{uuid.uuid4().hex[:6]}"
        """Ray Train's name of this runner's runs (a preempted job is launched again by a new runner)."""
        self._lock = threading.Lock()
        self._state: ControllerState = Training()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._ticker: threading.Thread | None = None
        self._reports = Reports(job_id, self._lock)
        rank_dcs = list(plan.rank_datacenters)
        planned_per_dc = {dc: rank_dcs.count(dc) for dc in dict.fromkeys(rank_dcs)}
        self.coordinator = Coordinator(
            planned_workers=len(rank_dcs), min_workers=min(min_workers, len(rank_dcs)),
            dc_order=tuple(planned_per_dc), on_event=self.push_event, grace_s=GRACE_S,
            start_timeout_s=START_TIMEOUT_S, on_verdicts=lambda verdicts: self._observe(RanksJudged(verdicts)),
            max_waiters=RDZV_WAITERS,
        )  # fmt: skip
        self._stopper = RunStopper(self.push_event, lambda: self._members_gone())
        self._replacements = Replacements(self.name, train_config, plan, self.push_event)
        self._nodes: dict[str, str] = {}
        self._asking = Backoff(initial_s=1.0, max_s=10.0)  # how often a failing cluster read is retried

    # -- the controller ------------------------------------------------------------------------------------------
    def _observe(self, obs: Observation) -> tuple[Action, ...]:
        """Move the controller with ``obs`` and carry out what it decided; the actions taken."""
        with self._lock:
            self._state, actions = decide(self._state, obs)
        for action in actions:
            if isinstance(action, StopTraining):
                self._stop_training()
            elif isinstance(action, Suspend):
                self.coordinator.suspend()
            elif isinstance(action, Finish):
                self._finish(action)
            elif isinstance(action, (LeaveBehind, StopStuck, NameRanks)):
                self.coordinator.carry_out((action,))
        return actions

    def _finish(self, action: Finish) -> None:
        # Before the outcome is visible: once it is, the service releases (kills) this actor. Best effort: a sweep
        # that raised (a busy GCS) left the job without an outcome before, and it ran forever. Its folders then
        # stay, and an event says so.
        try:
            sweep_snapshots(self.job_id)
        except Exception as e:  # noqa: BLE001 - the outcome must reach the service whatever the sweep did
            self.push_event(EventKind.SNAPSHOTS_NOT_SWEPT, f"removing the job's in-memory snapshot folders failed "
                            f"({e}); they stay in RAM on the nodes until the host reboots or a later sweep", {})
        self._done.set()  # from here on a poll tells the outcome

    def _stop_training(self) -> None:
        """End Ray Train's run (each controller once) and the replacement workers; no epoch forms after."""
        self.coordinator.close()
        with self._lock:
            controller = self._stopper.take()
        if controller is not None:
            self._stopper.stop(controller)
        self._replacements.kill_all()

    def _members_gone(self) -> bool:
        """Whether every member of the current epoch is found gone (its liveness port refuses)."""
        members = {m.worker_id for m in self.coordinator.members()}
        return members <= self.coordinator.probe_members()

    # -- called by the service ---------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"fit-{self.job_id}", daemon=True)
            self._thread.start()
            self._ticker = threading.Thread(target=self._tick_loop, name=f"tick-{self.job_id}", daemon=True)
            self._ticker.start()

    def poll(self, after: int) -> RunnerPoll:
        """Everything pushed after cursor ``after``, plus the runner's state. ``after`` is the cursor the
        service stored with what it committed: the acknowledgement, so what it covers is trimmed here."""
        # Outside the lock: the coordinator reports events (taking the lock) while holding its own.
        wait_reason, finished = self.coordinator.waiting_view()
        verdicts = self.coordinator.watch.current
        with self._lock:
            r = self._reports
            r.observe(verdicts)
            records, events = r.outbox.since(after)
            told = self._done.is_set()
            return RunnerPoll(
                state=runner_state(self._state, told=told), error=error_of(self._state, told=told), result=r.result,
                records=records, events=events,
                cursor=r.outbox.seq, wait_reason=wait_reason, finished=finished, placement=r.placement_since(after),
                stalls=self.coordinator.watch.stalls(),
                suspended_step=suspended_step(self._state, told=told),
            )

    def cancel(self) -> None:
        self._observe(CancelAsked())

    def profile(self, request_id: str, steps: int, ranks: list[int]) -> ProfileDelivery | str:
        """Ask ``ranks`` of the current epoch for a profiler trace of their next ``steps`` steps
        (:mod:`meridian.service.runner.profiling`); what the epoch lacks comes back as the message."""
        try:
            return deliver(self.coordinator.members(), request_id, steps, ranks)
        except NoSuchRank as e:
            return str(e)

    def suspend(self) -> None:
        """Preempt the job: its members write a durable checkpoint at their next step boundary and stop; the poll
        then says ``suspended`` (asked again by the service until it does; the same each time)."""
        self._observe(SuspendAsked())

    # -- called by the workers and the Train controller ----------------------------------------------------------
    def set_controller(self, controller: Any) -> None:
        with self._lock:
            self._stopper.set_controller(controller)
        self._observe(ControllerStarted())

    def push_progress(self, records: list[StepRecord]) -> None:
        with self._lock:
            self._reports.add_records(records)
        if records:
            self._observe(Stepped())

    def push_event(self, kind: str, message: str, data: dict[str, Any] | None = None) -> None:
        """An event from a worker or the coordinator, in its wire form (typed against the registry)."""
        with self._lock:
            self._reports.add_event(kind, message, data)

    def push_heartbeats(self, beats: list[dict[str, Any]]) -> None:
        """One rank's heartbeats since its last batch (each: a step computed or finished)."""
        with self._lock:
            self._reports.add_heartbeats(beats)

    def push_result(self, result: dict[str, Any]) -> None:
        with self._lock:
            if self._reports.result is None:  # every finishing worker sends one; they agree
                self._reports.result = result

    def fail(self, message: str) -> None:
        """A worker hit an error that restarting cannot fix: stop the others, then fail the job with it and its
        traceback (the controller's order: see :func:`~meridian.service.runner.controller.decide.decide`)."""
        self._observe(WorkerFailed(error=failure_with_traceback(message)))

    # The rendezvous, called by the workers (see meridian.workers.elastic.rendezvous).
    def rdzv_join(self, request: JoinRequest, known_epoch: int) -> JoinReply:
        if request.worker_id not in self._replacements:  # a worker of the Train run, not one the runner started
            self._stopper.workers_started = True
        return self.coordinator.join(request, known_epoch)

    def rdzv_pending_change(self, epoch: int) -> bool:
        return self.coordinator.pending_change(epoch)

    def rdzv_finish(self, worker_id: str) -> None:
        self.coordinator.finish(worker_id)

    def rdzv_suspended(self, worker_id: str, step: int) -> None:
        self.coordinator.suspended(worker_id, step)  # the watch's next tick ends the run (not in the worker's call)

    # -- the cluster watch ---------------------------------------------------------------------------------------
    def _tick_loop(self) -> None:
        said = ""
        while not self._done.wait(TICK_S):
            if not self._asking.due("watch"):
                continue  # the GCS failed to answer lately: ask it less often until it does
            try:
                self._tick()
            except Exception as e:  # noqa: BLE001 - a slow GCS answer must not end the watch
                self._asking.unchanged("watch")
                if str(e) != said:  # once per distinct error, not every tick
                    said = str(e)
                    self.push_event(EventKind.WATCH_ERROR, f"watching the cluster failed: {e} (retrying, less often "
                                    f"while it fails: next in {self._asking.delay('watch'):.0f} s)")
            else:
                self._asking.changed("watch")
                said = ""

    def _read_topology(self) -> ClusterTopology:
        """The cluster as Ray reports it now (its live nodes and their datacenters)."""
        return read_topology()

    def _tick(self) -> None:
        topo = self._read_topology()
        nodes = {n.node_id: n.datacenter or "" for n in topo.alive_nodes}
        for node, dc in self._nodes.items():
            if node not in nodes:
                self.push_event(EventKind.NODE_LOST, f"node {node[:12]} in {dc or 'no datacenter'} is no longer alive",
                                {"node_id": node, "datacenter": dc})
        for node, dc in nodes.items():
            if self._nodes and node not in self._nodes:
                self.push_event(EventKind.NODE_JOINED, f"node {node[:12]} joined {dc or 'no datacenter'}",
                                {"node_id": node, "datacenter": dc})
        self._nodes = nodes
        self._judge_ranks(set(nodes))
        suspended_at = self.coordinator.suspended_at
        if suspended_at is not None:
            self._observe(SuspendWritten(step=suspended_at))
            return
        if self.coordinator.job_finished and self._reports.result is not None:
            # Normally every Train worker returns and fit() ends by itself. After a loss, Ray Train may still be
            # trying to re-place the lost worker (it cannot while its node is gone): the controller ends the run.
            first = isinstance(self._state, Training) and self._state.last_step_at is None
            controller = self._stopper.controller
            answers = not (first and controller is not None and loop_held(controller))
            self._observe(LastStepSeen(now=time.monotonic(), run_answers=answers, grace_s=fit_grace_s(self.train_config.tracking)))
            return
        if isinstance(self._state, Training):
            self._replacements.replace_lost(topo, self.coordinator)

    def _judge_ranks(self, alive_nodes: set[str]) -> None:
        """Hand Ray's live nodes and the ranks' heartbeats to the coordinator, which judges every rank; its new
        verdicts come back through the controller (:class:`RanksJudged`)."""
        with self._lock:
            beats, recent = self._reports.metrics.beats(), tuple(self._reports.metrics.recent_step_s())
        self.coordinator.tick(alive_nodes, beats=beats, beats_at=time.time(), recent_step_s=recent)

    # -- the fit thread ------------------------------------------------------------------------------------------
    def _run(self) -> None:
        attempt = 1
        while True:
            try:
                error = self._fit(attempt)
                ended = RunEnded(attempt=attempt, error=describe_failure(error) if error is not None else "",
                                 controller_failed=error is not None and train_controller_failed(error),
                                 job_finished=self.coordinator.job_finished,
                                 suspended_at=self.coordinator.suspended_at)
            except BaseException as e:  # noqa: BLE001 - every outcome must reach the service
                ended = RunEnded(attempt=attempt, error=describe_failure(e) or traceback.format_exc(limit=3))
            actions = self._observe(ended)
            start = next((a for a in actions if isinstance(a, StartRun)), None)
            if start is None:
                return
            # Ray Train's controller failed (a Ray Train 2.60 bug: a second worker dying while it replaces a first
            # ends its control loop with an error it does not retry) and shut its workers down; their nodes live,
            # and so do the snapshots in their RAM folders. A new run's workers take those over.
            gone = self.coordinator.probe_members()
            self.push_event(EventKind.TRAIN_RUN_RESTARTED, f"Ray Train's controller failed ({start.after_error}) "
                            f"and ended its workers ({len(gone)} found gone); starting Train run {start.attempt} of "
                            f"at most {MAX_TRAIN_RUNS}: its workers resume from the snapshots the ended ones left "
                            "on their nodes", {"attempt": start.attempt, "gone": sorted(gone)})  # fmt: skip
            attempt = start.attempt

    def _fit(self, attempt: int) -> BaseException | None:
        return fit_run(self._run_name, self.name, self.train_config, self.plan, self.storage_path, attempt,
                       cancelled=lambda: not isinstance(self._state, Training),
                       expect_run=self.coordinator.expect_run)
