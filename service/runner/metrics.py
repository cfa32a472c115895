"""Job metrics for the Ray metrics endpoint: what a job's runner folds from records, heartbeats and events.

Decide apart from doing: :class:`JobMetricsState` turns what the workers push into a snapshot of
``(metric, tags) → value`` (pure, tested without Ray); :class:`RayJobMetrics` hands a snapshot to
``ray.util.metrics``, which the runner actor's raylet exports on the Ray metrics endpoint (Ray prefixes
every user metric with ``ray_``). :data:`JOB_METRICS` is the one list of names, kinds and tags: the
dashboards test reads it, so a panel cannot query a metric the code does not export.

Every metric carries ``job_id`` and ``datacenter``; job-wide figures (loss, lr, tokens/s...) use
``datacenter="all"``. Must not import ``meridian.api``.
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from meridian.service.runner.liveness.judge import Beat, Liveness, LivenessPolicy, Verdict
from meridian.workers.contracts.events import EventKind, JobEvent
from meridian.workers.contracts.records import StepRecord

ALL_DCS = "all"
RECENT_STEPS = 50
"""Heartbeats kept per rank for the per-datacenter means and the liveness judge's median step time."""
SLOW_WINDOW = 16
"""A rank's last steps whose compute times the liveness judge compares (a median: one slow step is not a slow rank)."""


@dataclass(frozen=True)
class MetricDef:
    name: str
    kind: str  # "gauge" | "counter" | "histogram"
    description: str
    tags: tuple[str, ...] = ("job_id", "datacenter")
    boundaries: tuple[float, ...] = ()


STEP_BOUNDARIES = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

JOB_METRICS: tuple[MetricDef, ...] = (
    MetricDef("meridian_job_loss", "gauge", "Training loss of the last step (global mean over ranks)"),
    MetricDef("meridian_job_learning_rate", "gauge", "Learning rate of the last step"),
    MetricDef("meridian_job_tokens_per_second", "gauge", "Training throughput of the last step, all ranks"),
    MetricDef("meridian_job_mfu", "gauge",
              "Model FLOPs utilisation: model FLOPs/token x tokens/s / (workers x measured matmul peak)"),
    MetricDef("meridian_job_step_seconds", "gauge",
              "Wall time of the last step (datacenter=all: rank 0; per DC: mean of its ranks)"),
    MetricDef("meridian_job_step_phase_seconds", "gauge",
              "Where a step's time went: data (loader), compute (fwd/bwd/optimizer), sync_wait (blocked on "
              "communication), comm (gradient sync in flight, overlapped or not)",
              tags=("job_id", "datacenter", "phase")),
    MetricDef("meridian_job_comm_seconds", "gauge",
              "Gradient sync time per link tier (rank 0): intra_dc = reduce-scatters inside the DC, inter_dc = "
              "the rest of the sync (all-reduce across DCs and its waits); 0 for flat DDP, whose comm is hidden",
              tags=("job_id", "datacenter", "tier")),
    MetricDef("meridian_job_inter_dc_bytes_per_second", "gauge",
              "Tensor bytes put into inter-datacenter collectives per second, all ranks"),
    MetricDef("meridian_job_overlap_fraction", "gauge", "Share of the gradient sync hidden behind backward"),
    MetricDef("meridian_job_live_workers", "gauge",
              "Members the liveness judge finds alive or slow (neither dead nor stuck), per datacenter"),
    MetricDef("meridian_job_steps_total", "counter", "Optimizer steps completed"),
    MetricDef("meridian_job_recoveries_total", "counter",
              "Recoveries: groups re-formed after losing workers (per DC: workers lost there)"),
    MetricDef("meridian_job_step_duration_seconds", "histogram", "Distribution of step wall times",
              boundaries=STEP_BOUNDARIES),
)
PHASES = ("data", "compute", "sync_wait", "comm")

Key = tuple[str, tuple[tuple[str, str], ...]]


