"""Graph analysis (dyncompile.passes.analysis): layers and cut tensors of real exported models.

The real-model checks use the session fixtures ``minilm_model_path`` (BERT classifier, 6 layers) and
``smollm2_model_path`` (Llama decoder with KV cache, 30 layers) from conftest.py. A cut tensor is checked
the way the early-exit pass uses it: ``ir.convenience.extract`` from [graph inputs + cut] to a later tensor,
run in ONNX Runtime (ORT_DISABLE_ALL) on the value the original model computes for the cut.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common
import pytest
from helpers import ort_session

from dyncompile.passes.analysis import (
    WEIGHT_MIN_ELEMENTS,
    CutTensor,
    ModelStructure,
    NoLayerStructureError,
    analyze_model,
    format_report,
)

ATOL = 1e-5
RTOL = 0.0


# ----------------------------------------------------------------------------------------------- helpers


def _snapshot(model: ir.Model) -> str:
    return ir.to_onnx_text(model, exclude_initializers=True)


def _analyze_unmodified(model: ir.Model) -> ModelStructure:
    """``analyze_model(model)``, checking that the model is left as it was."""
    before = _snapshot(model)
    s = analyze_model(model)
    assert _snapshot(model) == before, "analyze_model must not modify the model"
    return s


def _feeds(graph: ir.Graph, *, batch: int = 2, seq: int = 7, past: int = 3, vocab: int = 1000, seed: int = 0):
    """Feeds for the graph inputs, by name and type: ids, masks (with padding), positions, past KV."""
    rng = np.random.default_rng(seed)
    has_past = any(v.name.startswith("past") for v in graph.inputs)
    p = past if has_past else 0
    feeds = {}
    for v in graph.inputs:
        name = v.name
        if name == "input_ids":
            feeds[name] = rng.integers(0, vocab, (batch, seq)).astype(np.int64)
        elif name == "attention_mask":
            mask = np.ones((batch, p + seq), np.int64)
            mask[1:, -2:] = 0  # right padding on every row but the first
            feeds[name] = mask
        elif name == "token_type_ids":
            feeds[name] = np.zeros((batch, seq), np.int64)
        elif name == "position_ids":
            feeds[name] = np.tile(np.arange(p, p + seq, dtype=np.int64), (batch, 1))
        elif name.startswith("past"):
            dims = [d if isinstance(d, int) else None for d in v.shape]
            shape = [batch, dims[1], p, dims[3]]
            feeds[name] = (rng.standard_normal(shape) * 0.5).astype(np.float32)
        else:
            raise AssertionError(f"test does not know how to feed input {name!r}")
    return feeds


def _run_with_exposed(model_path, names: list[str], tmp_path, feeds) -> dict[str, np.ndarray]:
    """Run the original model with extra outputs ``names`` (a copy in tmp_path) -> {output name: value}."""
    model = ir.load(model_path)
    mapping = ir.convenience.create_value_mapping(model.graph)
    for name in names:
        v = mapping[name]
        assert v.dtype is not None and v.shape is not None, f"{name} has no type in the exported graph"
        if not v.is_graph_output():
            model.graph.outputs.append(v)
    path = tmp_path / "exposed.onnx"
    ir.save(model, path, external_data="exposed.onnx.data")  # also rewrites tensors the source kept external
    sess = ort_session(path)
    out_names = [o.name for o in sess.get_outputs()]
    return dict(zip(out_names, sess.run(None, feeds), strict=True))


def _extract_model(model: ir.Model, inputs: list[str], outputs: list[str]) -> ir.Model:
    graph = ir.convenience.extract(model.graph, inputs=inputs, outputs=outputs)
    return ir.Model(graph, ir_version=model.ir_version)  # the graph carries the opset imports


def _run_extracted(part: ir.Model, tmp_path, tag: str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    path = tmp_path / f"{tag}.onnx"
    ir.save(part, path, external_data=f"{tag}.onnx.data")
    sess = ort_session(path)
    wanted = {i.name for i in sess.get_inputs()}
    return sess.run(None, {k: v for k, v in feeds.items() if k in wanted})


def _weights_read(model: ir.Model, node_names, threshold: int = WEIGHT_MIN_ELEMENTS) -> set[str]:
    """Names of the big constants read by the named nodes."""
    names = set(node_names)
    out = set()
    for node in model.graph:
        if node.name in names:
            for v in node.inputs:
                if v is not None and v.const_value is not None and v.const_value.size >= threshold:
                    out.add(v.name)
    return out


def _check_common(s: ModelStructure, num_layers: int, hidden: int):
    assert s.has_layers and s.num_layers == num_layers
    assert [layer.index for layer in s.layers] == list(range(1, num_layers + 1))
    assert [c.after_layer for c in s.cuts] == list(range(num_layers + 1))
    assert len({c.name for c in s.cuts}) == num_layers + 1
    for cut in s.cuts:
        assert isinstance(cut, CutTensor)
        assert cut.dtype == "float32"
        assert len(cut.shape) == 3 and cut.shape[-1] == hidden, cut
        assert all(isinstance(d, str) for d in cut.shape[:2]), f"batch and sequence dims stay symbolic: {cut}"
    for k, layer in enumerate(s.layers, start=1):
        assert layer.input_cut == s.cuts[k - 1].name and layer.output_cut == s.cuts[k].name
        assert layer.num_nodes == s.layers[0].num_nodes > 0
        assert layer.num_nodes == len(layer.node_names)
        assert layer.first_node == layer.node_names[0] and layer.last_node == layer.node_names[-1]
        assert layer.param_count == s.layers[0].param_count > 0
        assert s.cut_for_layer(k).name == layer.output_cut
    assert s.cut_for_layer(0) == s.cuts[0]
    with pytest.raises(IndexError, match="layers 1.."):
        s.cut_for_layer(num_layers + 1)
    assert s.hidden_size == hidden
    assert s.require_layers() is s


# ------------------------------------------------------------------------------------------------ MiniLM


@pytest.fixture(scope="module")
def minilm_model(minilm_model_path) -> ir.Model:
    return ir.load(minilm_model_path)


@pytest.fixture(scope="module")
def minilm_structure(minilm_model) -> ModelStructure:
    return _analyze_unmodified(minilm_model)


def test_minilm_layers_and_cuts(minilm_structure):
    s = minilm_structure
    _check_common(s, num_layers=6, hidden=384)
    assert s.segments_per_layer == 4  # post-LN BERT: attn, +LN, FFN, +LN
    assert all(len(layer.inner_cuts) == 3 for layer in s.layers)
    # each layer reads 4 attention + 2 FFN weight matrices (+ biases, LayerNorms): 1.78M parameters
    assert s.layers[0].param_count == 4 * (384 * 384 + 384) + 2 * 384 * 1536 + 1536 + 384 + 4 * 384
    assert s.family == "bert" and "LayerNorm" in s.family_reason
    assert s.task == "text-classification"
    assert 22_000_000 < s.param_count < 23_500_000
    assert [(name, dtype, len(shape)) for name, dtype, shape in s.inputs] == [
        ("input_ids", "int64", 2),
        ("attention_mask", "int64", 2),
        ("token_type_ids", "int64", 2),
    ]
    assert [o[0] for o in s.outputs] == ["logits"] and s.outputs[0][2][-1] == 2
    assert s.op_histogram["MatMul"] >= 36 and s.op_histogram["LayerNormalization"] == 13


def test_minilm_head_is_cls_pooler(minilm_structure, minilm_model):
    head = minilm_structure.head
    assert head.pooling == "cls"
    assert head.description.startswith("Gather index 0 on axis 1")
    assert "Tanh" in head.description and head.description.endswith("logits")
    ops = [n.op_type for n in minilm_model.graph if n.name in set(head.nodes)]
    assert ops == ["Gather", "Gemm", "Tanh", "Gemm"]


def test_minilm_every_cut_separates_in_ort(minilm_model_path, minilm_model, minilm_structure, tmp_path):
    """Tail from [inputs + cut k] reproduces the logits; segment k-1 -> k reproduces cut k; nothing before
    cut k is recomputed (no weight of layers <= k or of the embeddings is in the tail)."""
    s = minilm_structure
    feeds = _feeds(minilm_model.graph, vocab=30522)
    cut_names = [c.name for c in s.cuts]
    ref = _run_with_exposed(minilm_model_path, cut_names, tmp_path, feeds)
    graph_inputs = [v.name for v in minilm_model.graph.inputs]
    for k, cut in enumerate(s.cuts):
        tail = _extract_model(minilm_model, [*graph_inputs, cut.name], ["logits"])
        (logits,) = _run_extracted(tail, tmp_path, f"tail{k}", {**feeds, cut.name: ref[cut.name]})
        np.testing.assert_allclose(logits, ref["logits"], rtol=RTOL, atol=ATOL, err_msg=f"tail from cut {k}")
        before = _weights_read(minilm_model, s.embedding_nodes)
        for layer in s.layers[:k]:
            before |= _weights_read(minilm_model, layer.node_names)
        tail_weights = {
            v.name for v in tail.graph.initializers.values() if v.const_value.size >= WEIGHT_MIN_ELEMENTS
        }
        assert before and not (tail_weights & before), (
            f"tail from cut {k} recomputes {sorted(tail_weights & before)}"
        )
        if k > 0:
            seg = _extract_model(minilm_model, [*graph_inputs, s.cuts[k - 1].name], [cut.name])
            heavy = [
                n
                for n in seg.graph
                if any(
                    v is not None and v.const_value is not None and v.const_value.size >= WEIGHT_MIN_ELEMENTS
                    for v in n.inputs
                )
            ]
            assert [n.op_type for n in heavy] == ["MatMul"] * 6, f"layer {k} segment"
            (out,) = _run_extracted(
                seg, tmp_path, f"seg{k}", {**feeds, s.cuts[k - 1].name: ref[s.cuts[k - 1].name]}
            )
            np.testing.assert_allclose(out, ref[cut.name], rtol=RTOL, atol=ATOL, err_msg=f"layer {k} segment")


def test_minilm_report(minilm_structure, minilm):
    import torch  # noqa: F401  (transformers needs it)
    from transformers import AutoModelForSequenceClassification

    text = format_report(minilm_structure)
    # the parameter count of the model the ONNX file was exported from, counted by PyTorch
    hf = AutoModelForSequenceClassification.from_pretrained(str(minilm.hf_dir))
    torch_params = sum(p.numel() for p in hf.parameters())
    for fact in (
        "input_ids: int64 [batch, seq]",
        "logits: float32 [batch, 2]",
        "Family guess: bert",
        "Task guess: text-classification",
        "Layers: 6 found",
        "pooling=cls",
        "MatMul",
        f"parameters: {torch_params:,} ",
    ):
        assert fact in text, fact
    for cut in minilm_structure.cuts:
        assert f"after layer {cut.after_layer:>3}: {cut.name}  float32 [batch, seq, 384]" in text
    for layer in minilm_structure.layers:
        assert f"{layer.first_node} .. {layer.last_node}" in text


# ----------------------------------------------------------------------------------------------- SmolLM2


@pytest.fixture(scope="module")
def smollm2_model(smollm2_model_path) -> ir.Model:
    return ir.load(smollm2_model_path)


@pytest.fixture(scope="module")
def smollm2_structure(smollm2_model) -> ModelStructure:
    return _analyze_unmodified(smollm2_model)


def test_smollm2_layers_and_cuts(smollm2_structure, smollm2_model):
    s = smollm2_structure
    _check_common(s, num_layers=30, hidden=576)
    assert s.segments_per_layer == 2  # pre-norm: attention + residual, MLP + residual
    assert s.family == "llama", s.family_reason
    assert "kv_cache_inputs=60" in s.family_reason
    assert s.task == "text-generation"
    assert s.head.pooling == "none"  # the LM head computes logits at every position, nothing is pooled
    assert "MatMul" in s.head.description and "logits" in s.head.description
    assert 130_000_000 < s.param_count < 140_000_000
    assert sum(1 for i in s.inputs if i[0].startswith("past_key_values.")) == 60
    # every layer concatenates its past K and V: the past inputs do not break the cuts
    assert s.cuts[0].producer and s.embedding_nodes


def test_smollm2_every_layer_is_one_segment(smollm2_structure, smollm2_model):
    """[graph inputs + cut k-1] -> cut k holds exactly one decoder layer: 7 weight MatMuls (q, k, v, o, gate,
    up, down) and one K/V concat pair with the layer's own past."""
    s = smollm2_structure
    graph_inputs = [v.name for v in smollm2_model.graph.inputs]
    for k in range(1, s.num_layers + 1):
        seg = ir.convenience.extract(
            smollm2_model.graph, inputs=[*graph_inputs, s.cuts[k - 1].name], outputs=[s.cuts[k].name]
        )
        heavy = collections.Counter(
            n.op_type
            for n in seg
            if any(
                v is not None and v.const_value is not None and v.const_value.size >= WEIGHT_MIN_ELEMENTS
                for v in n.inputs
            )
        )
        assert heavy == {"MatMul": 7}, f"layer {k}: {heavy}"
        pasts = {
            v.name
            for n in seg
            if n.op_type == "Concat"
            for v in n.inputs
            if v is not None and v.name.startswith("past_key_values.")
        }
        assert pasts == {f"past_key_values.{k - 1}.key", f"past_key_values.{k - 1}.value"}, (
            f"layer {k}: {pasts}"
        )


