"""``split-drafter``: build a drafter from the target decoder's own first ``k`` layers.

The drafter is the target graph cut after layer ``k``, followed by a small linear *bridge* fitted on
calibration text (least squares from the layer-``k`` hidden states to the last layer's, applied before
the final norm), the target's final norm and LM head — optionally restricted to the tokens that
matter on the calibration text (a vocabulary subset makes the drafter's LM head much cheaper; any
subset keeps decoding exact, it only changes how often drafts are accepted). Everything but the bridge
and the (sub-)head is the target's own weights, shared on disk by the plan, and the first ``k`` layers'
KV cache is the target's, which the runtime hands over after every verification.

``k`` is chosen by measured acceptance x cost: for every candidate, the bridge is fitted on 3/4 of the
calibration tokens and the drafter's greedy agreement with the target (its acceptance rate) is measured
on the rest; the cost of a draft step is the fraction of the target's per-token weight reads the drafter
does; a verification of ``g+1`` tokens costs what the target's measured timings say. The projected speedup
``max_g E(alpha, g) / (g * c + v(g + 1))`` (:mod:`dyncompile.runtime.rules.cost_model`, the model the runtime's draft
length controller uses too) picks ``k``; below ``min_speedup`` (default 1) the pass refuses.

Module layout: graph surgery (:func:`trim_lm_head`, :func:`build_split_drafter`), calibration input
(:func:`read_calibration_text`), the pass; measurement lives in :mod:`.probe`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from dyncompile.io import read_jsonl
from dyncompile.passes import _keys
from dyncompile.passes._graph import backward_slice, const_array
from dyncompile.passes._infra import CompileContext, register_pass
from dyncompile.passes._infra import progress_bar as _progress
from dyncompile.passes.speculative.decoder_spec import DrafterError, decoder_spec
from dyncompile.passes.speculative.probe import measure_verify_costs, prefill_feeds, session_for
from dyncompile.runtime.rules.cost_model import projected_speedup, verify_slope

logger = logging.getLogger(__name__)

__all__ = [
    "SplitDrafterPass",
    "build_split_drafter",
    "drop_unused_pasts",
    "frequent_subset",
    "read_calibration_text",
    "tokenized_calibration",
    "trim_lm_head",
]

SPLIT_DRAFTER_FORMAT = "dyncompile.split_drafter/v1"
MIN_CALIB_TOKENS = 64


# ------------------------------------------------------------------------------------------- graph surgery


def trim_lm_head(model: ir.Model, logits_name: str, subset: np.ndarray) -> bool:
    """Restrict the LM head producing ``logits_name`` to the tokens ``subset`` (in place).

    Handles ``MatMul(x, W)``, ``MatMul(x, Transpose(E))`` (tied embeddings) and an optional bias ``Add``, a
    weight-only quantized head ``MatMulNBits`` (its packed rows, scales and zero points; ``quantize-int4``), and a
    head lowered by ``matmul-to-conv`` (``Squeeze(Transpose(Conv(., W[N, K, 1, 1])))``: the Conv's output channels).
    The weights are sliced into new initializers (the originals stay shared). Returns False, changing
    nothing, for any other head shape.
    """
    g = model.graph
    out = next((v for v in g.outputs if v.name == logits_name), None)
    if out is None or out.producer() is None:
        return False
    node, idx = out.producer(), np.asarray(subset, np.int64)
    if node.op_type == "MatMulNBits" and node.domain == "com.microsoft":
        return _trim_matmul_nbits(g, node, out, idx)
    if node.op_type == "Squeeze":
        return _trim_conv(g, node, out, idx)
    return _trim_matmul(g, node, out, idx)


def _use_subset(g: ir.Graph, node: ir.Node, i: int, rows: np.ndarray) -> None:
    """Feed ``node``'s input ``i`` from a new initializer holding ``rows`` (the sliced original, which stays)."""
    name = f"{node.inputs[i].name}.subset"
    new = ir.val(name, const_value=ir.tensor(np.ascontiguousarray(rows), name=name))
    g.register_initializer(new)
    node.replace_input_with(i, new)


def _set_dim(v: ir.Value, axis: int, size: int) -> None:
    """Set one dimension of ``v``'s recorded shape, if it has one."""
    if v.shape is not None:
        dims = list(v.shape)
        dims[axis] = size
        v.shape = ir.Shape(dims)


def _trim_conv(g: ir.Graph, squeeze: ir.Node, out: ir.Value, idx: np.ndarray) -> bool:
    """:func:`trim_lm_head` for ``matmul-to-conv``'s head: keep output channels ``idx`` of the 1x1 Conv's weight."""
    tr = squeeze.inputs[0].producer() if squeeze.inputs and squeeze.inputs[0] is not None else None
    conv = tr.inputs[0].producer() if tr is not None and tr.op_type == "Transpose" else None
    if conv is None or conv.op_type != "Conv" or conv.domain not in ("", "ai.onnx") or len(conv.inputs) != 2:
        return False
    if len(tr.inputs[0].uses()) != 1 or len(squeeze.inputs[0].uses()) != 1:
        return False
    w = conv.inputs[1]
    arr = const_array(w)
    if arr is None or arr.ndim != 4 or arr.shape[2:] != (1, 1) or idx.size == 0 or idx.max() >= arr.shape[0]:
        return False
    _use_subset(g, conv, 1, arr[idx])
    for v, axis in ((conv.outputs[0], 1), (tr.outputs[0], -1), (out, -1)):
        _set_dim(v, axis, len(idx))
    return True


def _trim_matmul(g: ir.Graph, node: ir.Node, out: ir.Value, idx: np.ndarray) -> bool:
    """:func:`trim_lm_head` for a float head: ``MatMul`` (of a weight or a transposed embedding), optional bias."""
    bias_node = None
    if node.op_type == "Add":
        bias_node = node
        mm = next((v.producer() for v in node.inputs if v is not None and v.producer() is not None
                   and v.producer().op_type == "MatMul"), None)
        if mm is None:
            return False
        node = mm
    if node.op_type != "MatMul":
        return False
    w = node.inputs[1]
    if bias_node is not None:
        b = next((v for v in bias_node.inputs if v is not None and v.const_value is not None), None)
        barr = const_array(b)
        if barr is None or barr.shape[-1] < idx.max() + 1:
            return False
    if w.const_value is not None:
        arr = w.const_value.numpy()
        if arr.ndim != 2:
            return False
        _use_subset(g, node, 1, arr[:, idx])
    elif w.producer() is not None and w.producer().op_type == "Transpose" and w.producer().inputs[0].const_value is not None:
        tr = w.producer()
        perm = tr.attributes.get_ints("perm", None)
        e = tr.inputs[0]
        arr = e.const_value.numpy()
        if arr.ndim != 2 or (perm is not None and list(perm) != [1, 0]):
            return False
        _use_subset(g, tr, 0, arr[idx])
        _set_dim(w, -1, len(idx))
    else:
        return False
    if bias_node is not None:
        bi = next(i for i, v in enumerate(bias_node.inputs) if v is not None and v.const_value is not None)
        _use_subset(g, bias_node, bi, const_array(bias_node.inputs[bi])[..., idx])
        _set_dim(node.outputs[0], -1, len(idx))
    _set_dim(out, -1, len(idx))
    return True


def _trim_matmul_nbits(g: ir.Graph, node: ir.Node, out: ir.Value, idx: np.ndarray) -> bool:
    """:func:`trim_lm_head` for ``MatMulNBits``: keep output rows ``idx`` of every row-major input, and set ``N``.

    Those are B ``[N, blocks, blob]``, the scales ``[N * blocks]`` / ``[N, blocks]``, the packed zero points and the
    bias.
    """
    n = node.attributes.get_int("N", 0)
    ins = list(node.inputs)
    if n <= 0 or idx.size == 0 or idx.max() >= n or len(ins) > 4 and any(v is not None for v in ins[4:5]):
        return False  # no N, or a g_idx input (act-order): not a plain row-major layout
    arrays = {}
    for i in (1, 2, 3, 5):
        v = ins[i] if i < len(ins) else None
        if v is None:
            continue
        arr = const_array(v)
        if arr is None or arr.size % n:
            return False
        arrays[i] = arr
    if 1 not in arrays or 2 not in arrays:
        return False
    for i, arr in arrays.items():
        rows = arr.reshape(n, -1)[idx]
        shape = (len(idx), *arr.shape[1:]) if arr.shape[0] == n else (rows.size,)
        _use_subset(g, node, i, rows.reshape(shape))
    node.attributes["N"] = ir.AttrInt64("N", len(idx))
    _set_dim(out, -1, len(idx))
    return True


def frequent_subset(score: np.ndarray, n: int, special_ids: Sequence[int] = ()) -> np.ndarray:
    """The ``n`` token ids of highest ``score`` (counts on calibration text) plus ``special_ids``, sorted.

    Ties (tokens the text never shows) go to lower ids first: a BPE vocabulary lists earlier, more frequent merges
    first.
    """
    vocab_size = len(score)
    score = np.asarray(score, np.float64) - np.arange(vocab_size) * 1e-9
    chosen = set(np.argsort(-score, kind="stable")[:n].tolist())
    chosen.update(int(i) for i in special_ids if 0 <= int(i) < vocab_size)
    return np.array(sorted(chosen), dtype=np.int64)


def drop_unused_pasts(g: ir.Graph, keep_nodes: set[ir.Node]) -> None:
    """Remove past inputs no kept Concat reads; shape-only readers are rewired to a kept past of the same shape."""
    pasts = [v for v in g.inputs if v.shape is not None and len(v.shape) == 4 and v.dtype is not None
             and v.dtype.is_floating_point()]
    used_directly = {v for v in pasts if any(u.node in keep_nodes and u.node.op_type == "Concat" for u in v.uses())}
    for v in pasts:
        if v in used_directly:
            continue
        if v.uses():
            if any(u.node.op_type not in ("Shape", "Size") for u in v.uses()):
                raise DrafterError(
                    f"cannot split the drafter: past input {v.name!r} of a dropped layer is still read by "
                    f"{[u.node.op_type for u in v.uses()][:3]} in the first layers"
                )
            kind = v.name.rsplit(".", 1)[-1]
            same = [p for p in used_directly if list(p.shape) == list(v.shape) and p.name.endswith(kind)] or [
                p for p in used_directly if list(p.shape) == list(v.shape)]
            if not same:
                raise DrafterError(f"cannot split the drafter: nothing can stand in for the past length read from {v.name!r}")
            repl = sorted(same, key=lambda p: p.name)[0]
            for u in list(v.uses()):
                u.node.replace_input_with(u.idx, repl)
        g.inputs.remove(v)


def build_split_drafter(
    target: ir.Model,
    *,
    cut_in: str,
    cut_last: str,
    logits: str,
    bridge: tuple[np.ndarray, np.ndarray] | None,
    subset: np.ndarray | None,
) -> ir.Model:
    """The drafter graph: target up to ``cut_in`` -> bridge -> the head that followed ``cut_last``.

    KV inputs/outputs of the dropped layers are removed (shape-only readers of a dropped past input, such
    as a mask computing the past length, are rewired to a kept past input of identical shape).
    Initializer tensors are the target's own objects (shared), except the bridge and a trimmed head.
    """
    d = target.clone()
    g = d.graph
    for k in [k for k in d.metadata_props if k.startswith("dyncompile.")]:
        del d.metadata_props[k]
    values = ir.convenience.create_value_mapping(g)
    h_in, h_last = values[cut_in], values[cut_last]
    new = h_in
    if bridge is not None:
        w, b = bridge
        wv = ir.val("split_drafter.bridge.weight", const_value=ir.tensor(np.ascontiguousarray(w, np.float32),
                                                                          name="split_drafter.bridge.weight"))
        bv = ir.val("split_drafter.bridge.bias", const_value=ir.tensor(np.ascontiguousarray(b, np.float32),
                                                                        name="split_drafter.bridge.bias"))
        g.register_initializer(wv)
        g.register_initializer(bv)
        mm = ir.node("MatMul", [h_in, wv], name="split_drafter.bridge.matmul")
        add = ir.node("Add", [mm.outputs[0], bv], name="split_drafter.bridge.add")
        mm.outputs[0].name = "split_drafter.bridge.mm"
        add.outputs[0].name = "split_drafter.bridge.out"
        if h_last.dtype is not None:
            for v in (mm.outputs[0], add.outputs[0]):
                v.dtype, v.shape = h_last.dtype, h_last.shape
        g.insert_after(h_in.producer(), [mm, add])
        new = add.outputs[0]
    if new is not h_last:
        h_last.replace_all_uses_with(new)
    logits_v = next(v for v in g.outputs if v.name == logits)
    keep_nodes = backward_slice([logits_v])
    kept_outputs = [v for v in g.outputs if v is logits_v or (v.producer() in keep_nodes)]
    g.outputs.clear()
    g.outputs.extend(kept_outputs)
    common_passes.RemoveUnusedNodesPass()(d)
    drop_unused_pasts(g, keep_nodes)
    if subset is not None and not trim_lm_head(d, logits, subset):
        raise DrafterError("cannot restrict the LM head to a vocabulary subset (unknown head shape); use vocab=full")
    d.metadata_props[_keys.ROLE] = "drafter"
    return d


# ------------------------------------------------------------------------------------------- calibration


def read_calibration_text(path: str | Path) -> list[str]:
    """Texts of a calibration file: plain text (one text), JSONL (``text`` fields) or a directory of text files."""
    p = Path(path)
    if not p.exists():
        raise DrafterError(f"calibration text not found: {p} (give a text file, a JSONL file or a directory)")
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in (".txt", ".py", ".md", ".rst", ".jsonl"))
        if not files:
            raise DrafterError(f"calibration directory {p} holds no .txt/.py/.md/.rst/.jsonl files")
        return [t for f in files for t in read_calibration_text(f)]
    if p.suffix == ".jsonl":
        return [r["text"] for r in read_jsonl(p)]
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DrafterError(f"calibration file {p} is not UTF-8 text") from None
    if not text.strip():
        raise DrafterError(f"calibration file {p} is empty")
    return [text]


