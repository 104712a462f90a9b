"""quantize-int8 / quantize-int4 passes: structure, idempotence, numerics, composition with early exit."""

from __future__ import annotations

import json

import dyncompile
import numpy as np
import onnx_ir as ir
from dyncompile.models.synthetic import tiny_encoder_classifier
from dyncompile.passes import QuantizeDynamicInt8Pass, QuantizeWeightsInt4Pass, run_pipeline
from helpers import DATA, ort_session, random_token_feeds


def _ops(m: ir.Model) -> set[str]:
    return {n.op_type for n in m.graph.all_nodes()}


def test_int8_structure_idempotence_and_numerics():
    feeds = random_token_feeds()
    ref = ort_session(tiny_encoder_classifier()).run(None, feeds)[0]
    m = tiny_encoder_classifier()
    res = run_pipeline([QuantizeDynamicInt8Pass()], m, check="each")
    assert res.modified and "MatMulInteger" in _ops(m) and "DynamicQuantizeLinear" in _ops(m)
    assert [v.name for v in m.graph.outputs] == ["logits"]
    assert QuantizeDynamicInt8Pass()(m).modified is False
    got = ort_session(m).run(None, feeds)[0]
    np.testing.assert_allclose(got, ref, rtol=0, atol=0.15)  # int8 weights+activations: loose but bounded
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 2 / 3


def test_int4_structure_idempotence_and_numerics():
    feeds = random_token_feeds()
    ref = ort_session(tiny_encoder_classifier()).run(None, feeds)[0]
    m = tiny_encoder_classifier()
    res = run_pipeline([QuantizeWeightsInt4Pass(block_size=32)], m, check="none")
    assert res.modified and "MatMulNBits" in _ops(m)
    assert QuantizeWeightsInt4Pass()(m).modified is False
    got = ort_session(m).run(None, feeds)[0]
    np.testing.assert_allclose(got, ref, rtol=0, atol=0.6)  # 4-bit weights of a random-weight net


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
        lowering="staged", progress=False,
    )
    assert [r.name for r in res.pipeline.records] == ["QuantizeDynamicInt8Pass", "FitExitHeadsPass", "InsertEarlyExitPass"]
    seg0 = ir.load(res.plan.directory / res.plan.files["segment0"].path)
    assert "MatMulInteger" in _ops(seg0)  # the heads were fitted on the quantized model's features
    m = dyncompile.load(res.plan_dir)
    rows = [json.loads(x) for x in (DATA / "movie-test.jsonl").read_text().splitlines()[:64]]
    p = m.predict_proba([r["text"] for r in rows])
    assert (p.argmax(-1) == np.array([r["label"] for r in rows])).mean() > 0.7
    assert m.last_info["exit_layer"].min() < 6
