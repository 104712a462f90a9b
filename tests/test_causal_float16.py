"""causal-attention and float16 on the real SmolLM2-135M export: the graph ONNX Runtime's CUDA attention kernel takes.

Golden structure, the checker, second runs, cases where each pass does not fire; logits of the causal graph against
the bias graph it came from (ORT_DISABLE_ALL) through prefill, verification chunks and rollbacks, on a shared buffer
and concatenated; the float16 graph's logits against float32's; greedy and speculative token identity; the plan's
``attention: causal`` and what the runtime does with it (gap-free rollback, no trees, a shared buffer on the CUDA EP).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from helpers import (  # tests/ is on pythonpath
    OnCuda,
    ort_session,
    plan_decoder_spec,
    plan_kv_decoder,
    run_cli,
)

import dyncompile
from dyncompile.errors import DyncompileError
from dyncompile.models._export import decoder_tolerance
from dyncompile.passes._infra import NotFired, check_model
from dyncompile.passes.cast_float16 import CastFloat16Pass
from dyncompile.passes.causal_attention import CausalAttentionPass
from dyncompile.passes.compiler import compile_model
from dyncompile.runtime.decode.kv_cache import KVDecoder

STDLIB = Path(sysconfig.get_paths()["stdlib"])
_CODE = (STDLIB / "bisect.py").read_text()
PROMPT = _CODE[: _CODE.index("def bisect_right")] + "def bisect_right(a, x, lo=0, hi=None, *, key=None):\n"
NEW_TOKENS = 24
FUSED = "explicit-attention,fuse-decoder,pack-matmuls,trim-logits"


@pytest.fixture(scope="module")
def plans(smollm2, module_tmp):
    """The bias graph, its causal rewrite and the float16 causal graph, each with a prompt-lookup chain plan."""
    root = module_tmp("causal16")
    out = {}
    for name, passes in (("bias", FUSED), ("causal", f"{FUSED},causal-attention"),
                         ("half", f"{FUSED},causal-attention,float16"),
                         ("notrim", "explicit-attention,fuse-decoder,pack-matmuls,causal-attention")):
        out[name] = compile_model(smollm2.onnx_path, f"{passes},speculative{{measure=false}}", root / name,
                                  drafter="prompt-lookup", progress=False, opt_level=0).plan_dir
    return out


_spec, _decoder = plan_decoder_spec, plan_kv_decoder


def _gqa(model: ir.Model) -> list[ir.Node]:
    return [n for n in model.graph if n.op_type == "GroupQueryAttention"]


def test_causal_structure_checker_and_second_run(plans):
    bias = ir.load(str(plans["bias"] / "model.onnx"))
    model = ir.load(str(plans["causal"] / "model.onnx"))
    names = [v.name for v in model.graph.inputs]
    assert "attention_bias" not in names and "attention_mask" in names
    mask = model.graph.inputs[names.index("attention_mask")]
    assert mask.dtype == ir.DataType.INT64 and len(mask.shape) == 2
    # every other input and every output unchanged, in order
    assert [n for n in names if n != "attention_mask"] == [v.name for v in bias.graph.inputs if v.name != "attention_bias"]
    assert [v.name for v in model.graph.outputs] == [v.name for v in bias.graph.outputs]
    gqa = _gqa(model)
    assert len(gqa) == len(_gqa(bias)) == 30
    for node in gqa:
        assert node.attributes.get_int("causal") == 1
        assert len(node.inputs) == 9  # no position_ids (do_rotary takes positions from seqlens_k), no bias
        assert node.inputs[5].name == "causal_attention.seqlens_k"
        assert node.inputs[6].name == "causal_attention.total_sequence_length"
    spec = _spec(plans["causal"] / "model.onnx")
    assert spec.attention == "causal" and spec.kv_buffer == "shared" and spec.attention_bias is None
    assert _spec(plans["bias"] / "model.onnx").attention == "masked"
    check_model(model, full_check=True)
    assert CausalAttentionPass()(model).modified is False  # done already


def test_causal_attention_does_not_fire_without_a_fused_bias_graph(smollm2):
    orig = ir.load(str(smollm2.onnx_path))
    res = CausalAttentionPass()(orig)
    assert isinstance(res, NotFired) and not res.modified and "no GroupQueryAttention" in res.message()
    from dyncompile.passes.fuse_decoder import FuseDecoderPass

    fused = ir.load(str(smollm2.onnx_path))
    assert FuseDecoderPass()(fused).modified  # GQA with the graph's own mask, no attention_bias input
    res = CausalAttentionPass()(fused)
    assert isinstance(res, NotFired) and "no attention_bias graph input" in res.message()


def test_causal_logits_match_the_bias_graph_through_chunks_and_rollbacks(plans):
    """The causal graph on a gap-free cache computes what the bias graph computes fed the causal bias."""
    ref = _decoder(plans["bias"] / "model.onnx", rollback="copy", kv_buffer="concat")
    shared = _decoder(plans["causal"] / "model.onnx")
    concat = _decoder(plans["causal"] / "model.onnx", kv_buffer="concat")
    assert shared.shared and not concat.shared
    assert shared.rollback == concat.rollback == "copy"  # the plan's causal attention: no masked holes
    rng = np.random.default_rng(0)
    for op, n in [("f", 20), ("f", 4), ("t", 2), ("f", 3), ("f", 1), ("t", 3), ("f", 5), ("f", 1)]:
        if op == "t":
            for d in (ref, shared, concat):
                d.truncate(d.length - n)
            assert shared.slots == shared.length and concat.slots == concat.length
            continue
        ids = rng.integers(100, 40000, size=n)
        expect = ref.forward(ids)
        tol = decoder_tolerance(np.abs(expect).max())
        np.testing.assert_allclose(shared.forward(ids), expect, atol=tol)
        np.testing.assert_allclose(concat.forward(ids), expect, atol=tol)


def test_a_causal_graph_cannot_express_a_hole_in_the_cache(plans):
    """Negative control for the runtime's gap-free rule: a slot masked in the middle of the cache (what a draft tree's
    rejected node leaves) is skipped by the bias graph, while the causal graph's mask only counts valid slots, so its
    logits go wrong; hence the plan's ``attention: causal`` forces rollback by copy and refuses trees."""
    bias = _decoder(plans["bias"] / "model.onnx", kv_buffer="concat")
    causal = _decoder(plans["causal"] / "model.onnx", kv_buffer="concat")
    rng = np.random.default_rng(1)
    prompt, nxt = rng.integers(100, 40000, size=12), [int(rng.integers(100, 40000))]
    for d in (bias, causal):
        d.forward(prompt)
    np.testing.assert_allclose(causal.forward(nxt), bias.forward(nxt), atol=1e-3)  # control: gap-free, they agree
    for d in (bias, causal):  # drop slot 5 as a tree's rejected node would be dropped: masked, not removed
        d._mask[0, 5] = 0
        d.length -= 1
    assert np.abs(causal.forward(nxt) - bias.forward(nxt)).max() > 1.0


