"""The job runner: a detached Ray actor that owns one job's TorchTrainer and its elastic membership.

It runs ``TorchTrainer.fit()`` in a thread and buffers what the workers push (per-step records, events,
the final result) under increasing sequence numbers. The service polls it with a cursor, so a restarted
service picks up exactly where the stored cursor says — nothing dropped, nothing twice. Because the actor
is detached and named ``meridian-job-<id>``, training outlives the service process.

It also hosts the job's :class:`~meridian.service.runner.coordinator.Coordinator` (workers call ``rdzv_*``) and
watches the cluster every ``TICK_S``: a node that dies is reported on the job and its workers are not
waited for; when a datacenter has capacity again and the job runs short there, the runner starts a
replacement worker on it, which joins at the next step boundary.

Ray Train's own reaction to a dead worker would restart the whole worker group (34–85 s measured here,
from the last disk checkpoint). The job's backend declares *replica groups* of one worker each, the mode
Ray Train 2.60 has for torchft: a dead worker is then replaced alone and the survivors keep running, so
Meridian's re-formation over the survivors is what the job sees.

It takes the job's :class:`~meridian.service.planning.plan.Plan` as itself and answers polls with a typed
:class:`~meridian.service.runner.poll.RunnerPoll`. Decisions are pure functions elsewhere (membership,
replacement, metrics folding); this module does what they say and must never decide a job's status: the
supervisor does, from what the poll reports.
"""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from meridian.service.cluster.topology import ClusterTopology, read_topology
from meridian.service.planning.placement import pin_ranks_to_nodes
from meridian.service.planning.plan import Plan
from meridian.service.runner.backoff import Backoff
from meridian.service.runner.buffer import AckedBuffer
from meridian.service.runner.coordinator import Coordinator
from meridian.service.runner.metrics import JobMetricsState, RayJobMetrics
from meridian.service.runner.poll import RunnerPoll, RunnerState
from meridian.service.runner.replacement import replacement_datacenter
from meridian.service.runner.train_controller import ANSWER_WAIT_S, loop_held, remove_placement_groups_of
from meridian.workers.contracts.records import StepRecord
from meridian.workers.contracts.rendezvous import JoinReply, JoinRequest

if TYPE_CHECKING:
    from meridian.workers.contracts.config import TrainConfig

NAMESPACE = "meridian"
NODE_ID_LABEL = "ray.io/node-id"
TICK_S = 0.5
EXPORT_EVERY_S = 0.5
"""Step records push the job's Ray metrics at most this often (a job of 50 ms steps sent 20 exports a second;
Prometheus scrapes every few seconds)."""
GRACE_S = 30.0
"""How long re-forming waits for a member whose node is alive but which has not rejoined. Survivors restart
their training process to rejoin (2 s on an idle machine, over 10 s on a loaded one); a member that is
known dead (its node is gone) is never waited for."""
FIT_GRACE_S = 10.0
"""After the last step, how long fit() may take to return by itself before the runner ends it."""
START_TIMEOUT_S = 300.0
"""The first epoch waits this long for every planned worker before starting with those present."""
MAX_TRAIN_RUNS = 3
"""Ray Train runs one job may go through: a run whose controller failed (not the training) is followed by a
new one, whose workers take over the snapshots the ended ones left on their nodes."""
PLACEABLE_WAIT_S = 30.0
"""How long a new Train run waits for free capacity to place at least one worker before asking for all."""
ABORT_WAIT_S = 10.0
"""How long stopping a run waits for Ray Train's controller to abort before killing it. Its ``abort`` runs on the
controller's event loop, which a blocking wait of its own can hold: seen in ``bench recovery``, the cancel of a job
whose node had died and come back waited behind Ray Train's replacement of the dead worker (a ``ray.get`` in
``WorkerGroup._create_workers``, for a worker the returned node had no room for), and the job had not ended 60 s
after the cancel. Killing the controller ends its workers with it (they are its actors)."""
WORKERS_GONE_WAIT_S = 10.0
"""After killing the controller, how long to wait for the members' processes to be gone, so the snapshot sweep
that ends the run comes after their last write."""


def runner_name(job_id: str) -> str:
    return f"meridian-job-{job_id}"