def tokenized_calibration(context: CompileContext, calib: str | Path, what: str) -> tuple[list[list[int]], list[int]]:
    """The calibration text ``calib`` as token ids of the target's tokenizer, one list per text, and special ids.

    The special ids are the model's eos, bos and pad tokens; ``what`` names the pass option that needs them in the
    error for a missing tokenizer.
    """
    from tokenizers import Tokenizer

    texts = read_calibration_text(calib)
    tok_path = context.tokenizer_file()
    if tok_path is None or not Path(tok_path).is_file():
        raise DrafterError(
            f"{what} tokenizes the calibration text with the target's tokenizer, but {tok_path} is missing; "
            "pass --tokenizer tokenizer.json"
        )
    tok = Tokenizer.from_file(str(tok_path))
    tok.no_truncation()
    tok.no_padding()
    ids = [e.ids for e in tok.encode_batch(texts)]
    cfg = context.model_config or {}
    eos = cfg.get("eos_token_id")
    special = [*(eos if isinstance(eos, list) else [eos]), cfg.get("bos_token_id"), cfg.get("pad_token_id")]
    return ids, [i for i in special if isinstance(i, int)]


def _chunk(ids_list: Sequence[Sequence[int]], chunk_len: int, max_tokens: int) -> list[list[int]]:
    chunks: list[list[int]] = []
    total = 0
    for ids in ids_list:
        for i in range(0, len(ids), chunk_len):
            c = list(ids[i : i + chunk_len])
            if len(c) < 8:
                continue
            chunks.append(c)
            total += len(c)
            if total >= max_tokens:
                return chunks
    return chunks


