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
import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import onnx_ir as ir

from dyncompile.errors import DyncompileError, PassConfigError
from dyncompile.io import external_data_dirs, working_directory

logger = logging.getLogger(__name__)

__all__ = [
    "CompileContext",
    "PassRecord",
    "PipelineResult",
    "PASS_REGISTRY",
    "register_pass",
    "parse_pass_spec",
    "build_passes",
    "run_pipeline",
    "known_passes",
    "check_model",
]


@dataclasses.dataclass
class CompileContext:
    """What a pass factory may read besides its own options: the compile request.

    Factories read it once to construct their pass; passes never keep a reference to it (no state
    between runs).
    """

    model_path: Path | None = None
    model_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    progress: bool = True


@dataclasses.dataclass(frozen=True)
class PassSpec:
    name: str
    factory: Callable[..., ir.passes.PassBase]
    help: str
    requires: tuple[str, ...] = ()


PASS_REGISTRY: dict[str, PassSpec] = {}


def register_pass(name: str, *, help: str, requires: Sequence[str] = ()):  # noqa: A002 - CLI wording
    """Register ``factory(context, **options) -> PassBase`` under ``name``.

    ``requires`` names context fields (e.g. ``calib``) the pass cannot run without; the pipeline
    builder reports them as one clear error before anything runs.
    """

    def deco(factory):
        if name in PASS_REGISTRY:
            raise ValueError(f"pass {name!r} registered twice")
        PASS_REGISTRY[name] = PassSpec(name, factory, help, tuple(requires))
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


def parse_pass_spec(spec: str | Sequence[str]) -> list[tuple[str, dict[str, Any]]]:
    """Parse ``"verify,early-exit{budget=1.0,lowering=if},cleanup"`` into ``[(name, options), ...]``."""
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
        if not part.strip():
            continue
        m = _SPEC_RE.match(part)
        if not m:
            raise PassConfigError(
                f"cannot parse pass spec {part!r}: expected NAME or NAME{{key=value,...}} (e.g. 'cleanup' or "
                "'early-exit{budget=1.0}')"
            )
        opts: dict[str, Any] = {}
        if m.group(2):
            for kv in m.group(2).split(","):
                if not kv.strip():
                    continue
                if "=" not in kv:
                    raise PassConfigError(f"pass option {kv!r} in {part!r} is not key=value")
                k, v = kv.split("=", 1)
                opts[k.strip().replace("-", "_")] = _parse_value(v)
        out.append((m.group(1), opts))
    if not out:
        raise PassConfigError("no passes given: use e.g. --passes verify,cleanup (see `dyncompile passes`)")
    return out


def build_passes(
    spec: str | Sequence[str] | Sequence[ir.passes.PassBase], context: CompileContext | None = None
) -> list[ir.passes.PassBase]:
    """Instantiate the passes named in ``spec`` (unknown names list the known ones).

    ``spec`` may also be a list of pass instances (Python API), used as given.
    """
    _load_builtin_passes()
    context = context or CompileContext()
    if not isinstance(spec, str) and spec and all(isinstance(p, ir.passes.PassBase) for p in spec):
        return list(spec)
    passes = []
    for name, opts in parse_pass_spec(spec):
        if name not in PASS_REGISTRY:
            known = ", ".join(sorted(PASS_REGISTRY))
            raise PassConfigError(f"unknown pass {name!r}; known passes: {known}")
        entry = PASS_REGISTRY[name]
        missing = [r for r in entry.requires if context.options.get(r) in (None, "")]
        if missing:
            flags = ", ".join("--" + r.replace("_", "-") for r in missing)
            raise PassConfigError(f"pass {name!r} needs {flags} (see `dyncompile --help`)")
        try:
            made = entry.factory(context, **opts)
        except TypeError as e:
            raise PassConfigError(f"bad options for pass {name!r}: {e}") from None
        # A registered name may stand for several passes (e.g. early-exit = fit heads + lower).
        passes.extend(made if isinstance(made, list | tuple) else [made])
    return passes


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

    def result_of(self, pass_type: type) -> ir.passes.PassResult | None:
        """The last result produced by a pass of ``pass_type`` (for pass statistics)."""
        for rec in reversed(self.records):
            if rec.result is not None and rec.name == pass_type.__name__:
                return rec.result
        return None


def check_model(model: ir.Model, *, full_check: bool = True) -> None:
    """Run the ONNX checker on ``model`` without touching it.

    (onnx-ir's ``CheckerPass`` reorders initializers as a side effect; serialising once and checking the
    proto leaves the IR exactly as it was.)
    """
    import onnx

    proto = ir.to_proto(model)
    # Weights kept as external data (models loaded from disk) are found by the checker relative to the
    # working directory: check from the directory they live in.
    dirs = external_data_dirs(model)
    with working_directory(next(iter(dirs)) if len(dirs) == 1 else None):
        onnx.checker.check_model(proto, full_check=full_check)


def _pass_name(p: ir.passes.PassBase) -> str:
    return type(p).__name__


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
