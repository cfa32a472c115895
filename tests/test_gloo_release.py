"""``meridian bench gloo-release``: what releases a gloo rank blocked on a live peer that failed (the fact an
in-process re-formation would rest on; the agent ends the training process today)."""

from __future__ import annotations

import argparse

from meridian.bench import gloo_release


def test_abort_and_dropping_every_reference_releases_a_blocked_survivor_while_every_process_lives():
    args = argparse.Namespace(modes=["abort-drop"], numel=1_000_000, die_after_s=0.3, linger_s=60.0, timeout_s=120.0)
    out = gloo_release.run(args)["abort-drop"]
    assert "error" not in out, out
    assert all(r["failed"] for r in out["ranks"].values()), out
    # Every survivor failed before the ones that failed first exited (they linger 60 s, gloo's timeout is 120 s):
    # so the drop closed their sockets, not an exit or a timeout.
    assert out["released_in_process"], out
