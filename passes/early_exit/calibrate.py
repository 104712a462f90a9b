"""Threshold calibration: per-exit thresholds that save the most compute within an accuracy budget.

Given every exit's probabilities on calibration rows (out-of-fold ones for fitted heads, so that they
are as confident as they will be on new data), :func:`calibrate_thresholds` picks one threshold per exit
for a criterion of the exit rule (:mod:`dyncompile.runtime.rules.exit_rule`: ``entropy``, ``maxprob``,
``patience``) that minimises the mean cost subject to "accuracy drop <= budget points" (agreement with
the full model when no labels are given). :func:`calibrate_exits` is the pass-level entry point (costs
``k / L``, the full model as the last exit, an optional reference model that shares the budget).
:func:`exit_decisions` applies a :class:`Calibration` to new probabilities with the same numpy rule.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from dyncompile.passes.early_exit.checks import CalibrationError, check_labels, check_probs, check_two_classes
from dyncompile.runtime.rules.exit_rule import (
    CRITERIA,
    LEARNED,
    exit_scores,
    first_exit,
    first_exits,
    softmax,
    thresholds_from_confidence,
)

logger = logging.getLogger(__name__)

__all__ = [
    "CALIBRATION_FORMAT",
    "CRITERIA",
    "LEARNED_ALWAYS",
    "Calibration",
    "Cascade",
    "calibrate_against_reference",
    "calibrate_exits",
    "calibrate_thresholds",
    "criterion_thresholds",
    "exit_decisions",
    "exit_scores",
    "fit_combiner",
    "reference_budget",
]

CALIBRATION_FORMAT = "dyncompile.exit_calibration/v1"
#: "always fires" for the learned criterion's logit score, finite so that plans stay strict JSON.
LEARNED_ALWAYS = -1e30


@dataclasses.dataclass
class Calibration:
    """Per-exit thresholds and what they are expected to give (measured on the calibration rows).

    Attributes:
        thresholds: one per exit; ``None`` = that exit never fires; the last exit always stops (its
            entry is ignored, calibration stores ``None``). Semantics per ``criterion``: see
            :mod:`dyncompile.runtime.rules.exit_rule` (entropy: exit when ``H < t``; maxprob: when ``max p > t``; patience: when the
            last ``patience`` exits agree and ``max p > t``).
        criterion: ``"entropy"``, ``"maxprob"`` or ``"patience"``.
        patience: number of consecutive agreeing exits (``patience`` criterion only).
        costs: the cumulative relative costs the calibration optimised (full model = 1.0).
        budget: the accuracy-drop budget asked (points).
        metric: ``"accuracy"`` (labels given) or ``"agreement"`` (with the full model).
        expected_speedup: ``1 / mean cost`` on the calibration rows.
        expected_accuracy, baseline_accuracy: % with early exit / of the full model (``None`` without labels).
        expected_agreement: % of rows whose early-exit prediction equals the full model's.
        exit_histogram: rows stopping at each exit.
        warnings: things the caller should know (small set for the budget, nothing exits, ...).
        reference: set when the budget is measured against another model than the one whose exits were
            calibrated (e.g. the fp32 original of an int8 model; see :func:`reference_budget`): that
            model's accuracy, the part of the budget the model itself already spends, and the part left
            to the exits.
    """

    thresholds: list[float | None]
    criterion: str
    patience: int
    costs: list[float]
    budget: float
    metric: str
    expected_speedup: float
    expected_accuracy: float | None
    baseline_accuracy: float | None
    expected_agreement: float
    exit_histogram: list[int]
    warnings: list[str] = dataclasses.field(default_factory=list)
    n_rows: int = 0
    reference: dict[str, Any] | None = None

    @property
    def num_exits(self) -> int:
        """Number of exits, the last (the full model) included."""
        return len(self.thresholds)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able record (with its format tag), as stored in a plan."""
        d = dataclasses.asdict(self)
        d["format"] = CALIBRATION_FORMAT
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Calibration:
        """Read a record written by :meth:`to_dict`; :class:`CalibrationError` for anything else."""
        if not isinstance(d, dict) or d.get("format") != CALIBRATION_FORMAT:
            raise CalibrationError(f"not an exit calibration (expected format {CALIBRATION_FORMAT!r})")
        fields = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in d.items() if k in fields})
        except TypeError as exc:
            raise CalibrationError(f"exit calibration description is incomplete: {exc}") from exc


