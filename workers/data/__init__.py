"""Training data and the sample order, a pure function of (seed, step, global batch)."""
