"""fuse-gelu: the exported exact GELU (Div/Erf/Add/Mul/Mul) becomes one com.microsoft.Gelu; outputs unchanged;
both operand orders fire, a look-alike with the wrong constant does not; a second run and a graph without GELU
leave the model alone."""

from __future__ import annotations

import logging
import math

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from helpers import ort_session  # tests/ is on pythonpath; ORT_DISABLE_ALL

from dyncompile.passes import FuseGeluPass, build_passes, run_pipeline

_MS = "com.microsoft"


def _gelus(model: onnx.ModelProto) -> int:
    return sum(n.op_type == "Gelu" and n.domain == _MS for n in model.graph.node)


@pytest.mark.parametrize("name, layers", [("minilm", 6), ("mpnet", 12)])
def test_real_encoder_gelus_are_fused_exactly(name, layers, request, movie_test_rows):
    from dyncompile.runtime.text import TextEncoder

    art = request.getfixturevalue(name)
    before = ir.load(art.onnx_path)
    erfs = sum(n.op_type == "Erf" for n in before.graph)
    assert erfs == layers  # one exact GELU per feed-forward layer in the export
    model = ir.load(art.onnx_path)
    result = FuseGeluPass()(model)
    assert result.modified
    fused = ir.to_proto(result.model)
    onnx.checker.check_model(fused, full_check=True)
    assert _gelus(fused) == layers
    ops = [n.op_type for n in fused.graph.node]
    assert "Erf" not in ops and len(ops) == len(list(before.graph)) - 4 * layers  # five nodes -> one
    assert [o.name for o in fused.graph.output] == [v.name for v in before.graph.outputs]
    # outputs: the original's within round-off on real padded rows, ORT optimizations off
    names = [i.name for i in fused.graph.input]
    feeds = TextEncoder(art.tokenizer_path, max_length=128)([r["text"] for r in movie_test_rows[:8]])
    feeds = {k: v for k, v in feeds.items() if k in names}
    ref = ort_session(art.onnx_path).run(None, feeds)[0]
    got = ort_session(fused.SerializeToString()).run(None, feeds)[0]
    assert np.abs(got - ref).max() <= 1e-5
    assert not FuseGeluPass()(result.model).modified  # nothing left to fuse


def _gelu_graph(order: int, sqrt2: float) -> ir.Model:
    """``y = gelu(x)`` written in one of the exporters' two operand orders, with ``sqrt2`` as the divisor."""
    x = ir.val("x", ir.DataType.FLOAT, ir.Shape([2, 5]))
    tape = ir.tape.Tape()

    def c(v, name):
        return tape.initializer(ir.tensor(np.array(v, np.float32), name=name))

    erf = tape.op("Erf", [tape.op("Div", [x, c(sqrt2, "sqrt2")])])
    one_plus = tape.op("Add", [erf, c(1.0, "one")])
    if order == 1:  # 0.5 * (x * (erf + 1))
        y = tape.op("Mul", [c(0.5, "half"), tape.op("Mul", [x, one_plus])])
    else:  # x * (0.5 * (erf + 1)), torch dynamo's
        y = tape.op("Mul", [x, tape.op("Mul", [c(0.5, "half"), one_plus])])
    y.name, y.dtype, y.shape = "y", ir.DataType.FLOAT, ir.Shape([2, 5])
    g = ir.Graph([x], [y], nodes=tape.nodes, initializers=tape.initializers, opset_imports={"": 18},
                 name="gelu")
    return ir.Model(g, ir_version=10)


@pytest.mark.parametrize("order", [1, 2])
def test_both_operand_orders_fire_and_compute_gelu(order):
    x = np.linspace(-4, 4, 10, dtype=np.float32).reshape(2, 5)
    want = 0.5 * x * (1 + np.vectorize(math.erf)(x.astype(np.float64) / math.sqrt(2)))
    model = _gelu_graph(order, math.sqrt(2))
    assert FuseGeluPass()(model).modified
    assert [(n.op_type, n.domain) for n in model.graph] == [("Gelu", _MS)]
    onnx.checker.check_model(ir.to_proto(model), full_check=True)
    np.testing.assert_allclose(ort_session(model).run(None, {"x": x})[0], want, rtol=0, atol=1e-6)


def test_a_look_alike_with_another_divisor_is_not_fused(caplog):
    """x / 1.5 is not GELU: named by the user, the pass leaves it and says why at WARNING."""
    model = _gelu_graph(2, 1.5)
    ops = [n.op_type for n in model.graph]
    with caplog.at_level(logging.WARNING):
        run_pipeline(build_passes("fuse-gelu"), model, check="none")
    assert [n.op_type for n in model.graph] == ops
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("fuse-gelu" in m and "no exact GELU" in m and "leave fuse-gelu out" in m for m in msgs), msgs


def test_a_graph_without_gelu_is_left_alone(tiny_encoder_path):
    model = ir.load(tiny_encoder_path)  # ReLU feed-forward layers
    nodes = [n.op_type for n in model.graph]
    result = FuseGeluPass()(model)
    assert not result.modified and [n.op_type for n in model.graph] == nodes


@pytest.mark.parametrize("name, op", [("fuse-gelu", "Gelu"), ("fuse-encoder-attention", "MultiHeadAttention")])
def test_the_contrib_op_passes_warn_off_the_providers_they_were_measured_on(name, op, caplog):
    """Both passes write onnxruntime contrib operators: named for the OpenVINO EP they warn (pass, op, EP), for
    the CPU and CUDA EPs they do not."""
    from dyncompile.passes import CompileContext

    for provider, warns in (("openvino", True), ("cpu", False), ("cuda", False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            build_passes(name, CompileContext(options={"provider": provider}))
        msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any(m.startswith(f"{name}: {op} is an onnxruntime contrib operator; the {provider} EP")
                   and f"--provider {provider}" in m for m in msgs) == warns, (provider, msgs)