def criterion_thresholds(tc: np.ndarray, criterion: str, n_classes: int) -> list[float | None]:
    """Confidence thresholds ``tc`` (``+inf`` = never) in the criterion's units; the last exit is ``None``.

    The learned criterion compares its logit score as it is; "always" becomes :data:`LEARNED_ALWAYS`.
    """
    if criterion != LEARNED:
        return thresholds_from_confidence(tc, criterion, n_classes)
    return [None if (e == len(tc) - 1 or t == np.inf) else (LEARNED_ALWAYS if t == -np.inf else float(t))
            for e, t in enumerate(tc)]


def exit_decisions(exit_probs: np.ndarray, calibration: Calibration, policy=None) -> np.ndarray:
    """Exit index ``[N]`` (0-based) at which each row stops under ``calibration``.

    The rule calibration optimised (:func:`dyncompile.runtime.rules.exit_rule.first_exits`): first exit whose
    test fires, else the last exit. Works for the runtime's reference check on new data as well. The
    learned criterion needs its fitted ``policy`` (:class:`~dyncompile.runtime.rules.exit_policy.ExitPolicy`).
    """
    if calibration.criterion == LEARNED:
        p = np.asarray(exit_probs)
        if policy is None:
            raise CalibrationError("the learned criterion's exit decisions need its fitted exit policy")
        tc = np.array([np.inf if t is None else float(t) for t in calibration.thresholds], np.float64)
        return first_exit(exit_scores(p, LEARNED, policy=policy), tc).astype(np.int64)
    p = np.asarray(exit_probs)
    if p.ndim != 3 or p.shape[0] != calibration.num_exits:
        raise CalibrationError(
            f"exit_probs must be [E, N, C] with E = {calibration.num_exits} exits (as calibrated), got shape {p.shape}"
        )
    if calibration.criterion not in CRITERIA:
        raise CalibrationError(f"unknown criterion {calibration.criterion!r}; use one of {', '.join(CRITERIA)}")
    return first_exits(p, calibration.thresholds, calibration.criterion, calibration.patience)


def fit_combiner(log_t: np.ndarray, log_e: np.ndarray, labels: np.ndarray, ridge: float = 1e-3) -> np.ndarray:
    """Posterior P(y | full model, exit) as softmax(a log q + b log p + c) fitted by Newton on the labels.

    A conditional-logit model with C + 1 parameters (a, b, class biases c[1:]); returns [N, C] probabilities.
    """
    n, c = log_t.shape
    phi = np.zeros((n, c, c + 1))
    phi[:, :, 0] = log_t
    phi[:, :, 1] = log_e
    for k in range(1, c):
        phi[:, k, k + 1] = 1.0
    theta = np.zeros(c + 1)
    theta[0] = 1.0
    rows = np.arange(n)
    for _ in range(50):
        z = phi @ theta
        pr = softmax(z)
        mean_phi = np.einsum("nk,nkd->nd", pr, phi)
        grad = (mean_phi - phi[rows, labels]).sum(axis=0) + ridge * theta
        centred = phi - mean_phi[:, None, :]
        hess = np.einsum("nk,nkd,nke->de", pr, centred, centred) + ridge * np.eye(c + 1)
        step = np.linalg.solve(hess, grad)
        theta -= step
        if np.abs(step).max() < 1e-8:
            break
    return softmax(phi @ theta)


