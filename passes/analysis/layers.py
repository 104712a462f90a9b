"""Graph analysis: find the repeated blocks (transformer layers) of an exported model and the cut tensors
between them.

Scope: the main graph of an ``ir.Model`` (nodes with subgraphs are treated as one unit, their captured
outer values count as inputs); ``model.functions`` are not entered. The model is never mutated.

Definitions used throughout:

* A **weight** is a constant tensor (initializer, ``Constant`` node, or something computed from constants
  only) with at least :data:`WEIGHT_MIN_ELEMENTS` elements. A node that reads a weight is **heavy**.
* A value is **recomputable** when neither its producer nor any ancestor is heavy: graph inputs,
  constants, mask processing, shape arithmetic, rotary cos/sin computed from ``position_ids``...
  Every other value is **tainted** (it carries the hidden state).
* Sweeping the topological order once, the **live set** at the boundary after node ``i`` is the set of
  tainted values produced at or before ``i`` and consumed after ``i`` (graph outputs without later
  consumers, like present KV, do not keep a value live). A value ``v`` is a **cut candidate** when the
  live set is exactly ``{v}`` at some boundary: together with the graph inputs it separates everything
  before from everything after, so ``ir.convenience.extract(graph, inputs=[*graph inputs, v], outputs=...)``
  never needs to recompute anything heavy that came before.
  Two virtual candidates complete the list: a floating-point graph input that feeds the computation
  (``inputs_embeds``-style models; past KV inputs, only concatenated, do not count) is the cut before the
  first node, and the graph output computed last closes the graph (a model returning its last hidden
  state).
* Consecutive cut candidates delimit **segments**. Each segment gets a signature (op-type counts of its
  tainted nodes plus the shapes of the weights it reads). The longest periodic run of signatures (period
  ``P`` segments, repeated ``k >= 2`` times, each period reading a weight) gives the layers; among equally
  long runs the phase whose first segment reads a weight wins, so a post-LN LayerNorm stays in the layer it
  closes (BERT's layer output is the LayerNorm output, as in Hugging Face ``hidden_states``). The run is then
  extended at both ends by blocks that read the same weights (a first or last layer whose light ops differ).
  What comes before the run is the embedding stage, what comes after is the head.

Names and metadata are never used to find layers or cuts; they are only a hint for the family guess.
The main graph is used in its stored order when that order is topological, else in a stable
topological order computed with networkx (the model itself is not re-sorted).

Sketch: ``analyze_model(model) -> ModelStructure(layers=[LayerInfo...], cuts=[CutTensor(after_layer=0..L)])``.
Cost: O(nodes + edges) for the sweep, O(segments^2) for the period search: ~10 ms for MiniLM (313 nodes),
~40 ms for SmolLM2 with KV cache (2,245 nodes).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import re
import time
from collections.abc import Iterable, Sequence
from typing import Any

import networkx as nx
import numpy as np
import onnx_ir as ir

__all__ = [
    "WEIGHT_MIN_ELEMENTS",
    "CutTensor",
    "HeadInfo",
    "LayerInfo",
    "ModelStructure",
    "NoLayerStructureError",
    "analyze_model",
    "format_report",
]

logger = logging.getLogger(__name__)

#: A constant with at least this many elements is a weight; a node reading one is "heavy".
WEIGHT_MIN_ELEMENTS = 65_536

_NONDETERMINISTIC_OPS = frozenset(
    {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"}
)
_SHAPE_ONLY_OPS = frozenset({"Shape", "Size"})
_COMPARE_OPS = frozenset({"Less", "LessOrEqual", "Greater", "GreaterOrEqual"})
_RMS_NORM_OPS = frozenset(
    {"SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "RMSNormalization"}
)
_LAYER_NORM_OPS = frozenset({"LayerNormalization", "SkipLayerNormalization"})
_MATMUL_OPS = frozenset(
    {"MatMul", "Gemm", "MatMulNBits", "MatMulInteger", "QLinearMatMul", "FusedMatMul", "Einsum"}
)
#: longest repeating unit considered, in segments between cut tensors (BERT: 4, Llama: 2)
_MAX_SEGMENTS_PER_LAYER = 256


class NoLayerStructureError(ValueError):
    """Raised by :meth:`ModelStructure.require_layers` when no repeated layer structure was found."""


@dataclasses.dataclass(frozen=True)
class CutTensor:
    """A tensor that, together with the graph inputs, separates the graph before it from the graph after it.

    Attributes:
        name: the value's name in the main graph.
        dtype: element type, e.g. ``"float32"`` (``"unknown"`` if no type is known).
        shape: dims; ``int`` for static dims, ``str`` for symbolic ones (``"?"`` when unknown).
        after_layer: 0 = after the embeddings (input of layer 1), k = output of layer k.
        producer: name of the node producing the value.
    """

    name: str
    dtype: str
    shape: list[int | str]
    after_layer: int
    producer: str = ""


@dataclasses.dataclass(frozen=True)
class LayerInfo:
    """One repeated block.

    Attributes:
        index: 1-based layer number.
        first_node / last_node: first and last compute (non-recomputable) node of the layer, in order.
        num_nodes: number of compute nodes in the layer (recomputable mask/shape nodes are shared and not
            counted).
        input_cut / output_cut: names of the cut tensors entering and leaving the layer.
        inner_cuts: cut tensors inside the layer (e.g. after attention+LayerNorm in post-LN BERT, after the
            attention residual add in pre-LN Llama).
        param_count: elements of the float initializers the layer reads (scalars excluded).
        node_names: all compute nodes of the layer, in order.
    """

    index: int
    first_node: str
    last_node: str
    num_nodes: int
    input_cut: str
    output_cut: str
    inner_cuts: tuple[str, ...] = ()
    param_count: int = 0
    node_names: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class HeadInfo:
    """What happens after the last layer's output.

    Attributes:
        pooling: ``"cls"`` (first position), ``"mean"``, ``"last"`` (last position), or ``"none"``
            (token-wise, e.g. an LM head or raw hidden states).
        nodes: names of the compute nodes after the last layer output, in order.
        description: one line, e.g. ``"Gather index 0 on axis 1 -> Gemm -> Tanh -> Gemm -> logits"``.
    """

    pooling: str = "none"
    nodes: list[str] = dataclasses.field(default_factory=list)
    description: str = ""


@dataclasses.dataclass
class ModelStructure:
    """Result of :func:`analyze_model`."""

    inputs: list[tuple[str, str, list[int | str]]]
    outputs: list[tuple[str, str, list[int | str]]]
    op_histogram: dict[str, int]
    param_count: int
    num_nodes: int
    family: str = "unknown"
    family_reason: str = ""
    task: str = "unknown"
    layers: list[LayerInfo] = dataclasses.field(default_factory=list)
    cuts: list[CutTensor] = dataclasses.field(default_factory=list)
    head: HeadInfo = dataclasses.field(default_factory=HeadInfo)
    message: str = ""
    #: every cut candidate found by the sweep (embedding stage, inside layers, head), in order
    candidate_cuts: list[str] = dataclasses.field(default_factory=list)
    #: compute nodes before layer 1 (the embedding stage)
    embedding_nodes: list[str] = dataclasses.field(default_factory=list)
    #: segments (between consecutive cut candidates) per layer
    segments_per_layer: int = 0
    analysis_seconds: float = 0.0

    @property
    def has_layers(self) -> bool:
        return bool(self.layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int | None:
        """Last dim of the layer-output cut tensors when static, else None."""
        if self.cuts and self.cuts[-1].shape and isinstance(self.cuts[-1].shape[-1], int):
            return self.cuts[-1].shape[-1]
        return None

    def require_layers(self) -> ModelStructure:
        """Return self, or raise :class:`NoLayerStructureError` explaining why no layers were found."""
        if not self.layers:
            raise NoLayerStructureError(
                (self.message or "no repeated layer structure found in the model.")
                + " Layer-based passes (early exit, split drafter) need a transformer-like stack of"
                " identical blocks; run `dyncompile inspect MODEL` to see what the analysis found."
            )
        return self

    def cut_for_layer(self, k: int) -> CutTensor:
        """The cut tensor after layer ``k`` (0 = after the embeddings, ``num_layers`` = last layer output)."""
        self.require_layers()
        for cut in self.cuts:
            if cut.after_layer == k:
                return cut
        raise IndexError(
            f"no cut after layer {k}: the model has layers 1..{len(self.layers)} (cuts 0..{len(self.layers)})"
        )


# --------------------------------------------------------------------------------------------- helpers


def _dtype_str(dtype: ir.DataType | None) -> str:
    if dtype is None:
        return "unknown"
    try:
        return str(dtype.numpy().name) if dtype not in (ir.DataType.STRING,) else "string"
    except Exception:  # noqa: BLE001 - types without a numpy equivalent (float8, int4...)
        return dtype.name.lower()


def _shape_list(shape: ir.Shape | None) -> list[int | str] | None:
    if shape is None:
        return None
    dims: list[int | str] = []
    for d in shape:
        if isinstance(d, int):
            dims.append(d)
        else:
            value = getattr(d, "value", None)
            dims.append(str(value) if value is not None else "?")
    return dims


def _io_entry(v: ir.Value) -> tuple[str, str, list[int | str]]:
    return (v.name or "", _dtype_str(v.dtype), _shape_list(v.shape) or [])


def _node_label(node: ir.Node, index: int) -> str:
    return node.name or f"{node.op_type}_{index}"


def _subgraphs(node: ir.Node) -> list[ir.Graph]:
    graphs: list[ir.Graph] = []
    for attr in node.attributes.values():
        if attr.type == ir.AttributeType.GRAPH:
            graphs.append(attr.value)
        elif attr.type == ir.AttributeType.GRAPHS:
            graphs.extend(attr.value)
    return graphs


def _node_inputs(node: ir.Node) -> list[ir.Value]:
    """Explicit inputs plus outer-scope values captured by the node's subgraphs."""
    inputs = [v for v in node.inputs if v is not None]
    graphs = _subgraphs(node)
    if not graphs:
        return inputs
    inner: set[ir.Value] = set()
    inner_nodes: list[ir.Node] = []
    for g in graphs:
        inner.update(g.inputs)
        inner.update(g.initializers.values())
        for n in g.all_nodes():
            inner_nodes.append(n)
            inner.update(n.outputs)
            for sub in _subgraphs(n):
                inner.update(sub.inputs)
                inner.update(sub.initializers.values())
    seen = set(inputs)
    for n in inner_nodes:
        for v in n.inputs:
            if v is not None and v not in inner and v not in seen:
                seen.add(v)
                inputs.append(v)
    return inputs


