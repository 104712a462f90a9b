"""Root-op guards on onnxscript rewrite rules (_rule_guard.py): the same rewrites, fewer matcher calls.

Byte-identical graphs from the whole ``fuse-decoder`` pass on the real SmolLM2 export with and without the guard;
the multi-output rule it exists for (``SlicesSplit``) still fires; the matcher is not
called on nodes of another op; the module attribute is restored after an exception."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnxscript import rewriter
from onnxscript.optimizer import optimize

from dyncompile._rule_guard import guard_rule, guard_rules, guarded_default_rules
from dyncompile.passes.fuse_decoder import FuseDecoderPass


def _graph_bytes(model: ir.Model) -> bytes:
    return ir.serde.serialize_model(model).SerializeToString(deterministic=True)


def _slices_graph() -> ir.Model:
    """x[4, 8] -> x[..., :4] and x[..., 4:8] (each through an Identity): the two Slices SlicesSplit turns into one
    Split."""
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([4, 8]))

    def const(name, v):
        return ir.Value(name=name, const_value=ir.tensor(np.array(v, np.int64), name=name))

    consts = {n: const(n, v) for n, v in (("b0", [0]), ("e0", [4]), ("b1", [4]), ("e1", [8]), ("ax", [1]))}
    s0 = ir.node("Slice", [x, consts["b0"], consts["e0"], consts["ax"]], outputs=[ir.Value(name="lo")])
    s1 = ir.node("Slice", [x, consts["b1"], consts["e1"], consts["ax"]], outputs=[ir.Value(name="hi")])
    # graph outputs behind Identity (a rewrite does not replace a graph output's producer); the upper half first:
    # the rule's matcher pairs a Slice with the first Slice in graph order, itself included
    i0 = ir.node("Identity", [s0.outputs[0]], outputs=[ir.Value(name="lo_out")])
    i1 = ir.node("Identity", [s1.outputs[0]], outputs=[ir.Value(name="hi_out")])
    graph = ir.Graph([x], [i0.outputs[0], i1.outputs[0]], nodes=[s1, s0, i0, i1],
                     initializers=list(consts.values()), opset_imports={"": 18}, name="slices")
    return ir.Model(graph, ir_version=10)


def test_slices_split_fires_guarded_as_unguarded():
    plain, guarded = _slices_graph(), _slices_graph()
    optimize(plain)
    with guarded_default_rules():
        optimize(guarded)
    assert "Slice" not in {n.op_type for n in guarded.graph}  # the rule fired
    assert "Split" in {n.op_type for n in guarded.graph}
    assert _graph_bytes(guarded) == _graph_bytes(plain)


def test_fuse_decoder_on_the_real_decoder_is_byte_identical_to_the_unguarded_pass(smollm2, monkeypatch):
    import contextlib

    import dyncompile.passes.fuse_decoder as fd

    guarded = ir.load(str(smollm2.onnx_path))
    assert FuseDecoderPass()(guarded).modified
    monkeypatch.setattr(fd, "guarded_default_rules", contextlib.nullcontext)  # the pass as it was before the guard
    plain = ir.load(str(smollm2.onnx_path))
    assert FuseDecoderPass()(plain).modified
    assert "GroupQueryAttention" in {n.op_type for n in guarded.graph}
    assert _graph_bytes(guarded) == _graph_bytes(plain)


def test_the_matcher_runs_only_on_nodes_of_the_rules_root_op():
    rule = next(r for r in rewriter._DEFAULT_REWRITE_RULES if type(r).__name__ == "RewriteRule"
                and r._target_pattern.output_nodes[0].op_identifier() == ("", "Transpose", ""))
    calls = []
    original = rule.try_rewrite

    class Probe:  # the rule's try_rewrite, counted
        pass

    probe = Probe()
    probe._target_pattern = rule._target_pattern
    probe.try_rewrite = lambda *a, **k: calls.append(a[2].op_type) or original(*a, **k)
    guarded = guard_rule(probe)
    model = _slices_graph()
    for node in model.graph:  # Slices: skipped without matching
        assert guarded.try_rewrite(model, model.graph, node) is None
    assert calls == []
    x = model.graph.inputs[0]
    t = ir.node("Transpose", [x], attributes={"perm": [1, 0]}, outputs=[ir.Value(name="t")])
    model.graph.append(t)
    guarded.try_rewrite(model, model.graph, t)
    assert calls == ["Transpose"]


def test_rules_without_a_fixed_root_op_stay_unguarded_and_the_default_set_is_restored():
    class Loose:
        _target_pattern = None

    loose = Loose()
    assert guard_rule(loose) is loose
    before = rewriter._DEFAULT_REWRITE_RULES
    assert len(guard_rules(before)) == len(before)
    with pytest.raises(RuntimeError, match="boom"), guarded_default_rules():
        assert rewriter._DEFAULT_REWRITE_RULES is not before
        raise RuntimeError("boom")
    assert rewriter._DEFAULT_REWRITE_RULES is before
