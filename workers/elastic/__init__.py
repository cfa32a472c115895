"""Surviving a lost node: the agent process, the worker side of the rendezvous, and re-forming epochs."""