def _constant_node_tensor(node: ir.Node) -> Any | None:
    if node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
        return None
    attr = node.attributes.get("value")
    if attr is not None and attr.type == ir.AttributeType.TENSOR:
        return attr.value
    return None


def _const_array(v: ir.Value | None, max_elements: int = 64) -> np.ndarray | None:
    """Small constant value as numpy (initializer or Constant node), else None."""
    if v is None:
        return None
    tensor = v.const_value
    if tensor is None:
        producer = v.producer()
        if producer is None:
            return None
        tensor = _constant_node_tensor(producer)
        if tensor is None:
            if producer is not None and producer.op_type == "Constant":
                for key in ("value_int", "value_ints", "value_float", "value_floats"):
                    attr = producer.attributes.get(key)
                    if attr is not None:
                        return np.asarray(attr.value)
            return None
    try:
        if tensor.size > max_elements:
            return None
        return tensor.numpy()
    except Exception:  # noqa: BLE001 - unreadable external data etc.
        return None


def _attr_int(node: ir.Node, name: str, default: int | None = None) -> int | None:
    attr = node.attributes.get(name)
    if attr is None:
        return default
    try:
        return int(attr.value)
    except (TypeError, ValueError):
        return default


def _shape_tuple(v: ir.Value) -> tuple[Any, ...]:
    if v.const_value is not None:
        return tuple(v.const_value.shape)
    if v.shape is not None:
        return tuple(_shape_list(v.shape) or ())
    return ("?",)


