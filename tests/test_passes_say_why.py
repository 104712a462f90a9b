"""Passes the user named that cannot fire say so at the default verbosity (a WARNING naming the pass, the reason and
the fix); presets an optimization level inserted stay at INFO. GPT-2-style decoders (fused QKV Conv1D exported as
Gemm + Split, learned position embeddings): quantize-int4 quantizes the Conv1D weights, fuse-decoder refuses them
by name, explicit-attention handles them; matmul-to-conv runs shape inference itself on a graph without shapes."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from dyncompile.passes import build_passes, run_pipeline
from dyncompile.passes.fuse_decoder import FuseDecoderPass
from dyncompile.passes.matmul_to_conv import MatMulToConvPass
from dyncompile.passes.presets import PresetPass

LAYERS, HEADS, HEAD_DIM, VOCAB = 2, 2, 16, 64


@pytest.fixture(scope="module")
def gpt2_path(tmp_path_factory):
    """A tiny random-init GPT-2 (2 layers, n_embd 32) exported with a KV cache as the decoder recipes export."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from dyncompile.models._decoders import kv_input_names, kv_output_names, make_kv_wrapper
    from dyncompile.models._export import export_onnx

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=HEADS * HEAD_DIM, n_layer=LAYERS, n_head=HEADS, vocab_size=VOCAB,
                                  n_positions=64, bos_token_id=0, eos_token_id=0)
    wrapper = make_kv_wrapper(transformers.GPT2LMHeadModel(cfg).eval(), LAYERS)
    b, s, p = 2, 4, 3
    args = (torch.randint(0, VOCAB, (b, s)), torch.ones(b, p + s, dtype=torch.int64),
            torch.arange(p, p + s).unsqueeze(0).expand(b, s).contiguous(),
            *(torch.randn(b, HEADS, p, HEAD_DIM) for _ in range(2 * LAYERS)))
    batch, seq, past, total = (torch.export.Dim(n) for n in ("batch", "seq", "past", "past_plus_seq"))
    dyn = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: total}, "position_ids": {0: batch, 1: seq},
           "past": tuple({0: batch, 2: past} for _ in range(2 * LAYERS))}
    out = tmp_path_factory.mktemp("gpt2") / "model.onnx"
    export_onnx(wrapper, args, input_names=["input_ids", "attention_mask", "position_ids", *kv_input_names(LAYERS)],
                output_names=["logits", *kv_output_names(LAYERS)], dynamic_shapes=dyn, out_path=out,
                strip_prefix="model.")
    return out


def _feeds(past: int = 3, seq: int = 2) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    feeds = {"input_ids": rng.integers(0, VOCAB, (1, seq)).astype(np.int64),
             "attention_mask": np.ones((1, past + seq), np.int64),
             "position_ids": np.arange(past, past + seq, dtype=np.int64)[None]}
    for i in range(LAYERS):
        for kv in ("key", "value"):
            feeds[f"past_key_values.{i}.{kv}"] = rng.standard_normal((1, HEADS, past, HEAD_DIM)).astype(np.float32)
    return feeds


def _run(model: ir.Model | onnx.ModelProto, feeds) -> list[np.ndarray]:
    proto = model if isinstance(model, onnx.ModelProto) else ir.to_proto(model)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    return sess.run(None, {k: v for k, v in feeds.items() if k in names})


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_fuse_decoder_named_on_gpt2_warns_with_the_pattern_it_lacks(gpt2_path, caplog):
    model = ir.load(gpt2_path)
    with caplog.at_level(logging.WARNING):
        result = run_pipeline(build_passes("fuse-decoder"), model, check="none")
    assert not result.modified
    msgs = [m for m in _warnings(caplog) if "fuse-decoder" in m]
    assert msgs, "a named pass that does nothing must say so at the default verbosity"
    text = msgs[0]
    # learned positions: the Gather that reads position_ids, by name; fused QKV: the projection + Split, by name
    gather = next(n for n in model.graph if n.op_type == "Gather" and any(
        i is not None and i.name == "position_ids" for i in n.inputs))
    split = next(n for n in model.graph if n.op_type == "Split")
    assert "learned position" in text and gather.name in text
    assert "Split" in text and split.name in text
    assert "leave fuse-decoder out" in text


def test_inserted_preset_that_cannot_apply_stays_info(gpt2_path, caplog):
    model = ir.load(gpt2_path)
    with caplog.at_level(logging.INFO):
        run_pipeline([PresetPass(FuseDecoderPass(), "fuse-decoder", 2)], model, check="none")
    assert not _warnings(caplog)
    assert any("fuse-decoder" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)


def test_quantize_int4_quantizes_gpt2_conv1d_gemms(gpt2_path, caplog):
    model = ir.load(gpt2_path)
    weights = [n for n in model.graph if n.op_type == "Gemm"] + [
        n for n in model.graph if n.op_type == "MatMul" and n.inputs[1].const_value is not None]
    assert len(weights) == 4 * LAYERS + 1  # c_attn, c_proj, c_fc, mlp c_proj per layer, and the LM head
    ref = _run(ir.load(gpt2_path), _feeds())
    with caplog.at_level(logging.INFO):
        result = run_pipeline(build_passes("quantize-int4{block_size=16,accuracy_level=0}"), model, check="none")
    nbits = [n for n in result.model.graph if n.op_type == "MatMulNBits"]
    assert len(nbits) == len(weights), f"{len(nbits)} of {len(weights)} weight products quantized"
    assert not [n for n in result.model.graph if n.op_type == "Gemm"]
    got = _run(result.model, _feeds())
    assert got[0].shape == ref[0].shape
    assert np.abs(got[0] - ref[0]).max() < 0.1 * np.abs(ref[0]).max() + 0.05  # int4 of random weights: close, not equal


