"""The plan container: :class:`Plan`, its :class:`Step` and :class:`FileRef` entries, and the schema registries.

:data:`STEP_SCHEMAS` and :data:`POLICY_SCHEMAS` gather the per-technique schemas of
:mod:`~dyncompile.plan.classify`, :mod:`~dyncompile.plan.decode`, :mod:`~dyncompile.plan.diffusion` and
:mod:`~dyncompile.plan.routing`. A step's typed params may declare what the plan must hold for it, and
:func:`~dyncompile.plan.load_plan` checks each declaration:

* ``file_keys() -> [(field, file key), ...]``: the plan files the step names (each must be in ``files``);
* ``sub_plans() -> [(field, name, folder), ...]``: sub-plan folders that must be inside the plan's folder;
* ``needs_tokenizer = True``: the plan must have a tokenizer.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

from dyncompile.errors import PlanError
from dyncompile.io import sha256_file, write_json_atomic
from dyncompile.plan import classify, decode, diffusion, embed, routing

__all__ = [
    "PLAN_FILENAME",
    "PLAN_FORMAT",
    "POLICY_SCHEMAS",
    "STEP_SCHEMAS",
    "FileRef",
    "OrtSessionPolicy",
    "Plan",
    "Step",
    "file_ref",
    "save_plan",
]

PLAN_FORMAT = "dyncompile.plan/v1"
PLAN_FILENAME = "plan.json"

STEP_SCHEMAS: dict[str, Any] = {**classify.STEPS, **decode.STEPS, **diffusion.STEPS, **routing.STEPS}
"""Step kind -> ``build(params_json, where)`` returning the typed params (declared schema per kind)."""



@dataclasses.dataclass(frozen=True)
class OrtSessionPolicy:
    """``policy.ort_session``: ONNX Runtime graph fusions the runtime switches off in the plan's CPU EP sessions.

    Only fusions dyncompile measures (``dyncompile.runtime.providers.OPTIONAL_CPU_FUSIONS``) may be named: a plan
    cannot pass arbitrary session options. ``measured_us`` and ``onnxruntime`` record the compile's measurement
    (fused vs unfused microseconds, and the ORT version it was made with); informational.
    """

    disabled_optimizers: list[Literal["SkipLayerNormFusion"]]
    measured_us: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    onnxruntime: str = ""


POLICY_SCHEMAS: dict[str, type] = {**classify.POLICIES, **decode.POLICIES, **routing.POLICIES, **embed.POLICIES,
                                   "ort_session": OrtSessionPolicy}
"""Policy name -> schema; other policy entries must be free-form JSON (finite numbers)."""


@dataclasses.dataclass
class FileRef:
    """One file of the plan: path relative to the plan dir (posix), sha256 and role."""

    path: str
    sha256: str
    role: str
    external_data: list[str] = dataclasses.field(default_factory=list)  # sidecar files of an ONNX model

    def to_dict(self) -> dict[str, Any]:
        """The ``files`` entry of ``plan.json``."""
        d = {"path": self.path, "sha256": self.sha256, "role": self.role}
        if self.external_data:
            d["external_data"] = list(self.external_data)
        return d


@dataclasses.dataclass
class Step:
    """One step of the plan; ``kind`` selects the runtime handler, ``params`` are its policy.

    ``typed`` holds the params validated against the kind's schema (:data:`STEP_SCHEMAS`) once the plan
    was loaded (None for a step built in memory or a kind without a declared schema).
    """

    kind: str
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    typed: Any = dataclasses.field(default=None, compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """The ``steps`` entry of ``plan.json``."""
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
    contents: dict[str, bytes] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    """Bytes of the small non-ONNX files (tokenizer, vocab maps), read once and hash-checked at load."""
    hashes_checked: bool = dataclasses.field(default=True, compare=False, repr=False)
    """Whether sessions check the sha256 of the bytes they read (off only for ``load_plan(verify_hashes=False)``)."""

    def to_dict(self) -> dict[str, Any]:
        """The JSON form written as ``plan.json``."""
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

    def original_model(self, purpose: str = "--compare") -> Path:
        """The original model this plan was compiled from (``provenance.source``), checked against its sha256.

        Raises:
            PlanError: no source recorded, the file is missing, or its sha256 differs from the recorded one
                (it is not the model the plan was compiled from, so figures "vs original" would be wrong).
        """
        src = self.provenance.get("source") if isinstance(self.provenance, dict) else None
        path = src.get("path") if isinstance(src, dict) else None
        want = src.get("sha256") if isinstance(src, dict) else None
        if not isinstance(path, str) or not path or not isinstance(want, str):
            raise PlanError(f"{purpose} needs the original model, but the plan records none (provenance.source)")
        p = Path(path)
        if not p.is_absolute() or "\x00" in path:
            raise PlanError(f"{purpose}: the plan's original model path {path!r} is not an absolute path")
        if not p.is_file():
            raise PlanError(
                f"{purpose} needs the original model, recorded as {path}, which is not there any more; copy it back "
                f"or leave out {purpose}"
            )
        actual = sha256_file(p)
        if actual != want:
            raise PlanError(
                f"{purpose}: {path} is not the model this plan was compiled from (sha256 {actual[:12]}… != recorded "
                f"{want[:12]}…); restore the original, or leave out {purpose}"
            )
        return p

    def content_of(self, key: str) -> bytes:
        """The verified bytes of small file ``key`` (read at load; read now for a plan built in memory)."""
        data = self.contents.get(key)
        if data is None:
            data = self.path_of(key).read_bytes()
        return data


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
