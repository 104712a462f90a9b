"""Exit heads, their fitting and threshold calibration (dyncompile.passes.early_exit.{heads,fit,calibrate}) on
small synthetic data."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from dyncompile.errors import DyncompileError
from dyncompile.passes.early_exit.calibrate import Calibration, calibrate_thresholds, exit_decisions
from dyncompile.passes.early_exit.checks import CalibrationError
from dyncompile.passes.early_exit.fit import adam_fit, average_heads, fit_exit_heads, fit_standardisation
from dyncompile.passes.early_exit.heads import ExitHead, pool_features
from dyncompile.runtime.rules.exit_rule import exit_scores

# ----------------------------------------------------------------------------------------------- helpers


def _softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def _blobs(n=240, f=12, sep=3.0, seed=0, scale=1.0, offset=0.0):
    """Two Gaussian classes, separable along the first feature; returns raw features and labels."""
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 2
    x = rng.standard_normal((n, f))
    x[:, 0] += np.where(y == 1, sep, -sep)
    return (x * scale + offset).astype(np.float32), y


def _cascade_problem(n=600, n_exits=4, seed=0):
    """Exits that get better with depth; the last exit is the 'full model'. Returns probs [E, N, 2], labels."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    signal = np.where(y == 1, 1.0, -1.0)
    probs = []
    for e in range(n_exits):
        strength = 0.6 + 1.2 * e  # later exits are more informative
        logit = strength * signal + rng.standard_normal(n) * 1.5
        z = np.stack([-logit / 2, logit / 2], axis=1)
        probs.append(_softmax(z))
    return np.stack(probs).astype(np.float32), y


def _costs(n_exits):
    return [(k + 1) / n_exits for k in range(n_exits)]


def _oracle_exits(exit_probs, thresholds, criterion, patience=2):
    """The exit rule written out row by row in plain Python (an independent reference for exit_decisions)."""
    n_exits, n, _ = exit_probs.shape
    out = []
    for i in range(n):
        for e in range(n_exits):
            p = [float(v) for v in exit_probs[e, i]]
            t = thresholds[e]
            if e == n_exits - 1:
                fires = True
            elif t is None:
                fires = False
            elif criterion == "entropy":
                fires = -sum(v * math.log(v) for v in p if v > 0) < t
            else:
                window = [int(np.argmax(exit_probs[j, i])) for j in range(e - patience + 1, e + 1)] if e >= patience - 1 else []
                agree = criterion == "maxprob" or (len(window) == patience and len(set(window)) == 1)
                fires = agree and max(p) > t
            if fires:
                out.append(e)
                break
    return np.array(out)


def _accuracy(exit_probs, ex, labels):
    pred = exit_probs.argmax(axis=2)[ex, np.arange(exit_probs.shape[1])]
    return float((pred == labels).mean() * 100)


# ----------------------------------------------------------------------------------------------- pooling


