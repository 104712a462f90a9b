"""``eagle-drafter``: build an EAGLE drafter graph from the target and a trained head (``train-drafter``).

The drafter, for draft position ``t``, reads the embedding of token ``t+1`` and a top-layer feature
``f_t`` of the target (the true one for verified positions, its own prediction while drafting), and runs

    x = fc([embedding(ids), features])          # [.., 2H] -> [.., H], trained
    h = decoder_layer(x)                         # the target's LAST layer subgraph, trained weights swapped in
    logits = lm_head(final_norm(h))             # the target's own norm and LM head (optionally a vocab subset)

with its own one-layer KV cache. The graph is cut from the target itself (its embedding Gather, rotary
and attention-mask code, the last layer, the final norm and the LM head stay as they are), so the layer is
"of the target's architecture" by construction; every tensor except ``fc``, the layer's trained weights and
the trimmed LM head is the target's own object, which the plan emitter points at the target's external
data file (no copy on disk). Outputs: ``logits`` (draft vocabulary), ``eagle_hidden`` (the predicted
feature ``f_{t+1}``, fed back for the next draft step) and the layer's ``present`` pair.

The head's layer tensors are matched to the target's by the fingerprint the trainer recorded of the
tensor each replaces (transposition-invariant), so a head trained for another model is refused.

EAGLE-3 heads (``dyncompile.eagle_head/v2``, ``train-drafter --features fused --layout fc``) read a trained projection of a
low, a middle and a high layer of the target instead of the top layer; the projection runs inside the target's
call (:class:`ExposeFeaturesPass` with ``taps``/``fuse``), so the drafter graph, its ``eagle_features`` input and
the runtime are the same for both kinds: while drafting, the head's own output feeds the next step, as it was
trained to (training-time test).

EAGLE-3 heads in the reference layout (``dyncompile.eagle_head/v3``, ``train-drafter --features fused``' default;
the checkpoints vLLM, SGLang and OpenVINO GenAI run) have no ``fc``: the feature ``f`` is the layer's residual stream
and the attention reads ``[input_layernorm(embedding), hidden_norm(f)]``, 2H wide. The graph is the same cut of
the target's last layer, with the feature in place of the layer input, the norm chain in front of the attention
cloned for the embedding, and ``q/k/v`` widened to 2H (a bias the target's projection has is zeroed: the
reference layout has none).

The pass also exposes the target's features (:class:`ExposeFeaturesPass`), and records the head's
provenance in ``metadata_props["dyncompile.eagle"]``; the drafter graph and its vocabulary go to
``model.meta["dyncompile.eagle.model"]`` for the ``speculative`` pass and the emitter.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from dyncompile.passes import _keys
from dyncompile.passes._graph import backward_slice
from dyncompile.passes._infra import CompileContext, not_fired, register_pass
from dyncompile.passes.speculative.decoder_spec import DrafterError, decoder_spec
from dyncompile.passes.speculative.expose_features import FEATURES_OUTPUT, ExposeFeaturesPass, layer_structure
from dyncompile.passes.speculative.split_drafter import drop_unused_pasts, trim_lm_head

logger = logging.getLogger(__name__)

__all__ = ["EAGLE_FORMAT", "FEATURE_INPUT", "HIDDEN_OUTPUT", "EagleDrafterPass", "build_eagle_drafter", "load_head"]

EAGLE_FORMAT = "dyncompile.eagle/v1"
HEAD_FORMAT = "dyncompile.eagle_head/v1"
HEAD_FORMAT_FUSED = "dyncompile.eagle_head/v2"  # EAGLE-3: fused low/middle/high features (``fuse.weight``)
HEAD_FORMAT_REFERENCE = "dyncompile.eagle_head/v3"  # EAGLE-3 in the reference layout (``mid.*``: a 2H-wide attention)
_FORMATS = (HEAD_FORMAT, HEAD_FORMAT_FUSED, HEAD_FORMAT_REFERENCE)
_REF_KEYS = tuple(f"mid.{k}" for k in (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
    "hidden_norm.weight", "post_attention_layernorm.weight"))
FEATURE_INPUT = "eagle_features"
HIDDEN_OUTPUT = "eagle_hidden"


def load_head(head_dir: str | Path) -> tuple[dict[str, np.ndarray], dict[str, Any], str]:
    """Arrays of ``eagle_head.npz``, the ``eagle_head.json`` record, and the npz's sha256."""
    d = Path(head_dir).expanduser()
    npz, meta = d / "eagle_head.npz", d / "eagle_head.json"
    if not npz.is_file() or not meta.is_file():
        raise DrafterError(
            f"{d} holds no EAGLE head (eagle_head.npz + eagle_head.json); train one with "
            "`dyncompile train-drafter TARGET --out HEAD_DIR` (README: EAGLE drafter)"
        )
    try:
        info = json.loads(meta.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DrafterError(f"{meta} is not valid JSON ({e}); retrain the head") from None
    if info.get("format") not in _FORMATS:
        raise DrafterError(f"{meta}: format {info.get('format')!r}, expected one of {list(_FORMATS)}; retrain the head")
    sha = hashlib.sha256(npz.read_bytes()).hexdigest()
    try:
        with np.load(npz, allow_pickle=False) as z:
            arrays = {k: np.asarray(z[k]) for k in z.files}
    except (ValueError, OSError) as e:
        raise DrafterError(f"{npz} cannot be read as an npz of arrays ({e}); retrain the head") from None
    fused = info["format"] != HEAD_FORMAT
    keys = _REF_KEYS if info["format"] == HEAD_FORMAT_REFERENCE else ("fc.weight", "fc.bias")
    for k in ("vocab", *keys, *(("fuse.weight",) if fused else ())):
        if k not in arrays:
            raise DrafterError(f"{npz} lacks {k!r}; retrain the head")
    taps = info.get("feature_layers")
    if fused and (not isinstance(taps, list) or not taps or not all(isinstance(t, int) and t > 0 for t in taps)):
        raise DrafterError(f"{meta}: a fused-feature head needs feature_layers (a list of layer numbers); retrain the head")
    return arrays, info, sha


def expose_features_for(arrays: Mapping[str, np.ndarray], info: Mapping[str, Any]) -> ExposeFeaturesPass:
    """The target-side pass a head needs: the top-layer feature (EAGLE-1/2) or the fused taps (EAGLE-3)."""
    if info.get("format") in (HEAD_FORMAT_FUSED, HEAD_FORMAT_REFERENCE):
        return ExposeFeaturesPass(taps=info["feature_layers"], fuse=arrays["fuse.weight"])
    return ExposeFeaturesPass()


def _match(fp: list[float], arr: np.ndarray, rtol: float = 1e-4) -> bool:
    a = np.asarray(arr, np.float64)
    got = [float(a.sum()), float((a * a).sum()), float(np.abs(a).max())]
    return all(abs(x - y) <= rtol * max(1.0, abs(y)) for x, y in zip(got, fp))


def _swap_layer_weights(g: ir.Graph, layer_nodes: set[str], params: dict[str, Any],
                        arrays: Mapping[str, np.ndarray], prefix: str = "layer.") -> None:
    """Give the last layer's nodes the head's weights (``arrays[prefix + name]``), each by the tensor it replaces.

    Each replaced tensor is found by the fingerprint the trainer recorded of it.
    """
    todo = dict(params)
    for node in [n for n in g if n.name in layer_nodes]:
        for v in node.inputs:
            if v is None or v.const_value is None or not v.is_initializer() or v.name.startswith("eagle."):
                continue
            arr = v.const_value.numpy()
            hit = next((k for k, p in todo.items() if tuple(p["shape"]) in (arr.shape, arr.shape[::-1])
                        and _match(p["replaces"], arr)), None)
            if hit is None:
                continue
            new = np.asarray(arrays[f"{prefix}{hit}"], np.float32)  # Hugging Face layout: Linear weights [out, in]
            if new.ndim == 2 and not (node.op_type == "Gemm" and node.attributes.get_int("transB", 0)):
                new = new.T  # MatMul(x, W) reads [in, out] (also when square: the shape cannot tell)
            if new.shape != arr.shape:
                raise DrafterError(f"the EAGLE head's {hit} is {list(new.shape)} but replaces a {list(arr.shape)} tensor")
            nv = ir.val(f"eagle.{hit}", const_value=ir.tensor(np.ascontiguousarray(new), name=f"eagle.{hit}"))
            g.register_initializer(nv)
            for u in list(v.uses()):
                if u.node.name in layer_nodes:
                    u.node.replace_input_with(u.idx, nv)
            del todo[hit]
    if todo:
        raise DrafterError(
            f"the EAGLE head's tensors {sorted(todo)[:4]} match no weight of the target's last layer: the head was "
            "trained for another model (or another build of it); retrain with `dyncompile train-drafter`"
        )


def _feed_layer(h_in: ir.Value, layer_nodes: set[str], x: ir.Value) -> None:
    """The last layer reads ``x`` wherever it read its input ``h_in`` (the layers before keep ``h_in``)."""
    for u in list(h_in.uses()):
        if u.node.name in layer_nodes:
            u.node.replace_input_with(u.idx, x)


def _fc_layer(g: ir.Graph, layer_nodes: set[str], params: dict[str, Any], arrays: Mapping[str, np.ndarray],
              emb: ir.Value, h_in: ir.Value, f_in: ir.Value, hidden: int) -> None:
    """The ``fc`` layout: the head's weights in the last layer, ``x = [embedding(ids), f] @ fc.W^T + fc.b`` as its input."""
    _swap_layer_weights(g, layer_nodes, params, arrays)
    w_fc = np.asarray(arrays["fc.weight"], np.float32)
    wv = ir.val("eagle.fc.weight", const_value=ir.tensor(np.ascontiguousarray(w_fc.T), name="eagle.fc.weight"))
    bv = ir.val("eagle.fc.bias", const_value=ir.tensor(np.asarray(arrays["fc.bias"], np.float32), name="eagle.fc.bias"))
    g.register_initializer(wv)
    g.register_initializer(bv)
    cat = ir.node("Concat", [emb, f_in], attributes={"axis": -1}, name="eagle.concat")
    mm = ir.node("MatMul", [cat.outputs[0], wv], name="eagle.fc.matmul")
    add = ir.node("Add", [mm.outputs[0], bv], name="eagle.fc.add")
    for n, nm in ((cat, "eagle.concat_out"), (mm, "eagle.fc_mm"), (add, "eagle.fc_out")):
        n.outputs[0].name = nm
        n.outputs[0].dtype = ir.DataType.FLOAT
    cat.outputs[0].shape = ir.Shape(["batch", "seq", 2 * hidden])
    mm.outputs[0].shape = add.outputs[0].shape = ir.Shape(["batch", "seq", hidden])
    g.insert_after(emb.producer(), [cat, mm, add])
    _feed_layer(h_in, layer_nodes, add.outputs[0])


def _initializer_matching(node: ir.Node, fp: list[float]) -> tuple[int, ir.Value] | None:
    """(input index, value) of the initializer input of ``node`` whose fingerprint is ``fp``."""
    for i, v in enumerate(node.inputs):
        if v is not None and v.const_value is not None and v.is_initializer() and _match(fp, v.const_value.numpy()):
            return i, v
    return None


def _reference_layer(g: ir.Graph, layer_nodes: set[str], params: dict[str, Any], arrays: Mapping[str, np.ndarray],
                     emb: ir.Value, h_in: ir.Value, f_in: ir.Value, hidden: int) -> None:
    """The reference layout in the cut last layer (see the module docstring).

    ``f`` is the layer's input and residual, the norm chain in front of q/k/v is cloned for the embedding, and
    q/k/v read ``[norm_e(emb), norm_h(f)]``.
    """
    qkv = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
    found: dict[str, tuple[ir.Node, int]] = {}
    for node in [n for n in g if n.name in layer_nodes and n.op_type == "MatMul"]:
        for k in qkv:
            hit = _initializer_matching(node, params[k]["widens"])
            if hit is not None and k not in found:
                found[k] = (node, hit[0])
    if len(found) != 3 or len({n.inputs[1 - i] for n, i in found.values()}) != 1:
        raise DrafterError("the EAGLE head's q/k/v projections match no MatMuls of the target's last layer reading one "
                           "normalised input: the head was trained for another model; retrain with `dyncompile "
                           "train-drafter --layout reference`")
    first, wi0 = found[qkv[0]]
    normed = first.inputs[1 - wi0]
    # the norm chain: the layer's nodes between its input and the normalised value q/k/v read
    chain = [n for n in g if n.name in layer_nodes and n in backward_slice([normed])]
    if not chain or not any(v is h_in for n in chain for v in n.inputs):
        raise DrafterError("cannot find the norm in front of the last layer's attention (an unknown layer shape)")
    # 1. the feature is the layer's input and residual; the existing chain becomes hidden_norm(f)
    _feed_layer(h_in, layer_nodes, f_in)
    _swap_layer_weights(g, layer_nodes, {k: p for k, p in params.items() if "replaces" in p}, arrays, prefix="mid.")
    # 2. the same chain on the embedding, with input_layernorm's weight
    w_e = ir.val("eagle.input_layernorm.weight", const_value=ir.tensor(
        np.asarray(arrays["mid.input_layernorm.weight"], np.float32), name="eagle.input_layernorm.weight"))
    g.register_initializer(w_e)
    mapping: dict[ir.Value, ir.Value] = {f_in: emb}
    clones = []
    for n in chain:
        ins = [mapping.get(v, v) for v in n.inputs]
        ins = [w_e if v is not None and v.name == "eagle.hidden_norm.weight" else v for v in ins]
        c = ir.Node(n.domain, n.op_type, ins, attributes=list(n.attributes.values()), num_outputs=len(n.outputs),
                    name=f"eagle.emb_norm.{len(clones)}")
        for o, co in zip(n.outputs, c.outputs):
            co.name, co.dtype, co.shape = f"eagle.emb_norm_{len(clones)}_{o.name}", o.dtype, o.shape
            mapping[o] = co
        clones.append(c)
    if not any(v is w_e for c in clones for v in c.inputs):
        raise DrafterError("the norm in front of the last layer's attention has no weight the head could replace")
    cat = ir.node("Concat", [mapping[normed], normed], attributes={"axis": -1}, name="eagle.concat")
    cat.outputs[0].name, cat.outputs[0].dtype = "eagle.concat_out", ir.DataType.FLOAT
    cat.outputs[0].shape = ir.Shape(["batch", "seq", 2 * hidden])
    g.insert_after(normed.producer(), [*clones, cat])
    # 3. q/k/v read the 2H input; a bias the target's projection adds is zeroed (the reference layout has none)
    for k, (node, wi) in found.items():
        w = np.asarray(arrays[f"mid.{k}"], np.float32)  # [out, 2H]
        old = node.inputs[wi].const_value.numpy()
        if w.shape[1] != 2 * hidden or w.shape[0] not in old.shape:
            raise DrafterError(f"the EAGLE head's {k} is {list(w.shape)}; expected [{max(old.shape)}, {2 * hidden}]")
        nv = ir.val(f"eagle.{k}", const_value=ir.tensor(np.ascontiguousarray(w.T), name=f"eagle.{k}"))
        g.register_initializer(nv)
        node.replace_input_with(wi, nv)
        node.replace_input_with(1 - wi, cat.outputs[0])
        bias_fp = params[k].get("drops_bias")
        for u in list(node.outputs[0].uses()) if bias_fp else []:
            hit = _initializer_matching(u.node, bias_fp) if u.node.op_type == "Add" else None
            if hit is not None:
                zv = ir.val(f"eagle.{k}.zero_bias", const_value=ir.tensor(np.zeros_like(hit[1].const_value.numpy()),
                                                                         name=f"eagle.{k}.zero_bias"))
                g.register_initializer(zv)
                u.node.replace_input_with(hit[0], zv)


def build_eagle_drafter(target: ir.Model, arrays: Mapping[str, np.ndarray], info: Mapping[str, Any]) -> ir.Model:
    """The drafter graph (see the module docstring); ``target`` is not modified."""
    spec = decoder_spec(target, "model", what="target model")
    d = target.clone()
    g = d.graph
    for k in [k for k in d.metadata_props if k.startswith("dyncompile.")]:
        del d.metadata_props[k]
    s = layer_structure(d, "eagle-drafter")
    num = s.num_layers
    cfg = info.get("target_config") or {}
    if cfg.get("num_layers") not in (None, num):
        raise DrafterError(f"the EAGLE head was trained for a {cfg['num_layers']}-layer target; this one has {num} layers")
    values = ir.convenience.create_value_mapping(g)
    emb, h_in, h_out = (values[s.cut_for_layer(k).name] for k in (0, num - 1, num))
    hidden = int(h_out.shape[-1]) if h_out.shape is not None and isinstance(h_out.shape[-1], int) else None
    reference = info.get("format") == HEAD_FORMAT_REFERENCE
    w_in = np.shape(arrays["mid.self_attn.o_proj.weight" if reference else "fc.weight"])  # [H, ...] / [H, 2H]
    if hidden is None or w_in[0] != hidden or (not reference and w_in != (hidden, 2 * hidden)):
        raise DrafterError(f"the EAGLE head is for hidden size {w_in[0]}, the target's is {hidden}; "
                           "this head was trained for another model")
    f_in = ir.Value(name=FEATURE_INPUT, shape=ir.Shape(["batch", "seq", hidden]), type=ir.TensorType(ir.DataType.FLOAT))
    g.inputs.append(f_in)
    layer_nodes = set(s.layers[-1].node_names)
    params = dict(info.get("layer_params") or {})
    if reference:
        _reference_layer(g, layer_nodes, params, arrays, emb, h_in, f_in, hidden)
    else:
        _fc_layer(g, layer_nodes, params, arrays, emb, h_in, f_in, hidden)

    # outputs: logits, the predicted feature, the last layer's present pair
    logits_v = next(v for v in g.outputs if v.name == spec["logits"])
    h_out.name = HIDDEN_OUTPUT
    keep_nodes = backward_slice([logits_v, h_out])
    kept = [v for v in g.outputs if v is logits_v or (v.producer() in keep_nodes and v is not h_out)]
    g.outputs.clear()
    g.outputs.extend([*kept, h_out])
    common_passes.RemoveUnusedNodesPass()(d)
    drop_unused_pasts(g, keep_nodes)
    vocab = np.asarray(arrays["vocab"], np.int64)
    if len(vocab) < int(cfg.get("vocab_size") or len(vocab) + 1) and not trim_lm_head(d, spec["logits"], vocab):
        raise DrafterError("cannot restrict the LM head to the head's draft vocabulary (unknown head shape)")
    common_passes.RemoveUnusedNodesPass()(d)
    d.metadata_props[_keys.ROLE] = "drafter"
    return d


class EagleDrafterPass(ir.passes.InPlacePass):
    """Expose the target's features and build its EAGLE drafter from a trained head.

    Scope: target graph: only :class:`ExposeFeaturesPass` (one extra output, no compute; for a fused-feature
    EAGLE-3 head, the fuse projection of its layer taps: one Concat and one MatMul); the drafter is a
    new ``ir.Model`` sharing the target's tensors, left in ``model.meta`` with its vocabulary.
    Invariants: the target's original outputs are unchanged; ``metadata_props["dyncompile.eagle"]`` records the
    head (file hash, training record summary, IO names). A model that already carries the record with the
    drafter in memory is left alone (``modified=False``).
    Sketch: ``target -> target + features output``; ``drafter = head(fc, last layer) + target norm/LM head``.
    """

    def __init__(self, head_dir: str | Path) -> None:
        super().__init__()
        self.head_dir = Path(head_dir).expanduser()

    def __repr__(self) -> str:
        return f"EagleDrafterPass(head_dir={str(self.head_dir)!r})"

    def requires(self, model: ir.Model) -> None:
        """Refuse a model the pass cannot work on, with what to do about it."""
        if _keys.EAGLE in model.metadata_props:
            if _keys.EAGLE_MODEL not in model.meta:
                raise DrafterError("this model records an EAGLE drafter but its graph is not in memory (drafters are "
                                   "never saved inside the target); compile from the original model")
            return
        decoder_spec(model, "model", what="target model")
        load_head(self.head_dir)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Run the rewrite on ``model`` (scope and invariants: the class docstring)."""
        if _keys.EAGLE in model.metadata_props and _keys.EAGLE_MODEL in model.meta:
            return ir.passes.PassResult(model, modified=False)
        arrays, info, sha = load_head(self.head_dir)
        drafter = build_eagle_drafter(model, arrays, info)
        expose_features_for(arrays, info)(model)
        vocab = np.asarray(arrays["vocab"], np.int64)
        record = {
            "format": EAGLE_FORMAT,
            "head": {"dir": str(self.head_dir), "sha256": sha, "target": info.get("target"),
                     "eval": info.get("eval"), "training": info.get("training"), "corpus_held_out":
                     (info.get("corpus") or {}).get("held_out")},
            "features": FEATURES_OUTPUT,
            "feature_input": FEATURE_INPUT,
            "hidden_output": HIDDEN_OUTPUT,
            "draft_vocab": int(len(vocab)),
            "feature_layers": list(info.get("feature_layers") or []),
        }
        model.metadata_props[_keys.EAGLE] = json.dumps(record, sort_keys=True)
        model.meta[_keys.EAGLE_MODEL] = (drafter, vocab)
        logger.info("eagle-drafter: head %s (eval one-step agreement %s), draft vocabulary %d", self.head_dir,
                    (info.get("eval") or {}).get("draft_top1_agreement"), len(vocab))
        return ir.passes.PassResult(model, modified=True)

    def ensures(self, model: ir.Model) -> None:
        """Check what the pass promises on its output."""
        if _keys.EAGLE_MODEL not in model.meta:
            raise ir.passes.PostconditionError("the EAGLE drafter did not reach model.meta")


@register_pass(
    "eagle-drafter",
    help="EAGLE drafter from a trained head (head=DIR from `dyncompile train-drafter`): one layer of the target's "
    "architecture on the target's features (EAGLE-3: low/middle/high layers fused), the target's norm and LM head "
    "shared; then `speculative`",
    before=("speculative",),
)
def _make_eagle_drafter(context: CompileContext, head: str = ""):
    del context
    if not head:
        raise DrafterError("eagle-drafter needs head=DIR (a head trained by `dyncompile train-drafter TARGET --out DIR`)")
    return EagleDrafterPass(head)


def _nbits_block(k: int) -> int | None:
    """The largest of 128, 64, 32, 16 that divides ``k`` (one scale per block of the reduced axis), else None."""
    return next((b for b in (128, 64, 32, 16) if k % b == 0), None)


def drafter_weights_to_int8(drafter: ir.Model) -> tuple[int, int]:
    """Rewrite each ``MatMul`` of ``drafter`` with a constant float32 ``[K, N]`` weight into an 8-bit ``MatMulNBits``.

    Zero point 128, one scale per block of ``K``, int8 compute (``accuracy_level`` 4). Every other initializer keeps its identity, so the tensors the drafter shares with the target (the embedding,
    the norms) stay shared when the plan is written. Returns (MatMuls rewritten, float32 bytes they read before).
    """
    from dyncompile.passes._graph import add_initializer, replace_node_output
    from dyncompile.passes.screen_lm_head import quantize_head

    g, count, before = drafter.graph, 0, 0
    for node in list(g):
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            continue
        w = node.inputs[1]
        t = None if w is None else w.const_value
        if t is None or t.dtype != ir.DataType.FLOAT or len(t.shape) != 2:
            continue
        k, n = (int(d) for d in t.shape)
        bs = _nbits_block(k)
        if bs is None:
            continue
        b_u8, scales, _ = quantize_head(t.numpy(), bs)
        stem = f"{w.name or f'drafter_weight_{count}'}.int8"
        q = ir.node("MatMulNBits", [node.inputs[0], add_initializer(g, f"{stem}.B", b_u8),
                                    add_initializer(g, f"{stem}.scales", scales)],
                    attributes={"K": k, "N": n, "bits": 8, "block_size": bs, "accuracy_level": 4},
                    domain="com.microsoft", name=f"{node.name or stem}/int8")
        g.insert_before(node, q)
        replace_node_output(g, node, node.outputs[0], q.outputs[0])
        if not w.uses() and w.name in g.initializers:
            del g.initializers[w.name]
        count += 1
        before += k * n * 4
    if count:
        drafter.opset_imports.setdefault("com.microsoft", 1)
        g.opset_imports.setdefault("com.microsoft", 1)
    return count, before


class QuantizeDrafterPass(ir.passes.InPlacePass):
    """8-bit weights for the EAGLE drafter: its MatMuls become ``MatMulNBits`` (int8 compute).

    Scope: the EAGLE drafter graph that ``eagle-drafter`` left in ``model.meta`` (the target graph is not touched).
    A drafter step reads its weights once per drafted token, so on the CPU it is memory-bound like the target:
    on Qwen2.5-Coder-0.5B the float32 drafter reads ~100 MB a step (3.3 ms on 2 cores), the 8-bit one a quarter
    of that (1.8 ms). Invariants: the target's outputs are bit-identical (only drafts change, and little: the
    verification keeps greedy decoding token-identical to the target alone and sampling exact); the drafter's
    inputs and outputs are unchanged; the tensors it shares with the target stay shared.
    Idempotent: a drafter already holding ``MatMulNBits`` is left alone (``modified=False``).
    Sketch: ``MatMul(x, W) -> MatMulNBits(x, q8(W), scales)`` for each constant ``W`` of the drafter.
    """

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def requires(self, model: ir.Model) -> None:
        """Refuse a model without an EAGLE drafter in memory, saying what to run first."""
        if _keys.EAGLE_MODEL not in model.meta:
            raise DrafterError("quantize-drafter needs an EAGLE drafter: put eagle-drafter{head=DIR} before it")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Run the rewrite on the drafter (scope and invariants: the class docstring)."""
        drafter = model.meta[_keys.EAGLE_MODEL][0]
        if any(n.op_type == "MatMulNBits" for n in drafter.graph):
            return ir.passes.PassResult(model, modified=False)
        count, before = drafter_weights_to_int8(drafter)
        if not count:
            return not_fired(model, "quantize-drafter", "the EAGLE drafter has no float32 MatMul weight whose rows "
                             "are a multiple of 16; it stays in float")
        rec = json.loads(model.metadata_props[_keys.EAGLE])
        rec["drafter_weights"] = "int8"
        model.metadata_props[_keys.EAGLE] = json.dumps(rec, sort_keys=True)
        logger.info("quantize-drafter: %d drafter MatMuls to 8-bit weights (%.1f MB of float32 weights -> %.1f MB)",
                    count, before / 2**20, before / 4 / 2**20)
        return ir.passes.PassResult(model, modified=True)


@register_pass(
    "quantize-drafter",
    help="8-bit weights (MatMulNBits, int8 compute) for the EAGLE drafter's MatMuls: a drafter step reads a "
    "quarter of the bytes; the target is untouched, so greedy decoding stays token-identical (inserted by -O2 on "
    "the CPU EP after eagle-drafter)",
    after=("eagle-drafter",),
    before=("speculative",),
)
def _make_quantize_drafter(context: CompileContext):
    del context
    return QuantizeDrafterPass()