def _key(name: str, **tags: str) -> Key:
    return name, tuple(sorted(tags.items()))


@dataclass
class JobMetricsState:
    """Folds one job's pushes into current gauge values and counter/histogram increments."""

    job_id: str
    policy: LivenessPolicy = field(default_factory=LivenessPolicy)
    rank_dc: dict[int, str] = field(default_factory=dict)
    last_beat: dict[int, dict[str, Any]] = field(default_factory=dict)
    computed: dict[int, tuple[int, float]] = field(default_factory=dict)  # rank → (step computed, when)
    recent: dict[int, deque[dict[str, Any]]] = field(default_factory=dict)
    gauges: dict[Key, float] = field(default_factory=dict)
    pending_counts: dict[Key, float] = field(default_factory=dict)
    pending_observations: list[tuple[Key, float]] = field(default_factory=list)
    stale_dcs: set[str] = field(default_factory=set)
    """Datacenters with heartbeats since their means were last computed: they are computed at :meth:`drain`, once,
    not at every beat (each mean reads every rank of its datacenter: per beat, a job's beats cost N² a step)."""

    def tags(self, dc: str = ALL_DCS, **extra: str) -> dict[str, str]:
        return {"job_id": self.job_id, "datacenter": dc, **extra}

    def _count(self, name: str, n: float, **tags: str) -> None:
        k = _key(name, **tags)
        self.pending_counts[k] = self.pending_counts.get(k, 0.0) + n

    def on_record(self, r: StepRecord) -> None:
        t = self.tags()
        for name, value in (
            ("meridian_job_loss", r.loss), ("meridian_job_learning_rate", r.lr),
            ("meridian_job_tokens_per_second", r.tokens_per_s), ("meridian_job_mfu", r.mfu),
            ("meridian_job_step_seconds", r.step_s), ("meridian_job_overlap_fraction", r.overlap_fraction),
        ):
            if value is not None:
                self.gauges[_key(name, **t)] = float(value)
        if r.step_s:
            self.gauges[_key("meridian_job_inter_dc_bytes_per_second", **t)] = r.inter_dc_bytes / r.step_s
            self.pending_observations.append((_key("meridian_job_step_duration_seconds", **t), r.step_s))
        for phase, value in (("data", r.data_s), ("compute", r.compute_s), ("sync_wait", r.sync_wait_s),
                             ("comm", r.comm_s)):
            self.gauges[_key("meridian_job_step_phase_seconds", **t, phase=phase)] = float(value)
        for tier, value in (("intra_dc", r.comm_intra_dc_s), ("inter_dc", r.comm_inter_dc_s)):
            self.gauges[_key("meridian_job_comm_seconds", **t, tier=tier)] = float(value)
        self._count("meridian_job_steps_total", 1, **t)

    def on_event(self, event: JobEvent) -> None:
        p = event.payload
        if event.kind is EventKind.WORKER_STARTED and p.rank is not None:
            self.rank_dc[p.rank] = p.datacenter
        elif event.kind is EventKind.WORKER_LOST:
            self._count("meridian_job_recoveries_total", 1, **self.tags(p.datacenter))
        elif event.kind is EventKind.EPOCH_FORMED:
            if p.placement:  # the ranks of the new membership; old ranks' beats no longer apply
                self.rank_dc = {s.rank: s.datacenter for s in p.placement}
                self.last_beat.clear()
                self.computed.clear()
                self.recent.clear()  # a rank number may now name another worker: its step times are not this one's
            if p.epoch > 1:
                self._count("meridian_job_recoveries_total", 1, **self.tags())

    def on_heartbeat(self, beat: dict[str, Any]) -> None:
        rank = int(beat["rank"])
        if beat.get("phase") == "computed":  # progress marker only: no timings in it
            self.computed[rank] = (int(beat["step"]), float(beat["time"]))
            return
        self.last_beat[rank] = beat
        self.recent.setdefault(rank, deque(maxlen=RECENT_STEPS)).append(beat)
        dc = self.rank_dc.get(rank)
        if dc is not None:
            self.stale_dcs.add(dc)

    def _refresh_dc_means(self) -> None:
        """Each stale datacenter's step and phase times: the mean over its ranks' last heartbeats."""
        for dc in self.stale_dcs:
            mine = [self.last_beat[r] for r, d in self.rank_dc.items() if d == dc and r in self.last_beat]
            if not mine:
                continue
            self.gauges[_key("meridian_job_step_seconds", **self.tags(dc))] = statistics.fmean(b["step_s"] for b in mine)
            for phase in ("data", "compute", "sync_wait"):
                self.gauges[_key("meridian_job_step_phase_seconds", **self.tags(dc, phase=phase))] = statistics.fmean(
                    b[f"{phase}_s"] for b in mine)
        self.stale_dcs.clear()

    def beats(self) -> dict[int, Beat]:
        """Per rank: last step finished, last step computed, when it last said anything, its recent compute times
        (what the liveness judge reads)."""
        view = {}
        for rank in set(self.last_beat) | set(self.computed):
            done = self.last_beat.get(rank, {})
            computed, at = self.computed.get(rank, (int(done.get("step", 0)), float(done.get("time", 0.0))))
            view[rank] = Beat(step=int(done.get("step", 0)), computed=computed, at=max(at, float(done.get("time", 0.0))),
                              compute_s=self._last_compute_s(rank))
        return view

    def _last_compute_s(self, rank: int) -> tuple[float, ...]:
        recent = self.recent.get(rank)
        if not recent:
            return ()
        last = [b["compute_s"] for b in itertools.islice(reversed(recent), SLOW_WINDOW) if "compute_s" in b]
        return tuple(reversed(last))

    def recent_step_s(self) -> list[float]:
        return [b["step_s"] for beats in self.recent.values() for b in beats]

    def refresh_live(self, verdicts: Iterable[Verdict]) -> None:
        """Live workers per DC: the members the liveness judge found alive or slow (neither dead nor stuck)."""
        live = dict.fromkeys(self.rank_dc.values(), 0)
        for v in verdicts:
            if v.rank is not None:
                live[v.datacenter] = live.get(v.datacenter, 0) + int(v.liveness in (Liveness.ALIVE, Liveness.SLOW))
        for dc, n in live.items():
            self.gauges[_key("meridian_job_live_workers", **self.tags(dc))] = float(n)
        self.gauges[_key("meridian_job_live_workers", **self.tags())] = float(sum(live.values()))

    def drain(self) -> tuple[dict[Key, float], dict[Key, float], list[tuple[Key, float]]]:
        """Current gauges, counter increments and histogram observations since the last drain."""
        self._refresh_dc_means()
        counts, obs = self.pending_counts, self.pending_observations
        self.pending_counts, self.pending_observations = {}, []
        return dict(self.gauges), counts, obs


class RayJobMetrics:
    """Pushes a :class:`JobMetricsState` into ``ray.util.metrics`` (call inside a Ray worker/actor)."""

    def __init__(self) -> None:
        from ray.util import metrics

        self._m: dict[str, Any] = {}
        for d in JOB_METRICS:
            if d.kind == "gauge":
                self._m[d.name] = metrics.Gauge(d.name, description=d.description, tag_keys=d.tags)
            elif d.kind == "counter":
                self._m[d.name] = metrics.Counter(d.name, description=d.description, tag_keys=d.tags)
            else:
                self._m[d.name] = metrics.Histogram(d.name, description=d.description,
                                                    boundaries=list(d.boundaries), tag_keys=d.tags)

    def export(self, state: JobMetricsState) -> None:
        gauges, counts, observations = state.drain()
        for (name, tags), value in gauges.items():
            self._m[name].set(value, tags=dict(tags))
        for (name, tags), n in counts.items():
            self._m[name].inc(n, tags=dict(tags))
        for (name, tags), value in observations:
            self._m[name].observe(value, tags=dict(tags))
