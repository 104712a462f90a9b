"""The trust boundary: load a plan that may come from a stranger, and check everything before any ONNX file opens.

Plans travel (they are made to be copied to edge devices), so a plan may come from a stranger. Loading
therefore validates everything against one declared schema before any ONNX file is opened: size (at most
:data:`MAX_PLAN_BYTES`) and nesting depth of the JSON, the version, paths that would escape the plan
directory, the sha256 of every file, the step kinds known to the runtime, the type and range of every
field of every step kind (:data:`~dyncompile.plan.STEP_SCHEMAS`) and policy
(:data:`~dyncompile.plan.POLICY_SCHEMAS`), and what each step declares the plan must hold (its file keys,
sub-plans, a tokenizer). A routed plan's sub-plans are loaded with the same checks and compared with the
digest the routed plan records (:func:`load_subplan`, :func:`plan_digest`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from dyncompile.errors import PlanError
from dyncompile.io import json_cost_problem, sha256_file
from dyncompile.plan._core import (
    PLAN_FILENAME,
    PLAN_FORMAT,
    POLICY_SCHEMAS,
    STEP_SCHEMAS,
    FileRef,
    Plan,
    Step,
)
from dyncompile.plan._typed import _check_json, _field, _short, from_json
from dyncompile.plan.decode import MAX_POSITIONS
from dyncompile.plan.model_bytes import external_locations, may_have_external_data, parse_model
from dyncompile.plan.routing import Candidate, RoutedParams

__all__ = [
    "MAX_DEPTH",
    "MAX_JSON_ITEMS",
    "MAX_JSON_STRING",
    "MAX_PLAN_BYTES",
    "SUPPORTED_FORMATS",
    "check_json_cost",
    "is_plan_dir",
    "load_plan",
    "load_subplan",
    "plan_digest",
]

SUPPORTED_FORMATS = (PLAN_FORMAT,)
MAX_PLAN_BYTES = 16 * 2**20  # a real plan is a few kB (a split drafter's record: tens of kB)
MAX_DEPTH = 32  # nesting of JSON containers; real plans reach 6
MAX_JSON_ITEMS = 200_000  # values + keys in plan.json; a real plan has a few thousand (a step-saver head: ~2k floats)
MAX_JSON_STRING = 1 << 20  # characters of one string (a chat template: a few kB)


# ------------------------------------------------------------------------------------------- plan.json's schema


@dataclasses.dataclass(frozen=True)
class _TokenizerSpec:
    file: str
    max_length: int = _field(512, lo=1, hi=MAX_POSITIONS)
    padding: Literal["longest", "max_length"] = "longest"


@dataclasses.dataclass(frozen=True)
class _IOSpec:
    _extra = True
    name: str
    dtype: str | None = None
    shape: list[int | str | None] = _field(factory=list)


@dataclasses.dataclass(frozen=True)
class _FileSpec:
    path: str
    sha256: str
    role: str
    external_data: list[str] = _field(factory=list)

    def _check(self, where: str) -> None:
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256):
            raise PlanError(f"{where}.sha256 must be 64 lowercase hex digits, got {_short(self.sha256)}")


@dataclasses.dataclass(frozen=True)
class _PlanSpec:
    format: str
    task: str
    files: dict[str, _FileSpec]
    steps: list[Any]
    inputs: list[_IOSpec] = _field(factory=list)
    outputs: list[_IOSpec] = _field(factory=list)
    tokenizer: _TokenizerSpec | None = None
    labels: list[str] | None = None
    policy: dict[str, Any] = _field(factory=dict)
    provenance: dict[str, Any] = _field(factory=dict)


def _check_rel_path(plan_dir: Path, rel: Any, what: str) -> Path:
    if not isinstance(rel, str) or not rel:
        raise PlanError(f"{what}: path must be a non-empty string, got {rel!r}")
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts or "\\" in rel or "\x00" in rel:
        raise PlanError(
            f"{what}: path {rel!r} escapes the plan directory; plan paths must be relative and stay inside it"
        )
    full = (plan_dir / rel).resolve()
    if plan_dir.resolve() not in full.parents and full != plan_dir.resolve():
        raise PlanError(f"{what}: path {rel!r} resolves outside the plan directory ({full})")
    return full


def _depth_ok(v: Any, limit: int) -> bool:
    stack = [(v, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, dict | list):
            if d > limit:
                return False
            stack.extend((y, d + 1) for y in (x.values() if isinstance(x, dict) else x))
    return True


def _read_plan_json(path: Path) -> dict[str, Any]:
    size = path.stat().st_size
    if size > MAX_PLAN_BYTES:
        raise PlanError(
            f"{path} is {size / 2**20:.1f} MiB; a plan.json is at most {MAX_PLAN_BYTES // 2**20} MiB (real plans "
            "are a few kB): this is not a plan dyncompile wrote"
        )
    data = path.read_bytes()
    if data[:1] != b"{" and data.lstrip()[:1] != b"{":
        raise PlanError(f"{path} is not a plan (plan.json is a JSON object); recompile the model")
    check_json_cost(data, path)
    try:
        raw = json.loads(data.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanError(f"{path} is not valid JSON ({e}); recompile the model") from None
    except RecursionError:
        raise PlanError(f"{path}: JSON nested too deeply (a plan nests at most {MAX_DEPTH} levels)") from None
    if not isinstance(raw, dict):
        raise PlanError(f"{path}: top level must be a JSON object")
    if not _depth_ok(raw, MAX_DEPTH):
        raise PlanError(f"{path}: JSON nested too deeply (a plan nests at most {MAX_DEPTH} levels)")
    return raw


def check_json_cost(data: bytes, where: Path | str) -> None:
    """Refuse JSON whose parse would cost far more than any plan's, before parsing it (:func:`dyncompile.io.json_cost_problem`).

    Raises:
        PlanError: more than :data:`MAX_JSON_ITEMS` values and keys, or a string over :data:`MAX_JSON_STRING`.
    """
    problem = json_cost_problem(data, max_items=MAX_JSON_ITEMS, max_string=MAX_JSON_STRING)
    if problem:
        raise PlanError(f"{where}: {problem}; this is not a plan dyncompile wrote")


def is_plan_dir(path: str | Path) -> bool:
    """True when ``path`` is a directory holding a ``plan.json`` of a format this dyncompile writes."""
    p = Path(path) / PLAN_FILENAME
    try:
        if not p.is_file() or p.stat().st_size > MAX_PLAN_BYTES:
            return False
        data = p.read_bytes()
        check_json_cost(data, p)
        raw = json.loads(data.decode("utf-8"))
    except (OSError, ValueError, RecursionError, PlanError):
        return False
    return isinstance(raw, dict) and raw.get("format") in SUPPORTED_FORMATS


def _resolve_plan_path(plan_dir: Path) -> tuple[Path, Path]:
    if plan_dir.is_dir():
        return plan_dir, plan_dir / PLAN_FILENAME
    if plan_dir.is_file():
        if plan_dir.name == PLAN_FILENAME:
            return plan_dir.parent, plan_dir
        with open(plan_dir, "rb") as f:
            head = f.read(64).lstrip()
        if plan_dir.suffix == ".onnx" or (head[:1] != b"{" and plan_dir.suffix != ".json"):
            raise PlanError(
                f"{plan_dir} is an ONNX model (or another file), not a plan; compile it first "
                f"(`dyncompile {plan_dir} -o DIR`) and run the plan directory DIR"
            )
        raise PlanError(f"{plan_dir} is a file, not a plan directory; give the directory holding {PLAN_FILENAME}")
    raise PlanError(
        f"no plan at {plan_dir}: expected {plan_dir / PLAN_FILENAME} (make one with `dyncompile MODEL.onnx -o DIR`)"
    )


@contextlib.contextmanager
def _blamed_on(path: Path) -> Iterator[None]:
    """Prefix a schema error with the plan file and say how to fix it."""
    try:
        yield
    except PlanError as e:
        raise PlanError(f"{path}: {e}; recompile the model, or fix plan.json") from None


def _parse_spec(path: Path, raw: dict[str, Any]) -> _PlanSpec:
    """Check the format version and the required fields, then validate ``raw`` against the plan schema."""
    fmt = raw.get("format")
    if not isinstance(fmt, str) or fmt not in SUPPORTED_FORMATS:
        raise PlanError(
            f"{path}: unknown plan format {_short(fmt)}; this dyncompile reads {', '.join(SUPPORTED_FORMATS)} — "
            "recompile the model with this version, or use the dyncompile version that wrote it"
        )
    for key in ("task", "files", "steps"):
        if key not in raw:
            raise PlanError(f"{path}: missing required field {key!r}")
    with _blamed_on(path):
        return from_json(_PlanSpec, raw, "plan")


def _hash_and_scan(path: Path) -> tuple[str, bool]:
    """The sha256 of ``path`` and whether its bytes may name external data, in one streaming read."""
    h = hashlib.sha256()
    found, tail = False, b""
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            found = found or may_have_external_data(tail + chunk)
            tail = chunk[-16:]
    return h.hexdigest(), found


def _check_onnx_file(full: Path, key: str, fr: _FileSpec, plan_paths: set[str]) -> str:
    """Hash ONNX file ``key`` and check that every external-data location it names is a file of the plan.

    Streams the file (a model with inline weights is not held in memory); one that names external data is
    then read whole and parsed, from bytes hashed again (a file changed in between is reported as modified).

    Returns:
        The sha256 of the file (of the bytes that were parsed, when it was parsed).
    """
    try:
        actual, external = _hash_and_scan(full)
        if actual != fr.sha256 or not external:  # a modified file is reported as such by the caller
            return actual
        data = full.read_bytes()
    except OSError as e:
        raise PlanError(f"cannot read file {key!r} of the plan ({full}): {e.strerror or e}") from None
    actual = hashlib.sha256(data).hexdigest()
    if actual == fr.sha256:
        where = f"file {key!r} ({fr.path})"
        try:
            proto = parse_model(data, where)
        except PlanError:  # not ONNX at all: it names no external data; ONNX Runtime refuses it at session time
            return actual
        external_locations(proto, fr.path, plan_paths, where)
    return actual


def _load_files(plan_dir: Path, spec: _PlanSpec, verify_hashes: bool) -> tuple[dict[str, FileRef], dict[str, bytes]]:
    """Check every file's path and sha256; read the small ones (tokenizer, vocab maps) into memory.

    Every external-data file an ONNX file names (in its ``external_data`` list, and with ``verify_hashes`` in
    its tensors) must itself be a file entry of the plan, so that its sha256 is checked and the plan's digest
    covers it.

    Returns:
        The plan's files, and the bytes of its small files (the bytes that were hashed).
    """
    files: dict[str, FileRef] = {}
    contents: dict[str, bytes] = {}
    plan_paths = {fr.path for fr in spec.files.values()}
    for key, fr in spec.files.items():
        full = _check_rel_path(plan_dir, fr.path, f"file {key!r}")
        for e in fr.external_data:
            _check_rel_path(plan_dir, e, f"external data of file {key!r}")
            if e not in plan_paths:
                raise PlanError(
                    f"external data {e!r} of file {key!r} is not a file of the plan: plan.json lists no sha256 for "
                    "it, so its weights would run unchecked; recompile the plan, or add it to plan.json's files"
                )
        if not full.is_file():
            raise PlanError(f"file {key!r} of the plan is missing: {full}")
        small = not fr.path.endswith((".onnx", ".data")) and fr.role not in ("external_data",)
        if small:
            data = full.read_bytes()
            contents[key] = data
            actual = hashlib.sha256(data).hexdigest()
        elif not verify_hashes:
            actual = fr.sha256
        elif fr.path.endswith(".onnx"):
            actual = _check_onnx_file(full, key, fr, plan_paths)
        else:
            actual = sha256_file(full)
        if verify_hashes and actual != fr.sha256:
            raise PlanError(
                f"file {key!r} ({full}) was modified after compile: sha256 {actual[:12]}… != plan's "
                f"{fr.sha256[:12]}…; recompile, or restore the original file"
            )
        files[key] = FileRef(fr.path, fr.sha256, fr.role, list(fr.external_data))
    return files, contents


def _load_step(path: Path, i: int, s: Any, spec: _PlanSpec, files: dict[str, FileRef], known_step_kinds) -> Step:
    """Validate step ``i`` against its kind's schema and what it declares the plan must hold."""
    if not isinstance(s, dict) or not isinstance(s.get("kind"), str):
        raise PlanError(f"{path}: step {i} has no 'kind' (a string naming the step handler)")
    kind = s["kind"]
    if known_step_kinds is not None and kind not in known_step_kinds:
        raise PlanError(
            f"{path}: step {i} has unknown kind {_short(kind)}; this runtime knows: "
            f"{', '.join(sorted(known_step_kinds))} (plan from a newer dyncompile?)"
        )
    params = {k: v for k, v in s.items() if k != "kind"}
    build = STEP_SCHEMAS.get(kind)
    if build is None:
        _check_json(params, f"steps[{i}]")
        return Step(kind, params, None)
    with _blamed_on(path):
        typed = build(params, f"steps[{i}] ({kind})")
    _check_step_needs(path, f"steps[{i}] ({kind})", typed, spec, files)
    return Step(kind, params, typed)