class Cascade:
    """Exact evaluation and coordinate-wise optimisation of per-exit confidence thresholds.

    Works in 'confidence' space: exit e fires when score[e, n] > tc[e] (tc = +inf: never; the last
    exit always stops). ``gains`` are [M, E, N] per-row 'value' matrices (e.g. correctness); constraint
    m holds when the sum over rows of gains[m, exit(n), n] is >= required[m]. The Lagrangian phase
    trades cost against gains[0].
    """

    def __init__(self, scores: np.ndarray, gains: np.ndarray, required: np.ndarray, costs: np.ndarray):
        self.scores = scores  # [E, N] float64
        self.gains = gains.astype(np.float64)  # [M, E, N]
        self.required = required.astype(np.float64)  # [M]
        self.costs = costs  # [E]
        self.n_exits, self.n = scores.shape
        self.cols = np.arange(self.n)
        self.order = [np.argsort(-scores[e], kind="stable") for e in range(self.n_exits)]

    def evaluate(self, tc: np.ndarray) -> tuple[float, np.ndarray]:
        """``(total cost, totals [M])`` of the thresholds ``tc`` on these rows."""
        ex = first_exit(self.scores, tc)
        return float(self.costs[ex].sum()), self.gains[:, ex, self.cols].sum(axis=1)

    def feasible(self, totals: np.ndarray) -> np.ndarray:
        """Whether ``totals`` ``[M]`` (or each column of ``[M, K]``) meets every constraint."""
        return np.all(totals >= self.required[:, None] - 1e-9, axis=0) if totals.ndim == 2 else bool(
            np.all(totals >= self.required - 1e-9)
        )

    def coordinate_options(self, tc: np.ndarray, e: int):
        """All distinct settings of tc[e] with the other thresholds fixed.

        Returns (thresholds [K+1], total_cost [K+1], totals [M, K+1]); option 0 is 'never'.
        """
        fires = self.scores > tc[:, None]
        fires[-1] = True
        reach = ~fires[:e].any(axis=0) if e > 0 else np.ones(self.n, bool)
        after = fires[e + 1 :]
        rest = e + 1 + after.argmax(axis=0)  # where a row goes if it does not stop at e or before
        ex = fires.argmax(axis=0)
        ex_off = np.where(reach, rest, ex)  # exit e switched off
        base_cost = self.costs[ex_off].sum()
        base_tot = self.gains[:, ex_off, self.cols].sum(axis=1)
        order = self.order[e]
        order = order[reach[order]]
        sc = self.scores[e, order]
        finite = np.isfinite(sc)
        order, sc = order[finite], sc[finite]
        if len(order) == 0:
            return np.array([np.inf]), np.array([base_cost]), base_tot[:, None], 0
        dcost = np.cumsum(self.costs[e] - self.costs[rest[order]])
        dtot = np.cumsum(self.gains[:, e, order] - self.gains[:, rest[order], order], axis=1)
        # cut only between distinct values: last index of each group of equal scores
        last = np.flatnonzero(np.r_[sc[1:] != sc[:-1], True])
        lower = np.r_[sc[last[:-1] + 1], -np.inf]  # the next distinct value below each cut
        thr = np.where(np.isfinite(lower), 0.5 * (sc[last] + lower), -np.inf)
        current = int(np.searchsorted(-sc[last], -tc[e], side="left"))  # groups above tc[e] now
        return (
            np.r_[np.inf, thr],
            np.r_[base_cost, base_cost + dcost[last]],
            np.concatenate([base_tot[:, None], base_tot[:, None] + dtot[:, last]], axis=1),
            current,
        )

    def ascend(self, tc: np.ndarray, lam: float | None, max_sweeps: int = 30) -> np.ndarray:
        """Coordinate ascent over the thresholds, from ``tc``.

        ``lam`` given: maximise ``-cost + lam * total[0]`` (unconstrained). ``lam`` None: minimise cost subject
        to every constraint (``tc`` must start feasible).
        """
        tc = tc.copy()
        for _ in range(max_sweeps):
            changed = False
            for e in range(self.n_exits - 1):
                thr, cost, tot, cur = self.coordinate_options(tc, e)
                if lam is not None:
                    obj = -cost + lam * tot[0]
                else:
                    obj = np.where(self.feasible(tot), -cost, -np.inf)
                best = int(np.argmax(obj))
                if obj[best] > obj[cur] + 1e-9:  # strict improvement only: guarantees termination
                    tc[e] = thr[best]
                    changed = True
            if not changed:
                break
        return tc