def test_pool_shapes_and_masked_mean():
    rng = np.random.default_rng(0)
    h = rng.standard_normal((3, 5, 4)).astype(np.float32)
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    assert pool_features(h, mask, "cls").shape == (3, 4)
    assert pool_features(h, mask, "mean").shape == (3, 4)
    both = pool_features(h, mask, "cls+mean")
    assert both.shape == (3, 8) and both.dtype == np.float32
    np.testing.assert_array_equal(pool_features(h, None, "cls"), h[:, 0])
    mean = pool_features(h, mask, "mean")
    for i in range(3):
        ref = h[i, mask[i] == 1].mean(axis=0)
        np.testing.assert_allclose(mean[i], ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(both[:, 4:], mean)
    np.testing.assert_array_equal(both[:, :4], h[:, 0])
    # padding positions must not leak into the mean
    h2 = h.copy()
    h2[0, 3:] = 1e6
    np.testing.assert_allclose(pool_features(h2, mask, "mean")[0], mean[0], rtol=1e-6)
    # an all-zero mask row gives zeros, not NaN
    mask0 = mask.copy()
    mask0[1] = 0
    assert np.all(pool_features(h, mask0, "mean")[1] == 0)


def test_pool_bad_input():
    h = np.zeros((2, 3, 4), np.float32)
    with pytest.raises(CalibrationError, match="unknown pooling"):
        pool_features(h, None, "max")
    with pytest.raises(CalibrationError, match="attention_mask shape"):
        pool_features(h, np.ones((2, 4)), "mean")
    with pytest.raises(CalibrationError, match=r"\[N, S, H\]"):
        pool_features(np.zeros((2, 4)), None, "cls")


# ----------------------------------------------------------------------------------------------- fitting


@pytest.mark.parametrize("hidden", [None, 16])
def test_head_fits_separable_problem(hidden):
    x, y = _blobs()
    teacher = np.eye(2)[y] * 0.9 + 0.05
    progress = []
    res = fit_exit_heads(
        [x, x[:, ::-1].copy()], teacher, y, pooling="cls", hidden=hidden, folds=3,
        progress=lambda done, total, msg: progress.append((done, total)),
    )
    assert len(res.heads) == 2 and res.oof_probs.shape == (2, len(y), 2)
    assert all(a > 95.0 for a in res.oof_accuracy)
    assert all(a > 95.0 for a in res.oof_agreement)
    xt, yt = _blobs(seed=1)
    assert (res.heads[0].predict_proba(xt).argmax(1) == yt).mean() > 0.95
    assert progress[-1][0] == progress[-1][1] and len(progress) == progress[-1][1]
    assert [d for d, _ in progress] == sorted(d for d, _ in progress)
    # the heads are plain dense stacks: linear = one layer, hidden = two
    assert len(res.heads[0].layers) == (1 if hidden is None else 2)
    assert res.heads[0].layers[-1][2] == "none"


def test_standardisation_is_folded_into_first_layer():
    # tiny-variance, offset features (like early-layer first-token states: per-dimension std ~1e-3 against
    # values ~0.5): only learnable if standardised
    x, y = _blobs(scale=1e-3, offset=0.5)
    teacher = np.eye(2)[y] * 0.9 + 0.05
    res = fit_exit_heads([x], teacher, y, pooling="mean", hidden=None, folds=2)
    head = res.heads[0]
    assert res.oof_accuracy[0] > 95.0
    # predict on raw features == explicit standardise-then-dense reference, with the fitted parameters
    prep = fit_standardisation(x[:50], None)
    rng = np.random.default_rng(0)
    q = teacher[:50].astype(np.float32)
    dense = adam_fit(prep.apply(x[:50]), q, np.ones((50, 1), bool), None, "tanh", 1e-2, 50, 0.05, rng)[0]
    w_raw, b_raw = prep.fold_into(*dense[0])
    z = (x.astype(np.float64) - prep.mu) / prep.sd
    ref = _softmax(z @ dense[0][0].astype(np.float64) + dense[0][1])
    folded = ExitHead(pooling="mean", layers=[(w_raw, b_raw, "none")])
    np.testing.assert_allclose(folded.predict_proba(x), ref, atol=1e-4)
    # and the shipped head is one MatMul+Add on raw features: recompute it by hand
    w, b, act = head.layers[0]
    assert act == "none"
    np.testing.assert_allclose(head.predict_proba(x), _softmax(x.astype(np.float64) @ w + b), atol=1e-4)


def test_hidden_head_with_pca_is_folded():
    # low-rank features (5 latent directions mixed into 40 dims, tiny variance, offset): PCA keeps the signal
    z, y = _blobs(n=200, f=5)
    mix = np.random.default_rng(1).standard_normal((5, 40))
    x = (z @ mix * 1e-2 + 3.0 + np.random.default_rng(2).standard_normal((200, 40)) * 1e-4).astype(np.float32)
    teacher = np.eye(2)[y] * 0.9 + 0.05
    res = fit_exit_heads([x], teacher, y, pooling="cls", hidden=8, folds=2, pca_dim=10)
    head = res.heads[0]
    (w1, b1, a1), (w2, b2, a2) = head.layers
    assert w1.shape[0] == 40 and a1 == "tanh" and a2 == "none"
    ref = _softmax(np.tanh(x.astype(np.float64) @ w1 + b1) @ w2 + b2)
    np.testing.assert_allclose(head.predict_proba(x), ref, atol=1e-4)
    assert res.oof_accuracy[0] > 95.0


def test_averaged_heads_equal_mean_logits():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((20, 6)).astype(np.float32)
    for hidden in (False, True):
        heads = []
        for _ in range(3):
            if hidden:
                layers = [(rng.standard_normal((6, 5)), rng.standard_normal(5), "tanh"),
                          (rng.standard_normal((5, 2)), rng.standard_normal(2), "none")]
            else:
                layers = [(rng.standard_normal((6, 2)), rng.standard_normal(2), "none")]
            heads.append(ExitHead(pooling="cls", layers=layers))
        avg = average_heads(heads)
        ref = np.mean([h.logits(x) for h in heads], axis=0)
        np.testing.assert_allclose(avg.logits(x), ref, atol=1e-5)


def test_head_round_trip_identical_probabilities():
    rng = np.random.default_rng(1)
    head = ExitHead(
        pooling="cls+mean",
        layers=[(rng.standard_normal((8, 5)), rng.standard_normal(5), "gelu"),
                (rng.standard_normal((5, 3)), rng.standard_normal(3), "none")],
        info={"exit": 2},
    )
    x = rng.standard_normal((7, 8)).astype(np.float32)
    for encoding in ("base64", "list"):
        d = json.loads(json.dumps(head.to_dict(encoding=encoding), allow_nan=False))
        back = ExitHead.from_dict(d)
        assert back.pooling == "cls+mean" and back.info == {"exit": 2}
        np.testing.assert_array_equal(back.predict_proba(x), head.predict_proba(x))
        for (w, b, a), (w2, b2, a2) in zip(head.layers, back.layers, strict=True):
            np.testing.assert_array_equal(w, w2)
            np.testing.assert_array_equal(b, b2)
            assert a == a2
    with pytest.raises(CalibrationError, match="not an exit head"):
        ExitHead.from_dict({"pooling": "cls"})


def test_gelu_is_exact_erf_gelu():
    x = np.linspace(-6, 6, 101, dtype=np.float32)[:, None]
    head = ExitHead(pooling="cls", layers=[(np.eye(1), np.zeros(1), "gelu")])
    ref = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x[:, 0].astype(np.float64)])
    np.testing.assert_allclose(head.logits(x)[:, 0], ref, atol=2e-6)


