"""Graph helpers the passes share: backward slices and constant reads (one copy of each).

* :func:`backward_slice`: the nodes a set of values depends on, *including* through values that a subgraph
  (an ``If`` branch, a ``Loop`` body) captures from an enclosing graph: a node whose branch reads an outer value
  depends on that value's producer even though the value is no input of the node itself.
* :func:`const_array`: a constant's value as numpy, from an initializer / ``const_value`` or a ``Constant`` node,
  optionally only when it is small (shape arithmetic reads ``Slice`` starts and ``Gather`` indices, never weights).
* :func:`replace_node_output`: swap a node for the nodes that now compute its output, keeping the output's name.
* :func:`default_opset`: the model's default-domain opset.
* :func:`custom_ops_of`: the ``dyncompile``-domain custom operators a model's graphs use (its sessions, the
  compile's calibration ones too, need dyncompile's kernel library).
* :func:`extract_model`: a new model of the part of a graph between some of its values (a staged plan's segment,
  a pass's probe of one value), nodes and initializers cloned, the source model untouched.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import onnx_ir as ir

__all__ = ["add_initializer", "backward_slice", "captured_values", "const_array", "constant_node_tensor",
           "custom_ops_of", "default_opset", "extract_model", "replace_node_output"]


def add_initializer(graph: ir.Graph, name: str, arr: np.ndarray) -> ir.Value:
    """A new initializer ``name`` of ``graph`` holding ``arr`` (registered; its value returned)."""
    v = ir.Value(name=name, const_value=ir.tensor(arr, name=name))
    graph.register_initializer(v)
    return v


def default_opset(model: ir.Model) -> int:
    """The model's default-domain opset (18 when it declares none)."""
    return int(model.opset_imports.get("", model.opset_imports.get("ai.onnx", 18)))


def extract_model(model: ir.Model, inputs: list[str], outputs: list[str], name: str) -> ir.Model:
    """The part of ``model``'s main graph that computes ``outputs`` from ``inputs``, as a new model.

    Nodes and initializers are cloned (``ir.convenience.extract``; ``model`` is untouched); the inputs it does not
    read are dropped, nodes nothing reads removed, and names fixed.
    """
    import onnx_ir.passes.common as common_passes

    sub = ir.convenience.extract(model.graph, inputs=inputs, outputs=outputs)
    sub.name = name
    for v in list(sub.inputs):  # graph inputs this part does not read
        if not v.uses():
            sub.inputs.remove(v)
    part = ir.Model(sub, ir_version=model.ir_version, producer_name="dyncompile")
    common_passes.RemoveUnusedNodesPass()(part)
    common_passes.NameFixPass()(part)
    return part


def custom_ops_of(model: ir.Model) -> list[str]:
    """``domain.op`` of every operator of dyncompile's kernel library used in ``model`` (subgraphs included), sorted."""
    from dyncompile.runtime.kernels import DOMAIN

    return sorted({f"{n.domain}.{n.op_type}" for n in ir.traversal.RecursiveGraphIterator(model.graph)
                   if n.domain == DOMAIN})


def _subgraphs(node: ir.Node) -> Iterator[ir.Graph]:
    for attr in node.attributes.values():
        if attr.type == ir.AttributeType.GRAPH:
            yield attr.value
        elif attr.type == ir.AttributeType.GRAPHS:
            yield from attr.value


def captured_values(node: ir.Node) -> list[ir.Value]:
    """Values that ``node``'s subgraphs (nested ones included) read from outside themselves."""
    out: list[ir.Value] = []
    for sub in _subgraphs(node):
        inner = {id(sub)}
        nodes = list(ir.traversal.RecursiveGraphIterator(sub))
        for n in nodes:
            inner.update(id(g) for g in _subgraphs(n))
        for n in nodes:
            for v in n.inputs:
                p = v.producer() if v is not None else None
                if p is not None and id(p.graph) not in inner:
                    out.append(v)
    return out


def backward_slice(values: Iterable[ir.Value | None], stop: set[ir.Node] | None = None) -> set[ir.Node]:
    """The nodes ``values`` depend on (their producers, transitively), not entering ``stop``.

    Dependencies run through node inputs and through values a node's subgraphs capture from an enclosing graph.
    Only nodes of the graphs that hold ``values`` (and of enclosing graphs) are returned, never subgraph nodes.
    """
    seen: set[ir.Node] = set()
    stack = [v.producer() for v in values if v is not None and v.producer() is not None]
    while stack:
        n = stack.pop()
        if n in seen or (stop and n in stop):
            continue
        seen.add(n)
        for v in (*n.inputs, *captured_values(n)):
            if v is not None and v.producer() is not None and v.producer() not in seen:
                stack.append(v.producer())
    return seen


def constant_node_tensor(node: ir.Node) -> ir.TensorProtocol | None:
    """The tensor of a standard-domain ``Constant`` node with a ``value`` attribute, else ``None``."""
    if node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
        return None
    attr = node.attributes.get("value")
    if attr is not None and attr.type == ir.AttributeType.TENSOR:
        return attr.value
    return None


def const_array(v: ir.Value | None, max_elements: int | None = None) -> np.ndarray | None:
    """The value of constant ``v`` as numpy, or ``None`` when it is not a (readable) constant.

    Reads an initializer or other ``const_value``, a ``Constant`` node's ``value`` tensor or its scalar / list
    attributes. With ``max_elements``, larger tensors give ``None`` without being read.
    """
    if v is None:
        return None
    tensor = v.const_value
    if tensor is None:
        producer = v.producer()
        if producer is None:
            return None
        tensor = constant_node_tensor(producer)
        if tensor is None:
            if producer.op_type == "Constant":
                for key in ("value_int", "value_ints", "value_float", "value_floats"):
                    attr = producer.attributes.get(key)
                    if attr is not None:
                        return np.asarray(attr.value)
            return None
    try:
        if max_elements is not None and tensor.size > max_elements:
            return None
        return tensor.numpy()
    except Exception:  # noqa: BLE001 - unreadable external data etc.
        return None


def replace_node_output(graph: ir.Graph, node: ir.Node, y: ir.Value, out: ir.Value) -> None:
    """Let ``out`` take over ``node``'s output ``y``, then remove ``node``.

    ``out`` (already in ``graph``) gets ``y``'s name, type and shape and every use of it, graph outputs included.
    """
    name = y.name
    y.name = None
    out.name, out.type = name, y.type
    if y.shape is not None:
        out.shape = y.shape
    ir.convenience.replace_all_uses_with(y, out, replace_graph_outputs=True)
    graph.remove(node, safe=True)
