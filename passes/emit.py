"""Plan emitters: turn the compiled IR into files + ``plan.json`` inside a (temporary) plan directory.

The last pass of a pipeline decides the emitter through the model's ``dyncompile.emitter`` metadata
(default ``single``: one ONNX file run by one ``run_model`` step). Emitters are registered by name so
that a pass module can add its own (e.g. the staged early-exit lowering writes several segment graphs).
When no pass chose one, the rules registered with :func:`register_default_emitter` may pick one from the
model itself (a KV-cache decoder gets the ``generate`` emitter of :mod:`dyncompile.passes.speculative`).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx_ir as ir

from dyncompile.passes import _keys
from dyncompile.plan import EMBEDDING_TASKS, FileRef, Plan, Step, file_ref

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_EMITTER_RULES",
    "EmitRequest",
    "PLAN_EMITTERS",
    "emit_plan",
    "io_signature",
    "register_default_emitter",
    "register_emitter",
    "save_model",
]

#: Models larger than this are saved with their weights as ONNX external data.
EXTERNAL_DATA_THRESHOLD = 1 << 30


@dataclasses.dataclass
class EmitRequest:
    """Everything an emitter needs besides the model."""

    out_dir: Path
    task: str
    tokenizer_file: Path | None = None
    tokenizer_spec: dict[str, Any] | None = None
    labels: list[str] | None = None
    provenance: dict[str, Any] = dataclasses.field(default_factory=dict)
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: the ``dyncompile-model.json`` of the input model (eos ids, chat template, ... for decoders)
    model_config: dict[str, Any] = dataclasses.field(default_factory=dict)


PLAN_EMITTERS: dict[str, Callable[[ir.Model, EmitRequest], Plan]] = {}


def register_emitter(name: str):
    """Register ``fn(model, request) -> Plan`` as the plan emitter ``name``."""
    def deco(fn):
        PLAN_EMITTERS[name] = fn
        return fn

    return deco


#: ``(model, request) -> emitter name or None``, asked in order when no pass set ``dyncompile.emitter``
DEFAULT_EMITTER_RULES: list[Callable[[ir.Model, EmitRequest], str | None]] = []


def register_default_emitter(rule: Callable[[ir.Model, EmitRequest], str | None]):
    """Register a rule choosing the emitter of a model no pass chose one for (the first non-None answer wins)."""
    DEFAULT_EMITTER_RULES.append(rule)
    return rule


def _model_nbytes(model: ir.Model) -> int:
    total = 0
    for g in model.graphs():
        for v in g.initializers.values():
            if v.const_value is not None:
                total += v.const_value.nbytes
    return total


def save_model(model: ir.Model, out_dir: Path, filename: str, role: str) -> list[FileRef]:
    """Save ``model`` as ``out_dir/filename`` (+ external data when large); return its FileRefs."""
    path = out_dir / filename
    refs = []
    # Tensors still stored as another file's external data (a model loaded from disk) must be written out
    # too: ir.save would otherwise keep references to a data file that is not in the plan directory.
    has_external = any(isinstance(v.const_value, ir.ExternalTensor) for g in model.graphs() for v in g.initializers.values())
    if _model_nbytes(model) > EXTERNAL_DATA_THRESHOLD or has_external:
        data_name = filename + ".data"
        ir.save(model, path, external_data=data_name)
        refs.append(file_ref(out_dir, filename, role, [data_name]))
        refs.append(file_ref(out_dir, data_name, "external_data"))
    else:
        ir.save(model, path)
        refs.append(file_ref(out_dir, filename, role))
    return refs


def copy_model(src: Path, out_dir: Path, rel: str, role: str) -> list[FileRef]:
    """Copy the ONNX file ``src`` to ``out_dir/rel`` with every external-data file it names; return their FileRefs.

    The copied model's entry lists its external data, and each data file is an entry of its own (with its
    sha256), so that loading checks it and the plan's digest covers it.

    Raises:
        ModelLoadError: the model names external data outside its folder, or a data file is missing.
    """
    import onnx

    from dyncompile.errors import ModelLoadError
    from dyncompile.plan.model_bytes import external_tensors

    dst = out_dir / rel
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    proto = onnx.load(str(src), load_external_data=False)
    locs = sorted({e.value for t, _ in external_tensors(proto) for e in t.external_data if e.key == "location"})
    base = rel.rsplit("/", 1)[0] + "/" if "/" in rel else ""
    data = []
    for loc in locs:
        p = Path(loc)
        if p.is_absolute() or ".." in p.parts or not (src.parent / loc).is_file():
            raise ModelLoadError(f"{src} names external data {loc!r}, which is not a file beside it; re-export the model")
        (dst.parent / loc).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src.parent / loc, dst.parent / loc)
        data.append(file_ref(out_dir, base + loc, "external_data"))
    return [file_ref(out_dir, rel, role, [d.path for d in data]), *data]


def _dims(shape) -> list[int | str | None]:
    if shape is None:
        return []
    return [d if isinstance(d, int) else (str(d) if d is not None else None) for d in shape]


def io_signature(graph: ir.Graph) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Name, dtype and dims of the graph's inputs and outputs, for the plan."""
    def sig(v):
        return {"name": v.name, "dtype": str(v.dtype) if v.dtype is not None else None, "shape": _dims(v.shape)}

    return [sig(v) for v in graph.inputs], [sig(v) for v in graph.outputs]


