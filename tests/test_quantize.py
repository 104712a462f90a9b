"""quantize-int8 / quantize-int4 passes: structure, idempotence, numerics, composition with early exit."""

from __future__ import annotations

import json
import logging

import numpy as np
import onnx_ir as ir
import pytest
from helpers import DATA, ort_session, random_token_feeds

import dyncompile
from dyncompile.models.synthetic import tiny_encoder_classifier
from dyncompile.passes import QuantizeDynamicInt8Pass, QuantizeWeightsInt4Pass, _keys, run_pipeline


def _ops(m: ir.Model) -> set[str]:
    return {n.op_type for n in m.graph.all_nodes()}


#: rows of random token ids (with varied padding) for the numeric checks: enough for an agreement rate
ROWS = 400


def _weight_step_error(model: ir.Model, qmax: int, *, block: int | None = None, per_channel: bool = True,
                       asymmetric: bool = False):
    """``(e, n)``: the RMS error of rounding each MatMul weight to a symmetric ``±qmax`` grid, relative to the
    weight's RMS (one scale per column, per matrix, or per ``block`` rows of a column), and the number ``n``
    of such MatMuls. This is the quantization step's size on this model's weights, measured in numpy.
    ``asymmetric``: ``2 qmax + 1`` levels spanning each block's ``[min(lo, 0), max(hi, 0)]`` with an integer
    zero point instead (int4: 16 levels, as MatMulNBits with zero points)."""
    errs = []
    for node in model.graph:
        w = node.inputs[1] if node.op_type == "MatMul" else None
        if w is None or w.const_value is None or len(w.const_value.shape) != 2:
            continue
        a = w.const_value.numpy().astype(np.float64)
        g = a.reshape(a.shape[0] // block, block, a.shape[1]) if block else a
        axis = 1 if block else (0 if per_channel else None)
        if asymmetric:
            lo = np.minimum(g.min(axis=axis, keepdims=True), 0)
            hi = np.maximum(g.max(axis=axis, keepdims=True), 0)
            scale = (hi - lo) / (2 * qmax + 1)
            zp = np.rint(-lo / scale)
            q = (np.clip(np.rint(g / scale) + zp, 0, 2 * qmax + 1) - zp) * scale
        else:
            scale = np.abs(g).max(axis=axis, keepdims=True) / qmax
            q = np.clip(np.rint(g / scale), -qmax, qmax) * scale
        errs.append(((q - g) ** 2).mean() / (g**2).mean())
    return float(np.sqrt(np.mean(errs))), len(errs)


def _check_quantized(got: np.ndarray, ref: np.ndarray, rel_step: float, matmuls: int, *, activations: bool):
    """Quantized logits vs fp32 logits, with bounds derived from the quantization step.

    Each quantized MatMul adds an output error of about ``rel_step`` of its output's size (x2 in variance
    when activations are quantized too); LayerNorm keeps the scale, so ``matmuls`` of them in series add
    up in quadrature: expected RMS error ``sigma = sqrt(matmuls * (1 + activations)) * rel_step * std(ref)``.
    Checked: the RMS error is at most ``sigma``, no error exceeds ``5 sigma``, and the argmax agrees on at
    least every row whose fp32 top-2 margin is beyond ``3 sqrt(2) sigma`` (the std of a difference of two
    logit errors, 3 sigma): a flip needs an error that large.
    """
    sigma = np.sqrt(matmuls * (2 if activations else 1)) * rel_step * float(ref.std())
    err = got - ref
    assert float(np.sqrt((err**2).mean())) <= sigma, (float(np.sqrt((err**2).mean())), sigma)
    assert float(np.abs(err).max()) <= 5 * sigma, (float(np.abs(err).max()), sigma)
    top2 = np.sort(ref, axis=-1)[:, -2:]
    safe = (top2[:, 1] - top2[:, 0]) > 3 * np.sqrt(2) * sigma
    agree = got.argmax(-1) == ref.argmax(-1)
    assert safe.any(), "no row is beyond the margin: the argmax check would say nothing"
    assert agree[safe].all() and agree.mean() >= safe.mean(), (agree.mean(), safe.mean())


def test_int8_structure_idempotence_and_numerics():
    feeds = random_token_feeds(batch=ROWS)
    ref = ort_session(tiny_encoder_classifier()).run(None, feeds)[0]
    m = tiny_encoder_classifier()
    res = run_pipeline([QuantizeDynamicInt8Pass()], m, check="each")
    assert res.modified and "MatMulInteger" in _ops(m) and "DynamicQuantizeLinear" in _ops(m)
    assert [v.name for v in m.graph.outputs] == ["logits"]
    assert QuantizeDynamicInt8Pass()(m).modified is False
    got = ort_session(m).run(None, feeds)[0]
    # ORT's dynamic int8: one scale per weight matrix, activations quantized per tensor at run time
    rel_step, matmuls = _weight_step_error(tiny_encoder_classifier(), 127, per_channel=False)
    _check_quantized(got, ref, rel_step, matmuls, activations=True)


def test_int4_structure_idempotence_and_numerics():
    feeds = random_token_feeds(batch=ROWS)
    ref = ort_session(tiny_encoder_classifier()).run(None, feeds)[0]
    m = tiny_encoder_classifier()
    res = run_pipeline([QuantizeWeightsInt4Pass(block_size=32, symmetric=True)], m, check="none")
    assert res.modified and "MatMulNBits" in _ops(m)
    assert QuantizeWeightsInt4Pass()(m).modified is False
    assert all(n.attributes["accuracy_level"].as_int() == 4 for n in m.graph if n.op_type == "MatMulNBits")
    got = ort_session(m).run(None, feeds)[0]
    # symmetric 4-bit weights, one scale per 32 rows of a column; accuracy_level 4 quantizes activations
    rel_step, matmuls = _weight_step_error(tiny_encoder_classifier(), 7, block=32)
    _check_quantized(got, ref, rel_step, matmuls, activations=True)


def test_int4_default_is_asymmetric_blocks_of_128():
    """The default format (block 128 with zero points, NNCF's int4 format): structure and numerics against the
    asymmetric grid's step."""
    feeds = random_token_feeds(batch=ROWS)
    ref = ort_session(tiny_encoder_classifier()).run(None, feeds)[0]
    m = tiny_encoder_classifier()
    assert run_pipeline([QuantizeWeightsInt4Pass()], m, check="none").modified
    nbits = [n for n in m.graph if n.op_type == "MatMulNBits"]
    assert nbits and all(n.attributes["block_size"].as_int() == 128 for n in nbits)
    # input 3 = zero points (a symmetric quantization has none)
    assert all(len(n.inputs) > 3 and n.inputs[3] is not None and n.inputs[3].const_value is not None for n in nbits)
    got = ort_session(m).run(None, feeds)[0]
    rel_step, matmuls = _weight_step_error(tiny_encoder_classifier(), 7, block=128, asymmetric=True)
    _check_quantized(got, ref, rel_step, matmuls, activations=True)


def test_dyncompile_metadata_survives_quantization():
    m = tiny_encoder_classifier()
    m.metadata_props["dyncompile.task"] = "text-classification"
    QuantizeDynamicInt8Pass()(m)
    assert m.metadata_props["dyncompile.task"] == "text-classification"


def test_int8_then_early_exit_on_minilm(minilm, tmp_path):
    calib = tmp_path / "calib.jsonl"
    calib.write_text("\n".join((DATA / "movie-calib.jsonl").read_text().splitlines()[:300]) + "\n")
    res = dyncompile.compile(
        minilm.onnx_path, "quantize-int8,early-exit", tmp_path / "q8ee", calib=str(calib), budget=2.0,
        lowering="staged", confidence="none", progress=False,
    )
    assert [r.name for r in res.pipeline.records] == [  # the -O2 presets (fused attention, key mask, GELU) first
        "FuseEncoderAttentionPass", "KeyPaddingMaskPass", "FuseGeluPass", "TabulateLengthValuesPass", "RaiseOpsetPass",
        "QuantizeDynamicInt8Pass", "FitExitHeadsPass", "InsertEarlyExitPass"]
    seg0 = ir.load(res.plan.directory / res.plan.files["segment0"].path)
    assert "MatMulInteger" in _ops(seg0)  # the heads were fitted on the quantized model's features
    m = dyncompile.load(res.plan_dir)
    rows = [json.loads(x) for x in (DATA / "movie-test.jsonl").read_text().splitlines()[:ROWS]]
    texts, labels = [r["text"] for r in rows], np.array([r["label"] for r in rows])
    p = m.predict_proba(texts)
    acc = float((p.argmax(-1) == labels).mean())
    # the fp32 original on the same rows; the plan may drop up to the budget (2 points, calibrated on other
    # rows), plus the sampling error of a drop measured on len(rows) rows (3 sigma, binomial)
    from dyncompile.models.evaluate import classifier_logits

    base = float((classifier_logits(minilm, texts).argmax(-1) == labels).mean())
    margin = 3 * np.sqrt(base * (1 - base) / len(rows))
    assert acc >= base - 0.02 - margin, (acc, base, margin)
    assert m.last_info["exit_layer"].min() < 6


# --- int8 x early exit: the budget is the total drop against the fp32 original ---------------------------


def _ref_case(n=1000, seed=0):
    """fp32 reference right on 92 % of the rows; the 'int8' model flips 10 of its right rows (-1.0 point)."""
    from dyncompile.runtime.rules.exit_rule import softmax as _softmax

    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    ref_pred = np.where(rng.random(n) < 0.92, y, 1 - y)
    conf = rng.uniform(0.6, 0.99, n)
    ref = np.stack([np.where(ref_pred == 0, conf, 1 - conf), np.where(ref_pred == 1, conf, 1 - conf)], 1)
    q = ref.copy()
    flip = np.flatnonzero(ref_pred == y)[:10]
    q[flip] = q[flip, ::-1]
    # two exits: noisy copies of the int8 model's logits (confident rows are mostly right)
    exits = [_softmax(np.log(q) * s + rng.normal(0, 0.7, q.shape)) for s in (0.8, 1.2)]
    return np.stack(exits), q, ref, y


def test_reference_budget_splits_the_budget():
    from dyncompile.passes.early_exit.calibrate import reference_budget

    _, q, ref, y = _ref_case()
    left, info = reference_budget(1.5, q, ref, y)
    assert info["spent_by_model"] == 1.0 and left == 0.5 and not info["budget_exceeded"]
    assert info["reference_accuracy"] - info["model_accuracy"] == 1.0
    left, info = reference_budget(0.5, q, ref, y)
    assert left == 0.0 and info["budget_exceeded"]
    left, info = reference_budget(1.0, ref, q, y)  # the model beats its reference: the gain is not spent
    assert info["spent_by_model"] == 0.0 and left == 1.0
    left, info = reference_budget(1.5, q, ref, None)  # no labels: disagreement with the reference
    assert info["metric"] == "agreement" and info["spent_by_model"] == 1.0 and left == 0.5


def test_calibrate_exits_against_the_reference_keeps_the_total_drop_within_budget():
    from dyncompile.passes.early_exit.calibrate import calibrate_exits, exit_decisions

    oof, q, ref, y = _ref_case()
    kw = dict(exits=[1, 2], num_layers=4, criterion="entropy", patience=2)
    for budget in (1.5, 2.0, 3.0):
        own = calibrate_exits(oof, q, y, budget=budget, **kw)
        tot = calibrate_exits(oof, q, y, budget=budget, reference_probs=ref, **kw)
        same = calibrate_exits(oof, q, y, budget=budget - 1.0, **kw)
        assert tot.thresholds == same.thresholds and tot.budget == budget  # the exits get budget - 1.0
        assert tot.reference["budget_left"] == budget - 1.0 and tot.reference["spent_by_model"] == 1.0
        probs = np.concatenate([oof, q[None]])
        pred = probs[exit_decisions(probs, tot), np.arange(len(y))].argmax(1)
        drop = ((ref.argmax(1) == y).mean() - (pred == y).mean()) * 100
        assert drop <= budget + 1e-9 and abs(drop - tot.reference["expected_drop_vs_reference"]) < 1e-6
        assert own.expected_speedup >= tot.expected_speedup  # measured against itself it may exit more
    over = calibrate_exits(oof, q, y, budget=0.5, reference_probs=ref, **kw)
    assert over.reference["budget_exceeded"] and any("already drops 1.00 points" in w for w in over.warnings)


def _gelu_mlp() -> ir.Model:
    """x -> MatMul(W1) -> erf-GELU (as torch exports it) -> MatMul(W2) -> logits."""
    rng = np.random.default_rng(0)
    tape, inits = ir.tape.Tape(), []
    x = ir.val("x", ir.DataType.FLOAT, ir.Shape(["batch", 64]))

    def c(arr, name):
        inits.append(ir.val(name, const_value=ir.tensor(np.asarray(arr, np.float32), name=name)))
        return inits[-1]

    h = tape.op("MatMul", [x, c(rng.standard_normal((64, 128)) / 8, "w1")], name="fc1")
    erf = tape.op("Erf", [tape.op("Div", [h, c(np.sqrt(2.0), "sqrt2")])])
    gelu = tape.op("Mul", [h, tape.op("Mul", [tape.op("Add", [erf, c(1.0, "one")]), c(0.5, "half")])])
    y = tape.op("MatMul", [gelu, c(rng.standard_normal((128, 2)) / 11, "w2")], name="fc2")
    y.name, y.dtype, y.shape = "logits", ir.DataType.FLOAT, ir.Shape(["batch", 2])
    g = ir.Graph([x], [y], nodes=tape.nodes, initializers=inits, opset_imports={"": 18}, name="gelu_mlp")
    return ir.Model(g, ir_version=10)


def test_int8_keep_fp32_ffn_out_and_quantized_metadata():
    from dyncompile.passes.quantize_weights import gelu_fed_matmuls

    assert gelu_fed_matmuls(_gelu_mlp()) == ["fc2"]
    assert gelu_fed_matmuls(tiny_encoder_classifier()) == []  # Relu blocks: nothing is GELU-fed
    m = _gelu_mlp()
    res = run_pipeline([QuantizeDynamicInt8Pass(keep_fp32="ffn-out")], m, check="each")
    assert res.modified
    mms = [n for n in m.graph if n.op_type == "MatMul"]
    assert len(mms) == 1 and mms[0].inputs[1].name == "w2" and "MatMulInteger" in _ops(m)
    meta = json.loads(m.metadata_props[_keys.QUANTIZED])
    assert meta["keep_fp32"] == ["ffn-out"] and meta["fp32_matmuls_kept"] == 1

    from dyncompile.errors import PassConfigError

    with pytest.raises(PassConfigError, match="ffn-out"):
        QuantizeDynamicInt8Pass(keep_fp32="attention")


def test_int8_early_exit_pipeline_budget_is_against_the_fp32_original(minilm, tmp_path):
    """quantize-int8,early-exit on a tiny generated encoder: heads on int8 features, budget vs the fp32 input."""
    import shutil

    from dyncompile.runtime.text import TextEncoder

    d = tmp_path / "tiny"
    d.mkdir()
    ir.save(tiny_encoder_classifier(num_layers=4, vocab=30522), d / "model.onnx")
    shutil.copy(minilm.tokenizer_path, d / "tokenizer.json")
    lines = (DATA / "movie-calib.jsonl").read_text().splitlines()[:200]
    calib = tmp_path / "calib.jsonl"
    calib.write_text("\n".join(lines) + "\n")
    rows = [json.loads(x) for x in lines]
    feeds = TextEncoder(d / "tokenizer.json", max_length=512)([r["text"] for r in rows])
    fp32 = ort_session(d / "model.onnx", disable_all=False).run(None, {k: feeds[k] for k in ("input_ids", "attention_mask")})[0]
    fp32_acc = float((fp32.argmax(-1) == np.array([r["label"] for r in rows])).mean() * 100)

    # per-token int8: a row's answer does not depend on the rows batched with it (per-tensor ranges do, and the
    # calibration batches rows its own way), so the int8 model's accuracy can be measured again here
    q8 = "quantize-int8{format=dynamic,activations=per-token}"
    res = dyncompile.compile(d / "model.onnx", f"{q8},early-exit", tmp_path / "out", calib=str(calib),
                             budget=3.0, lowering="staged", exits="2", confidence="none", progress=False)
    seg0 = _ops(ir.load(res.plan.directory / res.plan.files["segment0"].path))
    assert {"MatMulInteger", "MatMulIntegerToFloat"} & seg0  # heads on int8
    c = res.plan.policy["early_exit"]["calibration"]
    ref = c["reference"]
    assert c["budget"] == 3.0 and abs(ref["reference_accuracy"] - fp32_acc) < 1e-6
    # the int8 model's own accuracy, measured here independently: what it spends is its drop vs fp32
    alone = dyncompile.compile(d / "model.onnx", q8, tmp_path / "int8", progress=False).plan.directory
    int8 = dyncompile.load(alone).predict_proba([r["text"] for r in rows], batch_size=32)
    int8_acc = float((int8.argmax(-1) == np.array([r["label"] for r in rows])).mean() * 100)
    one_row = 100 / len(rows)  # ORT's int8 kernels may round a near-tie row differently between sessions
    assert abs(ref["model_accuracy"] - int8_acc) <= one_row + 1e-9
    assert abs(ref["budget_left"] - max(0.0, 3.0 - max(0.0, fp32_acc - int8_acc))) <= one_row + 1e-9
    assert ref["expected_drop_vs_reference"] <= 3.0 + 1e-9
    from dyncompile.passes import CompileContext, build_passes  # budget_reference=self: measured against int8

    ctx = CompileContext(model_path=d / "model.onnx", options={"calib": str(calib)})
    assert build_passes("early-exit", ctx)[0].reference_model == d / "model.onnx"
    assert build_passes("early-exit{budget_reference=self}", ctx)[0].reference_model is None


def test_int8_qdq_weights_structure_numerics_idempotence():
    from dyncompile.passes.quantize_weights import QuantizeWeightsInt8Pass

    feeds = random_token_feeds(batch=ROWS)
    ref = ort_session(tiny_encoder_classifier()).run(None, feeds)[0]
    m = tiny_encoder_classifier()
    assert run_pipeline([QuantizeWeightsInt8Pass()], m, check="each").modified
    mms = [n for n in m.graph if n.op_type == "MatMul"]
    assert len(mms) == 9 and all(n.inputs[1].producer().op_type == "DequantizeLinear" for n in mms)
    assert all(m.graph.node(m.graph.index(n) - 1).op_type == "DequantizeLinear" for n in mms)  # right before its MatMul
    assert not any(k.startswith("layer0.w1") and not k.endswith((".int8", ".scale", ".zero")) for k in m.graph.initializers)
    assert json.loads(m.metadata_props[_keys.QUANTIZED])["scheme"] == "int8-weights-qdq"
    assert QuantizeWeightsInt8Pass()(m).modified is False
    got = ort_session(m).run(None, feeds)[0]
    rel_step, matmuls = _weight_step_error(tiny_encoder_classifier(), 127)  # one scale per output channel
    _check_quantized(got, ref, rel_step, matmuls, activations=False)  # weight-only: activations stay float
    g = _gelu_mlp()
    QuantizeWeightsInt8Pass(keep_fp32="ffn-out")(g)
    assert [n.inputs[1].name for n in g.graph if n.op_type == "MatMul"] == ["w1.dequantized.0", "w2"]


def test_int8_format_auto_follows_the_provider():
    from dyncompile.errors import PassConfigError
    from dyncompile.passes import CompileContext, build_passes
    from dyncompile.passes.quantize_weights import QuantizeWeightsInt8Pass

    def made(spec, provider=None):
        (p,) = build_passes(spec, CompileContext(options={"provider": provider} if provider else {}))
        return p

    assert isinstance(made("quantize-int8"), QuantizeDynamicInt8Pass)
    assert isinstance(made("quantize-int8", "cpu"), QuantizeDynamicInt8Pass)
    ov = made("quantize-int8{keep_fp32=ffn-out}", "openvino")
    assert isinstance(ov, QuantizeWeightsInt8Pass) and ov.per_channel and ov.keep_fp32 == ("ffn-out",)
    assert isinstance(made("quantize-int8{format=dynamic}", "openvino"), QuantizeDynamicInt8Pass)
    assert made("quantize-int8{format=qdq-weights,per_channel=false}").per_channel is False

    with pytest.raises(PassConfigError, match="format"):
        made("quantize-int8{format=static}")


def test_int8_qdq_weights_refuses_opset_below_13_before_touching_the_model():
    """Per-channel DequantizeLinear needs opset 13: the precondition fails in ``requires``, so the model is
    left exactly as it was (no initializer added, no node inserted, no metadata)."""
    from onnx_ir.passes import PreconditionError

    from dyncompile.passes.quantize_weights import QuantizeWeightsInt8Pass

    m = tiny_encoder_classifier()
    m.opset_imports[""] = 12
    before = ir.to_proto(m).SerializeToString()
    with pytest.raises(PreconditionError, match="opset >= 13, the model imports opset 12"):
        QuantizeWeightsInt8Pass()(m)
    assert ir.to_proto(m).SerializeToString() == before
    # nothing to do at opset 12 is not an error: a model already quantized is left alone, as before
    m.metadata_props[_keys.QUANTIZED] = "{}"
    assert QuantizeWeightsInt8Pass()(m).modified is False


@pytest.mark.parametrize("name", ["quantize-int8", "quantize-int4"])
def test_weight_quantization_for_the_cuda_ep_says_it_was_measured_slower(name, caplog):
    """On the CUDA EP int8 and int4 were measured slower than fp32: a compile for it says so at the default
    verbosity (and still builds the pass); other providers hear nothing."""
    from dyncompile.passes import CompileContext, build_passes

    for provider, warned in (("cuda", True), ("cpu", False), ("openvino", False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dyncompile.passes.quantize_weights"):
            (p,) = build_passes(name, CompileContext(options={"provider": provider}))
        assert p is not None
        assert (f"{name} with --provider cuda" in caplog.text) is warned, provider


def test_int8_reads_a_model_whose_weights_are_external_data(tmp_path, monkeypatch):
    """quantize-int8 on a model loaded with its weights in a data file (a real decoder's layout): ORT's quantizer works
    on a temporary copy, which must carry the weights (a reference to the input's data file does not resolve from
    there); the input's files stay as they were."""
    from dyncompile.models.synthetic_decoder import tiny_decoder
    from dyncompile.passes.compiler import compile_model

    src = tmp_path / "src"
    src.mkdir()
    ir.save(tiny_decoder(num_layers=1, vocab=8, hidden=64, seed=2), src / "model.onnx", external_data="model.onnx.data",
            size_threshold_bytes=1024)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    monkeypatch.chdir(tmp_path)
    plan = compile_model(src / "model.onnx", "quantize-int8", tmp_path / "q8", verify=True).plan_dir
    q = ir.load(plan / "model.onnx")
    assert "MatMulInteger" in _ops(q) or "DynamicQuantizeMatMul" in _ops(q)
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
