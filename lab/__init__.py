"""``meridian lab`` (:mod:`meridian.cli.lab` is its CLI): a multi-datacenter Ray cluster on one machine whose inter-DC traffic is real TCP over a
link with real delay and rate, so nothing the application reports can flatter it."""
