"""Which of your own modules a job may build: factories the operator installed and allowed, never what a job
names.

A job's ``model.factory`` is either the name of an entry point of the ``meridian.models`` group (installed
packages declare them; reading them imports nothing) or ``module:function`` with ``module`` equal to or under one
of :attr:`ModelAccess.modules` (``meridian serve --model-module PKG``, repeatable). Anything else is a 422 listing
what is allowed, decided on the name alone: nothing is imported on a job's behalf unless it is on that list. An
allowed factory is then described (:mod:`meridian.workers.model.describe`) in a child process, with a timeout:
the service itself never imports torch or the operator's code; the description (blocks, parameters, embedding)
is what admission and the planner read, and a factory that fails or returns no ``nn.Module`` is a 422 before any
worker starts.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from meridian.service.errors import InvalidJob
from meridian.workers.contracts.model_config import ModelConfig, ModelFamily

ENTRY_POINT_GROUP = "meridian.models"
"""The entry-point group whose names a job may give as ``model.factory``."""

DESCRIBE_TIMEOUT_S = 120.0
"""How long describing a factory's module may take: importing torch and the module, building it on the meta device
(a few seconds on a 2-core machine); longer means the factory does real work at build time."""

_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def _path_ok(path: str) -> bool:
    module, sep, attr = path.partition(":")
    return bool(sep) and bool(_DOTTED.match(module)) and bool(_DOTTED.match(attr))


@dataclass(frozen=True)
class ModelAccess:
    modules: tuple[str, ...] = ()
    """Packages (or modules) whose functions a job may name as ``module:function`` (``--model-module``)."""
    timeout_s: float = DESCRIBE_TIMEOUT_S

    def __post_init__(self) -> None:
        for module in self.modules:
            if not _DOTTED.match(module):
                raise ValueError(f"--model-module {module!r} is not a module name such as mymodels or org.models")

    def entry_points(self) -> dict[str, str]:
        """Installed factories: entry-point name → ``module:function`` (from package metadata, nothing imported)."""
        return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}

    def allowed(self) -> str:
        """What a job may name, as a person reads it."""
        eps = ", ".join(sorted(self.entry_points())) or "none installed"
        modules = ", ".join(self.modules) or "no module (none allowed with meridian serve --model-module PKG)"
        return f"entry points of the {ENTRY_POINT_GROUP} group ({eps}), or module:function under {modules}"

    def resolve(self, name: str) -> str:
        """The ``module:function`` of an allowed ``model.factory`` name; :class:`InvalidJob` listing what is
        allowed otherwise (decided on the name: nothing is imported)."""
        eps = self.entry_points()
        if name in eps:
            value = eps[name].split("[", 1)[0].strip()  # an entry point may name extras after the object
            if not _path_ok(value):
                raise InvalidJob(f"model.factory {name!r}: its entry point names {eps[name]!r}, not module:function")
            return value
        module = name.partition(":")[0]
        if _path_ok(name) and any(module == m or module.startswith(m + ".") for m in self.modules):
            return name
        raise InvalidJob(f"model.factory {name!r} is not allowed on this service; name one of the {self.allowed()}")

    def describe(self, path: str, args: dict[str, Any], block: str, seq_len: int) -> dict[str, Any]:
        """:mod:`meridian.workers.model.describe`'s description of the module ``path(**args)`` builds, run in a
        child process; :class:`InvalidJob` saying what failed."""
        request = json.dumps({"factory": path, "args": args, "block": block, "seq_len": seq_len})
        try:
            done = subprocess.run([sys.executable, "-m", "meridian.workers.model.describe"], input=request,
                                  capture_output=True, text=True, timeout=self.timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise InvalidJob(f"model.factory {path}: building its module on the meta device took over "
                             f"{self.timeout_s:.0f} s; a factory should only construct the module") from None
        lines = done.stdout.strip().splitlines()
        try:
            answer = json.loads(lines[-1]) if lines else {}
        except ValueError:
            answer = {}
        if "error" in answer or done.returncode or not answer:
            why = answer.get("error") or (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise InvalidJob(f"model.factory {path}: building its module failed: {why}")
        return answer

    def admit_factory(self, *, factory: str, args: dict[str, Any], block: str, seq_len: int,
                      vocab_size: int | None) -> ModelConfig:
        """The :class:`ModelConfig` (family ``factory``) of an allowed factory's module, from its description."""
        path = self.resolve(factory)
        found = self.describe(path, args, block, seq_len)
        if vocab_size is not None and vocab_size != found["vocab_size"]:
            raise InvalidJob(f"model.vocab_size is {vocab_size} but model.factory {path}'s token embedding has "
                             f"{found['vocab_size']} rows; drop model.vocab_size or pass the factory that size")
        try:
            return ModelConfig(
                family=ModelFamily.FACTORY, factory=path, factory_args=json.dumps(args, sort_keys=True,
                                                                                  separators=(",", ":")),
                block=found["block"], n_layers=found["n_layers"], d_model=found["d_model"], n_heads=1,
                seq_len=seq_len, vocab_size=found["vocab_size"], tie_embeddings=found["tie_embeddings"],
                param_count=found["param_count"])
        except ValueError as e:
            raise InvalidJob(f"model.factory {path}: its module is not one Meridian can train: {e}") from None


__all__ = ["ENTRY_POINT_GROUP", "ModelAccess"]
