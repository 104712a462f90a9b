"""smooth-activations (SmoothQuant folded into LayerNorm -> MatMul) and quantize-int8{format=static} (QDQ, calibrated)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from helpers import DATA, REDUCE_RANGE, ort_session, random_token_feeds, tiny_classifier_dir

import dyncompile
from dyncompile.models.synthetic import tiny_encoder_classifier
from dyncompile.passes import SmoothActivationsPass, _keys
from dyncompile.passes.quantize_search import GATE_INPUT, gated_fake_quant, quant_targets, static_qparams
from dyncompile.passes.quantize_weights import QuantizeStaticInt8Pass
from dyncompile.passes.smooth_activations import channel_absmax, channel_ranges, smoothing_groups


def _run(model, feeds, gate=None, disable_all=True):
    s = ort_session(model, disable_all=disable_all)
    names = {i.name for i in s.get_inputs()}
    f = {k: v for k, v in feeds.items() if k in names}
    if gate is not None:
        f[GATE_INPUT] = gate.astype(np.float32)
    return s.run(None, f)


def _outlier_model() -> ir.Model:
    """The tiny encoder with a few LayerNorm channels made outliers (x30 in gamma), as BERT-class LayerNorms have."""
    m = tiny_encoder_classifier()
    for v in m.graph.initializers.values():
        if v.name == "ln.scale":
            a = v.const_value.numpy().copy()
            a[[3, 17, 100]] *= 30.0
            v.const_value = ir.tensor(a, name=v.name)
    return m


def _ln_output_as_graph_output() -> ir.Model:
    """x -> LayerNorm -> {MatMul W1 -> out, graph output} : the LayerNorm's output is also read outside the group."""
    rng = np.random.default_rng(0)
    x = ir.val("x", ir.DataType.FLOAT, [2, 5, 8])
    g = ir.val("gamma", const_value=ir.tensor(rng.normal(1, 0.5, 8).astype(np.float32), name="gamma"))
    b = ir.val("beta", const_value=ir.tensor(rng.normal(0, 0.5, 8).astype(np.float32), name="beta"))
    w = ir.val("w", const_value=ir.tensor(rng.normal(0, 1, (8, 4)).astype(np.float32), name="w"))
    ln = ir.node("LayerNormalization", [x, g, b], {"axis": -1}, name="ln")
    ln.outputs[0].name = "h"
    mm = ir.node("MatMul", [ln.outputs[0], w], name="mm")
    mm.outputs[0].name = "y"
    for v, shape in ((ln.outputs[0], [2, 5, 8]), (mm.outputs[0], [2, 5, 4])):
        v.dtype, v.shape = ir.DataType.FLOAT, ir.Shape(shape)
    graph = ir.Graph([x], [mm.outputs[0], ln.outputs[0]], nodes=[ln, mm], initializers=[g, b, w], opset_imports={"": 18}, name="ln_graph")
    return ir.Model(graph, ir_version=10)