class SplitDrafterPass(ir.passes.InPlacePass):
    """Build a drafter from the target's first ``k`` layers + a fitted bridge + final norm + LM head.

    Scope: reads the main graph (layers and cut tensors from :func:`dyncompile.passes.analysis.analyze_model`,
    KV pairs from :func:`dyncompile.passes.speculative.decoder_spec`); runs the target on the calibration tokens
    in ONNX Runtime. The drafter is a new ``ir.Model`` sharing the target's tensors, left in
    ``model.meta["dyncompile.split_drafter.model"]`` for the ``speculative`` pass and the plan emitter.

    Invariants: the target graph is unchanged; the decisions (k, acceptance, cost, projected speedup, every
    candidate's numbers, the calibration) go to ``metadata_props["dyncompile.split_drafter"]``. A model that
    already carries them with the drafter in memory is left alone (``modified=False``).

    Sketch: ``h_k = layers_1..k(x); logits = lm_head(norm(h_k @ W + b))`` with ``W, b = lstsq(h_k, h_L)``.
    """

    def __init__(
        self,
        calib_ids: Sequence[Sequence[int]],
        *,
        layers: int | None = None,
        bridge: str = "linear",
        vocab: str | int = "auto",
        min_speedup: float = 1.0,
        max_tokens: int = 8192,
        chunk_len: int = 256,
        eval_tokens: int = 1024,
        max_draft: int = 8,
        ridge: float = 1e-3,
        special_ids: Sequence[int] = (),
        progress: bool = True,
    ) -> None:
        super().__init__()
        if bridge not in ("linear", "none"):
            raise DrafterError(f"split-drafter bridge must be 'linear' or 'none', not {bridge!r}")
        if not (vocab in ("auto", "full") or (isinstance(vocab, int) and vocab > 0)):
            raise DrafterError(f"split-drafter vocab must be 'auto', 'full' or a positive number of tokens, not {vocab!r}")
        if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 1):
            raise DrafterError(f"split-drafter layers must be a positive integer, got {layers!r}")
        if isinstance(max_draft, bool) or not isinstance(max_draft, int) or max_draft < 1:
            raise DrafterError(f"split-drafter max_draft must be a positive integer, got {max_draft!r}")
        self.calib_ids = [list(map(int, c)) for c in calib_ids]
        self.layers = layers
        self.bridge = bridge
        self.vocab = vocab
        self.min_speedup = float(min_speedup)
        self.max_tokens = int(max_tokens)
        self.chunk_len = int(chunk_len)
        self.eval_tokens = int(eval_tokens)
        self.max_draft = int(max_draft)
        self.ridge = float(ridge)
        self.special_ids = [int(i) for i in special_ids if i is not None]
        self.progress = progress

    def __repr__(self) -> str:
        n = sum(len(c) for c in self.calib_ids)
        return (
            f"SplitDrafterPass(calib_tokens={n}, layers={self.layers or 'auto'}, bridge={self.bridge!r}, "
            f"vocab={self.vocab!r}, min_speedup={self.min_speedup})"
        )

    # --- checks ----------------------------------------------------------------------------------
    def _structure(self, model: ir.Model):
        from dyncompile.passes.analysis.layers import analyze_model  # networkx: loaded when the pass runs

        s = analyze_model(model)
        if not s.has_layers:
            hint = ""
            if any(n.op_type in ("MatMulNBits", "MatMulInteger", "DynamicQuantizeMatMul") for n in model.graph):
                hint = (" The model is already quantized, which hides its layer structure: put split-drafter before "
                        "the quantize pass (--passes split-drafter,quantize-int4{accuracy_level=0},speculative).")
            raise DrafterError(
                f"split-drafter needs a layered decoder, but no repeated layer structure was found: {s.message}{hint}"
            )
        return s

    def requires(self, model: ir.Model) -> None:
        """Refuse a model the pass cannot work on, with what to do about it."""
        if _keys.SPLIT_DRAFTER in model.metadata_props:
            if _keys.SPLIT_DRAFTER_MODEL not in model.meta:
                raise DrafterError(
                    "this model already records a split drafter, but its graph is not in memory (drafters are never "
                    "saved inside the target); compile from the original model"
                )
            return
        decoder_spec(model, "model", what="target model")
        s = self._structure(model)
        num = s.num_layers
        if self.layers is not None and not 1 <= self.layers < num:
            raise DrafterError(
                f"split-drafter layers={self.layers} but the target has {num} layers: the drafter keeps the first k "
                f"layers, so choose k in 1..{num - 1} (or leave it out to choose by measured acceptance x cost)"
            )
        tokens = sum(len(c) for c in self.calib_ids)
        if tokens < MIN_CALIB_TOKENS:
            raise DrafterError(
                f"the calibration text has {tokens} tokens; split-drafter needs at least {MIN_CALIB_TOKENS} (a few "
                "thousand is better) to fit the bridge and measure acceptance — give more text in the domain you will "
                "generate (e.g. source files for code completion)"
            )

    # --- the pass --------------------------------------------------------------------------------
    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Run the rewrite on ``model`` (scope and invariants: the class docstring)."""
        if _keys.SPLIT_DRAFTER in model.metadata_props:
            return ir.passes.PassResult(model, modified=False)
        t_start = time.perf_counter()
        s = self._structure(model)
        num = s.num_layers
        target_spec = decoder_spec(model, "model", what="target model")
        cands = [self.layers] if self.layers else list(range(1, num))
        cut_names = {k: s.cut_for_layer(k).name for k in [*cands, num]}
        logits_name = target_spec["logits"]
        chunks = _chunk(self.calib_ids, self.chunk_len, self.max_tokens)

        hidden, top, inputs, probe = self._collect(model, target_spec, cut_names, chunks)
        n_chunks = len(chunks)
        n_fit = max(1, int(round(n_chunks * 0.75))) if n_chunks > 1 else 1
        fit_pos = sum(len(c) for c in chunks[:n_fit])
        if n_chunks == 1:  # one chunk: fit on its first 3/4, evaluate on the rest
            fit_pos = int(len(chunks[0]) * 0.75)
        eval_sl = slice(fit_pos, min(len(top), fit_pos + self.eval_tokens))
        vocab_size = target_spec["vocab_size"] or int(top.max()) + 1
        subset = self._subset(vocab_size, top[:fit_pos], inputs[:fit_pos])

        head_model = self._head_model(model, cut_names[num], logits_name, subset, hidden[num].shape[-1])
        head = session_for(head_model)
        head_in = head.get_inputs()[0].name
        layer_params = [layer.param_count for layer in s.layers]
        head_params_full = _head_params(self._head_model(model, cut_names[num], logits_name, None, hidden[num].shape[-1]))
        head_params = _head_params(head_model)
        target_cost = sum(layer_params) + head_params_full
        verify = measure_verify_costs(probe, target_spec, chunks[0], self.max_draft)
        del probe

        y = hidden[num]
        y_eval_top = top[eval_sl]
        rows = []
        fits = {}
        for k in cands:
            x = hidden[k]
            if self.bridge == "linear":
                w, b = _ridge_fit(x[:fit_pos], y[:fit_pos], self.ridge)
                pred = x[eval_sl] @ w + b
                fits[k] = (w, b)
            else:
                pred = x[eval_sl]
                fits[k] = None
            lg = head.run(None, {head_in: pred[None].astype(np.float32)})[0][0]
            pick = lg.argmax(-1)
            if subset is not None:
                pick = subset[pick]
            alpha = float((pick == y_eval_top).mean())
            bridge_params = (x.shape[1] * y.shape[1] + y.shape[1]) if self.bridge == "linear" else 0
            cost = (sum(layer_params[:k]) + bridge_params + head_params) / target_cost
            speed, g = projected_speedup(alpha, cost, verify, self.max_draft)
            rows.append({"layers": k, "acceptance": round(alpha, 4), "draft_cost": round(cost, 4),
                         "projected_speedup": round(speed, 4), "draft_length": g})
            logger.info("split-drafter: k=%d acceptance %.3f cost %.3f -> projected %.2fx (draft %d)", k, alpha, cost,
                        speed, g)
        best = max(rows, key=lambda r: (r["projected_speedup"], -r["layers"]))
        if best["projected_speedup"] < self.min_speedup:
            top3 = sorted(rows, key=lambda r: -r["projected_speedup"])[:3]
            detail = "; ".join(
                f"k={r['layers']}: acceptance {r['acceptance']:.2f}, drafter cost {r['draft_cost']:.2f} of the target, "
                f"projected {r['projected_speedup']:.2f}x" for r in top3
            )
            raise DrafterError(
                f"split-drafter refuses: the best projected speedup is {best['projected_speedup']:.2f}x < "
                f"{self.min_speedup:g} on {len(top)} calibration tokens ({detail}). The target's early layers "
                "predict its output too rarely to pay for themselves. Try calibration text closer to what you will "
                "generate, an external drafter (--drafter DRAFT.onnx), --drafter prompt-lookup for input-grounded "
                "tasks, or force a k with split-drafter{layers=K,min_speedup=0}"
            )
        k = best["layers"]
        drafter = build_split_drafter(model, cut_in=cut_names[k], cut_last=cut_names[num], logits=logits_name,
                                      bridge=fits[k], subset=subset)
        dspec = decoder_spec(drafter, "drafter", what="split drafter")
        target_kv = [e["past"] for e in target_spec["kv"]]
        try:
            share = [target_kv.index(e["past"]) for e in dspec["kv"]]
        except ValueError as e:
            raise DrafterError(f"split drafter's KV inputs are not the target's: {e}") from None
        record = {
            "format": SPLIT_DRAFTER_FORMAT,
            "layers": k,
            "num_layers": num,
            "cut": cut_names[k],
            "bridge": {"kind": self.bridge, "ridge": self.ridge} if self.bridge == "linear" else {"kind": "none"},
            "vocab_size": None if subset is None else int(len(subset)),
            "target_vocab_size": int(vocab_size),
            "acceptance": best["acceptance"],
            "draft_cost": best["draft_cost"],
            "projected_speedup": best["projected_speedup"],
            "draft_length": best["draft_length"],
            "verify_cost": {str(k_): round(v, 4) for k_, v in sorted(verify.items())},
            "verify_slope": round(verify_slope(verify), 4),
            "share_kv": share,
            "candidates": rows,
            "calibration": {"tokens": int(len(top)), "chunks": n_chunks, "fit_tokens": int(fit_pos),
                            "eval_tokens": int(len(y_eval_top)), "chunk_len": self.chunk_len},
            "seconds": round(time.perf_counter() - t_start, 2),
        }
        model.metadata_props[_keys.SPLIT_DRAFTER] = json.dumps(record)
        model.meta[_keys.SPLIT_DRAFTER_MODEL] = drafter
        model.meta[_keys.SPLIT_DRAFTER_VOCAB] = subset
        logger.info("split-drafter: k=%d of %d layers, acceptance %.3f, projected %.2fx", k, num, best["acceptance"],
                    best["projected_speedup"])
        return ir.passes.PassResult(model, modified=True)

    def ensures(self, model: ir.Model) -> None:
        """Check what the pass promises on its output."""
        if _keys.SPLIT_DRAFTER_MODEL not in model.meta:
            raise ir.passes.PostconditionError("split-drafter left no drafter graph in model.meta")

    # --- helpers ---------------------------------------------------------------------------------
    def _collect(self, model, spec, cut_names: dict[int, str], chunks):
        """Hidden states at the cuts, the target's top-1 and the input token of every calibration position."""
        g = model.graph
        values = ir.convenience.create_value_mapping(g)
        n_out = len(g.outputs)
        extra = [values[n] for n in dict.fromkeys(cut_names.values()) if not values[n].is_graph_output()]
        g.outputs.extend(extra)
        try:
            sess = session_for(model)
        finally:
            while len(g.outputs) > n_out:  # pop(): `del [n:]` skips onnx-ir's graph-output bookkeeping
                g.outputs.pop()
        names = [spec["logits"], *dict.fromkeys(cut_names.values())]
        hidden: dict[str, list[np.ndarray]] = {n: [] for n in dict.fromkeys(cut_names.values())}
        tops, ins = [], []
        bar = _progress(sum(len(c) for c in chunks), "split-drafter: running calibration text", self.progress)
        for c in chunks:
            feeds = prefill_feeds(spec, c)
            outs = sess.run(names, feeds)
            tops.append(outs[0][0].argmax(-1))
            for n, h in zip(names[1:], outs[1:]):
                hidden[n].append(h[0].astype(np.float32))
            ins.append(np.asarray(c, np.int64))
            bar.update(len(c))
        bar.close()
        merged = {n: np.concatenate(v) for n, v in hidden.items()}
        return ({k: merged[n] for k, n in cut_names.items()}, np.concatenate(tops), np.concatenate(ins), sess)

    def _subset(self, vocab_size: int, top: np.ndarray, inputs: np.ndarray) -> np.ndarray | None:
        if self.vocab == "full":
            return None
        n = (8192 if vocab_size > 16384 else vocab_size) if self.vocab == "auto" else int(self.vocab)
        if n >= vocab_size:
            return None
        score = np.bincount(top, minlength=vocab_size).astype(np.float64) * 2.0
        score += np.bincount(inputs[inputs < vocab_size], minlength=vocab_size)[:vocab_size]
        return frequent_subset(score, n, self.special_ids)

    @staticmethod
    def _head_model(model: ir.Model, cut_last: str, logits: str, subset, hidden: int) -> ir.Model:
        g = model.graph
        sub = ir.convenience.extract(g, inputs=[cut_last], outputs=[logits])
        for v in sub.inputs:  # intermediate values of an export may carry no type
            if v.dtype is None:
                v.dtype = ir.DataType.FLOAT
            if v.shape is None:
                v.shape = ir.Shape(["batch", "seq", hidden])
        for dom, ver in model.opset_imports.items():
            sub.opset_imports.setdefault(dom, ver)
        head = ir.Model(sub, ir_version=model.ir_version)
        if subset is not None and not trim_lm_head(head, logits, subset):
            raise DrafterError("cannot restrict this model's LM head to a vocabulary subset; use split-drafter{vocab=full}")
        return head


