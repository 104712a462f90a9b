"""Golden tests of the early-exit lowering on a generated 4-layer encoder (both lowerings, every branch)."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest
from helpers import EE_FEEDS, EE_LAYERS, lower_if, ort_session, tolerance, with_heads

import dyncompile
from dyncompile.models.synthetic import tiny_encoder_classifier
from dyncompile.passes import InsertEarlyExitPass, _keys, run_pipeline
from dyncompile.passes.early_exit import AttachExitHeadsPass, FitExitHeadsPass
from dyncompile.passes.early_exit.calibrate import Calibration, exit_decisions
from dyncompile.passes.emit import EmitRequest, emit_plan
from dyncompile.plan import save_plan

LAYERS, FEEDS = EE_LAYERS, EE_FEEDS


@pytest.fixture(scope="module")
def original_logits():
    return ort_session(tiny_encoder_classifier(num_layers=LAYERS)).run(None, FEEDS)[0]


def head_outputs(m):
    """Logits of the full model and of every exit head (before lowering)."""
    sess = ort_session(m)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, FEEDS)))


def test_if_structure_nested_and_initializers_inward():
    m = lower_if(with_heads({}))
    g = m.graph
    assert [v.name for v in g.outputs] == ["logits", "exit_layer"]
    ifs = [n for n in g if n.op_type == "If"]
    assert len(ifs) == 1  # outermost; the others nest in else branches
    depth, node = 0, ifs[0]
    while node is not None:
        depth += 1
        else_g = node.attributes["else_branch"].as_graph()
        node = next((n for n in else_g if n.op_type == "If"), None)
    assert depth == 3
    # layer 4's weights live in the innermost else branch, not in the main graph
    assert "layer3.w1" not in g.initializers
    inner = ifs[0].attributes["else_branch"].as_graph()
    inner = next(n for n in inner if n.op_type == "If").attributes["else_branch"].as_graph()
    inner = next(n for n in inner if n.op_type == "If").attributes["else_branch"].as_graph()
    assert "layer3.w1" in inner.initializers


def test_never_exit_reproduces_original(original_logits):
    m = lower_if(with_heads({}))
    logits, layer = ort_session(m).run(None, FEEDS)
    assert int(layer) == LAYERS
    np.testing.assert_allclose(logits, original_logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("exit_at", [1, 2, 3])
def test_each_if_branch_taken(exit_at):
    m = with_heads({exit_at: 10.0})  # entropy < 10 always fires
    heads = head_outputs(m)
    lower_if(m)
    logits, layer = ort_session(m).run(None, FEEDS)
    assert int(layer) == exit_at
    np.testing.assert_allclose(logits, heads[f"exit_logits_{exit_at}"], rtol=0, atol=1e-5)


def test_if_batch_exits_only_when_every_row_is_confident(original_logits):
    m = with_heads({})
    heads = head_outputs(m)
    p = np.exp(heads["exit_logits_1"]) / np.exp(heads["exit_logits_1"]).sum(-1, keepdims=True)
    ent = -(p * np.log(p)).sum(-1)
    thr = float(np.sort(ent)[-2] + 1e-4)  # all rows but the least confident one pass
    m = lower_if(with_heads({1: thr}))
    logits, layer = ort_session(m).run(None, FEEDS)
    assert int(layer) == LAYERS
    np.testing.assert_allclose(logits, original_logits, rtol=0, atol=1e-5)
    one_row = {k: v[np.argmin(ent)][None] for k, v in FEEDS.items()}
    assert int(ort_session(m).run(None, one_row)[1]) == 1


def test_patience_lowering_needs_agreeing_exits():
    m = with_heads({2: 0.0, 3: 0.0}, criterion="patience", patience=2)
    pred = {k: v.argmax(-1) for k, v in head_outputs(m).items()}
    lower_if(m)
    for rows in ([0], [1], [2], [0, 1, 2, 3, 4, 5]):
        feeds = {k: v[rows] for k, v in FEEDS.items()}
        _, layer = ort_session(m).run(None, feeds)
        p1, p2, p3 = (pred[f"exit_logits_{k}"][rows] for k in (1, 2, 3))
        want = 2 if (p1 == p2).all() else 3 if (p2 == p3).all() else LAYERS
        assert int(layer) == want


def test_lowering_is_idempotent_and_needs_heads():
    m = lower_if(with_heads({}))
    assert InsertEarlyExitPass("if")(m).modified is False
    with pytest.raises(ir.passes.PreconditionError, match="no exit heads"):
        InsertEarlyExitPass("if")(tiny_encoder_classifier())


def test_fit_pass_does_not_fire_twice():
    m = with_heads({})
    fit = FitExitHeadsPass(["x"] * 200, [0, 1] * 100, tokenizer_file="/nonexistent/tokenizer.json")
    assert fit(m).modified is False  # metadata present: nothing to do (before any file is read)


def _staged(m, tmp_path, provider="cpu"):
    InsertEarlyExitPass("staged")(m)
    plan = emit_plan(m, EmitRequest(out_dir=tmp_path, task="text-classification"))
    save_plan(plan, tmp_path)
    return dyncompile.load(tmp_path, provider=provider, optimization="disable")


def test_staged_never_exit_reproduces_original(tmp_path, original_logits, provider):
    cm = _staged(with_heads({}), tmp_path, provider)
    st = cm.run_feeds(dict(FEEDS))
    assert (st["exit_layer"] == LAYERS).all()
    np.testing.assert_allclose(st["logits"], original_logits, rtol=0, atol=tolerance(provider))
    assert [s.kind for s in cm.plan.steps] == ["early_exit_staged"]
    assert sorted(cm.plan.files) == ["segment0", "segment1", "segment2", "segment3"]


@pytest.mark.parametrize("criterion", ["entropy", "maxprob", "patience"])
def test_staged_per_row_exits_match_reference_decisions(tmp_path, criterion, original_logits, provider):
    m = with_heads({}, criterion=criterion)
    heads = head_outputs(m)
    probs = []
    for k in (1, 2, 3):
        z = heads[f"exit_logits_{k}"]
        probs.append(np.exp(z - z.max(-1, keepdims=True)) / np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True))
    # thresholds that split the batch: median confidence per exit
    if criterion == "entropy":
        thr = [float(np.median(-(p * np.log(p)).sum(-1))) for p in probs]
    else:
        thr = [float(np.median(p.max(-1))) for p in probs]
    m = with_heads(dict(zip((1, 2, 3), thr)), criterion=criterion)
    cm = _staged(m, tmp_path, provider)
    st = cm.run_feeds(dict(FEEDS))
    full = np.exp(original_logits) / np.exp(original_logits).sum(-1, keepdims=True)
    cal = Calibration(
        thresholds=[*thr, None], criterion=criterion, patience=2, costs=[0.25, 0.5, 0.75, 1.0], budget=1.0,
        metric="agreement", expected_speedup=1.0, expected_accuracy=None, baseline_accuracy=None,
        expected_agreement=100.0, exit_histogram=[0, 0, 0, 0],
    )
    want = np.array([1, 2, 3, 4])[exit_decisions(np.stack([*probs, full]).astype(np.float32), cal)]
    np.testing.assert_array_equal(st["exit_layer"], want)
    assert len(set(want.tolist())) > 1  # the batch really splits
    for k in (1, 2, 3):
        sel = want == k
        np.testing.assert_allclose(st["logits"][sel], heads[f"exit_logits_{k}"][sel], rtol=0, atol=tolerance(provider))
    np.testing.assert_allclose(st["logits"][want == 4], original_logits[want == 4], rtol=0, atol=tolerance(provider))


def test_attach_pass_adds_numpy_exact_heads_and_is_idempotent():
    from dyncompile.passes.early_exit.heads import ExitHead, pool_features

    m = tiny_encoder_classifier(num_layers=LAYERS)
    lns = [n for n in m.graph if n.op_type == "LayerNormalization"]
    cuts = {k: lns[k].outputs[0].name for k in (1, 3)}
    rng = np.random.default_rng(5)
    heads = {
        1: ExitHead("cls", [(rng.standard_normal((256, 2)), rng.standard_normal(2), "none")]),
        3: ExitHead("cls+mean", [(rng.standard_normal((512, 8)), rng.standard_normal(8), "gelu"),
                                 (rng.standard_normal((8, 2)), rng.standard_normal(2), "none")]),
    }
    # the hidden states at the cuts, from the untouched model
    probe = tiny_encoder_classifier(num_layers=LAYERS)
    values = ir.convenience.create_value_mapping(probe.graph)
    probe.graph.outputs.extend(values[cuts[k]] for k in (1, 3))
    logits, h1, h3 = ort_session(probe).run(None, FEEDS)

    attach = AttachExitHeadsPass(heads, cuts, {1: 0.3, 3: None}, num_layers=LAYERS)
    assert run_pipeline([attach], m, check="each").modified
    out = dict(zip([v.name for v in m.graph.outputs], ort_session(m).run(None, FEEDS)))
    assert list(out) == ["logits", "exit_logits_1", "exit_logits_3"]
    np.testing.assert_allclose(out["logits"], logits, rtol=0, atol=1e-6)  # the original output is untouched
    for k, h in ((1, h1), (3, h3)):  # the ONNX head computes what the numpy head computes
        want = heads[k].logits(pool_features(h, FEEDS["attention_mask"], heads[k].pooling))
        np.testing.assert_allclose(out[f"exit_logits_{k}"], want, rtol=0, atol=1e-4)
    meta = json.loads(m.metadata_props[_keys.EARLY_EXIT])
    assert meta["final_output"] == "logits" and meta["num_layers"] == LAYERS
    assert [(e["layer"], e["cut"]) for e in meta["exits"]] == [(1, cuts[1]), (3, cuts[3])]
    assert attach(m).modified is False


@pytest.mark.parametrize("criterion", ["entropy", "maxprob"])
def test_margin_threshold_gives_the_entropy_and_maxprob_decisions(criterion):
    """Two-class entropy falls and top probability rises with |l0 - l1|: ``|d| > margin_threshold(t)`` fires on
    the same rows as the criterion on the probabilities, at every threshold between two rows' scores (entropy
    above 1e-6, maxprob below 1 - 1e-6), and on
    every row or none at the edges (entropy above log 2 or at most 0; maxprob below 0.5 or at least 1)."""
    from dyncompile.passes.early_exit.graph import margin_threshold
    from dyncompile.runtime.rules.exit_rule import confidence, exit_fires

    rng = np.random.default_rng(3)
    logits = np.concatenate([rng.standard_normal((400, 2)) * s for s in (0.01, 1.0, 5.0, 20.0)])
    logits[:3] = [[0.0, 0.0], [3.0, 3.0], [-2.0, 2.0]]  # ties, and one margin whose sign is flipped
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    d = np.abs(logits[:, 0] - logits[:, 1])
    score = np.sort(np.unique(confidence(p, criterion)))
    cuts = (score[:-1] + score[1:]) / 2  # between two rows' scores...
    # ...where float64 probabilities still resolve them (numpy's entropy of p = [1 - e, e] loses e's digits in
    # 1 - e below ~1e-6; a float32 graph's much earlier)
    cuts = cuts[(cuts < -1e-6) if criterion == "entropy" else (cuts < 1 - 1e-6)]
    thresholds = -cuts if criterion == "entropy" else cuts
    for t in thresholds[:: max(1, len(thresholds) // 300)]:
        assert np.array_equal(d > margin_threshold(criterion, t), exit_fires(p, float(t), criterion))
    edges = (np.log(2) + 1e-3, 0.0, -1.0) if criterion == "entropy" else (0.4, 1.0, 2.0)
    for t, fires in zip(edges, (True, False, False), strict=True):
        assert np.array_equal(d > margin_threshold(criterion, t), np.full(len(d), fires))
        assert np.array_equal(exit_fires(p, t, criterion), np.full(len(d), fires))


@pytest.mark.parametrize("criterion", ["entropy", "maxprob"])
def test_two_class_exits_test_the_margin_and_compute_logits_only_when_taken(criterion):
    """The lowered exit test reads the logit difference (``[H, 1]`` product, Abs, ReduceMin) and the head's own
    logits product moves into the then-branch: no LogSoftmax or Softmax in any branch that goes on. Each row alone
    exits where numpy's decisions on the head's logits say, at thresholds between the rows' scores (every branch
    taken), with the head's logits."""
    from dyncompile.runtime.rules.exit_rule import confidence

    heads = head_outputs(with_heads({}, criterion=criterion))
    p = {k: np.exp(v) / np.exp(v).sum(-1, keepdims=True) for k, v in heads.items()}
    s1 = np.sort(confidence(p["exit_logits_1"], criterion))
    s2 = np.sort(confidence(p["exit_logits_2"], criterion))
    cut1, cut2 = (s1[2] + s1[3]) / 2, (s2[1] + s2[2]) / 2  # exit 1 takes the 3 most confident rows...
    thr = {1: -cut1 if criterion == "entropy" else cut1, 2: -cut2 if criterion == "entropy" else cut2}
    m = lower_if(with_heads(thr, criterion=criterion))
    outer = next(n for n in m.graph if n.op_type == "If")
    then_ops = [n.op_type for n in outer.attributes["then_branch"].as_graph()]
    assert then_ops[:2] == ["MatMul", "Add"]
    main_ops = [n.op_type for n in m.graph]
    assert "Abs" in main_ops and not {"LogSoftmax", "Softmax", "Exp"} & set(main_ops)
    want_layers = np.where(confidence(p["exit_logits_1"], criterion) > cut1, 1,
                           np.where(confidence(p["exit_logits_2"], criterion) > cut2, 2, LAYERS))
    assert set(want_layers.tolist()) == {1, 2, LAYERS}
    sess = ort_session(m)
    for r, want in enumerate(want_layers):
        logits, layer = sess.run(None, {k: v[r : r + 1] for k, v in FEEDS.items()})
        assert int(layer) == want
        ref = heads["logits"] if want == LAYERS else heads[f"exit_logits_{want}"]
        np.testing.assert_allclose(logits[0], ref[r], rtol=0, atol=1e-5)