def test_trees_are_refused_on_a_causal_graph(plans, tmp_path):
    # the causal plan's own graph (FUSED + causal-attention, as compiled above) given to a tree compile
    with pytest.raises(DyncompileError) as e:
        compile_model(plans["causal"] / "model.onnx", "speculative{tree=true,measure=false}",
                      tmp_path / "p", drafter="prompt-lookup", progress=False, opt_level=0)
    assert "causal-attention replaced it by a causal mask" in str(e.value)
    assert not (tmp_path / "p").exists()


def test_float16_structure_checker_and_second_run(plans):
    model = ir.load(str(plans["half"] / "model.onnx"))
    ref = ir.load(str(plans["causal"] / "model.onnx"))
    assert [v.name for v in model.graph.inputs] == [v.name for v in ref.graph.inputs]
    assert [v.name for v in model.graph.outputs] == [v.name for v in ref.graph.outputs]
    floats = {v.name: v.dtype for v in model.graph.inputs if v.dtype in (ir.DataType.FLOAT, ir.DataType.FLOAT16)}
    assert floats and set(floats.values()) == {ir.DataType.FLOAT16}  # the KV cache
    outs = {v.name: v.dtype for v in model.graph.outputs}
    assert outs["logits"] == ir.DataType.FLOAT
    assert {d for n, d in outs.items() if n.startswith("present.")} == {ir.DataType.FLOAT16}
    assert not [n for n, v in model.graph.initializers.items() if v.const_value.dtype == ir.DataType.FLOAT]
    assert _spec(plans["half"] / "model.onnx").kv_dtype == "float16"
    check_model(model, full_check=True)
    assert CastFloat16Pass()(model).modified is False


def test_float16_does_not_fire_on_a_classifier(minilm_model_path):
    model = ir.load(str(minilm_model_path))
    res = CastFloat16Pass()(model)
    assert isinstance(res, NotFired) and "not a KV-cache decoder" in res.message()


