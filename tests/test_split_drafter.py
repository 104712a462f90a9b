"""Golden test of SplitDrafterPass on a tiny generated decoder: drafter structure, numerics against an
independent numpy computation (ORT_DISABLE_ALL, explicit tolerances), shared KV, vocabulary trimming,
the k choice and the refusal, idempotence, and the ONNX checker on the drafter."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from helpers import ort_session

from dyncompile.models.synthetic_decoder import tiny_decoder
from dyncompile.passes import _keys, run_pipeline
from dyncompile.passes.analysis.layers import analyze_model
from dyncompile.passes.speculative import DrafterError
from dyncompile.passes.speculative.split_drafter import (
    SplitDrafterPass,
    trim_lm_head,
)
from dyncompile.runtime.rules.cost_model import projected_speedup

L, VOCAB, HIDDEN = 4, 64, 256
RTOL, ATOL = 1e-4, 1e-4


def check_model(model: ir.Model) -> None:
    """The ONNX checker with full_check (shape inference included) on an in-memory model."""
    onnx.checker.check_model(ir.to_proto(model), full_check=True)


def _calib(n=900, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, n).tolist()]


def _feeds(ids, layers, past=None, past_len=0, heads=4, head_dim=64):
    n = len(ids)
    f = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, past_len + n), np.int64),
         "position_ids": np.arange(past_len, past_len + n, dtype=np.int64)[None]}
    for i in layers:
        for kind in ("key", "value"):
            f[f"past_key_values.{i}.{kind}"] = (past[(i, kind)] if past else np.zeros((1, heads, 0, head_dim), np.float32))
    return f


def _run(k=2, **kw):
    model = tiny_decoder(num_layers=L, vocab=VOCAB, seed=0)
    opts = {"layers": k, "min_speedup": 0.0, "progress": False, **kw}
    p = SplitDrafterPass(_calib(), **opts)
    res = run_pipeline([p], model, check="each")
    return model, p, res


def test_structure_and_checker():
    model, _, res = _run(k=2)
    assert res.modified
    drafter = model.meta[_keys.SPLIT_DRAFTER_MODEL]
    names_in = [v.name for v in drafter.graph.inputs]
    assert names_in == ["input_ids", "attention_mask", "position_ids", "past_key_values.0.key",
                        "past_key_values.0.value", "past_key_values.1.key", "past_key_values.1.value"]
    assert [v.name for v in drafter.graph.outputs] == ["logits", "present.0.key", "present.0.value", "present.1.key",
                                                        "present.1.value"]
    ops = [n.op_type for n in drafter.graph]
    assert "split_drafter.bridge.matmul" in [n.name for n in drafter.graph]
    assert ops.count("Concat") == 4  # two layers' key/value caches, nothing of layers 3-4
    assert not any(name.startswith(("layers.2.", "layers.3.")) for name in drafter.graph.initializers)
    assert analyze_model(drafter).num_layers == 2
    check_model(drafter)  # ONNX checker, full check
    rec = json.loads(model.metadata_props[_keys.SPLIT_DRAFTER])
    assert rec["layers"] == 2 and rec["num_layers"] == L and rec["share_kv"] == [0, 1, 2, 3]
    assert rec["calibration"]["tokens"] == 900 and rec["vocab_size"] is None  # 64 tokens: no trimming
    # the target graph is untouched
    fresh = tiny_decoder(num_layers=L, vocab=VOCAB, seed=0)
    assert [n.op_type for n in model.graph] == [n.op_type for n in fresh.graph]
    assert [v.name for v in model.graph.outputs] == [v.name for v in fresh.graph.outputs]


def test_drafter_numerics_and_shared_kv():
    """drafter(x) == lm_head(LN(h_k @ W + b)) with h_k the target's layer-k output; its KV == the target's."""
    model, _, _ = _run(k=2)
    drafter = model.meta[_keys.SPLIT_DRAFTER_MODEL]
    w = drafter.graph.initializers["split_drafter.bridge.weight"].const_value.numpy()
    b = drafter.graph.initializers["split_drafter.bridge.bias"].const_value.numpy()
    w_lm = drafter.graph.initializers["lm_head.weight"].const_value.numpy()
    cut = analyze_model(model).cut_for_layer(2).name
    probe = model.clone()
    vals = ir.convenience.create_value_mapping(probe.graph)
    probe.graph.outputs.append(vals[cut])
    ids = [3, 14, 15, 9, 2, 6, 5, 35]
    t_out = ort_session(probe).run(None, _feeds(ids, range(L)))
    h_k = t_out[-1][0]
    z = h_k @ w + b
    z = (z - z.mean(-1, keepdims=True)) / np.sqrt(z.var(-1, keepdims=True) + 1e-5)
    ref = z @ w_lm
    d_sess = ort_session(drafter)
    d_out = d_sess.run(None, _feeds(ids, range(2)))
    np.testing.assert_allclose(d_out[0][0], ref, rtol=RTOL, atol=ATOL)
    for j in range(4):  # present.0.key ... present.1.value: the target's own
        np.testing.assert_allclose(d_out[1 + j], t_out[1 + j], rtol=1e-5, atol=1e-5)
    # decoding on the target's cache (what the runtime does): same logits as one full pass
    past = {(i, kind): t_out[1 + 2 * i + j][:, :, :6] for i in range(2) for j, kind in enumerate(("key", "value"))}
    step = d_sess.run(None, _feeds(ids[6:], range(2), past=past, past_len=6))
    np.testing.assert_allclose(step[0][0], d_out[0][0][6:], rtol=RTOL, atol=ATOL)


def test_bridge_none_is_the_plain_early_exit():
    model, _, _ = _run(k=3, bridge="none")
    drafter = model.meta[_keys.SPLIT_DRAFTER_MODEL]
    assert "split_drafter.bridge.weight" not in drafter.graph.initializers
    assert json.loads(model.metadata_props[_keys.SPLIT_DRAFTER])["bridge"] == {"kind": "none"}


def test_vocabulary_trimming():
    model, _, _ = _run(k=2, vocab=16)
    drafter = model.meta[_keys.SPLIT_DRAFTER_MODEL]
    subset = model.meta[_keys.SPLIT_DRAFTER_VOCAB]
    assert len(subset) == 16 and list(subset) == sorted(subset)
    assert drafter.graph.outputs[0].shape[-1] == 16
    full, _, _ = _run(k=2)
    ids = [1, 2, 3, 4, 5]
    a = ort_session(drafter).run(["logits"], _feeds(ids, range(2)))[0]
    b = ort_session(full.meta[_keys.SPLIT_DRAFTER_MODEL]).run(["logits"], _feeds(ids, range(2)))[0]
    np.testing.assert_allclose(a, b[..., subset], rtol=RTOL, atol=ATOL)
    check_model(drafter)


def test_trim_lm_head_on_transposed_tied_weights():
    """MatMul(x, Transpose(E)) (tied embeddings, as SmolLM2 exports it) is trimmed by rows of E."""
    rng = np.random.default_rng(0)
    e = rng.standard_normal((10, 4)).astype(np.float32)
    x = ir.val("x", ir.DataType.FLOAT, ir.Shape([1, 2, 4]))
    ev = ir.val("E", const_value=ir.tensor(e, name="E"))
    tape = ir.tape.Tape()
    logits = tape.op("MatMul", [x, tape.op("Transpose", [ev], {"perm": [1, 0]})])
    logits.name, logits.dtype, logits.shape = "logits", ir.DataType.FLOAT, ir.Shape([1, 2, 10])
    g = ir.Graph([x], [logits], nodes=tape.nodes, initializers=[ev], opset_imports={"": 18})
    m = ir.Model(g, ir_version=10)
    subset = np.array([1, 4, 7])
    assert trim_lm_head(m, "logits", subset)
    xv = rng.standard_normal((1, 2, 4)).astype(np.float32)
    out = ort_session(m).run(None, {"x": xv})[0]
    np.testing.assert_allclose(out, xv @ e[subset].T, rtol=1e-5, atol=1e-5)


def test_trim_lm_head_with_a_bias():
    """MatMul(x, W) + b: the weight's columns and the bias are both trimmed to the subset."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((4, 10)).astype(np.float32)
    b = rng.standard_normal(10).astype(np.float32)
    x = ir.val("x", ir.DataType.FLOAT, ir.Shape([1, 2, 4]))
    wv, bv = ir.val("W", const_value=ir.tensor(w, name="W")), ir.val("b", const_value=ir.tensor(b, name="b"))
    tape = ir.tape.Tape()
    logits = tape.op("Add", [tape.op("MatMul", [x, wv]), bv])
    logits.name, logits.dtype, logits.shape = "logits", ir.DataType.FLOAT, ir.Shape([1, 2, 10])
    m = ir.Model(ir.Graph([x], [logits], nodes=tape.nodes, initializers=[wv, bv], opset_imports={"": 18},
                          name="head"), ir_version=10)
    subset = np.array([0, 3, 9])
    assert trim_lm_head(m, "logits", subset)
    assert list(m.graph.outputs[0].shape) == [1, 2, 3]
    check_model(m)
    xv = rng.standard_normal((1, 2, 4)).astype(np.float32)
    out = ort_session(m).run(None, {"x": xv})[0]
    np.testing.assert_allclose(out, (xv @ w + b)[..., subset], rtol=1e-5, atol=1e-5)