def test_smollm2_cut_separates_in_ort(smollm2_model_path, smollm2_model, smollm2_structure, tmp_path):
    """Logits from [inputs + cut after layer L-2] equal the full model's (with a past KV cache)."""
    s = smollm2_structure
    k = s.num_layers - 2
    cut = s.cut_for_layer(k)
    feeds = _feeds(smollm2_model.graph, batch=2, seq=5, past=3, vocab=49152)
    ref = _run_with_exposed(smollm2_model_path, [cut.name], tmp_path, feeds)
    graph_inputs = [v.name for v in smollm2_model.graph.inputs]
    tail = _extract_model(smollm2_model, [*graph_inputs, cut.name], ["logits"])
    big = [v for v in tail.graph.initializers.values() if v.const_value.size >= WEIGHT_MIN_ELEMENTS]
    assert len(big) == 2 * 7 + 1, sorted(v.name for v in big)  # two layers + the (tied) LM head
    (logits,) = _run_extracted(tail, tmp_path, "tail", {**feeds, cut.name: ref[cut.name]})
    np.testing.assert_allclose(logits, ref["logits"], rtol=RTOL, atol=ATOL)


def test_smollm2_report(smollm2_structure):
    text = format_report(smollm2_structure)
    assert "past_key_values.0.key .. past_key_values.29.key (30 tensors)" in text
    assert "Layers: 30 found" in text and "Family guess: llama" in text and "text-generation" in text
    assert f"after layer  30: {smollm2_structure.cuts[-1].name}" in text and ", 576]" in text