def _controller_hook(name: str, namespace: str) -> Any:
    """A Ray Train controller callback that hands the controller's handle to the runner (for cancel)."""
    from ray.train.v2._internal.execution.callback import ControllerCallback

    class _TellRunner(ControllerCallback):
        def after_controller_start(self, train_run_context: Any) -> None:
            me = ray.get_runtime_context().current_actor
            ray.get_actor(name, namespace=namespace).set_controller.remote(me)

    return _TellRunner()


def _meridian_torch_config(use_gpu: bool) -> Any:
    """The ``torch_config`` of the job's ``TorchTrainer``: a backend that leaves process groups to Meridian and
    declares one-worker replica groups, so Ray Train replaces a dead worker alone instead of restarting every
    worker of the job.

    It is a plain ``BackendConfig``, not a ``TorchConfig`` subclass, so a Train worker never imports torch: each
    worker unpickles this config, and a ``TorchConfig`` brought in ``ray.train.torch`` (torch with it), its
    ``train_func_context`` would set a CUDA device in the worker, and its ``framework`` makes Ray Train import
    torch in every worker to record its version. The Train worker is Meridian's agent, which trains in a child
    process that imports torch itself (:mod:`meridian.workers.elastic.agent`); torch in the agent cost every
    worker an import at every job start (docs/benchmarks/history.md, "How a job runs"). ``backend`` is what
    ``TorchTrainer`` reads; the training processes pick their own from their device.
    """
    from ray.train.backend import Backend, BackendConfig

    class _MeridianBackend(Backend):
        has_replica_groups = True  # Ray Train 2.60: replace failing replica groups, keep the others running
        # As Ray Train's torch backend: each GPU worker sees every GPU its node gives the job, so NCCL between
        # workers of one node can use peer-to-peer (NVLink) transfers. Masked to its own GPU per process, NCCL
        # falls back to slower paths and has known bugs on NVSwitch hosts (NVIDIA/nccl#1749, #1906). The worker
        # picks its own device by Ray's GPU id within the list (meridian.workers.entry._device).
        share_cuda_visible_devices = True

        def on_start(self, worker_group: Any, backend_config: Any) -> None:
            pass  # each epoch forms its own process group (meridian.workers.elastic.rendezvous)

        def on_shutdown(self, worker_group: Any, backend_config: Any) -> None:
            pass

    class MeridianBackendConfig(BackendConfig):
        def __init__(self, backend: str) -> None:
            self.backend = backend

        @property
        def backend_cls(self) -> type:
            return _MeridianBackend

    return MeridianBackendConfig("nccl" if use_gpu else "gloo")


def _describe_failure(error: BaseException | str) -> str:
    """The root cause of a Train failure in one readable paragraph (not a wall of Ray internals)."""
    text = str(error)
    for marker in ("RuntimeError: ", "ValueError: ", "MemoryError", "ActorDiedError"):
        if marker in text:
            tail = text[text.rindex(marker):]
            return tail.strip().splitlines()[0][:2000]
    return text.strip().splitlines()[-1][:2000] if text.strip() else type(error).__name__


def _train_loop_config(runner_name_: str, train_config: TrainConfig) -> dict[str, Any]:
    """Ray Train's ``train_loop_config``: the frozen config itself (pickled), read as is by the workers."""
    return {"config": train_config, "runner_name": runner_name_, "namespace": NAMESPACE}