def _check_step_needs(path: Path, where: str, typed: Any, spec: _PlanSpec, files: dict[str, FileRef]) -> None:
    """Check what a step's typed params declare the plan must hold: file keys, sub-plan folders, a tokenizer."""
    file_keys = getattr(typed, "file_keys", None)
    for field, key in file_keys() if file_keys is not None else ():
        if key not in files:
            raise PlanError(
                f"{path}: {where}.{field} names file {key!r}, which the plan does not list "
                f"(files: {', '.join(files)}); recompile the model"
            )
    sub_plans = getattr(typed, "sub_plans", None)
    for field, name, rel in sub_plans() if sub_plans is not None else ():
        sub = _check_rel_path(path.parent, rel, f"{where}.{field}")
        if not (sub / PLAN_FILENAME).is_file():
            raise PlanError(
                f"{path}: {where}: sub-plan {name!r} is missing (no {sub / PLAN_FILENAME}); a routed "
                "plan carries its candidates inside its folder — copy the whole folder, or recompile with "
                "`dyncompile route`"
            )
    if getattr(typed, "needs_tokenizer", False) and spec.tokenizer is None:
        raise PlanError(f"{path}: {where} tokenizes text, but the plan has no tokenizer; recompile the model")


def _check_policy(path: Path, spec: _PlanSpec) -> None:
    """Validate each ``policy`` entry against its schema (free-form JSON for names without one)."""
    for name, value in spec.policy.items():
        schema = POLICY_SCHEMAS.get(name)
        with _blamed_on(path):
            if schema is not None:
                from_json(schema, value, f"policy.{name}")
            else:
                _check_json(value, f"policy.{name}")


