"""A job's one liveness path: :mod:`.judge` decides about every rank (alive, dead, stuck, slow, with a reason)
from Ray's node state, its agent's liveness port (:mod:`.probes`) and its heartbeats; :mod:`.watch` keeps each
verdict from being acted on twice. The coordinator gathers the observations and carries out what the controller
decides about the verdicts (:func:`~meridian.service.runner.controller.decide.liveness_actions`)."""
