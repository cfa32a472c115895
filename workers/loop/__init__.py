"""The training loop every rank runs: a step, its records and its measurements."""
