"""``medusa-heads``: build a Medusa drafter (Cai et al. 2024, Medusa-1 heads) and expose the feature it reads.

The heads are trained by ``train-drafter --kind medusa``; the exposed feature is the target's last hidden state.

The target's LM head reads ``h`` (the hidden state after the final norm) and gives token ``t + 1``; Medusa head
``k`` (``k = 0..K-1``) gives token ``t + k + 2`` from the same ``h``:

    z_k = h + SiLU(h @ W_k + b_k)           # one residual block per head, trained
    logp_k = log_softmax(z_k @ LM_k)         # the target's own LM head (its rows for the draft vocabulary),
                                             # or head k's own trained one (Medusa-1's per-head LM heads)
    medusa_logp, idx = TopK(logp_k, topk)   # [K, n, topk]
    medusa_ids = vocab[idx]                  # target token ids

The heads graph is a separate ONNX model (input ``medusa_features`` ``[n, H]``, outputs ``medusa_logp`` and
``medusa_ids`` ``[K, n, topk]``), built with onnx-ir; when the heads cover the full vocabulary it shares the
target's LM head tensor (the emitter points it at the target's external data), otherwise it holds the head's rows
for the draft vocabulary only, or the heads' own LM heads (``lm`` ``[K, H, Vd]`` in the head file). The target
gets one more output: the LM head's input, named ``medusa_features`` (no compute added). The head file's LM-head fingerprint must match the target's (a head trained for another model
is refused). Provenance goes to ``metadata_props["dyncompile.medusa"]``; the heads graph to
``model.meta["dyncompile.medusa.model"]`` for the ``speculative`` pass and the emitter.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from dyncompile.passes import _keys
from dyncompile.passes._infra import CompileContext, register_pass
from dyncompile.passes.speculative.decoder_spec import DrafterError, decoder_spec
from dyncompile.passes.speculative.eagle_drafter import _match

logger = logging.getLogger(__name__)

__all__ = ["FEATURES", "HEADS_FORMAT", "LOGP_OUTPUT", "IDS_OUTPUT", "MedusaHeadsPass", "build_medusa_heads",
           "load_medusa_heads"]

HEADS_FORMAT = "dyncompile.medusa/v1"
HEAD_FILE_FORMAT = "dyncompile.medusa_heads/v1"
FEATURES = "medusa_features"
LOGP_OUTPUT = "medusa_logp"
IDS_OUTPUT = "medusa_ids"
MAX_HEADS = 16


def load_medusa_heads(head_dir: str | Path) -> tuple[dict[str, np.ndarray], dict[str, Any], str]:
    """Arrays of ``medusa_heads.npz``, the ``medusa_heads.json`` record, and the npz's sha256."""
    d = Path(head_dir).expanduser()
    npz, meta = d / "medusa_heads.npz", d / "medusa_heads.json"
    if not npz.is_file() or not meta.is_file():
        raise DrafterError(f"{d} holds no Medusa heads (medusa_heads.npz + medusa_heads.json); train them with "
                           "`dyncompile train-drafter TARGET --kind medusa --out HEAD_DIR`")
    try:
        info = json.loads(meta.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DrafterError(f"{meta} is not valid JSON ({e}); retrain the heads") from None
    if not isinstance(info, dict) or info.get("format") != HEAD_FILE_FORMAT:
        raise DrafterError(f"{meta}: format {info.get('format') if isinstance(info, dict) else None!r}, expected "
                           f"{HEAD_FILE_FORMAT!r}; retrain the heads")
    sha = hashlib.sha256(npz.read_bytes()).hexdigest()
    try:
        with np.load(npz, allow_pickle=False) as z:
            arrays = {k: np.asarray(z[k]) for k in z.files}
    except (ValueError, OSError) as e:
        raise DrafterError(f"{npz} cannot be read as an npz of arrays ({e}); retrain the heads") from None
    for k in ("w", "b", "vocab"):
        if k not in arrays:
            raise DrafterError(f"{npz} lacks {k!r}; retrain the heads")
    w, b = arrays["w"], arrays["b"]
    if w.ndim != 3 or w.shape[1] != w.shape[2] or b.shape != (w.shape[0], w.shape[1]) or not 1 <= w.shape[0] <= MAX_HEADS:
        raise DrafterError(f"{npz}: w {list(w.shape)} / b {list(b.shape)} are not K residual blocks [K, H, H] / [K, H] "
                           f"with 1 <= K <= {MAX_HEADS}; retrain the heads")
    return arrays, info, sha


def lm_head_of(model: ir.Model) -> tuple[ir.Node, ir.Value, np.ndarray, bool]:
    """The target's LM head: ``(MatMul node, its input h, weight [H, V], transposed-embedding?)``.

    Handles ``MatMul(h, W)`` and ``MatMul(h, Transpose(E))`` (tied embeddings), with an optional bias ``Add`` refused.
    """
    spec = decoder_spec(model, "model", what="target model")
    out = next(v for v in model.graph.outputs if v.name == spec["logits"])
    node = out.producer()
    if node is None or node.op_type != "MatMul":
        raise DrafterError(f"medusa-heads needs the logits produced by a MatMul LM head; {spec['logits']!r} comes from "
                           f"{node.op_type if node is not None else 'a graph input'}")
    w = node.inputs[1]
    if w.const_value is not None and w.const_value.numpy().ndim == 2:
        return node, node.inputs[0], w.const_value.numpy(), False
    tr = w.producer()
    if tr is not None and tr.op_type == "Transpose" and tr.inputs[0].const_value is not None:
        e = tr.inputs[0].const_value.numpy()
        if e.ndim == 2:
            return node, node.inputs[0], e.T, True
    raise DrafterError("medusa-heads: the LM head's weight is not a constant [H, V] matrix (or the transpose of one)")


def build_medusa_heads(target: ir.Model, arrays: dict[str, np.ndarray], info: dict[str, Any], topk: int) -> ir.Model:
    """The heads graph (module docstring); ``target`` is not modified."""
    node, h, w_lm, _ = lm_head_of(target)
    H, V = w_lm.shape
    W = np.asarray(arrays["w"], np.float32)
    K = int(W.shape[0])
    if W.shape[1] != H:
        raise DrafterError(f"the Medusa heads are {W.shape[1]} wide, the target's hidden size is {H}: they were "
                           "trained for another model")
    fp = (info.get("lm_head") or {}).get("fingerprint")
    if fp is None or not _match(fp, w_lm):
        raise DrafterError("the Medusa heads were trained on another LM head (fingerprint mismatch): they belong to "
                           "another model; retrain with `dyncompile train-drafter TARGET --kind medusa`")
    vocab = np.asarray(arrays["vocab"], np.int64)
    if vocab.ndim != 1 or not len(vocab) or vocab.min() < 0 or vocab.max() >= V:
        raise DrafterError(f"the Medusa heads' vocabulary names tokens outside the target's {V}")
    if not 1 <= topk <= min(64, len(vocab)):
        raise DrafterError(f"medusa-heads topk must be in 1..{min(64, len(vocab))}, got {topk}")
    full = len(vocab) == V and bool(np.all(vocab == np.arange(V)))
    if "lm" in arrays:  # one trained LM head per head (Medusa-1), over the draft vocabulary
        lms = np.asarray(arrays["lm"], np.float32)
        if lms.shape != (K, H, len(vocab)):
            raise DrafterError(f"the Medusa heads' per-head LM heads are {list(lms.shape)}, expected "
                               f"{[K, H, len(vocab)]} (heads, hidden size, draft vocabulary); retrain the heads")
        lm = ir.val("medusa.lm_heads", const_value=ir.tensor(np.ascontiguousarray(lms), name="medusa.lm_heads"))
    elif full and node.inputs[1].const_value is not None:
        lm = ir.Value(name=node.inputs[1].name, const_value=node.inputs[1].const_value)  # the target's own tensor
    else:
        lm = ir.val("medusa.lm_head", const_value=ir.tensor(np.ascontiguousarray(w_lm[:, vocab], np.float32),
                                                            name="medusa.lm_head"))
    f = ir.Value(name=FEATURES, shape=ir.Shape(["n", H]), type=ir.TensorType(ir.DataType.FLOAT))

    def const(name, arr):
        return ir.val(name, const_value=ir.tensor(np.ascontiguousarray(arr), name=name))

    wv, bv = const("medusa.w", W), const("medusa.b", np.asarray(arrays["b"], np.float32)[:, None, :])
    axes, kv, voc = const("medusa.axes0", np.asarray([0], np.int64)), const("medusa.k", np.asarray([topk], np.int64)), \
        const("medusa.vocab", vocab)
    nodes = []

    def op(kind, inputs, name, n_out=1, **attrs):
        nd = ir.node(kind, inputs, attributes=attrs, name=name, num_outputs=n_out)
        for i, o in enumerate(nd.outputs):
            o.name = name if n_out == 1 else f"{name}.{i}"
            o.dtype = ir.DataType.INT64 if (kind == "TopK" and i == 1) or kind == "Gather" else ir.DataType.FLOAT
        nodes.append(nd)
        return nd.outputs[0] if n_out == 1 else nd.outputs

    x3 = op("Unsqueeze", [f, axes], "medusa.x")                  # [1, n, H]
    a = op("Add", [op("MatMul", [x3, wv], "medusa.mm"), bv], "medusa.pre")  # [K, n, H]
    z = op("Add", [x3, op("Mul", [a, op("Sigmoid", [a], "medusa.sig")], "medusa.silu")], "medusa.z")
    lp = op("LogSoftmax", [op("MatMul", [z, lm], "medusa.logits")], "medusa.logsoftmax", axis=-1)
    vals, idx = op("TopK", [lp, kv], "medusa.topk", n_out=2, axis=-1)
    ids = op("Gather", [voc, idx], IDS_OUTPUT)
    vals.name = LOGP_OUTPUT
    for v, dt in ((vals, ir.DataType.FLOAT), (ids, ir.DataType.INT64)):
        v.dtype = dt
        v.shape = ir.Shape([K, "n", topk])
    g = ir.Graph([f], [vals, ids], nodes=nodes, initializers=[wv, bv, axes, kv, voc, lm], opset_imports={"": 18},
                 name="medusa_heads")
    m = ir.Model(g, ir_version=10, producer_name="dyncompile")
    m.metadata_props[_keys.ROLE] = "drafter"
    return m


class MedusaHeadsPass(ir.passes.InPlacePass):
    """Expose the target's LM-head input as ``medusa_features`` and build the Medusa heads graph.

    Scope: target graph: one more output (the LM head's input value, renamed ``medusa_features``), no node added;
    the heads graph is a new ``ir.Model`` left in ``model.meta``.
    Invariants: the target's original outputs are the same values; ``metadata_props["dyncompile.medusa"]`` records
    the heads (file hash, held-out agreement, heads, topk). A model that already carries the record with the heads
    in memory is left alone (``modified=False``).
    Sketch: ``h -> logits`` becomes ``h -> logits, h``; ``heads = [h + SiLU(h W_k + b_k)] @ LM -> TopK``.
    """

    def __init__(self, head_dir: str | Path, topk: int = 4) -> None:
        super().__init__()
        self.head_dir = Path(head_dir).expanduser()
        self.topk = int(topk)

    def __repr__(self) -> str:
        return f"MedusaHeadsPass(head_dir={str(self.head_dir)!r}, topk={self.topk})"

    def requires(self, model: ir.Model) -> None:
        """Refuse a model the pass cannot work on, with what to do about it."""
        if _keys.MEDUSA in model.metadata_props:
            if _keys.MEDUSA_MODEL not in model.meta:
                raise DrafterError("this model records Medusa heads but their graph is not in memory (drafters are "
                                   "never saved inside the target); compile from the original model")
            return
        if _keys.EAGLE in model.metadata_props:
            raise DrafterError("two drafters: eagle-drafter already gave this model a drafter; drop one of them")
        lm_head_of(model)
        if not 1 <= self.topk <= 64:
            raise DrafterError(f"medusa-heads topk must be in 1..64, got {self.topk}")
        load_medusa_heads(self.head_dir)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Run the rewrite on ``model`` (scope and invariants: the class docstring)."""
        if _keys.MEDUSA in model.metadata_props and _keys.MEDUSA_MODEL in model.meta:
            return ir.passes.PassResult(model, modified=False)
        arrays, info, sha = load_medusa_heads(self.head_dir)
        heads = build_medusa_heads(model, arrays, info, self.topk)
        node, h, w_lm, _ = lm_head_of(model)
        if h.is_graph_output() or h.is_graph_input():
            raise DrafterError(f"the LM head's input {h.name!r} is already a graph input/output; cannot expose it")
        h.name = FEATURES
        if h.dtype is None:  # an untyped intermediate becomes a graph output: give it its (float) type
            h.dtype = ir.DataType.FLOAT
        if h.shape is None:  # the logits' leading dims, then the hidden size
            lead = list(node.outputs[0].shape)[:-1] if node.outputs[0].shape is not None else ["batch", "seq"]
            h.shape = ir.Shape([*lead, int(w_lm.shape[0])])
        model.graph.outputs.append(h)
        record = {
            "format": HEADS_FORMAT,
            "head": {"dir": str(self.head_dir), "sha256": sha, "target": info.get("target"), "eval": info.get("eval"),
                     "training": info.get("training"), "corpus_held_out": (info.get("corpus") or {}).get("held_out")},
            "features": FEATURES,
            "heads": int(arrays["w"].shape[0]),
            "topk": self.topk,
            "draft_vocab": int(len(arrays["vocab"])),
            "lm_heads": "per head" if "lm" in arrays else "shared",
        }
        model.metadata_props[_keys.MEDUSA] = json.dumps(record, sort_keys=True)
        model.meta[_keys.MEDUSA_MODEL] = heads
        logger.info("medusa-heads: %d heads (held-out top-1 agreement %s), top-%d each, draft vocabulary %d",
                    record["heads"], (info.get("eval") or {}).get("head_top1_agreement"), self.topk,
                    record["draft_vocab"])
        return ir.passes.PassResult(model, modified=True)

    def ensures(self, model: ir.Model) -> None:
        """Check what the pass promises on its output."""
        if _keys.MEDUSA_MODEL not in model.meta or not any(v.name == FEATURES for v in model.graph.outputs):
            raise ir.passes.PostconditionError("the Medusa heads or the medusa_features output are missing")


@register_pass(
    "medusa-heads",
    help="Medusa drafter from trained heads (head=DIR from `dyncompile train-drafter --kind medusa`; topk=4 per head): "
    "residual blocks on the target's last hidden state + the target's LM head; then `speculative{tree=true}`",
    before=("speculative",),
)
def _make_medusa_heads(context: CompileContext, head: str = "", topk: int = 4):
    del context
    if not head:
        raise DrafterError("medusa-heads needs head=DIR (heads trained by `dyncompile train-drafter TARGET --kind "
                           "medusa --out DIR`)")
    return MedusaHeadsPass(head, topk=topk)
