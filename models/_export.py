"""torch.onnx (dynamo) export, ORT-vs-PyTorch checks and tokenizer files for the recipes.

Imports torch / transformers / onnxruntime lazily (inside functions): they are the ``export`` extra.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from dyncompile.models._core import RecipeError

logger = logging.getLogger("dyncompile.models")

OPSET = 18
EXPORT_TOOL = "torch.onnx.export(dynamo=True)"
LOGITS_TOLERANCE = 1e-4
# Decoders: logits reach |40| and 30 fp32 layers accumulate round-off; for SmolLM2 PyTorch fp32 itself is
# 9e-5 away from an fp64 run and ORT 1.4e-4, so the absolute bound is scaled with the logit magnitude.
DECODER_RELATIVE_TOLERANCE = 1e-5


def decoder_tolerance(max_abs_logit: float) -> float:
    """max(1e-4, 1e-5 * max|logits|): the fp32 noise floor of a deep decoder grows with the logit scale."""
    return max(LOGITS_TOLERANCE, DECODER_RELATIVE_TOLERANCE * float(max_abs_logit))


def _require(module: str, extra: str = "export"):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise RecipeError(
            f"building models needs the Python package {module!r} ({e}); install the extras: "
            f"pip install 'dyncompile[{extra},cpu]' (torch==2.13.0 first for a CPU-only build)"
        ) from None


def require_export_stack() -> None:
    for mod in ("torch", "transformers", "onnxscript", "onnxruntime", "safetensors"):
        _require(mod)


@contextlib.contextmanager
def _quiet_export() -> Iterator[None]:
    """Keep the exporter's warnings (deprecations, axis renames, torchvision absence) out of the user's way."""
    torch_logs = [
        logging.getLogger(n)
        for n in (
            "torch.onnx",
            "torch.onnx._internal.exporter._registration",
            "torch._export",
            "torch.export",
            "onnx_ir",
            "onnxscript",
        )
    ]
    levels = [lg.level for lg in torch_logs]
    for lg in torch_logs:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, lv in zip(torch_logs, levels):
            lg.setLevel(lv)


def versions() -> dict[str, str]:
    import onnx
    import onnxruntime
    import onnxscript
    import torch
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "onnx": onnx.__version__,
        "onnxscript": onnxscript.__version__,
        "onnxruntime": onnxruntime.__version__,
    }


def export_onnx(
    module,
    args: tuple,
    *,
    input_names: Sequence[str],
    output_names: Sequence[str],
    dynamic_shapes: Any,
    out_path: Path,
    strip_prefix: str | None = None,
    external_data: bool = False,
) -> dict[str, Any]:
    """Export ``module(*args)`` with ``torch.onnx.export(dynamo=True, opset_version=18)`` to ``out_path``.

    ``strip_prefix`` is removed from initializer names so that they equal the Hugging Face parameter names
    (the wrapper module adds its attribute name in front). Returns facts for the provenance record.
    """
    import torch

    module.eval()
    with _quiet_export(), torch.no_grad():
        prog = torch.onnx.export(
            module,
            args,
            dynamic_shapes=dynamic_shapes,
            input_names=list(input_names),
            output_names=list(output_names),
            dynamo=True,
            opset_version=OPSET,
            external_data=external_data,
            verbose=False,
            report=False,
        )
    if prog is None:  # pragma: no cover - only when dynamo=False
        raise RecipeError("torch.onnx.export returned no program")
    graph = prog.model.graph
    renamed = 0
    if strip_prefix:
        for name in list(graph.initializers):
            if name.startswith(strip_prefix):
                new = name[len(strip_prefix) :]
                if new not in graph.initializers:
                    graph.initializers[name].name = new
                    renamed += 1
    got_in = [v.name for v in graph.inputs]
    got_out = [v.name for v in graph.outputs]
    if got_in != list(input_names) or got_out != list(output_names):
        raise RecipeError(
            f"exported graph has inputs {got_in[:5]}... / outputs {got_out[:5]}..., expected "
            f"{list(input_names)[:5]}... / {list(output_names)[:5]}..."
        )
    prog.model.producer_name = "dyncompile.models"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with _quiet_export():
        prog.save(str(out_path), external_data=external_data)
    n_nodes = sum(1 for _ in graph)
    logger.info(
        "exported %s: %d nodes, %d initializers (renamed %d)",
        out_path.name,
        n_nodes,
        len(graph.initializers),
        renamed,
    )
    return {"nodes": n_nodes, "initializers": len(graph.initializers)}


def ort_session(path: Path, threads: int | None = None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = threads
    so.log_severity_level = 3
    # a check session only: no prepacked second copy of every weight (a 1.5B fp32 decoder would need ~2x its
    # 6 GB and the recipe was OOM-killed at its greedy check on a 24 GB machine); outputs are unchanged
    so.add_session_config_entry("session.disable_prepacking", "1")
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


_DTYPE_NAMES = {1: "float32", 10: "float16", 16: "bfloat16", 11: "float64", 7: "int64", 6: "int32", 9: "bool"}


def onnx_io(path: Path) -> dict[str, Any]:
    """Names, element types and symbolic shapes of the model's graph inputs/outputs (read without weights)."""
    import onnx

    m = onnx.load(str(path), load_external_data=False)

    def desc(v) -> dict[str, Any]:
        t = v.type.tensor_type
        dims = [
            d.dim_param if d.HasField("dim_param") else (d.dim_value if d.HasField("dim_value") else None)
            for d in t.shape.dim
        ]
        return {
            "name": v.name,
            "dtype": _DTYPE_NAMES.get(t.elem_type, onnx.TensorProto.DataType.Name(t.elem_type).lower()),
            "shape": dims,
        }

    return {"inputs": [desc(v) for v in m.graph.input], "outputs": [desc(v) for v in m.graph.output]}


