"""Pass pipeline: registry, spec parsing, honest `modified`, checker after each pass, IR dumps, fidelity."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from helpers import ort_session, random_token_feeds

from dyncompile.errors import PassConfigError
from dyncompile.models.synthetic import tiny_encoder_classifier, tiny_mlp
from dyncompile.passes import (
    CleanupGraphPass,
    VerifyModelPass,
    build_passes,
    known_passes,
    parse_pass_spec,
    run_pipeline,
)


def test_spec_parsing_with_options():
    assert parse_pass_spec("verify, cleanup{cse=false},early-exit{budget=1.5,lowering=if}") == [
        ("verify", {}),
        ("cleanup", {"cse": False}),
        ("early-exit", {"budget": 1.5, "lowering": "if"}),
    ]
    with pytest.raises(PassConfigError, match="key=value"):
        parse_pass_spec("cleanup{cse}")
    with pytest.raises(PassConfigError, match="no passes"):
        parse_pass_spec(" , ")


def test_unknown_pass_lists_known_ones():
    with pytest.raises(PassConfigError) as e:
        build_passes("verify,frobnicate")
    msg = str(e.value)
    assert "frobnicate" in msg and "cleanup" in msg and "verify" in msg


def test_bad_pass_option_is_a_clear_error():
    with pytest.raises(PassConfigError, match="bad options for pass 'cleanup'"):
        build_passes("cleanup{colour=red}")


def test_known_passes_have_help():
    kp = known_passes()
    assert {"verify", "cleanup"} <= set(kp) and all(kp.values())


def _dirty_model() -> ir.Model:
    m = tiny_encoder_classifier(num_layers=2, hidden=64)
    g = m.graph
    # dead code: an unused Relu and an unused initializer-consuming MatMul
    first = next(iter(g))
    dead = ir.node("Relu", [first.outputs[0]])
    g.append(dead)
    return m


def test_cleanup_modified_is_honest_and_idempotent():
    m = _dirty_model()
    r1 = CleanupGraphPass()(m)
    assert r1.modified is True
    assert not any(n.op_type == "Relu" and not n.outputs[0].uses() for n in m.graph)
    r2 = CleanupGraphPass()(m)
    assert r2.modified is False  # second run on its own output changes nothing


def test_verify_never_modifies():
    m = tiny_encoder_classifier(num_layers=2, hidden=64)
    before = ir.to_onnx_text(m)
    assert VerifyModelPass()(m).modified is False
    assert ir.to_onnx_text(m) == before


def test_verify_rejects_graph_without_outputs():
    m = tiny_mlp()
    m.graph.outputs.clear()
    with pytest.raises(ir.passes.PreconditionError, match="no outputs"):
        VerifyModelPass()(m)


def test_pipeline_runs_checker_after_each_pass(monkeypatch):
    calls = []
    import dyncompile.passes._infra as infra

    orig = infra.check_model

    def spy(model, *, full_check=True):
        calls.append(full_check)
        return orig(model, full_check=full_check)

    monkeypatch.setattr(infra, "check_model", spy)
    m = tiny_encoder_classifier(num_layers=2, hidden=64)
    dead = ir.node("Identity", [m.graph.inputs[0]], name="dead_identity")  # unused: cleanup must remove it
    m.graph.append(dead)
    res = run_pipeline(build_passes("cleanup,cleanup"), m, check="each")
    assert len(calls) == 2 and all(calls)
    assert [r.modified for r in res.records] == [True, False]  # the second run finds nothing left to do
    assert "dead_identity" not in {n.name for n in m.graph}
    calls.clear()
    run_pipeline(build_passes("cleanup"), m, check="none")
    assert calls == []


def test_checker_after_each_pass_catches_a_broken_pass():
    class BreakGraphPass(ir.passes.InPlacePass):
        def call(self, model):
            node = next(iter(model.graph))
            node.op_type = "NoSuchOp"
            return ir.passes.PassResult(model, modified=True)

    with pytest.raises(Exception, match="NoSuchOp"):
        run_pipeline([BreakGraphPass()], tiny_mlp(), check="each")


def _big_weight_model(bad: bool = False) -> ir.Model:
    """y = MatMul(x, W) with a 2 MB in-memory W (with ``bad``, x is int64: a type error the checker must see)."""
    w = ir.val("W", const_value=ir.tensor(np.ones((512, 1024), np.float32), name="W"))
    x = ir.val("x", ir.DataType.INT64 if bad else ir.DataType.FLOAT, ir.Shape([2, 512]))
    node = ir.node("MatMul", [x, w], name="mm")
    node.outputs[0].name, node.outputs[0].dtype, node.outputs[0].shape = "y", ir.DataType.FLOAT, ir.Shape([2, 1024])
    g = ir.Graph([x], node.outputs, nodes=[node], initializers=[w], opset_imports={"": 18}, name="g")
    return ir.Model(g, ir_version=10)


def test_checker_past_the_protobuf_limit_checks_weights_as_inputs(monkeypatch):
    """A model whose rewritten in-memory weights pass protobuf's 2 GB (lowered here to 1 MB) is still checked:
    its large weights become typed inputs in the checked copy (a type error is still caught), and the IR keeps its
    initializers."""
    import dyncompile.passes._infra as infra

    monkeypatch.setattr(infra, "PROTO_LIMIT", 1 << 20)
    seen = []
    real = infra._weights_as_inputs
    monkeypatch.setattr(infra, "_weights_as_inputs", lambda proto: (seen.append(1), real(proto)))
    good = _big_weight_model()
    infra.check_model(good)
    assert seen and list(good.graph.initializers) == ["W"] and [v.name for v in good.graph.inputs] == ["x"]
    with pytest.raises(Exception, match="MatMul|type"):
        infra.check_model(_big_weight_model(bad=True))


def test_dump_ir_writes_one_file_per_pass(tmp_path):
    run_pipeline(build_passes("verify,cleanup"), tiny_mlp(), dump_dir=tmp_path)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["000_input.onnx.txt", "001_VerifyModelPass.onnx.txt", "002_CleanupGraphPass.onnx.txt"]
    assert "MatMul" in (tmp_path / "002_CleanupGraphPass.onnx.txt").read_text()


def test_per_pass_timing_is_recorded(monkeypatch):
    """Each record holds the time spent inside its own pass (a fake clock that only passes advance)."""
    import types

    import dyncompile.passes._infra as infra

    clock = [100.0]
    monkeypatch.setattr(infra, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    class TakesTime(ir.passes.InPlacePass):
        def __init__(self, seconds):
            super().__init__()
            self.seconds = seconds

        def call(self, model):
            clock[0] += self.seconds
            return ir.passes.PassResult(model, modified=False)

    res = run_pipeline([TakesTime(0.25), *build_passes("verify"), TakesTime(1.5)], tiny_mlp(), check="each")
    assert [r.name for r in res.records] == ["TakesTime", "VerifyModelPass", "TakesTime"]
    assert [r.seconds for r in res.records] == [0.25, 0.0, 1.5]


def test_verify_cleanup_reproduce_outputs_exactly():
    m = tiny_encoder_classifier()
    ref = ort_session(m)
    feeds = random_token_feeds()
    want = ref.run(None, feeds)[0]
    run_pipeline(build_passes("verify,cleanup"), m)
    got = ort_session(m).run(None, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def test_passes_have_repr():
    for p in build_passes("verify,cleanup{cse=false}"):
        assert "object at" not in repr(p)
    assert repr(build_passes("cleanup{cse=false}")[0]) == "CleanupGraphPass(cse=False)"