def test_float16_logits_track_float32_and_greedy_tokens_agree(plans):
    """float16 is lossy: the bound is float16's own rounding over 30 layers, and the tokens must still agree."""
    a, b = _decoder(plans["causal"] / "model.onnx"), _decoder(plans["half"] / "model.onnx")
    rng = np.random.default_rng(2)
    ids = rng.integers(100, 40000, size=40)
    la, lb = a.forward(ids), b.forward(ids)
    assert lb.dtype == np.float32
    err = np.abs(la - lb).max(axis=-1) / np.abs(la).max(axis=-1)
    assert err.max() < 0.02 and err.max() > 1e-5  # close, and really computed in half precision
    assert (la.argmax(-1) == lb.argmax(-1)).mean() >= 0.9


@pytest.mark.parametrize("name", ["causal", "half"])
def test_greedy_and_speculative_are_token_identical(plans, name):
    m = dyncompile.load(plans[name], session_config={"session.intra_op.allow_spinning": "0"})
    alone = m.generate(PROMPT, max_new_tokens=NEW_TOKENS, speculative=False)
    spec = m.generate(PROMPT, max_new_tokens=NEW_TOKENS)
    assert spec.token_ids == alone.token_ids
    assert spec.stats.target_calls < NEW_TOKENS  # drafts were accepted (and rejected ones rolled back)
    if name == "causal":  # fp32: the same tokens as the bias graph it came from
        ref = dyncompile.load(plans["bias"], session_config={"session.intra_op.allow_spinning": "0"})
        assert ref.generate(PROMPT, max_new_tokens=NEW_TOKENS, speculative=False).token_ids == alone.token_ids


@pytest.fixture
def host_device_buffers(monkeypatch):
    """No GPU here: a decoder's "device" buffers are CPU ORT values (the decisions made on them are under test)."""
    import onnxruntime as ort

    monkeypatch.setattr(KVDecoder, "_ortvalue", lambda self, a: ort.OrtValue.ortvalue_from_numpy(a, "cpu", 0))


def test_the_cuda_ep_shares_a_device_buffer_only_for_the_float16_causal_graph(plans, host_device_buffers):
    """ORT's CUDA GQA takes float16 without attention_bias: only that graph keeps a shared buffer on the CUDA EP."""
    for name, shared in (("bias", False), ("causal", False), ("half", True)):
        path = plans[name] / "model.onnx"
        dec = KVDecoder(OnCuda(ort_session(path, disable_all=True)), _spec(path))
        assert dec.kv_device == "cuda" and dec.shared is shared, name
        assert dec._on_host is False


def test_the_cuda_preset_puts_the_fused_graph_before_causal_attention_and_float16():
    """The documented CUDA command names only causal-attention,float16: -O2 must lower the graph before them."""
    from dyncompile.passes import presets

    wanted = [p for p, _ in presets.PRESETS["cuda"]["text-generation"]]
    merged, inserted, left_out = presets.place(["eagle-drafter", "causal-attention", "float16", "speculative"], wanted)
    assert merged == ["eagle-drafter", "explicit-attention", "fuse-decoder", "pack-matmuls", "trim-logits",
                      "causal-attention", "float16", "speculative"]
    assert not left_out


def test_graph_steps_match_plain_steps_through_growth_and_rollback(plans, monkeypatch):
    """The CUDA-graph step's fixed bindings (a capacity-wide attention_mask, ids / positions / logits updated in
    place) give the plain step's logits bit for bit; growing the buffer rebinds under a new graph id. Run on the CPU
    EP (no GPU here): what ORT captures on the GPU is exactly these bound calls."""
    from dyncompile.runtime.decode.kv_cache import KVDecoder

    # a 32-slot first buffer (256 by default) reaches the growth after a dozen steps instead of 236
    monkeypatch.setattr(KVDecoder, "_first_capacity", property(lambda self: 32))
    path = plans["notrim"] / "model.onnx"
    plain = _decoder(path)
    graphed = _decoder(path)
    monkeypatch.setattr(graphed, "_why_no_graph", lambda: None)
    graphed.set_cuda_graph(True)
    assert plain.shared and graphed.cuda_graph
    rng = np.random.default_rng(3)
    ids = rng.integers(100, 40000, size=20)
    np.testing.assert_array_equal(graphed.forward(ids), plain.forward(ids))  # several tokens: not a graph step
    assert graphed.graph_steps == 0
    for i in range(40):  # past the first 32 slots: the buffer grows once
        if i == 6:  # a verification chunk and a rollback between graph steps
            chunk = rng.integers(100, 40000, size=3)
            np.testing.assert_array_equal(graphed.forward(chunk), plain.forward(chunk))
            graphed.truncate(graphed.length - 2)
            plain.truncate(plain.length - 2)
        tok = [int(rng.integers(100, 40000))]
        np.testing.assert_array_equal(graphed.forward(tok), plain.forward(tok))
    assert graphed.graph_steps == 40 and graphed._graph_id == 2 and graphed.length == plain.length
    assert 32 < graphed.length <= graphed._cap == plain._cap  # grown once, past the first 32 slots


