"""``AttachExitHeadsPass``: attach already-fitted exit heads with given thresholds, and the metadata they carry.

:func:`attach_exit_heads` is the one writer of the ``dyncompile.early_exit`` metadata for fitted heads
(:class:`~dyncompile.passes.early_exit.fit_exit_heads.FitExitHeadsPass` calls it after fitting and
calibrating); :class:`~dyncompile.passes.early_exit.insert_early_exit.InsertEarlyExitPass` reads it.
"""

from __future__ import annotations

import json
from typing import Any

import onnx_ir as ir

from dyncompile.passes import _keys
from dyncompile.passes._graph import default_opset
from dyncompile.passes.early_exit.graph import GraphBuilder
from dyncompile.passes.early_exit.heads import ExitHead

__all__ = ["EARLY_EXIT_FORMAT", "AttachExitHeadsPass", "attach_exit_heads"]

EARLY_EXIT_FORMAT = "dyncompile.early_exit/v1"


def attach_exit_heads(
    model: ir.Model,
    *,
    heads: dict[int, ExitHead],
    cuts: dict[int, str],
    thresholds: dict[int, float | None],
    num_layers: int,
    criterion: str = "entropy",
    patience: int = 2,
    extra: dict[str, Any] | None = None,
    policies: dict[int, dict[str, Any]] | None = None,
) -> None:
    """Add ``exit_logits_<k>`` head outputs after the cut tensors and record the early-exit metadata.

    ``thresholds[k] is None`` means exit ``k`` never fires (kept for patience windows / fidelity checks).
    ``policies`` (criterion ``learned``): per exit ``{"weights", "bias", "prev_head"}``
    (:func:`dyncompile.passes.early_exit.certify.policy_metadata`), written into the exit's entry.
    """
    if criterion == "learned" and (policies is None or set(policies) != set(heads)):
        raise ir.passes.PreconditionError("criterion 'learned' needs a policy for every exit head (policies=...)")
    g = model.graph
    outs = [v for v in g.outputs if not v.name.startswith("exit_logits_")]
    final = outs[0]
    values = ir.convenience.create_value_mapping(g)
    mask = next((v for v in g.inputs if v.name == "attention_mask"), None)
    opset = default_opset(model)
    for k in sorted(heads):
        if cuts[k] not in values:
            raise ir.passes.PreconditionError(f"cut tensor {cuts[k]!r} for the exit after layer {k} is not in the graph")
    # the mask-derived rows every head reads, once, at the top of the graph (the If lowering computes them
    # before the first exit; a staged segment recomputes them from its attention_mask input)
    shared = GraphBuilder(opset, "exit.")
    parts = shared.mask_parts(mask, [h.pooling for h in heads.values()]) if heads else None
    if shared.tape.nodes:
        for init in shared.initializers:
            g.register_initializer(init)
        g.insert_before(g.node(0), shared.tape.nodes)
    for k in sorted(heads):
        b = GraphBuilder(opset, f"exit{k}.")
        hidden = values[cuts[k]]
        logits = b.head(heads[k], hidden, parts)
        logits.name = f"exit_logits_{k}"
        logits.dtype = ir.DataType.FLOAT
        logits.shape = ir.Shape([final.shape[0], final.shape[1]])
        for init in b.initializers:
            g.register_initializer(init)
        g.insert_after(hidden.producer(), b.tape.nodes)
        g.outputs.append(logits)
    meta = {
        "format": EARLY_EXIT_FORMAT,
        "num_layers": int(num_layers),
        "criterion": criterion,
        "patience": int(patience),
        "final_output": final.name,
        "exits": [
            {"layer": k, "cut": cuts[k], "head_output": f"exit_logits_{k}", "threshold": thresholds[k]}
            | ({"policy": policies[k]} if policies else {})
            for k in sorted(heads)
        ],
        **(extra or {}),
    }
    model.metadata_props[_keys.EARLY_EXIT] = json.dumps(meta)



class AttachExitHeadsPass(ir.passes.InPlacePass):
    """Attach already-fitted exit heads with given thresholds (no calibration data needed).

    Scope: main graph of an encoder classifier (one ``[batch, classes]`` output besides any
    ``exit_logits_*``).

    For heads fitted elsewhere (or one fit re-lowered at several thresholds). Same output as
    :class:`~dyncompile.passes.early_exit.fit_exit_heads.FitExitHeadsPass`: for every exit ``k`` in
    ``heads`` the head's nodes after the cut tensor ``cuts[k]`` and an extra graph output
    ``exit_logits_<k>``, plus the ``dyncompile.early_exit`` metadata (``thresholds[k] is None``: exit ``k``
    never fires) that :class:`~dyncompile.passes.early_exit.insert_early_exit.InsertEarlyExitPass` lowers.

    Invariants: the original outputs and nodes are unchanged. Idempotent: a model that already carries
    the metadata is left alone (``modified=False``).

    Sketch: ``h_k = layer_k(...)  ->  exit_logits_k = head_k(pool(h_k, mask))`` (extra output).
    """

    def __init__(self, heads, cuts, thresholds, num_layers: int, criterion: str = "entropy", patience: int = 2, extra=None,
                 policies=None):
        super().__init__()
        self.heads, self.cuts, self.thresholds = dict(heads), dict(cuts), dict(thresholds)
        self.num_layers, self.criterion, self.patience = int(num_layers), criterion, int(patience)
        self.extra = dict(extra or {})
        self.policies = None if policies is None else dict(policies)

    def __repr__(self) -> str:
        return f"AttachExitHeadsPass(exits={sorted(self.heads)}, criterion={self.criterion!r})"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Run the rewrite on ``model`` (scope and invariants: the class docstring)."""
        if _keys.EARLY_EXIT in model.metadata_props:
            return ir.passes.PassResult(model, modified=False)
        attach_exit_heads(
            model, heads=self.heads, cuts=self.cuts, thresholds=self.thresholds, num_layers=self.num_layers,
            criterion=self.criterion, patience=self.patience, extra=self.extra, policies=self.policies,
        )
        return ir.passes.PassResult(model, modified=True)
