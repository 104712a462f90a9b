"""fuse-int8-epilogues and its kernels (dyncompile.QuantizeRows, dyncompile.ScaledResidualAdd).

Kernels against the ONNX Runtime chains they replace, bit for bit (any row count, widths with tails, one thread
and the pool); the pass on a generated int8 layer (structure, a broadcasting residual and a look-alike left alone,
outputs bit-identical with ORT_DISABLE_ALL, a second run reports nothing) and on the real MiniLM-L6 (per-token
int8: every chain fused, logits bit-identical); an early-exit plan compiled with it names the kernels, runs them,
and has the unfused plan's thresholds and exits.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from dyncompile.passes import FuseInt8EpiloguesPass, build_passes, run_pipeline
from dyncompile.runtime import kernels

_D = kernels.DOMAIN
_MS = "com.microsoft"
_F = ir.DataType.FLOAT


def _session(model, kernel_lib, *, optimize: bool = False):
    """ORT_DISABLE_ALL, or (``optimize``) ORT's optimizations as a dyncompile CPU encoder plan runs them: all, with
    ``SkipLayerNormFusion`` off (``policy.ort_session``: onnxruntime 1.32's fused kernel is slower). That fusion would
    turn an unfused residual ``Add`` + LayerNorm into another kernel with its own rounding."""
    so = ort.SessionOptions()
    so.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                   else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    so.intra_op_num_threads = 2
    kernels.register(so, *kernel_lib)
    data = model if isinstance(model, (bytes, str)) else (
        ir.to_proto(model) if isinstance(model, ir.Model) else model).SerializeToString()
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"],
                                disabled_optimizers=["SkipLayerNormFusion"] if optimize else None)


def _model(tape: ir.tape.Tape, inputs, outputs) -> ir.Model:
    g = ir.Graph(inputs, outputs, nodes=tape.nodes, initializers=tape.initializers,
                 opset_imports={"": 21, _D: 1, _MS: 1}, name="g")
    return ir.Model(g, ir_version=10)


def _const(tape: ir.tape.Tape, name: str, arr) -> ir.Value:
    return tape.initializer(ir.tensor(np.asarray(arr), name=name))


def _chain(tape: ir.tape.Tape, x: ir.Value, k: int, absolute: bool, floor: float = 0.171 / 127):
    """The per-row quantization chain ``quantize-int8`` writes (ReduceMax, Mul, Max, two QuantizeLinear): (q, s)."""
    src = tape.op("Abs", [x]) if absolute else x
    m = tape.op("ReduceMax", [src, _const(tape, "axes", np.array([-1], np.int64))], {"keepdims": 1})
    s0 = tape.op("Mul", [m, _const(tape, "inv", np.float32(1 / 127))])
    s = tape.op("Max", [s0, _const(tape, "floor", np.float32(floor))])
    z = tape.op("QuantizeLinear", [s, _const(tape, "big", np.float32(1e30)), _const(tape, "zp", np.uint8(128))])
    q = tape.op("QuantizeLinear", [x, s, z], {"axis": -1, "block_size": k})
    return q, s


def _quantize_rows(tape: ir.tape.Tape, x: ir.Value, absolute: bool):
    return tape.op_multi_out("QuantizeRows", [x], {"inv_range": float(np.float32(1 / 127)), "floor": float(
        np.float32(0.171 / 127)), "absolute": int(absolute)}, num_outputs=2, domain=_D)


def _named(values, *names):
    for v, n in zip(values, names, strict=True):
        v.name = n
    return list(values)


# ----------------------------------------------------------------------------------------------- kernels


@pytest.mark.parametrize("absolute", [False, True])
@pytest.mark.parametrize("rows, k", [(1, 3072), (27, 3072), (5, 1027), (3, 7)])
def test_quantize_rows_is_the_chain_bit_for_bit(kernel_lib, absolute, rows, k):
    """Scales and bytes equal ORT's chain exactly (vector body and scalar tail; one thread and the pool)."""
    rng = np.random.default_rng(rows * k)
    x = (rng.standard_normal((1, rows, k)) * 3).astype(np.float32)
    x[0, 0, : min(k, 5)] = [0.5, -0.5, 1.5, 2.5, -2.5][: min(k, 5)]  # ties, if the scale is 1
    if rows > 1:
        x[0, -1] *= 1e-6  # a row whose scale is the floor
    outs = []
    for build in (lambda t, v: _chain(t, v, k, absolute), lambda t, v: _quantize_rows(t, v, absolute)):
        tape, xv = ir.tape.Tape(), ir.val("x", _F, [1, rows, k])
        outs.append(_session(_model(tape, [xv], _named(build(tape, xv), "q", "s")), kernel_lib).run(None, {"x": x}))
    (ref_q, ref_s), (got_q, got_s) = outs
    np.testing.assert_array_equal(got_s, ref_s)
    np.testing.assert_array_equal(got_q, ref_q)
    assert got_q.min() < 128 < got_q.max()  # both signs reached the bytes


def _residual_graph(rows, n, fused: bool, shapes=True) -> ir.Model:
    tape = ir.tape.Tape()
    dims = (lambda last: [2, rows, last]) if shapes else (lambda last: None)
    x, s, r = ir.val("x", _F, dims(n)), ir.val("s", _F, dims(1)), ir.val("r", _F, dims(n))
    bias = _const(tape, "bias", np.random.default_rng(n).standard_normal(n).astype(np.float32))
    if fused:
        h = tape.op("ScaledResidualAdd", [x, s, bias, r], domain=_D)
    else:
        h = tape.op("Add", [tape.op("Add", [tape.op("Mul", [x, s]), bias]), r])
    return _model(tape, [x, s, r], _named([h], "h"))


@pytest.mark.parametrize("rows, n", [(1, 768), (27, 768), (64, 771)])
def test_scaled_residual_add_is_the_chain_bit_for_bit(kernel_lib, rows, n):
    rng = np.random.default_rng(rows + n)
    feeds = {"x": rng.standard_normal((2, rows, n)).astype(np.float32) * 4,
             "s": rng.random((2, rows, 1)).astype(np.float32) * 0.01,
             "r": rng.standard_normal((2, rows, n)).astype(np.float32)}
    ref = _session(_residual_graph(rows, n, False), kernel_lib).run(None, feeds)[0]
    got = _session(_residual_graph(rows, n, True), kernel_lib).run(None, feeds)[0]
    np.testing.assert_array_equal(got, ref)
    # a k-row call gives the rows of one-row calls bit for bit
    one = {k: v[:1, :1] for k, v in feeds.items()}
    single = _session(_residual_graph(rows, n, True, shapes=False), kernel_lib).run(None, one)[0]
    np.testing.assert_array_equal(single[0, 0], got[0, 0])


def test_kernel_errors_are_clear(kernel_lib):
    tape = ir.tape.Tape()
    x, sc, r = ir.val("x", _F, [1, 3, 4]), ir.val("s", _F, [1, 3, 1]), ir.val("r", _F, [1, 1, 4])
    h = tape.op("ScaledResidualAdd", [x, sc, _const(tape, "b", np.ones(4, np.float32)), r], domain=_D)
    with pytest.raises(Exception, match="residual R must have X's shape"):
        _session(_model(tape, [x, sc, r], _named([h], "h")), kernel_lib).run(
            None, {"x": np.ones((1, 3, 4), np.float32), "s": np.ones((1, 3, 1), np.float32),
                   "r": np.ones((1, 1, 4), np.float32)})
    tape, x = ir.tape.Tape(), ir.val("x", _F, [1, 4])
    q, s = tape.op_multi_out("QuantizeRows", [x], {"inv_range": 1.0, "floor": 0.0, "absolute": 0}, num_outputs=2,
                             domain=_D)
    with pytest.raises(Exception, match="inv_range and floor must be finite and > 0"):
        _session(_model(tape, [x], _named([q, s], "q", "s")), kernel_lib).run(None, {"x": np.ones((1, 4), np.float32)})


# ----------------------------------------------------------------------------------------------- the pass


def _int8_layer(residual_shape=(1, "seq", 8), k: int = 32, n: int = 8) -> ir.Model:
    """A generated encoder block in the shape ``quantize-int8{activations=mixed}`` leaves it.

    ``h = Gelu(x)`` quantized per row -> ``MatMulIntegerToFloat`` -> ``* s + bias + residual`` -> LayerNorm ``y1``;
    then ``LN(y1 + r2)`` (a residual with no row scale: not fused) -> ``y2``. ``residual_shape``: ``r``'s shape.
    """
    rng = np.random.default_rng(0)
    tape = ir.tape.Tape()
    x, r, r2 = ir.val("x", _F, [1, "seq", k]), ir.val("r", _F, list(residual_shape)), ir.val("r2", _F, [1, "seq", n])
    h = tape.op("Gelu", [x], domain=_MS)
    q, s = _chain(tape, h, k, absolute=False)
    c = {nm: _const(tape, nm, rng.standard_normal(n).astype(np.float32)) for nm in ("bias", "g1", "b1", "g2", "b2")}
    acc = tape.op("MatMulIntegerToFloat", [
        q, _const(tape, "w", rng.integers(-127, 128, (k, n)).astype(np.int8)), _const(tape, "one", np.float32(1)),
        _const(tape, "wscale", (rng.random(n) * 0.01 + 0.001).astype(np.float32)), _const(tape, "zp_a", np.uint8(128)),
        _const(tape, "zp_w", np.int8(0))], domain=_MS)
    lin = tape.op("Add", [tape.op("Mul", [acc, s]), c["bias"]])
    y1 = tape.op("LayerNormalization", [tape.op("Add", [lin, r]), c["g1"], c["b1"]], {"axis": -1, "epsilon": 1e-5})
    y2 = tape.op("LayerNormalization", [tape.op("Add", [y1, r2]), c["g2"], c["b2"]], {"axis": -1, "epsilon": 1e-12})
    y2.dtype, y2.shape = _F, ir.Shape([1, "seq", n])
    return _model(tape, [x, r, r2], _named([y2], "y2"))


def _layer_feeds(rows: int = 5, k: int = 32, n: int = 8, r_rows: int | None = None):
    rng = np.random.default_rng(1)
    return {"x": rng.standard_normal((1, rows, k)).astype(np.float32) * 2,
            "r": rng.standard_normal((1, r_rows or rows, n)).astype(np.float32),
            "r2": rng.standard_normal((1, rows, n)).astype(np.float32)}


def test_pass_fuses_a_generated_int8_layer_bit_exactly(kernel_lib):
    model = _int8_layer()
    ref_model = ir.to_proto(model)
    onnx.checker.check_model(ref_model, full_check=True)
    feeds = _layer_feeds()
    ref = _session(ref_model, kernel_lib).run(None, feeds)[0]
    result = FuseInt8EpiloguesPass()(model)
    assert result.modified
    assert [(n.op_type, n.domain) for n in model.graph] == [
        ("Gelu", _MS), ("QuantizeRows", _D), ("MatMulIntegerToFloat", _MS), ("ScaledResidualAdd", _D),
        ("LayerNormalization", ""), ("Add", ""), ("LayerNormalization", "")]
    qr = next(n for n in model.graph if n.op_type == "QuantizeRows")
    assert qr.attributes.get_float("floor") == np.float32(0.171 / 127)
    assert qr.attributes.get_float("inv_range") == np.float32(1 / 127) and qr.attributes.get_int("absolute") == 0
    assert model.opset_imports[_D] == 1
    assert not {"axes", "inv", "floor", "big", "zp"} & set(model.graph.initializers)  # the chain's constants went
    assert {"w", "bias", "zp_a"} <= set(model.graph.initializers)
    fused = ir.to_proto(model)
    onnx.checker.check_model(fused, full_check=True)
    assert [o.name for o in fused.graph.output] == ["y2"] and [i.name for i in fused.graph.input] == ["x", "r", "r2"]
    np.testing.assert_array_equal(_session(fused, kernel_lib).run(None, feeds)[0], ref)
    np.testing.assert_array_equal(_session(fused, kernel_lib, optimize=True).run(None, feeds)[0],
                                  _session(ref_model, kernel_lib, optimize=True).run(None, feeds)[0])
    assert not FuseInt8EpiloguesPass()(model).modified  # nothing left to fuse


def test_a_broadcasting_residual_is_not_fused(kernel_lib):
    """``r`` of shape [1, 1, n] broadcasts over the rows: the row-scale Mul and both Adds stay."""
    model = _int8_layer(residual_shape=(1, 1, 8))
    feeds = _layer_feeds(r_rows=1)
    ref = _session(ir.to_proto(model), kernel_lib).run(None, feeds)[0]
    assert FuseInt8EpiloguesPass()(model).modified  # the quantization chain still fuses
    ops = [n.op_type for n in model.graph]
    assert "QuantizeRows" in ops and "ScaledResidualAdd" not in ops and ops.count("Mul") == 1
    np.testing.assert_array_equal(_session(ir.to_proto(model), kernel_lib).run(None, feeds)[0], ref)


def test_a_look_alike_chain_is_not_fused(kernel_lib):
    """A zero point of 0 instead of 128 is not what QuantizeRows computes: that chain stays."""
    model = _int8_layer()
    zp = model.graph.initializers["zp"]
    zp.const_value = ir.tensor(np.uint8(0), name="zp")
    before = [n.op_type for n in model.graph]
    FuseInt8EpiloguesPass()(model)
    ops = [n.op_type for n in model.graph]
    assert "QuantizeRows" not in ops and ops.count("QuantizeLinear") == before.count("QuantizeLinear") == 2


def test_a_graph_without_the_chains_is_left_alone_and_says_why(tiny_encoder_path, caplog, kernel_lib):
    """The tiny generated encoder (dynamic shapes only through Reshape, no int8): named by the user, the pass
    leaves it and says why at WARNING."""
    model = ir.load(tiny_encoder_path)
    nodes = [n.op_type for n in model.graph]
    with caplog.at_level(logging.WARNING):
        run_pipeline(build_passes("fuse-int8-epilogues"), model, check="none")
    assert [n.op_type for n in model.graph] == nodes
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("fuse-int8-epilogues" in m and "no per-row int8 quantization chain" in m and "leave it out" in m
               for m in msgs), msgs


def test_pass_must_follow_quantization_and_precede_early_exit_on_the_cpu_ep():
    from dyncompile.errors import PassConfigError
    from dyncompile.passes import CompileContext

    with pytest.raises(PassConfigError, match="fuse-int8-epilogues"):
        build_passes("fuse-int8-epilogues,quantize-int8")
    with pytest.raises(PassConfigError, match="fuse-int8-epilogues"):
        build_passes("early-exit,fuse-int8-epilogues")
    assert build_passes("fuse-int8-epilogues", CompileContext(options={"provider": "cpu"}))
    for provider in ("openvino", "cuda"):
        with pytest.raises(PassConfigError, match=f"CPU kernels; with --provider {provider}"):
            build_passes("fuse-int8-epilogues", CompileContext(options={"provider": provider}))


# ----------------------------------------------------------------------------------------------- real model


def _minilm_feeds(art, rows):
    from dyncompile.runtime.text import TextEncoder

    return TextEncoder(art.tokenizer_path, max_length=128)([r["text"] for r in rows])


def test_real_minilm_per_token_int8_chains_fused_bit_exactly(minilm, movie_test_rows, kernel_lib, tmp_path):
    """Per-token int8 on every MatMul: each quantization chain becomes QuantizeRows, each row-scaled MatMul's bias +
    residual a ScaledResidualAdd, with the same logits bit for bit, ORT's optimizations off and on."""
    import dyncompile

    dyncompile.compile(minilm.onnx_path, passes="quantize-int8{format=dynamic,activations=per-token}",
                       output_dir=tmp_path / "q")
    model = ir.load(tmp_path / "q" / "model.onnx")
    chains = sum(n.op_type == "QuantizeLinear" and n.attributes.get_int("block_size", 0) > 0 for n in model.graph)
    assert chains == 24  # six layers x one chain per MatMul input: q/k/v (shared), attention output, two FFN
    ref_proto = ir.to_proto(model)
    assert FuseInt8EpiloguesPass()(model).modified
    ops = [n.op_type for n in model.graph]
    assert ops.count("QuantizeRows") == chains and ops.count("ScaledResidualAdd") == 12  # two residuals a layer
    assert ops.count("LayerNormalization") == 13
    names = [i.name for i in ref_proto.graph.input]
    feeds = {k: v for k, v in _minilm_feeds(minilm, movie_test_rows[:8]).items() if k in names}
    for optimize in (False, True):
        ref = _session(ref_proto, kernel_lib, optimize=optimize).run(None, feeds)[0]
        got = _session(ir.to_proto(model), kernel_lib, optimize=optimize).run(None, feeds)[0]
        np.testing.assert_array_equal(got, ref)


def test_an_early_exit_plan_with_fused_epilogues_is_the_unfused_plan_on_the_kernels(minilm, movie_test_rows, kernel_lib,
                                                                                      tmp_path):
    """Compiled with and without the pass, an int8 early-exit plan has the same thresholds and certificate; the
    fused one names the kernels (never ships them) and gives the same probabilities and exits row by row."""
    from helpers import DATA

    import dyncompile

    calib = tmp_path / "calib.jsonl"
    calib.write_text("\n".join((DATA / "movie-calib.jsonl").read_text().splitlines()[:600]) + "\n")
    plans = {}
    for name, extra in (("plain", ""), ("fused", "fuse-int8-epilogues,")):
        out = tmp_path / name
        dyncompile.compile(minilm.onnx_path, passes=f"quantize-int8{{format=dynamic,activations=mixed}},{extra}"
                           "early-exit", output_dir=out, calib=str(calib), budget=6.0, progress=False)
        plans[name] = json.loads((out / "plan.json").read_text())
    fused, plain = plans["fused"]["policy"], plans["plain"]["policy"]
    assert fused["custom_ops"] == {"ops": ["dyncompile.QuantizeRows", "dyncompile.ScaledResidualAdd"],
                                   "source_sha256": kernels.source_sha256()}
    assert "custom_ops" not in plain
    assert fused["early_exit"]["thresholds"] == plain["early_exit"]["thresholds"]
    assert fused["early_exit"]["certificate"] == plain["early_exit"]["certificate"]
    assert fused["early_exit"]["certificate"]["certified"]
    assert not any(p.suffix in (".so", ".dll", ".dylib") for p in (tmp_path / "fused").iterdir())
    graph = ir.load(tmp_path / "fused" / "model.onnx")
    used = {n.op_type for n in ir.traversal.RecursiveGraphIterator(graph.graph) if n.domain == _D}
    assert used == {"QuantizeRows", "ScaledResidualAdd"}
    texts = [r["text"] for r in movie_test_rows[:24]]
    a, b = dyncompile.load(tmp_path / "plain"), dyncompile.load(tmp_path / "fused")
    exits = []
    for t in texts:  # batch 1: the If graph's path
        pa, pb = a.predict_proba([t]), b.predict_proba([t])
        np.testing.assert_array_equal(pb, pa)
        ea, eb = (np.asarray(m.last_info["exit_layer"]).reshape(-1) for m in (a, b))
        np.testing.assert_array_equal(eb, ea)
        exits.append(int(ea[0]))
    assert len(set(exits)) > 1  # rows left at different layers: more than one branch ran
    np.testing.assert_array_equal(b.predict_proba(texts), a.predict_proba(texts))  # several rows a call
