"""quantize-int8{activations=per-token}: one int8 scale per token (row) of each MatMul's activation.

Golden structure and idempotence on a generated encoder; the arithmetic against a numpy emulation, with ORT's
fusions off and on (ORT_ENABLE_ALL folds the weight scale into MatMulIntegerToFloat; the per-row scale must
survive it); the option's validation; and on the real MiniLM-L6 the property that makes per-token different
from ORT's per-tensor dynamic int8: a row's answer does not depend on the other rows of its batch.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from helpers import REDUCE_RANGE, ort_session, random_token_feeds, skip_if_int8_pairs_saturate

from dyncompile.models.synthetic import tiny_encoder_classifier
from dyncompile.passes import QuantizeDynamicInt8Pass, _keys, run_pipeline
from dyncompile.passes.quantize_weights import GELU_FLOOR, QuantizeDynamicInt8PerTokenPass


def _weight_matmuls(m: ir.Model) -> list[ir.Node]:
    return [n for n in m.graph if n.op_type == "MatMul" and n.inputs[1] is not None and n.inputs[1].const_value is not None]


def _one_matmul(w: np.ndarray, b: np.ndarray) -> ir.Model:
    """``x @ w + b``, as a Linear layer exports."""
    x = ir.val("x", ir.DataType.FLOAT, ir.Shape(["batch", "seq", w.shape[0]]))
    wv = ir.val("w", const_value=ir.tensor(w, name="w"))
    bv = ir.val("b", const_value=ir.tensor(b, name="b"))
    tape = ir.tape.Tape()
    y = tape.op("Add", [tape.op("MatMul", [x, wv], name="proj"), bv], name="bias")
    y.name, y.dtype, y.shape = "y", ir.DataType.FLOAT, ir.Shape(["batch", "seq", w.shape[1]])
    g = ir.Graph([x], [y], nodes=tape.nodes, initializers=[wv, bv], opset_imports={"": 18}, name="one_matmul")
    return ir.Model(g, ir_version=10)


def _emulate(x: np.ndarray, w: np.ndarray, reduce_range: bool = False) -> np.ndarray:
    """The pass's arithmetic in numpy (float64): symmetric int8 per token, symmetric int8 per output column (in
    [-64, 64] with ``reduce_range``, ORT's reduced range)."""
    wmax = 64 if reduce_range else 127
    s = np.maximum(np.abs(x).max(-1, keepdims=True) / 127.0, 1e-12)
    sw = np.abs(w).max(0) / wmax
    xq = np.round(x / s)  # within [-127, 127] by construction
    wq = np.clip(np.round(w / sw), -wmax, wmax)
    return (xq @ wq) * sw * s


def test_structure_idempotence_and_metadata():
    m = tiny_encoder_classifier()
    weights = {n.inputs[1].name for n in _weight_matmuls(m)}
    count = len(_weight_matmuls(m))
    res = run_pipeline([QuantizeDynamicInt8PerTokenPass()], m, check="each")  # onnx.checker full_check each pass
    assert res.modified
    ops = [n.op_type for n in m.graph]
    assert ops.count("MatMulInteger") == count and not _weight_matmuls(m)
    assert "DynamicQuantizeLinear" not in ops  # no per-tensor activation range anywhere
    assert not weights & set(m.graph.initializers)  # the float weights went with their MatMuls
    assert [v.name for v in m.graph.outputs] == ["logits"]
    assert {m.graph.initializers[n.inputs[1].name].const_value.dtype for n in m.graph if n.op_type == "MatMulInteger"} \
        == {ir.DataType.INT8}
    meta = json.loads(m.metadata_props[_keys.QUANTIZED])
    assert meta["scheme"] == "int8-dynamic-per-token" and meta["per_channel"] is True
    again = QuantizeDynamicInt8PerTokenPass()(m)
    assert again.modified is False
    # nor does it stack on ORT's per-tensor int8
    q = tiny_encoder_classifier()
    QuantizeDynamicInt8Pass()(q)
    assert QuantizeDynamicInt8PerTokenPass()(q).modified is False