def _ridge_fit(x: np.ndarray, y: np.ndarray, ridge: float) -> tuple[np.ndarray, np.ndarray]:
    """Least squares ``y ~ x @ w + b`` with a ridge of ``ridge * mean(diag(X^T X))``."""
    x64 = np.concatenate([x, np.ones((len(x), 1), x.dtype)], 1).astype(np.float64)
    a = x64.T @ x64
    lam = ridge * np.trace(a) / a.shape[0]
    sol = np.linalg.solve(a + lam * np.eye(a.shape[0]), x64.T @ y.astype(np.float64))
    return sol[:-1].astype(np.float32), sol[-1].astype(np.float32)


def _head_params(head: ir.Model) -> int:
    total = 0
    for v in head.graph.initializers.values():
        t = v.const_value
        if t is not None and v.uses() and t.dtype.is_floating_point() and len(t.shape) >= 2:
            total += int(np.prod(t.shape))
    return total


@register_pass(
    "split-drafter",
    help="drafter from the target's first k layers + a bridge fitted on --calib TEXT (k by measured acceptance x "
    "cost; refuses below 1x); use with speculative",
    requires=("calib",),
    # quantized layers hide the layer structure the drafter is cut from; the drafter feeds speculative
    before=("quantize-int8", "quantize-int4", "speculative"),
    choices={"bridge": ("linear", "none")},
)
def _make_split_drafter(
    context: CompileContext,
    layers: int | None = None,
    bridge: str = "linear",
    vocab: str | int = "auto",
    min_speedup: float = 1.0,
    max_tokens: int = 8192,
    chunk_len: int = 256,
    max_draft: int = 8,
):
    ids, special = tokenized_calibration(context, context.options["calib"], "split-drafter")
    return SplitDrafterPass(
        ids,
        layers=layers,
        bridge=bridge,
        vocab=vocab,
        min_speedup=min_speedup,
        max_tokens=max_tokens,
        chunk_len=chunk_len,
        max_draft=max_draft,
        special_ids=special,
        progress=context.progress,
    )