# ------------------------------------------------------------------------------------------------- MPNet


def test_mpnet_layers_and_cuts(mpnet):
    """MPNet: 12 post-LN layers, relative position bias shared by all layers (recomputable, not a cut).

    Runs in CI: the model is built once per machine (test_models_recipes builds it too); the analysis
    itself takes well under a second."""
    s = _analyze_unmodified(ir.load(mpnet.onnx_path))
    _check_common(s, num_layers=12, hidden=768)
    assert (s.family, s.task, s.head.pooling) == ("mpnet", "text-classification", "cls"), s.family_reason
    assert s.segments_per_layer == 4


# ------------------------------------------------------------------------------------ synthetic graphs


def _mlp_without_layers() -> ir.Model:
    """x -> MatMul(W1 [512, 256]) -> Relu -> MatMul(W2 [256, 8]) -> y: weights, but nothing repeats."""
    rng = np.random.default_rng(0)
    w1 = ir.val("w1", const_value=ir.tensor(rng.standard_normal((512, 256)).astype(np.float32), name="w1"))
    w2 = ir.val("w2", const_value=ir.tensor(rng.standard_normal((256, 8)).astype(np.float32), name="w2"))
    x = ir.val("x", ir.DataType.FLOAT, ir.Shape(["batch", 512]))
    tape = ir.tape.Tape()
    y = tape.op("MatMul", [tape.op("Relu", [tape.op("MatMul", [x, w1])]), w2])
    y.name, y.dtype, y.shape = "y", ir.DataType.FLOAT, ir.Shape(["batch", 8])
    g = ir.Graph([x], [y], nodes=tape.nodes, initializers=[w1, w2], opset_imports={"": 18}, name="mlp")
    return ir.Model(g, ir_version=10)


