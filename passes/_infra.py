"""Pass registry and pipeline runner.

Passes are plain :mod:`onnx_ir.passes` passes; this module adds what onnx-ir leaves to its users:

* a **registry** of passes by name (``verify``, ``cleanup``, ``early-exit``, ...) so that the CLI can
  build a pipeline from ``--passes a,b,c`` (with ``name{key=value,...}`` options);
* a **pipeline runner** that owns the policies — checker after each pass (``check="each"``), per-pass
  timing (logged at INFO, returned in the result), IR dumps ``NNN_PassName.onnx.txt`` after each pass.

Passes themselves never check, time or dump (TVM ``PassContext`` instruments / MLIR verifier style).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import os
import re
import time
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import onnx_ir as ir

from dyncompile.errors import DyncompileError, ModelLoadError, PassConfigError
from dyncompile.io import external_data_dirs, working_directory

logger = logging.getLogger(__name__)

__all__ = [
    "CompileContext",
    "PassOption",
    "PassRecord",
    "PipelineResult",
    "NotFired",
    "not_fired",
    "warn_unmeasured_contrib_op",
    "PASS_REGISTRY",
    "register_pass",
    "parse_pass_spec",
    "build_passes",
    "build_pipeline",
    "is_pass_list",
    "must_precede",
    "split_spec",
    "run_pipeline",
    "known_passes",
    "check_model",
]


@dataclasses.dataclass
class CompileContext:
    """What a pass factory may read besides its own options: the compile request.

    Factories read it once to construct their pass; passes never keep a reference to it (no state
    between runs). ``tokenizer`` is the tokenizer.json of the compile (``--tokenizer``, else the one beside
    the model; None when there is none).
    """

    model_path: Path | None = None
    model_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    progress: bool = True
    tokenizer: Path | None = None

    def tokenizer_file(self) -> Path | None:
        """``tokenizer``, else the tokenizer.json beside the model (a context built without the compiler)."""
        return self.tokenizer or (self.model_path.parent / "tokenizer.json" if self.model_path else None)

    def require_tokenizer(self, who: str) -> Path:
        """:meth:`tokenizer_file`, or a :class:`~dyncompile.errors.PassConfigError` naming ``who`` needs it."""
        from dyncompile.errors import PassConfigError

        tok = self.tokenizer_file()
        if tok is None or not Path(tok).is_file():
            raise PassConfigError(f"{who} needs the model's tokenizer.json (looked at {tok}); pass --tokenizer")
        return Path(tok)


@dataclasses.dataclass(frozen=True)
class PassOption:
    """One option of a registered pass, from its factory's signature: name, declared type, default."""

    name: str
    type: Any
    default: Any
    choices: tuple[Any, ...] = ()

    def describe(self) -> str:
        kind = "|".join(map(str, self.choices)) if self.choices else _type_name(self.type)
        return f"{self.name}: {kind} = {self.default!r}"


@dataclasses.dataclass(frozen=True)
class PassSpec:
    name: str
    factory: Callable[..., ir.passes.PassBase]
    help: str
    requires: tuple[str, ...] = ()
    options: tuple[PassOption, ...] = ()
    after: tuple[str, ...] = ()
    before: tuple[str, ...] = ()

    def option(self, name: str) -> PassOption | None:
        return next((o for o in self.options if o.name == name), None)


