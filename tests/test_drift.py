"""The early-exit drift guard (dyncompile.runtime.drift): the test's false-alarm rate, power, edge cases."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest

from dyncompile.errors import DataError
from dyncompile.runtime.drift import check, format_histograms
from dyncompile.runtime.rules.chi2 import chi2_sf, homogeneity_test

LAYERS = [1, 2, 3, 4, 5, 6]
# the shape of a real calibration histogram (MiniLM-L6, budget 1.0, entropy): most rows leave early
P_CAL = np.array([0.40, 0.17, 0.21, 0.16, 0.05, 0.01])


@pytest.mark.parametrize(
    "x, df, want",
    [(3.841458820694124, 1, 0.05), (9.21034037197618, 2, 0.01), (11.070497693516351, 5, 0.05),
     (0.5, 3, 0.918891411654), (40.0, 4, 4.3284e-08), (0.0, 2, 1.0)],
)
def test_chi2_sf_matches_tables(x, df, want):
    assert math.isclose(chi2_sf(x, df), want, rel_tol=1e-4, abs_tol=1e-12)


def test_false_alarm_rate_under_the_calibration_distribution():
    """Calibration and observed rows drawn from one distribution: alarms at rate <= alpha (+ sampling error)."""
    rng = np.random.default_rng(0)
    sims, alpha = 2000, 0.01
    alarms = 0
    for _ in range(sims):
        cal = rng.multinomial(2000, P_CAL)
        obs = rng.multinomial(300, P_CAL)
        v = check(dict(zip(LAYERS, obs.tolist())), (LAYERS, cal.tolist()), alpha=alpha, min_tv=0.0, warn=False)
        alarms += v.drift
    # 3 standard errors of a binomial rate over `sims` draws, + 0.005 for the chi-square approximation
    bound = alpha + 3 * math.sqrt(alpha * (1 - alpha) / sims) + 0.005
    assert alarms / sims <= bound, (alarms / sims, bound)
    assert alarms > 0  # the test is not vacuous (a p-value that is always 1 would pass the bound)


def test_fires_on_a_shifted_histogram():
    """Negative control for the test above: rows that exit later than the calibration's are flagged."""
    rng = np.random.default_rng(1)
    shifted = np.array([0.15, 0.10, 0.15, 0.20, 0.15, 0.25])
    hits = 0
    for _ in range(200):
        cal = rng.multinomial(2000, P_CAL)
        obs = rng.multinomial(300, shifted)
        hits += check(dict(zip(LAYERS, obs.tolist())), (LAYERS, cal.tolist()), warn=False).drift
    assert hits / 200 > 0.95


def test_small_shift_below_min_tv_is_not_an_alarm():
    cal = (P_CAL * 2000).round().astype(int)
    near = P_CAL + np.array([-0.03, 0.0, 0.0, 0.0, 0.0, 0.03])
    obs = (near * 20000).round().astype(int)  # a huge sample detects the shift (p tiny) ...
    v = check(dict(zip(LAYERS, obs.tolist())), (LAYERS, cal.tolist()), warn=False)
    assert v.p_value < 1e-6 and v.tv < 0.1
    assert not v.drift and v.verdict == "ok"  # ... but 3 % of rows moving is not a pattern never seen


def test_verdict_fields_warning_and_too_few_rows(caplog):
    cal = (P_CAL * 2000).round().astype(int).tolist()
    late = [6] * 150 + [1] * 10
    with caplog.at_level(logging.WARNING, logger="dyncompile.runtime.drift"):
        v = check(late, (LAYERS, cal))
    assert v.drift and v.verdict == "drift" and v.rows == 160 and v.observed[-1] == 150
    assert "drift guard" in caplog.text and "DRIFT" in v.message
    assert "exit layer" in format_histograms(v)
    few = check(late[:50], (LAYERS, cal))
    assert not few.drift and few.verdict == "too few rows" and few.p_value is None


def test_errors():
    cal = (LAYERS, [10, 10, 10, 10, 10, 10])
    with pytest.raises(DataError, match="not exits of this plan"):
        check([7] * 200, cal)
    with pytest.raises(DataError, match="records no calibration exit distribution"):
        check([1] * 200, {"early_exit": {"calibration": {}}})
    with pytest.raises(DataError, match="alpha"):
        check([1] * 200, cal, alpha=0.0)
    with pytest.raises(DataError, match="one length"):
        homogeneity_test([1, 2], [1, 2, 3])


def test_homogeneity_merges_sparse_bins():
    # the last bins have expected counts < 5: merged, so df < bins - 1
    stat, df, p = homogeneity_test([500, 300, 3, 1], [100, 60, 1, 0])
    assert df == 1 and 0.0 <= p <= 1.0
    assert homogeneity_test([10, 0], [5, 0]) == (0.0, 0, 1.0)
