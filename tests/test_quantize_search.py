"""quantize-int8{budget_share=...}: the gated fake-quant model, the fallback search, its plan record, the budget split."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest
from helpers import DATA, ort_session, random_token_feeds, tiny_classifier_dir

import dyncompile
from dyncompile.models.synthetic import tiny_encoder_classifier
from dyncompile.passes import QuantizeDynamicInt8Pass
from dyncompile.passes.emit import add_budget_split
from dyncompile.passes.quantize_search import (
    GATE_INPUT,
    fallback_counts,
    gated_fake_quant,
    predicted_bound,
    quant_losses,
    quant_targets,
)


def _run(model, feeds, gate=None):
    f = dict(feeds)
    if gate is not None:
        f[GATE_INPUT] = gate.astype(np.float32)
    return ort_session(model).run(None, f)[0]


def test_gated_fake_quant_is_fp32_at_gate_zero_and_quantize_dynamic_at_gate_one():
    """g = 0: the fp32 graph's outputs (to float round-off: the MatMuls read computed weights); g = 1: ORT's per-channel dynamic int8 (far closer to it than to fp32)."""
    feeds = random_token_feeds(64, vocab=512, seed=3)
    m = tiny_encoder_classifier()
    targets = quant_targets(m)
    assert len(targets) == sum(1 for n in m.graph if n.op_type == "MatMul" and n.inputs[1].const_value is not None)
    gated = ir.from_proto(__import__("onnx").load_from_string(gated_fake_quant(m, targets)))
    fp32 = _run(tiny_encoder_classifier(), feeds)
    off = _run(gated, feeds, np.zeros(len(targets)))
    assert np.abs(off - fp32).max() <= 1e-5 * max(1.0, float(np.abs(fp32).max()))
    assert (off.argmax(-1) == fp32.argmax(-1)).all()
    q = tiny_encoder_classifier()
    QuantizeDynamicInt8Pass(per_channel=True)(q)
    real = _run(q, feeds)
    sim = _run(gated, feeds, np.ones(len(targets)))
    assert np.abs(real - fp32).max() > 1e-3  # int8 does change the outputs here
    assert np.sqrt(((sim - real) ** 2).mean()) < 0.1 * np.sqrt(((real - fp32) ** 2).mean())
    one = np.zeros(len(targets))  # one MatMul alone: a change of the int8 step's size, not round-off
    one[0] = 1
    assert np.abs(_run(gated, feeds, one) - fp32).max() > 100 * np.abs(off - fp32).max()


def test_fallback_counts_scan_every_small_count_then_geometrically():
    assert fallback_counts(36) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32]
    assert fallback_counts(3) == [0, 1, 2]


def test_quant_losses_and_predicted_bound():
    ref = np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.3, 0.7]])
    q = np.array([[0.8, 0.2], [0.7, 0.3], [0.4, 0.6], [0.3, 0.7]])
    y = np.array([0, 1, 1, 0])
    # row 1: q wrong, ref right -> +1; row 2: q right, ref wrong -> -1; row 3: both wrong -> 0
    assert quant_losses(q, ref, y).tolist() == [0.0, 1.0, -1.0, 0.0]
    assert quant_losses(q, ref, None).tolist() == [0.0, 1.0, 1.0, 0.0]
    zero = np.zeros(600)
    some = np.r_[np.ones(12), np.zeros(588)]
    b0, b1 = predicted_bound(zero, 1400, 0.1, -1.0), predicted_bound(some, 1400, 0.1, -1.0)
    assert 0.0 < b0 < b1  # the betting bound of no loss is still positive, and grows with the losses
    assert predicted_bound(some, 5000, 0.1, -1.0) < b1  # more test rows: a tighter bound


def test_search_plan_records_table_fallbacks_and_certificate(minilm, tmp_path, capsys):
    """The fallback set is the top of the sensitivity ranking, those MatMuls stay fp32 in the graph, the rest are
    int8; the plan carries the table, the steps and a certificate computed on the held-out rows."""
    d, calib = tiny_classifier_dir(tmp_path, minilm)
    res = dyncompile.compile(d / "model.onnx", "quantize-int8{budget_share=0.5,sensitivity_rows=64}", tmp_path / "o",
                             calib=str(calib), budget=2.0, progress=False)
    q = res.plan.policy["quantization"]
    assert q["share"] == 0.5 and q["target_points"] == 1.0 and q["rows"] == {
        "calibration": 300, "path": 90, "test": 210, "sensitivity": 64}
    table = q["table"]
    assert sorted(r["rank"] for r in table) == list(range(1, len(table) + 1))
    kls = [r["kl"] for r in sorted(table, key=lambda r: r["rank"])]
    assert kls == sorted(kls, reverse=True)
    k = len(q["excluded"])
    assert {r["node"] for r in table if r["rank"] <= k} == set(q["excluded"])
    assert all(r.get("fp32") for r in table if r["rank"] <= k) and not any(r.get("fp32") for r in table if r["rank"] > k)
    steps = {s["fp32_kept"]: s for s in q["steps"]}
    assert list(steps) == [j for j in fallback_counts(len(table)) if j <= k]  # the scan stops at the first fit
    assert steps[k]["predicted_bound"] <= 1.0
    assert all(s["predicted_bound"] > 1.0 for j, s in steps.items() if j < k)
    g = ir.load(res.plan.directory / res.plan.files["model"].path).graph
    names = {n.name: n.op_type for n in g}
    assert all(names.get(n) == "MatMul" for n in q["excluded"])
    int8 = [n for n in g if n.op_type in ("MatMulInteger", "DynamicQuantizeMatMul")]
    assert len(int8) == len(table) - k
    from dyncompile.passes import _keys
    from dyncompile.passes.early_exit.fit_exit_heads import find_exit_cuts

    # the fp32 graph's layer boundaries travel with the int8 model: a later early-exit reads them from there
    fp32_layers = find_exit_cuts(tiny_encoder_classifier(num_layers=4, vocab=30522))
    int8_model = ir.load(res.plan.directory / res.plan.files["model"].path)
    assert 0 < k < len(table)  # this tiny model needs some fallbacks at 1 point: both branches of the search ran
    assert json.loads(int8_model.metadata_props[_keys.QUANTIZED])["layers"]["num_layers"] == fp32_layers[0]
    assert find_exit_cuts(int8_model) == fp32_layers
    c = q["certificate"]
    assert c["rows"] == 210 and c["confidence"] == 0.9 and c["method"] == "betting"
    assert c["bound"] >= c["observed"] and c["certified"] == (c["bound"] <= 1.0)
    from helpers import run_cli

    rc, out, _ = run_cli(capsys, "inspect", res.plan_dir)
    assert rc == 0 and f"{k} of {len(table)} MatMuls kept in fp32" in out
    top = min(table, key=lambda r: r["rank"])
    line = next(x for x in out.splitlines() if x.strip().startswith("1  ") and top["label"][:20] in x)
    assert ("fp32" if top.get("fp32") else "int8") in line.split()


def test_search_keeps_everything_fp32_when_nothing_fits_and_is_idempotent(minilm, tmp_path):
    d, calib = tiny_classifier_dir(tmp_path, minilm)
    res = dyncompile.compile(d / "model.onnx", "quantize-int8{budget_share=0.1,sensitivity_rows=32}", tmp_path / "o",
                             calib=str(calib), budget=0.0, progress=False)
    q = res.plan.policy["quantization"]
    assert len(q["excluded"]) == len(q["table"])  # a bound of 0 points is never met by int8
    g = ir.load(res.plan.directory / res.plan.files["model"].path).graph
    assert not any(n.op_type in ("MatMulInteger", "DynamicQuantizeMatMul") for n in g)
    from dyncompile.passes import CompileContext, build_passes

    ctx = CompileContext(model_path=d / "model.onnx", options={"calib": str(calib), "budget": 0.0})
    p = build_passes("quantize-int8{budget_share=0.1,sensitivity_rows=32}", ctx)[0]
    m = ir.load(res.plan.directory / res.plan.files["model"].path)
    assert p(m).modified is False


@pytest.mark.parametrize("spec, text", [
    ("quantize-int8{budget_share=0.5,format=qdq-weights}", "dynamic or static int8 formats"),
    ("quantize-int8{budget_share=1.5}", "in (0, 1]"),
    ("quantize-int8{budget_share=0.5,keep_fp32=ffn-out}", "drop keep_fp32"),
])
def test_search_options_refused_with_one_clear_error(spec, text, tmp_path):
    from dyncompile.errors import PassConfigError
    from dyncompile.passes import CompileContext, build_passes

    ctx = CompileContext(options={"calib": str(DATA / "movie-calib.jsonl")})
    with pytest.raises(PassConfigError, match=text.replace("(", r"\(").replace(")", r"\)").replace("]", r"\]")):
        build_passes(spec, ctx)
    with pytest.raises(PassConfigError, match="--calib"):
        build_passes("quantize-int8{budget_share=0.5}", CompileContext())


def test_budget_split_is_recorded_from_both_certificates():
    policy = {
        "quantization": {"share": 0.3, "target_points": 0.3, "excluded": ["a", "b"],
                         "certificate": {"observed": 0.07, "bound": 0.36, "certified": False, "rows": 1400}},
        "early_exit": {"certificate": {"budget": 1.0, "confidence": 0.9, "observed": 0.5, "bound": 0.95,
                                       "certified": True, "rows": 1400}},
    }
    add_budget_split(policy)
    s = policy["budget_split"]
    assert s["budget"] == 1.0 and s["quantization"]["fp32_matmuls"] == 2
    assert s["exits"]["observed"] == pytest.approx(0.43) and s["pipeline"]["bound"] == 0.95
    only_ee = {"early_exit": policy["early_exit"]}
    add_budget_split(only_ee)
    assert "budget_split" not in only_ee


@pytest.mark.slow
def test_minilm_int8_search_then_early_exit_one_budget(minilm, tmp_path):
    """Real MiniLM: int8 search at a share of 1.0 point, then exits, certified once against the fp32 original."""
    res = dyncompile.compile(minilm.onnx_path, "quantize-int8{budget_share=0.5},early-exit", tmp_path / "o",
                             calib=str(DATA / "movie-calib.jsonl"), budget=1.0, progress=False)
    pol = res.plan.policy
    split = pol["budget_split"]
    assert split["pipeline"]["certified"] and split["pipeline"]["bound"] <= 1.0
    assert split["quantization"]["observed"] <= 0.5 + 1e-9
    # the exits were certified against the fp32 original (run on the calibration rows), with labels
    assert "running the reference model" in pol["early_exit"]["fit"]["phases"]
    assert pol["early_exit"]["certificate"]["mode"] == "labels"
    assert pol["early_exit"]["calibration"]["exit_distribution"]["layers"][-1] == 6  # the fp32 graph's 6 layers
    assert json.dumps(pol)  # strict JSON


def test_fp32_nodes_pins_named_matmuls_in_fp32():
    """quantize-int8{fp32_nodes=A+B}: a search's choice, given by name (no calibration rows needed)."""
    from dyncompile.errors import PassConfigError
    from dyncompile.passes import CompileContext, build_passes

    m = tiny_encoder_classifier()
    names = [t.node for t in quant_targets(m)][:2]
    p = build_passes(f"quantize-int8{{format=dynamic,per_channel=true,fp32_nodes={'+'.join(names)}}}", CompileContext())[0]
    assert p(m).modified
    ops = {n.name: n.op_type for n in m.graph}
    assert all(ops[n] == "MatMul" for n in names)
    assert sum(1 for n in m.graph if n.op_type == "MatMulInteger") == len(quant_targets(tiny_encoder_classifier())) - 2
    with pytest.raises(PassConfigError, match="not both"):
        build_passes(f"quantize-int8{{budget_share=0.5,fp32_nodes={names[0]}}}", CompileContext(options={"calib": "x"}))