def test_gemm_unfolding_is_exact(gpt2_path):
    from dyncompile.passes.quantize_weights import gemms_as_matmuls

    model = ir.load(gpt2_path)
    ref = _run(ir.load(gpt2_path), _feeds())
    done, left = gemms_as_matmuls(model)
    assert done == 4 * LAYERS and not left
    assert not [n for n in model.graph if n.op_type == "Gemm"]
    for a, b in zip(_run(model, _feeds()), ref):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_explicit_attention_handles_gpt2(gpt2_path):
    model = ir.load(gpt2_path)
    result = run_pipeline(build_passes("explicit-attention"), model, check="none")
    assert result.modified
    assert "attention_bias" in {v.name for v in result.model.graph.inputs}


def test_speculative_tree_does_not_ask_for_a_pass_already_given(gpt2_path, monkeypatch):
    """explicit-attention named but unable to fire: the tree error says why, not 'add the explicit-attention pass'."""
    from dyncompile.errors import DyncompileError
    from dyncompile.passes.speculative import explicit_attention

    monkeypatch.setattr(explicit_attention, "find_attention_bias", lambda model, mask_input="attention_mask": None)
    model = ir.load(gpt2_path)
    passes = build_passes("explicit-attention,speculative{tree=true}", _context(drafter="prompt-lookup"))
    with pytest.raises(DyncompileError) as err:
        run_pipeline(passes, model, check="none")
    text = str(err.value)
    assert "add the explicit-attention pass" not in text
    assert "explicit-attention cannot fire on this model" in text


def _context(**options):
    from dyncompile.passes import CompileContext

    return CompileContext(options=options)


def _graph(nodes: list[ir.Node], inputs: list[ir.Value], outputs: list[ir.Value], inits=()) -> ir.Model:
    g = ir.Graph(inputs, outputs, nodes=nodes, initializers=list(inits), opset_imports={"": 18}, name="g")
    return ir.Model(g, ir_version=10)


def _no_shapes_graph() -> onnx.ModelProto:
    """x [b, s, 16] -> Relu -> (no shape recorded) -> MatMul(W [16, 16]) -> y: an export without value_info."""
    w = np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32)
    x = ir.val("x", ir.DataType.FLOAT, ir.Shape(["b", "s", 16]))
    wv = ir.val("W", const_value=ir.tensor(w, name="W"))
    relu = ir.node("Relu", [x], name="relu")
    relu.outputs[0].name = "r"
    mm = ir.node("MatMul", [relu.outputs[0], wv], name="mm")
    mm.outputs[0].name, mm.outputs[0].dtype = "y", ir.DataType.FLOAT
    return ir.to_proto(_graph([relu, mm], [x], [mm.outputs[0]], [wv]))


def test_matmul_to_conv_runs_shape_inference_itself():
    proto = _no_shapes_graph()
    model = ir.from_proto(proto)
    assert model.graph.node(1).inputs[0].shape is None
    result = MatMulToConvPass()(model)
    assert result.modified
    assert "Conv" in {n.op_type for n in result.model.graph}
    x = np.random.default_rng(2).standard_normal((2, 3, 16)).astype(np.float32)
    np.testing.assert_allclose(_run(result.model, {"x": x})[0], _run(proto, {"x": x})[0], atol=1e-5, rtol=0)


def test_matmul_to_conv_named_without_a_target_warns(caplog):
    """Nothing to lower (the weight is an input): the WARNING names the pass and the reason."""
    x = ir.val("x", ir.DataType.FLOAT, ir.Shape(["b", "s", 4]))
    w = ir.val("w", ir.DataType.FLOAT, ir.Shape([4, 4]))
    mm = ir.node("MatMul", [x, w], name="mm")
    mm.outputs[0].name, mm.outputs[0].dtype, mm.outputs[0].shape = "y", ir.DataType.FLOAT, ir.Shape(["b", "s", 4])
    model = _graph([mm], [x, w], [mm.outputs[0]])
    with caplog.at_level(logging.WARNING):
        result = run_pipeline(build_passes("matmul-to-conv"), model, check="none")
    assert not result.modified
    msgs = [m for m in _warnings(caplog) if "matmul-to-conv" in m]
    assert msgs and "constant" in msgs[0]


def test_pack_matmuls_named_on_gpt2_warns_that_qkv_is_already_one_product(gpt2_path, caplog):
    model = ir.load(gpt2_path)
    split = next(n for n in model.graph if n.op_type == "Split")
    with caplog.at_level(logging.WARNING):
        result = run_pipeline(build_passes("pack-matmuls"), model, check="none")
    assert not result.modified
    msgs = [m for m in _warnings(caplog) if "pack-matmuls" in m]
    assert msgs and split.name in msgs[0]


def test_trim_logits_named_without_an_lm_head_warns(caplog):
    x = ir.val("x", ir.DataType.FLOAT, ir.Shape(["b", "s", 4]))
    relu = ir.node("Relu", [x], name="relu")
    relu.outputs[0].name, relu.outputs[0].dtype, relu.outputs[0].shape = "y", ir.DataType.FLOAT, ir.Shape(["b", "s", 4])
    with caplog.at_level(logging.WARNING):
        result = run_pipeline(build_passes("trim-logits"), _graph([relu], [x], [relu.outputs[0]]), check="none")
    assert not result.modified
    assert any("trim-logits" in m and "LM head" in m for m in _warnings(caplog))
