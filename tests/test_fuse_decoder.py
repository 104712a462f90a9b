"""fuse-decoder on the real SmolLM2-135M export: structure, the checker, logits against the unfused graph
(ORT_DISABLE_ALL, explicit tolerance) for prefill, multi-token verification chunks and masked rollback holes,
greedy token identity, composition with the speculative pass, and the cases where it does not fire."""

from __future__ import annotations

import collections
import sysconfig
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from helpers import ort_session  # tests/ is on pythonpath

import dyncompile
from dyncompile.models._export import decoder_tolerance
from dyncompile.models.synthetic_decoder import tiny_decoder
from dyncompile.passes._infra import check_model
from dyncompile.passes.compiler import compile_model
from dyncompile.passes.fuse_decoder import FuseDecoderPass
from dyncompile.passes.speculative.decoder_spec import decoder_spec
from dyncompile.plan import DecoderSpec
from dyncompile.runtime.decode.kv_cache import KVDecoder

STDLIB = Path(sysconfig.get_paths()["stdlib"])
NEW_TOKENS = 16
_CODE = (STDLIB / "bisect.py").read_text()
PROMPT = _CODE[: _CODE.index("def bisect_right")] + "def bisect_right(a, x, lo=0, hi=None, *, key=None):\n"


@pytest.fixture(scope="module")
def fused_plan(smollm2, module_tmp):
    """fuse-decoder then the speculative pass (prompt lookup): one compile gives the fused graph and a chain plan."""
    root = module_tmp("fuse")
    return compile_model(smollm2.onnx_path, "fuse-decoder,speculative{measure=false}", root / "plan", drafter="prompt-lookup",
                         progress=False, opt_level=0).plan_dir


def _ops(model: ir.Model) -> collections.Counter:
    return collections.Counter((n.domain, n.op_type) for n in model.graph)


def _decoder(path, rollback: str) -> KVDecoder:
    spec = decoder_spec(ir.load(str(path)), path.name)
    spec.pop("vocab_size")
    return KVDecoder(ort_session(path, disable_all=True), DecoderSpec.from_params(spec), rollback=rollback)


def test_structure_io_and_checker(smollm2, fused_plan):
    orig = ir.load(str(smollm2.onnx_path))
    fused = ir.load(str(fused_plan / "model.onnx"))
    ops = _ops(fused)
    layers = 30
    assert ops[("com.microsoft", "GroupQueryAttention")] == layers
    assert ops[("com.microsoft", "RotaryEmbedding")] == 2 * layers
    assert ops[("com.microsoft", "SkipSimplifiedLayerNormalization")] == 2 * layers
    assert ("", "Softmax") not in ops and ("", "Cos") not in ops and ("", "Neg") not in ops
    # the only Transpose left is the tied LM head's (of a weight), none on activations
    assert all(n.inputs[0].const_value is not None for n in fused.graph if n.op_type == "Transpose")
    assert [v.name for v in fused.graph.inputs] == [v.name for v in orig.graph.inputs]
    assert [v.name for v in fused.graph.outputs] == [v.name for v in orig.graph.outputs]
    for gqa in (n for n in fused.graph if n.op_type == "GroupQueryAttention"):
        assert gqa.attributes.get_int("causal") == 0  # the graph's own mask is the whole mask
        assert gqa.inputs[3].name.startswith("past_key_values.") and gqa.outputs[1].name.startswith("present.")
    spec_o, spec_f = decoder_spec(orig, "o"), decoder_spec(fused, "f")
    assert spec_f == {**spec_o, "model": "f"}  # the runtime drives both the same way
    check_model(fused, full_check=True)


@pytest.mark.parametrize("rollback", ["mask"])
def test_logits_match_unfused_through_chunks_and_rollback(smollm2, fused_plan, rollback):
    """Prefill, verification chunks of several tokens, rejected drafts rolled back (masked holes or copies)."""
    a, b = _decoder(smollm2.onnx_path, rollback), _decoder(fused_plan / "model.onnx", rollback)
    rng = np.random.default_rng(0)
    holes = 0
    for op, n in [("f", 20), ("f", 4), ("t", 2), ("f", 3), ("f", 1), ("t", 3), ("f", 5), ("f", 1)]:
        if op == "t":
            a.truncate(a.length - n)
            b.truncate(b.length - n)
            continue
        ids = rng.integers(100, 40000, size=n)
        la, lb = a.forward(ids), b.forward(ids)
        assert la.shape == lb.shape == (n, 49152)
        tol = decoder_tolerance(np.abs(la).max())
        assert np.abs(la - lb).max() <= tol, (op, n, np.abs(la - lb).max(), tol)
        assert (la.argmax(-1) == lb.argmax(-1)).all()
        holes = max(holes, b.slots - b.length)
    assert holes == 5  # the fused graph really attended over masked holes (copy rollback has none: a subset)


