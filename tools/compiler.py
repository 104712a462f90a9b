"""``dyncompile MODEL.onnx --passes ... -o OUT``: load, run the pass pipeline, emit a plan atomically."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import dyncompile
import onnx_ir as ir
from dyncompile.errors import DataError, ModelLoadError, OutputExistsError, PassConfigError
from dyncompile.passes import CompileContext, PipelineResult, build_passes, run_pipeline
from dyncompile.passes._emit import EmitRequest, emit_plan
from dyncompile.runtime.plan import Plan, save_plan, sha256_file

logger = logging.getLogger(__name__)

__all__ = ["CompileResult", "compile_model", "load_input_model", "read_model_config", "atomic_output_dir"]

MODEL_CONFIG_NAME = "dyncompile-model.json"


def load_input_model(path: str | Path) -> ir.Model:
    """Load an ONNX model for compilation, turning every way it can be bad into one clear error."""
    import onnx
    from google.protobuf.message import DecodeError

    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"model file not found: {p} (build one with `dyncompile models build minilm-l6-sentiment`)")
    if p.is_dir():
        hint = [c.name for c in p.glob("*.onnx")]
        raise ModelLoadError(
            f"{p} is a directory, not an ONNX file" + (f"; did you mean {p / hint[0]}?" if hint else "")
        )
    size = p.stat().st_size
    if size == 0:
        raise ModelLoadError(f"{p} is empty (0 bytes); re-export the model")
    try:
        proto = onnx.load(str(p), load_external_data=False)
    except (DecodeError, RuntimeError, ValueError, OSError) as e:
        raise ModelLoadError(
            f"{p} is not a valid ONNX model: the protobuf does not parse ({type(e).__name__}: {e}). If it is an "
            "ONNX file, it is probably truncated or corrupted (an interrupted copy/download): re-export it"
        ) from None
    if not proto.graph.node or not proto.opset_import:
        raise ModelLoadError(
            f"{p} parses as protobuf but is not a usable ONNX model (graph has {len(proto.graph.node)} nodes, "
            f"{len(proto.opset_import)} opset imports): it is either not ONNX or truncated; re-export it"
        )
    for init in proto.graph.initializer:
        for entry in init.external_data:
            if entry.key == "location" and not (p.parent / entry.value).is_file():
                raise ModelLoadError(
                    f"{p} stores weights in external data file {entry.value!r}, which is missing next to it "
                    f"({p.parent / entry.value}); copy it beside the model"
                )
    try:
        model = ir.load(str(p))
    except Exception as e:  # onnx-ir deserialisation errors
        raise ModelLoadError(f"{p}: onnx-ir could not read the model ({type(e).__name__}: {e})") from None
    return model


def read_model_config(model_path: Path, explicit: str | Path | None = None) -> dict[str, Any]:
    """The ``dyncompile-model.json`` written by ``dyncompile models build`` (beside the model), if any."""
    cfg_path = Path(explicit) if explicit else model_path.parent / MODEL_CONFIG_NAME
    if not cfg_path.is_file():
        if explicit:
            raise DataError(f"model config {cfg_path} not found")
        return {}
    try:
        return json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{cfg_path} is not valid JSON: {e}") from None


@contextlib.contextmanager
def atomic_output_dir(out_dir: str | Path, *, force: bool = False):
    """Yield a temp dir beside ``out_dir``; on success it replaces ``out_dir`` in one rename.

    Refuses an existing ``out_dir`` unless ``force``; on any error the temp dir is removed and
    ``out_dir`` is left exactly as it was.
    """
    out = Path(out_dir).resolve()
    if out.exists() and not force:
        raise OutputExistsError(f"output directory {out} already exists; pass --force to replace it")
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"output path {out} exists and is not a directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes 0700; a plan directory gets the permissions mkdir would give
    try:
        yield tmp
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


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
