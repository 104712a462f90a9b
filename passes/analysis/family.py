"""Family and task guess of an analysed model, as data: facts measured on the graph, then signature tables.

Three steps:

1. :func:`collect_facts` measures structural facts on the graph (normalisation, activation, projections
   and their biases, rotary embedding, KV cache, causal mask, embedding gathers, position-id and
   relative-position computations). Names are never used here.
2. :data:`TASK_SIGNATURES` and :data:`FAMILY_SIGNATURES` are rows checked in order; the first row whose
   predicate holds gives the answer and its reason. The last row of each table always matches.
3. Weight names and metadata (:data:`NAME_HINTS`) may then refine the structural family within its group
   (``bert``/``roberta``/``mpnet``, ``llama``/``qwen2``) or name a generic one (``encoder``, ``decoder``,
   ``unknown``); they never move a model from one group to another.

The reason string is the matching row's reason, the name-hint note, then the non-empty facts in
brackets, so ``dyncompile inspect`` shows what the guess rests on.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import onnx_ir as ir

from dyncompile.passes.analysis._values import (
    COMPARE_OPS,
    LAYER_NORM_OPS,
    MATMUL_OPS,
    RMS_NORM_OPS,
    shape_list,
    shape_tuple,
)
from dyncompile.passes.analysis.structure import HeadInfo

if TYPE_CHECKING:
    from dyncompile.passes.analysis.layers import _Analyzer

__all__ = ["FAMILY_SIGNATURES", "NAME_HINTS", "TASK_SIGNATURES", "Signals", "collect_facts", "guess_family"]


@dataclasses.dataclass(frozen=True)
class Signals:
    """What the signature predicates read: the reported ``facts`` plus the derived, unreported signals.

    Attributes:
        facts: structural facts in report order (see :func:`collect_facts`).
        decoder: a KV cache, a causal mask, or a generation task was found.
        token_type: a token-type embedding (a 1- or 2-row table gathered by the inputs, or a
            ``token_type`` input).
        has_layers: the analysis found repeated layers.
        float_outputs: shapes of the floating-point graph outputs.
        vocab: rows of the largest heavy embedding table, or None.
        pooling: the head's pooling (``"cls"``, ``"mean"``, ``"last"``, ``"none"``).
        hidden: the hidden size (last dim of the layer cut tensors) when static, else None.
    """

    facts: dict[str, Any]
    decoder: bool = False
    token_type: bool = False
    has_layers: bool = False
    float_outputs: tuple[tuple[int | str, ...], ...] = ()
    vocab: int | None = None
    pooling: str = "none"
    hidden: int | None = None

    def __getitem__(self, key: str) -> Any:
        return self.facts.get(key)


def _last_dim(dims) -> int | None:
    return dims[-1] if dims and isinstance(dims[-1], int) else None


#: (task, predicate, meaning), checked in order; the first match wins.
TASK_SIGNATURES: tuple[tuple[str, Callable[[Signals], bool], str], ...] = (
    (
        "text-generation",
        lambda s: (
            bool(s["kv_cache_outputs"])
            or any(
                len(d) == 3 and _last_dim(d) is not None and (_last_dim(d) == s.vocab or _last_dim(d) >= 8000)
                for d in s.float_outputs
            )
        ),
        "present KV outputs, or [batch, seq, vocab] logits (vocab = the embedding rows, or >= 8000)",
    ),
    (
        "text-classification",
        lambda s: (
            s.pooling in ("cls", "mean", "last")
            and any(
                len(d) == 2 and _last_dim(d) is not None and _last_dim(d) <= 1000 and _last_dim(d) != s.hidden
                for d in s.float_outputs
            )
        ),
        "a pooled head with a [batch, classes] output (classes <= 1000, not the hidden size)",
    ),
    (
        "feature-extraction",
        lambda s: (
            s.hidden is not None
            and any(len(d) in (2, 3) and _last_dim(d) == s.hidden for d in s.float_outputs)
        ),
        "an output whose last dim is the hidden size",
    ),
    ("unknown", lambda s: True, "none of the above"),
)


def _llama_block(s: Signals) -> bool:
    return bool(s["rotary"]) and s["norm"] == "rmsnorm" and s["activation"] == "silu"


def _layernorm_encoder(s: Signals) -> bool:
    return s["norm"] == "layernorm" and not s.decoder


#: (family, predicate, reason), checked in order; the first match wins. ``{...}`` in a reason is filled
#: from the facts.
FAMILY_SIGNATURES: tuple[tuple[str, Callable[[Signals], bool], str], ...] = (
    (
        "qwen2",
        lambda s: _llama_block(s) and 3 <= s["biased_projections"] < s["matmuls_per_layer"],
        "RMSNorm + rotary + SiLU-gated MLP with biased q/k/v projections (Qwen2-like)",
    ),
    ("llama", _llama_block, "RMSNorm + rotary + SiLU-gated MLP, no projection biases (Llama-like)"),
    (
        "mpnet",
        lambda s: _layernorm_encoder(s) and bool(s["relative_position_bias"]),
        "LayerNorm encoder with a relative-position bias computed from the inputs (MPNet-like)",
    ),
    (
        "roberta",
        lambda s: _layernorm_encoder(s) and bool(s["cumsum_positions"]),
        "LayerNorm encoder with position ids from CumSum over the mask (RoBERTa-like)",
    ),
    (
        "bert",
        lambda s: _layernorm_encoder(s) and (s.token_type or s["embedding_gathers"] >= 3),
        "LayerNorm encoder with {embedding_gathers} embedding gathers incl. token types (BERT-like)",
    ),
    ("encoder", _layernorm_encoder, "LayerNorm encoder"),
    ("decoder", lambda s: s.decoder, "causal decoder"),
    ("encoder", lambda s: s.has_layers, "stack of blocks without a causal mask or KV cache"),
    (
        "unknown",
        lambda s: True,
        "no layer structure and no transformer signature (normalisation + attention)",
    ),
)

#: (family, regex over the first 400 initializer names and the metadata), checked in order.
NAME_HINTS: tuple[tuple[str, str], ...] = (
    ("mpnet", r"\bmpnet\.|relative_attention_bias"),
    ("roberta", r"\broberta\."),
    ("distilbert", r"\bdistilbert\."),
    ("bert", r"\bbert\."),
    ("qwen2", r"qwen"),
    ("llama", r"llama"),
)

#: structural families a name hint may replace: generic ones by any hint, the others within their group
_GENERIC_FAMILIES = frozenset({"encoder", "decoder", "unknown"})
_FAMILY_GROUPS = (frozenset({"bert", "roberta", "mpnet", "distilbert"}), frozenset({"llama", "qwen2"}))


def _hint_applies(family: str, hint: str) -> bool:
    return family in _GENERIC_FAMILIES or any(family in g and hint in g for g in _FAMILY_GROUPS)


def _first(table, signals: Signals) -> tuple[str, str]:
    for name, predicate, text in table:
        if predicate(signals):
            return name, text
    raise AssertionError("the last row of a signature table always matches")  # pragma: no cover


def _norm_of(layer_ops: collections.Counter) -> str | None:
    """``rmsnorm`` / ``layernorm`` from a layer's op counts (fused ops or their spelled-out forms)."""
    if any(op in RMS_NORM_OPS for op in layer_ops) or (
        layer_ops["ReduceMean"]
        and (layer_ops["Sqrt"] or layer_ops["Reciprocal"])
        and not layer_ops["Sub"]
        and not any(op in LAYER_NORM_OPS for op in layer_ops)
    ):
        return "rmsnorm"
    if any(op in LAYER_NORM_OPS for op in layer_ops) or (layer_ops["ReduceMean"] and layer_ops["Sub"]):
        return "layernorm"
    return None