def _residual_stack(num_blocks: int = 3, hidden: int = 256) -> ir.Model:
    """x [b, s, hidden] (float input, like inputs_embeds) -> blocks h += Relu(h @ W_i) -> mean over s -> W_out."""
    rng = np.random.default_rng(1)
    x = ir.val("x", ir.DataType.FLOAT, ir.Shape(["batch", "seq", hidden]))
    tape = ir.tape.Tape()
    inits = []
    h = x
    for i in range(num_blocks):
        w = ir.val(
            f"w{i}", const_value=ir.tensor((rng.standard_normal((hidden, hidden)) / 16).astype(np.float32))
        )
        inits.append(w)
        h = tape.op("Add", [h, tape.op("Relu", [tape.op("MatMul", [h, w])])])
    axes = ir.val("axes", const_value=ir.tensor(np.array([1], np.int64)))
    w_out = ir.val("w_out", const_value=ir.tensor(rng.standard_normal((hidden, 3)).astype(np.float32)))
    inits += [axes, w_out]
    y = tape.op("MatMul", [tape.op("ReduceMean", [h, axes], {"keepdims": 0}), w_out])
    y.name, y.dtype, y.shape = "y", ir.DataType.FLOAT, ir.Shape(["batch", 3])
    g = ir.Graph([x], [y], nodes=tape.nodes, initializers=inits, opset_imports={"": 18}, name="stack")
    return ir.Model(g, ir_version=10)