def test_fit_is_deterministic_given_seed():
    x, y = _blobs(sep=0.7)
    teacher = _softmax(np.stack([-x[:, 0], x[:, 0]], 1))
    for hidden in (None, 8):
        a = fit_exit_heads([x, x * 2], teacher, y, pooling="cls", hidden=hidden, seed=3, folds=3)
        b = fit_exit_heads([x, x * 2], teacher, y, pooling="cls", hidden=hidden, seed=3, folds=3)
        np.testing.assert_array_equal(a.oof_probs, b.oof_probs)
        for ha, hb in zip(a.heads, b.heads, strict=True):
            for (wa, ba, _), (wb, bb, _) in zip(ha.layers, hb.layers, strict=True):
                np.testing.assert_array_equal(wa, wb)
                np.testing.assert_array_equal(ba, bb)
        c = fit_exit_heads([x, x * 2], teacher, y, pooling="cls", hidden=hidden, seed=4, folds=3)
        assert not np.array_equal(a.oof_probs, c.oof_probs)  # the seed matters (fold split)


def test_fit_without_labels_distils_teacher():
    x, y = _blobs()
    teacher = np.eye(2)[y] * 0.8 + 0.1
    res = fit_exit_heads([x], teacher, None, pooling="cls", hidden=None, folds=3)
    assert res.oof_accuracy == [None] and res.oof_agreement[0] > 95.0


def test_fit_bad_input():
    x, y = _blobs(n=40)
    teacher = np.eye(2)[y] * 0.9 + 0.05
    with pytest.raises(CalibrationError, match="features is empty"):
        fit_exit_heads([], teacher, y, pooling="cls", hidden=None)
    with pytest.raises(CalibrationError, match=r"features\[0\] must be \[N, F\]"):
        fit_exit_heads([x[:10]], teacher, y, pooling="cls", hidden=None)
    with pytest.raises(CalibrationError, match="labels must have shape"):
        fit_exit_heads([x], teacher, y[:10], pooling="cls", hidden=None)
    with pytest.raises(CalibrationError, match="all 40 labels are class 0"):
        fit_exit_heads([x], teacher, np.zeros(40, int), pooling="cls", hidden=None)
    with pytest.raises(CalibrationError, match="teacher_probs must be"):
        fit_exit_heads([x], np.zeros((0, 2)), None, pooling="cls", hidden=None)
    with pytest.raises(CalibrationError, match="not probabilities"):
        fit_exit_heads([x], teacher * 3, y, pooling="cls", hidden=None)
    with pytest.raises(CalibrationError, match="too few"):
        fit_exit_heads([x[:6]], teacher[:6], y[:6], pooling="cls", hidden=None, folds=5)
    with pytest.raises(CalibrationError, match="unknown pooling"):
        fit_exit_heads([x], teacher, y, pooling="max", hidden=None)


