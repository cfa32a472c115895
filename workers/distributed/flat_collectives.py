"""The flat-tensor all-gather under whichever name this torch gives it (the inter-DC step's compressed payloads,
:mod:`meridian.workers.sync.inter_dc`).

torch 2.13 renamed ``all_gather_into_tensor`` → ``all_gather_single`` (and ``reduce_scatter_tensor`` →
``reduce_scatter_single``; the old names still work there, with a FutureWarning). Meridian supports torch ≥ 2.4,
and a GPU image ships torch 2.11, which has only the old names: calling the new ones there failed every
multi-rank job's first step (seen on an H100 host: ``module 'torch.distributed' has no attribute
'reduce_scatter_single'``). This takes the new name when torch has it, else the old one, looked up at each call
(tests count collectives by patching :mod:`torch.distributed`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

ALL_GATHER_NAMES = ("all_gather_single", "all_gather_into_tensor")


def _collective(names: tuple[str, ...]):
    for name in names:
        fn = getattr(dist, name, None)
        if fn is not None:
            return fn
    raise RuntimeError(f"torch {torch.__version__} has none of torch.distributed.{', '.join(names)}")


def all_gather_single(output, input, **kwargs: Any):
    """``output`` ← every rank's ``input``, concatenated in rank order."""
    return _collective(ALL_GATHER_NAMES)(output, input, **kwargs)
