"""torch.onnx (dynamo) export, ORT-vs-PyTorch checks and tokenizer files for the recipes.

Imports torch / transformers / onnxruntime lazily (inside functions): they are the ``export`` extra.
"""

from __future__ import annotations

import contextlib
import logging
import re
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

    from dyncompile._rule_guard import guarded_default_rules

    module.eval()
    # the exporter's onnxscript optimize() behind the rule guard: the same graph, minutes less on a decoder
    with _quiet_export(), torch.no_grad(), guarded_default_rules():
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




# --------------------------------------------------------------------------------------------- HF folder export

#: files of a Hugging Face folder that travel into the exported folder unchanged (Optimum's layout)
HF_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)
#: sentence-transformers files (with the numbered module folders' JSON configs): the folder stays a sentence embedder
ST_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")
_DECODER_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def _hf_kind(arch: str) -> str:
    """'decoder', 'classifier' or 'encoder' for a transformers class name; RecipeError for anything else."""
    if arch.endswith(_DECODER_SUFFIXES):
        return "decoder"
    if arch.endswith("ForSequenceClassification"):
        return "classifier"
    if arch.endswith("Model") and not arch.endswith("PreTrainedModel"):
        return "encoder"
    raise RecipeError(
        f"config.json names architecture {arch!r}; `dyncompile export` handles *ForSequenceClassification, "
        "*ForCausalLM / *LMHeadModel and base *Model classes (export other heads with optimum-cli export onnx "
        "in its own environment; dyncompile reads that folder)"
    )


def _encoder_input_names(model, src: Path) -> list[str]:
    """input_ids, attention_mask and, where the model and its tokenizer use it, token_type_ids."""
    import inspect
    import json

    names = ["input_ids", "attention_mask"]
    if "token_type_ids" not in inspect.signature(model.forward).parameters:
        return names
    tok_inputs = None
    tc = src / "tokenizer_config.json"
    if tc.is_file():
        tok_inputs = json.loads(tc.read_text(encoding="utf-8")).get("model_input_names")
    if tok_inputs is None:
        use = getattr(model.config, "type_vocab_size", 0) > 1 or model.config.model_type == "bert"
    else:
        use = "token_type_ids" in tok_inputs
    return [*names, "token_type_ids"] if use else names


def _export_encoder(model, kind: str, src: Path, onnx_path: Path) -> tuple[Any, tuple, list[str], list[str]]:
    import torch

    names = _encoder_input_names(model, src)
    out_name = "logits" if kind == "classifier" else "last_hidden_state"

    class Wrapper(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.model = m

        def forward(self, *inputs):
            return getattr(self.model(**dict(zip(names, inputs))), out_name)

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 5), generator=gen)
    args = (ids, torch.ones(2, 5, dtype=torch.int64), *([torch.zeros(2, 5, dtype=torch.int64)] * (len(names) - 2)))
    b, s = torch.export.Dim("batch"), torch.export.Dim("seq")
    wrapper = Wrapper(model).eval()
    export_onnx(wrapper, args, input_names=names, output_names=[out_name],
                dynamic_shapes={"inputs": tuple({0: b, 1: s} for _ in names)},
                out_path=onnx_path, strip_prefix="model.")
    return wrapper, args, names, [out_name]


def _export_decoder(model, onnx_path: Path) -> tuple[Any, tuple, list[str], list[str]]:
    import torch

    from dyncompile.models._decoders import kv_input_names, kv_output_names, make_kv_wrapper

    cfg = model.config
    num_layers = cfg.num_hidden_layers
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    wrapper = make_kv_wrapper(model, num_layers)
    b, s, p = 2, 4, 3
    gen = torch.Generator().manual_seed(0)
    args = (
        torch.randint(0, cfg.vocab_size, (b, s), generator=gen),
        torch.ones(b, p + s, dtype=torch.int64),
        torch.arange(p, p + s).unsqueeze(0).expand(b, s).contiguous(),
        *(torch.randn(b, kv_heads, p, head_dim, generator=gen) for _ in range(2 * num_layers)),
    )
    batch, seq, past, total = (torch.export.Dim(n) for n in ("batch", "seq", "past", "past_plus_seq"))
    dyn = {
        "input_ids": {0: batch, 1: seq},
        "attention_mask": {0: batch, 1: total},
        "position_ids": {0: batch, 1: seq},
        "past": tuple({0: batch, 2: past} for _ in range(2 * num_layers)),
    }
    names = ["input_ids", "attention_mask", "position_ids", *kv_input_names(num_layers)]
    outs = ["logits", *kv_output_names(num_layers)]
    export_onnx(wrapper, args, input_names=names, output_names=outs, dynamic_shapes=dyn, out_path=onnx_path,
                strip_prefix="model.")
    return wrapper, args, names, outs