def test_trim_lm_head_on_a_head_lowered_to_a_1x1_conv():
    """``matmul-to-conv``'s head (Squeeze(Transpose(Conv(., W[N, K, 1, 1])))) is trimmed by the Conv's output
    channels; a head whose Conv output has another reader is left alone."""
    from dyncompile.passes.matmul_to_conv import MatMulToConvPass

    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 10)).astype(np.float32)

    def lowered(extra_reader: bool) -> ir.Model:
        x = ir.val("x", ir.DataType.FLOAT, ir.Shape([1, 2, 4]))
        wv = ir.val("W", const_value=ir.tensor(w, name="W"))
        tape = ir.tape.Tape()
        logits = tape.op("MatMul", [x, wv])
        logits.name, logits.dtype, logits.shape = "logits", ir.DataType.FLOAT, ir.Shape([1, 2, 10])
        g = ir.Graph([x], [logits], nodes=tape.nodes, initializers=[wv], opset_imports={"": 18}, name="head")
        m = ir.Model(g, ir_version=10)
        assert MatMulToConvPass()(m).modified
        if extra_reader:
            conv = next(n for n in m.graph if n.op_type == "Conv")
            r = ir.node("Relu", [conv.outputs[0]])
            m.graph.append(r)
            r.outputs[0].name = "side"
            m.graph.outputs.append(r.outputs[0])
        return m

    m = lowered(False)
    subset = np.array([1, 4, 7])
    assert trim_lm_head(m, "logits", subset)
    conv = next(n for n in m.graph if n.op_type == "Conv")
    assert conv.inputs[1].const_value.shape == (3, 4, 1, 1)
    assert list(m.graph.outputs[0].shape) == [1, 2, 3]
    check_model(m)
    xv = rng.standard_normal((1, 2, 4)).astype(np.float32)
    out = ort_session(m).run(None, {"x": xv})[0]
    np.testing.assert_allclose(out, xv @ w[:, subset], rtol=1e-5, atol=1e-5)
    assert not trim_lm_head(lowered(True), "logits", subset)