def calibrate_thresholds(
    exit_probs: np.ndarray,
    final_probs: np.ndarray,
    labels: np.ndarray | None,
    costs: Sequence[float],
    *,
    budget: float,
    criterion: str = "entropy",
    patience: int = 2,
    policy=None,
) -> Calibration:
    """Choose per-exit thresholds that save the most compute within an accuracy-drop budget.

    Objective: minimise the mean cost ``mean_n costs[exit(n)]`` subject to
    ``accuracy(early exit) >= accuracy(full model) - budget`` on these rows (with ``labels=None``:
    ``agreement with the full model >= 100 - budget``). The budget is turned into a number of rows,
    ``floor(budget / 100 * N)``, so the constraint holds exactly on the calibration data.

    With labels, the accuracy drop is constrained two ways at once (:func:`_constraints`):

    * the *empirical* drop: label counts, rows the exit gets right and the full model wrong minus the
      reverse, at most ``floor(budget / 100 * N)`` rows;
    * the *stacked* drop: per exit, a small conditional-logit model of ``P(label | full model's and
      exit's log-probabilities)`` (:func:`fit_combiner`, fitted on the labels) gives the expected change
      in correctness of stopping at that exit, ``r[pred_exit] - r[pred_full]`` per row, summed to at least
      ``-budget / 100 * N``.

    The empirical count alone is a difference of two noisy counts that the optimiser learns to exploit,
    so on new data it overshoots the budget; the stacked estimate has far lower variance and generalises.
    The Lagrangian phase of the search trades cost against the stacked estimate; both constraints must
    hold. Without labels only the empirical agreement count is used.

    Search (:func:`_search`): a Lagrangian sweep over a shared multiplier ``lam`` (rows of accuracy per
    unit of full-model cost) in which, for each ``lam``, exact coordinate ascent sets one exit's threshold
    at a time to the best of *all* its distinct cut points (with the other exits fixed, every cut's cost
    and accuracy come from one sort and cumulative sums), a bisection of ``lam`` where feasibility
    switches on, then a constrained coordinate-ascent polish of every feasible candidate that spends
    whatever budget is left. Thresholds sit midway between adjacent calibration scores.

    Args:
        exit_probs: ``[E, N, C]`` probabilities of every exit (out-of-fold ones for fitted heads; the last
            exit may be the model's own final output).
        final_probs: ``[N, C]`` the full model's probabilities (the accuracy baseline / agreement target).
        labels: ``[N]`` gold labels or ``None``.
        costs: ``[E]`` cumulative relative cost of stopping at each exit (full model = 1.0), e.g. ``k / L``.
        budget: max accuracy drop in percentage points (>= 0).
        criterion: ``"entropy"``, ``"maxprob"``, ``"patience"`` (see :mod:`dyncompile.runtime.rules.exit_rule`) or
            ``"learned"`` (with ``policy``).
        patience: consecutive agreeing exits required by ``"patience"`` (>= 1).
        policy: the fitted :class:`~dyncompile.runtime.rules.exit_policy.ExitPolicy` whose scores the ``learned``
            criterion thresholds.

    Raises:
        CalibrationError: empty input, budget < 0, a single label, mismatched shapes, bad probabilities or costs.
    """
    p, final, cost, budget = _check_inputs(exit_probs, final_probs, costs, budget, criterion, patience,
                                           learned=policy is not None)
    n_exits, n, c = p.shape
    final_pred = final.argmax(axis=1)
    if labels is not None:
        ref = check_labels(labels, n, c)
        check_two_classes(
            ref,
            ": accuracy on such a set says nothing about when exiting early is safe; calibrate on rows of every "
            "class (or pass labels=None to use agreement with the full model)",
        )
    else:
        ref = final_pred
    warnings = _budget_warnings(budget, n)
    gains, required = _constraints(p, final, ref, labels is not None, budget)
    cas = Cascade(exit_scores(p, criterion, patience, policy=policy), gains, required, cost)
    best_tc = _search(cas, warnings)
    cal = Calibration(
        thresholds=criterion_thresholds(best_tc, criterion, c), criterion=criterion, patience=int(patience),
        costs=cost.tolist(), budget=budget, metric="accuracy" if labels is not None else "agreement",
        expected_speedup=0.0, expected_accuracy=None,
        baseline_accuracy=float((final_pred == ref).mean() * 100) if labels is not None else None,
        expected_agreement=0.0, exit_histogram=[], warnings=warnings, n_rows=n,
    )
    _report(cal, p, final_pred, ref if labels is not None else None, policy)
    return cal


