"""``dyncompile MODEL.onnx --passes ... -o OUT``: load, run the pass pipeline, emit a plan atomically."""

from __future__ import annotations

import dataclasses
import datetime
import logging
from pathlib import Path
from typing import Any

import onnx_ir as ir

from dyncompile._version import __version__
from dyncompile.errors import DataError, ModelLoadError, PassConfigError, PlanError
from dyncompile.io import (
    MODEL_CONFIG_NAME,
    atomic_output_dir,
    check_output_dir,
    load_input_model,
    read_model_config,
    sha256_file,
    temp_files_inside,
)
from dyncompile.passes import CompileContext, PipelineResult, _keys, run_pipeline
from dyncompile.passes.analysis.hf_metadata import hf_model_config, resolve_model_dir
from dyncompile.passes.emit import EmitRequest, emit_plan
from dyncompile.passes.presets import DEFAULT_OPT_LEVEL, EffectivePipeline, resolve
from dyncompile.plan import Plan, load_plan, save_plan

logger = logging.getLogger(__name__)

__all__ = ["CompileResult", "compile_model", "model_config_of"]

@dataclasses.dataclass
class CompileResult:
    """What a compile produced: the plan directory, the plan and the pipeline's per-pass record."""
    plan_dir: Path
    plan: Plan
    pipeline: PipelineResult

    def summary(self) -> str:
        """Lines for the CLI: the plan file, each pass's time and ``modified``, the plan's files."""
        lines = [f"plan written to {self.plan_dir}/plan.json ({self.plan.format})"]
        for rec in self.pipeline.records:
            lines.append(f"  {rec.name:<28} {rec.seconds:7.2f} s  modified={rec.modified}")
        for key, f in self.plan.files.items():
            lines.append(f"  file {key:<16} {f.path} ({f.role})")
        return "\n".join(lines)


def compile_model(
    model_path: str | Path,
    passes: str | list = "verify,cleanup",
    output_dir: str | Path | None = None,
    *,
    force: bool = False,
    verify: bool = False,
    dump_ir: str | Path | None = None,
    tokenizer: str | Path | None = None,
    model_config: str | Path | None = None,
    progress: bool = True,
    opt_level: int = DEFAULT_OPT_LEVEL,
    **options: Any,
) -> CompileResult:
    """Compile ``model_path`` with the pass pipeline ``passes`` into the plan directory ``output_dir``.

    Args:
        model_path: input ONNX file (never modified).
        passes: comma-separated pass names, each optionally with ``{key=value,...}`` options, or a list
            of onnx-ir pass instances.
        output_dir: plan directory to create (default: ``<model dir>/<model stem>-compiled``).
        force: replace an existing output directory.
        verify: run the ONNX checker after every pass (default: once at the end).
        dump_ir: write the IR after each pass into this directory (``NNN_PassName.onnx.txt``).
        tokenizer: ``tokenizer.json`` to bundle (default: the one beside the model, if any).
        model_config: ``dyncompile-model.json`` (default: the one beside the model, if any).
        progress: show progress bars on long work.
        opt_level: 0 runs exactly ``passes``; 1 and 2 (default) also insert the lowering passes that pay on
            ``provider`` for this kind of model (:mod:`dyncompile.passes.presets`; the plan records them).
        **options: pass inputs such as ``calib=``, ``budget=``, ``drafter=`` (see ``dyncompile --help``).
    """
    model_path = Path(model_path)
    unknown = sorted(set(options) - COMPILE_OPTIONS)
    if unknown:
        raise PassConfigError(
            f"unknown compile option {unknown[0]!r}; valid options: {', '.join(sorted(COMPILE_OPTIONS))} (pass "
            "options go into the pass spec, e.g. 'early-exit{budget=1.0}')"
        )
    folder_input = model_path.is_dir() and not (model_path / "model_index.json").is_file()
    model_path = resolve_model_dir(model_path)  # a Hugging Face / Optimum model folder: its model.onnx
    if folder_input and not output_dir:
        output_dir = model_path.parent.parent / f"{model_path.parent.name}-compiled"
    if model_path.is_dir():  # a diffusers-style pipeline folder: the passes run on its U-Net
        from dyncompile.passes.step_saver.pipeline import pipeline_compile_inputs

        model_path, output_dir, options = pipeline_compile_inputs(model_path, output_dir, options)
    out = Path(output_dir) if output_dir else model_path.parent / f"{model_path.stem}-compiled"
    protect = tuple(
        p for p in (model_path, tokenizer, model_config, options.get("calib"), options.get("drafter")) if p
    )
    check_output_dir(out, force=force, protect=protect)  # fail before any expensive work
    if model_path.exists() and out.resolve() == model_path.parent.resolve():
        raise PassConfigError(f"output directory {out} is the input model's directory; choose another -o")
    cfg = model_config_of(model_path, model_config)
    tok_path = Path(tokenizer) if tokenizer else model_path.parent / "tokenizer.json"
    if tokenizer and not tok_path.is_file():
        raise DataError(f"tokenizer file {tok_path} not found")
    if tok_path.is_file():
        check_tokenizer_file(tok_path)
    context = CompileContext(model_path=model_path, model_config=cfg, options=dict(options), progress=progress,
                             tokenizer=tok_path if tok_path.is_file() else None)
    pipeline = resolve(passes, context, opt_level)  # unknown names and options, bad order: fail here, before loading
    pass_list = pipeline.build(context)
    model = load_input_model(model_path)
    check_runnable_ops(model, model_path)
    source_sha = sha256_file(model_path)
    with atomic_output_dir(out, force=force, protect=protect) as tmp:
        # temp copies made by passes (quantizers) go inside the staging folder, never anonymous in /tmp
        with temp_files_inside(tmp / ".work"):
            result = run_pipeline(pass_list, model, check="each" if verify else None, dump_dir=dump_ir)
            plan = _emit(result, model_path, cfg, tok_path, source_sha, pass_list, options, tmp, pipeline)
    plan.directory = out
    logger.info("wrote plan %s", out / "plan.json")
    return CompileResult(out, plan, result)


