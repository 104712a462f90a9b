"""The re-split honesty bench's bookkeeping (tools/studies/early_exit_resplit) on synthetic exits."""

from __future__ import annotations

import numpy as np
import pytest

from dyncompile.tools.studies import early_exit_resplit as rs


def _probs(n=600, n_exits=3, seed=0):
    """Exits that get better with depth; labels; the full model's probabilities."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    sign = np.where(y == 1, 1.0, -1.0)
    ps = []
    for e in range(n_exits + 1):
        logit = (0.5 + 1.0 * e) * sign + rng.standard_normal(n)
        ps.append(np.stack([1 / (1 + np.exp(logit)), 1 / (1 + np.exp(-logit))], 1))
    p = np.stack(ps).astype(np.float32)
    return p[:-1], p[-1].astype(np.float64), y


@pytest.fixture
def rules(monkeypatch):
    monkeypatch.setattr(rs, "CALIBRATORS", dict(rs.CALIBRATORS))
    costs = [0.25, 0.5, 0.75, 1.0]
    rs.register_calibrator("never", lambda *a: rs.threshold_rule([None, None, None, None], "entropy", costs))
    rs.register_calibrator("always", lambda *a: rs.threshold_rule([9.0, None, None, None], "entropy", costs))
    return costs


def test_resplit_counts_violations_and_speedups(rules):
    probs, teacher, y = _probs()
    feats = [np.zeros((len(y), 1), np.float32)] * 3
    out = rs.resplit(feats, teacher, y, [1, 2, 3], 4, methods=["never", "always", "entropy"], budget=1.0, splits=20,
                     heads="fixed", fixed_probs=probs, progress=False)
    never, always, ent = (out["methods"][m] for m in ("never", "always", "entropy"))
    assert never["mean_drop"] == 0.0 and never["violation_rate"] == 0.0 and never["mean_speedup"] == 1.0
    # exiting every row at the weakest exit loses far more than a point, every time: the negative control
    assert always["violation_rate"] == 1.0 and always["mean_speedup"] == pytest.approx(4.0)
    assert 1.0 < ent["mean_speedup"] < 4.0 and len(ent["per_split"]) == 20
    lo, hi = ent["violation_rate_ci95"]
    assert lo <= ent["violation_rate"] <= hi


def test_register_certified_adapts_the_cert_api(rules):
    """The hook for certified calibration: thresholds in criterion units, a learned policy's own scores."""

    class Res:
        def __init__(self, thresholds, policy=None):
            self.thresholds, self.policy = thresholds, policy

    class Policy:
        def scores(self, p):
            return np.where(np.arange(p.shape[0])[:, None] == 1, 1.0, 0.0) * np.ones(p.shape[:2])

    class Certify:
        @staticmethod
        def certified_calibration(oof, teacher, labels, exits, num_layers, *, budget, confidence, criterion):
            assert confidence == rs.CONFIDENCE
            if criterion == "learned":
                return Res([None, 0.5, None, None], Policy()), {}
            return Res([None, None, None, None]), {}

    assert rs.register_certified(Certify) == ["certified", "learned-certified"]
    probs, teacher, y = _probs(n=40)
    rule = rs.CALIBRATORS["learned-certified"](probs, teacher, y, [1, 2, 3], 4, 1.0)
    ex = rule.decide(np.concatenate([probs, teacher[None].astype(np.float32)]))
    assert (ex == 1).all()  # the policy's score beats 0.5 at exit index 1 only
    ex = rs.CALIBRATORS["certified"](probs, teacher, y, [1, 2, 3], 4, 1.0).decide(np.concatenate([probs, teacher[None]]))
    assert (ex == 3).all()
