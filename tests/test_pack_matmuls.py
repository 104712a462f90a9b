"""pack-matmuls: sibling MatMuls with constant weights become one MatMul + Split; outputs unchanged."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from dyncompile.passes.pack_matmuls import PackMatMulsPass

RNG = np.random.default_rng(0)


def _graph(siblings: int = 2, out_is_graph_output: bool = False) -> onnx.ModelProto:
    """x -> MatMul(W_i) for i < siblings (constant), MatMul(x, w_in) (not constant), each through Relu."""
    x = ir.val("x", ir.DataType.FLOAT, ir.Shape(["b", 3, 8]))
    w_in = ir.val("w_in", ir.DataType.FLOAT, ir.Shape([8, 4]))
    tape = ir.tape.Tape()
    inits, outs = [], []
    for i in range(siblings):
        w = ir.val(f"W{i}", const_value=ir.tensor(RNG.standard_normal((8, 3 + 2 * i)).astype(np.float32), name=f"W{i}"))
        inits.append(w)
        y = tape.op("MatMul", [x, w], name=f"mm{i}")
        y.name = f"y{i}"
        out = y if out_is_graph_output and i == 0 else tape.op("Relu", [y])
        if out is not y:
            out.name = f"r{i}"
        out.dtype, out.shape = ir.DataType.FLOAT, ir.Shape(["b", 3, 3 + 2 * i])
        outs.append(out)
    z = tape.op("MatMul", [x, w_in], name="dyn")
    z.name, z.dtype, z.shape = "z", ir.DataType.FLOAT, ir.Shape(["b", 3, 4])
    outs.append(z)
    g = ir.Graph([x, w_in], outs, nodes=tape.nodes, initializers=inits, opset_imports={"": 18}, name="g")
    return ir.to_proto(ir.Model(g, ir_version=10))


def _run(model: onnx.ModelProto, feeds) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def _feeds():
    return {"x": RNG.standard_normal((2, 3, 8)).astype(np.float32), "w_in": RNG.standard_normal((8, 4)).astype(np.float32)}


@pytest.mark.parametrize("siblings", [2, 3])
def test_packs_constant_siblings_exactly(siblings):
    proto = _graph(siblings)
    model = ir.from_proto(proto)
    result = PackMatMulsPass()(model)
    assert result.modified
    packed = ir.to_proto(result.model)
    onnx.checker.check_model(packed, full_check=True)
    ops = [n.op_type for n in packed.graph.node]
    assert ops.count("MatMul") == 2 and ops.count("Split") == 1  # the packed one + the non-constant one
    weights = {i.name: i for i in packed.graph.initializer}
    assert not any(n.startswith("W") for n in weights)  # the sibling weights are gone, packed into one
    (w,) = [i for n, i in weights.items() if n.endswith(".weight")]
    assert list(w.dims) == [8, sum(3 + 2 * i for i in range(siblings))]
    assert [o.name for o in packed.graph.output] == [o.name for o in proto.graph.output]
    feeds = _feeds()
    for a, b in zip(_run(proto, feeds), _run(packed, feeds)):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)
    again = PackMatMulsPass()(result.model)
    assert not again.modified


def test_leaves_lone_and_output_matmuls_alone():
    lone = ir.from_proto(_graph(1))
    assert not PackMatMulsPass()(lone).modified  # one constant MatMul on x (+ one non-constant): nothing to pack
    exposed = ir.from_proto(_graph(2, out_is_graph_output=True))
    assert not PackMatMulsPass()(exposed).modified  # a sibling's output is a graph output
    assert not PackMatMulsPass(min_group=3)(ir.from_proto(_graph(2))).modified
    with pytest.raises(ValueError, match="min_group"):
        PackMatMulsPass(min_group=1)


def test_packed_smollm2_decoder_matches_the_fused_one(smollm2_model_path, tmp_path):
    """Real decoder: fuse-decoder then pack-matmuls packs q/k/v and gate/up in each of the 30 layers (q/k/v then
    go into GQA whole: 30 Splits left, gate/up), and greedy decoding through the runtime gives the same tokens as the
    fused graph alone."""
    import dyncompile
    from dyncompile.runtime.executor import load

    dyncompile.compile(smollm2_model_path, passes="fuse-decoder", output_dir=tmp_path / "fused", opt_level=0)
    dyncompile.compile(smollm2_model_path, passes="fuse-decoder,pack-matmuls", output_dir=tmp_path / "packed",
                       opt_level=0)
    m = onnx.load(str(tmp_path / "packed" / "model.onnx"), load_external_data=False)
    splits = [n for n in m.graph.node if n.op_type == "Split"]
    assert len(splits) == 30
    assert sum(n.op_type == "GroupQueryAttention" for n in m.graph.node) == 30
    a, b = load(tmp_path / "fused"), load(tmp_path / "packed")
    ids = [1, 504, 3458, 314, 260, 1345, 28, 334, 6578]
    ra = a.generate(ids, max_new_tokens=12, speculative=False)
    rb = b.generate(ids, max_new_tokens=12, speculative=False)
    assert list(ra.token_ids) == list(rb.token_ids)


def _biased_graph(all_biased: bool = True) -> onnx.ModelProto:
    """x -> MatMul(W_i) + b_i (q/k/v with biases, as Qwen's attention), each through Relu; with ``all_biased=False``
    the last sibling has no bias."""
    x = ir.val("x", ir.DataType.FLOAT, ir.Shape(["b", 3, 8]))
    tape = ir.tape.Tape()
    inits, outs = [], []
    for i in range(3):
        n = 3 + 2 * i
        w = ir.val(f"W{i}", const_value=ir.tensor(RNG.standard_normal((8, n)).astype(np.float32), name=f"W{i}"))
        inits.append(w)
        y = tape.op("MatMul", [x, w], name=f"mm{i}")
        if all_biased or i < 2:
            b = ir.val(f"B{i}", const_value=ir.tensor(RNG.standard_normal(n).astype(np.float32), name=f"B{i}"))
            inits.append(b)
            y = tape.op("Add", [b, y] if i == 1 else [y, b], name=f"add{i}")  # either operand order
        out = tape.op("Relu", [y])
        out.name, out.dtype, out.shape = f"r{i}", ir.DataType.FLOAT, ir.Shape(["b", 3, n])
        outs.append(out)
    g = ir.Graph([x], outs, nodes=tape.nodes, initializers=inits, opset_imports={"": 18}, name="g")
    return ir.to_proto(ir.Model(g, ir_version=10))


@pytest.mark.parametrize("all_biased", [True, False])
def test_packs_the_biases_with_their_matmuls(all_biased):
    proto = _biased_graph(all_biased)
    result = PackMatMulsPass()(ir.from_proto(proto))
    assert result.modified
    packed = ir.to_proto(result.model)
    onnx.checker.check_model(packed, full_check=True)
    ops = [n.op_type for n in packed.graph.node]
    assert ops.count("MatMul") == 1 and ops.count("Split") == 1
    if all_biased:  # one Add of the concatenated biases, between the packed MatMul and the Split
        assert ops.count("Add") == 1 and ops.index("MatMul") < ops.index("Add") < ops.index("Split")
        names = {i.name for i in packed.graph.initializer}
        assert not any(n.startswith("B") for n in names)
    else:  # one sibling has no bias: the biases stay on the split outputs
        assert ops.count("Add") == 2 and ops.index("Split") < ops.index("Add")
    feeds = {"x": RNG.standard_normal((2, 3, 8)).astype(np.float32)}
    for a, b in zip(_run(proto, feeds), _run(packed, feeds)):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)
    assert not PackMatMulsPass()(result.model).modified


@pytest.fixture(scope="module")
def fused_smollm2(smollm2_model_path, module_tmp):
    """SmolLM2 through explicit-attention + fuse-decoder (GQA fed by RotaryEmbedding(q), RotaryEmbedding(k), v)."""
    from dyncompile.passes.compiler import compile_model

    out = module_tmp("fused_smol") / "plan"
    compile_model(smollm2_model_path, "explicit-attention,fuse-decoder", out, progress=False, opt_level=0)
    return onnx.load(str(out / "model.onnx"))  # weights in memory


def _decoder_feeds(proto: onnx.ModelProto, ids, positions, bias, past=None):
    kv = [i for i in proto.graph.input if i.name.startswith("past_key_values.")]
    feeds = {"input_ids": np.asarray([ids], np.int64), "position_ids": np.asarray([positions], np.int64),
             "attention_bias": bias}
    for i in kv:
        dims = [d.dim_value for d in i.type.tensor_type.shape.dim]
        feeds[i.name] = past[i.name] if past else np.zeros((1, dims[1], 0, dims[3]), np.float32)
    return feeds


def test_packed_qkv_goes_into_group_query_attention_whole(fused_smollm2):
    """After fuse-decoder, the packed q/k/v Split and both RotaryEmbeddings of each layer fold into GQA
    (``do_rotary=1`` with the position_ids input); outputs equal the unpacked graph's through a prompt and then a
    draft-tree call (siblings share a position, a masked hole in the past)."""
    neg = np.finfo(np.float32).min
    original = fused_smollm2
    model = ir.from_proto(original)  # copies: the fixture's proto stays as it is
    assert PackMatMulsPass()(model).modified
    packed = ir.to_proto(model)
    onnx.checker.check_model(packed, full_check=True)
    ops = [n.op_type for n in packed.graph.node]
    gqa = [n for n in packed.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == 30 and "RotaryEmbedding" not in ops
    assert ops.count("Split") == 30  # gate/up only: every attention Split went into its GQA
    for n in gqa:
        attrs = {a.name: a.i for a in n.attribute if a.type == onnx.AttributeProto.INT}
        assert attrs["do_rotary"] == 1 and n.input[1] == n.input[2] == "" and n.input[9] == "position_ids"
        assert n.input[0].startswith("pack_matmuls.")  # the packed projection itself
    assert [i.name for i in packed.graph.input] == [i.name for i in original.graph.input]
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sessions = [ort.InferenceSession(p.SerializeToString(), so, providers=["CPUExecutionProvider"])
                for p in (original, packed)]
    names = [o.name for o in original.graph.output]
    prompt = [1, 504, 3458, 314, 260, 1345]
    p = len(prompt)
    bias = np.full((1, 1, p, p), neg, np.float32)
    bias[0, 0][np.tril_indices(p)] = 0.0
    first = [s.run(None, _decoder_feeds(original, prompt, range(p), bias)) for s in sessions]
    for a, b in zip(*first):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-4)
    past = {n.replace("present", "past_key_values"): v for n, v in zip(names[1:], first[0][1:])}
    tree = [28, 334, 6578, 42]  # root, two children of the root (one position), a grandchild of the second
    parents = [-1, 0, 0, 2]
    depth = [0, 1, 1, 2]
    tb = np.full((1, 1, 4, p + 4), neg, np.float32)
    tb[0, 0, :, :p] = 0.0
    tb[0, 0, :, 2] = neg  # a rolled-back hole in the past
    for i in range(4):
        j = i
        while j >= 0:
            tb[0, 0, i, p + j] = 0.0
            j = parents[j]
    second = [s.run(None, _decoder_feeds(original, tree, [p + d for d in depth], tb, past)) for s in sessions]
    for a, b in zip(*second):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-4)
    assert np.abs(second[0][0][0, 1] - second[0][0][0, 2]).max() > 1e-2  # the siblings' rows really differ
    assert not PackMatMulsPass()(model).modified


def test_unpacked_qkv_keeps_its_rotary(fused_smollm2):
    """q/k/v not packed (min_group above 3 leaves attention's three projections alone): GQA keeps its inputs."""
    model = ir.from_proto(fused_smollm2)
    PackMatMulsPass(min_group=4)(model)
    ops = [n.op_type for n in model.graph]
    assert ops.count("RotaryEmbedding") == 60
    assert all(n.attributes.get_int("do_rotary", 0) == 0 for n in model.graph if n.op_type == "GroupQueryAttention")