class JobRunner:
    def __init__(self, job_id: str, train_config: TrainConfig, plan: Plan, storage_path: str,
                 min_workers: int = 1) -> None:
        self.job_id = job_id
        self.name = runner_name(job_id)
        self.train_config = train_config
        self.plan = plan
        self.storage_path = storage_path
        self._lock = threading.Lock()
        self._outbox = AckedBuffer()  # records and events until the service acknowledges them
        self._state = RunnerState.STARTING
        self._finishing = False
        self._error = ""
        self._result: dict[str, Any] | None = None
        self._controller: Any = None
        self._stopped_controller: Any = None
        """The controller :meth:`_stop_training` has stopped (the service repeats a cancel until the job ends)."""
        self._cancel = threading.Event()
        self._failure: str | None = None
        """Why a worker failed the job (:meth:`fail`): its outcome once its training has been stopped."""
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._metrics = JobMetricsState(job_id)
        self._records_epoch = 0
        """The epoch of the newest step record (0: none yet)."""
        self._last_recorded_step = 0
        self._exporter: RayJobMetrics | None = None
        self._exported_at = 0.0
        self._ticker: threading.Thread | None = None
        rank_dcs = list(plan.rank_datacenters)
        self.planned_per_dc = {dc: rank_dcs.count(dc) for dc in dict.fromkeys(rank_dcs)}
        self.coordinator = Coordinator(
            planned_workers=len(rank_dcs), min_workers=min(min_workers, len(rank_dcs)),
            dc_order=tuple(self.planned_per_dc), on_event=self.push_event, grace_s=GRACE_S,
            start_timeout_s=START_TIMEOUT_S,
        )  # fmt: skip
        self._nodes: dict[str, str] = {}
        self._finished_at = 0.0
        self._fit_cannot_end = False
        self._run_workers_started = False
        """A worker of the current Train run has joined: Ray Train starts the train function only once its worker
        group has started. Until then the controller places the workers, which keeps its loop busy for seconds
        without holding it, and its abort is the clean end: it is not killed fast then (a kill after ABORT_WAIT_S
        also removes the placement group it leaves)."""
        self._replacements: dict[str, Any] = {}  # actor id → handle of a worker started after a loss
        # How often a replacement still starting is looked up, and how often a failing cluster read is retried.
        self._asking = Backoff(initial_s=1.0, max_s=10.0)

    # -- called by the service ---------------------------------------------------------------------------
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
        membership = self.coordinator.status()
        with self._lock:
            heartbeats, recent_step_s, now = self._observe()
            records, events = self._outbox.since(after)
            return RunnerPoll(
                state=self._state, error=self._error, result=self._result, records=records, events=events,
                cursor=self._outbox.seq, wait_reason=membership.get("wait_reason", ""),
                finished=bool(membership.get("finished")),
                heartbeats=heartbeats, recent_step_s=tuple(recent_step_s), now=now,
            )

    def cancel(self) -> None:
        self._cancel.set()
        self._stop_training()

    # -- called by the workers and the Train controller -------------------------------------------------
    def set_controller(self, controller: Any) -> None:
        self._controller = controller
        self._run_workers_started = False
        if self._cancel.is_set() or self._failure is not None or self._done.is_set():
            self._stop_training()

    def push_progress(self, records: list[StepRecord]) -> None:
        with self._lock:
            if self._state is RunnerState.STARTING:
                self._state = RunnerState.RUNNING
            for r in records:
                self._name_unrecorded_steps(r)
                if r.sync_decision is not None:  # an armed look-ahead decided, on the steps it measured
                    self._add_event("sync_decided", f"Sync at epoch {r.epoch}: {r.sync_decision['reason']}.",
                                    {**r.sync_decision, "epoch": r.epoch})
                self._outbox.add_record(r)
                self._metrics.on_record(r)
            if time.monotonic() - self._exported_at >= EXPORT_EVERY_S:  # the service's polls export too
                self._export()

    def push_event(self, kind: str, message: str, data: dict[str, Any] | None = None) -> None:
        with self._lock:
            self._add_event(kind, message, data or {})

    def _add_event(self, kind: str, message: str, data: dict[str, Any]) -> None:
        self._outbox.add_event({"kind": kind, "message": message, "data": data, "time": time.time()})
        self._metrics.on_event(kind, data)

    def _name_unrecorded_steps(self, r: StepRecord) -> None:
        """Rank 0 learns each step's loss a window of steps after the step (its sum over the ranks is read late:
        :mod:`meridian.workers.loop.report`). When an epoch breaks, the steps whose sums were still in flight were
        trained and their state kept, but no record of them will ever come. The new epoch's first record shows
        where it resumed: the steps between the last record and it are named in a ``steps_unrecorded`` event.
        (Read at that first record, not when the epoch forms: by then the old rank 0's last records, sent
        before it rejoined, have all arrived.)"""
        if self._records_epoch and r.epoch > self._records_epoch and r.step - 1 > self._last_recorded_step:
            first, last = self._last_recorded_step + 1, r.step - 1
            steps = f"step {first}" if first == last else f"steps {first}–{last}"
            self._add_event("steps_unrecorded", f"{steps} trained and kept before epoch {r.epoch} formed "
                            f"{'has' if first == last else 'have'} no record: the loss was still being summed over "
                            "the ranks when the epoch broke",
                            {"from_step": first, "to_step": last, "epoch": r.epoch})  # fmt: skip
        self._records_epoch = max(self._records_epoch, r.epoch)
        self._last_recorded_step = max(self._last_recorded_step, r.step)

    def push_heartbeats(self, beats: list[dict[str, Any]]) -> None:
        """One rank's heartbeats since its last batch (each: a step computed or finished). Stamped with this
        actor's clock on arrival, the one stall detection compares with."""
        with self._lock:
            now = time.time()
            for beat in beats:
                self._metrics.on_heartbeat({**beat, "finished_at": beat.get("time"), "time": now})

    # -- metrics ------------------------------------------------------------------------------------------
    def _observe(self) -> tuple[dict[int, dict[str, Any]], list[float], float]:
        """What the supervisor's stall detector needs — heartbeats, recent step times and this actor's clock
        (call with the lock held); also refreshes gauges."""
        now = time.time()
        self._metrics.refresh_live(now)
        self._export()
        return self._metrics.stall_view(), self._metrics.recent_step_s(), now

    def _export(self) -> None:
        self._exported_at = time.monotonic()
        try:
            if self._exporter is None:
                self._exporter = RayJobMetrics()
            self._exporter.export(self._metrics)
        except Exception:  # noqa: BLE001 - metrics must never break training or polling
            traceback.print_exc(limit=2)

    def push_result(self, result: dict[str, Any]) -> None:
        with self._lock:
            if self._result is None:  # every finishing worker sends one; they agree
                self._result = result

    def fail(self, message: str) -> None:
        """A worker hit an error that restarting cannot fix: stop the others, then fail the job with it. In that
        order, as a cancel does: the others' processes restart when their collectives fail, and each new one
        makes its snapshot folder again; a sweep before they were stopped left those folders in RAM once the
        workers were killed (reproduced: two of four, after one rank's snapshot write failed)."""
        with self._lock:
            if self._failure is None:
                self._failure = _describe_failure(message)
            failure = self._failure
        self._stop_training()
        self._finish(RunnerState.FAILED, failure)

    # The rendezvous, called by the workers (see meridian.workers.elastic.rendezvous).
    def rdzv_join(self, request: JoinRequest, known_epoch: int) -> JoinReply:
        if request.worker_id not in self._replacements:  # a worker of the Train run, not one the runner started
            self._run_workers_started = True
        return self.coordinator.join(request, known_epoch)

    def rdzv_pending_change(self, epoch: int) -> bool:
        return self.coordinator.pending_change(epoch)

    def rdzv_finish(self, worker_id: str) -> None:
        self.coordinator.finish(worker_id)

    # -- the cluster watch --------------------------------------------------------------------------------
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
                    self.push_event("watch_error", f"watching the cluster failed: {e} (retrying, less often "
                                    f"while it fails: next in {self._asking.delay('watch'):.0f} s)")
            else:
                self._asking.changed("watch")
                said = ""

    def _tick(self) -> None:
        topo = read_topology()
        nodes = {n.node_id: n.datacenter or "" for n in topo.alive_nodes}
        for node, dc in self._nodes.items():
            if node not in nodes:
                self.push_event("node_lost", f"node {node[:12]} in {dc or 'no datacenter'} is no longer alive",
                                {"node_id": node, "datacenter": dc})
        for node, dc in nodes.items():
            if self._nodes and node not in self._nodes:
                self.push_event("node_joined", f"node {node[:12]} joined {dc or 'no datacenter'}",
                                {"node_id": node, "datacenter": dc})
        self._nodes = nodes
        self.coordinator.tick(set(nodes))
        if self.coordinator.job_finished and self._result is not None:
            # Normally every Train worker returns and fit() ends by itself. After a loss, Ray Train may still be
            # trying to re-place the lost worker (it cannot while its node is gone): end the run for it.
            if not self._finished_at:
                self._finished_at = time.monotonic()
                controller = self._controller
                # A controller whose loop is held cannot end fit(): waiting FIT_GRACE_S for it would only delay the end.
                self._fit_cannot_end = controller is not None and loop_held(controller)
            if self._fit_cannot_end or time.monotonic() - self._finished_at > FIT_GRACE_S:
                self._finish(RunnerState.SUCCEEDED)
                self._stop_training()
            return
        self._replace_lost_workers(topo)

    def _replace_lost_workers(self, topo: ClusterTopology) -> None:
        """Start a worker in each datacenter that runs short of its plan and has room for one again; none once the
        job is ending (a cancel or the last step: the coordinator is closed; a worker started then held its CPU or
        GPU after the kill loop of :meth:`_stop_training` had run)."""
        epoch = self.coordinator.epoch
        if epoch is None or self._done.is_set() or self._cancel.is_set() or self.coordinator.closed:
            return
        members = {m.worker_id for m in epoch.members}
        waiting = set(self.coordinator.status()["waiting"])
        if not waiting - members:
            self._replacements = {k: a for k, a in self._replacements.items()
                                  if k not in members and self._still_starting(k, a)}  # started, not yet in an epoch
        dc = replacement_datacenter(
            self.planned_per_dc, epoch.members, alive_nodes={n.node_id for n in topo.alive_nodes},
            pending=[d for d, _ in self._replacements.values()], newcomer_waiting=bool(waiting - members),
            with_room={d for d in self.planned_per_dc if _has_room(topo, d, self.plan.resources_per_worker)},
        )
        if dc is None:
            return
        dc_, actor = _start_replacement(self.name, self.train_config, dc, self.plan)
        with self._lock:
            self._replacements[actor._actor_id.hex()] = (dc_, actor)
            stopped = self.coordinator.closed  # _stop_training closed it before its kill loop: this one was missed
        if stopped:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
            return
        self.push_event("worker_replacing", f"capacity returned in {dc}: starting a worker there", {"datacenter": dc})

    def _still_starting(self, key: str, handle: tuple[str, Any]) -> bool:
        """Whether a replacement that has not joined yet still lives. Looked up at once, then ever less
        often while it keeps starting (1, 2, 4, 8, 10 s), not every tick."""
        if not self._asking.due(key):
            return True
        self._asking.unchanged(key)
        alive = _actor_alive(handle)
        if not alive:
            self._asking.changed(key)
        return alive

    # -- the fit thread ---------------------------------------------------------------------------------
    def _finish(self, state: RunnerState, error: str = "") -> None:
        with self._lock:
            if self._finishing:
                return  # the first outcome wins (training finished, then the aborted controller returns)
            self._finishing = True
        # Before the outcome is visible: once it is, the service releases (kills) this actor. Best effort: a sweep
        # that raised (a busy GCS) left the job without an outcome, every later _finish returning at once, so the
        # job ran forever. Its folders then stay, and an event says so.
        try:
            sweep_snapshots(self.job_id)
        except Exception as e:  # noqa: BLE001 - the outcome must reach the service whatever the sweep did
            self.push_event("snapshots_not_swept", f"removing the job's in-memory snapshot folders failed ({e}); "
                            "they stay in RAM on the nodes until the host reboots or a later sweep", {})
        with self._lock:
            self._state, self._error = state, error
        self._done.set()

    def _stop_training(self) -> None:
        """End Ray Train's run (each controller once) and the replacement workers; no epoch forms after."""
        self.coordinator.close()
        with self._lock:
            controller = self._controller
            first = controller is not None and controller is not self._stopped_controller
            if first:
                self._stopped_controller = controller
        if first:
            self._abort(controller)
        with self._lock:
            replacements = list(self._replacements.values())
        for _, actor in replacements:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)

    def _abort(self, controller: Any) -> None:
        """Ray Train's abort; the controller's end instead if its event loop is held (it does not answer within
        :data:`ANSWER_WAIT_S`, once the run's workers have started) or it does not get to the abort within
        :data:`ABORT_WAIT_S`."""
        if self._run_workers_started and loop_held(controller):
            self._kill_controller(controller, f"did not answer within {ANSWER_WAIT_S:.0f} s", ANSWER_WAIT_S)
            return
        try:
            ray.get(controller.abort.remote(), timeout=ABORT_WAIT_S)
        except ray.exceptions.GetTimeoutError:
            self._kill_controller(controller, f"did not abort within {ABORT_WAIT_S:.0f} s", ABORT_WAIT_S)
        except Exception:  # noqa: BLE001, S110 - abort() ends the controller's process, so the call "fails": success
            pass

    def _kill_controller(self, controller: Any, why: str, waited_s: float) -> None:
        with contextlib.suppress(Exception):
            ray.kill(controller, no_restart=True)
        removed: list[str] = []
        with contextlib.suppress(Exception):  # best effort: the GCS may be busy; Ray Train's cleaner may do it
            removed = remove_placement_groups_of(controller._actor_id.hex())
        self.push_event("train_controller_killed",
                        f"Ray Train's controller {why} (its event loop is held, e.g. by its replacement of a worker "
                        "on a dead node): killed it, and its workers with it"
                        + (f"; removed the placement group it left ({len(removed)})" if removed else ""),
                        {"waited_s": waited_s, "placement_groups_removed": removed})  # fmt: skip
        deadline = time.monotonic() + WORKERS_GONE_WAIT_S
        while time.monotonic() < deadline and not self._members_gone():
            time.sleep(0.2)

    def _members_gone(self) -> bool:
        """Whether every member of the current epoch is found gone (its liveness port refuses)."""
        members = {m.worker_id for m in self.coordinator.members()}
        return members <= self.coordinator.probe_members()

    def _run(self) -> None:
        try:
            for attempt in range(1, MAX_TRAIN_RUNS + 1):
                error = self._fit(attempt)
                if (error is None or self._cancel.is_set() or self._failure is not None or self._done.is_set()
                        or self.coordinator.job_finished
                        or not _train_controller_failed(error) or attempt == MAX_TRAIN_RUNS):
                    break
                # Ray Train's controller failed (a Ray Train 2.60 bug: a second worker dying while it replaces a
                # first ends its control loop with an error it does not retry) and shut its workers down; their
                # nodes live, and so do the snapshots in their RAM folders. A new run's workers take those over.
                gone = self.coordinator.probe_members()
                self.push_event("train_run_restarted", f"Ray Train's controller failed ({_describe_failure(error)}) "
                                f"and ended its workers ({len(gone)} found gone); starting Train run {attempt + 1} of "
                                f"at most {MAX_TRAIN_RUNS}: its workers resume from the snapshots the ended ones left "
                                "on their nodes", {"attempt": attempt + 1, "gone": sorted(gone)})  # fmt: skip
            if self._cancel.is_set():
                self._finish(RunnerState.CANCELLED)
            elif self._failure is not None:  # a worker failed it (fail() stopped the run, and finishes it too)
                self._finish(RunnerState.FAILED, self._failure)
            elif error is not None:
                self._finish(RunnerState.FAILED, _describe_failure(error))
            elif self.coordinator.job_finished:
                self._finish(RunnerState.SUCCEEDED)
            else:
                self._finish(RunnerState.FAILED, "every worker ended before the job's last step (see the job's events)")
        except BaseException as e:  # noqa: BLE001 - every outcome must reach the service
            if self._cancel.is_set():
                self._finish(RunnerState.CANCELLED)
            elif self._failure is not None:
                self._finish(RunnerState.FAILED, self._failure)
            else:
                self._finish(RunnerState.FAILED, _describe_failure(e) or traceback.format_exc(limit=3))

    def _fit(self, attempt: int) -> BaseException | None:
        """One Ray Train run of the job's workers; the error it ended with (``None``: it ended cleanly). A new run
        after the first asks only for the workers the cluster can place now (the runner replaces the rest when
        their datacenters have room, as after any loss)."""
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer
        from ray.train.v2.api.exceptions import TrainingFailedError

        from meridian.workers.entry import ray_train_entry

        labels = worker_label_selectors(self.plan, read_topology())
        deadline = time.monotonic() + PLACEABLE_WAIT_S
        while attempt > 1 and time.monotonic() < deadline and not self._cancel.is_set():
            placeable = [sel for sel in labels if NODE_ID_LABEL in sel]  # pinned: a node has a free slot for it
            if placeable:
                labels = placeable
                break
            time.sleep(1.0)  # the ended run's workers are still releasing their slots
            labels = worker_label_selectors(self.plan, read_topology())
        if attempt > 1:
            self.coordinator.expect_run(len(labels))
        trainer = TorchTrainer(
            ray_train_entry,
            train_loop_config=_train_loop_config(self.name, self.train_config),
            torch_config=_meridian_torch_config(self.plan.use_gpu),
            scaling_config=ScalingConfig(
                num_workers=len(labels), use_gpu=self.plan.use_gpu, label_selector=labels,
                resources_per_worker=dict(self.plan.resources_per_worker),
            ),
            run_config=RunConfig(
                name=f"meridian-{self.job_id}" if attempt == 1 else f"meridian-{self.job_id}-run{attempt}",
                storage_path=self.storage_path,
                # Never give up on a lost worker: the survivors carry on and the runner decides the outcome.
                failure_config=FailureConfig(max_failures=-1),
                callbacks=[_controller_hook(self.name, NAMESPACE)],
            ),
        )
        try:
            return trainer.fit().error
        except TrainingFailedError as e:  # Ray Train 2.60's fit() raises the error that ended the run
            return e