@pytest.mark.parametrize("builder", ["tiny_mlp", "mlp_with_weights"])
def test_no_layer_structure(builder):
    if builder == "tiny_mlp":
        from dyncompile.models.synthetic import tiny_mlp

        model = tiny_mlp()
    else:
        model = _mlp_without_layers()
    s = analyze_model(model)
    assert not s.has_layers and s.layers == [] and s.cuts == [] and s.num_layers == 0
    assert s.message and "layer" in s.message
    with pytest.raises(NoLayerStructureError, match="no repeated layer structure") as err:
        s.require_layers()
    assert s.message in str(err.value)
    with pytest.raises(NoLayerStructureError):
        s.cut_for_layer(1)
    text = format_report(s)
    assert "Layers: none found" in text and s.message in text
    assert s.task == "unknown" and s.family == "unknown"
    assert s.inputs[0][0] == "x" and s.outputs[0][0] == "y"


def test_tiny_encoder_and_unsorted_graph():
    """The lead's synthetic BERT-shaped classifier: 4 layers, CLS head; same answer when the node list is
    not in topological order (analysis sorts a view, the model is left as it is)."""
    from dyncompile.models.synthetic import tiny_encoder_classifier

    model = tiny_encoder_classifier(num_layers=4)
    s = analyze_model(model)
    _check_common(s, num_layers=4, hidden=256)
    assert s.head.pooling == "cls" and s.task == "text-classification"

    shuffled = tiny_encoder_classifier(num_layers=4)
    nodes = list(shuffled.graph)
    shuffled.graph.remove(nodes)
    shuffled.graph.extend(reversed(nodes))
    before = [n.name for n in shuffled.graph]
    s2 = analyze_model(shuffled)
    assert [n.name for n in shuffled.graph] == before
    assert [c.name for c in s2.cuts] == [c.name for c in s.cuts]
    assert [(c.after_layer, c.shape) for c in s2.cuts] == [(c.after_layer, c.shape) for c in s.cuts]


def test_activation_input_stack_in_ort(tmp_path):
    """A stack fed with activations (no embedding): the float graph input is the cut before layer 1, the head
    mean-pools, and the tail from every cut reproduces the output in ORT."""
    model = _residual_stack(num_blocks=3)
    s = analyze_model(model)
    assert s.num_layers == 3 and s.cuts[0].name == "x" and s.cuts[0].shape == ["batch", "seq", 256]
    assert s.head.pooling == "mean" and s.head.description.startswith("ReduceMean over axis 1")
    assert s.family == "encoder"
    x = np.random.default_rng(2).standard_normal((2, 5, 256)).astype(np.float32)
    onnx_ir.passes.common.ShapeInferencePass()(model)  # extract needs typed boundary values
    names = [c.name for c in s.cuts[1:]]
    exposed = ir.from_proto(ir.to_proto(model))
    mapping = ir.convenience.create_value_mapping(exposed.graph)
    exposed.graph.outputs.extend(mapping[n] for n in names)
    ref = dict(
        zip([o.name for o in exposed.graph.outputs], ort_session(exposed).run(None, {"x": x}), strict=True)
    )
    ref["x"] = x
    for cut in s.cuts:
        tail = _extract_model(model, ["x", cut.name] if cut.name != "x" else ["x"], ["y"])
        feeds = {"x": x, cut.name: ref[cut.name]}
        sess = ort_session(tail)
        (y,) = sess.run(None, {i.name: feeds[i.name] for i in sess.get_inputs()})
        np.testing.assert_allclose(y, ref["y"], rtol=RTOL, atol=ATOL)


