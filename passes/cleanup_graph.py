"""``cleanup``: onnx-ir's common clean-up passes as one named pass."""

from __future__ import annotations

import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from dyncompile.passes._infra import register_pass

__all__ = ["CleanupGraphPass"]


class CleanupGraphPass(ir.passes.InPlacePass):
    """Remove dead code and duplicates, sort topologically and fix names.

    Scope: main graph, subgraphs and functions (each stock pass walks what it walks).
    Invariants: graph inputs, outputs and their names are preserved; numerics are unchanged (only
    unused nodes/functions/opsets, duplicate initializers and common subexpressions are removed).
    Sketch: ``RemoveUnusedNodes ∘ RemoveUnusedFunctions ∘ RemoveUnusedOpsets ∘
    DeduplicateHashedInitializers ∘ CommonSubexpressionElimination ∘ TopologicalSort ∘ NameFix``.
    ``modified`` is the OR of the stock passes' honest flags, so a second run reports ``False``.
    """

    def __init__(self, cse: bool = True) -> None:
        super().__init__()
        self.cse = cse

    def __repr__(self) -> str:
        return f"CleanupGraphPass(cse={self.cse})"

    def _passes(self) -> list[ir.passes.PassBase]:
        ps: list[ir.passes.PassBase] = [
            common_passes.RemoveUnusedNodesPass(),
            common_passes.RemoveUnusedFunctionsPass(),
            common_passes.RemoveUnusedOpsetsPass(),
            common_passes.DeduplicateHashedInitializersPass(),
        ]
        if self.cse:
            ps.append(common_passes.CommonSubexpressionEliminationPass())
        ps += [common_passes.RemoveUnusedNodesPass(), common_passes.TopologicalSortPass(), common_passes.NameFixPass()]
        return ps

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Run the rewrite on ``model`` (scope and invariants: the class docstring)."""
        modified = False
        for p in self._passes():
            modified |= p(model).modified
        return ir.passes.PassResult(model, modified=modified)


@register_pass("cleanup", help="remove unused nodes/functions/opsets, dedupe initializers, CSE, topo sort, name fix")
def _make_cleanup(context, cse: bool = True) -> CleanupGraphPass:
    return CleanupGraphPass(cse=cse)