def test_greedy_token_identical_and_speculative_chain(smollm2, fused_plan):
    fused = dyncompile.load(fused_plan, session_config={"session.intra_op.allow_spinning": "0"})
    alone = fused.generate(PROMPT, max_new_tokens=NEW_TOKENS, speculative=False)
    spec = fused.generate(PROMPT, max_new_tokens=NEW_TOKENS)
    # the unfused original, greedy, fed the same prompt ids
    ref = _decoder(smollm2.onnx_path, "copy")
    ids = list(alone.prompt_ids)
    out = [int(ref.forward(ids)[-1].argmax())]
    while len(out) < len(alone.token_ids):
        out.append(int(ref.forward(out[-1:])[-1].argmax()))
    assert len(out) == NEW_TOKENS
    assert alone.token_ids == out
    assert spec.token_ids == out
    assert spec.stats.target_calls < NEW_TOKENS  # several tokens verified per call on the fused graph


def test_second_run_and_non_decoders_are_left_alone(fused_plan, tiny_encoder_path):
    fused = ir.load(str(fused_plan / "model.onnx"))
    assert FuseDecoderPass()(fused).modified is False
    for model in (ir.load(str(tiny_encoder_path)), tiny_decoder()):  # an encoder; a KV decoder without rotary
        before = ir.to_onnx_text(model)
        assert FuseDecoderPass()(model).modified is False
        assert ir.to_onnx_text(model) == before


def test_options():
    assert repr(FuseDecoderPass(max_positions=64)) == "FuseDecoderPass(max_positions=64)"
    with pytest.raises(ValueError, match="max_positions"):
        FuseDecoderPass(max_positions=0)


def test_gqa_as_fused_applies_an_arbitrary_tree_mask():
    """The fused op with the pass's settings (causal=0, attention_bias) honours any additive mask over past + new
    tokens, e.g. a draft tree where a node sees its ancestors only, on top of a cache (numpy reference)."""

    b, h, hkv, dh, past, s = 1, 4, 2, 8, 7, 5
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((b, s, n * dh)).astype(np.float32) for n in (h, hkv, hkv))
    pk, pv = (rng.standard_normal((b, hkv, past, dh)).astype(np.float32) for _ in range(2))
    parent = [-1, 0, 0, 1, 2]  # a draft tree: root, two children, a grandchild under each
    allowed = np.zeros((s, past + s), bool)
    allowed[:, :past] = True
    for i in range(s):
        j = i
        while j >= 0:
            allowed[i, past + j] = True
            j = parent[j]
    allowed[:, 2] = False  # and a rolled-back hole in the cache
    bias = np.where(allowed, 0.0, -np.inf).astype(np.float32)[None, None]
    tape = ir.tape.Tape()
    ins = [ir.val(n, ir.DataType.FLOAT, ir.Shape(x.shape)) for n, x in
           (("q", q), ("k", k), ("v", v), ("pk", pk), ("pv", pv), ("bias", bias))]
    sk = tape.op("Constant", [], {"value": ir.tensor(np.array([past + s - 1], np.int32))})
    tot = tape.op("Constant", [], {"value": ir.tensor(np.array(past + s, np.int32))})
    out, pres_k, pres_v = tape.op_multi_out(
        "GroupQueryAttention", [*ins[:5], sk, tot, None, None, None, ins[5]],
        {"num_heads": h, "kv_num_heads": hkv, "causal": 0}, domain="com.microsoft", num_outputs=3)
    for val, n in ((out, "out"), (pres_k, "present_k"), (pres_v, "present_v")):
        val.name = n
    graph = ir.Graph(ins, [out, pres_k, pres_v], nodes=tape.nodes, opset_imports={"": 18, "com.microsoft": 1})
    sess = ort_session(ir.Model(graph, ir_version=10), disable_all=True)
    got, got_k, _ = sess.run(None, {"q": q, "k": k, "v": v, "pk": pk, "pv": pv, "bias": bias})
    kk = np.concatenate([pk, k.reshape(b, s, hkv, dh).transpose(0, 2, 1, 3)], axis=2)
    vv = np.concatenate([pv, v.reshape(b, s, hkv, dh).transpose(0, 2, 1, 3)], axis=2)
    qq = q.reshape(b, s, h, dh).transpose(0, 2, 1, 3)
    kk, vv = np.repeat(kk, h // hkv, axis=1), np.repeat(vv, h // hkv, axis=1)
    scores = qq @ kk.transpose(0, 1, 3, 2) / np.sqrt(dh) + bias
    p = np.exp(scores - scores.max(-1, keepdims=True))
    ref = (p / p.sum(-1, keepdims=True)) @ vv
    np.testing.assert_allclose(got, ref.transpose(0, 2, 1, 3).reshape(b, s, h * dh), atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(got_k[:, :, :past], pk)
