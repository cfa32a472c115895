"""Measurements run on the nodes themselves: collective and compute benchmarks, replica consistency."""
