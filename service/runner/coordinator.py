"""The rendezvous of an elastic job: workers join, the coordinator forms epochs, everyone learns its rank.

Hosted by the job's runner actor (thread-safe; workers call it concurrently). A worker calls
:meth:`Coordinator.join` at start and again whenever its epoch breaks (a peer failed) or must grow (a
newcomer waits); each call returns within ``poll_s`` either an assignment for a newer epoch or "wait, because
…", so no actor call blocks for long. Decisions come from :func:`meridian.service.runner.membership.decide`; the
runner's ticker calls :meth:`tick` with Ray's view of live nodes so a member on a dead node is not waited
for. Every formation and loss is reported through ``on_event``.

Ray's view of a node is slow to change (3 s with the fast health checks of a cluster Meridian starts, 13 s
with a ``ray start`` cluster's defaults). The evidence is often there sooner: when a member dies, its peers'
collectives fail and they rejoin while it does not. From that moment (a re-formation is pending), the
coordinator probes each member that has not rejoined (:mod:`meridian.service.runner.liveness`): whenever a
worker rejoins and on every tick. A member whose process is gone is not waited for. One that still answers
``abort_after_s`` after the first rejoin is stuck (a collective or a group formation with a peer that left):
its agent is told to stop that epoch's training process, and the next one rejoins within seconds instead of
after gloo's collective timeout, while the grace period still runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from meridian.service.runner.liveness import LivenessTracker
from meridian.service.runner.membership import Epoch, Form, Member, MembershipState, Wait, decide
from meridian.workers.contracts.events import EventKind
from meridian.workers.contracts.rendezvous import Assignment, Finished, JoinReply, JoinRequest, Waiting

REPROBE_S = 0.02
"""While a re-formation waits on a member that has not rejoined and whose agent still answered, the rejoined
workers' waiting calls probe it again this often, for :data:`REPROBE_FOR_S`. A killed process's port refuses
only once the kernel has freed the process's memory (tens to hundreds of ms for a Ray worker on a busy host):
a first rejoin that came sooner found it answering, and the next look was the runner's tick, 0.5 s later
(``bench recovery``: the dead member known gone at 0.49 s instead of ~0.1)."""
REPROBE_FOR_S = 3.0
"""After this long since the first rejoin the runner's ticks probe, as before (a slow member, or a stuck one)."""
STALE_POLL_S = 3.0
"""A waiting worker calls again as soon as its poll (``poll_s``, 2 s) returns; one that has not called for this
long is probed before an epoch may form with it, and dropped if its process is gone. Seen in a fresh clone's
``test_recovery_ray``: after Ray Train's controller failed, the ended run's two workers, which had joined while the
job waited below ``min_workers``, were still listed as waiting when a new worker joined; the epoch formed with
them and the new worker sat in forming its group with the dead until the newcomers' 60 s limit stopped it."""
STRANDED_AFTER_S = 1.0
"""Ray reports a member's node dead and no member has rejoined for this long: the others are stranded in a
collective with it. A killed process's sockets close and its peers' collectives fail within milliseconds, long
before Ray's health check (3 s at the fastest); a host that lost its power or its network closes nothing, and its
peers would wait out the collective timeout (gloo), or NCCL's. So they are told to stop (:meth:`Coordinator.tick`)."""
NEWCOMERS_PROBE_AFTER_S = 5.0
"""Newcomers that have waited this long for the members' next step boundary make every tick probe the members."""
NEWCOMERS_ABORT_AFTER_S = 60.0
"""Newcomers that have waited this long while the members answer: the members are stuck (no step boundary for a
minute) and are told to stop; their next processes rejoin from the snapshots, with the newcomers."""

EventSink = Callable[[str, str, dict[str, Any]], None]


