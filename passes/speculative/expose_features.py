"""``expose-features``: make the target's top-layer features an extra graph output, at no extra compute.

EAGLE drafters read the target's *feature* of every verified position: here, precisely, the residual
stream after the last decoder layer — the tensor that enters the final norm (``logits = lm_head(norm(f))``),
``[batch, seq, hidden]``. It is already computed on every call; this pass only names it ``features`` and
lists it among the graph outputs.

Scope: the main graph's output list and the name of that one value; no node or initializer is added,
removed or changed. Invariants: every original output is the same value (bit-identical results); the node
count is unchanged; the value is found by :func:`dyncompile.passes.analysis.analyze_model` (the cut after
the last layer), so a graph without a recognisable layer stack is refused. Idempotent: a graph that
already has the ``features`` output reports ``modified=False``.

Fused features (EAGLE-3 heads, ``taps=`` + ``fuse=``): ``features`` is instead a trained projection of several
layers' outputs, ``Concat([h_a, h_b, h_c], -1) @ fuse^T`` (``[batch, seq, hidden]`` again), computed in the
target's call: two nodes and one initializer (``3H x H``) are added; the original outputs are still the same
values, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from dyncompile.passes import _keys
from dyncompile.passes._infra import CompileContext, register_pass
from dyncompile.passes.speculative.decoder_spec import DrafterError

__all__ = ["FEATURES_OUTPUT", "ExposeFeaturesPass", "find_features", "layer_structure"]

FEATURES_OUTPUT = "features"


def layer_structure(model: ir.Model, what: str):
    """:func:`~dyncompile.passes.analysis.analyze_model` of ``model``, refused (for ``what``) without a layer stack."""
    from dyncompile.passes.analysis.layers import analyze_model  # networkx: loaded when used

    s = analyze_model(model)
    if not s.has_layers:
        raise DrafterError(f"{what} needs a layered decoder; no repeated layer structure was found: {s.message}")
    return s


def find_features(model: ir.Model) -> ir.Value:
    """The value entering the final norm (the last decoder layer's output)."""
    existing = next((v for v in model.graph.outputs if v.name == FEATURES_OUTPUT), None)
    if existing is not None:
        return existing
    s = layer_structure(model, "expose-features")
    name = s.cut_for_layer(s.num_layers).name
    values = ir.convenience.create_value_mapping(model.graph)
    return values[name]


class ExposeFeaturesPass(ir.passes.InPlacePass):
    """Add the last decoder layer's output (the final norm's input) as graph output ``features``.

    Sketch: ``f = layers(x); logits = head(norm(f))`` -> outputs ``logits, present..., features=f``.
    """

    def __init__(self, taps: Sequence[int] = (), fuse: np.ndarray | None = None) -> None:
        super().__init__()
        if bool(taps) != (fuse is not None):
            raise DrafterError("fused features need both the layer taps and the fuse weight")
        self.taps = tuple(int(t) for t in taps)
        self.fuse = None if fuse is None else np.asarray(fuse, np.float32)
        if self.fuse is not None and (self.fuse.ndim != 2 or self.fuse.shape[1] != len(self.taps) * self.fuse.shape[0]):
            raise DrafterError(f"the fuse weight is {list(self.fuse.shape)}; expected [hidden, {len(self.taps)} * hidden]")

    def __repr__(self) -> str:
        return f"ExposeFeaturesPass(taps={list(self.taps)})" if self.taps else "ExposeFeaturesPass()"

    def requires(self, model: ir.Model) -> None:
        """Refuse a model the pass cannot work on, with what to do about it."""
        names = {v.name for v in model.graph.outputs}
        if FEATURES_OUTPUT in names:
            return
        taken = {v.name for v in model.graph.inputs} | set(model.graph.initializers)
        if FEATURES_OUTPUT in taken:
            raise DrafterError(f"the graph already has an input or initializer named {FEATURES_OUTPUT!r}")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Run the rewrite on ``model`` (scope and invariants: the class docstring)."""
        g = model.graph
        if any(v.name == FEATURES_OUTPUT for v in g.outputs):
            return ir.passes.PassResult(model, modified=False)
        v = self._fused(model) if self.taps else find_features(model)
        if v.is_graph_output():  # already an output under another name: renaming it would change the interface
            raise DrafterError(f"the last layer's output {v.name!r} is already a graph output; cannot rename it")
        v.name = FEATURES_OUTPUT
        g.outputs.append(v)
        model.metadata_props[_keys.EAGLE_FEATURES] = FEATURES_OUTPUT
        return ir.passes.PassResult(model, modified=True)

    def _fused(self, model: ir.Model) -> ir.Value:
        """``Concat(cuts after the tap layers) @ fuse^T``, appended at the graph's end."""
        s = layer_structure(model, "expose-features with fused taps")
        if max(self.taps) >= s.num_layers or min(self.taps) < 1:
            raise DrafterError(f"feature taps {list(self.taps)} do not fit this {s.num_layers}-layer target: the head "
                               "was trained for another model")
        values = ir.convenience.create_value_mapping(model.graph)
        cuts = [values[s.cut_for_layer(k).name] for k in self.taps]
        hidden = self.fuse.shape[0]
        for c in cuts:
            if c.shape is None or c.shape[-1] != hidden:
                raise DrafterError(f"the fuse weight is for hidden size {hidden}; the target's layer output "
                                   f"{c.name!r} has shape {c.shape}")
        g = model.graph
        w = ir.val("eagle.fuse.weight", const_value=ir.tensor(np.ascontiguousarray(self.fuse.T), name="eagle.fuse.weight"))
        g.register_initializer(w)
        cat = ir.node("Concat", cuts, attributes={"axis": -1}, name="eagle.fuse.concat")
        mm = ir.node("MatMul", [cat.outputs[0], w], name="eagle.fuse.matmul")
        cat.outputs[0].name = "eagle.fuse.concat_out"
        cat.outputs[0].dtype = mm.outputs[0].dtype = ir.DataType.FLOAT
        cat.outputs[0].shape = ir.Shape([*cuts[0].shape[:-1], len(cuts) * hidden])
        mm.outputs[0].shape = ir.Shape([*cuts[0].shape[:-1], hidden])
        g.extend([cat, mm])  # at the end: after every tap, also when a later pass re-creates a tap's producer
        return mm.outputs[0]

    def ensures(self, model: ir.Model) -> None:
        """Check what the pass promises on its output."""
        if not any(v.name == FEATURES_OUTPUT for v in model.graph.outputs):
            raise ir.passes.PostconditionError("no features output")


@register_pass(
    "expose-features",
    help="add the target's top-layer features (the final norm's input) as graph output 'features' (no compute); "
    "what EAGLE drafters read",
)
def _make_expose_features(context: CompileContext):
    del context
    return ExposeFeaturesPass()
