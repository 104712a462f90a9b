"""Certified budgets (passes/early_exit/certify.py): bound coverage, fixed-sequence testing, the certificate.

Coverage tests draw many samples from known bounded loss distributions; a bound may miss the true mean
in at most a fraction ``delta`` of draws, so the observed miss rate is checked against ``delta`` plus a
binomial margin (3 standard errors of a rate ``delta`` over the number of draws). The negative control
(the plug-in sample mean) misses about half the time and must fail the same check.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from dyncompile.passes.early_exit.certify import (
    Certificate,
    CertificationError,
    bernstein_ucb,
    betting_rejects,
    betting_ucb,
    certify_exits,
    describe_certificate,
    exit_losses,
    fit_exit_policy,
    fixed_sequence_test,
    hoeffding_ucb,
    parse_confidence,
    split_check_warning,
)
from dyncompile.runtime.rules.exit_policy import ExitPolicy

DELTA = 0.1


def _margin(delta: float, draws: int) -> float:
    return delta + 3.0 * math.sqrt(delta * (1 - delta) / draws)


def _accuracy_drop_losses(rng, n, p_worse=0.03, p_better=0.02):
    """Per-row 1[exit wrong] - 1[full wrong] in {-1, 0, 1}: mean p_worse - p_better."""
    u = rng.random(n)
    return np.where(u < p_worse, 1.0, np.where(u < p_worse + p_better, -1.0, 0.0))


@pytest.mark.parametrize("bound", [betting_ucb, bernstein_ucb])
def test_ucb_covers_the_mean_at_the_stated_rate_and_plug_in_does_not(bound):
    rng = np.random.default_rng(0)
    draws, n, mu = 2000, 300, 0.01
    miss = naive_miss = 0
    for _ in range(draws):
        x = _accuracy_drop_losses(rng, n)
        miss += bound(x, DELTA, -1.0, 1.0) < mu
        naive_miss += x.mean() < mu  # negative control: the plug-in estimate as a "bound"
    assert miss / draws <= _margin(DELTA, draws), miss / draws
    assert naive_miss / draws > _margin(DELTA, draws) + 0.2, naive_miss / draws  # ~ half the draws


def test_betting_ucb_covers_bernoulli_disagreement():
    rng = np.random.default_rng(1)
    draws, n, p = 2000, 400, 0.03
    miss = sum(betting_ucb((rng.random(n) < p).astype(float), DELTA) < p for _ in range(draws))
    assert miss / draws <= _margin(DELTA, draws), miss / draws


def test_betting_is_tighter_than_bernstein_and_hoeffding_on_rare_losses():
    x = _accuracy_drop_losses(np.random.default_rng(2), 1400)
    bet, eb, hoef = (f(x, DELTA, -1.0, 1.0) for f in (betting_ucb, bernstein_ucb, hoeffding_ucb))
    assert x.mean() < bet < eb < hoef, (x.mean(), bet, eb, hoef)
    assert hoef - x.mean() > 3 * (bet - x.mean())  # Hoeffding ignores the small variance


def test_betting_test_and_bound_agree():
    x = _accuracy_drop_losses(np.random.default_rng(3), 800)
    u = betting_ucb(x, DELTA, -1.0, 1.0)
    assert betting_rejects(x, u + 1e-4, DELTA, -1.0, 1.0)
    assert not betting_rejects(x, u - 1e-4, DELTA, -1.0, 1.0)


def test_fixed_sequence_test_stops_at_the_first_unsafe_point():
    rng = np.random.default_rng(4)
    n = 2000
    risks = [0.0, 0.002, 0.005, 0.01, 0.2, 0.0]  # point 4 is unsafe; point 5 is safe but after it
    losses = np.stack([(rng.random(n) < r).astype(float) for r in risks])
    chosen, bounds = fixed_sequence_test(losses, 0.05, DELTA, 0.0, 1.0)
    assert chosen == 3
    assert len(bounds) == 5 and bounds[4] > 0.05 >= bounds[3]


def _synthetic(n, seed, n_exits=4):
    """Exit probabilities whose later exits agree more with the full model (2 classes)."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    full_right = rng.random(n) < 0.9
    full_pred = np.where(full_right, y, 1 - y)
    difficulty = rng.random(n)
    probs = []
    for e in range(n_exits):
        skill = 1.5 + 1.5 * e
        conf = 1.0 / (1.0 + np.exp(-(skill * (1.0 - difficulty) - 0.5 + rng.normal(0, 0.5, n))))
        agree = rng.random(n) < 0.5 + 0.5 * conf
        pred = np.where(agree, full_pred, 1 - full_pred)
        pmax = 0.5 + 0.5 * conf
        p = np.where(pred[:, None] == np.arange(2)[None, :], pmax[:, None], 1 - pmax[:, None])
        probs.append(p)
    final = np.where(full_pred[:, None] == np.arange(2)[None, :], 0.95, 0.05)
    probs.append(final)
    return np.stack(probs).astype(np.float32), final, y