def _train_controller_failed(error: BaseException) -> bool:
    """The Train run ended because Ray Train's control loop raised an error it does not retry, and it shut its
    workers down: not the training, whose own failures end the job through :meth:`JobRunner.fail`. (A controller
    whose process died is not this: its workers may still train, and a second run would compete with them.)"""
    from ray.train.v2.api.exceptions import ControllerError

    return isinstance(error, ControllerError)


# -- in-memory snapshots left behind -----------------------------------------------------------------------
def sweep_snapshots(job_id: str, timeout_s: float = 30.0) -> list[str]:
    """Remove the job's snapshot folders on every live host: a worker killed without its node (a crashed
    process, a simulated node on one host) leaves its folder in RAM behind. This process sweeps its own host; a
    task sweeps each other address (nodes on one host share its RAM folder). A task needs a worker process,
    whose start took ~2 s of every job's end on a 2-core host, where every node is this one's."""
    from meridian.workers.state.snapshot_paths import remove_snapshot_dirs  # no torch: the task starts fast

    here = ray.util.get_node_ip_address()
    one_per_host = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    removed = remove_snapshot_dirs(job_id) if here in one_per_host else []
    remove = ray.remote(num_cpus=0, max_retries=0)(remove_snapshot_dirs)
    refs = [
        remove.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(job_id)
        for address, node in one_per_host.items() if address != here
    ]  # fmt: skip
    deadline = time.monotonic() + timeout_s
    for ref in refs:
        with contextlib.suppress(Exception):  # best effort: a node that died meanwhile took its RAM with it
            removed += ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
    return removed