def model_config_of(model_path: Path, explicit: str | Path | None = None) -> dict[str, Any]:
    """What the compile knows of the model.

    The Hugging Face files beside it (:func:`~dyncompile.passes.analysis.hf_metadata.hf_model_config`),
    overridden field by field by its ``dyncompile-model.json`` (``explicit``, else the one beside the model).
    """
    return {**hf_model_config(model_path), **read_model_config(model_path, explicit)}


def _emit(result, model_path: Path, cfg, tok_path: Path, source_sha: str, pass_list, options, tmp: Path,
          pipeline: EffectivePipeline) -> Plan:
    task = result.model.metadata_props.get(_keys.TASK) or cfg.get("task") or "unknown"
    tok_spec = None
    if tok_path.is_file():
        tok_spec = {"max_length": int(cfg.get("max_length", 512)), "padding": "longest"}
    req = EmitRequest(
        out_dir=Path("."),
        task=task,
        tokenizer_file=tok_path if tok_path.is_file() else None,
        tokenizer_spec=tok_spec,
        labels=cfg.get("labels"),
        provenance={
            "source": {"path": str(model_path.resolve()), "sha256": source_sha},
            "model_config": {k: cfg[k] for k in ("name", "family", "num_layers", "hidden_size") if k in cfg},
            "passes": [repr(p) for p in pass_list],
            "pipeline": pipeline.provenance(),
            "pass_seconds": {r.name: round(r.seconds, 4) for r in result.records},
            "dyncompile": __version__,
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        },
        options=dict(options),
        model_config=cfg,
    )
    req.out_dir = tmp
    plan = emit_plan(result.model, req)
    _record_custom_ops(result.model, plan)
    _record_ort_session(plan, pipeline.provider)
    save_plan(plan, tmp)
    try:  # never publish a plan the runtime would refuse (e.g. a bad field copied from the model config)
        load_plan(tmp, verify_hashes=False)
    except PlanError as e:
        raise PlanError(f"the compiled plan does not validate, nothing written: {e} (check {MODEL_CONFIG_NAME})") from None
    return plan


