"""The exit rule is written twice: numpy (runtime/rules/exit_rule.py) and ONNX (GraphBuilder.fires, the If lowering).

Both must take the same decision on every row, for every criterion.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from helpers import ort_session

from dyncompile.passes.early_exit.graph import GraphBuilder
from dyncompile.runtime.rules.exit_rule import exit_fires, exit_scores, first_exits, softmax

ROWS, CLASSES, PATIENCE = 400, 3, 3


def _rule_model(criterion: str, threshold: float, window: int) -> ir.Model:
    """A graph ``(logits_0 .. logits_{window-1}) -> fires [B]`` built by the If lowering's builder."""
    b = GraphBuilder(18, "t.")
    inputs = [ir.val(f"logits_{j}", ir.DataType.FLOAT, ir.Shape(["B", CLASSES])) for j in range(window)]
    fires = b.fires(inputs[-1], criterion, threshold, inputs if criterion == "patience" else ())
    fires.name = "fires"
    fires.dtype, fires.shape = ir.DataType.BOOL, ir.Shape(["B"])
    g = ir.Graph(inputs, [fires], nodes=b.tape.nodes, initializers=b.initializers, opset_imports={"": 18})
    return ir.Model(g, ir_version=10)


def _logits(seed: int, n_exits: int) -> np.ndarray:
    """Logits of ``n_exits`` exits that agree more often than chance (so patience windows both pass and fail)."""
    rng = np.random.default_rng(seed)
    shared = rng.standard_normal((ROWS, CLASSES)) * 2.0
    return np.stack([shared + rng.standard_normal((ROWS, CLASSES)) * 1.5 for _ in range(n_exits)]).astype(np.float32)


def _midpoint_threshold(values: np.ndarray, q: float) -> float:
    """A threshold halfway between two adjacent distinct values near quantile ``q`` (as calibration places them),
    so float32 (ONNX) and float64 (numpy) arithmetic cannot land on different sides of it."""
    v = np.unique(values[np.isfinite(values)])
    i = int(q * (len(v) - 1))
    return float((v[i] + v[i + 1]) / 2)


@pytest.mark.parametrize("criterion", ["entropy", "maxprob", "patience"])
@pytest.mark.parametrize("seed", [0, 1])
def test_onnx_and_numpy_exit_rules_agree(criterion, seed):
    window = PATIENCE if criterion == "patience" else 1
    logits = _logits(seed, window)
    probs = softmax(logits.astype(np.float64))
    score = -exit_scores(probs[-1:], "entropy")[0] if criterion == "entropy" else probs[-1].max(-1)
    for q in (0.2, 0.5, 0.8):
        thr = _midpoint_threshold(score, q)
        sess = ort_session(_rule_model(criterion, thr, window))
        (onnx_fires,) = sess.run(None, {f"logits_{j}": logits[j] for j in range(window)})
        preds = list(probs.argmax(-1))
        numpy_fires = exit_fires(probs[-1], thr, criterion, PATIENCE, preds)
        np.testing.assert_array_equal(onnx_fires, numpy_fires)
        assert 0 < numpy_fires.sum() < ROWS  # the threshold splits the rows: both outcomes are compared
        if criterion == "patience":  # the agreement window decides some rows on its own
            agree = (preds[0] == preds[-1]) & (preds[1] == preds[-1])
            assert not agree.all() and numpy_fires[~agree].sum() == 0


@pytest.mark.parametrize("criterion", ["entropy", "maxprob", "patience"])
def test_per_exit_rule_reproduces_first_exits(criterion):
    """The runtime's per-segment form (exit_fires, batch compacted) and the calibrator's first_exits agree."""
    n_exits = 4
    probs = softmax(_logits(2, n_exits).astype(np.float64))
    signed = -exit_scores(probs, "entropy") if criterion == "entropy" else probs.max(-1)
    thresholds = [_midpoint_threshold(signed[e], 0.6) for e in range(n_exits - 1)] + [None]
    want = first_exits(probs, thresholds, criterion, PATIENCE - 1)
    got = np.full(ROWS, n_exits - 1)
    active = np.arange(ROWS)
    preds: list[np.ndarray] = []
    for e in range(n_exits - 1):
        preds.append(probs[e, active].argmax(-1))
        f = exit_fires(probs[e, active], thresholds[e], criterion, PATIENCE - 1, preds)
        got[active[f]] = e
        active = active[~f]
        preds = [p[~f] for p in preds]
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(want)) >= 3  # rows stop at several exits


def _all_fire_model(criterion: str, threshold: float, window: int) -> ir.Model:
    """A graph ``(logits_0 .. logits_{window-1}) -> all rows fire`` (scalar), the If lowering's condition."""
    b = GraphBuilder(18, "t.")
    inputs = [ir.val(f"logits_{j}", ir.DataType.FLOAT, ir.Shape(["B", CLASSES])) for j in range(window)]
    cond = b.all_fire(inputs[-1], criterion, threshold, inputs if criterion == "patience" else ())
    cond.name = "cond"
    cond.dtype, cond.shape = ir.DataType.BOOL, ir.Shape([])
    g = ir.Graph(inputs, [cond], nodes=b.tape.nodes, initializers=b.initializers, opset_imports={"": 18})
    return ir.Model(g, ir_version=10)


@pytest.mark.parametrize("criterion", ["entropy", "maxprob", "patience"])
def test_if_condition_is_every_row_of_the_numpy_rule(criterion):
    """``all_fire`` (the worst row against the threshold for entropy / maxprob) is ``all(exit_fires)`` of the batch."""
    window = PATIENCE if criterion == "patience" else 1
    logits = _logits(3, window)
    probs = softmax(logits.astype(np.float64))
    score = -exit_scores(probs[-1:], "entropy")[0] if criterion == "entropy" else probs[-1].max(-1)
    thr = _midpoint_threshold(score, 0.3)
    numpy_fires = exit_fires(probs[-1], thr, criterion, PATIENCE, list(probs.argmax(-1)))
    sess = ort_session(_all_fire_model(criterion, thr, window))
    rng = np.random.default_rng(0)
    firing = np.flatnonzero(numpy_fires)
    batches = [rng.choice(ROWS, size=k, replace=False) for k in (1, 2, 4, 8) for _ in range(25)]
    batches += [rng.choice(firing, size=k, replace=False) for k in (1, 3, 8) for _ in range(10)]  # every row fires
    outcomes = set()
    for rows in batches:
        (cond,) = sess.run(None, {f"logits_{j}": logits[j][rows] for j in range(window)})
        assert bool(cond) == bool(numpy_fires[rows].all()), rows
        outcomes.add(bool(cond))
    assert outcomes == {True, False}
