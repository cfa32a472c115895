"""Meridian: train one model across several datacenters as if they were one.

The code lives in top-level folders that install under this package: ``meridian.cli`` (the command line),
``meridian.api`` (the REST API and its client), ``meridian.service`` (the control plane), ``meridian.workers``
(code inside Ray Train workers), ``meridian.lab`` (the network lab) and ``meridian.bench`` (benchmarks). Imports
flow one way: cli → bench → api → service → workers; the lab stands alone.
"""

__version__ = "0.1.0"