def _record_ort_session(plan: Plan, provider: str) -> None:
    """An encoder plan for the CPU EP names the ORT fusions that are slow with this ONNX Runtime (``policy.ort_session``).

    The answer is :func:`~dyncompile.runtime.providers.slow_cpu_fusions`'s, the same one the compile's
    calibration sessions used, so the plan's certificate was made on the numerics its sessions run with.
    """
    from dyncompile.runtime.providers import ENCODER_TASKS, slow_cpu_fusions

    if plan.task not in ENCODER_TASKS or provider != "cpu":
        return
    rec = slow_cpu_fusions()
    if rec["disabled_optimizers"]:
        plan.policy["ort_session"] = {k: rec[k] for k in ("disabled_optimizers", "measured_us", "onnxruntime")}


def _record_custom_ops(model: ir.Model, plan: Plan) -> None:
    """A plan whose target or drafter holds dyncompile's own custom ops names them in ``policy.custom_ops``.

    The plan never carries the library: the runtime builds it from the installed package's C sources and refuses a
    plan compiled against other sources. Building it here first makes a missing compiler an error at compile
    time. The ``sparsify-activations`` records go to ``policy.sparsity`` (target) and ``policy.drafter_sparsity``
    (a sparse model drafter).
    """
    import json

    import dyncompile.runtime.kernels as kernels
    from dyncompile.passes._graph import custom_ops_of
    from dyncompile.passes.sparsify_activations import SPARSITY, uses_sparse_rows
    from dyncompile.plan.decode import SparsityPolicy  # the fields the plan's schema takes from the record

    drafter = model.meta.get(_keys.DRAFTER_MODEL)
    graphs = {"sparsity": model, "drafter_sparsity": drafter if isinstance(drafter, ir.Model) else None}
    ops = sorted({op for m in graphs.values() if m is not None for op in custom_ops_of(m)})
    if not ops:
        return
    kernels.library()
    plan.policy["custom_ops"] = {"ops": ops, "source_sha256": kernels.source_sha256()}
    for key, m in graphs.items():
        rec = m.metadata_props.get(SPARSITY) if m is not None and uses_sparse_rows(m) else None
        if rec:
            r = json.loads(rec)
            plan.policy[key] = {f.name: r[f.name] for f in dataclasses.fields(SparsityPolicy) if f.name in r}


COMPILE_OPTIONS = frozenset(
    {"calib", "budget", "confidence", "exits", "criterion", "lowering", "never_exit", "drafter", "provider", "heads",
     "batch_sizes", "metric", "train_text"}
)
"""Keyword options of :func:`compile_model` (the CLI's pass flags); anything else is an error."""

_ORT_DOMAINS = frozenset(
    {"", "ai.onnx", "ai.onnx.ml", "com.microsoft", "com.microsoft.nchwc", "com.ms.internal.nhwc",
     "ai.onnx.training", "ai.onnx.preview.training", "com.microsoft.experimental"}
)


def check_runnable_ops(model: ir.Model, where: Path) -> None:
    """Refuse a model with an op of a domain ONNX Runtime does not implement and the model does not define."""
    local = {(f.domain, f.name) for f in model.functions.values()}
    for graph in [model.graph, *(f.graph for f in model.functions.values())]:
        for node in ir.traversal.RecursiveGraphIterator(graph):
            if node.domain not in _ORT_DOMAINS and (node.domain, node.op_type) not in local:
                raise ModelLoadError(
                    f"{where}: node {node.name or node.op_type!r} uses op {node.op_type!r} of domain {node.domain!r}, "
                    "which ONNX Runtime does not implement and the model does not define as a function; a plan of "
                    "it could never run — export the model with standard ONNX ops"
                )


def check_tokenizer_file(path: Path) -> None:
    """``path`` must be a tokenizer.json the tokenizers library reads (the runtime will need it)."""
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise DataError(
            f"{path} is not a tokenizer.json the tokenizers library can read ({first}); give the model's "
            "tokenizer.json with --tokenizer"
        ) from None