def test_smoothing_is_exact_in_float_evens_the_channels_and_reports_honestly():
    """Golden: expected structure (gamma/beta and W rows scaled, one Mul for the residual readers, names kept), outputs
    equal to the original <= 1e-5 with ORT_DISABLE_ALL, the smoothed activation's outlier ratio falls, full_check,
    a second run reports False."""
    feeds = random_token_feeds(16, vocab=512, seed=3)
    original = _outlier_model()
    m = _outlier_model()
    groups, _ = smoothing_groups(m)
    assert len(groups) == 4 and all(len(mms) == 1 for _, mms in groups)  # each layer's LayerNorm feeds W1
    cut_names = [ln.outputs[0].name for ln, _ in groups]
    before = channel_absmax(m, cut_names, [feeds])
    w_before = {mm.name: mm.inputs[1].const_value.numpy().copy() for _, mms in groups for mm in mms}
    r = SmoothActivationsPass([feeds], alpha=0.5)(m)
    assert r.modified
    ref, out = _run(original, feeds), _run(m, feeds)
    assert max(float(np.abs(a - b).max()) for a, b in zip(ref, out, strict=True)) <= 1e-5 * max(1.0, float(np.abs(ref[0]).max()))
    onnx.checker.check_model(ir.to_proto(m), full_check=True)
    values = ir.convenience.create_value_mapping(m.graph)
    smoothed = {name: values[f"{name}/smoothed"] for name in cut_names}
    for name in cut_names:  # the old name holds the unsmoothed tensor (Mul of the smoothed one and s)
        assert values[name].producer().op_type == "Mul"
        assert values[name].producer().inputs[0] is smoothed[name]
        assert {u.node.op_type for u in smoothed[name].uses()} == {"MatMul", "Mul"}
    s0 = values[f"{cut_names[0]}/smooth_scale"].const_value.numpy()
    mm0 = next(u.node for u in smoothed[cut_names[0]].uses() if u.node.op_type == "MatMul")
    np.testing.assert_allclose(mm0.inputs[1].const_value.numpy(), w_before[mm0.name] * s0[:, None], rtol=1e-6)
    assert len({n.inputs[1].name for n in m.graph if n.op_type == "LayerNormalization"}) == 5  # shared gamma copied
    after = channel_absmax(m, [f"{n}/smoothed" for n in cut_names], [feeds])
    ratio = lambda a: float(a.max() / np.median(a))  # noqa: E731
    assert all(ratio(after[f"{n}/smoothed"]) < 0.5 * ratio(before[n]) for n in cut_names)
    meta = json.loads(m.metadata_props[_keys.SMOOTHED])
    assert meta["groups"] == 4 and meta["layers"]["num_layers"] == 4 and len(list(m.graph)) == len(list(original.graph)) + 4
    assert SmoothActivationsPass([feeds])(m).modified is False


def test_smoothing_keeps_a_graph_output_read_from_the_layernorm():
    m, original = _ln_output_as_graph_output(), _ln_output_as_graph_output()
    feeds = {"x": np.random.default_rng(1).normal(0, 3, (2, 5, 8)).astype(np.float32)}
    assert SmoothActivationsPass([feeds], alpha=0.8)(m).modified
    assert [v.name for v in m.graph.outputs] == ["y", "h"]
    assert m.graph.outputs[1].producer().op_type == "Mul"
    for a, b in zip(_run(original, feeds), _run(m, feeds), strict=True):
        np.testing.assert_allclose(b, a, atol=1e-5)
    onnx.checker.check_model(ir.to_proto(m), full_check=True)


def test_smoothing_does_not_fire_without_a_layernorm_feeding_a_matmul():
    m = _ln_output_as_graph_output()
    next(n for n in m.graph if n.name == "mm").replace_input_with(0, m.graph.inputs[0])  # the MatMul reads x, not the LayerNorm
    r = SmoothActivationsPass([{"x": np.ones((2, 5, 8), np.float32)}])(m)
    assert r.modified is False and "feeds a MatMul" in r.message()
    assert _keys.SMOOTHED not in m.metadata_props


