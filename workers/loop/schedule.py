"""The learning-rate schedule: a function of the step alone, so a resumed or resized epoch picks it up
exactly where the old one left off."""

from __future__ import annotations

import math

from meridian.workers.contracts.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at the last step."""
    o = cfg.optim
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    span = max(1, cfg.steps - o.warmup_steps)
    progress = min(1.0, (step - o.warmup_steps) / span)
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