def test_graph_steps_say_why_they_cannot_run(plans, caplog, host_device_buffers):
    """Without a graph-enabled CUDA session, or with trim-logits' host-side slice start, steps run as before."""
    with caplog.at_level("INFO", logger="dyncompile.runtime.decode.kv_cache"):
        dec = _decoder(plans["notrim"] / "model.onnx", cuda_graph=True)
    assert not dec.cuda_graph and "enable_cuda_graph" in caplog.text

    class _GraphCuda(OnCuda):
        def get_provider_options(self):
            return {"CUDAExecutionProvider": {"enable_cuda_graph": "1"}}

    for name, why in (("half", "trim-logits"), ("bias", "causal-attention")):
        path = plans[name] / "model.onnx"
        with caplog.at_level("INFO", logger="dyncompile.runtime.decode.kv_cache"):
            caplog.clear()
            dec = KVDecoder(_GraphCuda(ort_session(path, disable_all=True)), _spec(path), cuda_graph=True)
        assert not dec.cuda_graph and why in caplog.text, name


def test_cuda_graph_on_the_cpu_ep_loads_and_runs_without_graphs(plans, caplog):
    """``cuda_graph=True`` is a request: on another EP the plan runs as before and says why."""
    with caplog.at_level("INFO", logger="dyncompile.runtime.executor"):
        m = dyncompile.load(plans["notrim"], cuda_graph=True, session_config={"session.intra_op.allow_spinning": "0"})
    assert "CUDA graphs need the CUDA EP" in caplog.text
    target = m.handlers[-1].target
    assert not target.cuda_graph
    ref = dyncompile.load(plans["notrim"], session_config={"session.intra_op.allow_spinning": "0"})
    assert (m.generate(PROMPT, max_new_tokens=8, speculative=False).token_ids
            == ref.generate(PROMPT, max_new_tokens=8, speculative=False).token_ids)
    assert target.graph_steps == 0


def test_speculative_decoding_over_graph_steps_is_token_identical_and_says_what_is_not_graphed(plans, monkeypatch,
                                                                                               caplog):
    """The whole speculative loop with the target's one-token steps on the graph bindings (CPU EP): the same tokens
    as the target alone, and one INFO line that verification and drafting run without graphs."""
    cfg = {"session.intra_op.allow_spinning": "0"}
    ref = dyncompile.load(plans["notrim"], session_config=cfg).generate(PROMPT, max_new_tokens=NEW_TOKENS,
                                                                         speculative=False)
    m = dyncompile.load(plans["notrim"], session_config=cfg)
    target = m.handlers[-1].target
    monkeypatch.setattr(target, "_why_no_graph", lambda: None)
    target.set_cuda_graph(True)
    with caplog.at_level("INFO", logger="dyncompile.runtime.decode.speculative"):
        spec = m.generate(PROMPT, max_new_tokens=NEW_TOKENS)
    alone = m.generate(PROMPT, max_new_tokens=NEW_TOKENS, speculative=False)
    assert spec.token_ids == alone.token_ids == ref.token_ids
    assert target.graph_steps >= NEW_TOKENS - 1  # the target alone's decode steps, at least
    assert "speculative=False) may be faster" in caplog.text


def test_run_cuda_graph_flag_on_the_cpu_ep_runs_as_before(plans, capsys):
    """`dyncompile run PLAN --prompt ... --cuda-graph` is the CLI's way to ask; on the CPU EP the tokens are the same."""
    argv = ["run", plans["notrim"], "--prompt", "def add(a, b):", "--max-new-tokens", 6, "--target-only", "--json",
            "--no-spinning"]
    rc, out, _ = run_cli(capsys, *argv, "--cuda-graph")
    rc0, out0, _ = run_cli(capsys, *argv)
    import json

    assert rc == rc0 == 0
    assert json.loads(out)["token_ids"] == json.loads(out0)["token_ids"] and len(json.loads(out)["token_ids"]) == 6
