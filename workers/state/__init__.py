"""Training state that outlives a process: in-memory shards of each step and durable checkpoints."""
