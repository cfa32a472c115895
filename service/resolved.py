"""What a job runs, decided once at submit: its :class:`~meridian.service.planning.plan.Plan` and the frozen
:class:`~meridian.workers.contracts.config.TrainConfig` every rank trains with, as one value.

:func:`resolve` is the only place a request becomes that pair. The supervisor calls it when a job is submitted,
so anything the training config refuses is a 422 before the job is stored; the store keeps the result with the
job, and admission and the runner read it back as it was: a job is never planned or validated again. A job that
resumes from another's checkpoint is checked against it here too (:func:`resuming`). Plain data: no Ray, no
store, no clock.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

from meridian.service.errors import InvalidJob
from meridian.service.jobs import JobRequest
from meridian.service.planning.plan import Plan
from meridian.service.planning.train_config import build_train_config
from meridian.service.resume_source import FoundCheckpoint
from meridian.service.tracking import with_job_dir
from meridian.workers.contracts.config import ResetPart, ResumeFrom, TrainConfig
from meridian.workers.contracts.fields import from_plain, to_plain
from meridian.workers.contracts.fingerprint import fingerprint, resume_mismatches
from meridian.workers.state import storage


@dataclass(frozen=True, kw_only=True)
class ResolvedJob:
    """A job's plan and training config, fixed at submit."""

    plan: Plan
    config: TrainConfig

    def to_json(self) -> str:
        """The store's form (the JSON of both dataclasses, read back by :meth:`from_json`)."""
        return json.dumps({"plan": to_plain(self.plan), "config": to_plain(self.config)})

    @classmethod
    def from_json(cls, text: str) -> ResolvedJob:
        data = json.loads(text)
        return cls(plan=from_plain(Plan, data["plan"]), config=from_plain(TrainConfig, data["config"]))


def checkpoint_dir(checkpoint_root: str, job_id: str, request: JobRequest) -> str:
    """Where the job's durable checkpoints go; empty when it keeps none (no interval and no final weights)."""
    keep = request.checkpoint_every or request.keep_final
    return os.path.join(checkpoint_root, job_id) if keep else ""


def resolve(job_id: str, request: JobRequest, plan: Plan, *, checkpoint_root: str,
            resume: FoundCheckpoint | None = None) -> ResolvedJob:
    """The plan and the training config built from it, or :class:`InvalidJob` naming the option that the plan
    makes invalid (e.g. ``sync.compression`` where the planner chose flat sync), so the submit is a 422.
    ``resume``: the checkpoint ``request.resume_from`` names (:func:`~meridian.service.resume_source.find_checkpoint`),
    which the config then starts from (:func:`resuming`)."""
    try:
        config = build_train_config(job_id, request, plan, checkpoint_dir(checkpoint_root, job_id, request))
        # the job's folder in the storage (profiles, tracking logs) and its trackers with the plan as hyperparameters
        config = with_job_dir(config, storage.join(checkpoint_root, job_id), plan.to_dict(), tracking=request.tracking)
    except ValueError as e:
        raise InvalidJob(f"the plan chosen for this job ({plan.sync_strategy.value} sync, {plan.num_workers} "
                         f"worker(s), tp={plan.tp}, pp={plan.pp}) and its options do not make a valid training "
                         f"config: {e}; change the option named and submit again") from None
    if resume is not None:
        assert request.resume_from is not None
        config = resuming(config, resume, request.resume_from.reset)
    return ResolvedJob(plan=plan, config=config)


def resuming(config: TrainConfig, found: FoundCheckpoint, reset: tuple[ResetPart, ...]) -> TrainConfig:
    """``config`` starting from checkpoint ``found``, or :class:`InvalidJob` naming what differs between the two
    (the model always; the tokenizer and the data unless ``data`` is reset) and what to do."""
    problems = resume_mismatches(found.fingerprint, fingerprint(config), reset)
    if problems:
        model_differs = found.fingerprint.get("model") != fingerprint(config).get("model")
        fix = ("give this job the checkpoint's model" if model_differs else
               'give this job the checkpoint\'s data, tokenizer, seed and global batch, or start a new phase on '
               'other data with resume_from.reset: ["data"]')
        raise InvalidJob(f"resume_from: this job cannot continue {found.source}'s checkpoint of step {found.step}: "
                         f"{'; '.join(problems)}; {fix}")
    try:
        return replace(config, resume=ResumeFrom(checkpoint=found.folder, step=found.step, reset=reset,
                                                 fingerprint=json.dumps(found.fingerprint, sort_keys=True),
                                                 source=found.source))  # fmt: skip
    except ValueError as e:
        raise InvalidJob(f"resume_from: {e}") from None
