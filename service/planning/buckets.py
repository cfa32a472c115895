"""How big the gradient buckets are when a job leaves it to the planner, and how FSDP2 cuts a model into units.

Backward produces gradients from the last layer to the first, and each bucket's sync starts once its
gradients are complete (DDP's ``bucket_cap_mb`` under flat sync, :mod:`meridian.workers.sync.flat`; the
hierarchical engine syncs per FSDP2 unit, a transformer block, and the cost model takes the bucket size as the
size of what is synced last). A model that fits in one bucket syncs only after
backward, all of it exposed; that was the demo job's case with the old fixed 4 MiB bucket (a 3.5 MB model,
overlap fraction 0.01 through the API). Cutting the gradients into several buckets lets the first ones sync
while backward still runs, so only the last bucket's sync is necessarily exposed. Each bucket is a collective
of its own with a fixed cost; on the lab, with four buckets of 1 MiB, overlapping saved 1–4% of a step at 21 ms
RTT (``meridian bench lab``'s ``overlap_saving``). So the planner aims at :data:`TARGET_BUCKETS` buckets, none
smaller than :data:`MIN_BUCKET_MB` nor larger than :data:`MAX_BUCKET_MB`.

The hierarchical engine has no buckets: its pieces are FSDP2's units, one per transformer block or the whole
model as one, which the planner chooses with the cost model (each collective's fixed cost against what
overlapping it saves: :func:`meridian.service.planning.candidates._fastest_fsdp_setting`).
"""

from __future__ import annotations

TARGET_BUCKETS = 4
"""Buckets a replica's gradients are cut into when the size limits allow."""
MIN_BUCKET_MB = 1.0
"""Below this a bucket's fixed per-collective cost outweighs what overlapping it saves."""
MAX_BUCKET_MB = 25.0
"""PyTorch DDP's default ``bucket_cap_mb``: large models get many buckets of this size."""


def bucket_mb_for(grad_bytes: float) -> float:
    """The bucket size (MiB) for a replica whose gradients take ``grad_bytes`` on each device (fp32 gradients of
    the parameters one device holds: the whole model, or its tensor/pipeline slice)."""
    if grad_bytes <= 0:
        raise ValueError(f"grad_bytes must be > 0, got {grad_bytes!r}")
    return min(MAX_BUCKET_MB, max(MIN_BUCKET_MB, grad_bytes / TARGET_BUCKETS / 2**20))


def buckets_of(grad_bytes: float, bucket_mb: float) -> int:
    """How many buckets gradients of ``grad_bytes`` fill at ``bucket_mb`` (about: whole parameters per bucket)."""
    return max(1, -(-int(grad_bytes) // int(bucket_mb * 2**20)))

