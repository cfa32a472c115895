"""The Ray Train backend Meridian runs its TorchTrainer with.

Two differences from Ray Train's torch backend, both for node-loss recovery:

- Every worker is its own *replica group*. When a worker dies, Ray Train replaces only that worker (at its
  placement bundle, once its datacenter has capacity again) and leaves the survivors running — measured
  here: survivors kept training while the controller waited for a replacement, and the replacement
  started ~20 s after a node rejoined. (This rides on Ray 2.60's replica-group support, added for torchft;
  the class attribute it needs is checked at import so a Ray without it fails loudly, not silently.)
- Ray Train does not build a torch process group. Meridian's workers form their own through the job's
  runner (rank 0 of each epoch hosts the store), so the survivors can re-form it without a restart.
"""

from __future__ import annotations

from typing import Any

from ray.train.backend import Backend
from ray.train.torch import TorchConfig
from ray.train.torch.config import _TorchBackend

if not hasattr(Backend, "has_replica_groups"):  # pragma: no cover - depends on the installed Ray
    raise ImportError("Meridian needs Ray Train with replica-group support (ray>=2.60): upgrade ray")


class _MeridianBackend(_TorchBackend):
    has_replica_groups = True

    def on_start(self, worker_group: Any, backend_config: Any) -> None:
        # Meridian forms (and re-forms) its own process groups; see meridian.workers.rendezvous.
        pass


class MeridianTorchConfig(TorchConfig):
    @property
    def backend_cls(self) -> type[_MeridianBackend]:
        return _MeridianBackend
