"""A generic typed-JSON validator: dataclasses as schemas, checked value by value.

:func:`from_json` builds a schema dataclass from a JSON value and checks each field against its annotation
(``int`` is an integer, not a bool or a string; ``float`` is a finite number; ``Literal[...]`` is one of the
listed values; ``X | None``, ``list[X]``, ``tuple[X, ...]``, ``dict[str, X]`` and nested dataclasses) and
against the inclusive ``lo``/``hi`` range declared with :func:`_field`. Unknown keys are refused. Every
failure is a :class:`~dyncompile.errors.PlanError` naming the field (``steps[0].segments[1].threshold``),
what it got and what it needs. Nothing here knows what a plan is.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, Union

from dyncompile.errors import PlanError

_NO = object()  # a converter's "this value is not of my type"


def _short(v: Any) -> str:
    """``repr(v)``, cut to 60 characters for error messages."""
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _field(default: Any = dataclasses.MISSING, *, lo: float | None = None, hi: float | None = None,
           factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with an inclusive numeric range (``lo``/``hi``) checked by :func:`from_json`."""
    meta = {"lo": lo, "hi": hi}
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _describe(tp: Any) -> str:
    """What a value of annotation ``tp`` must be, in words (``"a list of an integer"``)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin in (list, tuple):
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    if origin is dict:
        return f"an object of {_describe(typing.get_args(tp)[1])}"
    if dataclasses.is_dataclass(tp):
        return "an object"
    return {int: "an integer", float: "a finite number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def _check_json(v: Any, where: str) -> Any:
    """Free-form JSON (informational records): only finite numbers and string keys."""
    if isinstance(v, float) and not math.isfinite(v):
        raise PlanError(f"{where}: {v} is not a finite number")
    if isinstance(v, dict):
        for k, x in v.items():
            _check_json(x, f"{where}.{k}")
    elif isinstance(v, list):
        for i, x in enumerate(v):
            _check_json(x, f"{where}[{i}]")
    return v


def _range(v: float, where: str, lo: float | None, hi: float | None) -> None:
    """Refuse ``v`` outside the inclusive range ``[lo, hi]`` (either bound may be None)."""
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        bounds = f">= {lo}" if hi is None else f"<= {hi}" if lo is None else f"in [{lo}, {hi}]"
        raise PlanError(f"{where} must be {bounds}, got {v}")


# One converter per annotation: ``(tp, v, where, lo, hi) -> value``, or ``_NO`` when ``v`` is not of that type.


def _as_bool(tp: Any, v: Any, where: str, lo: float | None, hi: float | None) -> Any:
    return v if isinstance(v, bool) else _NO


def _as_int(tp: Any, v: Any, where: str, lo: float | None, hi: float | None) -> Any:
    if not isinstance(v, int) or isinstance(v, bool):
        return _NO
    _range(v, where, lo, hi)
    return v


def _as_float(tp: Any, v: Any, where: str, lo: float | None, hi: float | None) -> Any:
    if not isinstance(v, int | float) or isinstance(v, bool):
        return _NO
    if not math.isfinite(v):
        raise PlanError(f"{where} must be a finite number, got {v}")
    _range(v, where, lo, hi)
    return float(v)


def _as_str(tp: Any, v: Any, where: str, lo: float | None, hi: float | None) -> Any:
    return v if isinstance(v, str) else _NO


def _as_list(tp: Any, v: Any, where: str, lo: float | None, hi: float | None) -> Any:
    if not isinstance(v, list):
        return _NO
    item = typing.get_args(tp)[0]
    out = [_convert(item, x, f"{where}[{i}]", lo, hi) for i, x in enumerate(v)]
    return tuple(out) if typing.get_origin(tp) is tuple else out


def _as_dict(tp: Any, v: Any, where: str, lo: float | None, hi: float | None) -> Any:
    if not isinstance(v, dict):
        return _NO
    item = typing.get_args(tp)[1]
    return {str(k): _convert(item, x, f"{where}.{k}", lo, hi) for k, x in v.items()}


_Converter = Callable[[Any, Any, str, "float | None", "float | None"], Any]
_SCALARS: dict[Any, _Converter] = {bool: _as_bool, int: _as_int, float: _as_float, str: _as_str}
_CONTAINERS: dict[Any, _Converter] = {list: _as_list, tuple: _as_list, dict: _as_dict}


def _convert_union(tp: Any, v: Any, where: str, lo: float | None, hi: float | None) -> Any:
    """``X | Y | None``: None when allowed, else the first option that accepts ``v``."""
    args = typing.get_args(tp)
    if v is None and type(None) in args:
        return None
    options = [a for a in args if a is not type(None)]
    if len(options) == 1:  # X | None: X's own, more specific message
        return _convert(options[0], v, where, lo, hi)
    for a in options:
        try:
            return _convert(a, v, where, lo, hi)
        except PlanError:
            pass
    raise PlanError(f"{where} must be {_describe(tp)}, got {_short(v)}")


def _convert(tp: Any, v: Any, where: str, lo: float | None = None, hi: float | None = None) -> Any:
    """Check JSON value ``v`` against annotation ``tp`` (and range ``lo``/``hi``); the converted value.

    Raises:
        PlanError: ``v`` is not of type ``tp`` or out of range; the message names ``where``.
    """
    origin = typing.get_origin(tp)
    if tp is Any:
        return _check_json(v, where)
    if origin in (Union, types.UnionType):
        return _convert_union(tp, v, where, lo, hi)
    if origin is Literal:
        if any(v == c and type(v) is type(c) for c in typing.get_args(tp)):
            return v
        raise PlanError(f"{where} must be {_describe(tp)}, got {_short(v)}")
    if dataclasses.is_dataclass(tp):
        return from_json(tp, v, where)
    convert = _SCALARS.get(tp) or _CONTAINERS.get(origin)
    if convert is None:  # pragma: no cover - a schema annotation this validator does not know
        raise TypeError(f"plan schema: unsupported annotation {tp!r} at {where}")
    out = convert(tp, v, where, lo, hi)
    if out is _NO:
        raise PlanError(f"{where} must be {_describe(tp)}, got {_short(v)}")
    return out


_HINTS: dict[type, dict[str, Any]] = {}


def from_json(cls: type, d: Any, where: str) -> Any:
    """Build the schema dataclass ``cls`` from JSON value ``d``, checking every field (see the module docstring).

    Unknown keys are an error unless ``cls`` sets ``_extra = True`` (informational records); a missing
    field without a default is an error; ``cls._check(self, where)`` runs cross-field checks.

    Args:
        cls: the schema dataclass.
        d: the JSON value (must be an object).
        where: the field path for error messages (``steps[0] (generate)``).

    Returns:
        The ``cls`` instance.

    Raises:
        PlanError: a value of the wrong type or out of range, an unknown or missing field, or a failed
            cross-field check.
    """
    if not isinstance(d, dict):
        raise PlanError(f"{where} must be an object, got {_short(d)}")
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    extra = [k for k in d if k not in fields]
    if extra and not getattr(cls, "_extra", False):
        raise PlanError(f"{where}: unknown field {extra[0]!r}; valid fields: {', '.join(fields)}")
    kwargs = {}
    for name, f in fields.items():
        if name not in d:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise PlanError(f"{where}: missing required field {name!r}")
            continue
        kwargs[name] = _convert(hints[name], d[name], f"{where}.{name}", f.metadata.get("lo"), f.metadata.get("hi"))
    obj = cls(**kwargs)
    check = getattr(obj, "_check", None)
    if check is not None:
        check(where)
    return obj
