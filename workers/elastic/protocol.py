"""What the agent and its training process agree on, kept apart so the agent (the Ray Train worker) can
start without importing the training stack, which its standby process pays for instead."""

RESTART_EXIT_CODE = 75
"""A training process's exit code for "my epoch broke (a peer failed): start me again"."""

LEAVING = "leaving"
"""The message a training process sends right before it exits with :data:`RESTART_EXIT_CODE`."""

KEEP_SNAPSHOTS = 3
"""Ranks of one epoch are at most one step apart when it breaks; three shards leave a margin."""