PASS_REGISTRY: dict[str, PassSpec] = {}


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is typing.Literal:
        return "|".join(str(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "none"
    return getattr(tp, "__name__", str(tp))


_OPTION_TYPES = (bool, int, float, str, type(None))


def _check_option_type(tp: Any, where: str) -> None:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for a in typing.get_args(tp):
            _check_option_type(a, where)
    elif origin is typing.Literal:
        if not all(isinstance(a, str | int) for a in typing.get_args(tp)):
            raise TypeError(f"{where}: Literal options must list strings or integers")
    elif tp not in _OPTION_TYPES:
        raise TypeError(f"{where}: option type {tp!r} is not one of bool, int, float, str, Literal[...] (or a union)")


def _factory_options(name: str, factory: Callable, choices: dict[str, Sequence[Any]]) -> tuple[PassOption, ...]:
    """The options of pass ``name`` from ``factory(context, *, opt: type = default, ...)``."""
    sig = inspect.signature(factory)
    params = list(sig.parameters.values())
    if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        raise TypeError(f"pass {name!r}: the factory's first parameter must be the CompileContext")
    try:
        hints = typing.get_type_hints(factory)
    except Exception as e:  # noqa: BLE001 - an annotation that does not resolve
        raise TypeError(f"pass {name!r}: the factory's annotations do not resolve ({e})") from None
    out = []
    for p in params[1:]:
        if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            raise TypeError(
                f"pass {name!r}: the factory takes {'**' if p.kind is p.VAR_KEYWORD else '*'}{p.name}; a pass's "
                "options must be explicit keyword arguments with types and defaults"
            )
        if p.default is p.empty or p.name not in hints:
            raise TypeError(f"pass {name!r}: option {p.name!r} needs a type annotation and a default")
        _check_option_type(hints[p.name], f"pass {name!r} option {p.name!r}")
        out.append(PassOption(p.name, hints[p.name], p.default, tuple(choices.get(p.name, ()))))
    unknown = set(choices) - {o.name for o in out}
    if unknown:
        raise TypeError(f"pass {name!r}: choices given for options it does not have: {sorted(unknown)}")
    return tuple(out)


def register_pass(
    name: str,
    *,
    help: str,  # noqa: A002 - CLI wording
    requires: Sequence[str] = (),
    after: Sequence[str] = (),
    before: Sequence[str] = (),
    choices: dict[str, Sequence[Any]] | None = None,
):
    """Register ``factory(context, *, option: type = default, ...) -> PassBase`` under ``name``.

    The factory's keyword arguments *are* the pass's options: their annotations (bool, int, float, str,
    ``Literal[...]``, unions with None) and defaults are read here, so ``NAME{key=value}`` is checked and
    converted before the factory runs; a factory taking ``**kwargs`` is rejected. ``requires`` names
    context fields (e.g. ``calib``) the pass cannot run without. ``after`` / ``before`` name passes that,
    when in the same pipeline, must come before / after this one; :func:`build_passes` checks them before
    the model loads. ``choices`` maps an option to its allowed values (e.g. ``{"format": ("dynamic", ...)}``).
    """

    def deco(factory):
        if name in PASS_REGISTRY:
            raise ValueError(f"pass {name!r} registered twice")
        PASS_REGISTRY[name] = PassSpec(
            name, factory, help, tuple(requires), _factory_options(name, factory, dict(choices or {})), tuple(after),
            tuple(before),
        )
        return factory

    return deco


def known_passes() -> dict[str, str]:
    """Name -> one-line help of every registered pass."""
    _load_builtin_passes()
    return {n: s.help for n, s in sorted(PASS_REGISTRY.items())}


def _load_builtin_passes() -> None:
    # Importing the package registers every built-in pass.
    import dyncompile.passes  # noqa: F401


_SPEC_RE = re.compile(r"^\s*([a-z][a-z0-9_-]*)\s*(?:\{(.*)\})?\s*$")


def _parse_value(text: str) -> Any:
    text = text.strip()
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def _split_spec(spec: str | Sequence[str]) -> list[tuple[str, dict[str, str]]]:
    """``[(name, {key: raw text})]`` of a pipeline spec (values not yet converted)."""
    if isinstance(spec, str):
        parts, depth, cur = [], 0, ""
        for ch in spec:
            depth += ch == "{"
            depth -= ch == "}"
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
            else:
                cur += ch
        parts.append(cur)
    else:
        parts = list(spec)
    out = []
    for part in parts:
        if not isinstance(part, str):
            raise PassConfigError(f"pass spec entries must be strings like 'cleanup{{cse=false}}', got {part!r}")
        if not part.strip():
            continue
        m = _SPEC_RE.match(part)
        if not m:
            raise PassConfigError(
                f"cannot parse pass spec {part!r}: expected NAME or NAME{{key=value,...}} (e.g. 'cleanup' or "
                "'early-exit{budget=1.0}')"
            )
        opts: dict[str, str] = {}
        if m.group(2):
            for kv in m.group(2).split(","):
                if not kv.strip():
                    continue
                if "=" not in kv:
                    raise PassConfigError(f"pass option {kv!r} in {part!r} is not key=value")
                k, v = kv.split("=", 1)
                key = k.strip().replace("-", "_")
                if key in opts:
                    raise PassConfigError(f"pass option {key!r} given twice in {part!r}")
                opts[key] = v.strip()
        out.append((m.group(1), opts))
    if not out:
        raise PassConfigError("no passes given: use e.g. --passes verify,cleanup (see `dyncompile passes`)")
    return out


def parse_pass_spec(spec: str | Sequence[str]) -> list[tuple[str, dict[str, Any]]]:
    """Parse ``"verify,early-exit{budget=1.0,lowering=if},cleanup"`` into ``[(name, options), ...]``.

    Values are read loosely here (``true``/``false``, numbers, else text); :func:`build_passes` converts
    the raw text against each pass's declared option types instead.
    """
    return [(name, {k: _parse_value(v) for k, v in opts.items()}) for name, opts in _split_spec(spec)]


def _convert_option(pass_name: str, opt: PassOption, text: str) -> Any:
    """``text`` as a value of ``opt``'s declared type, or a :class:`PassConfigError` saying what it accepts."""
    tp = opt.type
    origin = typing.get_origin(tp)
    choices = typing.get_args(tp) if origin in (typing.Union, types.UnionType) else (tp,)
    choices = tuple(sorted(choices, key=lambda c: c is str))  # text only when nothing more specific fits
    low = text.strip().lower()
    value = _convert_text(choices, text, low)
    if value is not _NO_VALUE and (not opt.choices or value in opt.choices or value is None):
        return value
    if opt.choices:
        raise PassConfigError(
            f"pass {pass_name!r}: option {opt.name}={text!r} must be one of {', '.join(map(str, opt.choices))}"
        )
    raise PassConfigError(
        f"pass {pass_name!r}: option {opt.name}={text!r} is not a valid {_type_name(tp)}"
        + (" (true or false)" if bool in choices else "")
        + f"; options of {pass_name!r}: {', '.join(o.describe() for o in PASS_REGISTRY[pass_name].options) or 'none'}"
    )


_NO_VALUE = object()


def _as_none(text: str, low: str) -> Any:
    return None if low in ("none", "null") else _NO_VALUE


def _as_bool(text: str, low: str) -> Any:
    return low == "true" if low in ("true", "false") else _NO_VALUE


def _as_int(text: str, low: str) -> Any:
    try:
        return int(text.strip())
    except ValueError:
        return _NO_VALUE


def _as_float(text: str, low: str) -> Any:
    try:
        v = float(text.strip())
    except ValueError:
        return _NO_VALUE
    return v if math.isfinite(v) else _NO_VALUE


def _as_str(text: str, low: str) -> Any:
    return text.strip() or _NO_VALUE


_CONVERTERS: dict[Any, Callable[[str, str], Any]] = {
    type(None): _as_none, bool: _as_bool, int: _as_int, float: _as_float, str: _as_str,
}


def _convert_text(choices: tuple[Any, ...], text: str, low: str) -> Any:
    """``text`` as the first of the types ``choices`` it reads as, else ``_NO_VALUE``."""
    for c in choices:
        if typing.get_origin(c) is typing.Literal:
            value = next((lit for lit in typing.get_args(c) if str(lit) == text.strip()), _NO_VALUE)
        else:
            value = _CONVERTERS[c](text, low) if c in _CONVERTERS else _NO_VALUE
        if value is not _NO_VALUE:
            return value
    return _NO_VALUE


def _check_order(names: list[str]) -> None:
    for i, name in enumerate(names):
        entry = PASS_REGISTRY[name]
        for other in entry.after:
            later = [j for j, n in enumerate(names) if n == other and j > i]
            if later:
                raise PassConfigError(
                    f"pass {name!r} must come after {other!r} in the pipeline (got {','.join(names)}); reorder --passes"
                )
        for other in entry.before:
            earlier = [j for j, n in enumerate(names) if n == other and j < i]
            if earlier:
                raise PassConfigError(
                    f"pass {name!r} must come before {other!r} in the pipeline (got {','.join(names)}); reorder --passes"
                )


def is_pass_list(spec: object) -> bool:
    """Whether ``spec`` is a non-empty list of pass instances (the Python API's alternative to a spec string)."""
    return not isinstance(spec, str) and bool(spec) and all(isinstance(p, ir.passes.PassBase) for p in spec)


def split_spec(spec: str | Sequence[str]) -> list[tuple[str, dict[str, str]]]:
    """``[(name, {key: raw text})]`` of a pipeline spec; names are checked against the registry."""
    _load_builtin_passes()
    parsed = _split_spec(spec)
    known = ", ".join(sorted(PASS_REGISTRY))
    for name, _ in parsed:
        if name not in PASS_REGISTRY:
            raise PassConfigError(f"unknown pass {name!r}; known passes: {known}")
    return parsed


def must_precede(first: str, second: str) -> bool:
    """Whether the registry orders pass ``first`` before pass ``second`` when both are in one pipeline."""
    return second in PASS_REGISTRY[first].before or first in PASS_REGISTRY[second].after


def build_passes(
    spec: str | Sequence[str] | Sequence[ir.passes.PassBase], context: CompileContext | None = None
) -> list[ir.passes.PassBase]:
    """Instantiate the passes named in ``spec``; every mistake is a :class:`PassConfigError` before any work.

    Unknown pass names list the known ones; unknown options list the pass's options; option values are
    converted to the factory's declared types (``cse=maybe`` is an error); ordering constraints
    (``after``/``before``) and required compile inputs are checked before any factory runs. ``spec`` may
    also be a list of pass instances (Python API), used as given.
    """
    if is_pass_list(spec):
        return list(spec)
    return [p for _, made in build_pipeline(spec, context) for p in made]


def build_pipeline(
    spec: str | Sequence[str], context: CompileContext | None = None
) -> list[tuple[str, list[ir.passes.PassBase]]]:
    """Like :func:`build_passes`, but per spec entry: ``[(name, [its pass instances])]``.

    One registered name may stand for several passes (``early-exit`` = fit heads + lower), hence a list.
    """
    _load_builtin_passes()
    context = context or CompileContext()
    parsed = _split_spec(spec)
    known = ", ".join(sorted(PASS_REGISTRY))
    for name, _ in parsed:
        if name not in PASS_REGISTRY:
            raise PassConfigError(f"unknown pass {name!r}; known passes: {known}")
    _check_order([n for n, _ in parsed])
    calls = []
    for name, raw in parsed:
        entry = PASS_REGISTRY[name]
        opts = {}
        for key, text in raw.items():
            opt = entry.option(key)
            if opt is None:
                valid = ", ".join(o.describe() for o in entry.options) or "none"
                raise PassConfigError(f"bad options for pass {name!r}: it has no option {key!r}; its options: {valid}")
            opts[key] = _convert_option(name, opt, text)
        missing = [r for r in entry.requires if context.options.get(r) in (None, "")]
        if missing:
            flags = ", ".join("--" + r.replace("_", "-") for r in missing)
            raise PassConfigError(f"pass {name!r} needs {flags} (see `dyncompile --help`)")
        calls.append((entry, opts))
    out = []
    for entry, opts in calls:
        made = entry.factory(context, **opts)
        out.append((entry.name, list(made) if isinstance(made, list | tuple) else [made]))
    return out


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, desc: str, enabled: bool):
    """A tqdm bar on stderr for long pass work (calibration runs, fitting), or a no-op when disabled."""
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, leave=False)


