"""A profiler request between a worker's agent and its training process: a small file in the worker's folder
(RAM, beside its snapshots), which the agent writes and the training process takes; torch-free, like the agent."""

from __future__ import annotations

import contextlib
import json
import os

REQUEST = "profile-request.json"


def write_request(folder: str, request_id: str, steps: int) -> None:
    """Leave the request (replacing an older one not taken yet) for the training process."""
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{REQUEST}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"id": request_id, "steps": steps}, f)
    os.replace(tmp, os.path.join(folder, REQUEST))


def take_request(folder: str) -> tuple[str, int] | None:
    """The request waiting in ``folder``, removed from it; ``None`` if there is none (or it is unreadable)."""
    path = os.path.join(folder, REQUEST)
    taken = f"{path}.{os.getpid()}.taken"
    try:
        os.replace(path, taken)  # one taker only, even with two processes of the worker alive for a moment
    except FileNotFoundError:
        return None
    try:
        with open(taken, encoding="utf-8") as f:
            data = json.load(f)
        return str(data["id"]), int(data["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(taken)
