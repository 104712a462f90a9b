"""``float16``: run a KV decoder in half precision (weights, activations and KV cache), logits stay float32.

ONNX Runtime's CUDA ``GroupQueryAttention`` has float16/bfloat16 kernels only, and half-precision weights halve
the bytes every decode step reads; onnxruntime-genai's CUDA models are float16 for both reasons. This is that
conversion for a dyncompile decoder graph, done on the IR so external weights convert one tensor at a time:

* Scope: the main graph of a KV-cache decoder (one :func:`~dyncompile.passes.speculative.decoder_spec.decoder_spec`
  accepts) with float32 past inputs. A graph holding an op ONNX Runtime's own converter keeps in float32
  (``onnxruntime.transformers.float16.DEFAULT_OP_BLOCK_LIST``: ``Range``, ``TopK``, ``CumSum`` ...) on a float
  tensor is left alone with a reason, as is a graph already in float16 (a second run reports ``modified=False``).
* Rewrite: every float32 initializer, ``Constant`` / ``ConstantOfShape`` value and value type becomes float16
  (values clipped to float16's finite range, as ORT's converter does), every ``Cast(to=FLOAT)`` casts to FLOAT16,
  the past/present KV tensors become float16 (the plan's ``kv_dtype``); the ``logits`` output and any further
  float outputs (an EAGLE-3 target's ``features``) keep their float32 type through a final ``Cast``.
* Invariants: input and output names unchanged; outputs equal the float32 graph's within float16 round-off (not
  bit-exact: this is a lossy pass, measured by ``dyncompile bench quality`` like quantization, and never
  inserted by an ``-O`` preset); greedy speculative decoding stays token-identical to the float16 target alone.
* Order: after the passes that rewrite the graph (``fuse-decoder``, ``pack-matmuls``, ``causal-attention``,
  ``trim-logits``, ``eagle-drafter``), before ``speculative`` (which times verification on the final graph).
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from dyncompile.passes._infra import not_fired, register_pass

logger = logging.getLogger(__name__)

__all__ = ["CastFloat16Pass"]

_F32, _F16 = ir.DataType.FLOAT, ir.DataType.FLOAT16
_LIMIT = float(np.finfo(np.float16).max)
#: ops ONNX Runtime's float16 converter keeps in float32 (onnxruntime.transformers.float16.DEFAULT_OP_BLOCK_LIST)
_BLOCKED = {
    "ArrayFeatureExtractor", "Binarizer", "CastMap", "CategoryMapper", "DictVectorizer", "FeatureVectorizer", "Imputer",
    "LabelEncoder", "LinearClassifier", "LinearRegressor", "Normalizer", "OneHotEncoder", "RandomUniformLike",
    "SVMClassifier", "SVMRegressor", "Scaler", "TreeEnsembleClassifier", "TreeEnsembleRegressor", "TreeEnsemble",
    "ZipMap", "NonMaxSuppression", "TopK", "RoiAlign", "Range", "CumSum", "Min", "Max", "Upsample",
}


def _half(a: np.ndarray) -> np.ndarray:
    return np.clip(a, -_LIMIT, _LIMIT).astype(np.float16)


def _half_tensor(t: ir.TensorProtocol, name: str | None) -> ir.Tensor:
    return ir.tensor(_half(t.numpy()), name=name)


def _is_f32(v: ir.Value | None) -> bool:
    return v is not None and v.type is not None and isinstance(v.type, ir.TensorType) and v.dtype == _F32


class CastFloat16Pass(ir.passes.InPlacePass):
    """Convert a KV decoder to float16 (weights, activations, KV cache); float32 logits and extra outputs."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    @staticmethod
    def _why_not(model: ir.Model) -> tuple[str | None, bool, dict | None]:
        """(why the pass leaves ``model`` alone or None, whether it is done already, the decoder spec if any)."""
        from dyncompile.passes.speculative.decoder_spec import decoder_spec

        try:
            spec = decoder_spec(model, "model")
        except Exception as e:  # noqa: BLE001 - not a KV decoder
            return f"not a KV-cache decoder ({str(e)[:80]})", False, None
        if spec["kv_dtype"] == "float16":
            return "the KV cache is float16 already", True, spec
        blocked = sorted({n.op_type for n in model.graph if n.op_type in _BLOCKED and any(_is_f32(v) for v in n.inputs)})
        if blocked:
            return f"{', '.join(blocked)} on float tensors (ONNX Runtime keeps those ops in float32)", False, spec
        if any(a.type == ir.AttributeType.GRAPH for n in model.graph for a in n.attributes.values()):
            return "the graph has subgraphs (If/Loop): only flat decoder graphs are converted", False, spec
        return None, False, spec

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Run the conversion on ``model`` (scope and invariants: the module docstring)."""
        why, done, spec = self._why_not(model)
        if done:
            logger.info("float16: nothing to do: %s", why)
            return ir.passes.PassResult(model, modified=False)
        if why is not None:
            return not_fired(model, "float16", why, "leave float16 out for this model")
        graph = model.graph
        presents = {e["present"] for e in spec["kv"]}
        keep = [v for v in graph.outputs if _is_f32(v) and v.name not in presents]
        for name, v in list(graph.initializers.items()):
            if v.const_value is not None and v.const_value.dtype == _F32:
                v.const_value = _half_tensor(v.const_value, name)
                v.type = ir.TensorType(_F16)
        converted = 0
        for node in graph:
            if node.op_type == "Cast" and node.attributes.get_int("to") == _F32:
                node.attributes["to"] = ir.AttrInt64("to", int(_F16))
            elif node.op_type in ("Constant", "ConstantOfShape"):
                attr = node.attributes.get("value")
                if attr is not None and attr.type == ir.AttributeType.TENSOR and attr.value.dtype == _F32:
                    node.attributes["value"] = ir.AttrTensor("value", _half_tensor(attr.value, attr.value.name))
            for v in node.outputs:
                if _is_f32(v):
                    v.type = ir.TensorType(_F16)
                    converted += 1
        for v in graph.inputs:
            if _is_f32(v):
                v.type = ir.TensorType(_F16)
        for out in keep:  # float32 again at the output: out.name is kept by the Cast's output
            i = graph.outputs.index(out)
            name = out.name
            out.name = f"{name}.float16"
            cast = ir.node("Cast", [out], attributes={"to": _F32}, name=f"float16/{name}/Cast")
            res = cast.outputs[0]
            res.name, res.type, res.shape = name, ir.TensorType(_F32), out.shape
            graph.append(cast)
            graph.outputs[i] = res
        logger.info("float16: %d initializers and %d values in float16; %s float32", len(graph.initializers),
                    converted, ", ".join(v.name for v in keep) or "no output")
        return ir.passes.PassResult(model, modified=True)


@register_pass(
    "float16",
    help="decoder: weights, activations and KV cache in float16, logits float32 (lossy: measure with "
    "`dyncompile bench quality`); what ORT's CUDA attention kernels need",
    after=("explicit-attention", "fuse-decoder", "pack-matmuls", "causal-attention", "trim-logits", "eagle-drafter"),
    before=("speculative",),
)
def _make_float16(context) -> CastFloat16Pass:
    return CastFloat16Pass()
