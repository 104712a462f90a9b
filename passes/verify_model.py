"""``verify``: check that a model is well formed, without changing it."""

from __future__ import annotations

import onnx_ir as ir

from dyncompile.passes._infra import check_model, register_pass

__all__ = ["VerifyModelPass"]


class VerifyModelPass(ir.passes.InPlacePass):
    """Check a model: ONNX checker (full check) plus the structural facts later passes rely on.

    Scope: the main graph, subgraphs and functions (through the ONNX checker); the structural checks
    look at the main graph.
    Invariants: never modifies the model; ``modified`` is always ``False``.
    Sketch: ``model -> model`` (raises :class:`onnx_ir.passes.PreconditionError` naming the culprit).
    """

    def __init__(self, full_check: bool = True) -> None:
        super().__init__()
        self.full_check = full_check

    def __repr__(self) -> str:
        return f"VerifyModelPass(full_check={self.full_check})"

    def requires(self, model: ir.Model) -> None:
        """Refuse a model the pass cannot work on, with what to do about it."""
        g = model.graph
        if not g.outputs:
            raise ir.passes.PreconditionError("the main graph has no outputs")
        if "" not in model.opset_imports and "ai.onnx" not in model.opset_imports:
            raise ir.passes.PreconditionError("the model imports no default ONNX opset")
        seen: set[str] = set()
        for v in [*g.inputs, *g.initializers.values()]:
            seen.add(v.name)
        for node in g:
            for v in node.outputs:
                if v.name in seen and v.name:
                    raise ir.passes.PreconditionError(
                        f"value {v.name!r} is defined twice (second time by node {node.name!r}); the graph is not SSA"
                    )
                seen.add(v.name)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Run the rewrite on ``model`` (scope and invariants: the class docstring)."""
        check_model(model, full_check=self.full_check)
        return ir.passes.PassResult(model, modified=False)


@register_pass("verify", help="check the model (ONNX checker, full check; SSA); changes nothing")
def _make_verify(context, full_check: bool = True) -> VerifyModelPass:
    return VerifyModelPass(full_check=full_check)