def _static_numel(v: ir.Value) -> int | None:
    if v.shape is None:
        return None
    total = 1
    for d in v.shape:
        if not isinstance(d, int):
            return None
        total *= d
    return total


# ------------------------------------------------------------------------------------------- the analysis


@dataclasses.dataclass
class _Segment:
    start: int  # first node index (inclusive)
    stop: int  # last node index (inclusive)
    signature: tuple
    heavy_signature: tuple
    has_heavy: bool


class _Analyzer:
    def __init__(self, model: ir.Model, weight_min_elements: int):
        self.model = model
        self.graph = model.graph
        self.threshold = weight_min_elements

    # -- order ------------------------------------------------------------------------------------------
    def _topological_order(self) -> list[ir.Node]:
        nodes = list(self.graph)
        index = {n: i for i, n in enumerate(nodes)}
        self.inputs_of: dict[ir.Node, list[ir.Value]] = {n: _node_inputs(n) for n in nodes}
        ordered = True
        for i, n in enumerate(nodes):
            for v in self.inputs_of[n]:
                p = v.producer()
                if p is not None and p in index and index[p] >= i:
                    ordered = False
                    break
            if not ordered:
                break
        if ordered:
            return nodes
        logger.debug("main graph is not topologically ordered; sorting a view of it (stable)")
        dag = nx.DiGraph()
        dag.add_nodes_from(range(len(nodes)))
        for i, n in enumerate(nodes):
            for v in self.inputs_of[n]:
                p = v.producer()
                if p is not None and p in index:
                    dag.add_edge(index[p], i)
        try:
            order = list(nx.lexicographical_topological_sort(dag))
        except nx.NetworkXUnfeasible as e:
            raise ValueError("the main graph has a cycle; cannot analyze it") from e
        return [nodes[i] for i in order]

    # -- classification of values -------------------------------------------------------------------------
    def _classify(self, order: list[ir.Node], seeds: Iterable[ir.Value] = ()) -> None:
        threshold = self.threshold
        const: set[ir.Value] = set()
        big: set[ir.Value] = set()
        for v in self.graph.initializers.values():
            if v.const_value is not None or v.is_initializer():
                const.add(v)
                size = v.const_value.size if v.const_value is not None else _static_numel(v)
                if size is not None and size >= threshold:
                    big.add(v)
        tainted: set[ir.Value] = set(seeds)
        heavy_nodes: set[ir.Node] = set()
        tainted_nodes: set[ir.Node] = set()
        const_nodes: set[ir.Node] = set()
        for node in order:
            ins = self.inputs_of[node]
            reads_big = any(v in big for v in ins)
            is_const = (
                all(v in const for v in ins)
                and node.op_type not in _NONDETERMINISTIC_OPS
                and (ins or node.op_type == "Constant")
                and not _subgraphs(node)
            )
            if is_const:
                const_nodes.add(node)
                const.update(node.outputs)
                tensor = _constant_node_tensor(node)
                for out in node.outputs:
                    if tensor is not None:
                        size = tensor.size
                    else:
                        size = _static_numel(out)
                        if size is None:
                            size = threshold if (reads_big and node.op_type not in _SHAPE_ONLY_OPS) else 0
                    if size >= threshold:
                        big.add(out)
                continue
            if reads_big:
                heavy_nodes.add(node)
            if reads_big or any(v in tainted for v in ins):
                tainted_nodes.add(node)
                tainted.update(node.outputs)
        self.const, self.big, self.tainted = const, big, tainted
        self.heavy_nodes, self.tainted_nodes, self.const_nodes = heavy_nodes, tainted_nodes, const_nodes

    # -- the sweep ----------------------------------------------------------------------------------------
    def _sweep(self, order: list[ir.Node]) -> list[tuple[int, ir.Value]]:
        last_use: dict[ir.Value, int] = {}
        for i, node in enumerate(order):
            for v in self.inputs_of[node]:
                last_use[v] = i
        dies_at: dict[int, list[ir.Value]] = collections.defaultdict(list)
        live: dict[ir.Value, None] = {}
        candidates: list[tuple[int, ir.Value]] = []
        for v in self.graph.inputs:  # an activation input seeded as tainted is live from the start
            if v in self.tainted and last_use.get(v, -1) >= 0:
                live[v] = None
                dies_at[last_use[v]].append(v)
        if len(live) == 1:
            candidates.append((-1, next(iter(live))))
        for i, node in enumerate(order):
            for v in dies_at.pop(i, ()):
                live.pop(v, None)
            if node in self.tainted_nodes:
                for out in node.outputs:
                    last = last_use.get(out, -1)
                    if last > i:
                        live[out] = None
                        dies_at[last].append(out)
            if len(live) == 1:
                (v,) = live
                if not candidates or candidates[-1][1] is not v:
                    candidates.append((i, v))
        # the graph output computed last closes the graph (a model that returns its last hidden state has
        # no consumer for it, so the sweep alone would not see the last layer's output)
        last = max((i for i, n in enumerate(order) if n in self.tainted_nodes), default=None)
        if last is not None:
            outs = [o for o in order[last].outputs if o.is_graph_output()]
            if outs and (not candidates or candidates[-1][1] is not outs[0]):
                candidates.append((last, outs[0]))
        self.last_use = last_use
        return candidates

    # -- segments and period -----------------------------------------------------------------------------
    def _segment(self, order: list[ir.Node], start: int, stop: int) -> _Segment:
        ops: collections.Counter[str] = collections.Counter()
        heavy_ops: collections.Counter[str] = collections.Counter()
        weights: list[tuple[str, tuple]] = []
        for i in range(start, stop + 1):
            node = order[i]
            if node not in self.tainted_nodes:
                continue
            op = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
            ops[op] += 1
            if node in self.heavy_nodes:
                heavy_ops[op] += 1
                for v in self.inputs_of[node]:
                    if v in self.big:
                        weights.append((op, _shape_tuple(v)))
        weights.sort(key=repr)
        signature = (tuple(sorted(ops.items())), tuple(weights))
        heavy_signature = (tuple(sorted(heavy_ops.items())), tuple(weights))
        return _Segment(start, stop, signature, heavy_signature, bool(heavy_ops))

    @staticmethod
    def _find_period(segments: Sequence[_Segment]) -> tuple[int, int, int] | None:
        """Best (offset, period, repetitions) by coverage; ties -> smaller period, earlier offset."""
        m = len(segments)
        if m < 2:
            return None
        codes: dict[tuple, int] = {}
        sig = [codes.setdefault(s.signature, len(codes)) for s in segments]
        heavy_before = [0]  # heavy_before[j] = number of segments reading weights among segments[:j]
        for seg in segments:
            heavy_before.append(heavy_before[-1] + seg.has_heavy)
        best: tuple | None = None  # (-coverage, not starts_heavy, period, offset, reps)
        for period in range(1, min(m // 2, _MAX_SEGMENTS_PER_LAYER) + 1):
            run_start = None
            for i in range(m - period + 1):
                eq = i < m - period and sig[i] == sig[i + period]
                if eq and run_start is None:
                    run_start = i
                if not eq and run_start is not None:
                    run_len = i - run_start  # sig[j] == sig[j+P] for j in [run_start, i)
                    # every phase of the run; prefer (in order) coverage, a unit that starts with a
                    # segment reading weights (so light trailing segments such as a post-LN LayerNorm
                    # stay in the layer they close), the smaller period, the earlier offset
                    for shift in range(min(period, run_len + 1)):
                        reps = (run_len - shift) // period + 1
                        offset = run_start + shift
                        if reps < 2 or heavy_before[offset + period] == heavy_before[offset]:
                            continue
                        key = (-reps * period, not segments[offset].has_heavy, period, offset, reps)
                        if best is None or key < best:
                            best = key
                    run_start = None
        if best is None:
            return None
        _, _, period, offset, reps = best
        return offset, period, reps

    @staticmethod
    def _extend(segments: Sequence[_Segment], offset: int, period: int, reps: int) -> tuple[int, int]:
        """Extend a run at both ends by blocks that read the same weights (light ops may differ)."""
        unit = [segments[offset + j].heavy_signature for j in range(period)]
        while (
            offset - period >= 0
            and [segments[offset - period + j].heavy_signature for j in range(period)] == unit
        ):
            offset -= period
            reps += 1
        end = offset + reps * period
        while (
            end + period <= len(segments)
            and [segments[end + j].heavy_signature for j in range(period)] == unit
        ):
            reps += 1
            end += period
        return offset, reps

    # -- shapes -------------------------------------------------------------------------------------------
    def _value_types(self, values: Iterable[ir.Value]) -> dict[str, tuple[str, list[int | str]]]:
        values = list(values)
        result = {}
        missing = []
        for v in values:
            shape = _shape_list(v.shape)
            if v.dtype is None or shape is None:
                missing.append(v.name)
            result[v.name] = (_dtype_str(v.dtype), shape if shape is not None else [])
        if missing:
            logger.debug("no type for %s; running shape inference on a clone", missing[:5])
            try:
                from onnx_ir.passes.common import ShapeInferencePass, TopologicalSortPass

                try:
                    clone = self.model.clone()
                except Exception:  # noqa: BLE001 - clone() needs a sorted graph; go through the proto
                    clone = ir.from_proto(ir.to_proto(self.model))
                TopologicalSortPass()(clone)
                ShapeInferencePass(strict_mode=False)(clone)
                mapping = ir.convenience.create_value_mapping(clone.graph, include_subgraphs=False)
                for name in missing:
                    w = mapping.get(name)
                    if w is not None and (w.dtype is not None or w.shape is not None):
                        result[name] = (_dtype_str(w.dtype), _shape_list(w.shape) or [])
            except Exception as e:  # noqa: BLE001 - best effort, types are informative only
                logger.warning("shape inference for cut tensors failed: %s", e)
        return result

    # -- head -----------------------------------------------------------------------------------------------
    def _head(self, order: list[ir.Node], boundary: int, cut: ir.Value | None) -> HeadInfo:
        nodes = [(i, order[i]) for i in range(boundary + 1, len(order)) if order[i] in self.tainted_nodes]
        names = [_node_label(n, i) for i, n in nodes]
        if cut is None:
            return HeadInfo("none", names, "")
        rank = len(cut.shape) if cut.shape is not None else 3
        seq_axis = 1
        pooling = "none"
        parts: list[str] = []
        # follow the data from the cut in order; the first node that reduces the sequence axis decides
        reach: set[ir.Value] = {cut}
        shape_derived: set[ir.Value] = set()
        pooled = False
        for _, node in nodes:
            ins = self.inputs_of[node]
            if not any(v in reach for v in ins):
                continue
            reach.update(node.outputs)
            if (
                node.op_type in _SHAPE_ONLY_OPS
                or all(v in shape_derived or v in self.const or v not in self.tainted for v in ins)
                or all(o.dtype is not None and not o.dtype.is_floating_point() for o in node.outputs)
            ):
                shape_derived.update(node.outputs)
                continue  # shape arithmetic on the hidden state, not part of the head's math
            desc = node.op_type
            if not pooled:
                src = next(v for v in ins if v in reach)
                src_rank = len(src.shape) if src.shape is not None else rank
                kind, desc = self._pooling_of(node, src_rank, seq_axis)
                if kind is not None:
                    pooling, pooled = kind, True
            parts.append(desc)
        outs = [o.name for o in self.graph.outputs if o in reach and o is not cut]
        if not parts and not outs and cut.is_graph_output():
            return HeadInfo("none", names, f"none: the last layer output {cut.name!r} is a graph output")
        description = " -> ".join(_compress(parts))
        if outs:
            description = (
                f"{description} -> {', '.join(outs[:3])}{', ...' if len(outs) > 3 else ''}"
                if description
                else ", ".join(outs[:3])
            )
        return HeadInfo(pooling, names, description)

    def _pooling_of(self, node: ir.Node, rank: int, seq_axis: int) -> tuple[str | None, str]:
        op = node.op_type

        def norm_axis(a: int) -> int:
            return a + rank if a < 0 else a

        if op == "Gather":
            axis = norm_axis(_attr_int(node, "axis", 0) or 0)
            if axis == seq_axis and rank >= 3:
                idx = _const_array(node.inputs[1])
                if idx is not None and idx.size == 1:
                    k = int(idx.reshape(-1)[0])
                    if k == 0:
                        return "cls", f"Gather index 0 on axis {axis}"
                    if k == -1:
                        return "last", f"Gather index -1 on axis {axis}"
                    return "cls", f"Gather index {k} on axis {axis}"
                if idx is None:
                    return "last", f"Gather on axis {axis} (index computed from the inputs)"
        if op == "Slice":
            starts = _const_array(node.inputs[1])
            ends = _const_array(node.inputs[2])
            axes = _const_array(node.inputs[3]) if len(node.inputs) > 3 else None
            if starts is not None and ends is not None:
                axes_l = (
                    [norm_axis(int(a)) for a in axes.reshape(-1)]
                    if axes is not None
                    else list(range(starts.size))
                )
                for a, s, e in zip(axes_l, starts.reshape(-1), ends.reshape(-1), strict=False):
                    if a != seq_axis or rank < 3:
                        continue
                    s, e = int(s), int(e)
                    if s == 0 and e == 1:
                        return "cls", f"Slice [0:1] on axis {a}"
                    if s == -1:
                        return "last", f"Slice [-1:] on axis {a}"
        if op in ("ReduceMean", "ReduceSum") and rank >= 3:
            axes = _const_array(node.inputs[1]) if len(node.inputs) > 1 else None
            if axes is None and "axes" in node.attributes:
                axes = np.asarray(node.attributes["axes"].value)
            if axes is not None and seq_axis in [norm_axis(int(a)) for a in axes.reshape(-1)]:
                return "mean", f"{op} over axis {seq_axis}"
        if op == "GlobalAveragePool":
            return "mean", op
        return None, op

    # -- family ---------------------------------------------------------------------------------------------
    def _family(
        self,
        order,
        layers_nodes: list[list[ir.Node]],
        prefix_nodes: list[ir.Node],
        head: HeadInfo,
        hidden: int | None,
    ) -> tuple[str, str, str, dict[str, Any]]:
        graph = self.graph
        facts: dict[str, Any] = {}
        reasons: list[str] = []
        all_ops = collections.Counter(n.op_type for n in order)
        layer = layers_nodes[0] if layers_nodes else [n for n in order if n in self.tainted_nodes]
        layer_ops = collections.Counter(n.op_type for n in layer)
        # normalisation
        if any(op in _RMS_NORM_OPS for op in layer_ops) or (
            layer_ops["ReduceMean"]
            and (layer_ops["Sqrt"] or layer_ops["Reciprocal"])
            and not layer_ops["Sub"]
            and not any(op in _LAYER_NORM_OPS for op in layer_ops)
        ):
            facts["norm"] = "rmsnorm"
        elif any(op in _LAYER_NORM_OPS for op in layer_ops) or (layer_ops["ReduceMean"] and layer_ops["Sub"]):
            facts["norm"] = "layernorm"
        # activation
        if layer_ops["Erf"] or layer_ops["Gelu"] or layer_ops["FastGelu"] or layer_ops["BiasGelu"]:
            facts["activation"] = "gelu"
        elif layer_ops["Sigmoid"] or layer_ops["Swish"]:
            facts["activation"] = "silu"
        elif layer_ops["Relu"]:
            facts["activation"] = "relu"
        elif layer_ops["Tanh"]:
            facts["activation"] = "gelu-tanh"
        # projections: matrix products with a constant matrix (any size: small K/V projections of GQA count)
        projections = [
            n
            for n in layer
            if n.op_type in _MATMUL_OPS
            and any(v in self.const and v.shape is not None and len(v.shape) >= 2 for v in self.inputs_of[n])
        ]
        facts["matmuls_per_layer"] = len(projections)
        # q/k/v biases: Add(MatMul(x, W), b) with a constant b
        biased = 0
        for n in projections:
            for out in n.outputs:
                for use in out.uses():
                    c = use.node
                    if c.op_type == "Add" and any(
                        v is not None and v in self.const and v is not out for v in c.inputs
                    ):
                        biased += 1
            if n.op_type == "Gemm" and len(n.inputs) > 2 and n.inputs[2] is not None:
                biased += 1
        facts["biased_projections"] = biased
        facts["rotary"] = bool(all_ops["Sin"] and all_ops["Cos"]) or any("Rotary" in op for op in all_ops)
        # KV cache: graph inputs concatenated inside the layers
        past_inputs = [
            v
            for v in graph.inputs
            if any(u.node.op_type == "Concat" and u.node in self.tainted_nodes for u in v.uses())
            and v.shape is not None
            and len(v.shape) == 4
        ]
        facts["kv_cache_inputs"] = len(past_inputs)
        # causal mask: comparison of two computed (non-constant) index tensors, or Trilu
        causal = bool(all_ops["Trilu"])
        for n in order:
            if n.op_type in _COMPARE_OPS and n not in self.tainted_nodes:
                if all(v is not None and v not in self.const for v in n.inputs):
                    causal = True
                    break
        facts["causal_mask"] = causal
        # embedding stage: gathers from constant tables with data-dependent indices
        gathers = [
            n
            for n in prefix_nodes
            if n.op_type == "Gather"
            and n.inputs[0] is not None
            and n.inputs[0] in self.const
            and n.inputs[1] is not None
            and n.inputs[1] not in self.const
        ]
        facts["embedding_gathers"] = len(gathers)
        vocab = None
        for n in gathers:
            if n in self.heavy_nodes:
                shape = _shape_tuple(n.inputs[0])
                if shape and isinstance(shape[0], int):
                    vocab = shape[0] if vocab is None else max(vocab, shape[0])
        facts["vocab_size"] = vocab
        token_type = any(
            n.inputs[0].const_value is not None
            and len(n.inputs[0].const_value.shape) == 2
            and n.inputs[0].const_value.shape[0] in (1, 2)
            for n in gathers
        ) or any("token_type" in (v.name or "") for v in graph.inputs)
        facts["token_type_embedding"] = token_type
        free = [n for n in order if n not in self.tainted_nodes and n not in self.const_nodes]
        facts["cumsum_positions"] = any(n.op_type == "CumSum" for n in free)
        rel_bias = any(n.op_type == "Log" for n in free) and any(
            n.op_type == "Gather" and n.inputs[0] is not None and n.inputs[0] in self.const for n in free
        )
        facts["relative_position_bias"] = rel_bias

        # task, from the floating-point outputs
        graph_inputs = set(graph.inputs)
        n_present = sum(
            1
            for o in graph.outputs
            if o.producer() is not None
            and o.producer().op_type == "Concat"
            and any(v in graph_inputs for v in o.producer().inputs)
        ) or sum(1 for o in graph.outputs if "present" in (o.name or "").lower())
        facts["kv_cache_outputs"] = n_present
        float_outs = [
            _shape_list(o.shape) or []
            for o in graph.outputs
            if o.dtype is not None and o.dtype.is_floating_point() and o not in graph_inputs
        ]

        def last(dims):
            return dims[-1] if dims and isinstance(dims[-1], int) else None

        task = "unknown"
        if n_present or any(
            len(d) == 3 and last(d) is not None and (last(d) == vocab or last(d) >= 8000) for d in float_outs
        ):
            task = "text-generation"
        elif head.pooling in ("cls", "mean", "last") and any(
            len(d) == 2 and last(d) is not None and last(d) <= 1000 and last(d) != hidden for d in float_outs
        ):
            task = "text-classification"
        elif hidden is not None and any(len(d) in (2, 3) and last(d) == hidden for d in float_outs):
            task = "feature-extraction"

        decoder = bool(past_inputs or n_present or causal or task == "text-generation")
        # family
        names = " ".join(list(graph.initializers)[:400]).lower()
        meta = " ".join(f"{k}={v}" for k, v in list(self.model.metadata_props.items())[:20]).lower()
        hint_text = names + " " + meta
        name_hint = None
        for fam, pattern in (
            ("mpnet", r"\bmpnet\.|relative_attention_bias"),
            ("roberta", r"\broberta\."),
            ("bert", r"\bbert\."),
            ("qwen2", r"qwen"),
            ("llama", r"llama"),
        ):
            if re.search(pattern, hint_text):
                name_hint = fam
                break
        family = "unknown"
        norm, act = facts.get("norm"), facts.get("activation")
        if facts.get("rotary") and norm == "rmsnorm" and act == "silu":
            if biased >= 3 and biased < facts["matmuls_per_layer"]:
                family = "qwen2"
                reasons.append("RMSNorm + rotary + SiLU-gated MLP with biased q/k/v projections (Qwen2-like)")
            else:
                family = "llama"
                reasons.append("RMSNorm + rotary + SiLU-gated MLP, no projection biases (Llama-like)")
        elif norm == "layernorm" and not decoder:
            if facts["relative_position_bias"]:
                family = "mpnet"
                reasons.append(
                    "LayerNorm encoder with a relative-position bias computed from the inputs (MPNet-like)"
                )
            elif facts["cumsum_positions"]:
                family = "roberta"
                reasons.append("LayerNorm encoder with position ids from CumSum over the mask (RoBERTa-like)")
            elif token_type or facts["embedding_gathers"] >= 3:
                family = "bert"
                reasons.append(
                    f"LayerNorm encoder with {facts['embedding_gathers']} embedding gathers incl. token types (BERT-like)"
                )
            else:
                family = "encoder"
                reasons.append("LayerNorm encoder")
        elif decoder:
            family = "decoder"
            reasons.append("causal decoder")
        elif layers_nodes:
            family = "encoder"
            reasons.append("stack of blocks without a causal mask or KV cache")
        else:
            reasons.append("no layer structure and no transformer signature (normalisation + attention)")
        if name_hint is not None:
            if (
                family in ("encoder", "decoder", "unknown")
                or (family in ("bert", "roberta", "mpnet") and name_hint in ("bert", "roberta", "mpnet"))
                or (family in ("llama", "qwen2") and name_hint in ("llama", "qwen2"))
            ):
                if name_hint != family:
                    reasons.append(f"weight names say {name_hint!r}")
                    family = name_hint
                else:
                    reasons.append("weight names agree")
        detail = ", ".join(
            f"{k}={v}" for k, v in facts.items() if v not in (None, False, 0) and k not in ("hidden",)
        )
        reason = "; ".join(reasons) + (f" [{detail}]" if detail else "")
        return family, reason, task, facts

    # -- driver ---------------------------------------------------------------------------------------------
    def run(self) -> ModelStructure:
        t0 = time.perf_counter()
        graph = self.graph
        order = self._topological_order()
        self._classify(order)
        op_hist = collections.Counter(
            n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}::{n.op_type}"
            for n in graph.all_nodes()
        )
        param_count = 0
        for v in graph.initializers.values():
            t = v.const_value
            if t is not None and t.dtype.is_floating_point() and t.size > 1:  # scalars are not parameters
                param_count += t.size
        for n in graph.all_nodes():
            t = _constant_node_tensor(n)
            if t is not None and t.dtype.is_floating_point() and t.size >= self.threshold:
                param_count += t.size
        structure = ModelStructure(
            inputs=[_io_entry(v) for v in graph.inputs if not v.is_initializer()],
            outputs=[_io_entry(v) for v in graph.outputs],
            op_histogram=dict(op_hist.most_common()),
            param_count=int(param_count),
            num_nodes=len(order),
        )
        start_value = self._start_value(order)
        if start_value is not None:
            # a model fed with activations (inputs_embeds, a feature tensor): that input carries the hidden
            # state, so it is tainted like a computed one and is the cut before the first node
            self._classify(order, seeds=[start_value])
        candidates = self._sweep(order)
        structure.candidate_cuts = [v.name for _, v in candidates]
        logger.debug(
            "%d nodes, %d heavy, %d compute, %d cut candidates",
            len(order),
            len(self.heavy_nodes),
            len(self.tainted_nodes),
            len(candidates),
        )

        segments = [
            self._segment(order, candidates[j][0] + 1, candidates[j + 1][0])
            for j in range(len(candidates) - 1)
        ]
        found = self._find_period(segments)
        layers: list[LayerInfo] = []
        layers_nodes: list[list[ir.Node]] = []
        head_boundary, head_cut = -1, None
        if found is not None:
            offset, period, reps = found
            offset, reps = self._extend(segments, offset, period, reps)
            structure.segments_per_layer = period
            cut_values = []
            for k in range(reps + 1):
                cand_index = offset + k * period
                cut_values.append(candidates[cand_index])
            types = self._value_types(v for _, v in cut_values)
            for k, (pos, v) in enumerate(cut_values):
                dtype, shape = types[v.name]
                producer = v.producer()
                structure.cuts.append(
                    CutTensor(v.name, dtype, shape, k, _node_label(producer, pos) if producer else "")
                )
            for k in range(reps):
                start = candidates[offset + k * period][0] + 1
                stop = candidates[offset + (k + 1) * period][0]
                nodes = [(i, order[i]) for i in range(start, stop + 1) if order[i] in self.tainted_nodes]
                layers_nodes.append([n for _, n in nodes])
                inner = tuple(candidates[offset + k * period + j][1].name for j in range(1, period))
                params = 0
                seen: set[ir.Value] = set()
                for _, n in nodes:
                    for w in self.inputs_of[n]:
                        t = w.const_value
                        if t is not None and w not in seen and t.dtype.is_floating_point() and t.size > 1:
                            seen.add(w)
                            params += t.size
                layers.append(
                    LayerInfo(
                        index=k + 1,
                        first_node=_node_label(nodes[0][1], nodes[0][0]) if nodes else "",
                        last_node=_node_label(nodes[-1][1], nodes[-1][0]) if nodes else "",
                        num_nodes=len(nodes),
                        input_cut=cut_values[k][1].name,
                        output_cut=cut_values[k + 1][1].name,
                        inner_cuts=inner,
                        param_count=params,
                        node_names=tuple(_node_label(n, i) for i, n in nodes),
                    )
                )
            structure.layers = layers
            first_boundary = candidates[offset][0]
            structure.embedding_nodes = [
                _node_label(order[i], i) for i in range(first_boundary + 1) if order[i] in self.tainted_nodes
            ]
            head_boundary, head_cut = cut_values[-1]
            prefix_nodes = [order[i] for i in range(first_boundary + 1)]
            structure.message = (
                f"found {reps} repeated layers ({period} segment{'s' if period > 1 else ''} between cut tensors per layer,"
                f" {layers[0].num_nodes} compute nodes per layer)"
            )
        else:
            prefix_nodes = order
            structure.message = self._explain_no_layers(order, candidates, segments)
        structure.head = (
            self._head(order, head_boundary, head_cut)
            if found is not None
            else HeadInfo("none", [], "no layer output to follow")
        )
        family, reason, task, _ = self._family(
            order, layers_nodes, prefix_nodes, structure.head, structure.hidden_size
        )
        structure.family, structure.family_reason, structure.task = family, reason, task
        structure.analysis_seconds = time.perf_counter() - t0
        logger.info("analysis: %s (%.3f s)", structure.message, structure.analysis_seconds)
        return structure

    def _start_value(self, order: list[ir.Node]) -> ir.Value | None:
        """The single floating-point graph input that feeds compute nodes other than Concat (past KV), if any."""
        found = []
        for v in self.graph.inputs:
            if v in self.const or v.dtype is None or not v.dtype.is_floating_point():
                continue
            users = [u.node for u in v.uses() if u.node in self.tainted_nodes]
            if any(n.op_type != "Concat" for n in users):
                found.append(v)
        return found[0] if len(found) == 1 else None

    def _explain_no_layers(self, order, candidates, segments) -> str:
        return "no repeated layer structure found: " + self._why_no_layers(order, candidates, segments)

    def _why_no_layers(self, order, candidates, segments) -> str:
        if not order:
            return "the graph has no nodes."
        if not self.heavy_nodes:
            return (
                f"no node reads a weight (a constant with >= {self.threshold:,} elements), so there is nothing to"
                " split into layers (for a toy model, pass a smaller weight_min_elements)."
            )
        if len(candidates) < 3:
            return (
                f"only {len(candidates)} cut tensor(s) were found (a tensor that alone, with the graph inputs,"
                " separates the computation before it from the computation after it); a stack of layers needs at"
                " least one per layer boundary."
            )
        return (
            f"{len(candidates)} cut tensors delimit {len(segments)} segments, but no block of segments that reads"
            " weights repeats (the segments' op types and weight shapes differ)."
        )


def _compress(parts: list[str], limit: int = 12) -> list[str]:
    """Collapse runs of the same op (``Mul x3``) and cap the length."""
    out: list[str] = []
    for p in parts:
        if out and (out[-1] == p or out[-1].startswith(p + " x")):
            if out[-1] == p:
                out[-1] = f"{p} x2"
            else:
                n = int(out[-1].rsplit("x", 1)[1]) + 1
                out[-1] = f"{p} x{n}"
        else:
            out.append(p)
    if len(out) > limit:
        out = [*out[: limit // 2], f"... ({len(out) - limit} more)", *out[-(limit // 2) :]]
    return out


def analyze_model(model: ir.Model, *, weight_min_elements: int = WEIGHT_MIN_ELEMENTS) -> ModelStructure:
    """Find the repeated layers of ``model`` and the cut tensors between them.

    Args:
        model: an exported model; it is not modified (shape inference, when needed, runs on a clone).
        weight_min_elements: constants with at least this many elements count as weights.

    Returns:
        A :class:`ModelStructure`; ``has_layers`` is False (with an explanation in ``message``) when no
        repeated structure is found.
    """
    return _Analyzer(model, weight_min_elements).run()


# ------------------------------------------------------------------------------------------------ report


def _fmt_shape(shape: Sequence[int | str]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _group_io(entries: Sequence[tuple[str, str, Sequence[int | str]]], limit: int = 12) -> list[str]:
    """One line per input/output; names that differ only by numbers with the same type are grouped."""
    groups: dict[tuple, list[str]] = {}
    for name, dtype, shape in entries:
        key = (re.sub(r"\d+", "#", name), dtype, tuple(str(d) for d in shape))
        groups.setdefault(key, []).append(name)
    lines = []
    for (_, dtype, _), names in groups.items():
        shape = next(e[2] for e in entries if e[0] == names[0])
        label = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)} tensors)"
        lines.append(f"{label}: {dtype} {_fmt_shape(shape)}")
    if len(lines) > limit:
        lines = [*lines[:limit], f"... and {len(lines) - limit} more"]
    return lines


def _fmt_count(n: int) -> str:
    if n >= 1_000_000:
        return f"{n / 1e6:.1f}M"
    if n >= 1_000:
        return f"{n / 1e3:.1f}k"
    return str(n)


def format_report(s: ModelStructure, *, top_ops: int = 12, max_layers: int = 64) -> str:
    """A human-readable structure report (for ``dyncompile inspect``)."""
    lines: list[str] = []
    lines.append(f"Nodes: {s.num_nodes}    parameters: {s.param_count:,} ({_fmt_count(s.param_count)})")
    for title, entries in (("Inputs", s.inputs), ("Outputs", s.outputs)):
        lines.append(f"{title} ({len(entries)}):")
        lines.extend(f"  {text}" for text in _group_io(entries))
    ops = list(s.op_histogram.items())
    top = ", ".join(f"{op} {n}" for op, n in ops[:top_ops])
    rest = sum(n for _, n in ops[top_ops:])
    lines.append(
        f"Op histogram (top {min(top_ops, len(ops))} of {len(ops)} op types): {top}"
        + (f", other {rest}" if rest else "")
    )
    lines.append(f"Family guess: {s.family} ({s.family_reason})")
    lines.append(f"Task guess: {s.task}")
    if not s.has_layers:
        lines.append("Layers: none found (" + s.message + ")")
        if s.candidate_cuts:
            lines.append(
                f"  cut tensors found: {len(s.candidate_cuts)} ({', '.join(s.candidate_cuts[:8])}{', ...' if len(s.candidate_cuts) > 8 else ''})"
            )
        return "\n".join(lines)
    lines.append(f"Layers: {s.num_layers} found ({s.message})")
    if s.embedding_nodes:
        lines.append(
            f"  embeddings: {len(s.embedding_nodes)} compute nodes ({s.embedding_nodes[0]} .. {s.embedding_nodes[-1]})"
        )
    for layer in s.layers[:max_layers]:
        inner = f", inner cuts {', '.join(layer.inner_cuts)}" if layer.inner_cuts else ""
        lines.append(
            f"  layer {layer.index:>3}: {layer.num_nodes} nodes, {_fmt_count(layer.param_count)} params,"
            f" {layer.first_node} .. {layer.last_node}{inner}"
        )
    if len(s.layers) > max_layers:
        lines.append(f"  ... {len(s.layers) - max_layers} more layers")
    lines.append(f"Cut tensors (after layer k; 0 = after embeddings): {len(s.cuts)}")
    for cut in s.cuts:
        lines.append(f"  after layer {cut.after_layer:>3}: {cut.name}  {cut.dtype} {_fmt_shape(cut.shape)}")
    lines.append(f"Head: pooling={s.head.pooling}; {len(s.head.nodes)} compute nodes: {s.head.description}")
    return "\n".join(lines)
