"""passes/_graph.py: a backward slice follows values that If branches capture from the outer graph (nested ones
too) and never returns subgraph nodes; constants are read from initializers and Constant nodes alike."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from dyncompile.passes._graph import backward_slice, const_array


def _branch(name: str, reads: ir.Value) -> ir.Graph:
    node = ir.node("Identity", [reads], name=f"{name}_id")
    node.outputs[0].name = f"{name}_out"
    return ir.Graph([], [node.outputs[0]], nodes=[node], name=name)


def _graph():
    """``out = If(cond, then: Identity(relu(x)), else: If(cond, Identity(neg(x)), Identity(x)))``: the branches
    read ``relu`` and ``neg`` (outer values, no input of either If) and ``x``."""
    x = ir.val("x", ir.DataType.FLOAT, ir.Shape([2]))
    cond = ir.val("cond", ir.DataType.BOOL, ir.Shape([]))
    relu = ir.node("Relu", [x], name="relu")
    neg = ir.node("Neg", [x], name="neg")
    unused = ir.node("Abs", [x], name="unused")
    inner = ir.node("If", [cond], attributes={"then_branch": _branch("inner_then", neg.outputs[0]),
                                               "else_branch": _branch("inner_else", x)}, name="inner_if")
    inner.outputs[0].name = "inner_out"
    else_graph = ir.Graph([], [inner.outputs[0]], nodes=[inner], name="outer_else")
    outer = ir.node("If", [cond], attributes={"then_branch": _branch("outer_then", relu.outputs[0]),
                                               "else_branch": else_graph}, name="outer_if")
    outer.outputs[0].name = "out"
    g = ir.Graph([x, cond], [outer.outputs[0], unused.outputs[0]], nodes=[relu, neg, unused, outer], name="g")
    return g, {n.name: n for n in (relu, neg, unused, outer, inner)}


def test_slice_follows_values_captured_by_branches_at_any_depth():
    g, nodes = _graph()
    got = backward_slice([g.outputs[0]])
    assert got == {nodes["outer_if"], nodes["relu"], nodes["neg"]}  # neg only via the nested If's branch
    assert nodes["inner_if"] not in got  # subgraph nodes are not part of the outer slice


def test_slice_stops_at_stop_nodes():
    g, nodes = _graph()
    assert backward_slice([g.outputs[0]], stop={nodes["relu"]}) == {nodes["outer_if"], nodes["neg"]}
    assert backward_slice([None, g.inputs[0]]) == set()  # graph inputs have no producer


def test_const_array_reads_initializers_and_constant_nodes():
    w = ir.val("w", const_value=ir.tensor(np.arange(6, dtype=np.float32).reshape(2, 3), name="w"))
    np.testing.assert_array_equal(const_array(w), np.arange(6).reshape(2, 3))
    assert const_array(w, max_elements=5) is None  # larger than asked for: not read
    c = ir.node("Constant", [], attributes={"value": ir.tensor(np.array([4, 5], np.int64))})
    np.testing.assert_array_equal(const_array(c.outputs[0]), [4, 5])
    ints = ir.node("Constant", [], attributes={"value_ints": ir.AttrInt64s("value_ints", [1, 2, 3])})
    np.testing.assert_array_equal(const_array(ints.outputs[0]), [1, 2, 3])
    x = ir.val("x", ir.DataType.FLOAT, ir.Shape([2]))
    assert const_array(x) is None and const_array(ir.node("Relu", [x]).outputs[0]) is None and const_array(None) is None