@dataclasses.dataclass
class PassRecord:
    name: str
    seconds: float
    modified: bool
    result: ir.passes.PassResult | None = dataclasses.field(default=None, repr=False)


@dataclasses.dataclass
class PipelineResult:
    model: ir.Model
    modified: bool
    records: list[PassRecord]


@dataclasses.dataclass
class NotFired(ir.passes.PassResult):
    """A pass's result when it could not do what it is for on this model (``modified`` is False).

    ``reason`` says what in the model stops it (naming the node or pattern), ``fix`` what the user can do. The
    pipeline runner reports it: a WARNING line at the default verbosity for a pass the user named, an INFO line
    for a pass an optimization level inserted (a preset, which is expected not to apply to every model). A pass
    with nothing left to do (a second run on its own output) returns a plain ``PassResult`` instead.
    """

    pass_name: str = ""
    reason: str = ""
    fix: str = ""

    def message(self) -> str:
        """One line: the pass, that it did nothing, why, and what to do."""
        text = f"pass {self.pass_name} did nothing: {self.reason}"
        return text + (f"; {self.fix}" if self.fix else "")


def warn_unmeasured_contrib_op(context: CompileContext, log: logging.Logger, pass_name: str, op: str) -> None:
    """Warn (on the pass's ``log``) that contrib operator ``op`` was not measured on the compile's provider.

    Passes that write onnxruntime contrib operators were measured on the CPU and CUDA EPs only.
    """
    provider = context.options.get("provider") or "cpu"
    if provider not in ("cpu", "cuda"):
        log.warning("%s: %s is an onnxruntime contrib operator; the %s EP was not measured with it (its nodes may run "
                    "on the CPU EP between partitions): leave the pass out for --provider %s", pass_name, op, provider,
                    provider)


