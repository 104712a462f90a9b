"""``tabulate-length-values``: what an encoder computes from its sequence length alone -> a slice of a table.

MPNet (like T5 and DeBERTa) computes a relative-position bias on every call: the ``[S, S]`` matrix of relative
positions, their log-spaced buckets and the gather of each head's bias for them — about 25 small kernels a row
(``Range``, ``Sub``, ``Abs``, ``Log``, ``Div``, ``Where``, ``Gather``, ...) whose inputs are the shapes of the
inputs, never their values. Computed once at compile time for the longest sequence the plan's tokenizer gives, the
value at length ``S`` is the table's leading ``S x S`` block: one ``Slice``. Longer inputs still run the original
kernels, so every length keeps working.

* Scope: the main graph of a text encoder whose inputs are all ``[batch, sequence]``. A value is *length-only*
  when it is computed, without subgraphs, from constants and ``Shape`` of the graph inputs. It is tabulated when
  (checked by running the length-only part in ONNX Runtime at lengths ``max_length``, 3 and 11 — 2 and
  ``max_length - 1`` below 12 — and batch 1 and 2)
  it does not depend on the batch size, its value at a length ``S`` is the table's leading block on the axes that
  have length ``S``, it is not read by another value that qualifies, and at least ``min_nodes`` kernels compute
  it alone.
* Rewrite: ``If(S <= max_length, then: Slice(table, 0, S), else: the original kernels)``, the kernels moved into
  the ``else`` branch; ``S`` is read with one ``Shape`` of an input. The table is an initializer (MPNet-base at
  64 tokens: 12 x 64 x 64 floats, 197 KB).
* Invariants: graph inputs/outputs unchanged; outputs bit-identical for every length (both branches tested on
  the real MPNet in ORT with ``ORT_DISABLE_ALL`` and with every optimization). Idempotent: the tabulated value
  is an ``If``'s output, not length-only, so a second run finds nothing (``modified=False``). A graph without
  such a computation (BERT and MiniLM read a position-id constant) is left alone with a message saying why.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from dyncompile.passes._graph import _subgraphs, add_initializer, extract_model
from dyncompile.passes._infra import not_fired, register_pass

logger = logging.getLogger(__name__)

__all__ = ["TabulateLengthValuesPass"]

#: the lengths (besides max_length) the length-only part is run at to check the rule, at batch 1 and 2
_PROBE_LENGTHS = (3, 11)


def probe_lengths(max_length: int) -> tuple[int, ...]:
    """Two lengths below ``max_length`` to check the rule at (:data:`_PROBE_LENGTHS` when they fit); ``()`` below 4."""
    if max_length > max(_PROBE_LENGTHS):
        return _PROBE_LENGTHS
    return (2, max_length - 1) if max_length >= 4 else ()


_NONDETERMINISTIC = frozenset({"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
                               "Multinomial", "Bernoulli", "Dropout"})


def _length_only(graph: ir.Graph) -> tuple[list[ir.Node], set[ir.Value]]:
    """The length-only nodes of ``graph`` (topological order) and their outputs."""
    inputs = set(graph.inputs)
    values: set[ir.Value] = set()
    nodes: list[ir.Node] = []
    for node in graph:
        if node.op_type in _NONDETERMINISTIC or any(True for _ in _subgraphs(node)) or not node.outputs:
            continue
        if node.op_type == "Shape" and node.domain in ("", "ai.onnx") and node.inputs[0] in inputs:
            ok = True
        else:
            present = [v for v in node.inputs if v is not None]
            ok = bool(present) and any(v in values for v in present) and all(
                v in values or v.const_value is not None or (v.producer() is not None and v.producer().op_type
                                                              == "Constant") for v in present)
        if ok:
            nodes.append(node)
            values.update(node.outputs)
    return nodes, values


class TabulateLengthValuesPass(ir.passes.InPlacePass):
    """Values computed from the sequence length alone -> ``Slice`` of a table (module docstring)."""

    def __init__(self, max_length: int = 128, min_nodes: int = 8) -> None:
        super().__init__()
        if int(max_length) < 1:
            raise ValueError(f"tabulate-length-values: max_length must be a positive length, not {max_length}")
        self.max_length = int(max_length)
        self.min_nodes = int(min_nodes)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(max_length={self.max_length}, min_nodes={self.min_nodes})"

    def _qualifying(self, model: ir.Model, candidates: list[ir.Value]) -> dict[ir.Value, tuple[np.ndarray, list[int]]]:
        """``{value: (table, sliced axes)}`` for the candidates that follow the rule (module docstring)."""
        import onnxruntime as ort

        names = [v.name for v in candidates]
        part = extract_model(model, [v.name for v in model.graph.inputs], names, "length_only")
        so = ort.SessionOptions()
        so.log_severity_level = 3
        sess = ort.InferenceSession(ir.to_proto(part).SerializeToString(), so, providers=["CPUExecutionProvider"])

        def run(batch: int, length: int) -> dict[str, np.ndarray]:
            feeds = {v.name: np.zeros((batch, length), v.dtype.numpy()) for v in part.graph.inputs}
            return dict(zip(names, sess.run(names, feeds), strict=True))

        table = run(1, self.max_length)
        lengths = probe_lengths(self.max_length)
        probes = {(b, s): run(b, s) for s in lengths for b in (1, 2)}
        out = {}
        for v in candidates:
            t = table[v.name]
            axes = [i for i, d in enumerate(t.shape) if d == self.max_length]
            if t.ndim < 2 or not axes or t.dtype == object:
                continue
            good = True
            for s in lengths:
                one, two = probes[(1, s)][v.name], probes[(2, s)][v.name]
                block = t[tuple(slice(0, s) if i in axes else slice(None) for i in range(t.ndim))]
                if not (one.shape == two.shape == block.shape and np.array_equal(one, two)
                        and np.array_equal(one, block, equal_nan=True)):
                    good = False
                    break
            if good:
                out[v] = (t, axes)
        return out

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Tabulate the length-only values of ``model`` (scope, rule and invariants: the module docstring)."""
        g = model.graph
        if not probe_lengths(self.max_length):
            return not_fired(model, "tabulate-length-values",
                             f"max_length {self.max_length} leaves no two shorter lengths to check the rule at",
                             "give max_length >= 4")
        bad = [v.name for v in g.inputs if v.shape is None or len(v.shape) != 2 or v.dtype is None]
        if bad or not g.inputs:
            return not_fired(model, "tabulate-length-values",
                             f"the graph inputs are not all [batch, sequence] tensors ({', '.join(bad) or 'none'})",
                             "leave tabulate-length-values out for this model")
        nodes, values = _length_only(g)
        candidates = [v for n in nodes for v in n.outputs if v.name and not v.is_graph_output()]
        found = self._qualifying(model, candidates) if candidates else {}
        if not found:
            return not_fired(model, "tabulate-length-values",
                             "no tensor of rank >= 2 is computed from the input lengths alone",
                             "nothing to tabulate; leave the pass out")
        # the largest ones: those no other qualifying value reads
        chosen = [v for v in found if not any(o in found for u in v.uses() for o in u.node.outputs)]
        rewritten = 0
        for v in chosen:
            table, axes = found[v]
            chain = self._exclusive_chain(v, values)
            if len(chain) < self.min_nodes:
                logger.info("tabulate-length-values: %s is computed by %d kernels alone (< %d): left as it is",
                            v.name, len(chain), self.min_nodes)
                continue
            self._rewrite(model, v, table, axes, chain)
            rewritten += 1
        if not rewritten:
            return not_fired(model, "tabulate-length-values",
                             f"no length-only value computed by >= {self.min_nodes} kernels alone follows the "
                             "rule (batch-free, its value at length S the table's leading block)",
                             "nothing to tabulate; leave the pass out")
        return ir.passes.PassResult(model, modified=True)

    @staticmethod
    def _exclusive_chain(v: ir.Value, values: set[ir.Value]) -> list[ir.Node]:
        """The length-only nodes that compute ``v`` and nothing another node reads, in topological order.

        Empty when ``v``'s own node has another output in use.
        """
        top = v.producer()
        if any(o is not v and (o.uses() or o.is_graph_output()) for o in top.outputs):
            return []
        chain: set[ir.Node] = set()
        stack = [top]
        while stack:
            n = stack.pop()
            if n not in chain:
                chain.add(n)
                stack += [i.producer() for i in n.inputs if i is not None and i in values]
        changed = True
        while changed:  # drop what is also read outside the chain, until stable
            changed = False
            for n in list(chain):
                if n is not top and any(o.is_graph_output() or any(u.node not in chain for u in o.uses())
                                        for o in n.outputs):
                    chain.discard(n)
                    changed = True
        order = {id(n): i for i, n in enumerate(top.graph)}
        return sorted(chain, key=lambda n: order[id(n)])

    def _rewrite(self, model: ir.Model, v: ir.Value, table: np.ndarray, axes: list[int], chain: list[ir.Node]) -> None:
        g = model.graph
        stem = f"tabulate_length.{v.name}"

        def const(name: str, arr: np.ndarray) -> ir.Value:
            return add_initializer(g, f"{stem}.{name}", arr)

        length = ir.node("Shape", [g.inputs[0]], attributes={"start": 1, "end": 2}, name=f"{stem}/length")
        cond = ir.node("LessOrEqual", [length.outputs[0], const("max_length", np.array([self.max_length], np.int64))],
                       name=f"{stem}/fits")
        ends = (ir.node("Concat", [length.outputs[0]] * len(axes), attributes={"axis": 0}, name=f"{stem}/ends")
                if len(axes) > 1 else None)
        sl = ir.node("Slice", [const("table", np.ascontiguousarray(table)),
                               const("starts", np.zeros(len(axes), np.int64)),
                               ends.outputs[0] if ends is not None else length.outputs[0],
                               const("axes", np.array(axes, np.int64))], name=f"{stem}/slice")
        vtype = ir.TensorType(ir.DataType.from_numpy(table.dtype))
        if v.type is None:
            v.type = vtype
        then_out = sl.outputs[0]
        then_out.name, then_out.type = f"{stem}.table_block", vtype
        for n in chain:
            g.remove(n)
        out = ir.Value(name=f"{stem}.value", type=v.type, shape=v.shape)
        head = [length, cond, *([ends] if ends is not None else [])]
        then_g = ir.Graph([], [then_out], nodes=[sl], name=f"{stem}.then")
        else_g = ir.Graph([], [v], nodes=chain, name=f"{stem}.else")  # the original kernels, v their output
        node = ir.Node("", "If", [cond.outputs[0]], attributes=[ir.AttrGraph("then_branch", then_g),
                                                               ir.AttrGraph("else_branch", else_g)],
                       outputs=[out], name=f"{stem}/if")
        users = [u for u in v.uses() if u.node.graph is g]
        order = {id(n): i for i, n in enumerate(g)}
        first_user = min((u.node for u in users), key=lambda n: order[id(n)])
        g.insert_before(first_user, [*head, node])
        for u in users:
            u.node.replace_input_with(u.idx, out)
        logger.info("tabulate-length-values: %s (%d kernels) -> a slice of a %s table below %d tokens",
                    v.name, len(chain), "x".join(map(str, table.shape)), self.max_length)


@register_pass(
    "tabulate-length-values",
    help="values an encoder computes from its sequence length alone (MPNet's relative-position bias: ~25 kernels "
    "a row) -> a slice of a table computed at compile time up to max_length (default: the model's); longer inputs "
    "run the original kernels; bit-identical",
    before=("early-exit", "quantize-int8", "quantize-int4"),
)
def _make_tabulate(context, max_length: int | None = None, min_nodes: int = 8) -> TabulateLengthValuesPass:
    n = max_length or int((context.model_config or {}).get("max_length") or 128)
    return TabulateLengthValuesPass(max_length=n, min_nodes=min_nodes)