def _activation_of(layer_ops: collections.Counter) -> str | None:
    """The MLP activation from a layer's op counts."""
    if layer_ops["Erf"] or layer_ops["Gelu"] or layer_ops["FastGelu"] or layer_ops["BiasGelu"]:
        return "gelu"
    if layer_ops["Sigmoid"] or layer_ops["Swish"]:
        return "silu"
    if layer_ops["Relu"]:
        return "relu"
    if layer_ops["Tanh"]:
        return "gelu-tanh"
    return None


def _biases_of(a: _Analyzer, n: ir.Node) -> int:
    """Constant biases of one projection: ``Add(MatMul(x, W), b)`` uses with a constant ``b``, or Gemm's ``C``."""
    count = sum(
        1
        for out in n.outputs
        for use in out.uses()
        if use.node.op_type == "Add" and any(v is not None and v in a.const and v is not out for v in use.node.inputs)
    )
    return count + int(n.op_type == "Gemm" and len(n.inputs) > 2 and n.inputs[2] is not None)


def collect_facts(
    a: _Analyzer, order: list[ir.Node], layers_nodes: list[list[ir.Node]], prefix_nodes: list[ir.Node]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Structural facts (reported, in this order) and the extra signals the tables read.

    Facts: ``norm``, ``activation`` (of the first layer, or of all compute nodes when there are no
    layers), ``matmuls_per_layer``, ``biased_projections``, ``rotary``, ``kv_cache_inputs``,
    ``causal_mask``, ``embedding_gathers``, ``vocab_size``, ``token_type_embedding``,
    ``cumsum_positions``, ``relative_position_bias``, ``kv_cache_outputs``.
    """
    graph = a.graph
    facts: dict[str, Any] = {}
    all_ops = collections.Counter(n.op_type for n in order)
    layer = layers_nodes[0] if layers_nodes else [n for n in order if n in a.tainted_nodes]
    layer_ops = collections.Counter(n.op_type for n in layer)
    for key, value in (("norm", _norm_of(layer_ops)), ("activation", _activation_of(layer_ops))):
        if value is not None:
            facts[key] = value
    # projections: matrix products with a constant matrix (any size: small K/V projections of GQA count)
    projections = [
        n
        for n in layer
        if n.op_type in MATMUL_OPS
        and any(v in a.const and v.shape is not None and len(v.shape) >= 2 for v in a.inputs_of[n])
    ]
    facts["matmuls_per_layer"] = len(projections)
    facts["biased_projections"] = sum(_biases_of(a, n) for n in projections)
    facts["rotary"] = bool(all_ops["Sin"] and all_ops["Cos"]) or any("Rotary" in op for op in all_ops)
    # KV cache: graph inputs concatenated inside the layers
    past_inputs = [
        v
        for v in graph.inputs
        if any(u.node.op_type == "Concat" and u.node in a.tainted_nodes for u in v.uses())
        and v.shape is not None
        and len(v.shape) == 4
    ]
    facts["kv_cache_inputs"] = len(past_inputs)
    # causal mask: comparison of two computed (non-constant) index tensors, or Trilu
    facts["causal_mask"] = bool(all_ops["Trilu"]) or any(
        n.op_type in COMPARE_OPS and n not in a.tainted_nodes and all(v is not None and v not in a.const for v in n.inputs)
        for n in order
    )
    # embedding stage: gathers from constant tables with data-dependent indices
    gathers = [
        n
        for n in prefix_nodes
        if n.op_type == "Gather"
        and n.inputs[0] is not None
        and n.inputs[0] in a.const
        and n.inputs[1] is not None
        and n.inputs[1] not in a.const
    ]
    facts["embedding_gathers"] = len(gathers)
    rows = [shape_tuple(n.inputs[0]) for n in gathers if n in a.heavy_nodes]
    vocab = max((s[0] for s in rows if s and isinstance(s[0], int)), default=None)
    facts["vocab_size"] = vocab
    token_type = any(
        n.inputs[0].const_value is not None
        and len(n.inputs[0].const_value.shape) == 2
        and n.inputs[0].const_value.shape[0] in (1, 2)
        for n in gathers
    ) or any("token_type" in (v.name or "") for v in graph.inputs)
    facts["token_type_embedding"] = token_type
    free = [n for n in order if n not in a.tainted_nodes and n not in a.const_nodes]
    facts["cumsum_positions"] = any(n.op_type == "CumSum" for n in free)
    facts["relative_position_bias"] = any(n.op_type == "Log" for n in free) and any(
        n.op_type == "Gather" and n.inputs[0] is not None and n.inputs[0] in a.const for n in free
    )
    # present KV outputs: Concat of a graph input returned as an output (else outputs named "present")
    graph_inputs = set(graph.inputs)
    facts["kv_cache_outputs"] = sum(
        1
        for o in graph.outputs
        if o.producer() is not None
        and o.producer().op_type == "Concat"
        and any(v in graph_inputs for v in o.producer().inputs)
    ) or sum(1 for o in graph.outputs if "present" in (o.name or "").lower())
    float_outputs = tuple(
        tuple(shape_list(o.shape) or [])
        for o in graph.outputs
        if o.dtype is not None and o.dtype.is_floating_point() and o not in graph_inputs
    )
    extra = {
        "past_inputs": bool(past_inputs),
        "token_type": token_type,
        "float_outputs": float_outputs,
        "vocab": vocab,
    }
    return facts, extra


def _name_hint(model: ir.Model) -> str | None:
    names = " ".join(list(model.graph.initializers)[:400]).lower()
    meta = " ".join(f"{k}={v}" for k, v in list(model.metadata_props.items())[:20]).lower()
    hint_text = names + " " + meta
    for family, pattern in NAME_HINTS:
        if re.search(pattern, hint_text):
            return family
    return None


def guess_family(
    a: _Analyzer,
    order: list[ir.Node],
    layers_nodes: list[list[ir.Node]],
    prefix_nodes: list[ir.Node],
    head: HeadInfo,
    hidden: int | None,
) -> tuple[str, str, str]:
    """``(family, reason, task)`` of the analysed model (see the module docstring)."""
    facts, extra = collect_facts(a, order, layers_nodes, prefix_nodes)
    signals = Signals(
        facts,
        token_type=extra["token_type"],
        has_layers=bool(layers_nodes),
        float_outputs=extra["float_outputs"],
        vocab=extra["vocab"],
        pooling=head.pooling,
        hidden=hidden,
    )
    task, _ = _first(TASK_SIGNATURES, signals)
    decoder = bool(
        extra["past_inputs"] or facts["kv_cache_outputs"] or facts["causal_mask"] or task == "text-generation"
    )
    signals = dataclasses.replace(signals, decoder=decoder)
    family, reason = _first(FAMILY_SIGNATURES, signals)
    reasons = [reason.format(**facts)]
    hint = _name_hint(a.model)
    if hint is not None and _hint_applies(family, hint):
        reasons.append(f"weight names say {hint!r}" if hint != family else "weight names agree")
        family = hint
    detail = ", ".join(f"{k}={v}" for k, v in facts.items() if v not in (None, False, 0))
    return family, "; ".join(reasons) + (f" [{detail}]" if detail else ""), task
