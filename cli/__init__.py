"""``meridian``, the command line: the control plane's verbs (``serve``, ``demo``), the REST API's (``submit``,
``watch``, ``plan``, ...), data preparation, the network lab and the benchmarks. :mod:`meridian.cli.main` holds the
parser; each group of verbs its own module."""
