"""matmul-to-conv: constant-weight MatMuls on [batch, seq, K] become 1x1 Convs over [batch, K, 1, seq]; outputs
unchanged within round-off, in ORT with no optimization and with the NCHWc kernels that make it worth doing."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

import dyncompile
from dyncompile.passes.matmul_to_conv import MatMulToConvPass

RNG = np.random.default_rng(0)


def _graph(chain: bool = True) -> onnx.ModelProto:
    """x [b, s, 32] -> MatMul(W1 [32, 48]) -> Relu -> MatMul(W2 [48, 16]) -> y (lowered; channel counts that are
    multiples of 16, as ORT's NCHWc kernels need and real models have); also MatMul(x, Wshared) twice (a shared
    weight), MatMul(x, w_in) (not constant), MatMul(x2d, W3) (rank 2): left alone."""
    x = ir.val("x", ir.DataType.FLOAT, ir.Shape(["b", "s", 32]))
    x2 = ir.val("x2", ir.DataType.FLOAT, ir.Shape(["r", 8]))
    w_in = ir.val("w_in", ir.DataType.FLOAT, ir.Shape([32, 4]))

    def const(name, shape):
        w = RNG.standard_normal(shape) / np.sqrt(shape[0])  # a trained layer's scale: outputs of order 1
        return ir.val(name, const_value=ir.tensor(w.astype(np.float32), name=name))

    w1, w2, ws, w3 = const("W1", (32, 48)), const("W2", (48, 16)), const("Wshared", (32, 3)), const("W3", (8, 6))
    tape = ir.tape.Tape()

    def out(v, name, shape):
        v.name, v.dtype, v.shape = name, ir.DataType.FLOAT, ir.Shape(shape)
        return v

    outs, inits = [], [ws, w3]
    if chain:  # the lowerable MatMuls
        h = out(tape.op("MatMul", [x, w1], name="mm1"), "h", ["b", "s", 48])
        r = out(tape.op("Relu", [h]), "r", ["b", "s", 48])
        outs, inits = [out(tape.op("MatMul", [r, w2], name="mm2"), "y", ["b", "s", 16])], [w1, w2, *inits]
    s1 = out(tape.op("MatMul", [x, ws], name="shared1"), "s1", ["b", "s", 3])
    s2 = out(tape.op("Relu", [out(tape.op("MatMul", [x, ws], name="shared2"), "s2", ["b", "s", 3])]), "s2r",
             ["b", "s", 3])
    z = out(tape.op("MatMul", [x, w_in], name="dyn"), "z", ["b", "s", 4])
    q = out(tape.op("MatMul", [x2, w3], name="rank2"), "q", ["r", 6])
    outs += [s1, s2, z, q]
    g = ir.Graph([x, x2, w_in], outs, nodes=tape.nodes, initializers=inits,
                 opset_imports={"": 18}, name="g")
    return ir.to_proto(ir.Model(g, ir_version=10))


def _run(model: onnx.ModelProto, feeds, level) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = level
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def test_lowers_constant_rank3_matmuls_exactly():
    proto = _graph()
    result = MatMulToConvPass()(ir.from_proto(proto))
    assert result.modified
    lowered = ir.to_proto(result.model)
    onnx.checker.check_model(lowered, full_check=True)
    convs = [n for n in lowered.graph.node if n.op_type == "Conv"]
    assert len(convs) == 2  # mm1 and mm2; the shared, non-constant and rank-2 MatMuls stay
    assert sorted(n.name for n in lowered.graph.node if n.op_type == "MatMul") == ["dyn", "rank2", "shared1",
                                                                                    "shared2"]
    weights = {i.name: list(i.dims) for i in lowered.graph.initializer}
    assert weights["W1"] == [48, 32, 1, 1] and weights["W2"] == [16, 48, 1, 1]  # transposed in place, same names
    assert weights["Wshared"] == [32, 3] and weights["W3"] == [8, 6]
    w1 = onnx.numpy_helper.to_array(next(i for i in proto.graph.initializer if i.name == "W1"))
    w1t = onnx.numpy_helper.to_array(next(i for i in lowered.graph.initializer if i.name == "W1"))
    np.testing.assert_array_equal(w1t[:, :, 0, 0], w1.T)
    assert [o.name for o in lowered.graph.output] == [o.name for o in proto.graph.output]
    for b, s in ((1, 1), (1, 9), (2, 300)):  # a decode step, a verification, a prompt (two sequences)
        feeds = {"x": RNG.standard_normal((b, s, 32)).astype(np.float32),
                 "x2": RNG.standard_normal((3, 8)).astype(np.float32),
                 "w_in": RNG.standard_normal((32, 4)).astype(np.float32)}
        want = _run(proto, feeds, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
        for level in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
            for a, got in zip(want, _run(lowered, feeds, level)):
                assert got.shape == a.shape
                np.testing.assert_allclose(got, a, rtol=0, atol=1e-5)
    again = MatMulToConvPass()(result.model)
    assert again.modified is False


def test_ort_folds_the_layout_transposes_into_its_nchwc_reorders(tmp_path):
    """The NHWC <-> NCHW Transposes are written so that ORT's NCHWc transformer absorbs them: with every
    optimization on, a lowered MatMul runs as ReorderInput -> NCHWc Conv -> ReorderOutput reading and writing
    channels-last, with no Transpose left (the rank-3 Transposes of the first version all ran)."""
    x = ir.val("x", ir.DataType.FLOAT, ir.Shape([1, "s", 32]))
    w = ir.val("W", const_value=ir.tensor(RNG.standard_normal((32, 48)).astype(np.float32), name="W"))
    y = ir.node("MatMul", [x, w], name="mm").outputs[0]
    y.name, y.dtype, y.shape = "y", ir.DataType.FLOAT, ir.Shape([1, "s", 48])
    g = ir.Graph([x], [y], nodes=[y.producer()], initializers=[w], opset_imports={"": 18}, name="g")
    lowered = MatMulToConvPass()(ir.Model(g, ir_version=10)).model
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    so.log_severity_level = 3
    ort.InferenceSession(ir.to_proto(lowered).SerializeToString(), so, providers=["CPUExecutionProvider"])
    ops = {n.op_type: n for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node}
    if "ReorderInput" not in ops:
        pytest.skip("this CPU has no NCHWc kernels (ORT's NCHWc transformer needs x86 AVX2 or AVX-512)")
    assert "Transpose" not in ops and ops["Conv"].domain == "com.microsoft.nchwc"
    for reorder in ("ReorderInput", "ReorderOutput"):
        attrs = {a.name: a.i for a in ops[reorder].attribute}  # int attributes
        assert attrs["channels_last"] == 1, reorder


def test_graphs_without_a_lowerable_matmul_are_left_alone():
    proto = _graph(chain=False)  # only the shared, non-constant and rank-2 MatMuls
    g = ir.from_proto(proto)
    before = ir.to_onnx_text(g)
    assert MatMulToConvPass()(g).modified is False
    assert ir.to_onnx_text(g) == before
    assert repr(MatMulToConvPass()) == "MatMulToConvPass()"


def test_real_decoder_lowered_is_token_identical(smollm2, tmp_path):
    """SmolLM2: every layer projection and the LM head become Convs; greedy text equals the unlowered plan's, and
    prompt lookup on the lowered plan equals its own target alone."""
    from dyncompile.passes.compiler import compile_model

    recipe = "explicit-attention,fuse-decoder,pack-matmuls,trim-logits"
    base = compile_model(smollm2.onnx_path, recipe, tmp_path / "base").plan_dir
    # measure=false: the draft policy comes from the default cost model, not from timings taken on a busy machine
    # (measured verification costs on a loaded CI box made prompt lookup draft nothing)
    conv = compile_model(smollm2.onnx_path, recipe + ",matmul-to-conv,speculative{measure=false}", tmp_path / "conv",
                         drafter="prompt-lookup").plan_dir
    model = onnx.load(str(conv / "model.onnx"), load_external_data=False)
    ops = [n.op_type for n in model.graph.node]
    # per layer: packed q/k/v, o, packed gate/up, down; the LM head reads the embedding tied to the token Gather
    assert ops.count("Conv") == 30 * 4 and ops.count("MatMul") == 1
    prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    cfg = {"session.intra_op.allow_spinning": "0"}
    a = dyncompile.load(base, session_config=cfg).generate(prompt, max_new_tokens=24)
    m = dyncompile.load(conv, session_config=cfg)
    b = m.generate(prompt, max_new_tokens=24, speculative=False)
    c = m.generate(prompt, max_new_tokens=24)
    assert a.token_ids == b.token_ids == c.token_ids and len(a.token_ids) == 24
    assert c.stats.target_calls < len(c.token_ids)  # prompt lookup did accept drafts
    step = json.loads((conv / "plan.json").read_text())["steps"][0]
    assert step["target"]["kv_buffer"] == "shared"