def _check_inputs(exit_probs, final_probs, costs, budget, criterion: str, patience, learned: bool = False) -> tuple:
    """Validated ``(exit_probs [E, N, C], final_probs [N, C], costs [E] float64, budget float)``."""
    allowed = (*CRITERIA, LEARNED) if learned else CRITERIA
    if criterion not in allowed:
        raise CalibrationError(f"unknown criterion {criterion!r}; use one of {', '.join(CRITERIA)}"
                               + (" (learned needs its fitted exit policy)" if criterion == LEARNED else ""))
    if not isinstance(patience, int | np.integer) or isinstance(patience, bool) or patience < 1:
        raise CalibrationError(f"patience must be an int >= 1 (consecutive agreeing exits), got {patience!r}")
    try:
        budget = float(budget)
    except (TypeError, ValueError) as exc:
        raise CalibrationError(f"budget must be a number of accuracy points, got {budget!r}") from exc
    if not math.isfinite(budget) or budget < 0:
        raise CalibrationError(
            f"budget must be a finite accuracy drop >= 0 (in points, e.g. 1.0 = one point), got {budget}"
        )
    p = np.asarray(exit_probs)
    if p.ndim != 3:
        raise CalibrationError(f"exit_probs must be [E, N, C] (exits, rows, classes), got shape {p.shape}")
    n_exits, n, c = p.shape
    if n_exits == 0 or n == 0:
        raise CalibrationError(
            f"nothing to calibrate on: exit_probs has {n_exits} exits and {n} rows; pass the calibration "
            "set's probabilities of every exit"
        )
    if c < 2:
        raise CalibrationError(f"exit_probs has {c} class(es); a classifier needs at least 2")
    final = np.asarray(final_probs)
    if final.shape != (n, c):
        raise CalibrationError(
            f"final_probs must be [N, C] = ({n}, {c}) to match exit_probs {p.shape}, got {final.shape}"
        )
    check_probs(p, "exit_probs", "pass softmax probabilities of every exit")
    check_probs(final, "final_probs", "pass the full model's softmax output")
    cost = np.asarray(costs, dtype=np.float64)
    if cost.shape != (n_exits,):
        raise CalibrationError(f"costs must have one entry per exit ({n_exits}), got shape {cost.shape}")
    if not np.all(np.isfinite(cost)) or np.any(cost <= 0) or np.any(np.diff(cost) < 0):
        raise CalibrationError(
            f"costs must be positive, finite and non-decreasing (cumulative cost of stopping at each exit, "
            f"full model = 1.0, e.g. k/L), got {cost.tolist()}"
        )
    return p, final, cost, budget


def _budget_warnings(budget: float, n: int) -> list[str]:
    """A budget of fewer than 10 rows gives noisy thresholds: say so, and how many rows would do."""
    if 0 < budget / 100.0 * n < 10:
        return [
            f"the budget of {budget:g} points is only {budget / 100.0 * n:.1f} of the {n} calibration rows: "
            f"thresholds will be noisy and the drop on new data may exceed the budget; use at least "
            f"{math.ceil(1000.0 / budget)} calibration rows or a larger budget"
        ]
    return []


def _constraints(
    p: np.ndarray, final: np.ndarray, ref: np.ndarray, labelled: bool, budget: float
) -> tuple[np.ndarray, np.ndarray]:
    """``(gains [M, E, N], required [M])``: constraint ``m`` holds when ``sum_n gains[m, exit(n), n] >= required[m]``.

    With labels: ``[stacked, empirical]`` (the Lagrangian phase trades cost against the first); without:
    ``[empirical]`` (agreement with the full model).
    """
    n_exits, n, _ = p.shape
    final_pred = final.argmax(axis=1)
    pred = p.argmax(axis=2)
    cols = np.arange(n)
    gains, required = [], []
    if labelled:
        # per exit: expected change in correctness when stopping there, under P(y | full model, exit)
        log_final = np.log(np.clip(final.astype(np.float64), 1e-30, 1.0))
        stacked = np.zeros((n_exits, n))
        for e in range(n_exits):
            r = fit_combiner(log_final, np.log(np.clip(p[e].astype(np.float64), 1e-30, 1.0)), ref)
            stacked[e] = r[cols, pred[e]] - r[cols, final_pred]
        gains.append(stacked)
        required.append(-budget / 100.0 * n)
    # change in correctness vs the full model per (exit, row), at most floor(budget% of N) rows lost
    correct = (pred == ref[None, :]).astype(np.float64)  # [E, N]
    gains.append(correct - (final_pred == ref)[None, :])
    required.append(-float(math.floor(budget / 100.0 * n + 1e-9)))
    return np.stack(gains), np.array(required)


