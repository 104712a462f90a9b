"""A tiny causal decoder with a KV cache, built with onnx_ir (test models are code, like :mod:`.synthetic`).

Same interface as the exported Hugging Face decoders (SmolLM2): inputs ``input_ids [b, s]``,
``attention_mask [b, past+s]``, ``position_ids [b, s]``, ``past_key_values.{i}.key/value [b, H, past, D]``;
outputs ``logits [b, s, V]`` and ``present.{i}.key/value [b, H, past+s, D]``. Pre-LN blocks with real causal
attention over the cache, so speculative verification (several tokens per call) and one-token decoding agree.
Matrices are ``hidden x hidden`` so that, with ``hidden >= 256``, the graph analysis sees "heavy" layers.

:func:`write_decoder_dir` and :func:`write_word_tokenizer` lay one out as a model directory (``model.onnx``,
``dyncompile-model.json``, ``tokenizer.json``) like the real recipes do, so the compiler and the runtime
treat it as they treat SmolLM2.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx_ir as ir

__all__ = ["tiny_decoder", "write_decoder_dir", "write_word_tokenizer"]


def tiny_decoder(
    num_layers: int = 2,
    hidden: int = 256,
    heads: int = 4,
    vocab: int = 8,
    seed: int = 0,
    *,
    with_kv: bool = True,
    logit_scale: float = 1.0,
    max_positions: int = 512,
    mlp: str = "relu",
) -> ir.Model:
    """A pre-LN causal decoder of ``num_layers`` blocks (``hidden``, ``heads``, vocabulary ``vocab``) with random
    weights from ``seed``; ``with_kv=False`` drops the cache inputs/outputs, ``logit_scale`` spreads the logits.
    ``mlp="swiglu"``: Llama-style gated MLPs ``down(SiLU(gate(x)) * up(x))`` (SiLU as ``g * Sigmoid(g)``, as torch
    exports it; intermediate size ``2 * hidden``) instead of ``fc2(Relu(fc1(x)))``."""
    if mlp not in ("relu", "swiglu"):
        raise ValueError(f"mlp must be 'relu' or 'swiglu', not {mlp!r}")
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads
    tape = ir.tape.Tape()
    inits: list[ir.Value] = []

    def init(arr, name):
        v = ir.val(name, const_value=ir.tensor(np.asarray(arr), name=name))
        inits.append(v)
        return v

    def weight(shape, scale, name):
        return init((rng.standard_normal(shape) * scale).astype(np.float32), name)

    ids = ir.val("input_ids", ir.DataType.INT64, ir.Shape(["batch", "seq"]))
    mask = ir.val("attention_mask", ir.DataType.INT64, ir.Shape(["batch", "past_plus_seq"]))
    pos = ir.val("position_ids", ir.DataType.INT64, ir.Shape(["batch", "seq"]))
    inputs = [ids, mask, pos]
    pasts = []
    if with_kv:
        for i in range(num_layers):
            for kind in ("key", "value"):
                v = ir.val(
                    f"past_key_values.{i}.{kind}", ir.DataType.FLOAT, ir.Shape(["batch", heads, "past", head_dim])
                )
                inputs.append(v)
                pasts.append(v)

    emb = weight((vocab, hidden), 1.0, "embed_tokens.weight")
    pos_emb = weight((max_positions, hidden), 0.5, "embed_positions.weight")
    h = tape.op("Add", [tape.op("Gather", [emb, ids], {"axis": 0}), tape.op("Gather", [pos_emb, pos], {"axis": 0})])

    ones = init(np.ones(hidden, np.float32), "ln.scale")
    zeros = init(np.zeros(hidden, np.float32), "ln.bias")
    i0 = init(np.array([0], np.int64), "c_i0")
    i1 = init(np.array([1], np.int64), "c_i1")
    ax0 = init(np.array([0], np.int64), "c_ax0")
    ax01 = init(np.array([0, 1], np.int64), "c_ax01")
    ax12 = init(np.array([1, 2], np.int64), "c_ax12")
    one_s = init(np.array(1, np.int64), "c_one")
    zero_f = init(np.array(0.0, np.float32), "c_zero_f")
    neg_f = init(np.array(-1e9, np.float32), "c_neg_f")
    scale = init(np.array(1.0 / np.sqrt(head_dim), np.float32), "c_scale")
    split_shape = init(np.array([0, 0, heads, head_dim], np.int64), "c_split_shape")
    merge_shape = init(np.array([0, 0, hidden], np.int64), "c_merge_shape")

    # causal + padding mask bias [b, 1, s, T]
    total = tape.op("Squeeze", [tape.op("Slice", [tape.op("Shape", [mask]), i1, tape.op("Add", [i1, i1])]), ax0])
    seq = tape.op("Squeeze", [tape.op("Slice", [tape.op("Shape", [ids]), i1, tape.op("Add", [i1, i1])]), ax0])
    past_len = tape.op("Sub", [total, seq])
    zero_s = tape.op("Sub", [one_s, one_s])
    q_pos = tape.op("Unsqueeze", [tape.op("Range", [past_len, total, one_s]), i1])  # [s, 1]
    k_pos = tape.op("Unsqueeze", [tape.op("Range", [zero_s, total, one_s]), i0])  # [1, T]
    causal = tape.op("LessOrEqual", [k_pos, q_pos])  # [s, T]
    causal = tape.op("Unsqueeze", [causal, ax01])  # [1, 1, s, T]
    pad = tape.op("Equal", [mask, tape.op("CastLike", [one_s, mask])])  # [b, T]
    pad = tape.op("Unsqueeze", [pad, ax12])  # [b, 1, 1, T]
    bias = tape.op("Where", [tape.op("And", [causal, pad]), zero_f, neg_f])

    def ln(x):
        return tape.op("LayerNormalization", [x, ones, zeros], {"axis": -1, "epsilon": 1e-5})

    def split_heads(x):
        return tape.op("Transpose", [tape.op("Reshape", [x, split_shape])], {"perm": [0, 2, 1, 3]})

    presents = []
    for i in range(num_layers):
        wq = weight((hidden, hidden), 1.0 / np.sqrt(hidden), f"layers.{i}.q")
        wk = weight((hidden, hidden), 1.0 / np.sqrt(hidden), f"layers.{i}.k")
        wv = weight((hidden, hidden), 1.0 / np.sqrt(hidden), f"layers.{i}.v")
        wo = weight((hidden, hidden), 0.5 / np.sqrt(hidden), f"layers.{i}.o")
        w1 = weight((hidden, hidden), 1.0 / np.sqrt(hidden), f"layers.{i}.fc1")
        w2 = weight((hidden, hidden), 0.5 / np.sqrt(hidden), f"layers.{i}.fc2")
        x = ln(h)
        q = split_heads(tape.op("MatMul", [x, wq]))
        k = split_heads(tape.op("MatMul", [x, wk]))
        v = split_heads(tape.op("MatMul", [x, wv]))
        if with_kv:
            k = tape.op("Concat", [pasts[2 * i], k], {"axis": 2})
            v = tape.op("Concat", [pasts[2 * i + 1], v], {"axis": 2})
            presents += [k, v]
        scores = tape.op("Mul", [tape.op("MatMul", [q, tape.op("Transpose", [k], {"perm": [0, 1, 3, 2]})]), scale])
        probs = tape.op("Softmax", [tape.op("Add", [scores, bias])], {"axis": -1})
        ctx = tape.op("Reshape", [tape.op("Transpose", [tape.op("MatMul", [probs, v])], {"perm": [0, 2, 1, 3]}), merge_shape])
        h = tape.op("Add", [h, tape.op("MatMul", [ctx, wo])])
        if mlp == "swiglu":
            wg = weight((hidden, 2 * hidden), 1.0 / np.sqrt(hidden), f"layers.{i}.gate")
            wu = weight((hidden, 2 * hidden), 1.0 / np.sqrt(hidden), f"layers.{i}.up")
            wd = weight((2 * hidden, hidden), 0.5 / np.sqrt(2 * hidden), f"layers.{i}.down")
            xn = ln(h)
            g = tape.op("MatMul", [xn, wg])
            act = tape.op("Mul", [tape.op("Mul", [g, tape.op("Sigmoid", [g])]), tape.op("MatMul", [xn, wu])])
            h = tape.op("Add", [h, tape.op("MatMul", [act, wd])])
        else:
            h = tape.op("Add", [h, tape.op("MatMul", [tape.op("Relu", [tape.op("MatMul", [ln(h), w1])]), w2])])
    w_lm = weight((hidden, vocab), logit_scale / np.sqrt(hidden), "lm_head.weight")
    logits = tape.op("MatMul", [ln(h), w_lm])
    logits.name, logits.dtype, logits.shape = "logits", ir.DataType.FLOAT, ir.Shape(["batch", "seq", vocab])
    outputs = [logits]
    for i in range(num_layers if with_kv else 0):
        for j, kind in enumerate(("key", "value")):
            p = presents[2 * i + j]
            p.name = f"present.{i}.{kind}"
            p.dtype = ir.DataType.FLOAT
            p.shape = ir.Shape(["batch", heads, "past_plus_seq", head_dim])
            outputs.append(p)
    graph = ir.Graph(
        inputs, outputs, nodes=tape.nodes, initializers=inits, opset_imports={"": 18}, name="tiny_decoder"
    )
    return ir.Model(graph, ir_version=10, producer_name="dyncompile.models.synthetic_decoder")


def write_decoder_dir(
    directory: Path, model: ir.Model, *, name: str = "tiny-decoder", eos: int = 0, bos: int | None = None, **extra
) -> Path:
    """Save ``model`` as ``directory/model.onnx`` with a ``dyncompile-model.json`` (text-generation)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "model.onnx"
    ir.save(model, path)
    vocab = model.graph.outputs[0].shape[-1]
    cfg = {
        "format": "dyncompile.model/v1",
        "name": name,
        "task": "text-generation",
        "vocab_size": int(vocab),
        "eos_token_id": eos,
        "bos_token_id": bos,
        "max_position_embeddings": 512,
        **extra,
    }
    (directory / "dyncompile-model.json").write_text(json.dumps(cfg, indent=2))
    return path


def write_word_tokenizer(directory: Path, vocab: int, *, eos: int | None = None) -> Path:
    """A word-level ``tokenizer.json`` for the tiny decoders: token ``i`` is the word ``w{i}``
    (``<eos>`` at id ``eos`` if given), split on whitespace."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = {f"w{i}": i for i in range(vocab)}
    if eos is not None:
        words = {("<eos>" if i == eos else w): i for w, i in words.items()}
    tok = Tokenizer(models.WordLevel(words, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    if eos is not None:
        tok.add_special_tokens(["<eos>"])
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    tok.save(str(path))
    return path