def test_second_run_does_not_fire():
    model, p, _ = _run(k=1)
    again = p(model)
    assert not again.modified


def test_choose_k_and_refuse():
    model = tiny_decoder(num_layers=L, vocab=VOCAB, seed=0)
    p = SplitDrafterPass(_calib(), min_speedup=0.0, progress=False)
    p(model)
    rec = json.loads(model.metadata_props[_keys.SPLIT_DRAFTER])
    assert [c["layers"] for c in rec["candidates"]] == [1, 2, 3]
    best = max(rec["candidates"], key=lambda c: c["projected_speedup"])
    assert rec["layers"] == best["layers"] and rec["projected_speedup"] == best["projected_speedup"]
    verify = {int(s): v for s, v in rec["verify_cost"].items()}
    assert sorted(verify) == [1, 2, 4, 9] and verify[1] == 1.0  # max_draft 8: up to 9 tokens per verification
    for c in rec["candidates"]:
        assert 0 <= c["acceptance"] <= 1 and 0 < c["draft_cost"] < 1 and c["draft_length"] >= 1
        # each candidate is projected with the runtime's cost model (from its rounded numbers: 1e-3)
        speed, g = projected_speedup(c["acceptance"], c["draft_cost"], verify, 8)
        assert c["projected_speedup"] == pytest.approx(speed, rel=1e-3) and c["draft_length"] == g, c
    # the same numbers with the default threshold of 1x: a random tiny model never pays -> a clear refusal
    with pytest.raises(DrafterError, match=r"split-drafter refuses: the best projected speedup is .*x < 50.*layers=K"):
        SplitDrafterPass(_calib(), min_speedup=50.0, progress=False)(tiny_decoder(num_layers=L, vocab=VOCAB, seed=0))


def test_too_little_calibration_text():
    with pytest.raises(DrafterError, match="calibration text has 20 tokens"):
        SplitDrafterPass([list(range(20))], layers=1, progress=False)(tiny_decoder(num_layers=L, vocab=VOCAB))
