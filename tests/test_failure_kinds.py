"""A rank tells a lost peer from the job's own error by the error's type, never by its message; an error of
unknown cause (gloo's plain RuntimeError, which a dead peer and a misuse both raise) is given one re-formation,
and fails the job with its traceback if it comes back with nothing changed (issue 60)."""

from __future__ import annotations

import torch.distributed as dist

from meridian.service.runner.train_run import TRACEBACK_CHARS, failure_with_traceback
from meridian.workers.elastic.failures import FailureJudge, FailureKind, is_peer_failure
from meridian.workers.elastic.rendezvous import StoreNotHosted

FOUR = (4, ("dc-a", "dc-a", "dc-b", "dc-b"))
THREE = (3, ("dc-a", "dc-a", "dc-b"))


def test_the_kind_is_the_type_not_the_message():
    assert is_peer_failure(dist.DistNetworkError("anything")) and is_peer_failure(StoreNotHosted("x"))
    assert not is_peer_failure(RuntimeError("Connection closed by peer (gloo)"))  # the words decide nothing
    judge = FailureJudge()
    assert judge.judge(dist.DistBackendError("NCCL"), step=3, membership=FOUR) is FailureKind.PEER
    assert judge.judge(ValueError("gloo timed out"), step=3, membership=FOUR) is FailureKind.OWN
    assert judge.judge(OSError(28, "No space left on device"), step=3, membership=FOUR) is FailureKind.OWN

    class Mine(RuntimeError):
        pass

    assert judge.judge(Mine("a subclass says what it is"), step=3, membership=FOUR) is FailureKind.OWN


def test_an_unknown_error_gets_one_re_formation_and_fails_the_job_if_nothing_changed():
    judge = FailureJudge()
    first = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    assert judge.judge(first, step=7, membership=FOUR) is FailureKind.UNKNOWN
    assert judge.judge(first, step=7, membership=FOUR) is FailureKind.UNKNOWN  # the same error, asked twice
    judge.handled()
    # A misuse of gloo in this job's own step: the next epoch (the same four ranks) fails at the same step again.
    assert judge.judge(RuntimeError("gloo: mismatched sizes"), step=7, membership=FOUR) is FailureKind.REPEATED


def test_a_real_loss_changes_the_membership_or_the_step_and_is_rejoined_again():
    judge = FailureJudge()
    assert judge.judge(RuntimeError("peer closed"), step=7, membership=FOUR) is FailureKind.UNKNOWN
    # A second peer dies in the re-formed epoch of three: a changed membership, so it is rejoined.
    assert judge.judge(RuntimeError("peer closed"), step=7, membership=THREE) is FailureKind.UNKNOWN
    # Later, after progress, another loss: a changed step.
    assert judge.judge(RuntimeError("peer closed"), step=20, membership=THREE) is FailureKind.UNKNOWN


def test_the_job_fails_with_the_workers_traceback():
    trace = ("RuntimeError: training failed: OwnFailure: RuntimeError: gloo: mismatched sizes\n"
             "Traceback (most recent call last):\n  File \"train.py\", line 12, in step\n    dist.all_reduce(t)\n"
             "RuntimeError: gloo: mismatched sizes")
    text = failure_with_traceback(trace)
    assert text.startswith("RuntimeError: gloo: mismatched sizes") and 'File "train.py", line 12' in text
    assert failure_with_traceback("OSError: disk full") == "OSError: disk full"
    long = failure_with_traceback("ValueError: x\n" + "  frame\n" * 2000)
    assert len(long) < TRACEBACK_CHARS + 200 and "…" in long