def not_fired(model: ir.Model, pass_name: str, reason: str, fix: str = "") -> NotFired:
    """The result of pass ``pass_name`` that leaves ``model`` alone because it cannot fire on it (see :class:`NotFired`)."""
    return NotFired(model, False, pass_name, reason, fix)


def _report_not_fired(p: ir.passes.PassBase, result: ir.passes.PassResult) -> None:
    """Log why a pass did nothing: WARNING when the user named it, INFO when a preset inserted it."""
    if not isinstance(result, NotFired) or result.modified:
        return
    if getattr(p, "wrapped", None) is not None:  # an inserted preset (presets.PresetPass)
        logger.info("-O preset: %s", result.message())
    else:
        logger.warning("%s", result.message())


#: in-memory weight bytes above which a model cannot be serialized as one protobuf message (the 2 GB limit)
PROTO_LIMIT = 1_900_000_000


def in_memory_weight_bytes(model: ir.Model) -> int:
    """Bytes of the initializers held in memory (rewritten by a pass), not those still in an external file."""
    return sum(v.const_value.nbytes for v in model.graph.initializers.values()
               if v.const_value is not None and not isinstance(v.const_value, ir.ExternalTensor))


def _weights_as_inputs(proto, min_bytes: int = 1 << 20) -> None:
    """Turn the large in-memory initializers of ``proto`` into graph inputs of the same type and shape.

    So a model past protobuf's limit can still be checked (node rules, types and shapes; not the weight values).
    """
    import onnx

    keep = []
    for t in proto.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL and len(t.raw_data) >= min_bytes:
            vi = proto.graph.input.add()
            vi.name = t.name
            vi.type.tensor_type.elem_type = t.data_type
            for d in t.dims:
                vi.type.tensor_type.shape.dim.add().dim_value = d
        else:
            keep.append(t)
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(keep)