def _check_labels_and_tokenizer(path: Path, spec: _PlanSpec, files: dict[str, FileRef]) -> None:
    """The labels fit the classifier's output, and the tokenizer names a file of the plan."""
    if spec.labels is not None and spec.task == "text-classification" and spec.outputs:
        classes = spec.outputs[0].shape[-1] if spec.outputs[0].shape else None
        if isinstance(classes, int) and classes != len(spec.labels):
            raise PlanError(
                f"{path}: labels lists {len(spec.labels)} classes but the output {spec.outputs[0].name!r} has {classes}; "
                "recompile the model, or fix plan.json"
            )
    if spec.tokenizer is not None and spec.tokenizer.file not in files:
        raise PlanError(f"{path}: tokenizer.file {spec.tokenizer.file!r} names no file of the plan ({', '.join(files)})")


def _check_provenance(path: Path, prov: dict[str, Any]) -> None:
    """The provenance fields the tools read (source, calib, passes, tool, dyncompile) have their recorded types."""
    for key in ("source", "calib"):
        rec = prov.get(key)
        if rec is None:
            continue
        if not isinstance(rec, dict) or not all(isinstance(rec.get(k, ""), str) for k in ("path", "sha256")):
            raise PlanError(f"{path}: provenance.{key} must be an object with string 'path' and 'sha256', got "
                            f"{_short(rec)}")
    passes = prov.get("passes")
    if passes is not None and (not isinstance(passes, list) or not all(isinstance(p, str) for p in passes)):
        raise PlanError(f"{path}: provenance.passes must be a list of strings, got {_short(passes)}")
    for key in ("tool", "dyncompile"):
        if prov.get(key) is not None and not isinstance(prov[key], str):
            raise PlanError(f"{path}: provenance.{key} must be a string, got {_short(prov[key])}")


