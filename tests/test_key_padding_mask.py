"""key-padding-mask (passes/key_padding_mask.py): the exported padding bias -> MultiHeadAttention's key_padding_mask.

Golden tests on the real encoders (structure, outputs on padded real rows with ORT's optimizations off, the
masks still matter, full_check, a second run reports ``modified=False``), and the cases where it must not fire:
no MultiHeadAttention, a bias that is a graph input, and a bias computed from attention_mask alone that is not a
padding mask (it hides the tokens instead: the probe's negative control).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from helpers import assert_left_alone_with_reason, ort_session  # ORT_DISABLE_ALL
from test_fuse_encoder_attention import _padded_feeds, _texts

from dyncompile.passes import FuseEncoderAttentionPass, KeyPaddingMaskPass

_MS = "com.microsoft"


def _fused(path) -> ir.Model:
    model = ir.load(path)
    assert FuseEncoderAttentionPass()(model).modified
    return model


@pytest.mark.parametrize("name, layers, kept_bias", [("minilm", 6, False), ("mpnet", 12, True)])
def test_real_padding_bias_becomes_the_key_padding_mask(name, layers, kept_bias, request, movie_test_rows):
    art = request.getfixturevalue(name)
    model = _fused(art.onnx_path)
    fused = ir.to_proto(model)
    result = KeyPaddingMaskPass()(model)
    assert result.modified
    out = ir.to_proto(result.model)
    onnx.checker.check_model(out, full_check=True)
    producers = {o: n for n in out.graph.node for o in n.output}
    mha = [n for n in out.graph.node if n.op_type == "MultiHeadAttention" and n.domain == _MS]
    assert len(mha) == layers
    masks = {n.input[4] for n in mha}
    assert len(masks) == 1  # one Cast shared by every layer
    cast = producers[masks.pop()]
    assert cast.op_type == "Cast" and list(cast.input) == ["attention_mask"]
    assert next(a.i for a in cast.attribute if a.name == "to") == onnx.TensorProto.INT32
    # MiniLM: no bias left; MPNet: its relative position bias stays, the padding half of the sum is gone
    biases = {n.input[5] if len(n.input) > 5 else "" for n in mha}
    assert (biases != {""}) == kept_bias
    ops = [n.op_type for n in out.graph.node]
    assert "GatherND" not in ops and ops.count("Where") < [n.op_type for n in fused.graph.node].count("Where")
    assert len(out.graph.node) <= len(fused.graph.node) - 15  # the exporter's mask chain went
    assert [o.name for o in out.graph.output] == [o.name for o in fused.graph.output]
    # outputs on real padded rows, optimizations off: those of the fused graph, and the masks still matter
    names = [i.name for i in out.graph.input]
    feeds = _padded_feeds(art, _texts(movie_test_rows, 8), names)
    want = ort_session(fused.SerializeToString()).run(None, feeds)[0]
    got = ort_session(out.SerializeToString()).run(None, feeds)[0]
    assert np.abs(got - want).max() <= 1e-6
    for i in (0, 5):
        one = {k: v[i : i + 1, : int(feeds["attention_mask"][i].sum())] for k, v in feeds.items()}
        assert np.abs(ort_session(out.SerializeToString()).run(None, one)[0][0] - got[i]).max() <= 1e-5
    assert not KeyPaddingMaskPass()(result.model).modified


def _mha_graph(bias_from: str, shape_of_x: bool = False) -> ir.Model:
    """One MultiHeadAttention over q = k = v = x ``[B, S, 8]`` (2 heads) whose attention_bias is ``bias_from``:
    ``input`` (a graph input), ``padding`` (0 for a token, -1e9 for padding) or ``inverted`` (-1e9 for a token)."""
    x = ir.val("x", ir.DataType.FLOAT, ir.Shape(["B", "S", 8]))
    mask = ir.val("attention_mask", ir.DataType.INT64, ir.Shape(["B", "S"]))
    inputs, nodes = [x, mask], []

    def const(arr, name):
        return ir.val(name, const_value=ir.tensor(np.asarray(arr), name=name))

    inits = [const(np.array([1, 2], np.int64), "axes"), const(np.array([1, 3], np.int64), "query_axes"),
             const(np.array(0, np.int64), "zero_i"), const(np.array(1, np.int64), "one"),
             const(np.array(0.0, np.float32), "zero"), const(np.array(-1e9, np.float32), "big")]
    c = {v.name: v for v in inits}
    if bias_from == "input":
        bias = ir.val("bias", ir.DataType.FLOAT, ir.Shape(["B", 1, "S", "S"]))
        inputs.append(bias)
    else:  # [B, 1, S, S]: the key's mask for every query (MultiHeadAttention wants the query axis)
        keys = ir.node("Unsqueeze", [mask, c["axes"]])
        queries = ir.node("Unsqueeze", [mask, c["query_axes"]])
        zero = c["zero_i"]
        if shape_of_x:  # the same 0, through the Shape of a rank-3 input
            dims = ir.node("ReduceMin", [ir.node("Shape", [x]).outputs[0]], attributes={"keepdims": ir.AttrInt64("keepdims", 0)})
            times_zero = ir.node("Mul", [dims.outputs[0], zero])
            nodes += [dims.inputs[0].producer(), dims, times_zero]
            zero = times_zero.outputs[0]
        zeros = ir.node("Mul", [queries.outputs[0], zero])
        m4 = ir.node("Add", [zeros.outputs[0], keys.outputs[0]])
        is_token = ir.node("Equal", [m4.outputs[0], c["one"]])
        is_pad = ir.node("Not", [is_token.outputs[0]])
        keep = is_pad if bias_from == "inverted" else is_token
        where = ir.node("Where", [keep.outputs[0], c["zero"], c["big"]])
        nodes += [keys, queries, zeros, m4, is_token, is_pad, where]
        bias = where.outputs[0]
    mha = ir.node("MultiHeadAttention", [x, x, x, None, None, bias], domain=_MS,
                  attributes={"num_heads": ir.AttrInt64("num_heads", 2)})
    mha.outputs[0].name = "y"
    nodes.append(mha)
    g = ir.Graph(inputs, [mha.outputs[0]], nodes=nodes, initializers=inits, opset_imports={"": 17, _MS: 1})
    return ir.Model(g, ir_version=10)


def _feeds(with_bias: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((2, 5, 8)).astype(np.float32),
             "attention_mask": np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], np.int64)}
    if with_bias:
        feeds["bias"] = np.zeros((2, 1, 5, 5), np.float32)
    return feeds


def test_a_padding_bias_is_rewritten_and_answers_the_same():
    model = _mha_graph("padding")
    want = ort_session(ir.to_proto(model).SerializeToString()).run(None, _feeds())[0]
    assert KeyPaddingMaskPass()(model).modified
    out = ir.to_proto(model)
    assert [n.op_type for n in out.graph.node] == ["Cast", "MultiHeadAttention"]
    got = ort_session(out.SerializeToString()).run(None, _feeds())[0]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("bias_from, why", [
    ("input", "no MultiHeadAttention bias is a padding mask computed from 'attention_mask' alone"),
    ("inverted", "no MultiHeadAttention bias is a padding mask computed from 'attention_mask' alone"),
])
def test_a_bias_that_is_not_a_padding_mask_is_left_alone_with_a_reason(bias_from, why, caplog):
    assert_left_alone_with_reason(_mha_graph(bias_from), "key-padding-mask", caplog, why)


def test_a_bias_the_probe_cannot_evaluate_is_left_alone(caplog):
    """A padding bias whose cone also reads the Shape of a rank-3 input: the probe feeds [batch, sequence] arrays,
    ONNX Runtime refuses the rank, and the pass leaves the graph alone instead of failing the compile."""
    model = _mha_graph("padding", shape_of_x=True)
    want = ort_session(ir.to_proto(model).SerializeToString()).run(None, _feeds())[0]
    assert_left_alone_with_reason(model, "key-padding-mask", caplog, "no MultiHeadAttention bias is a padding mask")
    np.testing.assert_array_equal(ort_session(ir.to_proto(model).SerializeToString()).run(None, _feeds())[0], want)


def test_a_weak_mask_filter_value_is_left_alone_with_a_reason(caplog):
    """The operator's own padded-key value must be as strong as the bias it replaces."""
    model = _mha_graph("padding")
    next(n for n in model.graph if n.op_type == "MultiHeadAttention").attributes["mask_filter_value"] = \
        ir.AttrFloat32("mask_filter_value", -5.0)
    assert_left_alone_with_reason(model, "key-padding-mask", caplog, "mask_filter_value above -10000")


def test_a_graph_without_multihead_attention_is_left_alone_with_a_reason(tiny_encoder_path, caplog):
    assert_left_alone_with_reason(ir.load(tiny_encoder_path), "key-padding-mask", caplog,
                                  "no com.microsoft.MultiHeadAttention (run fuse-encoder-attention first)")