def check_hf_folder(src: Path, out: Path) -> tuple[str, str]:
    """Check ``src`` is a Hugging Face folder of a head ``dyncompile export`` handles and ``out`` is new.

    Returns (architecture, kind); raises RecipeError otherwise. Needs no export stack.
    """
    import json

    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise RecipeError(f"{src} has no config.json: give a Hugging Face model folder (save_pretrained output)")
    if out.exists():
        raise RecipeError(f"{out} exists; give a new folder (dyncompile export does not overwrite)")
    try:
        archs = json.loads(cfg_path.read_text(encoding="utf-8")).get("architectures") or []
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise RecipeError(f"{cfg_path} is not a JSON object: {e}") from None
    if not archs or not isinstance(archs[0], str):
        raise RecipeError(f"{cfg_path} names no architectures; add e.g. \"architectures\": [\"BertModel\"]")
    arch = archs[0]
    kind = _hf_kind(arch)
    return arch, kind


def export_hf_folder(src: Path, out: Path) -> dict[str, Any]:
    """Export a Hugging Face model folder (config.json + weights + tokenizer files) into an Optimum-style folder.

    ``out`` gets ``model.onnx`` (Optimum's input/output names; decoders with a KV cache) beside the folder's
    config, generation config and tokenizer files. The export is checked against PyTorch in ONNX Runtime and
    written atomically (a temporary folder renamed into place); ``out`` must not exist. Returns a summary.
    """
    import os
    import shutil
    import tempfile

    require_export_stack()
    import numpy as np
    import torch
    import transformers

    arch, kind = check_hf_folder(src, out)
    cls = getattr(transformers, arch, None)
    if cls is None:
        raise RecipeError(f"transformers {transformers.__version__} has no class {arch!r} (from {src / 'config.json'})")
    try:
        model = cls.from_pretrained(str(src)).eval()
    except (OSError, ValueError) as e:
        raise RecipeError(f"cannot load {src} as {arch}: {e}") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        onnx_path = tmp / "model.onnx"
        if kind == "decoder":
            wrapper, args, names, outs = _export_decoder(model, onnx_path)
        else:
            wrapper, args, names, outs = _export_encoder(model, kind, src, onnx_path)
        with torch.no_grad():
            want = wrapper(*args)
        want = want if isinstance(want, tuple) else (want,)
        sess = ort_session(onnx_path)
        got = sess.run(outs, {n: a.numpy() for n, a in zip(names, args)})
        diff = max(float(np.max(np.abs(g - w.numpy()))) for g, w in zip(got, want))
        tol = decoder_tolerance(float(want[0].abs().max())) if kind == "decoder" else LOGITS_TOLERANCE
        if diff > tol:
            raise RecipeError(f"the ONNX export of {arch} differs from PyTorch by {diff:.3g} (> {tol:.3g})")
        for name in HF_SIDE_FILES + ST_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, tmp / name)
        for sub in src.iterdir():  # sentence-transformers module folders (1_Pooling, 2_Normalize): configs only
            if sub.is_dir() and re.fullmatch(r"\d+_\w+", sub.name):
                (tmp / sub.name).mkdir()
                for f in sub.glob("*.json"):
                    shutil.copy2(f, tmp / sub.name / f.name)
        if kind == "decoder" and not (tmp / "generation_config.json").exists():
            model.generation_config.save_pretrained(str(tmp))
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("exported %s (%s) to %s; ORT vs PyTorch max |diff| %.3g", arch, kind, out, diff)
    return {"architecture": arch, "kind": kind, "inputs": names, "outputs": outs, "max_abs_diff": diff}
