"""Meridian: train one model across several datacenters as if they were one.

The code lives in top-level folders that install under this package: ``meridian.api`` (HTTP and CLI),
``meridian.service`` (control plane), ``meridian.workers`` (code inside Ray Train workers) and
``meridian.bench`` (benchmarks). Imports flow one way: api → service → workers.
"""

__version__ = "0.1.0"