def _search(cas: Cascade, warnings: list[str]) -> np.ndarray:
    """The cheapest feasible confidence thresholds found (``+inf`` everywhere when nothing is feasible)."""
    never = np.full(cas.n_exits, np.inf)
    best_tc = never
    best_cost, tot = cas.evaluate(never)
    if not cas.feasible(tot):
        warnings.append(
            "even with no early exit the last exit misses the budget against the full model; make the "
            "last exit the full model's own output"
        )
        return best_tc
    candidates: list[np.ndarray] = [never]
    feasible_lams: list[float] = []
    infeasible_lams: list[float] = []
    for lam in np.geomspace(1e-3, 1e3, 25):
        tc = cas.ascend(never, lam=float(lam))
        if cas.feasible(cas.evaluate(tc)[1]):
            candidates.append(tc)
            feasible_lams.append(float(lam))
        else:
            infeasible_lams.append(float(lam))
    # refine the multiplier where feasibility switches on (bisection in log space)
    if feasible_lams:
        hi = min(feasible_lams)
        lo = max([x for x in infeasible_lams if x < hi], default=None)
        for _ in range(10 if lo is not None else 0):
            mid = math.sqrt(lo * hi)
            tc = cas.ascend(never, lam=mid)
            if cas.feasible(cas.evaluate(tc)[1]):
                candidates.append(tc)
                hi = mid
            else:
                lo = mid
    for tc in candidates:
        tc = cas.ascend(tc, lam=None)
        cst, tot = cas.evaluate(tc)
        if cas.feasible(tot) and cst < best_cost - 1e-9:
            best_tc, best_cost = tc, cst
    return best_tc


def _report(cal: Calibration, p: np.ndarray, final_pred: np.ndarray, labels: np.ndarray | None, policy=None) -> None:
    """Fill ``cal``'s expected figures on the calibration rows, through :func:`exit_decisions` itself."""
    n_exits, n, _ = p.shape
    cols = np.arange(n)
    pred = p.argmax(axis=2)
    ex = exit_decisions(p, cal, policy)
    cost = np.asarray(cal.costs)
    cal.expected_speedup = float(1.0 / cost[ex].mean())
    cal.expected_agreement = float((pred[ex, cols] == final_pred).mean() * 100)
    if labels is not None:
        cal.expected_accuracy = float((pred[ex, cols] == labels).mean() * 100)
    cal.exit_histogram = np.bincount(ex, minlength=n_exits).astype(int).tolist()
    if cal.exit_histogram[-1] == n:
        cal.warnings.append(
            f"no row exits early within a budget of {cal.budget:g} points: the exits are not confident enough "
            "on this data (try a larger budget, better heads, or more calibration rows)"
        )
    logger.info(
        "calibrated %s thresholds (budget %.2f points, %s): speedup %.2fx, agreement %.2f%%, exits %s",
        cal.criterion, cal.budget, cal.metric, cal.expected_speedup, cal.expected_agreement, cal.exit_histogram,
    )

