"""Which process-group backend a rank uses, and which device its collectives run on.

One design everywhere: the default process group (and every group created from it without a backend) is
made **per device type**. A rank with a GPU initialises with ``cpu:gloo,cuda:nccl``, so CUDA tensors go
through NCCL and the small CPU tensors that still cross ranks (object collectives, stats of the WAN
emulator, the benchmarks' timings, the pipeline's tiny headers) go through gloo, never through NCCL, which
rejects them. A CPU rank uses plain ``gloo``. Nothing hard-codes one backend: :func:`backend_for` picks it
from the rank's device.

A CUDA rank also binds its device before the group exists (:func:`bind_device`) and passes it as
``device_id``, so NCCL connects eagerly on that GPU and ``barrier``, ``all_gather_object`` and
``broadcast_object_list`` use it instead of whatever device is current (cuda:0 for every rank of a node).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

PER_DEVICE_BACKEND = "cpu:gloo,cuda:nccl"


def backend_for(device: torch.device | str) -> str:
    """``cpu:gloo,cuda:nccl`` for a rank on a GPU, ``gloo`` for a CPU rank. Torch-free: a joining worker's agent
    asks before (and without) importing torch."""
    kind = device.type if not isinstance(device, str) else device.split(":", 1)[0]
    return PER_DEVICE_BACKEND if kind == "cuda" else "gloo"


def bind_device(device: torch.device | str, local_rank: int | None = None) -> torch.device:
    """Make ``device`` this process's current CUDA device (a no-op on CPU); returns it with its index.

    ``local_rank`` names the GPU when ``device`` has no index (``cuda``): Ray Train's local rank, or the
    rendezvous' rank on its node."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return device
    if device.index is None:
        device = torch.device("cuda", local_rank or 0)
    torch.cuda.set_device(device)
    return device


def init_kwargs(device: torch.device | str) -> dict[str, Any]:
    """The device-dependent arguments of ``init_process_group``: backend and, on CUDA, ``device_id``."""
    import torch

    device = torch.device(device)
    kwargs: dict[str, Any] = {"backend": backend_for(device)}
    if device.type == "cuda":
        kwargs["device_id"] = device
    return kwargs
