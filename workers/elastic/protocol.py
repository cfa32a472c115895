"""What the agent and its training process agree on, kept apart so the agent (the Ray Train worker) can
start without importing the training stack, which its standby process pays for instead."""

from __future__ import annotations

import os
from collections.abc import Mapping

RESTART_EXIT_CODE = 75
"""A training process's exit code for "my epoch broke (a peer failed): start me again"."""

LEAVING = "leaving"
"""The message a training process sends right before it exits with :data:`RESTART_EXIT_CODE`."""

RECOVERED = "recovered"
"""The message a training process sends when a peer's failure broke its epoch and it joins again itself (on CPU:
see :mod:`meridian.workers.elastic.child`), where a process on a GPU exits to be restarted."""

KEEP_SNAPSHOTS = 3
"""Ranks of one epoch are at most one step apart when it breaks; three shards leave a margin."""

BEATS_EVERY_S = 0.25
"""A rank's heartbeats leave its training process in one message this often, at the least. Sent one by one (two
per rank per step, each a pipe message and then a Ray call to the job's runner), they cost the runner and the
agents ~19% of the CPU of a job of 50 ms steps on two cores (``bench recovery``: 22 of 116 CPU-seconds); stall
detection waits 5 s at the least, so a quarter of a second changes nothing it sees."""
BEAT_CALLS_PER_S = 1000.0
"""Heartbeat batches per second a job's ranks send its runner together (each batch is one call the runner
serves): a large job's ranks batch for longer (:func:`beats_every_s`)."""
BEATS_EVERY_MAX_S = 2.0
"""The longest a rank batches its heartbeats: stall detection waits 5 s at the least, and a batch this old leaves it
3 s to tell a silent rank from a batch on its way."""


def beats_every_s(world_size: int) -> float:
    """How often each rank of a ``world_size``-rank epoch sends its batch of heartbeats: every
    :data:`BEATS_EVERY_S`, or as often as keeps the job's batches near :data:`BEAT_CALLS_PER_S`, at most every
    :data:`BEATS_EVERY_MAX_S`."""
    return min(BEATS_EVERY_MAX_S, max(BEATS_EVERY_S, world_size / BEAT_CALLS_PER_S))


REFORM_ENV = "MERIDIAN_REFORM"
"""``new-process``: a training process on CPU whose epoch broke exits, and the agent's standby joins in its place,
instead of re-forming in its own process (the way it was before; ``meridian bench recovery`` compares both)."""


def re_forms_in_process(device: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether a training process on ``device`` joins the next epoch itself after a peer's failure: on CPU, unless
    :data:`REFORM_ENV` says ``new-process``. On a GPU it exits (see :mod:`meridian.workers.elastic.agent`)."""
    value = (os.environ if environ is None else environ).get(REFORM_ENV, "in-process")
    if value not in ("in-process", "new-process"):
        raise ValueError(f"{REFORM_ENV}={value!r}: expected 'in-process' or 'new-process'")
    return not device.startswith("cuda") and value == "in-process"
