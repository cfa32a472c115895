"""The rendezvous of an elastic job: workers join, the coordinator forms epochs, everyone learns its rank.

Hosted by the job's runner actor (thread-safe; workers call it concurrently). A worker calls
:meth:`Coordinator.join` at start and again whenever its epoch breaks (a peer failed) or must grow (a
newcomer waits); each call returns within ``poll_s`` either an assignment for a newer epoch or "wait, because
…", so no actor call blocks for long. Decisions come from :func:`meridian.service.runner.membership.decide`.
Every formation and loss is reported through ``on_event``.

It is also where the job's one liveness path gathers its evidence: the runner's ticker calls :meth:`tick` with
Ray's view of live nodes and the ranks' heartbeats; the coordinator adds what it knows (who rejoined, since
when, what each silent member's liveness port answered: :mod:`meridian.service.runner.liveness.probes`) and
judges every worker in one place (:func:`meridian.service.runner.liveness.judge.judge`). New verdicts go to
``on_verdicts`` (the runner's controller, which decides what to do about them); :meth:`carry_out` does it:
a dead worker is not waited for, a stuck member's agent is told to stop that epoch's training process (the
next one rejoins within seconds instead of after gloo's collective timeout), a silent or slow rank is named.

Ray's view of a node is slow to change (3 s with the fast health checks of a cluster Meridian starts, 13 s
with a ``ray start`` cluster's defaults). The evidence is often there sooner: when a member dies, its peers'
collectives fail and they rejoin while it does not. From that moment (a re-formation is pending), the
coordinator probes each member that has not rejoined, whenever a worker rejoins and on every tick, and judges.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

from meridian.service.runner.controller.decide import LeaveBehind, LivenessAction, StopStuck, liveness_actions
from meridian.service.runner.liveness.judge import (
    Beat,
    Cause,
    Liveness,
    LivenessPolicy,
    RankSeen,
    Seen,
    Verdict,
    judge,
)
from meridian.service.runner.liveness.probes import Probes
from meridian.service.runner.liveness.watch import LivenessWatch
from meridian.service.runner.membership import Epoch, Form, Member, MembershipState, Wait, decide
from meridian.workers.contracts.events import EventKind
from meridian.workers.contracts.fields import to_plain
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
NEWCOMERS_PROBE_AFTER_S = 5.0
"""Newcomers that have waited this long for the members' next step boundary make every tick probe the members
(they may all be gone with an ended Train run, which only a probe tells)."""

RETRY_AFTER_S = 0.5
"""A join that finds :attr:`Coordinator.max_waiters` calls already held open is registered, answered at once and
told to call again after at least this long."""
JOIN_CALLS_PER_S = 1000.0
"""Join calls per second that the workers not held open make together: a large job's call-back delay is sized so
(:attr:`Coordinator.retry_after_s`), and a worker that calls back is not taken for gone before
:data:`STALE_POLL_S` past that delay."""
WAITING_EVENT_EVERY_S = 1.0
"""A wait reason that changes only in its counts ("12 of 3072 workers have started") is reported as an event at
most this often (the runner's tick reports the latest); one that changes in kind is reported at once."""

EventSink = Callable[[str, str, dict[str, Any]], None]


class Coordinator:
    def __init__(self, *, planned_workers: int, min_workers: int, dc_order: tuple[str, ...], on_event: EventSink,
                 grace_s: float = 5.0, start_timeout_s: float = 300.0, clock: Callable[[], float] = time.monotonic,
                 probes: Probes | None = None, abort_after_s: float | None = None,
                 policy: LivenessPolicy | None = None,
                 on_verdicts: Callable[[tuple[Verdict, ...]], None] | None = None,
                 max_waiters: int | None = None) -> None:
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
        """Epoch number → when the runner first reported one of its members' node dead (stranded members)."""
        self.wait_reason = ""
        self.finished: set[str] = set()
        self.probes = probes or Probes()
        self.policy = policy or LivenessPolicy(abort_after_s=grace_s / 3 if abort_after_s is None else abort_after_s)
        """The judge's thresholds; a member that answers but has not rejoined is stuck ``grace_s / 3`` after its
        peers first rejoined, unless ``abort_after_s`` says otherwise."""
        self.watch = LivenessWatch()
        self.on_verdicts = on_verdicts or (lambda verdicts: self.carry_out(liveness_actions(verdicts)))
        """Where new verdicts go: the runner's controller; alone, straight to :meth:`carry_out`."""
        self.left_behind: set[str] = set()
        """Workers judged dead and left behind: the membership does not wait for them (until one calls again)."""
        self._beats: dict[int, Beat] = {}
        self._beats_at = 0.0
        self._recent_step_s: tuple[float, ...] = ()
        self.closed = False
        """The job is ending (cancelled, failed, or its run stopped): no epoch forms, and joins are told to end."""
        self.suspending = False
        """The job is being suspended: its members leave at the next step boundary, and the epoch they form then
        writes a durable checkpoint and stops (:attr:`~meridian.workers.contracts.rendezvous.Assignment.suspend`)."""
        self._suspended: dict[str, int] = {}  # member of the suspend epoch → the step its checkpoint part holds
        self.max_waiters = max_waiters
        """Join calls held open at most (``None``: every one). The host runs each call on one of a fixed number
        of threads: with more ranks than threads, held calls would queue the other ranks' joins (and every other
        call) behind their polls, so a first epoch of N ranks took N / threads polls to register everyone."""
        self._waiters = 0
        self.retry_after_s = max(RETRY_AFTER_S, (planned_workers - (max_waiters or 0)) / JOIN_CALLS_PER_S)
        """How long a join not held open is told to wait before calling again: sized to the job, so the calls of
        its waiting workers stay near :data:`JOIN_CALLS_PER_S` whatever its size."""
        self._silent: dict[str, None] = {}
        """Members of the current epoch with a liveness port that have not rejoined and are not left behind, in rank
        order: whom a pending re-formation probes (kept as joins come, not found by a scan of the members)."""
        self._back: set[str] = set()
        """The waiting workers that are members of the current epoch (rejoined), kept as joins come."""
        self._new: dict[str, None] = {}
        """The waiting workers that are not (newcomers), kept as joins come."""
        self._judging = threading.Lock()
        """Held by the one join (or waiting call) judging: the others do not judge the same evidence again."""
        self._said: tuple[str, float] = ("", float("-inf"))  # the last wait reason reported, and when

    # -- called by workers ------------------------------------------------------------------------------
    def join(self, request: JoinRequest, known_epoch: int = 0, poll_s: float = 2.0) -> JoinReply:
        """Register (or re-register) a worker; return its assignment in an epoch newer than ``known_epoch``,
        or :class:`Waiting` with the reason after ``poll_s`` (the worker calls again)."""
        wid = request.worker_id
        with self._cond:
            rejoining = self.state.epoch is not None and self.state.epoch.has(wid)
            polled = self._polls_again_locked(request)
        if not polled:
            # Outside the lock: a probe of an unreachable host takes its timeout.
            self._judge(also=wid if rejoining else "", only_news=True)
        with self._cond:
            if self.job_finished or self.closed:
                return Finished()  # a late worker (a replacement, one left out) has nothing to do
            now = self.clock()
            self.probes.revive(wid)  # it calls: whatever a probe found before, its process is alive
            self.watch.forget(wid)
            self.left_behind.discard(wid)
            a = self._assignment_locked(wid, known_epoch)
            if a is not None:
                # The epoch formed between two of its calls (it was told to wait, then the others arrived):
                # registering it again as waiting would break that epoch before it formed its group.
                self._track_silent_locked(wid)
                return a
            polled = self._polls_again_locked(request)
            self._ports[wid] = request.port
            self.state.waiting[wid] = Member.from_request(request, joined_at=self._first_seen.setdefault(wid, now))
            if self.state.epoch is not None and self.state.epoch.has(wid):
                self._back.add(wid)
            else:
                self._new[wid] = None
            self._called_locked(wid, now)
            self._silent.pop(wid, None)
            if self.state.epoch is None and self.state.first_join_at is None:
                self.state.first_join_at = now
            is_member = self.state.epoch is not None and self.state.epoch.has(wid)
            if is_member and self.state.first_rejoin_at is None:
                self.state.first_rejoin_at = now
            if not polled:
                self._decide_locked()
            if self.max_waiters is not None and self._waiters >= self.max_waiters:
                # Not held: no thread waits for this worker; it calls back, after a delay sized to the job.
                a = self._assignment_locked(wid, known_epoch)
                if a is not None:
                    return a
                if self.job_finished or self.closed:
                    return Finished()
                return Waiting(self.wait_reason, retry_after_s=self.retry_after_s)
            self._waiters += 1
            try:
                return self._wait_locked(wid, known_epoch, now + poll_s)
            finally:
                self._waiters -= 1

    def _wait_locked(self, wid: str, known_epoch: int, deadline: float) -> JoinReply:
        """Hold a join call open until its worker has an assignment, the job ends, or ``deadline``."""
        while True:
            if wid in self.state.waiting:
                self._called_locked(wid, self.clock())  # waiting in a call counts as calling
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
                self._judge(only_news=True)
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
        return e is not None and not self.finished.isdisjoint(e.ids)  # asked at every join: no scan of the members

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

    def tick(self, alive_nodes: set[str], beats: Mapping[int, Beat] | None = None, beats_at: float = 0.0,
             recent_step_s: tuple[float, ...] = ()) -> tuple[Verdict, ...]:
        """Ray's view of live nodes and, when given, the ranks' heartbeats (``beats`` by rank of the current epoch,
        read at ``beats_at`` on the runner's wall clock): judge every worker with them; every verdict."""
        with self._cond:
            self._alive_nodes = alive_nodes
            if beats is not None:
                self._beats, self._beats_at, self._recent_step_s = dict(beats), beats_at, tuple(recent_step_s)
        verdicts = self._judge()
        with self._cond:
            self._decide_locked()
        return verdicts

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

    def waiting_view(self) -> tuple[str, bool]:
        """:attr:`wait_reason` and :attr:`job_finished`, what the runner's every poll reads (:meth:`status` lists
        every waiting worker and rank)."""
        with self._cond:
            return self.wait_reason, self.job_finished

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
        """Probe every member of the current epoch now (a Train run ended and took its workers with it) and judge
        them; the worker ids of the members judged dead (not waited for)."""
        verdicts = self._judge(everyone=True)
        ids = {m.worker_id for m in self.members()}
        return {v.worker_id for v in verdicts if v.worker_id in ids and v.liveness is Liveness.DEAD}

    # -- liveness: gather what is known, judge it in one place, carry out what the controller decides ----------
    def _judge(self, also: str = "", everyone: bool = False, only_news: bool = False) -> tuple[Verdict, ...]:
        """Probe the workers worth a look now, judge every worker (:func:`~meridian.service.runner.liveness.judge.judge`)
        and hand the verdicts not acted on before to ``on_verdicts``; every verdict. ``also``: a member rejoining
        now (it calls: it is back). Probes and the hand-over run outside the lock: a probe of an unreachable host
        takes its timeout, and acting takes the lock. ``only_news``: judge only if a probe's answer is news or a
        member may be stuck by now (a worker's join: judging every rank at every join of a large job is quadratic;
        what else changes with time alone, the tick judges)."""
        if only_news and not self._judging.acquire(blocking=False):
            return self.watch.current  # another join judges now: what it finds is this join's news too
        try:
            with self._cond:
                suspects = self._suspects_locked(also, everyone)
                due = self._stuck_due_locked()
            news = self.probes.probe_each(suspects)
            if only_news and not news and not due:
                return self.watch.current
            with self._cond:
                verdicts = judge(self._seen_locked(also), self.policy)
                fresh = self.watch.new(verdicts)
        finally:
            if only_news:
                self._judging.release()
        if fresh:
            self.on_verdicts(fresh)
        return verdicts

    def _suspects_locked(self, also: str, everyone: bool) -> list[tuple[str, str, int]]:
        """Who to probe: while a re-formation is pending (a member rejoined), or newcomers have waited
        :data:`NEWCOMERS_PROBE_AFTER_S` for a step boundary, the members that have not rejoined; the waiting
        workers that have not called for :data:`STALE_POLL_S`; every member when ``everyone``."""
        now, e = self.clock(), self.state.epoch
        # _last_call is in call order: the stale are its first entries, and the scan stops at the first that is not.
        limit = STALE_POLL_S + (self.retry_after_s if self.max_waiters is not None else 0.0)
        out = []
        for w, at in self._last_call.items():
            if now - at < limit:
                break
            if w != also and (m := self.state.waiting.get(w)) is not None:
                out.append((w, m.address, m.probe_port))
        if e is None:
            return out
        if everyone:
            return out + [(m.worker_id, m.address, m.probe_port) for m in e.members]
        since = self._newcomers_since_locked()
        if self.state.first_rejoin_at is not None or also or (
                since is not None and now - since >= NEWCOMERS_PROBE_AFTER_S):
            members = e.members
            out += [(w, members[e.ranks[w]].address, members[e.ranks[w]].probe_port) for w in self._silent
                    if w != also]  # fmt: skip
        return out

    def _polls_again_locked(self, request: JoinRequest) -> bool:
        """``request`` is the same as the one its worker waits with: nothing it says changes what is decided or
        judged (what changes with time alone, the runner's tick decides and judges twice a second). A large job's
        waiting workers call back every few seconds; deciding at each call cost each call a pass over the members."""
        m = self.state.waiting.get(request.worker_id)
        return m is not None and m == Member.from_request(request, joined_at=m.joined_at)

    def _called_locked(self, wid: str, now: float) -> None:
        """A waiting worker calls (or waits in a call) at ``now``: it moves to the end of :attr:`_last_call`."""
        self._last_call.pop(wid, None)
        self._last_call[wid] = now

    def _track_silent_locked(self, wid: str) -> None:
        """Put ``wid`` in :attr:`_silent` or take it out, as it now is (a member with a liveness port, not waiting,
        not left behind) or not."""
        e = self.state.epoch
        if (e is not None and e.has(wid) and e.members[e.rank_of(wid)].probe_port and wid not in self.state.waiting
                and wid not in self.left_behind):
            self._silent.setdefault(wid, None)
        else:
            self._silent.pop(wid, None)

    def _stuck_due_locked(self) -> bool:
        """A re-formation, or newcomers, have waited long enough for a member to be judged stuck."""
        # Newcomers are those of a formed epoch: before the first one, everyone waits for the others to start.
        now, since = self.clock(), self._newcomers_since_locked() if self.state.epoch is not None else None
        return ((self.state.first_rejoin_at is not None and now - self.state.first_rejoin_at >= self.policy.abort_after_s)
                or (since is not None and now - since >= self.policy.newcomers_abort_after_s))

    def _newcomers_since_locked(self) -> float | None:
        """When the longest-waiting worker that is not a member first joined (a set difference, not a scan)."""
        waiting = self.state.waiting
        return min((waiting[w].joined_at for w in self._new), default=None)

    def _seen_locked(self, also: str) -> Seen:
        now, e, alive = self.clock(), self.state.epoch, self._alive_nodes
        ranks = []
        for rank, m in enumerate(e.members if e is not None else ()):
            probed, misses = self.probes.seen(m.worker_id)
            ranks.append(RankSeen(worker_id=m.worker_id, rank=rank, node_id=m.node_id, datacenter=m.datacenter,
                                  node_alive=alive is None or m.node_id in alive, probe_port=m.probe_port,
                                  probe=probed, misses=misses, rejoined=m.worker_id in self.state.waiting
                                  or m.worker_id == also, beat=self._beats.get(rank)))  # fmt: skip
        ids = {r.worker_id for r in ranks}
        for w, m in self.state.waiting.items():
            if w not in ids:  # a newcomer; one on a node Ray does not report yet may be too new for the report
                probed, misses = self.probes.seen(w)
                ranks.append(RankSeen(worker_id=w, rank=None, node_id=m.node_id, datacenter=m.datacenter,
                                      probe_port=m.probe_port, probe=probed, misses=misses))
        dead_since = None
        if e is not None and alive is not None and any(m.node_id not in alive for m in e.members):
            dead_since = self._node_dead_at.setdefault(e.number, now)
        reform = self.state.first_rejoin_at if self.state.first_rejoin_at is not None else (now if also else None)
        return Seen(now=now, epoch=e.number if e is not None else 0, ranks=tuple(ranks), reform_since=reform,
                    node_dead_since=dead_since, newcomers_since=self._newcomers_since_locked(),
                    idle=bool(self.wait_reason) or self.job_finished, finished=self.job_finished,
                    beats_at=self._beats_at, recent_step_s=self._recent_step_s)

    def carry_out(self, actions: Iterable[LivenessAction]) -> None:
        """Do what the controller decided about verdicts: leave the dead behind, stop the stuck, name the rest."""
        for a in actions:
            if isinstance(a, LeaveBehind):
                self._leave_behind(a.verdicts)
            elif isinstance(a, StopStuck):
                self._stop(a.verdicts)
            else:
                for v in a.verdicts:
                    self._name(v)

    def _leave_behind(self, verdicts: tuple[Verdict, ...]) -> None:
        with self._cond:
            for v in verdicts:
                self.left_behind.add(v.worker_id)
                self._silent.pop(v.worker_id, None)
                if v.rank is None:
                    self._last_call.pop(v.worker_id, None)
                    m = self.state.waiting.pop(v.worker_id, None)
                    self._new.pop(v.worker_id, None)
                    self._back.discard(v.worker_id)
                    if m is not None:
                        self.on_event(EventKind.WORKER_GONE, f"the waiting worker in {m.datacenter} on node "
                                      f"{m.node_id[:12]} is gone (it stopped calling and {v.reason}): not waited "
                                      "for", {"worker_id": v.worker_id, "cause": v.cause.value})  # fmt: skip
                else:
                    self.on_event(EventKind.WORKER_GONE, f"the worker in {v.datacenter} on node {v.node_id[:12]} is "
                                  f"gone ({v.reason}): re-forming without it",
                                  {"worker_id": v.worker_id, "cause": v.cause.value})  # fmt: skip
            self._decide_locked()

    def _stop(self, verdicts: tuple[Verdict, ...]) -> None:
        """Tell stuck members to stop their training process of the verdicts' epoch (each once); each one whose
        agent did gets an event saying why, and the grace period starts afresh: their next processes are on their
        way back, rejoining from their snapshots."""
        with self._cond:
            e = self.state.epoch
            where = {m.worker_id: m for m in e.members} if e is not None else {}
            mine = [v for v in verdicts if e is not None and v.epoch == e.number and v.worker_id in where]
        if not mine:
            return
        stopped = self.probes.abort([(v.worker_id, where[v.worker_id].address, v.probe_port) for v in mine], e.number)
        with self._cond:
            if stopped and self.state.epoch is e:
                self.state.first_rejoin_at = self.clock()
            for v in mine:
                if v.worker_id in stopped:
                    kind = EventKind.WORKER_STRANDED if v.cause is Cause.STRANDED else EventKind.WORKER_STUCK
                    self.on_event(kind, f"the worker in {v.datacenter} on node {v.node_id[:12]} {v.reason}: its "
                                  "training process was stopped, and the next one rejoins from its snapshots",
                                  {"worker_id": v.worker_id, "epoch": v.epoch})  # fmt: skip

    def _name(self, v: Verdict) -> None:
        if v.stall is not None:
            self.on_event(EventKind.STALL, f"{v.where} {v.reason}", to_plain(v.stall))
        elif v.liveness is Liveness.SLOW:
            self.on_event(EventKind.RANK_SLOW, f"{v.where} {v.reason}",
                          {"rank": v.rank, "worker_id": v.worker_id, "epoch": v.epoch, "step": v.step,
                           "node_id": v.node_id, "datacenter": v.datacenter, "compute_s": v.compute_s,
                           "peers_compute_s": v.peers_compute_s})

    def _reprobe_due_locked(self) -> bool:
        """A re-formation is pending (for under :data:`REPROBE_FOR_S`) and a member that has not rejoined is not
        known gone yet."""
        e, since = self.state.epoch, self.state.first_rejoin_at
        if e is None or since is None or self.clock() - since >= REPROBE_FOR_S:
            return False
        return bool(self._silent)

    def _assignment_locked(self, wid: str, known_epoch: int) -> Assignment | None:
        e = self.state.epoch
        if e is None or e.number <= known_epoch or wid in self.state.waiting:
            return None
        if not e.has(wid):
            return None
        rank = e.rank_of(wid)
        master = e.members[0]
        return Assignment(  # the layout's runs are the epoch's, shared by every member's assignment
            epoch=e.number, rank=rank, world_size=len(e.members), dc_runs=e.dc_runs,
            master_addr=master.address, master_port=self._ports[master.worker_id], resume_step=e.resume_step,
            from_checkpoint=e.from_checkpoint, newcomer_spans=e.newcomer_spans,
            snapshot_every=e.snapshot_every, suspend=e.suspend,
        )

    def _say_waiting_locked(self) -> None:
        """Report :attr:`wait_reason` as an event if it changed in kind, or in its counts only
        :data:`WAITING_EVENT_EVERY_S` after the last report (N joins of a first epoch made N events)."""
        said, at = self._said
        reason, now = self.wait_reason, self.clock()
        if not reason or reason == said:
            return
        if _kind(reason) == _kind(said) and now - at < WAITING_EVENT_EVERY_S:
            return
        self._said = (reason, now)
        self.on_event(EventKind.WAITING, reason, {})

    def _decide_locked(self) -> None:
        if self.closed:
            return
        alive = self._alive_nodes if self._alive_nodes is not None else {m.node_id for m in self.state.waiting.values()} | (
            {m.node_id for m in self.state.epoch.members} if self.state.epoch else set())
        decision = decide(self.state, self.clock(), alive_nodes=alive, grace_s=self.grace_s,
                          start_timeout_s=self.start_timeout_s, gone=self.left_behind, back=self._back)
        if isinstance(decision, Wait):
            self.wait_reason = decision.reason
            self._say_waiting_locked()
            return
        if isinstance(decision, Form):
            e = replace(decision.epoch, suspend=True) if self.suspending else decision.epoch
            self.state.epoch = e
            for m in e.members:
                self.state.waiting.pop(m.worker_id, None)
                self._last_call.pop(m.worker_id, None)
            self._back, self._new = set(), dict.fromkeys(self.state.waiting)  # who waits now waits to join it
            self._silent = {m.worker_id: None for m in e.members if m.probe_port and m.worker_id not in self.left_behind}
            self.state.first_rejoin_at = None
            self.wait_reason = ""
            self._said = ("", float("-inf"))
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
                 "snapshot_every": e.snapshot_every,
                 "placement": [{"rank": r, "worker_id": m.worker_id, "node_id": m.node_id, "datacenter": m.datacenter}
                               for r, m in enumerate(e.members)]},
            )
            self._cond.notify_all()


def _kind(reason: str) -> str:
    """A wait reason without its numbers: what it says, not how far along it is."""
    return re.sub(r"\d+", "#", reason)
