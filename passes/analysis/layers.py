"""Graph analysis: the repeated blocks (transformer layers) of an exported model and the cuts between them.

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

The other modules of this package hold the passengers: :mod:`.head` (what follows the last layer),
:mod:`.family` (family and task guess, a signature table), :mod:`.report` (``dyncompile inspect`` text);
:mod:`.structure` holds the result types.

Sketch: ``analyze_model(model) -> ModelStructure(layers=[LayerInfo...], cuts=[CutTensor(after_layer=0..L)])``.
Cost: O(nodes + edges) for the sweep, O(segments^2) for the period search: ~10 ms for MiniLM (313 nodes),
~40 ms for SmolLM2 with KV cache (2,245 nodes).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Iterable, Sequence

import networkx as nx
import onnx_ir as ir

from dyncompile.passes._graph import constant_node_tensor
from dyncompile.passes.analysis._values import (
    NONDETERMINISTIC_OPS,
    SHAPE_ONLY_OPS,
    dtype_str,
    io_entry,
    node_inputs,
    node_label,
    shape_list,
    shape_tuple,
    static_numel,
    subgraphs,
)
from dyncompile.passes.analysis.family import guess_family
from dyncompile.passes.analysis.head import describe_head
from dyncompile.passes.analysis.structure import CutTensor, HeadInfo, LayerInfo, ModelStructure

__all__ = ["WEIGHT_MIN_ELEMENTS", "analyze_model"]

logger = logging.getLogger(__name__)

#: A constant with at least this many elements is a weight; a node reading one is "heavy".
WEIGHT_MIN_ELEMENTS = 65_536

#: longest repeating unit considered, in segments between cut tensors (BERT: 4, Llama: 2)
_MAX_SEGMENTS_PER_LAYER = 256


# ------------------------------------------------------------------------------------------- the analysis


@dataclasses.dataclass
class _Segment:
    start: int  # first node index (inclusive)
    stop: int  # last node index (inclusive)
    signature: tuple
    heavy_signature: tuple
    has_heavy: bool


class _Analyzer:
    """One analysis of one model.

    Classify values, sweep for cut tensors, find the period, then hand the result to the head and family
    passengers.

    :meth:`run` is the only entry point; it fills these attributes on the way, which :mod:`.head` and
    :mod:`.family` read (the model itself is never mutated):

    * ``inputs_of``: node -> explicit inputs plus outer values captured by its subgraphs;
    * ``const`` / ``big``: constant values / constants with at least ``threshold`` elements (weights);
    * ``tainted`` / ``tainted_nodes``: values and nodes that carry the hidden state;
    * ``heavy_nodes``: nodes that read a weight; ``const_nodes``: nodes computed from constants only;
    * ``last_use``: value -> index of its last consumer in the order.
    """

    def __init__(self, model: ir.Model, weight_min_elements: int):
        self.model = model
        self.graph = model.graph
        self.threshold = weight_min_elements

    # -- order ------------------------------------------------------------------------------------------
    def _topological_order(self) -> list[ir.Node]:
        nodes = list(self.graph)
        index = {n: i for i, n in enumerate(nodes)}
        self.inputs_of: dict[ir.Node, list[ir.Value]] = {n: node_inputs(n) for n in nodes}
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
                size = v.const_value.size if v.const_value is not None else static_numel(v)
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
                and node.op_type not in NONDETERMINISTIC_OPS
                and (ins or node.op_type == "Constant")
                and not subgraphs(node)
            )
            if is_const:
                const_nodes.add(node)
                const.update(node.outputs)
                tensor = constant_node_tensor(node)
                for out in node.outputs:
                    if tensor is not None:
                        size = tensor.size
                    else:
                        size = static_numel(out)
                        if size is None:
                            size = threshold if (reads_big and node.op_type not in SHAPE_ONLY_OPS) else 0
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
                        weights.append((op, shape_tuple(v)))
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
            shape = shape_list(v.shape)
            if v.dtype is None or shape is None:
                missing.append(v.name)
            result[v.name] = (dtype_str(v.dtype), shape if shape is not None else [])
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
                        result[name] = (dtype_str(w.dtype), shape_list(w.shape) or [])
            except Exception as e:  # noqa: BLE001 - best effort, types are informative only
                logger.warning("shape inference for cut tensors failed: %s", e)
        return result

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
            t = constant_node_tensor(n)
            if t is not None and t.dtype.is_floating_point() and t.size >= self.threshold:
                param_count += t.size
        structure = ModelStructure(
            inputs=[io_entry(v) for v in graph.inputs if not v.is_initializer()],
            outputs=[io_entry(v) for v in graph.outputs],
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
                    CutTensor(v.name, dtype, shape, k, node_label(producer, pos) if producer else "")
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
                        first_node=node_label(nodes[0][1], nodes[0][0]) if nodes else "",
                        last_node=node_label(nodes[-1][1], nodes[-1][0]) if nodes else "",
                        num_nodes=len(nodes),
                        input_cut=cut_values[k][1].name,
                        output_cut=cut_values[k + 1][1].name,
                        inner_cuts=inner,
                        param_count=params,
                        node_names=tuple(node_label(n, i) for i, n in nodes),
                    )
                )
            structure.layers = layers
            first_boundary = candidates[offset][0]
            structure.embedding_nodes = [
                node_label(order[i], i) for i in range(first_boundary + 1) if order[i] in self.tainted_nodes
            ]
            head_boundary, head_cut = cut_values[-1]
            prefix_nodes = [order[i] for i in range(first_boundary + 1)]
            structure.message = (
                f"found {reps} repeated layers ({period} segment{'s' if period > 1 else ''} between cut tensors per layer,"
                f" {layers[0].num_nodes} compute nodes per layer)"
            )
        else:
            prefix_nodes = order
            structure.message = "no repeated layer structure found: " + self._why_no_layers(
                order, candidates, segments
            )
        structure.head = (
            describe_head(self, order, head_boundary, head_cut)
            if found is not None
            else HeadInfo("none", [], "no layer output to follow")
        )
        family, reason, task = guess_family(
            self, order, layers_nodes, prefix_nodes, structure.head, structure.hidden_size
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
