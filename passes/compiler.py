"""``dyncompile MODEL.onnx --passes ... -o OUT``: load, run the pass pipeline, emit a plan atomically."""

from __future__ import annotations

import dataclasses
import datetime
import logging
from pathlib import Path
from typing import Any

import dyncompile
from dyncompile.errors import DataError, OutputExistsError, PassConfigError
from dyncompile.io import atomic_output_dir, load_input_model, read_model_config, sha256_file
from dyncompile.passes import CompileContext, PipelineResult, build_passes, run_pipeline
from dyncompile.passes.emit import EmitRequest, emit_plan
from dyncompile.plan import Plan, save_plan

logger = logging.getLogger(__name__)

__all__ = ["CompileResult", "compile_model"]

@dataclasses.dataclass
class CompileResult:
    plan_dir: Path
    plan: Plan
    pipeline: PipelineResult

    def summary(self) -> str:
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
        **options: pass inputs such as ``calib=``, ``budget=``, ``drafter=`` (see ``dyncompile --help``).
    """
    model_path = Path(model_path)
    if model_path.is_dir():  # a diffusers-style pipeline folder: the passes run on its U-Net
        from dyncompile.passes.step_saver.pipeline import pipeline_compile_inputs

        model_path, output_dir, options = pipeline_compile_inputs(model_path, output_dir, options)
    out = Path(output_dir) if output_dir else model_path.parent / f"{model_path.stem}-compiled"
    if out.exists() and not force:  # fail before any expensive work
        raise OutputExistsError(f"output directory {out.resolve()} already exists; pass --force to replace it")
    if model_path.exists() and out.resolve() == model_path.parent.resolve():
        raise PassConfigError(f"output directory {out} is the input model's directory; choose another -o")
    cfg = read_model_config(model_path, model_config)
    context = CompileContext(model_path=model_path, model_config=cfg, options=dict(options), progress=progress)
    pass_list = build_passes(passes, context)  # unknown names fail here, before loading
    model = load_input_model(model_path)
    source_sha = sha256_file(model_path)
    result = run_pipeline(pass_list, model, check="each" if verify else None, dump_dir=dump_ir)

    tok_path = Path(tokenizer) if tokenizer else model_path.parent / "tokenizer.json"
    if tokenizer and not tok_path.is_file():
        raise DataError(f"tokenizer file {tok_path} not found")
    task = result.model.metadata_props.get("dyncompile.task") or cfg.get("task") or "unknown"
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
            "pass_seconds": {r.name: round(r.seconds, 4) for r in result.records},
            "dyncompile": dyncompile.__version__,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        },
        options=dict(options),
        model_config=cfg,
    )
    with atomic_output_dir(out, force=force) as tmp:
        req.out_dir = tmp
        plan = emit_plan(result.model, req)
        save_plan(plan, tmp)
    plan.directory = out
    logger.info("wrote plan %s", out / "plan.json")
    return CompileResult(out, plan, result)