def check_model(model: ir.Model, *, full_check: bool = True) -> None:
    """Run the ONNX checker on ``model`` without touching it.

    (onnx-ir's ``CheckerPass`` reorders initializers as a side effect; serialising once and checking the
    proto leaves the IR exactly as it was.) Past protobuf's 2 GB limit (e.g. ``pack-matmuls`` on a 1.5B
    decoder) the large in-memory weights are checked as typed graph inputs.
    """
    import onnx

    proto = ir.to_proto(model)
    if in_memory_weight_bytes(model) > PROTO_LIMIT:
        _weights_as_inputs(proto)
    # Weights kept as external data (models loaded from disk) are found by the checker relative to the
    # working directory: check from the directory they live in.
    dirs = external_data_dirs(model)
    with working_directory(next(iter(dirs)) if len(dirs) == 1 else None):
        try:
            onnx.checker.check_model(proto, full_check=full_check)
        except onnx.checker.ValidationError as e:
            if "hard link" not in str(e):
                raise
            # not a bug of a pass: the user's weight file is hard-linked (e.g. a routed plan linked it); the
            # checker refuses such files as a possible "hardlink attack"
            raise ModelLoadError(
                f"the ONNX checker refuses the model's external data in {sorted(str(d) for d in dirs)}: a weight "
                "file has several hard links. Give the model its own copy (e.g. `cp --remove-destination` the "
                "linked file onto itself via a temporary copy) or compile with DYNCOMPILE_CHECK=none"
            ) from None