# --------------------------------------------------------------------------------------------- tokenizers


def write_tokenizer_json(
    backend_tokenizer,
    dest: Path,
    *,
    truncation: int | None,
    pad_longest: bool,
    pad_id: int | None = None,
    pad_token: str | None = None,
) -> None:
    """Save a ``tokenizers.Tokenizer`` with explicit truncation/padding settings (none baked in otherwise).

    The asset tokenizers carry ``Fixed(128)`` padding and truncation 128 from their base models; the
    classifiers were fine-tuned at 64, so the saved file truncates at 64 and pads to the longest in a batch.
    """
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(backend_tokenizer.to_str())
    tok.no_truncation()
    tok.no_padding()
    if truncation:
        tok.enable_truncation(max_length=truncation)
    if pad_longest:
        if pad_id is None or pad_token is None:
            raise RecipeError("pad_longest needs pad_id and pad_token")
        tok.enable_padding(pad_id=pad_id, pad_token=pad_token)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(dest))


def verify_tokenizer(
    hf_tokenizer,
    tokenizer_json: Path,
    texts: Sequence[str],
    *,
    max_length: int | None,
    fields: Sequence[str] = ("input_ids", "attention_mask"),
) -> dict[str, Any]:
    """Check that ``tokenizers.Tokenizer.from_file(tokenizer_json)`` reproduces the transformers tokenizer.

    Encodes each text alone (no padding) with both and compares ``fields``; raises RecipeError on the first
    difference. Returns a summary for the provenance record.
    """
    from tokenizers import Tokenizer

    fast = Tokenizer.from_file(str(tokenizer_json))
    fast.no_padding()
    kw: dict[str, Any] = {"truncation": True, "max_length": max_length} if max_length else {}
    for i, text in enumerate(texts):
        ref = hf_tokenizer(text, **kw)
        enc = fast.encode(text)
        got = {"input_ids": enc.ids, "attention_mask": enc.attention_mask, "token_type_ids": enc.type_ids}
        for f in fields:
            if list(ref[f]) != list(got[f]):
                raise RecipeError(
                    f"tokenizer.json disagrees with the transformers tokenizer on text #{i} ({text[:60]!r}) "
                    f"field {f}: {list(ref[f])[:12]} vs {list(got[f])[:12]}"
                )
    logger.info("tokenizer.json reproduces the transformers tokenizer on %d texts", len(texts))
    return {"texts": len(texts), "fields": list(fields), "max_length": max_length, "identical": True}


