"""Gradient-sync engines: how data-parallel replicas agree on one update per step (HAR, flat DDP, DiLoCo)."""
