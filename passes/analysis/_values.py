"""Small readers of onnx-ir values and nodes shared by the analysis modules (no analysis logic here)."""

from __future__ import annotations

from typing import Any

import onnx_ir as ir

NONDETERMINISTIC_OPS = frozenset(
    {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"}
)
SHAPE_ONLY_OPS = frozenset({"Shape", "Size"})
COMPARE_OPS = frozenset({"Less", "LessOrEqual", "Greater", "GreaterOrEqual"})
RMS_NORM_OPS = frozenset(
    {"SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "RMSNormalization"}
)
LAYER_NORM_OPS = frozenset({"LayerNormalization", "SkipLayerNormalization"})
MATMUL_OPS = frozenset(
    {"MatMul", "Gemm", "MatMulNBits", "MatMulInteger", "QLinearMatMul", "FusedMatMul", "Einsum"}
)


def dtype_str(dtype: ir.DataType | None) -> str:
    if dtype is None:
        return "unknown"
    try:
        return str(dtype.numpy().name) if dtype not in (ir.DataType.STRING,) else "string"
    except Exception:  # noqa: BLE001 - types without a numpy equivalent (float8, int4...)
        return dtype.name.lower()


def shape_list(shape: ir.Shape | None) -> list[int | str] | None:
    if shape is None:
        return None
    dims: list[int | str] = []
    for d in shape:
        if isinstance(d, int):
            dims.append(d)
        else:
            value = getattr(d, "value", None)
            dims.append(str(value) if value is not None else "?")
    return dims


def io_entry(v: ir.Value) -> tuple[str, str, list[int | str]]:
    return (v.name or "", dtype_str(v.dtype), shape_list(v.shape) or [])


def node_label(node: ir.Node, index: int) -> str:
    return node.name or f"{node.op_type}_{index}"


def subgraphs(node: ir.Node) -> list[ir.Graph]:
    graphs: list[ir.Graph] = []
    for attr in node.attributes.values():
        if attr.type == ir.AttributeType.GRAPH:
            graphs.append(attr.value)
        elif attr.type == ir.AttributeType.GRAPHS:
            graphs.extend(attr.value)
    return graphs


def node_inputs(node: ir.Node) -> list[ir.Value]:
    """Explicit inputs plus outer-scope values captured by the node's subgraphs."""
    inputs = [v for v in node.inputs if v is not None]
    graphs = subgraphs(node)
    if not graphs:
        return inputs
    inner: set[ir.Value] = set()
    inner_nodes: list[ir.Node] = []
    for g in graphs:
        inner.update(g.inputs)
        inner.update(g.initializers.values())
        for n in g.all_nodes():
            inner_nodes.append(n)
            inner.update(n.outputs)
            for sub in subgraphs(n):
                inner.update(sub.inputs)
                inner.update(sub.initializers.values())
    seen = set(inputs)
    for n in inner_nodes:
        for v in n.inputs:
            if v is not None and v not in inner and v not in seen:
                seen.add(v)
                inputs.append(v)
    return inputs


def attr_int(node: ir.Node, name: str, default: int | None = None) -> int | None:
    attr = node.attributes.get(name)
    if attr is None:
        return default
    try:
        return int(attr.value)
    except (TypeError, ValueError):
        return default


def shape_tuple(v: ir.Value) -> tuple[Any, ...]:
    if v.const_value is not None:
        return tuple(v.const_value.shape)
    if v.shape is not None:
        return tuple(shape_list(v.shape) or ())
    return ("?",)


def static_numel(v: ir.Value) -> int | None:
    if v.shape is None:
        return None
    total = 1
    for d in v.shape:
        if not isinstance(d, int):
            return None
        total *= d
    return total
