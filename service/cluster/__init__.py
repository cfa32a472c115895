"""The Ray cluster as the control plane sees it: connecting, topology, link probes, worker logs."""