def test_shared_activation_is_quantized_once():
    """Three projections of one activation (unpacked q/k/v) read one quantized copy of it."""
    rng = np.random.default_rng(0)
    x = ir.val("x", ir.DataType.FLOAT, ir.Shape([1, 5, 16]))
    tape, inits, outs = ir.tape.Tape(), [], []
    for i in range(3):
        w = ir.val(f"w{i}", const_value=ir.tensor(rng.standard_normal((16, 8)).astype(np.float32), name=f"w{i}"))
        inits.append(w)
        y = tape.op("MatMul", [x, w], name=f"p{i}")
        y.name, y.dtype, y.shape = f"y{i}", ir.DataType.FLOAT, ir.Shape([1, 5, 8])
        outs.append(y)
    m = ir.Model(ir.Graph([x], outs, nodes=tape.nodes, initializers=inits, opset_imports={"": 18}), ir_version=10)
    QuantizeDynamicInt8PerTokenPass()(m)
    ops = [n.op_type for n in m.graph]
    assert ops.count("MatMulInteger") == 3 and ops.count("ReduceMax") == 1 and ops.count("QuantizeLinear") == 1


@pytest.mark.parametrize("reduce_range", REDUCE_RANGE)
@pytest.mark.parametrize("optimized", [False, True])
def test_arithmetic_matches_the_emulation_with_and_without_ort_fusions(optimized, reduce_range):
    """Rows of very different size (one token 300x the others): each keeps its own scale. At ORT_ENABLE_ALL the
    result must not change: ORT fuses MatMulInteger -> Cast -> Mul(scale) -> Add(bias) into MatMulIntegerToFloat;
    the per-row scale is multiplied after the weight scale (multiplied into the weight scale first, the fusion
    reads the product as one scale and the rows come out wrong: this test then fails by 15 on outputs of 574;
    on MPNet-base, 85 % agreement with fp32)."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((64, 48)) / 8).astype(np.float32)
    b = rng.standard_normal(48).astype(np.float32)
    x = rng.standard_normal((3, 7, 64)).astype(np.float32)
    x[1, 2] *= 300.0
    x[2, 4, :] = 0.0  # an all-zero token: scale floor, output exactly zero
    m = _one_matmul(w, b)
    QuantizeDynamicInt8PerTokenPass(reduce_range=reduce_range)(m)
    onnx.checker.check_model(ir.to_proto(m), full_check=True)
    wq = next(m.graph.initializers[n.inputs[1].name].const_value.numpy() for n in m.graph if n.op_type.startswith(
        "MatMulInteger"))
    assert np.abs(wq.astype(int)).max() == (64 if reduce_range else 127)  # the widest column reaches the range
    got = ort_session(m, disable_all=not optimized).run(None, {"x": x})[0]
    want = _emulate(x.astype(np.float64), w.astype(np.float64), reduce_range) + b
    scale = np.abs(want).max(-1, keepdims=True) + 1e-30  # relative to each token's own size
    assert (np.abs(got - want) / scale).max() <= 1e-5
    assert np.abs(got[2, 4] - b).max() <= 1e-6
    # and the small tokens beside the outlier keep a fine grid: their error is the quantization step's, not the
    # outlier's (per-tensor scaling would round them with a 300x coarser step)
    exact = x @ w + b
    small = np.ones(x.shape[:2], bool)
    small[1, 2] = small[2, 4] = False
    rel = np.abs(got - exact)[small].max() / np.abs(exact)[small].max()
    per_tensor_step = np.abs(x).max() / 127.0
    assert rel < 0.02 and np.abs(got - exact)[small].max() < 0.1 * per_tensor_step * np.abs(w).sum(0).max()


@skip_if_int8_pairs_saturate
@pytest.mark.parametrize("optimized", [False, True])
def test_row_quantizer_gives_the_bytes_of_the_elementwise_chain(optimized):
    """From opset 15 one QuantizeLinear over a [rows, k] view replaces Div, Round, Add(128), Cast; from opset 21 a
    blocked QuantizeLinear on x as it is (no view, no shape arithmetic); MatMulIntegerToFloat replaces
    MatMulInteger, Cast, Mul: same outputs, bit for bit (outlier token, all-zero token, ties at .5 after division,
    batch > 1); the opset-14 graph keeps the chain."""
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((64, 48)) / 8).astype(np.float32)
    b = rng.standard_normal(48).astype(np.float32)
    x = rng.standard_normal((3, 7, 64)).astype(np.float32)
    x[1, 2] *= 300.0
    x[2, 4, :] = 0.0
    x[0, 0, :4] = [127.0, 0.5, -0.5, 1.5]  # scale 1: x / s lands on .5 ties, rounded half to even by both
    out, ops = {}, {}
    for opset, to_float in ((14, False), (18, False), (21, False), (18, True), (21, True)):
        m = _one_matmul(w, b)
        m.opset_imports[""] = opset
        QuantizeDynamicInt8PerTokenPass(integer_to_float=to_float)(m)
        onnx.checker.check_model(ir.to_proto(m), full_check=True)
        key = (opset, "to_float") if to_float else opset
        ops[key] = [n.op_type for n in m.graph]
        out[key] = ort_session(m, disable_all=not optimized).run(None, {"x": x})[0]
    for opset in (18, 21):  # MatMulInteger -> Cast -> Mul(weight scale) as one MatMulIntegerToFloat: the same bytes
        assert ops[(opset, "to_float")].count("MatMulIntegerToFloat") == 1
        assert len(ops[(opset, "to_float")]) == len(ops[opset]) - 2 and "MatMulInteger" not in ops[(opset, "to_float")]
        assert np.array_equal(out[(opset, "to_float")], out[14])
    assert "QuantizeLinear" in ops[18] and "Round" not in ops[18] and "Div" not in ops[18]
    assert "QuantizeLinear" not in ops[14] and "Round" in ops[14]
    assert "Reshape" in ops[18] and "Concat" in ops[18]
    # at 21: the activation's QuantizeLinear and one more making the rows' zero points (no Shape, no Expand)
    assert ops[21].count("QuantizeLinear") == 2 and not {"Reshape", "Concat", "Unsqueeze", "Round", "Shape",
                                                          "Expand"} & set(ops[21])
    assert len(ops[21]) == len(ops[18]) - 6
    assert out[18].shape == (3, 7, 48) and np.array_equal(out[18], out[14]) and np.array_equal(out[21], out[14])
    want = _emulate(x.astype(np.float64), w.astype(np.float64)) + b
    assert np.abs(out[18] - want).max() / np.abs(want).max() <= 1e-5


def _gelu_then_matmul(w: np.ndarray, gelu_node: bool, opset: int = 21) -> ir.Model:
    """``Gelu(x) @ w`` (ONNX's Gelu from opset 20, com.microsoft's below); ``gelu_node=False`` puts an
    ``Identity`` between them (an unknown producer)."""
    x = ir.val("x", ir.DataType.FLOAT, ir.Shape(["batch", "seq", w.shape[0]]))
    wv = ir.val("w", const_value=ir.tensor(w, name="w"))
    tape = ir.tape.Tape()
    h = tape.op("Gelu", [x], domain="" if opset >= 20 else "com.microsoft")
    if not gelu_node:
        h = tape.op("Identity", [h])
    y = tape.op("MatMul", [h, wv], name="fc2")
    y.name, y.dtype, y.shape = "y", ir.DataType.FLOAT, ir.Shape(["batch", "seq", w.shape[1]])
    g = ir.Graph([x], [y], nodes=tape.nodes, initializers=[wv], opset_imports={"": opset, "com.microsoft": 1},
                 name="gelu_matmul")
    return ir.Model(g, ir_version=10)


@pytest.mark.parametrize("opset", [14, 18, 21])
def test_a_gelu_output_needs_no_abs_and_gives_the_same_bytes(opset):
    """A Gelu output is never below -0.17: its row scale is max(max x, 0.171) / 127 without an Abs pass. Rows whose
    largest value reaches 0.171 come out bit for bit as with max |x| (the graph with an Identity after the Gelu);
    a row whose Gelu values are all near its minimum (x ~ -0.75: values in [-0.17, -0.16]) gets the floor's
    coarser grid, clips nothing and stays within its quantization step of the fp32 product."""
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((64, 48)) / 8).astype(np.float32)
    x = rng.standard_normal((3, 7, 64)).astype(np.float32) * 2
    x[2, 3] = -0.75 + rng.standard_normal(64).astype(np.float32) * 0.05  # a row of Gelu values near -0.17
    outs, ops = {}, {}
    for gelu_node in (True, False):
        m = _gelu_then_matmul(w, gelu_node, opset)
        QuantizeDynamicInt8PerTokenPass(integer_to_float=opset >= 21)(m)
        onnx.checker.check_model(ir.to_proto(m), full_check=True)
        ops[gelu_node] = [n.op_type for n in m.graph]
        outs[gelu_node] = ort_session(m, disable_all=True).run(None, {"x": x})[0]
    assert "Abs" not in ops[True] and ops[False].count("Abs") == 1
    assert len(ops[True]) == len(ops[False]) - 2  # no Abs, no Identity
    rest = np.ones(x.shape[:2], bool)
    rest[2, 3] = False
    assert np.array_equal(outs[True][rest], outs[False][rest])
    gelu = ort_session(_gelu_then_matmul(np.eye(64, dtype=np.float32), True, opset), disable_all=True).run(None, {"x": x})[0]
    assert gelu[2, 3].max() < GELU_FLOOR and gelu[2, 3].min() >= -GELU_FLOOR
    assert not np.array_equal(outs[True][2, 3], outs[False][2, 3])  # the floor's grid, not the row's own
    step = GELU_FLOOR / 127 / 2 * np.abs(w).sum(0)  # at most half a step per input, times |w| summed
    assert np.all(np.abs(outs[True][2, 3] - gelu[2, 3] @ w) <= step + 1e-6)


@pytest.mark.parametrize("reduce_range", REDUCE_RANGE)
def test_numerics_on_the_generated_encoder_are_within_the_quantization_step(reduce_range):
    from test_quantize import ROWS, _check_quantized, _weight_step_error

    feeds = random_token_feeds(batch=ROWS)
    ref = ort_session(tiny_encoder_classifier()).run(None, feeds)[0]
    m = tiny_encoder_classifier()
    QuantizeDynamicInt8PerTokenPass(reduce_range=reduce_range)(m)
    got = ort_session(m).run(None, feeds)[0]
    rel_step, matmuls = _weight_step_error(tiny_encoder_classifier(), 64 if reduce_range else 127, per_channel=True)
    _check_quantized(got, ref, rel_step, matmuls, activations=True)


def _made(spec):
    from dyncompile.passes import CompileContext, build_passes

    (p,) = build_passes(spec, CompileContext(options={"provider": "cpu"}))
    return p


def test_the_option_is_a_dynamic_format_and_keeps_named_matmuls_fp32():
    from dyncompile.errors import PassConfigError

    made = _made
    p = made("quantize-int8{format=dynamic,activations=per-token,fp32_nodes=fc2}")
    assert isinstance(p, QuantizeDynamicInt8PerTokenPass) and p.exclude_nodes == ("fc2",)
    assert isinstance(made("quantize-int8{format=dynamic}"), QuantizeDynamicInt8Pass)  # per-tensor stays the default
    for bad in ("quantize-int8{format=qdq-weights,activations=per-token}",
                "quantize-int8{format=dynamic,activations=per-token,per_channel=false}"):
        with pytest.raises(PassConfigError, match="per-token is a dynamic format"):
            made(bad)
    from test_quantize import _gelu_mlp

    g = _gelu_mlp()
    QuantizeDynamicInt8PerTokenPass(keep_fp32="ffn-out")(g)
    assert [n.inputs[1].name for n in g.graph if n.op_type == "MatMul"] == ["w2"]
    assert json.loads(g.metadata_props[_keys.QUANTIZED])["fp32_matmuls_kept"] == 1


def test_real_encoder_rows_do_not_depend_on_their_batch(minilm, movie_test_rows):
    """MiniLM-L6 on real, padded rows: per-token int8 gives each row the logits it gets alone (the padding and the
    other rows never enter its scales); ORT's per-tensor int8 does not (negative control), and per-token is the
    closer of the two to fp32."""
    from dyncompile.runtime.text import TextEncoder

    texts = [r["text"] for r in movie_test_rows[:8]]
    feeds = TextEncoder(minilm.tokenizer_path, max_length=128)(texts)
    assert (feeds["attention_mask"] == 0).any()
    names = [v.name for v in ir.load(minilm.onnx_path).graph.inputs]
    feeds = {k: v for k, v in feeds.items() if k in names}
    ref = ort_session(minilm.onnx_path).run(None, feeds)[0]

    def batch_and_alone(p):
        m = ir.load(minilm.onnx_path)
        assert p(m).modified
        s = ort_session(m)
        got = s.run(None, feeds)[0]
        alone = np.stack([s.run(None, {k: v[i:i + 1, :int(feeds["attention_mask"][i].sum())] for k, v in feeds.items()})[0][0]
                          for i in range(len(texts))])
        return got, alone

    pt, pt_alone = batch_and_alone(QuantizeDynamicInt8PerTokenPass())
    assert np.abs(pt - pt_alone).max() <= 1e-5
    dyn, dyn_alone = batch_and_alone(QuantizeDynamicInt8Pass(per_channel=True))
    assert np.abs(dyn - dyn_alone).max() > 1e-3  # the batch's range moved every row's grid
    assert np.abs(pt_alone - ref).mean() < np.abs(dyn_alone - ref).mean()


def _weight_is_an_input() -> ir.Model:
    """One MatMul whose weight is a graph input, not an initializer: nothing an int8 pass can quantize."""
    x = ir.val("x", ir.DataType.FLOAT, ir.Shape([1, 4, 8]))
    w = ir.val("w", ir.DataType.FLOAT, ir.Shape([8, 3]))
    tape = ir.tape.Tape()
    y = tape.op("MatMul", [x, w], name="proj")
    y.name, y.dtype, y.shape = "y", ir.DataType.FLOAT, ir.Shape([1, 4, 3])
    return ir.Model(ir.Graph([x, w], [y], nodes=tape.nodes, opset_imports={"": 18}), ir_version=10)


def test_a_graph_without_weight_matmuls_is_left_alone_with_a_reason(caplog):
    """Named on a graph it cannot fire on (the weight is a graph input, not an initializer): unchanged, and a
    WARNING at the default verbosity that says why and what to do."""
    import logging

    m = _weight_is_an_input()
    with caplog.at_level(logging.WARNING):
        res = run_pipeline([QuantizeDynamicInt8PerTokenPass()], m, check="none")
    assert not res.modified and [n.op_type for n in m.graph] == ["MatMul"] and _keys.QUANTIZED not in m.metadata_props
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("quantize-int8" in t and "0 of the 1 MatMul nodes read a float weight initializer" in t
               and "leave quantize-int8 out" in t for t in msgs), msgs


# --- activations=mixed: per-token for the GELU-fed MatMuls, ORT's per-tensor elsewhere -------------------------


@pytest.mark.parametrize("reduce_range", REDUCE_RANGE)
def test_mixed_structure_numerics_and_idempotence(reduce_range):
    """On a GELU MLP: fc1 gets ORT's per-tensor DynamicQuantizeLinear, fc2 (GELU-fed) the per-token rewrite. The
    logits equal ORT's per-tensor fc1 followed by the numpy per-token emulation of fc2, with ORT's fusions off
    and on; a second run changes nothing."""
    from test_quantize import _gelu_mlp

    from dyncompile.passes.quantize_weights import QuantizeDynamicInt8MixedPass

    m = _gelu_mlp()
    res = run_pipeline([QuantizeDynamicInt8MixedPass(reduce_range=reduce_range)], m, check="each")  # full_check each
    assert res.modified
    ops = [n.op_type for n in m.graph]
    assert ops.count("MatMulInteger") == 2 and "MatMul" not in ops
    assert ops.count("DynamicQuantizeLinear") == 1 and ops.count("ReduceMax") == 1
    pt_matmul = [n for n in m.graph if n.op_type == "MatMulInteger" and n.name.endswith("/pt_matmul")]
    assert [n.name for n in pt_matmul] == ["fc2/pt_matmul"]
    meta = json.loads(m.metadata_props[_keys.QUANTIZED])
    assert meta["scheme"] == "int8-dynamic-mixed" and meta["per_token_matmuls"] == 1
    assert meta["reduce_range"] is reduce_range
    assert QuantizeDynamicInt8MixedPass()(m).modified is False
    # reference: ORT's per-tensor fc1 (fc2 left fp32), GELU output exposed, fc2 emulated per token
    ref = _gelu_mlp()
    QuantizeDynamicInt8Pass(per_channel=True, reduce_range=reduce_range, keep_fp32="ffn-out")(ref)
    fc2 = next(n for n in ref.graph if n.name == "fc2")
    ref.graph.outputs.append(fc2.inputs[0])
    x = np.random.default_rng(1).standard_normal((6, 64)).astype(np.float32) * 3
    _, gelu = ort_session(ref).run(None, {"x": x})
    w2 = _gelu_mlp().graph.initializers["w2"].const_value.numpy()
    want = _emulate(gelu.astype(np.float64), w2.astype(np.float64), reduce_range)
    for disable_all in (True, False):
        got = ort_session(m, disable_all=disable_all).run(None, {"x": x})[0]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


def test_mixed_without_a_gelu_is_per_tensor_and_the_option_is_checked():
    from dyncompile.errors import PassConfigError
    from dyncompile.passes.quantize_weights import QuantizeDynamicInt8MixedPass

    m, ref = tiny_encoder_classifier(), tiny_encoder_classifier()  # ReLU: nothing is GELU-fed
    QuantizeDynamicInt8MixedPass()(m)
    QuantizeDynamicInt8Pass(per_channel=True)(ref)
    assert sorted(n.op_type for n in m.graph) == sorted(n.op_type for n in ref.graph)
    assert json.loads(m.metadata_props[_keys.QUANTIZED])["per_token_matmuls"] == 0
    assert not [n for n in m.graph.initializers if n.startswith("dyncompile_pt_")]  # no per-token constants left over
    bare = _weight_is_an_input()  # no weight MatMul: not fired, nothing written
    assert not QuantizeDynamicInt8MixedPass()(bare).modified and _keys.QUANTIZED not in bare.metadata_props
    assert isinstance(_made("quantize-int8{format=dynamic,activations=mixed}"), QuantizeDynamicInt8MixedPass)
    for bad, why in (("quantize-int8{format=qdq-weights,activations=mixed}", "mixed is a dynamic format"),
                     ("quantize-int8{format=dynamic,activations=mixed,keep_fp32=ffn-out}", "drop keep_fp32")):
        with pytest.raises(PassConfigError, match=why):
            _made(bad)


def test_real_encoder_mixed_is_closer_to_fp32_than_per_tensor(minilm, movie_test_rows):
    """MiniLM-L6 on real rows: the 6 GELU-fed MatMuls go per-token, and the logits are closer to fp32's than ORT's
    per-tensor int8 (the same weights and kernels everywhere else)."""
    from dyncompile.passes.quantize_weights import QuantizeDynamicInt8MixedPass
    from dyncompile.runtime.text import TextEncoder

    names = [v.name for v in ir.load(minilm.onnx_path).graph.inputs]
    enc = TextEncoder(minilm.tokenizer_path, max_length=128)
    rows = [{k: v for k, v in enc([r["text"]]).items() if k in names} for r in movie_test_rows[:24]]
    ref = ort_session(minilm.onnx_path)
    want = np.concatenate([ref.run(None, f)[0] for f in rows])

    def err(p):
        m = ir.load(minilm.onnx_path)
        assert p(m).modified
        s = ort_session(m)
        return np.abs(np.concatenate([s.run(None, f)[0] for f in rows]) - want).mean(), m

    mixed, m = err(QuantizeDynamicInt8MixedPass())
    assert json.loads(m.metadata_props[_keys.QUANTIZED])["per_token_matmuls"] == 6
    dyn, _ = err(QuantizeDynamicInt8Pass(per_channel=True))
    assert mixed < dyn, (mixed, dyn)