class Coordinator:
    def __init__(self, *, planned_workers: int, min_workers: int, dc_order: tuple[str, ...], on_event: EventSink,
                 grace_s: float = 5.0, start_timeout_s: float = 300.0, clock: Callable[[], float] = time.monotonic,
                 liveness: LivenessTracker | None = None, abort_after_s: float | None = None) -> None:
        self.state = MembershipState(planned_workers=planned_workers, min_workers=min_workers, dc_order=dc_order)
        self.on_event = on_event
        self.grace_s = grace_s
        self.start_timeout_s = start_timeout_s
        self.clock = clock
        self._cond = threading.Condition()
        self._ports: dict[str, int] = {}
        self._first_seen: dict[str, float] = {}  # rank order inside a DC follows first arrival, stably
        self._last_call: dict[str, float] = {}
        self._alive_nodes: set[str] | None = None
        self._node_dead_at: dict[int, float] = {}
        """Epoch number → when the runner first reported one of its members' node dead (:data:`STRANDED_AFTER_S`)."""
        self.wait_reason = ""
        self.finished: set[str] = set()
        self.liveness = liveness or LivenessTracker()
        self.abort_after_s = grace_s / 3 if abort_after_s is None else abort_after_s
        """How long after the first rejoin a member that answers but has not rejoined is told to stop."""
        self.closed = False
        """The job is ending (cancelled, failed, or its run stopped): no epoch forms, and joins are told to end."""
        self.suspending = False
        """The job is being suspended: its members leave at the next step boundary, and the epoch they form then
        writes a durable checkpoint and stops (:attr:`~meridian.workers.contracts.rendezvous.Assignment.suspend`)."""
        self._suspended: dict[str, int] = {}  # member of the suspend epoch → the step its checkpoint part holds

    # -- called by workers ------------------------------------------------------------------------------
    def join(self, request: JoinRequest, known_epoch: int = 0, poll_s: float = 2.0) -> JoinReply:
        """Register (or re-register) a worker; return its assignment in an epoch newer than ``known_epoch``,
        or :class:`Waiting` with the reason after ``poll_s`` (the worker calls again)."""
        wid = request.worker_id
        with self._cond:
            rejoining = self.state.epoch is not None and any(m.worker_id == wid for m in self.state.epoch.members)
        if rejoining:
            self._probe_silent(also=wid)  # outside the lock: a probe of an unreachable host takes its timeout
        self._probe_stale_waiting(besides=wid)
        with self._cond:
            if self.job_finished or self.closed:
                return Finished()  # a late worker (a replacement, one left out) has nothing to do
            now = self.clock()
            self.liveness.revive(wid)  # it calls: whatever a probe concluded before, its process is alive
            a = self._assignment_locked(wid, known_epoch)
            if a is not None:
                # The epoch formed between two of its calls (it was told to wait, then the others arrived):
                # registering it again as waiting would break that epoch before it formed its group.
                self._last_call[wid] = now
                return a
            self._ports[wid] = request.port
            self.state.waiting[wid] = Member.from_request(request, joined_at=self._first_seen.setdefault(wid, now))
            if self.state.epoch is None and self.state.first_join_at is None:
                self.state.first_join_at = now
            is_member = self.state.epoch is not None and any(x.worker_id == wid for x in self.state.epoch.members)
            if is_member and self.state.first_rejoin_at is None:
                self.state.first_rejoin_at = now
            self._decide_locked()
            deadline = now + poll_s
            while True:
                self._last_call[wid] = self.clock()  # waiting in a call counts as calling
                a = self._assignment_locked(wid, known_epoch)
                if a is not None:
                    return a
                if self.job_finished or self.closed:
                    return Finished()
                left = deadline - self.clock()
                if left <= 0:
                    return Waiting(self.wait_reason)
                if not self._reprobe_due_locked():
                    self._cond.wait(left)
                    continue
                self._cond.wait(min(left, REPROBE_S))
                self._cond.release()  # a probe waits on the network: never under the lock
                try:
                    self._probe_silent()
                finally:
                    self._cond.acquire()

    def pending_change(self, epoch: int) -> bool:
        """Should the members of ``epoch`` re-form at their next step boundary (a newcomer waits, or the job is
        being suspended)?"""
        with self._cond:
            return (self.state.epoch is not None and self.state.epoch.number == epoch
                    and (self.suspending or self.state.newcomers_waiting(self._alive_nodes)))

    def suspend(self) -> None:
        """Suspend the job: its members leave at their next step boundary and re-form in an epoch that writes a
        durable checkpoint and stops."""
        with self._cond:
            self.suspending = True
            self._cond.notify_all()

    def suspended(self, worker_id: str, step: int) -> None:
        """A member of the suspend epoch wrote its part of the checkpoint of ``step``."""
        with self._cond:
            self._suspended[worker_id] = step
            self._cond.notify_all()

    @property
    def suspended_at(self) -> int | None:
        """The step of the checkpoint once every member of the suspend epoch wrote its part, else ``None``."""
        e = self.state.epoch
        if e is None or not e.suspend or not all(m.worker_id in self._suspended for m in e.members):
            return None
        return min(self._suspended[m.worker_id] for m in e.members)

    def finish(self, worker_id: str) -> None:
        """A member trained the job's last step."""
        with self._cond:
            self.finished.add(worker_id)
            self._cond.notify_all()

    @property
    def job_finished(self) -> bool:
        """A member of the current epoch has finished, so every member has trained the last step and written its
        part of the final checkpoint: a rank finishes only after its epoch's last collective, which every member
        enters after those (:meth:`~meridian.workers.loop.train.TrainingLoop.run_epoch`; a tensor/pipeline-parallel
        epoch ends on a barrier after its weights are written). A member whose process died after that collective,
        before its own finish arrived, has nothing left to do: its next process is told so. (Before, it re-formed
        an epoch alone, and holding a part of the state it trained the job again from step 0.)"""
        e = self.state.epoch
        return e is not None and any(m.worker_id in self.finished for m in e.members)

    # -- called by the runner ---------------------------------------------------------------------------
    def close(self) -> None:
        """The job is ending: form no epoch from here on; a worker that joins, or waits in a join, is told there
        is nothing left to do. (Seen before it on the ``ray start`` path: the cancel of a job that had lost and
        regained a node killed Ray Train's controller and its workers with it, and the one worker it did not own,
        the runner's replacement, formed an epoch alone 1.1 s after the kill and restarted from the durable
        checkpoint 1.3 s later.)"""
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def tick(self, alive_nodes: set[str]) -> None:
        self._probe_silent()
        self._probe_stale_waiting()
        with self._cond:
            self._alive_nodes = alive_nodes
            self._decide_locked()
        self._stop_stranded()

    def status(self) -> dict[str, Any]:
        with self._cond:
            e = self.state.epoch
            return {
                "epoch": e.number if e else 0,
                "workers": len(e.members) if e else 0,
                "datacenters": list(e.datacenters) if e else [],
                "waiting": sorted(self.state.waiting),
                "wait_reason": self.wait_reason,
                "finished": self.job_finished,
            }

    @property
    def epoch(self) -> Epoch | None:
        return self.state.epoch

    # -- internals --------------------------------------------------------------------------------------
    def expect_run(self, workers: int) -> None:
        """A new Train run starts ``workers`` workers (its predecessor ended with all of its own)."""
        with self._cond:
            self.state.run_workers = workers

    def members(self) -> tuple[Member, ...]:
        """The current epoch's members (none before the first epoch forms)."""
        with self._cond:
            return tuple(self.state.epoch.members) if self.state.epoch is not None else ()

    def probe_members(self) -> set[str]:
        """Probe every member of the current epoch now (a Train run ended and took its workers with it); those
        found gone are not waited for. The worker ids found gone."""
        with self._cond:
            e = self.state.epoch
            suspects = [(m.worker_id, m.address, m.probe_port) for m in e.members] if e is not None else []
        found = self.liveness.check(suspects)
        if found:
            with self._cond:
                self._decide_locked()
        return found

    def _probe_stale_waiting(self, besides: str = "") -> None:
        """Probe the waiting workers that have not called for :data:`STALE_POLL_S`; drop those whose process is
        gone, so no epoch forms with them."""
        with self._cond:
            now = self.clock()
            stale = [(w, m.address, m.probe_port) for w, m in self.state.waiting.items()
                     if w != besides and now - self._last_call.get(w, now) >= STALE_POLL_S]  # fmt: skip
        if not stale:
            return
        found = self.liveness.check(stale)
        if not found:
            return
        with self._cond:
            for w in found:
                m = self.state.waiting.pop(w, None)
                if m is not None:
                    self.on_event(EventKind.WORKER_GONE, f"the waiting worker in {m.datacenter} on node {m.node_id[:12]} is gone "
                                  "(it stopped calling and its process no longer answers): not waited for",
                                  {"worker_id": w})  # fmt: skip
            self._decide_locked()

    def _reprobe_due_locked(self) -> bool:
        """A re-formation is pending (for under :data:`REPROBE_FOR_S`) and a member that has not rejoined is not
        known gone yet."""
        e, since = self.state.epoch, self.state.first_rejoin_at
        if e is None or since is None or self.clock() - since >= REPROBE_FOR_S:
            return False
        return any(m.probe_port and m.worker_id not in self.state.waiting and m.worker_id not in self.liveness.gone
                   for m in e.members)  # fmt: skip

    def _probe_silent(self, also: str = "") -> None:
        """While a re-formation is pending (a member rejoined: ``also`` is one doing so now), probe the
        members that have not rejoined; those found gone are not waited for."""
        with self._cond:
            e = self.state.epoch
            ids = {m.worker_id for m in e.members} if e is not None else set()
            new_since = min((m.joined_at for w, m in self.state.waiting.items() if w not in ids), default=None)
            # Newcomers wait for the members' next step boundary; when none has come for a while, the members may
            # all be gone (a Train run ended with its workers), which only a probe tells.
            waited = self.clock() - new_since if new_since is not None else 0.0
            stalled = waited >= NEWCOMERS_PROBE_AFTER_S
            if e is None or (self.state.first_rejoin_at is None and not also and not stalled):
                return
            suspects = [(m.worker_id, m.address, m.probe_port) for m in e.members
                        if m.worker_id not in self.state.waiting and m.worker_id != also]  # fmt: skip
            since = self.clock() - (self.state.first_rejoin_at or self.clock())
        found = self.liveness.check(suspects)
        if found:
            with self._cond:
                for m in self.state.epoch.members if self.state.epoch else ():
                    if m.worker_id in found:
                        self.on_event(EventKind.WORKER_GONE, f"the worker in {m.datacenter} on node {m.node_id[:12]} is gone "
                                      "(its process no longer answers): re-forming without it", {"worker_id": m.worker_id})
                self._decide_locked()
        if since >= self.abort_after_s or waited >= NEWCOMERS_ABORT_AFTER_S:
            why = (f"had not rejoined {since:.0f} s after its peers (stuck in a collective with a peer that left)"
                   if since >= self.abort_after_s else
                   f"had reached no step boundary while new workers waited {waited:.0f} s (stuck)")
            self._stop(e, suspects, EventKind.WORKER_STUCK, f"answers but {why}")

    def _stop(self, e: Epoch, members: list[tuple[str, str, int]], kind: str, why: str) -> None:
        """Tell ``members`` (worker id, address, probe port) to stop their training process of epoch ``e`` (each
        once); each one whose agent did gets a ``kind`` event saying ``why``, and the grace period starts afresh:
        their next processes are on their way back, rejoining from their snapshots."""
        stopped = self.liveness.abort(members, e.number)
        with self._cond:
            if stopped and self.state.epoch is e:
                self.state.first_rejoin_at = self.clock()
            for m in e.members:
                if m.worker_id in stopped:
                    self.on_event(kind, f"the worker in {m.datacenter} on node {m.node_id[:12]} {why}: its training "
                                  "process was stopped, and the next one rejoins from its snapshots",
                                  {"worker_id": m.worker_id, "epoch": e.number})  # fmt: skip

    def _stop_stranded(self) -> None:
        """A member's node is dead (Ray says so) and no member has rejoined: tell the others to stop their training
        processes (:data:`STRANDED_AFTER_S`). Their next ones rejoin from their snapshots, and the epoch re-forms
        without the member on the dead node, which is not waited for."""
        with self._cond:
            e, alive = self.state.epoch, self._alive_nodes
            if e is None or alive is None or self.state.first_rejoin_at is not None or self.job_finished:
                return
            dead = [m for m in e.members if m.node_id not in alive]
            if not dead:
                return
            now = self.clock()
            if now - self._node_dead_at.setdefault(e.number, now) < STRANDED_AFTER_S:
                return
            stranded = [(m.worker_id, m.address, m.probe_port) for m in e.members if m.node_id in alive]
            where = ", ".join(sorted({f"node {m.node_id[:12]} in {m.datacenter}" for m in dead}))
        self._stop(e, stranded, EventKind.WORKER_STRANDED,
                   f"had not left epoch {e.number} {STRANDED_AFTER_S:.0f} s after Ray reported {where} dead (its "
                   "collectives wait on a host that closes nothing: power or network lost)")

    def _assignment_locked(self, wid: str, known_epoch: int) -> Assignment | None:
        e = self.state.epoch
        if e is None or e.number <= known_epoch or wid in self.state.waiting:
            return None
        if not any(m.worker_id == wid for m in e.members):
            return None
        rank = e.rank_of(wid)
        master = e.members[0]
        return Assignment(
            epoch=e.number, rank=rank, world_size=len(e.members), datacenters=e.datacenters,
            master_addr=master.address, master_port=self._ports[master.worker_id], resume_step=e.resume_step,
            from_checkpoint=e.from_checkpoint, newcomer_ranks=tuple(e.rank_of(w) for w in e.newcomers),
            snapshot_every=max(m.snapshot_every for m in e.members), suspend=e.suspend,
        )

    def _decide_locked(self) -> None:
        if self.closed:
            return
        alive = self._alive_nodes if self._alive_nodes is not None else {m.node_id for m in self.state.waiting.values()} | (
            {m.node_id for m in self.state.epoch.members} if self.state.epoch else set())
        decision = decide(self.state, self.clock(), alive_nodes=alive, grace_s=self.grace_s,
                          start_timeout_s=self.start_timeout_s, gone=self.liveness.gone)
        if isinstance(decision, Wait):
            if decision.reason != self.wait_reason:
                self.wait_reason = decision.reason
                self.on_event(EventKind.WAITING, decision.reason, {})
            return
        if isinstance(decision, Form):
            e = replace(decision.epoch, suspend=True) if self.suspending else decision.epoch
            self.state.epoch = e
            for m in e.members:
                self.state.waiting.pop(m.worker_id, None)
            self.state.first_rejoin_at = None
            self.wait_reason = ""
            for m in decision.lost:
                self.on_event(EventKind.WORKER_LOST, f"lost the worker in {m.datacenter} on node {m.node_id[:12]}",
                              {"worker_id": m.worker_id, "datacenter": m.datacenter, "node_id": m.node_id})
            per_dc: dict[str, int] = {}
            for dc in e.datacenters:
                per_dc[dc] = per_dc.get(dc, 0) + 1
            layout = ", ".join(f"{n} in {dc}" for dc, n in per_dc.items())
            how = "from the latest checkpoint" if e.from_checkpoint else f"at step {e.resume_step}"
            self.on_event(
                EventKind.EPOCH_FORMED,
                f"epoch {e.number}: {len(e.members)} worker(s) ({layout}), resuming {how}"
                + (f"; {len(e.newcomers)} joined" if e.number > 1 and e.newcomers else ""),
                {"epoch": e.number, "datacenters": list(e.datacenters), "resume_step": e.resume_step,
                 "lost": [m.worker_id for m in decision.lost], "newcomers": list(e.newcomers),
                 "from_checkpoint": e.from_checkpoint, "time": time.time(),
                 "snapshot_every": max(m.snapshot_every for m in e.members),
                 "placement": [{"rank": r, "worker_id": m.worker_id, "node_id": m.node_id, "datacenter": m.datacenter}
                               for r, m in enumerate(e.members)]},
            )
            self._cond.notify_all()
