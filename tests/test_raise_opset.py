"""raise-opset: the declared default opset goes to 21 when no operator of the graph changes meaning on the way;
nodes, weights and outputs stay (bit-identical on the real MiniLM, both If branches of a small graph, ORT
optimizations off and on); GroupNormalization, an unknown operator or a local function stop it with a reason; a
second run, and a model already at 21, report modified=False."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from helpers import ort_session  # tests/ is on pythonpath

from dyncompile.passes import RaiseOpsetPass
from dyncompile.passes.raise_opset import changed_operators


def _opset(model: ir.Model | onnx.ModelProto) -> int:
    if isinstance(model, ir.Model):
        return model.opset_imports[""]
    return {o.domain: o.version for o in model.opset_import}[""]


@pytest.mark.parametrize("optimized", [False, True])
def test_real_encoder_is_raised_with_bit_identical_outputs(minilm, movie_test_rows, optimized):
    from dyncompile.runtime.text import TextEncoder

    before = ir.load(minilm.onnx_path)
    model = ir.load(minilm.onnx_path)
    assert _opset(model) == 18
    result = RaiseOpsetPass()(model)
    assert result.modified and _opset(result.model) == 21
    proto = ir.to_proto(result.model)
    onnx.checker.check_model(proto, full_check=True)
    assert [n.op_type for n in proto.graph.node] == [n.op_type for n in before.graph]  # nodes untouched
    names = [i.name for i in proto.graph.input]
    feeds = TextEncoder(minilm.tokenizer_path, max_length=128)([r["text"] for r in movie_test_rows[:8]])
    feeds = {k: v for k, v in feeds.items() if k in names}
    ref = ort_session(minilm.onnx_path, disable_all=not optimized).run(None, feeds)
    got = ort_session(proto.SerializeToString(), disable_all=not optimized).run(None, feeds)
    assert all(np.array_equal(a, b) for a, b in zip(got, ref, strict=True))
    assert not RaiseOpsetPass()(result.model).modified  # already at 21


def _if_model(op: str = "Relu", opset: int = 18) -> ir.Model:
    """``y = If(c, then: Reshape(Relu(x)), else: Cast(Reshape(x * 2)))``: opset-21 operators in both branches."""
    f32 = ir.TensorType(ir.DataType.FLOAT)
    x = ir.val("x", ir.DataType.FLOAT, ir.Shape([2, 3]))
    c = ir.val("c", ir.DataType.BOOL, ir.Shape([]))

    def const(name, arr):
        return ir.Value(name=name, const_value=ir.tensor(arr, name=name), type=ir.TensorType(ir.DataType.from_numpy(
            arr.dtype)), shape=ir.Shape(arr.shape))

    def branch(name, nodes, consts):
        out = nodes[-1].outputs[0]
        out.name, out.type, out.shape = f"{name}_out", f32, ir.Shape([3, 2])
        return ir.Graph([], [out], nodes=nodes, initializers=consts, name=name)

    shape, shape2, two = const("shape", np.array([3, 2], np.int64)), const("shape2", np.array([3, 2], np.int64)), \
        const("two", np.array(2.0, np.float32))
    r = ir.node(op, [x], name="op")
    then_g = branch("then", [r, ir.node("Reshape", [r.outputs[0], shape], name="reshape")], [shape])
    m = ir.node("Mul", [x, two], name="mul")
    m2 = ir.node("Reshape", [m.outputs[0], shape2], name="reshape2")
    else_g = branch("else", [m, m2, ir.node("Cast", [m2.outputs[0]], attributes={"to": int(ir.DataType.FLOAT)},
                                             name="cast")], [two, shape2])
    node = ir.node("If", [c], attributes={"then_branch": then_g, "else_branch": else_g}, name="if")
    y = node.outputs[0]
    y.name, y.type, y.shape = "y", f32, ir.Shape([3, 2])
    g = ir.Graph([c, x], [y], nodes=[node], name="g", opset_imports={"": opset})
    return ir.Model(g, ir_version=10)


@pytest.mark.parametrize("optimized", [False, True])
def test_every_if_branch_gives_the_same_bytes(optimized):
    x = np.array([[-1.5, 2.0, 0.25], [3.0, -0.5, 7.0]], np.float32)
    ref = ort_session(_if_model(), disable_all=not optimized)
    model = _if_model()
    assert RaiseOpsetPass()(model).modified and _opset(model) == 21
    onnx.checker.check_model(ir.to_proto(model), full_check=True)
    got = ort_session(model, disable_all=not optimized)
    for c in (True, False):
        feeds = {"c": np.array(c), "x": x}
        want = ref.run(None, feeds)[0]
        assert np.array_equal(got.run(None, feeds)[0], want)
        assert want.shape == (3, 2) and (want.min() >= 0) == c  # the branch taken: Relu's, or the doubled x


def test_an_operator_that_changes_meaning_stops_it(caplog):
    model = _if_model(op="GroupNormalization")  # opset 21 reads its scale per channel, 18 per group
    assert changed_operators(model, 21) == ["GroupNormalization"]
    with caplog.at_level(logging.WARNING):
        result = RaiseOpsetPass()(model)
    assert not result.modified and _opset(model) == 18
    assert "GroupNormalization" in result.message()
    assert changed_operators(_if_model(), 21) == []  # Relu, Reshape, Mul, Cast, If keep their meaning
    assert changed_operators(_if_model(op="NoSuchOp"), 21) == ["NoSuchOp"]


def test_local_functions_stop_it():
    model = _if_model()
    f = ir.Function("local", "f", graph=ir.Graph([], [], nodes=[], opset_imports={"": 18}), attributes=[])
    model.functions[f.identifier()] = f
    result = RaiseOpsetPass()(model)
    assert not result.modified and _opset(model) == 18 and "function" in result.message()


def test_target_is_checked_and_lower_models_are_left_alone():
    with pytest.raises(ValueError, match="between 18 and 21"):
        RaiseOpsetPass(22)
    model = _if_model(opset=21)
    assert not RaiseOpsetPass()(model).modified
    model = _if_model()
    assert not RaiseOpsetPass(18)(model).modified and _opset(model) == 18