def add_tokenizer(req: EmitRequest, files: dict[str, FileRef]) -> dict[str, Any] | None:
    if req.tokenizer_file is None:
        return None
    shutil.copyfile(req.tokenizer_file, req.out_dir / "tokenizer.json")
    files["tokenizer"] = file_ref(req.out_dir, "tokenizer.json", "tokenizer")
    return {"file": "tokenizer", **(req.tokenizer_spec or {})}


def add_model_files(files: dict[str, FileRef], key: str, refs: list[FileRef]) -> None:
    files[key] = refs[0]
    for i, extra in enumerate(refs[1:]):
        files[f"{key}.data{i if i else ''}"] = extra


@register_emitter("single")
def emit_single(model: ir.Model, req: EmitRequest) -> Plan:
    """One ONNX file, one ``run_model`` step."""
    files: dict[str, FileRef] = {}
    add_model_files(files, "model", save_model(model, req.out_dir, "model.onnx", "main"))
    tok = add_tokenizer(req, files)
    inputs, outputs = io_signature(model.graph)
    policy = prefixed_policies(model)
    if _keys.EARLY_EXIT in model.metadata_props:
        policy["early_exit"] = early_exit_policy(model)
    add_budget_split(policy)
    if req.task in EMBEDDING_TASKS and isinstance(req.model_config.get("pooling"), dict):
        policy.setdefault("pooling", dict(req.model_config["pooling"]))  # sentence-embedding: how to pool
    return Plan(
        task=req.task,
        files=files,
        steps=[Step("run_model", {"model": "model"})],
        inputs=inputs,
        outputs=outputs,
        tokenizer=tok,
        labels=req.labels,
        policy=policy,
        provenance=req.provenance,
    )


def prefixed_policies(model: ir.Model) -> dict[str, Any]:
    """Plan policies a pass recorded as ``dyncompile.policy.NAME`` metadata (JSON text -> JSON value)."""
    import json

    return {k[len(_keys.POLICY_PREFIX) :]: json.loads(v) for k, v in model.metadata_props.items()
            if k.startswith(_keys.POLICY_PREFIX)}


def add_budget_split(policy: dict[str, Any]) -> None:
    """``policy["budget_split"]``: how one ``--budget`` was shared by the int8 search and the exits.

    Set when the plan has both an accuracy-aware int8 search (``policy.quantization``) and a certified early
    exit measured against the fp32 original. Both certificates are computed on the same held-out calibration
    rows (the same seeded split), so the exits' part is the pipeline's observed drop minus int8's own; the one
    promise of the plan is the pipeline's bound (int8 + exits against fp32).
    """
    q, ee = policy.get("quantization"), policy.get("early_exit")
    if not isinstance(q, dict) or not isinstance(ee, dict) or not isinstance(ee.get("certificate"), dict):
        return
    qc, pc = q.get("certificate") or {}, ee["certificate"]
    if qc.get("observed") is None or pc.get("observed") is None:
        return
    same_rows = qc.get("rows") == pc.get("rows")
    policy["budget_split"] = {
        "budget": pc.get("budget"),
        "confidence": pc.get("confidence"),
        "quantization": {"share": q.get("share"), "target": q.get("target_points"), "observed": qc["observed"],
                         "bound": qc.get("bound"), "certified": qc.get("certified"), "fp32_matmuls": len(q.get("excluded") or [])},
        "exits": {"observed": round(pc["observed"] - qc["observed"], 4) if same_rows else None},
        "pipeline": {"observed": pc["observed"], "bound": pc.get("bound"), "certified": pc.get("certified"),
                     "rows": pc.get("rows"), "reference": "fp32 original"},
    }


def early_exit_policy(model: ir.Model) -> dict[str, Any]:
    """The early-exit decisions recorded by the passes, for the plan's ``policy`` (and ``inspect``)."""
    import json

    meta = json.loads(model.metadata_props[_keys.EARLY_EXIT])
    return (
        {k: meta[k] for k in ("criterion", "patience", "num_layers") if k in meta}
        | {
            "lowering": model.metadata_props.get(_keys.EARLY_EXIT_LOWERING),
            "lowering_choice": json.loads(model.metadata_props.get(_keys.EARLY_EXIT_LOWERING_CHOICE, "null")),
            "thresholds": {str(e["layer"]): e["threshold"] for e in meta["exits"]},
        }
        | {k: meta[k] for k in ("certificate", "calibration", "exit_stats", "fit", "exit_policy") if k in meta}
    )


def emit_plan(model: ir.Model, req: EmitRequest) -> Plan:
    """The plan of the compiled ``model``, from the emitter a pass named (else the first default rule that fits)."""
    name = model.metadata_props.get(_keys.EMITTER)
    if name is None:  # e.g. a decoder with KV cache gets a generation plan (`dyncompile run PLAN --prompt ...`)
        name = next((n for rule in DEFAULT_EMITTER_RULES if (n := rule(model, req)) is not None), "single")
    if name not in PLAN_EMITTERS:
        raise ValueError(f"model asks for unknown plan emitter {name!r}; known: {', '.join(PLAN_EMITTERS)}")
    logger.debug("emitting plan with %r", name)
    return PLAN_EMITTERS[name](model, req)
