"""screen-lm-head: golden structure, both If branches in ORT with ORT_DISABLE_ALL (the screen: every row's argmax and
its float32 logit are the original's, every other logit within the bound; the fallback: the original logits), the
error bound against ONNX Runtime's own int8 compute, the checker, idempotence, graphs and compiles it leaves alone,
and on the real SmolLM2-135M: token-identical greedy decoding (alone and speculative), the tied embedding reused, and
sampling refused."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from helpers import decoder_feeds, ort_session  # tests/ is on pythonpath

import dyncompile
from dyncompile.errors import DataError, PassConfigError
from dyncompile.models.synthetic_decoder import tiny_decoder
from dyncompile.passes._infra import check_model
from dyncompile.passes._keys import LOGITS_EXACT
from dyncompile.passes.screen_lm_head import ScreenLMHeadPass
from dyncompile.passes.speculative.decoder_spec import decoder_spec
from dyncompile.runtime.decode.generate import PromptError

VOCAB = 512
PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def _feeds(model: ir.Model, n: int, seed: int) -> dict[str, np.ndarray]:
    return decoder_feeds(model, n, seed, vocab=VOCAB)


def _screened(candidates: int, slack: float = 2.0) -> ir.Model:
    """The tiny decoder screened, with the screen's fallback flag, bound and approximation as extra outputs."""
    model = tiny_decoder(vocab=VOCAB)
    assert ScreenLMHeadPass(candidates=candidates, slack=slack)(model).modified is True
    named = {n.name: n for n in model.graph}
    extra = [named[f"screen_lm_head/{k}"].outputs[0] for k in ("fallback", "bound", "approx")]
    extra[0].shape = ir.Shape([])  # a graph output needs a shape; ONNX infers a scalar
    model.graph.outputs.extend(extra)
    return model


def _head_input(model: ir.Model) -> ir.Value:
    return next(n for n in model.graph if n.name == "screen_lm_head/approx").inputs[0]


def test_golden_structure_and_the_screen_branch():
    orig = tiny_decoder(vocab=VOCAB)
    model = tiny_decoder(vocab=VOCAB)
    assert ScreenLMHeadPass(candidates=64)(model).modified is True
    ops = [n.op_type for n in model.graph]
    assert "MatMul" in ops and ops[-1] == "If" and model.graph.outputs[0].producer().op_type == "If"
    nbits = next(n for n in model.graph if n.op_type == "MatMulNBits")
    assert (nbits.attributes.get_int("bits"), nbits.attributes.get_int("accuracy_level"),
            nbits.attributes.get_int("N")) == (8, 4, VOCAB)
    assert model.metadata_props[LOGITS_EXACT] == "argmax"
    assert decoder_spec(model, "m")["logits_exact"] == "argmax" and "logits_exact" not in decoder_spec(orig, "m")
    if_node = model.graph.outputs[0].producer()
    then_ops = [n.op_type for n in if_node.attributes["then_branch"].as_graph()]
    else_ops = [n.op_type for n in if_node.attributes["else_branch"].as_graph()]
    assert "Gemm" in then_ops and else_ops[-1] == "ScatterElements" and "Gather" in else_ops
    # the head's float weight now lives as [vocab, hidden] rows (read by Gather and Gemm), its old copy is gone
    floats = {v.name: v.const_value.shape for v in model.graph.initializers.values()
              if v.const_value.dtype == ir.DataType.FLOAT and VOCAB in v.const_value.shape and len(v.const_value.shape) == 2}
    assert floats["screen_lm_head.weight_rows"] == (VOCAB, 256) and (256, VOCAB) not in floats.values()
    check_model(model, full_check=True)
    a = ort_session(orig)
    probe = ort_session(_screened(64))
    screens = 0
    for seed, n in ((0, 1), (1, 3), (2, 6)):
        feeds = _feeds(orig, n, seed)
        ref = a.run(None, feeds)[0][0]
        out = probe.run(None, feeds)
        got, fallback, bound = out[0][0], out[-3], out[-2][0]
        screens += not bool(fallback)
        np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))
        rows = np.arange(n)
        np.testing.assert_allclose(got[rows, ref.argmax(-1)], ref[rows, ref.argmax(-1)], atol=1e-5, rtol=0)
        assert (np.abs(got - ref) <= bound + 1e-5).all()  # the approximations stay within the bound
        assert np.abs(got - ref).max() > 1e-3  # and are approximations: the screen branch ran
    assert screens == 3
    before = ir.to_onnx_text(model)
    assert ScreenLMHeadPass(candidates=64)(model).modified is False
    assert ir.to_onnx_text(model) == before


