"""An int4 drafter's int8 twin for its calls of many rows: the dequantizer against ORT's MatMulNBits, the twin's graph
and numbers, the rule that picks the rows it takes, the plan schema, and a speculative plan that carries one
(token-identical with the twin on and off, the twin running the prompt, a second compile reusing it)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from test_speculative import EOS_UNUSED, PROMPTS, VOCAB

import dyncompile
from dyncompile.errors import DyncompileError, PlanError
from dyncompile.models.synthetic_decoder import tiny_decoder, write_decoder_dir, write_word_tokenizer
from dyncompile.passes import _keys
from dyncompile.passes.compiler import compile_model
from dyncompile.passes.quantize_weights import QuantizeWeightsInt4Pass
from dyncompile.passes.speculative import SpeculativePass
from dyncompile.passes.speculative import drafter_rows as dr
from dyncompile.passes.speculative.decoder_spec import decoder_spec
from dyncompile.passes.speculative.probe import prefill_feeds
from dyncompile.plan import from_json
from dyncompile.plan.decode import DrafterParams


def _matmul_graph(k: int, n: int, seed: int) -> ir.Model:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((k, n)) * rng.uniform(0.2, 3.0, (k, 1))).astype(np.float32)
    x = ir.Value(name="x", shape=ir.Shape(["rows", k]), type=ir.TensorType(ir.DataType.FLOAT))
    wv = ir.Value(name="w", const_value=ir.tensor(w, name="w"))
    node = ir.node("MatMul", [x, wv], name="mm")
    node.outputs[0].name = "y"
    node.outputs[0].shape, node.outputs[0].type = ir.Shape(["rows", n]), ir.TensorType(ir.DataType.FLOAT)
    g = ir.Graph([x], [node.outputs[0]], nodes=[node], initializers=[wv], opset_imports={"": 17})
    return ir.Model(g, ir_version=10)


@pytest.mark.parametrize(("k", "block", "symmetric"), [(64, 32, False), (64, 32, True), (80, 32, False), (96, 64, True)])
def test_dequantized_weight_is_what_matmulnbits_multiplies_by(k, block, symmetric):
    """x @ dequantize(node) equals ORT's MatMulNBits with float32 compute, zero points packed or absent and K not a
    multiple of the block (padded codes dropped)."""
    m = _matmul_graph(k, 24, seed=k + block)
    QuantizeWeightsInt4Pass(block_size=block, symmetric=symmetric, accuracy_level=0)(m)
    (node,) = [n for n in m.graph if n.op_type == "MatMulNBits"]
    assert (len(node.inputs) > 3 and node.inputs[3] is not None) == (not symmetric)
    w = dr.dequantize_matmulnbits(node)
    assert w.shape == (k, 24) and w.dtype == np.float32
    x = np.random.default_rng(1).standard_normal((5, k)).astype(np.float32)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    y = ort.InferenceSession(ir.to_proto(m).SerializeToString(), so, providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]
    np.testing.assert_allclose(x @ w, y, rtol=1e-5, atol=1e-4)


def test_a_weight_the_dequantizer_cannot_read_gets_no_twin():
    m = _matmul_graph(64, 16, seed=0)
    assert dr.int8_rows_twin(m) is None  # no MatMulNBits: nothing to twin
    QuantizeWeightsInt4Pass(block_size=32)(m)
    (node,) = [n for n in m.graph if n.op_type == "MatMulNBits"]
    node.inputs[1].const_value = None  # codes computed at run time
    assert dr.dequantize_matmulnbits(node) is None
    assert dr.int8_rows_twin(m) is None


def test_rows_from_is_the_start_of_the_run_of_sizes_where_the_twin_wins():
    d = {1: 1.0, 4: 4.0, 16: 10.0, 64: 40.0}
    assert dr.rows_from(d, {1: 2.0, 4: 5.0, 16: 9.0, 64: 20.0}) == 16
    assert dr.rows_from(d, {1: 0.5, 4: 3.0, 16: 9.0, 64: 20.0}) == 4  # one row never goes to the twin
    assert dr.rows_from(d, {1: 2.0, 4: 3.0, 16: 11.0, 64: 20.0}) == 64  # a loss at 16 restarts the run
    assert dr.rows_from(d, {1: 2.0, 4: 3.0, 16: 9.0, 64: 41.0}) is None  # slower at the largest size: none
    assert dr.rows_from(d, {s: 2 * t for s, t in d.items()}) is None


@pytest.fixture(scope="module")
def int4_drafter(module_tmp):
    """Tiny target (3 layers, hidden 64) and an int4 drafter (2 layers, int8 compute), each a decoder folder."""
    root = module_tmp("drafter-rows")
    target = write_decoder_dir(root / "t", tiny_decoder(num_layers=3, vocab=VOCAB, hidden=64, seed=0), eos=EOS_UNUSED)
    write_word_tokenizer(root / "t", VOCAB)
    src = write_decoder_dir(root / "d", tiny_decoder(num_layers=2, vocab=VOCAB, hidden=64, seed=3), eos=EOS_UNUSED)
    write_word_tokenizer(root / "d", VOCAB)
    q = compile_model(src, "quantize-int4{block_size=32}", root / "q4", verify=True).plan_dir
    return {"root": root, "target": target, "drafter": q / "model.onnx"}


def test_the_twin_has_the_drafter_s_interface_and_close_logits(int4_drafter):
    drafter = ir.load(int4_drafter["drafter"])
    twin = dr.int8_rows_twin(drafter, reduce_range=False)
    ops = {n.op_type for n in twin.graph}
    assert "MatMulNBits" not in ops and "MatMulIntegerToFloat" in ops
    assert any(n.op_type == "MatMulNBits" for n in drafter.graph)  # the drafter itself is left alone
    assert [(v.name, v.shape) for v in twin.graph.inputs] == [(v.name, v.shape) for v in drafter.graph.inputs]
    assert [v.name for v in twin.graph.outputs] == [v.name for v in drafter.graph.outputs]
    onnx.checker.check_model(ir.to_proto(twin), full_check=True)
    spec = decoder_spec(drafter, "drafter", what="drafter")
    ids = np.random.default_rng(0).integers(0, VOCAB, 12).tolist()
    runs = []
    for m in (drafter, twin):
        s = ort.InferenceSession(ir.to_proto(m).SerializeToString(), providers=["CPUExecutionProvider"])
        runs.append(s.run([spec["logits"]], prefill_feeds(spec, ids))[0][0])
    a, b = runs
    # int8 codes per column and per row against 4-bit codes per block: the twin's logits are the drafter's to
    # within a few percent of their spread (measured: 0.6 %), and pick the same token on most rows
    assert np.abs(a - b).max() < 0.05 * (a.max() - a.min()), np.abs(a - b).max()
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.9


def test_the_plan_schema_ties_rows_model_to_rows_from():
    dec = {"model": "drafter", "input_ids": "input_ids", "logits": "logits", "attention_mask": None,
           "kv": [{"past": "past.0", "present": "present.0", "axis": 2, "shape": [4, 16]}],
           "position_ids": None}
    ok = from_json(DrafterParams, {"kind": "model", "decoder": dec, "rows_model": "drafter_rows", "rows_from": 16}, "d")
    assert ok.rows_model == "drafter_rows" and ok.rows_from == 16
    for bad, match in (({"rows_model": "drafter_rows"}, "go together"), ({"rows_from": 8}, "go together"),
                       ({"rows_model": "drafter_rows", "rows_from": 1}, "go together")):
        with pytest.raises(PlanError, match=match):
            from_json(DrafterParams, {"kind": "model", "decoder": dec, **bad}, "d")
    with pytest.raises(PlanError, match="only a model drafter"):
        from_json(DrafterParams, {"kind": "prompt-lookup", "rows_model": "x", "rows_from": 4}, "d")


def test_a_plan_with_the_twin_is_token_identical_and_runs_the_prompt_on_it(int4_drafter, monkeypatch):
    """Forced (the tiny drafter's twin need not be faster here): the plan names the twin, the prompt runs on it, and
    output is the target's with the twin on and off (weights shared on disk: the SmolLM2 test)."""
    monkeypatch.setattr(dr, "rows_from", lambda d, t: 4)
    res = compile_model(int4_drafter["target"], "speculative", int4_drafter["root"] / "spec",
                        drafter=str(int4_drafter["drafter"]), verify=True)
    plan = json.loads((res.plan_dir / "plan.json").read_text())
    d = plan["steps"][0]["drafter"]
    assert d["rows_model"] == "drafter_rows" and d["rows_from"] == 4
    twin_rec = plan["policy"]["speculative"]["drafter_rows"]
    assert twin_rec["rows_from"] == 4 and set(twin_rec["ms_by_rows"]) == {str(s) for s in dr.ROW_SIZES}
    assert "drafter_rows" in plan["files"]
    m = dyncompile.load(res.plan_dir)
    calls = {"twin": 0}
    handler = _speculative_handler(m)
    twin_session = handler.drafter.decoder.rows_session
    assert twin_session is not None and handler.drafter.decoder.rows_from == 4

    class Spy:
        def __getattr__(self, name):
            return getattr(twin_session, name)

        def run_with_iobinding(self, *a, **k):
            calls["twin"] += 1
            return twin_session.run_with_iobinding(*a, **k)

        def run(self, *a, **k):
            calls["twin"] += 1
            return twin_session.run(*a, **k)

    handler.drafter.decoder.rows_session = Spy()
    for p in PROMPTS[:2]:
        alone = m.generate(p, max_new_tokens=12, speculative=False).token_ids
        before = calls["twin"]
        assert m.generate(p, max_new_tokens=12).token_ids == alone
        assert calls["twin"] > before  # the prompt (>= 4 tokens) ran on the twin
        before = calls["twin"]
        assert m.generate(p, max_new_tokens=12, drafter_rows=False).token_ids == alone
        assert calls["twin"] == before
    with pytest.raises(DyncompileError, match="drafter_rows must be"):
        m.generate(PROMPTS[0], max_new_tokens=2, drafter_rows="yes")


def _speculative_handler(model):
    from dyncompile.runtime.decode.speculative import SpeculativeGenerateStep

    (handler,) = [h for h in model.handlers if isinstance(h, SpeculativeGenerateStep)]
    return handler


def test_a_second_run_of_the_pass_reuses_the_twin(int4_drafter, monkeypatch):
    from dyncompile.io import load_input_model

    model = load_input_model(int4_drafter["target"])
    drafter = ir.load(int4_drafter["drafter"])
    p = SpeculativePass(drafter)
    first = p(model)
    kept = model.meta[_keys.DRAFTER_ROWS_MODEL]  # the memo, with or without a twin
    monkeypatch.setattr(dr, "int8_rows_twin", lambda *a, **k: pytest.fail("the twin was built again"))
    second = p(model)
    assert first.modified and not second.modified
    assert model.meta[_keys.DRAFTER_ROWS_MODEL][0] == kept[0]


def test_measure_false_and_drafter_rows_false_build_no_twin(int4_drafter, monkeypatch):
    from dyncompile.io import load_input_model

    monkeypatch.setattr(dr, "int8_rows_twin", lambda *a, **k: pytest.fail("a twin was built"))
    for opts in ({"drafter_rows": False}, {"measure": False}):
        model = load_input_model(int4_drafter["target"])
        SpeculativePass(ir.load(int4_drafter["drafter"]), **opts)(model)
        rec = json.loads(model.metadata_props[_keys.SPECULATIVE])
        assert "rows_from" not in rec["drafter"]