COSTS = [0.25, 0.5, 0.75, 1.0, 1.0]


@pytest.mark.parametrize("criterion", ["entropy", "learned"])
def test_certified_budget_holds_on_fresh_rows(criterion):
    p, final, y = _synthetic(3000, seed=5)
    res = certify_exits(p, final, y, COSTS[: p.shape[0]], budget=2.0, confidence=0.9, criterion=criterion)
    c = res.certificate
    assert c.certified and c.mode == "labels" and c.bound <= 2.0 and c.observed <= c.bound
    assert c.rows + c.path_rows == 3000 and c.rows == 2100
    assert c.expected_speedup > 1.0
    # the chosen thresholds on 100,000 fresh rows of the same distribution: drop within the budget
    q, qfinal, qy = _synthetic(100_000, seed=6)
    if criterion == "learned":
        scores = res.policy.scores(q)
        tc = np.array([np.inf if t is None else t for t in res.thresholds])
    else:
        from dyncompile.runtime.rules.exit_rule import exit_scores

        scores = exit_scores(q, "entropy")
        tc = np.array([np.inf if t is None else -t for t in res.thresholds])
    fires = scores > tc[:, None]
    fires[-1] = True
    ex = fires.argmax(0)
    loss = exit_losses(q, qfinal.argmax(1), qy)[ex, np.arange(len(qy))]
    assert 100 * loss.mean() <= 2.0


def test_agreement_mode_without_labels():
    p, final, _ = _synthetic(3000, seed=7)
    res = certify_exits(p, final, None, COSTS[: p.shape[0]], budget=3.0, confidence=0.9)
    c = res.certificate
    assert c.mode == "agreement" and c.certified and c.bound <= 3.0
    assert "disagreement" in describe_certificate(c.to_dict())


def test_tiny_calibration_set_says_what_budget_it_can_certify():
    p, final, y = _synthetic(150, seed=8)
    with pytest.raises(CertificationError) as ei:
        certify_exits(p, final, y, COSTS[: p.shape[0]], budget=0.5, confidence=0.9)
    msg = str(ei.value)
    assert "cannot be certified at 90 % confidence on 104 calibration rows" in msg  # 70 % of 150, stratified
    assert f"use --budget {ei.value.certifiable_budget:g} or more" in msg
    assert ei.value.certifiable_budget > 0.5
    with pytest.raises(CertificationError, match="too few to certify"):
        certify_exits(p[:, :40], final[:40], y[:40], COSTS[: p.shape[0]], budget=1.0)


def test_uncertified_mode_is_named_so_and_keeps_the_budget_in_sample():
    p, final, y = _synthetic(2000, seed=9)
    res = certify_exits(p, final, y, COSTS[: p.shape[0]], budget=1.0, confidence=None)
    c = res.certificate
    assert c.confidence is None and not c.certified and c.observed <= 1.0
    assert "NOT certified" in describe_certificate(c.to_dict())


@pytest.mark.parametrize("with_labels", [True, False])
def test_uncertified_learned_criterion_keeps_the_budget_in_sample(with_labels):
    """The early-exit pass's learned criterion without a certificate goes through the in-sample search the other
    criteria use: the budget holds on the calibration rows, in both modes, and the policy's decisions give the
    histogram."""
    from dyncompile.passes.early_exit.calibrate import Calibration, exit_decisions
    from dyncompile.passes.early_exit.certify import uncertified_exits

    p, final, y = _synthetic(2000, seed=11)
    labels = y if with_labels else None
    res = uncertified_exits(p, final, labels, COSTS[: p.shape[0]], budget=2.0, criterion="learned")
    assert res.policy is not None and res.certificate.confidence is None and not res.certificate.certified
    assert res.certificate.observed <= 2.0 and res.certificate.expected_speedup > 1.0
    cal = Calibration(thresholds=res.thresholds, criterion="learned", patience=2, costs=COSTS, budget=2.0,
                      metric="accuracy", expected_speedup=0.0, expected_accuracy=None, baseline_accuracy=None,
                      expected_agreement=0.0, exit_histogram=[])
    ex = exit_decisions(p, cal, res.policy)
    assert np.bincount(ex, minlength=p.shape[0]).tolist() == res.exit_histogram
    losses = exit_losses(p, final.argmax(-1), labels)
    assert 100 * losses[ex, np.arange(p.shape[1])].mean() == pytest.approx(res.certificate.observed, abs=1e-3)