def load_plan(plan_dir: str | Path, *, verify_hashes: bool = True, known_step_kinds=None) -> Plan:
    """Load and validate ``plan_dir/plan.json`` against the plan schema; read and hash-check every file.

    ONNX files and their external data are hashed here, and every external-data location of every ONNX file
    must be a file entry of the plan. The runtime hashes them again when it makes a session, from the bytes it
    hands ONNX Runtime (:func:`~dyncompile.plan.model_bytes.read_model`); small files (tokenizer, vocab maps)
    are read once into :attr:`Plan.contents` from the same bytes that were hashed. A file swapped after
    ``load`` is never used.

    Args:
        plan_dir: the plan directory (or its ``plan.json``).
        verify_hashes: check the sha256 of the ONNX files and their external data (small files always are).
        known_step_kinds: the step kinds the caller can run (None: any).

    Returns:
        The plan, each step's params validated into :attr:`Step.typed`.

    Raises:
        PlanError: missing/oversized/malformed plan, unknown format version, a field of the wrong type or
            out of range, a path escaping the plan dir, a file whose sha256 differs from the plan's
            (modified after compile), or an unknown step kind.
    """
    plan_dir, path = _resolve_plan_path(Path(plan_dir))
    if not path.is_file():
        raise PlanError(
            f"no plan at {plan_dir}: expected {path} (make one with `dyncompile MODEL.onnx -o DIR`)"
        )
    raw = _read_plan_json(path)
    spec = _parse_spec(path, raw)
    files, contents = _load_files(plan_dir, spec, verify_hashes)
    if not spec.steps:
        raise PlanError(f"{path}: 'steps' must be a non-empty list")
    steps = [_load_step(path, i, s, spec, files, known_step_kinds) for i, s in enumerate(spec.steps)]
    _check_policy(path, spec)
    _check_provenance(path, spec.provenance)
    _check_labels_and_tokenizer(path, spec, files)
    return Plan(
        task=spec.task,
        files=files,
        steps=steps,
        inputs=raw.get("inputs") or [],
        outputs=raw.get("outputs") or [],
        tokenizer=raw.get("tokenizer"),
        labels=spec.labels,
        policy=spec.policy,
        provenance=spec.provenance,
        format=spec.format,
        directory=plan_dir,
        contents=contents,
        hashes_checked=verify_hashes,
    )