def test_last_layer_output_as_graph_output():
    """A feature extractor that returns its last hidden state: the graph output is the last cut."""
    model = _residual_stack(num_blocks=3)
    graph = model.graph
    y = graph.outputs[0]
    head = [
        n
        for n in graph
        if n.op_type in ("ReduceMean", "MatMul") and n.outputs[0] in (y, y.producer().inputs[0])
    ]
    h = head[0].inputs[0]
    graph.outputs[0] = h
    graph.remove(head, safe=True)
    h.name, h.dtype, h.shape = "last_hidden_state", ir.DataType.FLOAT, ir.Shape(["batch", "seq", 256])
    s = analyze_model(model)
    assert s.num_layers == 3 and s.cuts[-1].name == "last_hidden_state"
    assert s.head.pooling == "none" and s.head.nodes == [] and "graph output" in s.head.description
    assert s.task == "feature-extraction"


_RANDOM_HF = {
    # name: (config class, model class, config kwargs, family, task, pooling)
    "bert": ("BertConfig", "BertForSequenceClassification", {}, "bert", "text-classification", "cls"),
    "roberta": (
        "RobertaConfig",
        "RobertaForSequenceClassification",
        {},
        "roberta",
        "text-classification",
        "cls",
    ),
    "mpnet": ("MPNetConfig", "MPNetForSequenceClassification", {}, "mpnet", "text-classification", "cls"),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"num_key_value_heads": 2},
        "qwen2",
        "text-generation",
        "none",
    ),
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"num_key_value_heads": 2},
        "llama",
        "text-generation",
        "none",
    ),
}


@pytest.mark.parametrize("arch", sorted(_RANDOM_HF))
def test_random_hf_exports(arch, tmp_path):
    """Family/task/layers on small randomly initialised Hugging Face models exported with torch.onnx (dynamo);
    random weights give the real graph structure without a download. Names are scrubbed so that only the
    structure can speak. Runs in CI (torch and transformers are in the export extra the test venv has):
    about 7-13 s per architecture on 2 shared cores, almost all of it the export."""
    import torch
    import transformers
    cfg_cls, model_cls, extra, family, task, pooling = _RANDOM_HF[arch]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(
        hidden_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=512,
        vocab_size=1000,
        max_position_embeddings=128,
        **extra,
    )
    hf = getattr(transformers, model_cls)(cfg).eval()

    class Wrapper(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask):
            return self.m(input_ids=input_ids, attention_mask=attention_mask).logits

    ids = torch.randint(3, 100, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.int64)
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
    path = tmp_path / f"{arch}.onnx"
    torch.onnx.export(
        Wrapper(hf),
        (ids, mask),
        str(path),
        dynamo=True,
        opset_version=18,
        input_names=["input_ids", "attention_mask"],
        output_names=["logits"],
        dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}),
    )
    model = ir.load(path)
    for i, v in enumerate(list(model.graph.initializers.values())):  # only the structure may speak
        v.name = f"w{i}"
    for node in model.graph:
        node.name = ""
    s = analyze_model(model)
    _check_common(s, num_layers=3, hidden=256)
    assert (s.family, s.task, s.head.pooling) == (family, task, pooling), s.family_reason
    # weight names refine the family within its group (bert/roberta/mpnet, llama/qwen2), never across
    first = next(iter(model.graph.initializers.values()))
    first.name = f"{_SAME_GROUP[family]}.w"
    assert analyze_model(model).family == _SAME_GROUP[family]
    first.name = f"{_OTHER_GROUP[family]}.w"
    assert analyze_model(model).family == family


_SAME_GROUP = {"bert": "roberta", "roberta": "bert", "mpnet": "bert", "llama": "qwen2", "qwen2": "llama"}
_OTHER_GROUP = {"bert": "llama", "roberta": "qwen2", "mpnet": "llama", "llama": "bert", "qwen2": "mpnet"}


def test_weight_names_name_a_generic_family():
    """A structure that is only 'encoder' takes the family its weight names give (and says so)."""
    model = _residual_stack(num_blocks=3)
    assert analyze_model(model).family == "encoder"
    model.graph.initializers["w0"].name = "bert.encoder.layer.0.weight"
    s = analyze_model(model)
    assert s.family == "bert" and "weight names say 'bert'" in s.family_reason
