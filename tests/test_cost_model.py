"""The draft cost model (dyncompile.runtime.rules.cost_model) against hand-computed values, and the runtime's draft
length controller choosing what the passes' projection chose (one model for both)."""

from __future__ import annotations

import pytest

from dyncompile.runtime.decode.speculative import DraftController
from dyncompile.runtime.rules.cost_model import (
    DEFAULT_VERIFY_SLOPE,
    best_draft_length,
    expected_tokens,
    projected_speedup,
    verify_cost,
    verify_slope,
)

#: verification of s tokens costs 1 + 0.1 (s - 1) target steps, measured at s = 1, 2, 4, 9
LINEAR = {1: 1.0, 2: 1.1, 4: 1.3, 9: 1.8}


@pytest.mark.parametrize("alpha,gamma,expected", [
    (0.5, 2, 1 + 0.5 + 0.25),
    (0.8, 4, 1 + 0.8 + 0.64 + 0.512 + 0.4096),
    (0.0, 5, 1.0),  # nothing accepted: the target's own token only
    (0.9, 0, 1.0),  # no drafts
])
def test_expected_tokens_is_the_geometric_sum(alpha, gamma, expected):
    assert expected_tokens(alpha, gamma) == pytest.approx(expected, rel=1e-12)
    assert expected_tokens(alpha, gamma) == pytest.approx((1 - alpha ** (gamma + 1)) / (1 - alpha), rel=1e-12)


def test_expected_tokens_at_certain_acceptance_is_every_draft_plus_one():
    assert expected_tokens(1.0, 3) == pytest.approx(4.0, abs=1e-4)
    assert expected_tokens(1.5, 3) == expected_tokens(1.0, 3) and expected_tokens(-0.2, 3) == 1.0  # clipped


def test_verify_cost_interpolates_extrapolates_and_falls_back_to_the_slope():
    assert verify_cost(1, LINEAR) == 1.0 and verify_cost(4, LINEAR) == pytest.approx(1.3)
    assert verify_cost(3, LINEAR) == pytest.approx(1.2)  # halfway between 2 (1.1) and 4 (1.3)
    assert verify_cost(6, LINEAR) == pytest.approx(1.3 + 2 * (1.8 - 1.3) / 5)
    assert verify_cost(11, LINEAR) == pytest.approx(1.8 + 2 * (1.8 - 1.0) / 8)  # the line through s=1 and s=9
    assert verify_cost(5, None) == pytest.approx(1 + 4 * DEFAULT_VERIFY_SLOPE)
    assert verify_cost(5, {1: 1.0}) == verify_cost(5, None)  # one point is no table
    assert verify_cost(5, {}, slope=0.25) == pytest.approx(2.0)


def test_verify_slope():
    assert verify_slope(LINEAR) == pytest.approx(0.1)
    assert verify_slope({1: 1.0, 2: 3.0}) == pytest.approx(2.0)
    assert verify_slope({1: 1.0, 4: 0.7}) == 0.0  # never negative
    assert verify_slope({1: 1.0}) == DEFAULT_VERIFY_SLOPE


def test_projected_speedup_by_hand():
    # alpha 0.8, a draft token costs 0.1 target steps; speedup(g) = E(0.8, g) / (0.1 g + 1 + 0.1 g):
    # g=1: 1.8/1.2 = 1.5; g=2: 2.44/1.4; g=3: 2.952/1.6; g=4: 3.3616/1.8 = 1.8676 (best); g=5: 3.68928/2.0
    speed, g = projected_speedup(0.8, 0.1, LINEAR, 8)
    assert g == 4 and speed == pytest.approx(3.3616 / 1.8, rel=1e-9)
    assert projected_speedup(0.8, 0.1, LINEAR, 3) == pytest.approx((2.952 / 1.6, 3))  # capped at max_draft
    # a drafter that is never right: one draft is the least bad, and it is slower than the target alone
    speed, g = projected_speedup(0.0, 0.3, LINEAR, 8)
    assert g == 1 and speed == pytest.approx(1 / 1.4)


def test_best_draft_length_takes_the_first_of_equals_and_nothing_for_no_lengths():
    assert best_draft_length(0.5, 0.0, lambda s: 1.0 + 0 * s, range(1, 4)) == pytest.approx((1.875, 3))
    assert best_draft_length(0.0, 0.0, lambda s: 1.0, range(1, 4)) == (1.0, 1)  # all equal: the first
    assert best_draft_length(0.9, 0.1, lambda s: 1.0, range(0)) == (0.0, 0)


def test_the_runtime_controller_picks_the_projected_draft_length():
    """The plan's projection and the runtime's choice come from one model: same alpha and costs, same gamma."""
    for alpha, cost, table in [(0.8, 0.1, LINEAR), (0.6, 0.05, LINEAR), (0.9, 0.3, {1: 1.0, 2: 1.05, 9: 1.4})]:
        _, projected = projected_speedup(alpha, cost, table, 8)
        ctl = DraftController(initial=1, min_len=0, max_len=8, alpha0=alpha, draft_cost=cost, verify_cost=table)
        assert ctl.next_length(8) == 1  # the first round tries the plan's initial length
        assert ctl.next_length(8) == projected, (alpha, cost, table)
