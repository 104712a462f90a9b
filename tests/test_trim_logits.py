"""trim-logits: golden structure, outputs unfed (all rows, the original's) and fed (the last k rows) in ORT with
ORT_DISABLE_ALL, the checker, idempotence, graphs it leaves alone, and the runtime feeding it (prompts ask for
their last row; greedy and speculative output token-identical) on the real SmolLM2-135M."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest
from helpers import decoder_feeds, ort_session  # tests/ is on pythonpath

import dyncompile
from dyncompile.models.synthetic_decoder import tiny_decoder
from dyncompile.passes._infra import check_model
from dyncompile.passes.speculative.decoder_spec import decoder_spec
from dyncompile.passes.trim_logits import LOGITS_TO_KEEP, TrimLogitsPass, lm_head
from dyncompile.plan import DecoderSpec
from dyncompile.runtime.decode.kv_cache import KVDecoder

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def _feeds(model: ir.Model, n: int, seed: int = 0) -> dict[str, np.ndarray]:
    return decoder_feeds(model, n, seed)


def test_golden_structure_outputs_and_idempotence():
    orig = tiny_decoder()
    model = tiny_decoder()
    head = lm_head(model.graph)
    assert head is not None and head.op_type == "MatMul"
    assert TrimLogitsPass()(model).modified is True
    keep = next(v for v in model.graph.inputs if v.name == LOGITS_TO_KEEP)
    assert keep.dtype == ir.DataType.INT64 and list(keep.shape) == [1] and not keep.is_initializer()
    head = lm_head(model.graph)
    sl = head.inputs[0].producer()
    assert sl.op_type == "Slice" and sl.inputs[1].producer().op_type == "Neg"
    assert sl.inputs[1].producer().inputs[0] is keep
    assert [v.name for v in model.graph.outputs] == [v.name for v in orig.graph.outputs]
    check_model(model, full_check=True)
    a, b = ort_session(orig), ort_session(model)
    feeds = _feeds(orig, 6)
    ref = a.run(None, feeds)
    got = b.run(None, {**feeds, LOGITS_TO_KEEP: np.zeros(1, np.int64)})
    for x, y in zip(ref, got):  # 0: every row, the original outputs
        np.testing.assert_allclose(y, x, atol=1e-5, rtol=0)
    for k in (1, 2, 6):
        got = b.run(None, {**feeds, LOGITS_TO_KEEP: np.array([k], np.int64)})
        assert got[0].shape == (1, k, ref[0].shape[-1])
        np.testing.assert_allclose(got[0], ref[0][:, -k:], atol=1e-5, rtol=0)
        for x, y in zip(ref[1:], got[1:]):  # the cache is untouched by the trimming
            np.testing.assert_array_equal(y, x)
    before = ir.to_onnx_text(model)
    assert TrimLogitsPass()(model).modified is False
    assert ir.to_onnx_text(model) == before


def test_graphs_without_an_lm_head_are_left_alone(tiny_encoder_path):
    enc = ir.load(str(tiny_encoder_path))  # logits [batch, classes] from a pooled 2-D state
    before = ir.to_onnx_text(enc)
    assert TrimLogitsPass()(enc).modified is False
    assert ir.to_onnx_text(enc) == before


@pytest.fixture(scope="module")
def trimmed_plan(smollm2_fast_plan):
    return smollm2_fast_plan  # explicit-attention,fuse-decoder,pack-matmuls,trim-logits,speculative{tree=true} (PL)


def test_runtime_feeds_it_and_output_is_token_identical(smollm2, trimmed_plan):
    step = json.loads((trimmed_plan / "plan.json").read_text())["steps"][0]
    assert step["target"]["logits_to_keep"] == LOGITS_TO_KEEP
    assert "logits_to_keep" not in decoder_spec(ir.load(str(smollm2.onnx_path)), "m")
    m = dyncompile.load(trimmed_plan, session_config={"session.intra_op.allow_spinning": "0"})
    handler = m.handlers[-1]
    target = handler.target
    target.reset()
    rows = target.forward(list(range(100, 140)), last=1)
    assert rows.shape == (1, 49152)
    assert target.length == 40 and target.slots == 40  # the whole prompt is cached
    target.reset()
    full = target.forward(list(range(100, 140)))
    assert full.shape == (40, 49152)
    np.testing.assert_allclose(rows[0], full[-1], atol=1e-4)
    alone = m.generate(PROMPT, max_new_tokens=20, speculative=False)
    spec = m.generate(PROMPT, max_new_tokens=20)
    assert spec.token_ids == alone.token_ids
    spec = decoder_spec(ir.load(str(smollm2.onnx_path)), "m")
    spec.pop("vocab_size")
    ref = KVDecoder(ort_session(smollm2.onnx_path), DecoderSpec.from_params(spec), rollback="copy")
    out = [int(ref.forward(list(alone.prompt_ids))[-1].argmax())]  # the unfused original, untrimmed
    while len(out) < len(alone.token_ids):
        out.append(int(ref.forward(out[-1:])[-1].argmax()))
    assert alone.token_ids == out and len(out) == 20


def test_export_genai_refuses_inputs_it_would_not_feed(trimmed_plan, tmp_path):
    from dyncompile.errors import DataError
    from dyncompile.tools.export_genai import export_genai

    with pytest.raises(DataError, match="logits_to_keep.*trim-logits"):
        export_genai(trimmed_plan, tmp_path / "genai")
    assert not (tmp_path / "genai").exists()  # nothing half-written
