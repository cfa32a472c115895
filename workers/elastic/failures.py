"""Which failures end an epoch so that a rank joins the next one, and which end the job: decided by the error's
type, never by its message.

A peer that went away is known by type where torch or Meridian says so: :class:`~torch.distributed.DistError`
(its network, store and backend errors) and :class:`~meridian.workers.elastic.rendezvous.StoreNotHosted`. Any
other type (``ValueError``, ``OSError``, Meridian's own errors, which subclass what they are) is this job's own
error, and ends it. Gloo reports a dead peer as a plain ``RuntimeError`` (exactly that type), as it reports a
misuse of its own, so such an *unknown* error is given one re-formation: the rank rejoins. If the next epoch ends
with an unknown error again at the same step and with the same membership, nothing changed that could explain it
(no peer left, none joined): it is this job's own error too, and the job fails with its traceback instead of
re-forming until a restart limit. Pure: tested without a process group.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch.distributed as dist

from meridian.workers.elastic.rendezvous import StoreNotHosted

PEER_FAILURES: tuple[type[BaseException], ...] = (StoreNotHosted, *((dist.DistError,) if hasattr(dist, "DistError") else ()))
"""The error types that name a lost peer or an epoch that cannot form around this rank."""


class FailureKind(str, enum.Enum):
    PEER = "peer"  # a peer went away: rejoin
    UNKNOWN = "unknown"  # maybe a peer (gloo's RuntimeError), maybe this job's own: rejoin once
    OWN = "own"  # this job's own error (by its type): fail the job with it
    REPEATED = "repeated"  # an unknown error again, with nothing changed: fail the job with it


def is_peer_failure(error: BaseException) -> bool:
    return isinstance(error, PEER_FAILURES)


class OwnFailure(RuntimeError):
    """An error that came back after a re-formation that changed nothing: the job's own, not a peer's."""


@dataclass
class FailureJudge:
    """Judges each failure of a rank's epochs, remembering the last unknown one (``(step, membership)``)."""

    last_unknown: tuple[int, tuple[object, ...]] | None = None
    _judged: tuple[int, type, FailureKind] | None = None
    """The error being handled (its id and type, never the error itself: its traceback holds the failed epoch's
    groups and engine, which must be collected) and how it was judged."""

    def judge(self, error: BaseException, *, step: int, membership: tuple[object, ...]) -> FailureKind:
        """The kind of ``error``, which ended an epoch of ``membership`` with this rank at ``step`` (its last
        completed step). The same error object is judged once (the loop and the epoch's caller both ask)."""
        if self._judged is not None and self._judged[:2] == (id(error), type(error)):
            return self._judged[2]
        if is_peer_failure(error):
            kind = FailureKind.PEER
        elif type(error) is not RuntimeError:
            kind = FailureKind.OWN
        elif self.last_unknown == (step, membership):
            kind = FailureKind.REPEATED
        else:
            kind = FailureKind.UNKNOWN
            self.last_unknown = (step, membership)
        self._judged = (id(error), type(error), kind)  # only the error being handled is asked about again
        return kind

    def handled(self) -> None:
        """The error judged last has been dealt with: a later one, even at the same address, is judged anew."""
        self._judged = None