def _pass_name(p: ir.passes.PassBase) -> str:
    # a wrapper (e.g. an opt-level preset guard) records the name of the pass it runs
    return type(getattr(p, "wrapped", p)).__name__


def run_pipeline(
    passes: Sequence[ir.passes.PassBase],
    model: ir.Model,
    *,
    check: str | None = None,
    dump_dir: str | Path | None = None,
    full_check: bool = True,
) -> PipelineResult:
    """Run ``passes`` in order on ``model`` with the pipeline's policies.

    Args:
        passes: the passes, in order.
        model: the model; in-place passes modify it.
        check: ``"each"`` runs the ONNX checker after every pass (tests and ``--verify``), ``"end"`` once
            at the end, ``"none"`` never. Default: ``$DYNCOMPILE_CHECK`` or ``"end"`` (the test suite
            sets ``each``).
        dump_dir: if given, writes ``000_input.onnx.txt`` and ``NNN_PassName.onnx.txt`` after each pass.
        full_check: run the checker with ``full_check=True`` (shape inference included).
    """
    if check is None:
        check = os.environ.get("DYNCOMPILE_CHECK", "end")
    if check not in ("each", "end", "none"):
        raise ValueError(f"check must be 'each', 'end' or 'none', not {check!r}")

    def checker(m: ir.Model) -> None:
        check_model(m, full_check=full_check)

    dump = Path(dump_dir) if dump_dir is not None else None
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / "000_input.onnx.txt").write_text(ir.to_onnx_text(model, exclude_initializers=True))
    records: list[PassRecord] = []
    modified = False
    for i, p in enumerate(passes, start=1):
        t0 = time.perf_counter()
        try:
            result = p(model)
        except (ir.passes.PreconditionError, DyncompileError) as e:
            # A model or data the pass cannot work on is the user's to fix: one clear message.
            if isinstance(e, DyncompileError):
                raise
            raise PassConfigError(f"{p!r} cannot run on this model: {e}") from None
        dt = time.perf_counter() - t0
        model = result.model
        modified |= result.modified
        records.append(PassRecord(_pass_name(p), dt, result.modified, result))
        _report_not_fired(p, result)
        logger.info("pass %-32s %8.3f s  modified=%s", repr(p), dt, result.modified)
        if check == "each":
            t1 = time.perf_counter()
            checker(model)
            logger.info("  checker after %s: ok (%.3f s)", _pass_name(p), time.perf_counter() - t1)
        if dump is not None:
            (dump / f"{i:03d}_{_pass_name(p)}.onnx.txt").write_text(
                ir.to_onnx_text(model, exclude_initializers=True)
            )
    if check == "end":
        checker(model)
    return PipelineResult(model, modified, records)