def test_certificate_round_trip_and_description():
    p, final, y = _synthetic(2000, seed=10)
    c = certify_exits(p, final, y, COSTS[: p.shape[0]], budget=2.0).certificate
    d = c.to_dict()
    assert Certificate.from_dict(d) == c
    line = describe_certificate(d)
    assert line.startswith(f"budget 2.0 points of accuracy certified at 90 % confidence on {c.rows} rows: observed")
    assert f"bound {c.bound:.2f}" in line


def test_learned_policy_scores_agreement():
    p, final, _ = _synthetic(2000, seed=11)
    pol = fit_exit_policy(p, final.argmax(1))
    assert pol.weights[-1] is None and len(pol.weights) == p.shape[0]
    assert all(a is not None and a > 0.6 for a in pol.info["auc_in_sample"])
    again = ExitPolicy.from_dict(pol.to_dict())
    np.testing.assert_array_equal(again.scores(p), pol.scores(p))


@pytest.mark.parametrize("value,expected", [("0.9", 0.9), ("95%", 0.95), ("none", None), (None, 0.9), ("90%", 0.9)])
def test_parse_confidence(value, expected):
    assert parse_confidence(value) == expected


@pytest.mark.parametrize("value", ["abc", "0", "1", "-0.5", "90", "100%"])
def test_parse_confidence_rejects(value):
    with pytest.raises(Exception, match="--confidence"):
        parse_confidence(value)


def test_split_check_records_what_the_other_splits_certify():
    p, final, y = _synthetic(2000, seed=12)
    res = certify_exits(p, final, y, COSTS[: p.shape[0]], budget=2.0, criterion="learned")
    check = res.certificate.split_check
    assert check["seeds"] == list(range(1, 9))
    for s, speed in zip(check["seeds"], check["expected_speedups"], strict=True):
        try:
            other = certify_exits(p, final, y, COSTS[: p.shape[0]], budget=2.0, criterion="learned", seed=s, split_check=0)
            assert other.certificate.expected_speedup == speed  # each entry is that split's own certificate
        except CertificationError:
            assert speed == 1.0
    assert check["rank"] == 1 + sum(v > res.certificate.expected_speedup for v in check["expected_speedups"])
    assert check["median"] == pytest.approx(float(np.median(check["expected_speedups"])), abs=1e-4)
    assert f"this split ranks {check['rank']} of 9" in describe_certificate(res.certificate.to_dict())
    # no check without a certificate, with explicit path rows, or when turned off
    assert certify_exits(p, final, y, COSTS[: p.shape[0]], budget=2.0, confidence=None).certificate.split_check is None
    assert certify_exits(p, final, y, COSTS[: p.shape[0]], budget=2.0, path_rows=np.arange(600)).certificate.split_check is None
    assert certify_exits(p, final, y, COSTS[: p.shape[0]], budget=2.0, split_check=0).certificate.split_check is None


def test_split_check_warns_only_when_this_split_certifies_the_most():
    p, final, y = _synthetic(2000, seed=12)
    c = certify_exits(p, final, y, COSTS[: p.shape[0]], budget=2.0, split_check=0).certificate
    top = dataclasses.replace(c, split_check={"seeds": [1, 2], "expected_speedups": [1.2, 1.1], "median": 1.15, "rank": 1})
    second = dataclasses.replace(top, split_check=top.split_check | {"rank": 2})
    assert split_check_warning(top).startswith(f"the calibration split (seed 0) certifies {c.expected_speedup:.2f}x")
    assert split_check_warning(second) is None and split_check_warning(c) is None


@pytest.mark.parametrize(("stem", "criterion", "warned"), [("minilm-l6-per-token-int8", "learned", True),
                                                           ("mpnet-base-mixed-int8", "entropy", False)])
def test_split_check_on_the_stored_real_calibration_arrays(stem, criterion, warned):
    """MiniLM-L6 int8 x trained exits: the compile's split is the favourable one (it lost 2 points on movie-test at
    budget 1.0); MPNet-base's is a typical one (bench-results/certificate-splits, per-row arrays of the real runs)."""
    from pathlib import Path

    from dyncompile.passes.early_exit.certify import certified_calibration

    z = np.load(Path(__file__).resolve().parent.parent / "bench-results" / "certificate-splits" / f"{stem}.npz",
                allow_pickle=False)
    exits = [int(k) for k in z["exits"]]
    res, record = certified_calibration(z["oof"], z["teacher"], z["labels"], exits, int(z["num_layers"]), budget=1.0,
                                        confidence=0.9, criterion=criterion, reference_probs=z["reference"])
    assert (res.certificate.split_check["rank"] == 1) is warned
    assert any("certifying rows look favourable" in w for w in record["warnings"]) is warned