def test_too_many_possible_argmaxes_take_the_full_float32_head():
    orig = tiny_decoder(vocab=VOCAB)
    model = _screened(candidates=2)  # the tiny model's top logits are close: more than 2 tokens can win
    check_model(model, full_check=True)
    feeds = _feeds(orig, 4, 7)
    ref = ort_session(orig).run(None, feeds)[0]
    out = ort_session(model).run(None, feeds)
    assert bool(out[-3]) is True
    np.testing.assert_allclose(out[0], ref, atol=1e-5, rtol=0)


def test_the_bound_holds_on_onnx_runtime_int8_compute():
    """Without the slack the bound must still cover ONNX Runtime's error (the slack is a margin, not a fudge)."""
    model = _screened(candidates=64, slack=1.0)
    x_name = _head_input(model)
    model.graph.outputs.append(x_name)
    sess = ort_session(model)
    worst = 0.0
    orig = tiny_decoder(vocab=VOCAB)
    weight = next(v.const_value.numpy() for v in orig.graph.initializers.values()
                  if v.const_value is not None and v.const_value.shape == (256, VOCAB))
    for seed, n in ((3, 1), (4, 2), (5, 8)):
        out = sess.run(None, _feeds(orig, n, seed))
        bound, approx, x = out[-3][0], out[-2][0], out[-1][0]
        exact = x.astype(np.float64) @ weight.astype(np.float64)
        err = np.abs(approx - exact)
        assert (err <= bound).all()
        worst = max(worst, float((err / bound).max()))
    assert 0.01 < worst < 1.0  # tight enough to be a real bound on a real error


def test_graphs_and_compiles_it_leaves_alone(tiny_encoder_path):
    enc = ir.load(str(tiny_encoder_path))
    before = ir.to_onnx_text(enc)
    assert ScreenLMHeadPass()(enc).modified is False
    assert ir.to_onnx_text(enc) == before
    dec = tiny_decoder(vocab=VOCAB)
    before = ir.to_onnx_text(dec)
    assert ScreenLMHeadPass(provider="cuda")(dec).modified is False
    assert ScreenLMHeadPass(block_size=512)(dec).modified is False  # hidden 256 is not a multiple
    assert ir.to_onnx_text(dec) == before
    for bad in ({"block_size": 24}, {"candidates": 0}, {"slack": 0.5}):
        with pytest.raises(PassConfigError, match="screen-lm-head"):
            ScreenLMHeadPass(**bad)


@pytest.fixture(scope="module")
def screened_plan(smollm2, tmp_path_factory):
    from dyncompile.passes.compiler import compile_model

    root = tmp_path_factory.mktemp("smol_screen")
    return compile_model(smollm2.onnx_path, "explicit-attention,fuse-decoder,pack-matmuls,trim-logits,screen-lm-head,"
                         "speculative{measure=false}", root / "plan", drafter="prompt-lookup", progress=False,
                         opt_level=0).plan_dir


def test_real_decoder_is_token_identical_and_refuses_to_sample(smollm2, screened_plan, smollm2_fast_plan):
    plan = json.loads((screened_plan / "plan.json").read_text())
    target = plan["steps"][0]["target"]
    assert target["logits_exact"] == "argmax"
    proto = onnx.load(str(screened_plan / plan["files"][target["model"]]["path"]), load_external_data=False)
    big = [list(i.dims) for i in proto.graph.initializer if i.data_type == onnx.TensorProto.FLOAT
           and 49152 in i.dims and len(i.dims) == 2]
    # SmolLM2's head is tied: the embedding serves the float32 rows, nothing is copied (the rest is the bound's [36, V])
    assert sorted(big) == [[36, 49152], [49152, 576]]
    m = dyncompile.load(screened_plan, session_config={"session.intra_op.allow_spinning": "0"})
    ref = dyncompile.load(smollm2_fast_plan, session_config={"session.intra_op.allow_spinning": "0"})
    for prompt in (PROMPT, "import numpy as np\n\n\ndef softmax(x):\n"):
        alone = m.generate(prompt, max_new_tokens=32, speculative=False)
        assert alone.token_ids == ref.generate(prompt, max_new_tokens=32, speculative=False).token_ids
        assert m.generate(prompt, max_new_tokens=32).token_ids == alone.token_ids
    for speculative in (False, True):
        with pytest.raises(PromptError, match="screen-lm-head.*greedily only"):
            m.generate(PROMPT, max_new_tokens=4, sample=True, speculative=speculative)
    from dyncompile.tools.bench.quality import _decoder

    with pytest.raises(DataError, match="screened"):
        _decoder(m)
