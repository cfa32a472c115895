"""How the frozen configs declare their knobs once, and the one generic way they become JSON and back.

A bounded knob is a dataclass field whose bounds live in its metadata (:func:`knob`): the dataclass checks
them in ``__post_init__`` (:func:`check_bounds`, a ``ValueError`` naming the field), and the HTTP edge reads
the same default and bounds into its schema (``meridian.api.schemas``), so no number is written twice.

:func:`to_plain` / :func:`from_plain` turn any of these dataclasses into JSON-ready values and back, driven
by the type hints (nested dataclasses, enums, tuples, optionals), not field by field.
"""

from __future__ import annotations

import enum
import types
import typing
from dataclasses import MISSING, Field, dataclass, field, fields, is_dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Bounds:
    """Inclusive (``ge``, ``le``) and exclusive (``gt``, ``lt``) limits of a number; ``None``: no limit."""

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None

    def check(self, name: str, value: Any) -> None:
        """Raise ``ValueError`` naming ``name`` when ``value`` is out of bounds (``None`` is not checked)."""
        if value is None or isinstance(value, bool):
            return
        for op, limit, ok in (
            (">", self.gt, lambda v, x: v > x), (">=", self.ge, lambda v, x: v >= x),
            ("<", self.lt, lambda v, x: v < x), ("<=", self.le, lambda v, x: v <= x),
        ):
            if limit is not None and not ok(value, limit):
                raise ValueError(f"{name} must be {op} {limit:g}, got {value!r}")

    def as_kwargs(self) -> dict[str, float]:
        """The limits as keyword arguments (``gt=...``), as pydantic's ``Field`` takes them."""
        return {k: v for k, v in (("gt", self.gt), ("ge", self.ge), ("lt", self.lt), ("le", self.le)) if v is not None}


def knob(default: Any = MISSING, *, gt: float | None = None, ge: float | None = None, lt: float | None = None,
         le: float | None = None, name: str = "") -> Any:
    """A dataclass field with bounds. ``name``: the field as users write it, when not ``<prefix><field>``
    (e.g. ``checkpoint.interval_steps``)."""
    return field(default=default, metadata={"bounds": Bounds(gt=gt, ge=ge, lt=lt, le=le), "name": name})


def like(cls: type, name: str) -> Any:
    """A field declared as ``cls``'s field ``name`` (same default and bounds): one declaration, two records."""
    f = field_of(cls, name)
    return field(default=f.default, default_factory=f.default_factory, metadata=f.metadata)  # type: ignore[call-overload]


def field_of(cls: type, name: str) -> Field[Any]:
    for f in fields(cls):
        if f.name == name:
            return f
    raise KeyError(f"{cls.__name__} has no field {name!r}")


def bounds_of(cls: type, name: str) -> Bounds:
    return field_of(cls, name).metadata.get("bounds", Bounds())


def default_of(cls: type, name: str) -> Any:
    """The default of ``cls``'s field ``name``; ``MISSING`` when the field is required."""
    f = field_of(cls, name)
    if f.default_factory is not MISSING:
        return f.default_factory()
    return f.default


def check_bounds(obj: Any, prefix: str) -> None:
    """Check every bounded field of ``obj``; an error names it as ``<prefix><field>`` (or its own name)."""
    for f in fields(obj):
        bounds = f.metadata.get("bounds")
        if bounds is not None:
            bounds.check(f.metadata.get("name") or f"{prefix}{f.name}", getattr(obj, f.name))


# -- JSON-ready values and back ----------------------------------------------------------------------------
def to_plain(obj: Any) -> Any:
    """Dataclasses → dicts, enums → values, tuples → lists, recursively."""
    if is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, tuple | list):
        return [to_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj


def from_plain(cls: type[T], data: dict[str, Any]) -> T:
    """Rebuild dataclass ``cls`` from :func:`to_plain`'s output; absent fields take their defaults, an
    unknown field is a ``TypeError``, except one the class lists in ``RETIRED_FIELDS`` (a field earlier versions
    stored), which is dropped."""
    retired = getattr(cls, "RETIRED_FIELDS", frozenset())
    data = {name: value for name, value in data.items() if name not in retired}
    hints = typing.get_type_hints(cls)
    kwargs = {name: _convert(hints[name], value) for name, value in data.items() if name in hints}
    unknown = set(data) - set(hints)
    if unknown:
        raise TypeError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    return cls(**kwargs)


def _convert(tp: Any, value: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is not type(None) and _accepts(option, value):
                return _convert(option, value)
        raise TypeError(f"{value!r} is none of {tp}")
    if origin is tuple:
        args = typing.get_args(tp)
        items = value.items() if isinstance(value, dict) else value
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], x) for x in items)
        return tuple(_convert(a, x) for a, x in zip(args, items, strict=True))
    if isinstance(tp, type) and is_dataclass(tp):
        return value if isinstance(value, tp) else from_plain(tp, value)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp(value)
    return value


def _accepts(tp: Any, value: Any) -> bool:
    """Could ``value`` (JSON-ready) be a ``tp``? Picks the branch of a union."""
    origin = typing.get_origin(tp) or tp
    if origin is tuple:
        return isinstance(value, list | tuple | dict)
    if isinstance(origin, type) and is_dataclass(origin):
        return isinstance(value, dict | origin)
    if isinstance(origin, type) and issubclass(origin, enum.Enum):
        return isinstance(value, origin) or any(value == m.value for m in origin)
    if origin is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if origin is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, origin) if isinstance(origin, type) else True