@pytest.mark.parametrize("reduce_range", REDUCE_RANGE)
def test_static_int8_structure_fusion_and_simulation(reduce_range):
    """QDQ on every constant-weight MatMul (per-channel int8 weights, uint8 activations, outputs float), names kept in
    fp32 are untouched; ORT's CPU EP fuses every quantized MatMul into MatMulIntegerToFloat; the gated fake-quant
    model at gate 1 with :func:`static_qparams` of the calibrated ranges reproduces the real static model."""
    feeds = random_token_feeds(16, vocab=512, seed=3)
    m = tiny_encoder_classifier()
    targets = quant_targets(m)
    keep = targets[0].node
    q = tiny_encoder_classifier()
    assert QuantizeStaticInt8Pass([feeds], exclude_nodes=[keep], reduce_range=reduce_range)(q).modified
    g = q.graph
    mms = {n.name: n for n in g if n.op_type == "MatMul"}
    assert mms[keep].inputs[1].const_value is not None  # kept fp32: reads its float weight
    for t in targets[1:]:
        a, w = (mms[t.node].inputs[i].producer() for i in (0, 1))
        assert a.op_type == w.op_type == "DequantizeLinear"
        assert w.inputs[0].const_value.dtype == ir.DataType.INT8 and w.attributes.get_int("axis", 1) == 1
        assert np.abs(w.inputs[0].const_value.numpy().astype(int)).max() == (64 if reduce_range else 127)
        assert len(w.inputs[1].const_value.shape) == 1  # one scale per output channel
        assert a.inputs[0].producer().op_type == "QuantizeLinear" and a.inputs[2].const_value.dtype == ir.DataType.UINT8
        assert not any(u.node.op_type == "QuantizeLinear" for u in mms[t.node].outputs[0].uses())
        assert [u.node for u in a.outputs[0].uses()] == [mms[t.node]]  # the residual Add reads the float tensor
    onnx.checker.check_model(ir.to_proto(q), full_check=True)
    meta = json.loads(q.metadata_props[_keys.QUANTIZED])
    assert meta["scheme"] == "int8-static-qdq" and meta["fp32_matmuls_kept"] == 1
    assert meta["reduce_range"] is reduce_range
    assert QuantizeStaticInt8Pass([feeds])(q).modified is False
    ref = _run(m, feeds)[0]
    real = _run(q, feeds, disable_all=False)[0]
    assert np.abs(real - ref).max() > 1e-3  # int8 changes the outputs
    nodes = {n.name: n for n in m.graph}
    xs = {t.node: nodes[t.node].inputs[0].name for t in targets}
    ranges = channel_ranges(m, sorted(set(xs.values())), [feeds])
    qp = {k: static_qparams(float(ranges[x][0].min()), float(ranges[x][1].max()), False) for k, x in xs.items()}
    gated = ir.from_proto(onnx.load_from_string(gated_fake_quant(m, targets, True, qp,
                                                                 weight_max=64 if reduce_range else 127)))
    gate = np.ones(len(targets))
    gate[0] = 0.0
    sim = _run(gated, feeds, gate)[0]
    qdq = _run(q, feeds)[0]  # the QDQ graph as written (no fusion): exactly the simulation's arithmetic
    effect = np.sqrt(((real - ref) ** 2).mean())
    assert np.sqrt(((sim - qdq) ** 2).mean()) <= 1e-4 * effect
    # fused into MatMulIntegerToFloat: the same integer sums, a different float order for the scaling, which flips
    # the rounding of a few activations downstream (7-bit weights: 0.10 of int8's effect; a saturating kernel: ~1)
    assert np.sqrt(((sim - real) ** 2).mean()) < 0.2 * effect


def test_static_int8_fuses_every_matmul_on_the_cpu_ep(tmp_path):
    """uint8 activations: the CPU EP turns each DQ, DQ -> MatMul into MatMulIntegerToFloat (no weight dequantized
    per call); the check that fails if a QDQ layout change leaves MatMuls running in float."""
    import onnxruntime as ort

    feeds = random_token_feeds(16, vocab=512, seed=3)
    q = tiny_encoder_classifier()
    QuantizeStaticInt8Pass([feeds])(q)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    ort.InferenceSession(ir.to_proto(q).SerializeToString(), so, providers=["CPUExecutionProvider"])
    ops = [n.op_type for n in ir.load(tmp_path / "opt.onnx").graph]
    # the 2-D classifier MatMul + Add becomes a Gemm (ORT's MatMulAddFusion) on the dequantized weight
    assert ops.count("MatMulIntegerToFloat") == len(quant_targets(tiny_encoder_classifier())) - 1
    assert "MatMul" not in ops and ops.count("Gemm") == 1