def reference_budget(
    budget: float, probs: np.ndarray, reference_probs: np.ndarray, labels: np.ndarray | None
) -> tuple[float, dict[str, Any]]:
    """The part of a ``budget`` (accuracy points vs a reference model) left for early exit.

    ``probs`` are the full model's probabilities (e.g. the int8 model), ``reference_probs`` the reference's
    (its fp32 original) on the same calibration rows. With labels the model already spends
    ``max(0, acc_ref - acc)`` points; without labels (budget = disagreement with the reference's
    predictions) ``100 - agreement``. What is left, ``max(0, budget - spent)``, is the budget of the exits
    against the model itself, so on these rows ``acc_ref - acc_early_exit <= budget`` (and
    ``disagreement(early exit, reference) <= budget`` by the union bound) whenever ``spent <= budget``.
    A model more accurate than its reference on these rows does not give the exits more than ``budget``
    (``spent >= 0``): a gain of a quantized model on calibration data is noise more often than not.
    """
    probs, reference_probs = np.asarray(probs), np.asarray(reference_probs)
    if probs.shape != reference_probs.shape:
        raise CalibrationError(f"reference probabilities {reference_probs.shape} do not match the model's {probs.shape}")
    n = len(probs)
    pred, ref_pred = probs.argmax(1), reference_probs.argmax(1)
    agree = int((pred == ref_pred).sum())
    info: dict[str, Any] = {"budget_total": float(budget), "agreement_with_reference": round(100.0 * agree / n, 4)}
    if labels is not None:
        y = np.asarray(labels)
        c_ref, c = int((ref_pred == y).sum()), int((pred == y).sum())
        spent = max(0.0, 100.0 * (c_ref - c) / n)
        info.update(metric="accuracy", reference_accuracy=round(100.0 * c_ref / n, 4), model_accuracy=round(100.0 * c / n, 4))
    else:
        spent = 100.0 * (n - agree) / n
        info.update(metric="agreement")
    left = max(0.0, float(budget) - spent)
    info.update(spent_by_model=round(spent, 4), budget_left=round(left, 4), budget_exceeded=bool(spent > budget + 1e-9))
    return left, info


def calibrate_exits(
    oof_probs: np.ndarray,
    teacher: np.ndarray,
    labels: np.ndarray | None,
    exits: Sequence[int],
    num_layers: int,
    *,
    budget: float,
    criterion: str,
    patience: int,
    reference_probs: np.ndarray | None = None,
    policy=None,
) -> Calibration:
    """Thresholds for the head exits (+ the full model as the last exit), costs ``k / L``.

    See :func:`calibrate_against_reference` for ``reference_probs`` and ``policy``.
    """
    exit_probs = np.concatenate([oof_probs, teacher[None].astype(np.float32)])
    costs = [k / num_layers for k in exits] + [1.0]
    return calibrate_against_reference(exit_probs, teacher, labels, costs, budget=budget, criterion=criterion,
                                       patience=patience, reference_probs=reference_probs, policy=policy)


def calibrate_against_reference(
    exit_probs: np.ndarray,
    final_probs: np.ndarray,
    labels: np.ndarray | None,
    costs: Sequence[float],
    *,
    budget: float,
    criterion: str,
    patience: int = 2,
    reference_probs: np.ndarray | None = None,
    policy=None,
) -> Calibration:
    """The uncertified (in-sample) calibration: :func:`calibrate_thresholds`, with an optional reference model.

    ``reference_probs`` (e.g. the fp32 original's probabilities on the same rows, for an int8 model):
    ``budget`` is the total drop against that reference, and the exits get what the model leaves of it
    (:func:`reference_budget`); ``Calibration.budget`` stays the total, ``Calibration.reference`` says how
    it was split. ``policy``: the fitted exit policy of the ``learned`` criterion.
    """
    exit_probs = np.asarray(exit_probs)
    teacher = np.asarray(final_probs)
    info = None
    if reference_probs is not None:
        budget_total = float(budget)
        budget, info = reference_budget(budget_total, teacher, reference_probs, labels)
    cal = calibrate_thresholds(exit_probs, teacher, labels, costs, budget=budget, criterion=criterion,
                               patience=patience, policy=policy)
    if info is not None:
        cal.budget, cal.reference = budget_total, info
        if info["budget_exceeded"]:
            cal.warnings.append(
                f"the model alone already drops {info['spent_by_model']:.2f} points against its reference on the "
                f"calibration rows, more than the budget of {budget_total:g}: exits were calibrated with no budget left"
            )
        n = len(teacher)
        pred = exit_probs[exit_decisions(exit_probs, cal, policy), np.arange(n)].argmax(1)
        ref_pred = np.asarray(reference_probs).argmax(1)
        info["expected_agreement_with_reference"] = round(float((pred == ref_pred).mean() * 100), 4)
        if labels is not None:
            info["expected_drop_vs_reference"] = round(
                float(((ref_pred == np.asarray(labels)).mean() - (pred == np.asarray(labels)).mean()) * 100), 4
            )
    return cal
