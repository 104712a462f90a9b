"""The draft cost model of speculative decoding: expected tokens per round, verification cost, speedup.

One round drafts ``gamma`` tokens and verifies them with the target in one call of ``gamma + 1`` tokens.
With each draft accepted independently with probability ``alpha``, a round yields

    E(alpha, gamma) = 1 + alpha + ... + alpha^gamma = (1 - alpha^(gamma + 1)) / (1 - alpha)

tokens (the accepted drafts plus the target's own next token) and costs ``gamma * c + v(gamma + 1)`` in
units of one target decode step, with ``c`` the drafter's cost per token and ``v(s)`` the target's cost
for ``s`` tokens in one call relative to one token. The speedup over the target alone is the ratio.

``v`` comes from a table measured at compile time (``{1: 1.0, 2: 1.1, 4: 1.3, 9: 1.8}``): linear
interpolation inside it, the line through its first and last points beyond it, and ``1 + slope (s - 1)``
when there is no table. The passes use this to choose a drafter (``split-drafter``'s projection), the
runtime to choose each round's draft length (:class:`dyncompile.runtime.decode.speculative.DraftController`):
one model, so the projection is what the runtime then does.

Draft trees (:mod:`dyncompile.runtime.decode.draft_tree`) verify a main chain of ``gamma`` drafts plus ``b`` branch
nodes in one call of ``gamma + 1 + b`` tokens. With ``g`` the tokens one branch node has bought on average
(measured while generating), a round yields about ``E(alpha, gamma) + g b`` tokens for
``gamma c + b c_b + v(gamma + 1 + b)``; :func:`best_tree_extra` picks ``b`` on the measured curve ``v``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import numpy as np

__all__ = [
    "DEFAULT_VERIFY_SLOPE",
    "best_draft_length",
    "best_tree_extra",
    "expected_tokens",
    "projected_speedup",
    "round_rate",
    "verify_cost",
    "verify_slope",
]

#: cost of each token beyond the first in one verification call, relative to a one-token call, when
#: nothing was measured
DEFAULT_VERIFY_SLOPE = 0.1


def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens per verification round with ``gamma`` drafts accepted i.i.d. with probability ``alpha``.

    ``(1 - alpha^(gamma+1)) / (1 - alpha)``; ``alpha`` is clipped to ``[0, 0.999999]`` (at 1 the limit is
    ``gamma + 1``).
    """
    alpha = min(max(alpha, 0.0), 0.999999)
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def verify_cost(s: int, table: Mapping[int, float] | None, slope: float = DEFAULT_VERIFY_SLOPE) -> float:
    """Cost of verifying ``s`` tokens in one call relative to one token.

    With a table of at least two measured sizes: linear interpolation inside it, beyond its largest size the
    line through its smallest and largest entries. Otherwise ``1 + slope * (s - 1)``.
    """
    if table and len(table) >= 2:
        xs = np.array(sorted(table), float)
        ys = np.array([table[int(x)] for x in xs], float)
        if s <= xs[-1]:
            return float(np.interp(s, xs, ys))
        return float(ys[-1] + (s - xs[-1]) * (ys[-1] - ys[0]) / max(xs[-1] - xs[0], 1.0))
    return 1.0 + slope * (s - 1)


def verify_slope(table: Mapping[int, float]) -> float:
    """Least-squares slope of ``v(s) - 1`` over ``s - 1`` (>= 0): the plan's one-number summary of the table."""
    xs = np.array(sorted(table), float)
    ys = np.array([table[int(x)] for x in xs])
    if len(xs) < 2:
        return DEFAULT_VERIFY_SLOPE
    b = np.polyfit(xs - 1, ys - 1, 1)[0]
    return float(max(b, 0.0))


def round_rate(alpha: float, gamma: int, draft_cost: float, verify: float) -> float:
    """Tokens per unit of time of a round: ``E(alpha, gamma) / (gamma * draft_cost + verify)``.

    ``draft_cost`` and ``verify`` (the cost of the ``gamma + 1``-token verification) in the same unit:
    target steps for the plan's model, seconds for measured timings.
    """
    return expected_tokens(alpha, gamma) / (gamma * draft_cost + verify)


def best_draft_length(
    alpha: float, draft_cost: float, verify: Callable[[int], float], lengths: Iterable[int]
) -> tuple[float, int]:
    """``(rate, gamma)`` of the draft length in ``lengths`` with the highest :func:`round_rate`.

    The first of equals; ``verify(s)`` is the cost of an ``s``-token verification. ``(0.0, 0)`` for no lengths.
    """
    best, best_g = 0.0, 0
    for g in lengths:
        r = round_rate(alpha, g, draft_cost, verify(g + 1))
        if best_g == 0 or r > best:
            best, best_g = r, g
    return best, best_g


def projected_speedup(
    alpha: float, cost: float, verify: Mapping[int, float], max_draft: int
) -> tuple[float, int]:
    """``(speedup, best draft length >= 1)`` over the target alone.

    For a drafter accepted with probability ``alpha`` at ``cost`` target steps per draft token;
    ``verify[s]`` = time of s tokens / time of 1.
    """
    return best_draft_length(alpha, cost, lambda s: verify_cost(s, verify), range(1, max_draft + 1))


def best_tree_extra(
    alpha: float, gamma: int, draft_cost: float, branch_cost: float, gain_per_node: float,
    verify: Callable[[int], float], extras: Iterable[int],
) -> tuple[float, int]:
    """``(rate, b)``: the best number of branch nodes ``b`` in ``extras`` beside a main chain of ``gamma`` drafts.

    The one with the highest ``(E(alpha, gamma) + gain_per_node b) / (gamma draft_cost + b branch_cost + v(gamma + 1 + b))``
    (the first of equals).
    """
    base = expected_tokens(alpha, gamma)
    best, best_b = -1.0, 0
    for b in extras:
        r = (base + gain_per_node * b) / (gamma * draft_cost + b * branch_cost + verify(gamma + 1 + b))
        if r > best:
            best, best_b = r, b
    return max(best, 0.0), best_b
