"""``meridian plan SPEC``: the plan a job spec gets, from the live service, or offline on a described cluster.

``--cluster CLUSTER.yaml`` plans without a service, with the planner the service runs, on the datacenters, nodes
and links the file describes (:mod:`meridian.service.planning.described`); the spec's model may then be any
shape the planner knows: a preset, the usual model fields, or ``"hf_config"`` (a Hugging Face ``config.json``
object or a path to one). ``training.micro_batch`` may be left out (or ``"auto"``) for the planner to choose.
Every bad field is an error naming it (exit 2; ``--json`` prints ``{"error": PROBLEM}``).
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meridian.api.client import Client
from meridian.cli import render
from meridian.cli.errors import CliError, local_problem, report

HF_CONFIG_MAX_BYTES = 1 << 20
"""A Hugging Face ``config.json`` is a few KB; a bigger file is not one."""
OFFLINE_SECTIONS = ("name", "model", "data", "training", "topology", "parallelism", "sync", "wan", "checkpoint",
                    "validation", "priority")


SpecLoader = Callable[[str], dict[str, Any]]
Emitter = Callable[[argparse.Namespace, Any, str], None]


def add_plan_parser(verb: Callable[..., argparse.ArgumentParser], *, load_spec: SpecLoader, emit: Emitter) -> None:
    """Register ``plan`` with ``verb`` (:func:`meridian.cli.main.build_parser`'s helper); ``load_spec`` reads a JSON
    or YAML file, ``emit`` prints a result as every verb does (both :mod:`meridian.cli.main`'s)."""
    s = verb("plan", "the plan a job spec would get: from the live service, or offline on a described cluster")
    s.add_argument("file", help="the job spec (JSON or YAML)")
    s.add_argument("--cluster", metavar="CLUSTER.yaml",
                   help="plan offline on the cluster this file describes (datacenters, nodes, links), no service")
    s.add_argument("--compare-one-dc", action="store_true",
                   help="with --cluster: also plan the same GPUs in one datacenter and give efficiency_vs_one_dc")
    s.add_argument("--explain", action="store_true", help="print the planner's whole reasoning after the summary")
    s.set_defaults(run=functools.partial(cmd_plan, load_spec=load_spec, emit=emit))


def cmd_plan(args: argparse.Namespace, client: Client, *, load_spec: SpecLoader, emit: Emitter) -> int:
    spec = load_spec(args.file)
    if not args.cluster:
        if args.compare_one_dc:
            raise CliError("invalid-input", "Invalid input", "--compare-one-dc needs --cluster", exit_code=2)
        plan = client.plan(spec)
        emit(args, plan, render.plan_view(plan, explain=args.explain))
        return 0
    try:
        result = _offline(spec, args.file, args.cluster, load_spec)
    except _Bad as e:
        return report(args.json, local_problem(e.kind, e.title, str(e), **({"field": e.field} if e.field else {})), 2)
    except Exception as e:  # noqa: BLE001 - re-raised unless it is the planner's refusal
        from meridian.service.errors import Unschedulable

        if not isinstance(e, Unschedulable):
            raise
        return report(args.json, local_problem("unschedulable", "No layout fits", str(e)), 1)
    data = result.to_dict(compare_one_dc=args.compare_one_dc)
    emit(args, data, render.offline_plan_view(data, result.summary(), explain=args.explain))
    return 0


class _Bad(Exception):
    """A spec or cluster file that cannot be planned: ``field`` names the bad value where one does."""

    def __init__(self, kind: str, title: str, detail: str, field: str = "") -> None:
        super().__init__(detail)
        self.kind, self.title, self.field = kind, title, field


def _offline(spec: dict[str, Any], spec_path: str, cluster_path: str, load_spec: SpecLoader):  # -> OfflinePlan
    from meridian.service.planning.described import cluster_from_dict
    from meridian.service.planning.offline import plan_described

    cluster_data = _read_cluster(cluster_path, load_spec)
    try:
        cluster = cluster_from_dict(cluster_data)
    except ValueError as e:
        raise _Bad("invalid-cluster-file", "Invalid cluster file", f"{cluster_path}: {e}",
                   getattr(e, "field", "")) from None
    request = offline_request(spec, base=Path(spec_path).parent)
    try:
        return plan_described(request, cluster)
    except ValueError as e:  # a cluster the calibration does not know (gpu.name), a layout the request rules out
        raise _Bad("invalid-input", "Invalid input", str(e)) from None


def _read_cluster(path: str, load_spec: SpecLoader) -> Any:
    try:
        return load_spec(path)
    except CliError as e:
        raise _Bad("invalid-cluster-file", "Invalid cluster file", str(e).replace("job spec", "cluster file")) from None


def offline_request(spec: dict[str, Any], *, base: Path = Path(".")):  # -> PlanRequest
    """The planner's request for an offline spec: its model's shape and the sections the planner reads, each
    validated with the API's own schema (a bad field is named as the API names it)."""
    from meridian.api.schemas import CheckpointSpec, ParallelismSpec, SyncSpec, TopologySpec, TrainingSpec
    from meridian.service.planning.request import PlanRequest
    from meridian.workers.contracts.config import TrainConfig
    from meridian.workers.contracts.fields import bounds_of

    unknown = sorted(set(spec) - set(OFFLINE_SECTIONS))
    if unknown:
        raise _Bad("invalid-spec", "Invalid job spec", f"{unknown[0]} is not a section of a job spec; the sections "
                   f"are {', '.join(OFFLINE_SECTIONS)}", unknown[0])
    t = _validated(_offline_training(TrainingSpec), _section(spec, "training", required=True), "training")
    micro = t.micro_batch
    if micro != "auto":
        try:
            bounds_of(TrainConfig, "micro_batch").check("training.micro_batch", micro)
        except ValueError as e:
            raise _Bad("invalid-spec", "Invalid job spec", str(e), "training.micro_batch") from None
    topology = _validated(TopologySpec, _section(spec, "topology"), "topology")
    if topology.links:
        raise _Bad("invalid-spec", "Invalid job spec", "topology.links: with --cluster the links are the cluster "
                   "file's (links:); leave topology.links out of the spec", "topology.links")
    if spec.get("wan") is not None:
        raise _Bad("invalid-spec", "Invalid job spec", "wan: with --cluster the inter-DC link is the cluster file's; "
                   "an emulated WAN has no place in an offline plan", "wan")
    parallelism = _validated(ParallelismSpec, _section(spec, "parallelism"), "parallelism")
    sync = _validated(SyncSpec, _section(spec, "sync"), "sync")
    checkpoint = _validated(CheckpointSpec, _section(spec, "checkpoint"), "checkpoint")
    try:
        return PlanRequest(shape=model_shape(_section(spec, "model"), base=base), global_batch=t.global_batch,
                           micro_batch=None if micro == "auto" else micro, steps=t.steps, precision=t.precision,
                           topology=topology.to_request(), parallelism=parallelism.to_request(), sync=sync.to_config(),
                           warmup_steps=t.warmup_steps, checkpoint_every=checkpoint.interval_steps)
    except ValueError as e:
        raise _Bad("invalid-spec", "Invalid job spec", str(e), str(e).split(" ", 1)[0]) from None


def _offline_training(base: Any) -> Any:
    """The API's training section with ``micro_batch`` optional: a whole number, or ``auto`` (the default) for
    the planner to choose."""
    from typing import Literal

    from pydantic import create_model

    return create_model("OfflineTrainingSpec", __base__=base, micro_batch=(int | Literal["auto"], "auto"))


def model_shape(model: dict[str, Any], *, base: Path = Path(".")):  # -> ModelShape
    """The shape of the spec's model: ``hf_config`` (an object, or a path relative to the spec) with an optional
    ``seq_len``, or what the API's model fields build (a preset, sizes, ``init_from``)."""
    from meridian.api.schemas import ModelSpec
    from meridian.workers.contracts.model_shape import ModelShape

    if "hf_config" not in model:
        cfg = _validated(ModelSpec, model, "model")
        try:
            return ModelShape.of(cfg.to_config())
        except ValueError as e:
            raise _Bad("invalid-spec", "Invalid job spec", str(e), "model") from None
    extra = sorted(set(model) - {"hf_config", "seq_len"})
    if extra:
        raise _Bad("invalid-spec", "Invalid job spec", f"model.{extra[0]}: with model.hf_config the shape is the "
                   "config's; only model.seq_len may be given with it", f"model.{extra[0]}")
    hf = model["hf_config"]
    if isinstance(hf, str):
        hf = _read_hf_config(base / hf)
    seq_len = model.get("seq_len")
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1):
        raise _Bad("invalid-spec", "Invalid job spec", f"model.seq_len must be a whole number >= 1, got {seq_len!r}",
                   "model.seq_len")
    try:
        return ModelShape.from_hf_config(hf, seq_len=seq_len)
    except ValueError as e:
        raise _Bad("invalid-spec", "Invalid job spec", str(e), str(e).split(" ", 1)[0]) from None


def _read_hf_config(path: Path) -> Any:
    try:
        raw = path.read_bytes()[: HF_CONFIG_MAX_BYTES + 1]
    except OSError as e:
        raise _Bad("invalid-spec", "Invalid job spec", f"model.hf_config: cannot read {path} ({e.strerror})",
                   "model.hf_config") from None
    if len(raw) > HF_CONFIG_MAX_BYTES:
        raise _Bad("invalid-spec", "Invalid job spec", f"model.hf_config: {path} is over {HF_CONFIG_MAX_BYTES} "
                   "bytes, too big for a config.json", "model.hf_config")
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise _Bad("invalid-spec", "Invalid job spec", f"model.hf_config: {path} is not JSON ({e})",
                   "model.hf_config") from None


def _section(spec: dict[str, Any], name: str, *, required: bool = False) -> dict[str, Any]:
    value = spec.get(name)
    if value is None and not required:
        return {}
    if not isinstance(value, dict):
        raise _Bad("invalid-spec", "Invalid job spec", f"{name} must be an object, got {type(value).__name__}", name)
    return value


def _validated(schema: Any, data: dict[str, Any], section: str) -> Any:
    """``data`` as the API's ``schema`` reads it; a :class:`_Bad` naming the first bad field otherwise."""
    from pydantic import ValidationError

    try:
        return schema.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join([section, *(str(p) for p in first["loc"])])
        raise _Bad("invalid-spec", "Invalid job spec", f"{where}: {first['msg']}", where) from None
    except ValueError as e:
        raise _Bad("invalid-spec", "Invalid job spec", f"{section}: {e}", section) from None