def test_smooth_then_static_search_pipeline(minilm, tmp_path):
    """smooth-activations,quantize-int8{format=static,budget_share=...},early-exit: the search runs on the smoothed
    graph in the static format, the fallbacks stay float MatMuls, the rest are QDQ, the certificate is the real
    static model's; the If lowering puts every weight's DequantizeLinear in the graph of its MatMul (ORT fuses the
    pair only within one graph)."""
    d, calib = tiny_classifier_dir(tmp_path, minilm)
    res = dyncompile.compile(d / "model.onnx", "smooth-activations{rows=64},quantize-int8{format=static,budget_share=0.5,"
                             "sensitivity_rows=32,calib_rows=32},early-exit", tmp_path / "o", calib=str(calib),
                             budget=6.0, lowering="if", progress=False)
    q = res.plan.policy["quantization"]
    assert q["int8_format"] == "static" and q["certificate"]["rows"] == 210
    assert 0 < len(q["excluded"]) < len(q["table"])  # both kinds of MatMul in the graph
    m = ir.load(res.plan.directory / res.plan.files["model"].path)
    assert json.loads(m.metadata_props[_keys.QUANTIZED])["scheme"] == "int8-static-qdq"
    assert json.loads(m.metadata_props[_keys.SMOOTHED])["groups"] == 4
    mms = {n.name: n for n in m.graph.all_nodes() if n.op_type == "MatMul"}
    for name in q["excluded"]:
        assert mms[name].inputs[1].const_value is not None
    quantized = [n for n in mms.values() if n.inputs[1].producer() is not None
                 and n.inputs[1].producer().op_type == "DequantizeLinear"]
    assert len(quantized) == len(q["table"]) - len(q["excluded"])
    assert any(n.op_type == "If" for n in m.graph)
    weight_dqs = [n for n in m.graph.all_nodes() if n.op_type == "DequantizeLinear" and n.inputs[0].is_initializer()]
    assert len(weight_dqs) == len(quantized)
    assert all(u.node.graph is dq.graph for dq in weight_dqs for u in dq.outputs[0].uses())
    assert any(dq.graph is not m.graph for dq in weight_dqs)  # those of later layers went into the branches


@pytest.mark.parametrize("spec, text", [
    ("quantize-int8{format=static,keep_fp32=ffn-out}", "drop keep_fp32"),
    ("quantize-int8{format=static,calib_rows=2}", "calib_rows must be >= 8"),
    ("smooth-activations{alpha=1.5}", "alpha must be in"),
])
def test_static_and_smoothing_options_refused_with_one_clear_error(spec, text):
    from dyncompile.errors import PassConfigError
    from dyncompile.passes import CompileContext, build_passes

    with pytest.raises(PassConfigError, match=text):
        build_passes(spec, CompileContext(options={"calib": str(DATA / "movie-calib.jsonl")}))
    with pytest.raises(PassConfigError, match="--calib"):
        build_passes("quantize-int8{format=static}", CompileContext())


def test_clipped_forecast_never_lets_helpful_flips_pay_for_harmful_ones(minilm, tmp_path):
    """forecast=clipped: each count's forecast is at least the labelled forecast's (the loss clipped at 0 is >= the
    loss), the ranking is the same, and the plan records which forecast chose."""
    d, calib = tiny_classifier_dir(tmp_path, minilm)
    spec = "quantize-int8{{budget_share=0.5,sensitivity_rows=32,forecast={}}}"
    q = {f: dyncompile.compile(d / "model.onnx", spec.format(f), tmp_path / f, calib=str(calib), budget=6.0,
                               progress=False).plan.policy["quantization"] for f in ("labels", "clipped")}
    assert q["clipped"]["forecast"] == "clipped" and q["labels"]["forecast"] == "labels"
    assert [r["rank"] for r in q["clipped"]["table"]] == [r["rank"] for r in q["labels"]["table"]]
    lab = {s["fp32_kept"]: s for s in q["labels"]["steps"]}
    both = [s for s in q["clipped"]["steps"] if s["fp32_kept"] in lab]
    assert both and all(s["predicted_bound"] >= lab[s["fp32_kept"]]["predicted_bound"] - 1e-9 for s in both)
    # so a count the clipped forecast accepts, the labelled one accepted too: the clipped scan stops no earlier
    assert len(q["clipped"]["excluded"]) >= len(q["labels"]["excluded"])