def worker_label_selectors(plan: Plan, topo: ClusterTopology | None = None) -> list[dict[str, str]]:
    """One label selector per Train worker: its datacenter and its node (Ray's ``ray.io/node-id`` label): the
    node the planner gave a tensor-parallel group, so the group shares one node, and for every other rank one
    with room in its datacenter now (:func:`meridian.service.planning.placement.pin_ranks_to_nodes`: why)."""
    nodes = pin_ranks_to_nodes(plan, topo) if topo is not None else plan.rank_nodes or (None,) * plan.num_workers
    return [{"datacenter": dc, **({NODE_ID_LABEL: node} if node else {})}
            for dc, node in zip(plan.rank_datacenters, nodes, strict=True)]


# -- replacement workers ---------------------------------------------------------------------------------
def _actor_alive(handle: tuple[str, Any]) -> bool:
    """Asked of the GCS directly (one actor's row), not through the state API: that goes through the
    dashboard, which clusters may run without and which shares the head's CPU with everything else."""
    from ray._private.state import actors

    try:
        info = actors(actor_id=handle[1]._actor_id.hex())
    except Exception:  # noqa: BLE001 - the GCS is busy: assume it lives, check again later
        return True
    return bool(info) and info.get("State") != "DEAD"


def _has_room(topo: ClusterTopology, dc: str, resources: dict[str, float]) -> bool:
    """A live node of ``dc`` has the free resources of one worker."""
    cpus, gpus = resources.get("CPU", 0.0), resources.get("GPU", 0.0)
    return any(n.available_cpus >= cpus and n.available_gpus >= gpus for n in topo.nodes_in(dc))


class _ReplacementWorker:
    def run(self, loop_config: dict[str, Any]) -> None:
        from meridian.workers.entry import ray_train_entry

        ray_train_entry(loop_config, replacement=True)


def _start_replacement(name: str, train_config: TrainConfig, dc: str, plan: Plan) -> tuple[str, Any]:
    """A worker outside Ray Train's group (Train 2.60 does not re-place a lost replica group once its node is
    gone), pinned by label to ``dc``; it runs the same entry and joins the rendezvous as a newcomer."""
    resources = dict(plan.resources_per_worker)
    cpus = resources.pop("CPU", 1.0)
    gpus = resources.pop("GPU", 0.0)
    actor = ray.remote(_ReplacementWorker).options(
        num_cpus=cpus, num_gpus=gpus, resources=resources or None, label_selector={"datacenter": dc},
        max_restarts=0,
    ).remote()
    actor.run.remote(_train_loop_config(name, train_config))
    return (dc, actor)