# ----------------------------------------------------------------------------------------------- calibration


@pytest.mark.parametrize("criterion", ["entropy", "maxprob", "patience"])
@pytest.mark.parametrize("budget", [0.0, 0.5, 2.0, 5.0])
def test_calibration_respects_budget_on_calibration_data(criterion, budget):
    probs, y = _cascade_problem()
    final = probs[-1]
    costs = _costs(len(probs))
    cal = calibrate_thresholds(probs, final, y, costs, budget=budget, criterion=criterion)
    # decisions, accuracy and speedup from a row-by-row reference of the rule, not from the calibrator's own code
    ex = _oracle_exits(probs, cal.thresholds, criterion)
    np.testing.assert_array_equal(exit_decisions(probs, cal), ex)
    base = float((final.argmax(1) == y).mean() * 100)
    acc = _accuracy(probs, ex, y)
    assert base - acc <= budget + 1e-9
    assert cal.baseline_accuracy == pytest.approx(base)
    assert cal.expected_accuracy == pytest.approx(acc)
    assert cal.expected_speedup == pytest.approx(1.0 / np.mean(np.asarray(costs)[ex]))
    assert cal.exit_histogram == np.bincount(ex, minlength=len(probs)).tolist()
    assert cal.thresholds[-1] is None and len(cal.thresholds) == len(probs)
    if budget >= 2.0:
        assert cal.exit_histogram[-1] < probs.shape[1]  # a budget of >= 12 rows lets some rows exit early
    # agreement with the full model when there are no labels
    cal2 = calibrate_thresholds(probs, final, None, costs, budget=budget, criterion=criterion)
    ex2 = _oracle_exits(probs, cal2.thresholds, criterion)
    agree = (probs.argmax(2)[ex2, np.arange(probs.shape[1])] == final.argmax(1)).mean() * 100
    assert 100 - agree <= budget + 1e-9 and cal2.metric == "agreement"


def test_larger_budget_saves_more():
    probs, y = _cascade_problem()
    speed = [calibrate_thresholds(probs, probs[-1], y, _costs(4), budget=b).expected_speedup for b in (0.5, 2, 8)]
    assert speed[0] <= speed[1] <= speed[2] and speed[2] > 1.3


def test_thresholds_that_never_fire_exit_last():
    probs, _ = _cascade_problem(n=50)
    n_exits = len(probs)
    for criterion, never in [("entropy", 0.0), ("maxprob", 1.0), ("patience", 1.0)]:
        for thr in ([None] * n_exits, [never] * (n_exits - 1) + [None]):
            cal = Calibration(thresholds=thr, criterion=criterion, patience=2, costs=_costs(n_exits), budget=0.0,
                              metric="agreement", expected_speedup=1.0, expected_accuracy=None,
                              baseline_accuracy=None, expected_agreement=100.0, exit_histogram=[])
            assert np.all(exit_decisions(probs, cal) == n_exits - 1)


def test_threshold_semantics_and_patience():
    # 3 exits, 4 rows; hand-checked decisions
    p = np.array([
        [[0.9, 0.1], [0.6, 0.4], [0.2, 0.8], [0.55, 0.45]],
        [[0.8, 0.2], [0.3, 0.7], [0.1, 0.9], [0.45, 0.55]],
        [[0.7, 0.3], [0.2, 0.8], [0.4, 0.6], [0.6, 0.4]],
    ], np.float32)
    mk = lambda crit, thr, patience=2: Calibration(  # noqa: E731
        thresholds=thr, criterion=crit, patience=patience, costs=[1 / 3, 2 / 3, 1.0], budget=0, metric="agreement",
        expected_speedup=1, expected_accuracy=None, baseline_accuracy=None, expected_agreement=100, exit_histogram=[])
    assert exit_decisions(p, mk("maxprob", [0.85, 0.75, None])).tolist() == [0, 2, 1, 2]
    h = -(p * np.log(p)).sum(-1)
    assert exit_decisions(p, mk("entropy", [float(h[0, 0]) + 1e-6, None, None])).tolist() == [0, 2, 2, 2]
    # patience 2: exit 0 can never fire; exit 1 fires where exits 0 and 1 agree (rows 0 and 2)
    assert exit_decisions(p, mk("patience", [0.0, 0.0, None])).tolist() == [1, 2, 1, 2]
    # a threshold on top of the agreement: row 0 (max 0.8) passes 0.85? no
    assert exit_decisions(p, mk("patience", [0.0, 0.85, None])).tolist() == [2, 2, 1, 2]
    # patience 1 is plain maxprob
    assert exit_decisions(p, mk("patience", [0.85, 0.75, None], patience=1)).tolist() == [0, 2, 1, 2]
    s = exit_scores(p, "patience", 2)
    assert np.all(np.isneginf(s[0]))


