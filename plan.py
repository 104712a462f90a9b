"""The execution plan: a versioned JSON file beside the ONNX files it names.

``plan.json`` (``"format": "dyncompile.plan/v1"``) says which files make up a compiled model (relative
paths + sha256, each with a role), the I/O signature, the tokenizer, and the ordered ``steps`` the
runtime executes with their policy parameters (thresholds, ...). Passes and the compiler produce it;
the runtime only follows it. Loading validates everything: version, JSON shape, paths that would
escape the plan directory, hashes of every file, and step kinds known to the runtime.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path, PurePosixPath
from typing import Any

from dyncompile.errors import PlanError
from dyncompile.io import sha256_file, write_json_atomic

__all__ = [
    "PLAN_FORMAT",
    "PLAN_FILENAME",
    "FileRef",
    "Step",
    "Plan",
    "save_plan",
    "load_plan",
]

PLAN_FORMAT = "dyncompile.plan/v1"
PLAN_FILENAME = "plan.json"
SUPPORTED_FORMATS = (PLAN_FORMAT,)


@dataclasses.dataclass
class FileRef:
    """One file of the plan: path relative to the plan dir (posix), sha256 and role."""

    path: str
    sha256: str
    role: str
    external_data: list[str] = dataclasses.field(default_factory=list)  # sidecar files of an ONNX model

    def to_dict(self) -> dict[str, Any]:
        d = {"path": self.path, "sha256": self.sha256, "role": self.role}
        if self.external_data:
            d["external_data"] = list(self.external_data)
        return d


@dataclasses.dataclass
class Step:
    """One step of the plan; ``kind`` selects the runtime handler, ``params`` are its policy."""

    kind: str
    params: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **self.params}


@dataclasses.dataclass
class Plan:
    """In-memory form of ``plan.json``."""

    task: str
    files: dict[str, FileRef]
    steps: list[Step]
    inputs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    outputs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    tokenizer: dict[str, Any] | None = None
    labels: list[str] | None = None
    policy: dict[str, Any] = dataclasses.field(default_factory=dict)
    provenance: dict[str, Any] = dataclasses.field(default_factory=dict)
    format: str = PLAN_FORMAT
    directory: Path | None = dataclasses.field(default=None, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "task": self.task,
            "files": {k: f.to_dict() for k, f in self.files.items()},
            "inputs": self.inputs,
            "outputs": self.outputs,
            "tokenizer": self.tokenizer,
            "labels": self.labels,
            "steps": [s.to_dict() for s in self.steps],
            "policy": self.policy,
            "provenance": self.provenance,
        }

    def path_of(self, key: str) -> Path:
        """Absolute path of file ``key`` (plan must have been loaded from / saved to a directory)."""
        if self.directory is None:
            raise PlanError("plan has no directory; load it with load_plan(dir)")
        if key not in self.files:
            raise PlanError(f"plan names no file {key!r}; it has: {', '.join(self.files)}")
        return self.directory / self.files[key].path


def file_ref(plan_dir: Path, rel: str, role: str, external_data: list[str] | None = None) -> FileRef:
    """A :class:`FileRef` for ``plan_dir/rel`` with its current sha256."""
    return FileRef(rel, sha256_file(plan_dir / rel), role, list(external_data or []))


def save_plan(plan: Plan, plan_dir: str | Path) -> Path:
    """Write ``plan_dir/plan.json`` atomically; returns its path."""
    plan_dir = Path(plan_dir)
    path = plan_dir / PLAN_FILENAME
    write_json_atomic(path, plan.to_dict())
    plan.directory = plan_dir
    return path


def _check_rel_path(plan_dir: Path, rel: Any, what: str) -> Path:
    if not isinstance(rel, str) or not rel:
        raise PlanError(f"{what}: path must be a non-empty string, got {rel!r}")
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts or "\\" in rel:
        raise PlanError(
            f"{what}: path {rel!r} escapes the plan directory; plan paths must be relative and stay inside it"
        )
    full = (plan_dir / rel).resolve()
    if plan_dir.resolve() not in full.parents and full != plan_dir.resolve():
        raise PlanError(f"{what}: path {rel!r} resolves outside the plan directory ({full})")
    return full


def load_plan(plan_dir: str | Path, *, verify_hashes: bool = True, known_step_kinds=None) -> Plan:
    """Load and validate ``plan_dir/plan.json``.

    Raises:
        PlanError: missing/malformed plan, unknown format version, a path escaping the plan dir, a file
            whose sha256 differs from the plan's (modified after compile), or an unknown step kind.
    """
    plan_dir = Path(plan_dir)
    path = plan_dir / PLAN_FILENAME if plan_dir.is_dir() else plan_dir
    if path.is_file() and path.name == PLAN_FILENAME:
        plan_dir = path.parent
    if not path.is_file():
        raise PlanError(
            f"no plan at {plan_dir}: expected {plan_dir / PLAN_FILENAME} (make one with `dyncompile MODEL.onnx -o DIR`)"
        )
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanError(f"{path} is not valid JSON ({e}); recompile the model") from None
    if not isinstance(raw, dict):
        raise PlanError(f"{path}: top level must be a JSON object")
    fmt = raw.get("format")
    if fmt not in SUPPORTED_FORMATS:
        raise PlanError(
            f"{path}: unknown plan format {fmt!r}; this dyncompile reads {', '.join(SUPPORTED_FORMATS)} — "
            "recompile the model with this version, or use the dyncompile version that wrote it"
        )
    for key in ("task", "files", "steps"):
        if key not in raw:
            raise PlanError(f"{path}: missing required field {key!r}")
    files: dict[str, FileRef] = {}
    if not isinstance(raw["files"], dict):
        raise PlanError(f"{path}: 'files' must be an object of name -> {{path, sha256, role}}")
    for key, fr in raw["files"].items():
        if not isinstance(fr, dict) or not {"path", "sha256", "role"} <= set(fr):
            raise PlanError(f"{path}: file entry {key!r} needs path, sha256 and role")
        full = _check_rel_path(plan_dir, fr["path"], f"file {key!r}")
        ext = fr.get("external_data", [])
        for e in ext:
            _check_rel_path(plan_dir, e, f"external data of file {key!r}")
        if not full.is_file():
            raise PlanError(f"file {key!r} of the plan is missing: {full}")
        if verify_hashes:
            actual = sha256_file(full)
            if actual != fr["sha256"]:
                raise PlanError(
                    f"file {key!r} ({full}) was modified after compile: sha256 {actual[:12]}… != plan's "
                    f"{str(fr['sha256'])[:12]}…; recompile, or restore the original file"
                )
        files[key] = FileRef(fr["path"], fr["sha256"], fr["role"], list(ext))
    steps = []
    if not isinstance(raw["steps"], list) or not raw["steps"]:
        raise PlanError(f"{path}: 'steps' must be a non-empty list")
    for i, s in enumerate(raw["steps"]):
        if not isinstance(s, dict) or "kind" not in s:
            raise PlanError(f"{path}: step {i} has no 'kind'")
        params = {k: v for k, v in s.items() if k != "kind"}
        if known_step_kinds is not None and s["kind"] not in known_step_kinds:
            raise PlanError(
                f"{path}: step {i} has unknown kind {s['kind']!r}; this runtime knows: "
                f"{', '.join(sorted(known_step_kinds))} (plan from a newer dyncompile?)"
            )
        steps.append(Step(s["kind"], params))
    return Plan(
        task=raw["task"],
        files=files,
        steps=steps,
        inputs=raw.get("inputs", []),
        outputs=raw.get("outputs", []),
        tokenizer=raw.get("tokenizer"),
        labels=raw.get("labels"),
        policy=raw.get("policy", {}),
        provenance=raw.get("provenance", {}),
        format=fmt,
        directory=plan_dir,
    )