def plan_digest(plan_dir: str | Path, *, loaded: Plan | None = None) -> str:
    """One sha256 over the whole plan: ``plan.json`` and every file it names, in canonical (sorted path) order.

    Each entry contributes ``path NUL sha256-of-bytes NUL``, so the digest changes when any byte of any
    file changes, when a file is renamed, added to or dropped from the plan. Compare it with the digest
    the plan's publisher printed (``dyncompile inspect --verify PLAN``). A routed plan (``route`` /
    ``cascade`` steps) also checks every sub-plan against the digest it records (:func:`load_subplan`).

    ``loaded``: the plan as :func:`load_plan` returned it with ``verify_hashes=True`` — its files' hashes were
    just checked, so they are not read a second time (same digest).
    """
    plan = loaded if loaded is not None else load_plan(plan_dir, verify_hashes=True)
    assert plan.directory is not None
    known = {f.path: f.sha256 for f in plan.files.values()}
    rels = {PLAN_FILENAME}
    for f in plan.files.values():
        rels.add(f.path)
        rels.update(f.external_data)
    h = hashlib.sha256(b"dyncompile.plan-digest/v1\0")
    for rel in sorted(rels):
        full = plan.directory / rel
        if not full.is_file():
            raise PlanError(f"file {rel!r} named by the plan is missing: {full}")
        digest = known[rel] if (loaded is not None and rel in known) else sha256_file(full)
        h.update(rel.encode("utf-8") + b"\0" + digest.encode() + b"\0")
    if loaded is None:
        for step in plan.steps:
            if isinstance(step.typed, RoutedParams):
                for c in step.typed.candidates:
                    load_subplan(plan, c)
    return h.hexdigest()


def load_subplan(parent: Plan, candidate: Candidate, known_step_kinds=None) -> Plan:
    """Load candidate ``candidate`` of routed plan ``parent`` and check it against the recorded digest.

    The sub-plan gets the same checks as a top-level plan (:func:`load_plan`).

    Raises:
        PlanError: the sub-plan is missing, fails any check of :func:`load_plan`, is itself a routed plan, or
            differs from what was compiled in (digest mismatch: a file added, removed, renamed or changed).
    """
    assert parent.directory is not None
    sub_dir = _check_rel_path(parent.directory, candidate.plan, f"candidate {candidate.name!r}")
    if not (sub_dir / PLAN_FILENAME).is_file():
        raise PlanError(
            f"sub-plan {candidate.name!r} of {parent.directory} is missing (no {sub_dir / PLAN_FILENAME}); copy the "
            "whole routed folder, or recompile with `dyncompile route`"
        )
    try:
        sub = load_plan(sub_dir, verify_hashes=True, known_step_kinds=known_step_kinds)
    except PlanError as e:
        raise PlanError(f"sub-plan {candidate.name!r} of routed plan {parent.directory}: {e}") from None
    if any(isinstance(s.typed, RoutedParams) for s in sub.steps):
        raise PlanError(f"sub-plan {candidate.name!r} of {parent.directory} is itself a routed plan; candidates must be plain plans")
    digest = plan_digest(sub_dir, loaded=sub)
    if digest != candidate.digest:
        raise PlanError(
            f"sub-plan {candidate.name!r} ({sub_dir}) was modified after the routed plan was compiled: digest "
            f"{digest[:12]}… != recorded {candidate.digest[:12]}… (a file added, removed or changed); restore it, or "
            "recompile with `dyncompile route`"
        )
    if sub.task != candidate.task or (sub.labels is not None and candidate.labels is not None and list(sub.labels) != list(candidate.labels)):
        raise PlanError(f"sub-plan {candidate.name!r} does not match the task / labels the routed plan records; recompile")
    return sub
