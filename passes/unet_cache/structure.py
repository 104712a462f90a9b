"""The skip structure of a U-Net graph, the cut at a skip connection, and the cost of each part.

A diffusers-style U-Net concatenates, on the channel axis, the up path's tensor (the first input) with skip
tensors that the down path computed earlier. Read from the graph alone: a *skip Concat* is a ``Concat`` on
axis 1 whose other inputs are each an ancestor of its first input (the down path continued from the skip,
through the deeper blocks, back up to the first input). Shape Concats (axis 0) and the timestep
embedding's ``[cos, sin]`` (no input descends from another) are not skip Concats.

Depth ``d`` counts skip Concats from the output: depth 1 is the last one (highest resolution). Cutting at
depth ``d`` caches the first input of that Concat (the *deep feature*): the shallow graph takes it as an input
and computes only what the output still needs (the shallow down blocks that feed the skips at depths ``<= d``
and the up blocks after the cut).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from dyncompile.passes._graph import backward_slice, const_array

__all__ = ["SkipConcat", "find_skip_concats", "annotate", "node_macs", "part_cost", "shallow_model"]


@dataclasses.dataclass(frozen=True)
class SkipConcat:
    """One skip connection: the Concat node, its deep (up-path) input and its skip inputs."""

    node: str
    deep: str
    skips: tuple[str, ...]


def _axis(node: ir.Node) -> int | None:
    a = node.attributes.get("axis")
    return None if a is None else int(a.as_int())


def find_skip_concats(graph: ir.Graph) -> tuple[list[SkipConcat], str]:
    """The skip Concats of ``graph``, shallowest (closest to the output) first, and why there are none if so."""
    cands = [n for n in graph if n.op_type == "Concat" and n.domain in ("", "ai.onnx") and len(n.inputs) >= 2
             and _axis(n) in (1, -3)]
    if not cands:
        return [], "no Concat on the channel axis (axis 1): the graph has no U-Net skip connection to cut at"
    found = []
    for n in cands:
        main, *rest = n.inputs
        if main is None or main.producer() is None or any(v is None or v.producer() is None for v in rest):
            continue
        if n.outputs[0].shape is not None and len(n.outputs[0].shape) != 4:
            continue
        anc = backward_slice([main])
        if all(v.producer() in anc for v in rest):
            found.append(SkipConcat(n.name or n.outputs[0].name, main.name, tuple(v.name for v in rest)))
    if not found:
        return [], (f"{len(cands)} channel Concat(s), but none joins a tensor with one of its own ancestors "
                    "(a U-Net skip connection: the down path's tensor concatenated back onto the up path)")
    order = {n.name or n.outputs[0].name: i for i, n in enumerate(graph)}
    found.sort(key=lambda s: -order[s.node])
    return found, ""


def shallow_model(model: ir.Model, deep: str) -> ir.Model:
    """The shallow graph of a cut: the model's inputs plus ``deep`` as an input, only the nodes its outputs still need.

    The model's first output only (the noise prediction); inputs the shallow part does not read are dropped.
    """
    g = model.graph
    values = {v.name: v for n in g for v in n.outputs}
    if deep not in values:
        raise ValueError(f"{deep!r} is not a tensor of the graph")
    annotate(model, [deep])
    outs = [g.outputs[0]]
    sub = ir.convenience.extract(g, inputs=[*g.inputs, values[deep]], outputs=outs)
    for v in list(sub.inputs):  # graph inputs the shallow part does not read (the text states at a shallow cut)
        if not v.uses() and v.name != deep:
            sub.inputs.remove(v)
    sub.name = (g.name or "unet") + "_shallow"
    m = ir.Model(sub, ir_version=model.ir_version, producer_name="dyncompile")
    m.metadata_props.update({k: v for k, v in model.metadata_props.items() if not k.startswith("dyncompile.")})
    return m


def annotate(model: ir.Model, names: list[str]) -> None:
    """Give the tensors ``names`` their element type and shape from ONNX shape inference.

    A graph input or output needs both; exported graphs often carry no value_info for intermediates.
    """
    import onnx

    values = {v.name: v for n in model.graph for v in n.outputs}
    todo = [values[k] for k in names if values[k].type is None or values[k].shape is None]
    if not todo:
        return
    proto = ir.to_proto(model)
    del proto.graph.value_info[:]
    inferred = onnx.shape_inference.infer_shapes(proto, data_prop=True)
    info = {vi.name: vi for vi in inferred.graph.value_info}
    for v in todo:
        vi = info.get(v.name)
        if vi is None:
            v.type = v.type or model.graph.inputs[0].type
            continue
        iv = ir.serde.deserialize_value_info_proto(vi, None)
        v.type = iv.type
        v.shape = iv.shape


def _dims(shape) -> list[int] | None:
    if shape is None:
        return None
    return [d if isinstance(d, int) else 1 for d in shape]


def node_macs(model: ir.Model) -> dict[str, float]:
    """Multiply-accumulates of one batch row per Conv / MatMul / Gemm, keyed by the node's first output name.

    From ONNX shape inference on the whole graph (symbolic dims = 1): a part's cost is the sum over its nodes.
    """
    import onnx

    proto = ir.to_proto(model)
    for v in proto.graph.input:
        for d in v.type.tensor_type.shape.dim:
            if not d.HasField("dim_value"):
                d.ClearField("dim_param")
                d.dim_value = 1
    del proto.graph.value_info[:]
    inferred = ir.from_proto(onnx.shape_inference.infer_shapes(proto, data_prop=True))
    total: dict[str, float] = {}
    for n in inferred.graph:
        if n.op_type not in ("Conv", "MatMul", "Gemm") or not n.outputs:
            continue
        out = _dims(n.outputs[0].shape)
        if out is None:
            continue
        if n.op_type == "Conv":
            w = n.inputs[1]
            ws = _dims(w.shape) if w.shape is not None else None
            if ws is None:
                arr = const_array(w)
                ws = None if arr is None else list(arr.shape)
            if ws is None:
                continue
            total[n.outputs[0].name] = float(np.prod(out)) * float(np.prod(ws[1:]))
        else:
            a = _dims(n.inputs[0].shape)
            if not a:
                continue
            k = a[0] if n.op_type == "Gemm" and n.attributes.get("transA") and n.attributes["transA"].as_int() else a[-1]
            total[n.outputs[0].name] = float(np.prod(out)) * k
    return total


def part_cost(macs: dict[str, float], part: ir.Model) -> float:
    """The MACs of the nodes of ``part`` (a graph cut out of the model ``macs`` was computed on)."""
    return sum(macs.get(n.outputs[0].name, 0.0) for n in part.graph if n.outputs)
