"""The worker agent: training runs in a child process that the agent restarts when it dies.

Why a child: a peer's death must not take the Ray Train worker with it, and a rank that cannot leave its
collectives must be stoppable. gloo cannot abort a collective in flight. When a peer dies, a rank whose other
operations are still pending (its communication thread, an async all-gather) keeps its sockets open however its
process groups are destroyed (measured: a blocked peer waited until the process exited), so ranks that wait on
*it* hang until the collective timeout. ``ProcessGroupGloo.abort()`` (torch 2.13) does not change that
(measured: 4 ranks in an all-reduce, one exits; its two neighbours failed at 0.32 s and aborted their group at
once, and the third rank stayed blocked until they exited, 1.37 s, as without the abort).

What a survivor does on CPU: it stays in its process. It shuts every TCP connection it holds down
(:func:`~meridian.workers.elastic.sockets.shut_down_tcp_sockets`: what the exit did for it; peers blocked on it
and its own threads inside a collective fail at once), drops the epoch's groups and engine, and joins the next
epoch (:class:`~meridian.workers.elastic.trainer.OnPeerFailure`, ``SHUT_SOCKETS_AND_REJOIN``), its memory and
datasets warm. It tells the agent (:data:`~meridian.workers.elastic.protocol.RECOVERED`), which counts the
recovery. On a GPU it exits instead (NCCL's threads may abort a process whose socket is shut under them, and
that is not checked on a GPU): the agent hands training to a *standby* child that it started earlier, which has
already paid for the interpreter and the torch import (~2 s idle, far more on a loaded machine), and starts the
next standby while the new child trains (on CPU a fork of a zygote that imported everything once:
:func:`~meridian.workers.elastic.standby.standby_context`). A standby also takes over from a child killed by a
signal, or stopped by the coordinator because it stayed stuck (:meth:`Agent.abort`): a restart is a pipe message,
not a process start. ``MERIDIAN_REFORM=new-process`` in a worker's environment makes a CPU survivor exit too (the
way it did before; ``meridian bench recovery`` compares both).

What survives a child: the in-memory snapshots, written after each step to a tmpfs folder (``/dev/shm``,
RAM) that the next child reads, and the epoch number it last belonged to. The child reaches the
coordinator, the progress sink and the event sink through the agent, over one pipe
(:class:`~meridian.workers.elastic.child.PipeClient`), so it never touches Ray. The standby process lives in
:mod:`meridian.workers.elastic.standby` (torch-free, so a worker can start its first standby before it imports
torch), the pipe's framing in :mod:`meridian.workers.elastic.pipe`, the training process's side in
:mod:`meridian.workers.elastic.child`. The agent also keeps a liveness port open (:mod:`meridian.workers.elastic.liveness`): the coordinator's
proof, when this process is gone, that it need not wait for it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from meridian.workers.contracts.config import TrainConfig
from meridian.workers.elastic.liveness import LivenessListener
from meridian.workers.elastic.pipe import recv, send
from meridian.workers.elastic.profile_request import write_request
from meridian.workers.elastic.protocol import KEEP_SNAPSHOTS, LEAVING, RECOVERED, RESTART_EXIT_CODE
from meridian.workers.elastic.standby import Standby, standby_context
from meridian.workers.state.snapshot_paths import adopt_orphan, snapshot_dir

if TYPE_CHECKING:  # torch-free to import: a joining worker's agent need not wait for torch (its zygote imports it)
    from meridian.workers.contracts.records import TrainResult

Call = Callable[..., Any]

CRASHES_IN_A_ROW = 3
"""Training processes of a worker that may be killed by a signal one after another, none of them having trained a
step, before the worker gives up. A process killed by a signal (the kernel's out-of-memory killer, NCCL's watchdog
aborting a rank whose peer died, a segfault in a kernel, someone's ``kill``) is restarted and rejoins from the
snapshots; one that keeps dying before it trains is a fault a restart does not cure."""


def killed_by(exitcode: int | None) -> str | None:
    """The name of the signal that ended a process (``SIGKILL``) from its ``multiprocessing`` exit code, or
    ``None`` if it exited by itself."""
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def _reap(proc: Any) -> None:
    """Wait for a training process that said it exits (it is in ``os._exit``); kill one that does not."""
    proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join(5)



def raised(traceback_text: str) -> str:
    """The exception a formatted traceback ends with (``"OSError: [Errno 28] No space left on device"``): its last
    line at column 0, the one a person needs first; the frames above it are indented."""
    lines = [line for line in traceback_text.strip().splitlines() if line and not line[0].isspace()]
    exception = re.compile(r"[A-Za-z_][\w.]*(: |$)")  # "Name: message" or a bare "Name"
    return next((line for line in reversed(lines) if exception.match(line) and not line.startswith("Traceback (")),
                lines[-1] if lines else "(no message)")

class Agent:
    """Runs the job's training in child processes until it finishes; restarts a child that died or left."""

    def __init__(
        self, cfg: TrainConfig, call: Call, *, worker_id: str, datacenter: str, node_id: str, address: str,
        backend: str | None = None, device: str = "cpu", sink: Any = None, on_event: Callable[..., None] | None = None,
        join_timeout_s: float = 600.0, collective_timeout_s: float = 300.0, threads: int | None = None,
        max_restarts: int = 100, keep_params: bool = False, standby: Standby | None = None,
    ) -> None:  # fmt: skip
        self.cfg, self.call, self.sink = cfg, call, sink
        self.on_event = on_event or (lambda *a: None)
        self.ids = {
            "worker_id": worker_id, "datacenter": datacenter, "node_id": node_id, "address": address,
            "backend": backend, "collective_timeout_s": collective_timeout_s, "join_timeout_s": join_timeout_s,
            "keep": KEEP_SNAPSHOTS, "epoch": 0, "keep_params": keep_params, "parent_pid": os.getpid(),
            "probe_port": 0, "peak": None, "snapshot_every": 1,
        }  # fmt: skip
        self.device = device
        self.threads = threads
        """The training process's torch threads; ``None`` leaves torch's default, which reads the same environment."""
        self.max_restarts = max_restarts
        self.store_dir = snapshot_dir(cfg.job_id, worker_id)
        self.restarts = 0
        """Training processes started after the first (a crash, an abort, or a peer's failure on a GPU)."""
        self.recoveries = 0
        """Times this worker's training went on after its epoch broke: in a new process, or re-formed in its own."""
        self.crashes = 0
        """Training processes killed by a signal one after another before training a step (:data:`CRASHES_IN_A_ROW`)."""
        self._trained = False
        """The current training process has trained (sent a heartbeat of a step)."""
        self._ctx = standby_context(device)
        self._standby: Standby | None = standby
        """The next training process, started and waiting; the caller may hand over one it started early."""
        self._lock = threading.Lock()
        self._child: Any = None
        """The training process now running (its ``Process``), for :meth:`abort`."""
        self._joining = False
        """The child is in a join (it left its epoch, or has none yet): an abort of its old epoch is moot."""
        self._aborted: Any = None
        """The child :meth:`abort` stopped: its exit is a restart, whatever its code."""
        self.aborts = 0

    def run(self) -> TrainResult | None:
        # A new agent's own folder is new (a leftover of the same worker id is removed); it takes over the folder
        # of a worker of this job whose agent died on this host, if there is one. Its shards count only where the
        # rendezvous says so: when no member of the job is left (membership.decide), else they are old.
        adopted = adopt_orphan(self.cfg.job_id, self.ids["worker_id"])
        if adopted is not None:
            self.on_event("snapshots_adopted", f"worker {self.ids['worker_id']} took over the snapshots of a worker "
                          f"of this job whose process is gone ({os.path.basename(adopted)}); the job resumes from them "
                          "only if no member of it is left", {"folder": adopted})
        # Lives as long as this process: the coordinator's proof that this worker is gone is a refused connect.
        liveness = LivenessListener(on_abort=self.abort, on_profile=self.profile)
        self.ids["probe_port"] = liveness.port
        leaving: Any = None  # a process that said it exits for a restart: the next starts before that exit is done
        reapers: list[threading.Thread] = []
        try:
            while True:
                current = self._take_standby()
                with self._lock:
                    self._child, self._joining, self._trained = current.proc, True, False
                if leaving is not None:
                    # Reaped beside the new process, not before serving it: an exit frees the process's memory
                    # before its files (tens of ms for torch), and the new process's join waited on this loop.
                    reapers.append(threading.Thread(target=_reap, args=(leaving,), name="meridian-reap", daemon=True))
                    reapers[-1].start()
                    leaving = None
                outcome = self._serve(current.conn, current.proc)
                if outcome == LEAVING:
                    with self._lock:
                        self._child, leaving = None, current.proc
                else:
                    current.proc.join()
                    with self._lock:
                        self._child, aborted = None, self._aborted is current.proc
                    if outcome is not None:
                        return outcome[1]
                    if current.proc.exitcode != RESTART_EXIT_CODE and not aborted:
                        self._crashed(current.proc)
                self.restarts += 1
                self.recoveries += 1
                if self.restarts > self.max_restarts:
                    raise RuntimeError(f"gave up after {self.max_restarts} restarts of the training process")
        finally:
            if leaving is not None:
                _reap(leaving)
            for reaper in reapers:
                reaper.join()
            liveness.close()
            if self._standby is not None:
                self._standby.discard()
                self._standby = None
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def _crashed(self, proc: Any) -> None:
        """A training process ended without saying why. Killed by a signal: restart it (it rejoins, its peers
        re-form with it, every rank resumes from its snapshots), unless :data:`CRASHES_IN_A_ROW` processes in a row
        died before training a step. Any other exit (a code of its own, not a restart's): give up."""
        signal_name = killed_by(proc.exitcode)
        if signal_name is None:
            raise RuntimeError(f"the training process exited with code {proc.exitcode}")
        self.crashes = 0 if self._trained else self.crashes + 1
        worker = self.ids["worker_id"]
        if self.crashes >= CRASHES_IN_A_ROW:
            raise RuntimeError(
                f"the training process of worker {worker} was killed by {signal_name}: {self.crashes} in a row died "
                "before training a step, so it is not restarted again (the worker's log and the kernel's, `dmesg`, "
                "say what killed it; running out of memory is the usual cause)")
        self.on_event("training_process_killed",
                      f"the training process of worker {worker} was killed by {signal_name} (pid {proc.pid}); "
                      "restarting it: it rejoins and the job resumes from its snapshots",
                      {"worker_id": worker, "signal": signal_name, "pid": proc.pid,
                       "killed_before_training": self.crashes})

    def abort(self, epoch: int) -> None:
        """The coordinator's order (over the liveness port): this worker's peers re-form without it, while it
        has not left ``epoch`` (stuck in a collective with a peer that is gone). Stop the training process if it
        still trains in that epoch; the next one rejoins from the snapshots the stopped one kept."""
        with self._lock:
            child = self._child
            if child is None or self._joining or self.ids["epoch"] != epoch or not child.is_alive():
                return
            self._aborted = child
            self.aborts += 1
        child.kill()  # SIGKILL: closes its sockets at once, like the exit of a rank that saw its peer fail

    def profile(self, request_id: str, steps: int) -> None:
        """The runner's request for a profiler trace of the next ``steps`` steps: left in this worker's folder,
        where its training process (the current one, or the next) picks it up within a quarter second
        (:class:`~meridian.workers.elastic.profiling.StepProfiler`)."""
        write_request(self.store_dir, request_id, steps)

    def _take_standby(self) -> Standby:
        """The started standby (or, the first time or if it died, a new one), told to train now."""
        args = (self.cfg, dict(self.ids), self.store_dir, self.device, self.threads)
        standby, self._standby = self._standby, None
        if standby is not None:
            try:
                standby.go(*args)
                return standby
            except OSError:  # it died while waiting (killed, out of memory): start one now
                standby.discard()
        standby = Standby(self._ctx, self.ids["worker_id"])  # told to go at once: nothing to prepare ahead
        standby.go(*args)
        return standby

    def _relay_beats(self, beats: list[dict[str, Any]]) -> None:
        """A batch of the child's heartbeats, to the sink in one call when it takes batches."""
        if (rank_steps := getattr(self.sink, "rank_steps", None)) is not None:
            rank_steps(beats)
        elif (rank_step := getattr(self.sink, "rank_step", None)) is not None:
            for beat in beats:
                rank_step(beat)

    def _serve(self, conn: Any, proc: Any) -> tuple[str, TrainResult | None] | str | None:
        """Relay the child's messages until it ends; ``("done", result)`` when training finished,
        :data:`LEAVING` when it said it exits for a restart, ``None`` when it exited."""
        while True:
            try:
                msg = recv(conn)
            except (EOFError, ConnectionResetError):
                return None  # the child exited (to be restarted, or it crashed: the exit code says)
            kind = msg[0]
            if kind == "call":
                _, method, args = msg
                if method == "join":
                    with self._lock:
                        self._joining = True
                try:
                    reply = (True, self.call(method, *args))
                except Exception as e:  # noqa: BLE001 - the child raises it
                    reply = (False, f"{type(e).__name__}: {e}")
                try:
                    send(conn, reply)
                except OSError:  # it exited while the call was out (stopped, or its epoch broke)
                    return None
            elif kind == "progress":
                if self.sink is not None:
                    self.sink.step(msg[1])
            elif kind == "beats":
                self._trained = True
                if self._standby is None:
                    # The child trains: start the next one now, so its import never competes with a re-formation.
                    self._standby = Standby(self._ctx, self.ids["worker_id"], self.cfg)
                self._relay_beats(msg[1])
            elif kind == "event":
                self.on_event(*msg[1:])
            elif kind == "epoch":
                with self._lock:
                    self.ids["epoch"], self._joining = msg[1], False
            elif kind == RECOVERED:
                self.recoveries += 1
            elif kind == "peak":
                self.ids["peak"] = msg[1]  # the next training process reuses rank 0's device peak
            elif kind == "cadence":
                self.ids["snapshot_every"] = msg[1]  # and joins the next epoch with the cadence agreed so far
            elif kind == LEAVING and not self.device.startswith("cuda"):
                # (On a GPU the next process waits for the exit: the old one's device memory is freed by it.)
                return LEAVING
            elif kind == "done":
                return ("done", msg[1])
            elif kind == "error":
                raise RuntimeError(f"training failed: {raised(msg[1])}\n{msg[1]}")
