"""quantize-int8{budget_share=...}: the gated fake-quant model, the fallback search, its plan record, the budget split."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest
from helpers import DATA, REDUCE_RANGE, ort_session, random_token_feeds, tiny_classifier_dir

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


@pytest.mark.parametrize("reduce_range", REDUCE_RANGE)
def test_gated_fake_quant_is_fp32_at_gate_zero_and_quantize_dynamic_at_gate_one(reduce_range):
    """g = 0: the fp32 graph's outputs (to float round-off: the MatMuls read computed weights); g = 1: ORT's per-channel dynamic int8 (far closer to it than to fp32)."""
    feeds = random_token_feeds(64, vocab=512, seed=3)
    m = tiny_encoder_classifier()
    targets = quant_targets(m)
    assert len(targets) == sum(1 for n in m.graph if n.op_type == "MatMul" and n.inputs[1].const_value is not None)
    gated = ir.from_proto(__import__("onnx").load_from_string(
        gated_fake_quant(m, targets, weight_max=64 if reduce_range else 127)))
    fp32 = _run(tiny_encoder_classifier(), feeds)
    off = _run(gated, feeds, np.zeros(len(targets)))
    assert np.abs(off - fp32).max() <= 1e-5 * max(1.0, float(np.abs(fp32).max()))
    assert (off.argmax(-1) == fp32.argmax(-1)).all()
    q = tiny_encoder_classifier()
    QuantizeDynamicInt8Pass(per_channel=True, reduce_range=reduce_range)(q)
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


# ---------------------------------------------------------------- int4 in the search (quantize-int4{budget_share=...})


def _single_matmul(k: int = 256, n: int = 64, seed: int = 0) -> ir.Model:
    """``y = x @ W`` with a random ``[k, n]`` weight (node ``mm``), ``x`` ``[1, m, k]``."""
    w = np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32)
    x = ir.val("x", ir.DataType.FLOAT, ir.Shape([1, "m", k]))
    wv = ir.Value(name="W", const_value=ir.tensor(w, name="W"))
    node = ir.node("MatMul", [x, wv], name="mm")
    y = node.outputs[0]
    y.name, y.dtype, y.shape = "y", ir.DataType.FLOAT, ir.Shape([1, "m", n])
    g = ir.Graph([x], [y], nodes=[node], initializers=[wv], opset_imports={"": 18})
    return ir.Model(g, ir_version=10)


@pytest.mark.parametrize("block, symmetric", [(32, False), (128, True)])
def test_int4_gate_is_matmulnbits_exactly(block, symmetric):
    """The gated int4 MatMul computes what ORT's MatMulNBits computes: the quantizer's own weights (unpacked) and,
    at accuracy_level 4, the activation rounded to int8 per block of K (to float round-off, not int4's step size);
    a per-row rounding instead of per block would be far off (the simulation is not vacuous)."""
    from dyncompile.passes.quantize_search import Int4Format, int4_weights
    from dyncompile.passes.quantize_weights import QuantizeWeightsInt4Pass

    rng = np.random.default_rng(1)
    x = (rng.standard_normal((1, 7, 256)) * np.exp(rng.standard_normal((1, 7, 256)))).astype(np.float32)
    for level in (0, 4):
        m = _single_matmul()
        targets = quant_targets(m)
        w4 = int4_weights(m, targets, Int4Format(block, symmetric, level))
        assert set(w4) == {"mm"}
        gated = ir.from_proto(__import__("onnx").load_from_string(
            gated_fake_quant(m, targets, True, None, w4, block if level == 4 else None)))
        real_m = _single_matmul()
        QuantizeWeightsInt4Pass(block, symmetric, level, include_nodes=["mm"])(real_m)
        assert [n.op_type for n in real_m.graph] == ["MatMulNBits"]
        real = ort_session(real_m).run(None, {"x": x})[0]
        fp32 = x @ _single_matmul().graph.initializers["W"].const_value.numpy()
        sim = ort_session(gated).run(None, {"x": x, GATE_INPUT: np.array([0.0, 1.0], np.float32)})[0]
        off = ort_session(gated).run(None, {"x": x, GATE_INPUT: np.zeros(2, np.float32)})[0]
        step = np.abs(real - fp32).max()
        assert step > 0.1  # int4 moves the outputs by far more than round-off
        assert np.abs(sim - real).max() < 1e-4 * step * 100  # equal to float round-off
        assert np.abs(off - fp32).max() < 1e-3
        if level == 4:  # the activation rounding matters: the weight alone is not the kernel's answer
            assert np.abs(x @ w4["mm"] - real).max() > 10 * np.abs(sim - real).max()


def test_int4_gate_on_an_encoder_tracks_the_real_mixed_model():
    """tiny encoder, every MatMul int4 (block 32, zero points, int8 compute): the gated model at the int4 gates is
    far closer to the real MatMulNBits model than either is to fp32."""
    from dyncompile.passes.quantize_search import Int4Format, int4_weights
    from dyncompile.passes.quantize_weights import QuantizeWeightsInt4Pass

    feeds = random_token_feeds(64, vocab=512, seed=3)
    m = tiny_encoder_classifier()
    targets = quant_targets(m)
    w4 = int4_weights(m, targets, Int4Format(32, False, 4))
    assert len(w4) == len(targets)
    gated = ir.from_proto(__import__("onnx").load_from_string(gated_fake_quant(m, targets, True, None, w4, 32)))
    fp32 = _run(tiny_encoder_classifier(), feeds)
    q = tiny_encoder_classifier()
    QuantizeWeightsInt4Pass(32, False, 4, include_nodes=[t.node for t in targets])(q)
    real = _run(q, feeds)
    sim = _run(gated, feeds, np.r_[np.zeros(len(targets)), np.ones(len(targets))])
    assert np.sqrt(((sim - real) ** 2).mean()) < 0.1 * np.sqrt(((real - fp32) ** 2).mean())


def test_int4_pass_include_nodes_quantizes_only_those():
    from dyncompile.passes.quantize_weights import QuantizeWeightsInt4Pass

    m = tiny_encoder_classifier()
    names = [t.node for t in quant_targets(m)]
    r = QuantizeWeightsInt4Pass(32, include_nodes=names[1:3])(m)
    assert r.modified
    ops = {n.name: n.op_type for n in m.graph}
    assert [ops.get(f"{x}_Q4") for x in names[1:3]] == ["MatMulNBits"] * 2
    assert all(ops.get(x) == "MatMul" for x in [names[0], *names[3:]])
    assert QuantizeWeightsInt4Pass(32, include_nodes=names[1:3])(m).modified is False  # idempotent


def test_precision_moves_order_and_hull():
    """Moves are taken by their drop in KL; int4 -> int8 before int8 -> fp32 for one MatMul, or one int4 -> fp32
    move when the second step is worth more; without int4 the int8 search's order (KL descending)."""
    from dyncompile.passes.quantize_search import precision_moves

    table = [
        {"kl": 0.010, "kl_int4": 0.100},  # int4 -> int8 worth 0.09, then fp32 0.01
        {"kl": 0.050, "kl_int4": 0.060},  # the second step (0.05) is worth more than the first (0.01): one move
        {"kl": 0.001, "kl_int4": 0.004},  # worth 0.003, then 0.001
        {"kl": 0.020},                     # not int4-eligible: starts at int8
    ]
    moves = precision_moves(table, [4, 4, 4, 8])
    assert moves == [(0, 8), (1, 32), (3, 32), (0, 32), (2, 8), (2, 32)]
    assert precision_moves(table, [8, 8, 8, 8]) == [(1, 32), (3, 32), (0, 32), (2, 32)]


@pytest.mark.parametrize("budget, levels", [(3.0, {"int4", "int8"}), (2.0, {"int8", "fp32"})])
def test_int4_search_plan_graph_and_inspect(minilm, tmp_path, capsys, budget, levels):
    """quantize-int4{budget_share=...}: each MatMul's precision in the table is the one in the graph (MatMulNBits,
    dynamic int8, fp32 MatMul), the precisions are the scan's prefix of moves, the certificate is the real
    model's, inspect shows the precisions; a second run does nothing."""
    from dyncompile.passes.quantize_search import precision_moves

    d, calib = tiny_classifier_dir(tmp_path, minilm)
    # reduce_range=false: 8-bit int8 fallbacks on every CPU (the branches each budget reaches were found with them)
    spec = "quantize-int4{budget_share=0.5,sensitivity_rows=64,block_size=32,reduce_range=false}"
    res = dyncompile.compile(d / "model.onnx", spec, tmp_path / "o", calib=str(calib), budget=budget, progress=False)
    q = res.plan.policy["quantization"]
    assert q["int4"] == {"block_size": 32, "symmetric": False, "accuracy_level": 4}
    table = q["table"]
    prec = {r["node"]: r["precision"] for r in table}
    assert set(prec.values()) == levels  # the two branches this budget reaches
    assert set(q["int4_nodes"]) == {k for k, v in prec.items() if v == "int4"}
    assert set(q["int8_nodes"]) == {k for k, v in prec.items() if v == "int8"}
    assert set(q["excluded"]) == {k for k, v in prec.items() if v == "fp32"}
    g = ir.load(res.plan.directory / res.plan.files["model"].path).graph
    ops = {n.name: n.op_type for n in g}
    assert all(ops.get(f"{x}_Q4") == "MatMulNBits" for x in q["int4_nodes"])
    assert all(ops.get(x) == "MatMul" for x in q["excluded"])
    assert sum(1 for n in g if n.op_type == "MatMulInteger") == len(q["int8_nodes"])
    assert sum(1 for n in g if n.op_type == "MatMulNBits") == len(q["int4_nodes"])
    moves = precision_moves(table, [4] * len(table))  # every K here is a multiple of 32: all start in int4
    k = q["steps"][-1]["moves"]
    lv = [4] * len(table)
    for i, to in moves[:k]:
        lv[i] = to
    assert [{4: "int4", 8: "int8", 32: "fp32"}[b] for b in lv] == [r["precision"] for r in table]
    assert q["steps"][-1]["predicted_bound"] <= q["target_points"]
    assert all(s["predicted_bound"] > q["target_points"] for s in q["steps"][:-1])
    c = q["certificate"]
    assert c["rows"] == 210 and c["bound"] >= c["observed"]
    from helpers import run_cli

    rc, out, _ = run_cli(capsys, "inspect", res.plan_dir)
    assert rc == 0 and "int4/int8 search" in out and "zero points, accuracy_level 4" in out
    for r in table:
        if r["precision"] != "int4":
            line = next(x for x in out.splitlines() if x.split()[:1] == [str(r["rank"])])
            assert r["precision"] in line.split()
    from dyncompile.passes import CompileContext, build_passes

    ctx = CompileContext(model_path=d / "model.onnx", options={"calib": str(calib), "budget": budget})
    p = build_passes("quantize-int4{budget_share=0.5,sensitivity_rows=64,block_size=32}", ctx)[0]
    assert p(ir.load(res.plan.directory / res.plan.files["model"].path)).modified is False


@pytest.mark.parametrize("spec, text", [
    ("quantize-int4{budget_share=0.5,accuracy_level=2}", "accuracy_level 4"),
    ("quantize-int4{budget_share=0.5,lm_head_bits=4}", "drop lm_head_bits"),
    ("quantize-int4{budget_share=0.5,forecast=maybe}", "forecast"),
])
def test_int4_search_options_refused_with_one_clear_error(spec, text):
    from dyncompile.errors import PassConfigError
    from dyncompile.passes import CompileContext, build_passes

    with pytest.raises(PassConfigError, match=text):
        build_passes(spec, CompileContext(options={"calib": str(DATA / "movie-calib.jsonl")}))
    with pytest.raises(PassConfigError, match="--calib"):
        build_passes("quantize-int4{budget_share=0.5}", CompileContext())


def test_int4_pins_named_int8_and_fp32_matmuls():
    """quantize-int4{int8_nodes=A,fp32_nodes=B}: those two as named, every other MatMul int4; a name not in the
    graph is one clear error; a second run does nothing."""
    from dyncompile.errors import PassConfigError
    from dyncompile.passes import CompileContext, build_passes

    m = tiny_encoder_classifier()
    names = [t.node for t in quant_targets(m)]
    p = build_passes(f"quantize-int4{{block_size=32,int8_nodes={names[0]},fp32_nodes={names[1]}+{names[2]}}}",
                     CompileContext())[0]
    assert p(m).modified
    ops = {n.name: n.op_type for n in m.graph}
    assert ops[names[1]] == ops[names[2]] == "MatMul"
    assert sum(1 for n in m.graph if n.op_type == "MatMulInteger") == 1
    assert all(ops.get(f"{x}_Q4") == "MatMulNBits" for x in names[3:])
    assert json.loads(m.metadata_props["dyncompile.quantized"])["int4_matmuls"] == len(names) - 3
    assert p(m).modified is False
    bad = build_passes("quantize-int4{int8_nodes=nope}", CompileContext())[0]
    with pytest.raises(PassConfigError, match="not constant-weight MatMuls"):
        bad(tiny_encoder_classifier())
    with pytest.raises(PassConfigError, match="not both"):
        build_passes("quantize-int4{budget_share=0.5,fp32_nodes=x}", CompileContext(options={"calib": "x"}))



@pytest.mark.slow
def test_minilm_int4_search_certified_alone(minilm, tmp_path):
    """Real MiniLM: the int4 search (block 32, int8 compute) at a share of 0.5 point keeps most MatMuls in int4,
    the graph holds what the table says, and the quantized model alone is certified on the held-out rows."""
    res = dyncompile.compile(minilm.onnx_path, "quantize-int4{budget_share=0.5,block_size=32,sensitivity_rows=64}",
                             tmp_path / "o", calib=str(DATA / "movie-calib.jsonl"), budget=1.0, progress=False)
    q = res.plan.policy["quantization"]
    assert len(q["int4_nodes"]) > len(q["table"]) // 2
    g = ir.load(res.plan.directory / res.plan.files["model"].path).graph
    assert sum(1 for n in g if n.op_type == "MatMulNBits") == len(q["int4_nodes"])
    c = q["certificate"]
    assert c["certified"] and c["bound"] <= 0.5 and c["rows"] == 1400