def test_budget_zero_with_oracle_exit_still_exits_early():
    probs, y = _cascade_problem(n=400)
    oracle = np.where(np.eye(2)[y] > 0, 0.97, 0.03).astype(np.float32)
    p = probs.copy()
    p[0] = oracle  # the first exit is always right (and confident)
    cal = calibrate_thresholds(p, p[-1], y, _costs(len(p)), budget=0.0, criterion="entropy")
    assert cal.exit_histogram[0] == len(y) and cal.expected_speedup == pytest.approx(len(p))
    # without labels: an exit that always agrees with the full model
    p[0] = np.where(np.eye(2)[p[-1].argmax(1)] > 0, 0.97, 0.03)
    for criterion in ("maxprob", "patience"):
        cal = calibrate_thresholds(p, p[-1], None, _costs(len(p)), budget=0.0, criterion=criterion, patience=1)
        assert cal.exit_histogram[0] == len(y)


def test_small_set_warns():
    probs, y = _cascade_problem(n=300)
    cal = calibrate_thresholds(probs, probs[-1], y, _costs(4), budget=1.0)
    assert any("only 3.0 of the 300 calibration rows" in w for w in cal.warnings)
    big = calibrate_thresholds(probs, probs[-1], y, _costs(4), budget=5.0)
    assert not any("calibration rows" in w for w in big.warnings)


def test_calibration_round_trip_and_determinism():
    probs, y = _cascade_problem()
    a = calibrate_thresholds(probs, probs[-1], y, _costs(4), budget=1.0, criterion="patience")
    b = calibrate_thresholds(probs, probs[-1], y, _costs(4), budget=1.0, criterion="patience")
    assert a == b
    back = Calibration.from_dict(json.loads(json.dumps(a.to_dict(), allow_nan=False)))
    assert back == a
    np.testing.assert_array_equal(exit_decisions(probs, back), exit_decisions(probs, a))


def _bad(match, *args, **kw):
    with pytest.raises(CalibrationError, match=match) as info:
        calibrate_thresholds(*args, **kw)
    assert isinstance(info.value, DyncompileError)  # printed by the CLI without a traceback
    return str(info.value)


def test_calibration_bad_input():
    probs, y = _cascade_problem(n=100)
    final, costs = probs[-1], _costs(4)
    msg = _bad("nothing to calibrate", np.zeros((4, 0, 2)), np.zeros((0, 2)), None, costs, budget=1.0)
    assert "pass the calibration" in msg
    _bad("nothing to calibrate", np.zeros((0, 100, 2)), final, y, [], budget=1.0)
    msg = _bad("budget must be a finite accuracy drop >= 0", probs, final, y, costs, budget=-0.5)
    assert "-0.5" in msg
    _bad("budget must be", probs, final, y, costs, budget=float("nan"))
    msg = _bad("all 100 labels are class 1", probs, final, np.ones(100, int), costs, budget=1.0)
    assert "every class" in msg
    _bad(r"final_probs must be \[N, C\] = \(100, 2\)", probs, final[:50], y, costs, budget=1.0)
    _bad(r"labels must have shape \[N\] = \(100,\)", probs, final, y[:99], costs, budget=1.0)
    _bad("labels must lie in", probs, final, y + 5, costs, budget=1.0)
    _bad("costs must have one entry per exit", probs, final, y, costs[:3], budget=1.0)
    _bad("non-decreasing", probs, final, y, costs[::-1], budget=1.0)
    _bad(r"exit_probs must be \[E, N, C\]", probs[0], final, y, costs, budget=1.0)
    _bad("not probabilities", probs * 2, final, y, costs, budget=1.0)
    _bad("NaN", np.full_like(probs, np.nan), final, y, costs, budget=1.0)
    _bad("unknown criterion", probs, final, y, costs, budget=1.0, criterion="margin")
    _bad("patience must be", probs, final, y, costs, budget=1.0, criterion="patience", patience=0)
    with pytest.raises(CalibrationError, match="E = 4 exits"):
        cal = calibrate_thresholds(probs, final, y, costs, budget=1.0)
        exit_decisions(probs[:3], cal)
