"""fuse-encoder-attention: the real encoders' decomposed attention becomes one MultiHeadAttention per layer; outputs
unchanged (padded batches included); a second run and a graph without attention leave the model alone; the fused
graph quantizes and early-exits like the original."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from helpers import assert_left_alone_with_reason, ort_session  # tests/ is on pythonpath; ORT_DISABLE_ALL

from dyncompile.passes import FuseEncoderAttentionPass

_MS = "com.microsoft"


def _texts(rows, n):
    return [r["text"] for r in rows[:n]]


def _padded_feeds(artifacts, texts, names):
    """A batch of real texts padded to the longest (every row but one has padding the masks must hide)."""
    from dyncompile.runtime.text import TextEncoder

    feeds = TextEncoder(artifacts.tokenizer_path, max_length=128)(texts)
    assert (feeds["attention_mask"] == 0).any()  # the batch is padded: the masks matter
    return {k: v for k, v in feeds.items() if k in names}


@pytest.mark.parametrize("name, layers, heads", [("minilm", 6, 12), ("mpnet", 12, 12)])
def test_real_encoder_attention_is_fused_exactly(name, layers, heads, request, movie_test_rows, tmp_path):
    art = request.getfixturevalue(name)
    before = ir.load(art.onnx_path)
    softmaxes = sum(n.op_type == "Softmax" for n in before.graph)
    model = ir.load(art.onnx_path)
    result = FuseEncoderAttentionPass()(model)
    assert result.modified
    fused = ir.to_proto(result.model)
    onnx.checker.check_model(fused, full_check=True)
    mha = [n for n in fused.graph.node if n.op_type == "MultiHeadAttention"]
    assert len(mha) == layers and all(n.domain == _MS for n in mha)
    assert {a.i for n in mha for a in n.attribute if a.name == "num_heads"} == {heads}
    # the scale the export split over q and k (MiniLM) or divided by (MPNet) is 1/sqrt(head size)
    scales = {round(a.f, 6) for n in mha for a in n.attribute if a.name == "scale"}
    assert scales == {round(1 / np.sqrt(fused_hidden(fused, mha[0]) / heads), 6)}
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count("Softmax") == softmaxes - layers and "IsNaN" not in ops
    assert len(fused.graph.node) < len(list(before.graph)) - 10 * layers  # the detours went with them
    assert [o.name for o in fused.graph.output] == [v.name for v in before.graph.outputs]
    # outputs: the original's within round-off, on real padded rows, optimizations off
    names = [i.name for i in fused.graph.input]
    feeds = _padded_feeds(art, _texts(movie_test_rows, 8), names)
    ref = ort_session(art.onnx_path).run(None, feeds)[0]
    got = ort_session(fused.SerializeToString()).run(None, feeds)[0]
    assert np.abs(got - ref).max() <= 1e-5
    # and the masks still matter: the padded rows' logits equal the same rows run alone, unpadded
    for i in (0, 5):
        one = {k: v[i : i + 1, : int(feeds["attention_mask"][i].sum())] for k, v in feeds.items()}
        assert np.abs(ort_session(fused.SerializeToString()).run(None, one)[0][0] - got[i]).max() <= 1e-5
    # a second run finds nothing left to fuse
    again = FuseEncoderAttentionPass()(result.model)
    assert not again.modified


def fused_hidden(model: onnx.ModelProto, mha: onnx.NodeProto) -> int:
    """The width of the query a MultiHeadAttention reads (the q projection's weight columns)."""
    producers = {o: n for n in model.graph.node for o in n.output}
    inits = {i.name: i for i in model.graph.initializer}
    n = producers[mha.input[0]]
    while n.op_type != "MatMul":
        n = producers[n.input[0]]
    return int(inits[n.input[1]].dims[1])


def test_a_graph_without_attention_is_left_alone_with_a_reason(tiny_encoder_path, caplog):
    """Named by the user on a graph it cannot fire on: unchanged, and a WARNING with the reason and the fix."""
    assert_left_alone_with_reason(ir.load(tiny_encoder_path), "fuse-encoder-attention", caplog,
                                  "no Softmax of scaled, masked q.k^T scores")


def test_the_fused_graph_quantizes_and_keeps_its_predictions(minilm, movie_test_rows, tmp_path):
    """quantize-int8 after the fusion (ORT's quantizer gets no type for a contrib op's output from ONNX shape
    inference): the same int8 MatMuls as without the fusion, the same answers on real rows."""
    from dyncompile.passes.compiler import compile_model

    plain = compile_model(minilm.onnx_path, "quantize-int8{format=dynamic}", tmp_path / "q", progress=False,
                          opt_level=0).plan_dir
    fused = compile_model(minilm.onnx_path, "fuse-encoder-attention,quantize-int8{format=dynamic}", tmp_path / "fq",
                          progress=False, opt_level=0).plan_dir
    a, b = onnx.load(plain / "model.onnx"), onnx.load(fused / "model.onnx")
    ints = [sum(n.op_type == "MatMulInteger" for n in m.graph.node) for m in (a, b)]
    assert ints[0] == ints[1] >= 36  # every layer's six weight MatMuls (and the head's) in int8, fused or not
    assert sum(n.op_type == "MultiHeadAttention" for n in b.graph.node) == 6
    import dyncompile

    texts = _texts(movie_test_rows, 64)
    pa = dyncompile.load(plain).predict_proba(texts)
    pb = dyncompile.load(fused).predict_proba(texts)
    # dynamic int8 rounds activations: a 1e-6 change upstream can move a value across a rounding step, so the
    # probabilities differ a little on some rows (measured: median 1e-4, max 0.04); the answers do not
    assert (pa.argmax(-1) == pb.argmax(-1)).all() and np.median(np.abs(pa - pb)) < 1e-3


def _mha_and_ifs(graph: onnx.GraphProto) -> tuple[int, int]:
    mha = ifs = 0
    stack = [graph]
    while stack:
        cur = stack.pop()
        for n in cur.node:
            mha += n.op_type == "MultiHeadAttention"
            if n.op_type == "If":
                ifs += 1
                stack.extend(a.g for a in n.attribute if a.type == onnx.AttributeProto.GRAPH)
    return mha, ifs


@pytest.mark.parametrize("budget", [100.0, 0.0])
def test_fused_graph_early_exits_on_both_branches(budget, minilm, movie_test_rows, tmp_path):
    """fuse-encoder-attention then early-exit (If lowering): the layers are found on the fused graph and every
    attention stays fused inside the If branches; a budget of 100 points makes rows leave at an exit, a budget of 0
    sends rows through every layer, where the answer is the original model's."""
    import dyncompile
    from dyncompile.passes.compiler import compile_model

    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join(json.dumps(r) + "\n" for r in movie_test_rows[-200:]))
    plan = compile_model(minilm.onnx_path, "fuse-encoder-attention,early-exit", tmp_path / "ee", progress=False,
                         opt_level=0, calib=str(calib), budget=budget, confidence="none").plan_dir
    mha, ifs = _mha_and_ifs(onnx.load(plan / "model.onnx").graph)
    assert ifs >= 1 and mha == 6
    m = dyncompile.load(plan)
    texts = _texts(movie_test_rows, 24)
    probs, exits = [], []
    for t in texts:
        probs.append(m.predict_proba([t])[0])
        exits.append(int(np.asarray(m.last_info["exit_layer"]).reshape(-1)[0]))
    exits = np.array(exits)
    if budget:
        assert (exits < 6).any()
    else:
        full = exits == 6
        assert full.any()
        ref = ort_session(minilm.onnx_path)
        for i in np.flatnonzero(full):
            feeds = m.encode([texts[i]])
            x = ref.run(None, {k: feeds[k] for k in ("input_ids", "attention_mask", "token_type_ids")})[0][0]
            p = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
            assert np.abs(probs[i] - p).max() <= 1e-5
