"""Certified early-exit budgets: Learn-then-Test with fixed-sequence testing (numpy only).

The promise ``--budget 1.0 --confidence 0.9`` means: with probability >= 0.9 over the draw of the
calibration rows, the *expected* loss of the chosen exit configuration on new rows from the same
distribution is at most one point, where the per-row loss is

* with labels (``mode="labels"``): ``1[early-exit answer wrong] - 1[reference answer wrong]`` in
  ``{-1, 0, 1}`` — its mean is the accuracy drop against the reference (the full model, or the fp32
  original of a quantized model);
* without labels (``mode="agreement"``): ``1[early-exit answer != reference answer]`` in ``{0, 1}`` — its
  mean is the disagreement rate with the reference.

Method (Angelopoulos, Bates, Candès, Jordan & Lei, "Learn then Test", 2021; the split as in
Laufer-Goldshtein et al., "Efficiently controlling multiple risks with Pareto Testing", ICLR 2023):

1. Split the calibration rows (seeded) into a *path* part (default 30 %) and a *test* part (70 %).
2. On the path part only — fit the learned exit policy if any, then build a path of threshold
   configurations ordered from safe to fast (:func:`threshold_path`: a Lagrangian sweep
   ``max -cost + lam * (-loss)`` over ``lam`` with exact per-exit coordinate ascent, sorted by the
   path part's cost, highest first).
3. On the test part, walk the path in that fixed order and test ``H_j: risk(config_j) > budget`` at
   level ``delta`` each with an upper confidence bound (UCB) of the mean loss; stop at the first
   ``H_j`` not rejected. Fixed-sequence testing controls the family-wise error at ``delta`` without a
   multiplicity correction, so the last rejected configuration has ``risk <= budget`` with probability
   ``>= 1 - delta``.

The UCB (:func:`betting_ucb`, default) is Waudby-Smith & Ramdas' betting confidence bound ("Estimating
means of bounded random variables by betting", JRSS-B 2023) with predictable plug-in bets, as used by
RCPS/LTT: ``K_i(m) = prod_{j<=i} (1 - lam_j (x_j - m))`` is a non-negative supermartingale under
``mean >= m``, so ``max_i K_i(m) >= 1/delta`` rejects it (Ville's inequality). It adapts to the loss
variance — most rows have loss 0, so it is several times tighter than Hoeffding at 1,400 rows.
:func:`bernstein_ucb` (Maurer & Pontil 2009) is the closed-form alternative; :func:`hoeffding_ucb` is
here for comparison only.

Split 30/70: the path part only has to *order* configurations (its noise makes the path a little less
efficient), while the bound's slack shrinks with the test part like ``1/sqrt(n_test)``; on movie-calib
(OOF head probabilities of MiniLM-L6, budget 1.0, 20 seeded splits per fraction;
``bench-results/early-exit-certified/split-study.txt``) the mean certified speedup on the test part was
1.83/1.86/1.84/1.76x (entropy) and 1.85/1.91/1.87/1.75x (learned) for path fractions 0.15/0.2/0.3/0.5:
0.2 and 0.3 are within noise of each other, and 0.3 had the best worst case (1.55x / 1.61x).

What the certificate covers: the exit decisions computed from the probabilities it is given. The
early-exit pass gives the heads' *out-of-fold* probabilities (each row scored by a head fitted without
its fold) and deploys the average of the K fold heads, which is not independent of the test part: the
guarantee is exact for the out-of-fold predictor and approximate for the deployed one (its outputs differ
from any fold head's only by the averaging). The re-split check of the bench measures the deployed plans.

The split is part of the draw the confidence is about, and every compile of the same rows makes the same
split. The split check (:data:`SPLIT_CHECK_SEEDS` more seeds, same rows and budget) records what the other splits
certify (``Certificate.split_check``) and warns when this split certifies more speed than each of them: its
certifying rows then look favourable, the place a certificate's misses come from. It never changes the chosen
thresholds — choosing a split by its outcome would void the guarantee.

Everything here works from stored per-row arrays (exit probabilities, reference probabilities,
labels): :func:`certify_exits` reruns a calibration in well under a second, with no ONNX Runtime.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from dyncompile.passes.early_exit.calibrate import (
    LEARNED_ALWAYS,
    Cascade,
    calibrate_against_reference,
    criterion_thresholds,
    exit_decisions,
)
from dyncompile.passes.early_exit.checks import CalibrationError
from dyncompile.runtime.rules.exit_policy import POLICY_FEATURES, ExitPolicy, policy_features
from dyncompile.runtime.rules.exit_rule import exit_scores, first_exit

__all__ = [
    "CERTIFICATE_FORMAT",
    "LEARNED_ALWAYS",
    "SPLIT_CHECK_SEEDS",
    "UCB_METHODS",
    "Certificate",
    "CertificationError",
    "CertifiedExits",
    "betting_rejects",
    "betting_ucb",
    "bernstein_ucb",
    "certify_exits",
    "certify_scores",
    "exit_losses",
    "fit_exit_policy",
    "fit_logistic",
    "fixed_sequence",
    "fixed_sequence_test",
    "hoeffding_ucb",
    "parse_confidence",
    "split_check_warning",
    "stratified_split",
    "threshold_path",
    "uncertified_exits",
]

CERTIFICATE_FORMAT = "dyncompile.exit_certificate/v1"
DEFAULT_SPLIT = 0.3
DEFAULT_CONFIDENCE = 0.9
#: other split seeds a certified compile also certifies on (same rows, same budget), to say where its own split's
#: certified speed falls among them (``Certificate.split_check``); 0 turns the check off. ~0.3 s a seed on
#: 2,000 rows. On MiniLM-L6 int8 x trained exits the compile's split (seed 0) certified more speed than seeds 1-8
#: at budgets 1.0 and 0.5 and lost 2.00 / 1.00 points on movie-test, where 30 seeds' settings average 1.00 / 0.50
#: (bench-results/certificate-splits).
SPLIT_CHECK_SEEDS = 8


class CertificationError(CalibrationError):
    """The budget cannot be certified; ``certifiable_budget`` is the smallest budget that could be."""

    def __init__(self, message: str, certifiable_budget: float | None = None) -> None:
        super().__init__(message)
        self.certifiable_budget = certifiable_budget


# --------------------------------------------------------------------------------------------------
# upper confidence bounds of the mean of bounded losses


def _check_losses(x: Any, delta: float, lo: float, hi: float) -> np.ndarray:
    x = np.asarray(x, np.float64).ravel()
    if not 0.0 < delta < 1.0:
        raise CalibrationError(f"delta must lie in (0, 1) (1 - confidence), got {delta}")
    if not hi > lo:
        raise CalibrationError(f"the loss range [{lo}, {hi}] is empty")
    if len(x) == 0:
        raise CalibrationError("no rows to bound the risk on")
    if np.any(x < lo - 1e-12) or np.any(x > hi + 1e-12) or not np.all(np.isfinite(x)):
        raise CalibrationError(f"losses must lie in [{lo}, {hi}], found {x.min()}..{x.max()}")
    return np.clip(x, lo, hi)


def _bets(z: np.ndarray, delta: float) -> np.ndarray:
    """Predictable plug-in bets of WSR (before the cap) for losses ``z`` scaled to [0, 1]."""
    n = len(z)
    t = np.arange(1, n + 1, dtype=np.float64)
    mu = (0.5 + np.cumsum(z)) / (t + 1)  # mu_hat_t after seeing x_1..x_t
    var = (0.25 + np.cumsum((z - mu) ** 2)) / (t + 1)  # sigma_hat^2_t
    var_prev = np.r_[0.25, var[:-1]]  # sigma_hat^2_{t-1}: only the past (predictable)
    return np.sqrt(2.0 * math.log(1.0 / delta) / (n * var_prev))


def _log_capital(z: np.ndarray, lam0: np.ndarray, mz: float, c: float = 0.75) -> float:
    lam = np.minimum(lam0, c / max(1.0 - mz, 1e-12))
    f = 1.0 - lam * (z - mz)
    return float(np.max(np.cumsum(np.log(np.maximum(f, 1e-300)))))


def betting_rejects(losses: Any, m: float, delta: float, lo: float = 0.0, hi: float = 1.0) -> bool:
    """Does the betting test reject ``H0: E[loss] >= m`` at level ``delta``? (``max_i K_i(m) >= 1/delta``)."""
    x = _check_losses(losses, delta, lo, hi)
    z = (x - lo) / (hi - lo)
    mz = (m - lo) / (hi - lo)
    if mz >= 1.0:
        return True
    if mz <= 0.0:
        return False
    return _log_capital(z, _bets(z, delta), mz) >= math.log(1.0 / delta)


def betting_ucb(losses: Any, delta: float, lo: float = 0.0, hi: float = 1.0, tol: float = 1e-6) -> float:
    """Waudby-Smith–Ramdas betting UCB of the mean of losses in ``[lo, hi]`` (level ``1 - delta``).

    ``inf {m : max_i K_i(m) >= 1/delta}`` with ``K_i(m) = prod_{j<=i} (1 - lam_j (x_j - m))`` on losses
    scaled to [0, 1], bets ``lam_j = min(sqrt(2 log(1/delta) / (n sigma_{j-1}^2)), 0.75 / (1 - m))``
    (``sigma_{j-1}^2`` the WSR running variance of the earlier rows). Every factor grows with ``m``,
    so the rejected set is ``[ucb, hi]`` and bisection finds its end. The bound depends on the row
    order; pass rows in an order chosen independently of their values (a seeded shuffle).
    """
    x = _check_losses(losses, delta, lo, hi)
    z = (x - lo) / (hi - lo)
    lam0 = _bets(z, delta)
    target = math.log(1.0 / delta)
    a, b = float(z.mean()), 1.0  # the UCB is never below the sample mean
    if _log_capital(z, lam0, a) >= target:
        return lo + a * (hi - lo)
    while b - a > tol:
        mid = 0.5 * (a + b)
        if _log_capital(z, lam0, mid) >= target:
            b = mid
        else:
            a = mid
    return lo + b * (hi - lo)


def bernstein_ucb(losses: Any, delta: float, lo: float = 0.0, hi: float = 1.0) -> float:
    """Empirical-Bernstein UCB (Maurer & Pontil 2009, Thm 4), one-sided, level ``1 - delta``.

    ``mean + sqrt(2 V log(2/delta) / n) + 7 (hi - lo) log(2/delta) / (3 (n - 1))``, ``V`` the unbiased
    sample variance.
    """
    x = _check_losses(losses, delta, lo, hi)
    n = len(x)
    if n < 2:
        return hi
    r = hi - lo
    var = float(x.var(ddof=1))
    ub = float(x.mean()) + math.sqrt(2.0 * var * math.log(2.0 / delta) / n) + 7.0 * r * math.log(2.0 / delta) / (3.0 * (n - 1))
    return min(ub, hi)


def hoeffding_ucb(losses: Any, delta: float, lo: float = 0.0, hi: float = 1.0) -> float:
    """Hoeffding UCB ``mean + (hi - lo) sqrt(log(1/delta) / (2n))`` — for comparison only (too loose)."""
    x = _check_losses(losses, delta, lo, hi)
    return min(float(x.mean()) + (hi - lo) * math.sqrt(math.log(1.0 / delta) / (2.0 * len(x))), hi)


UCB_METHODS = {"betting": betting_ucb, "bernstein": bernstein_ucb}


def fixed_sequence_test(
    losses: np.ndarray, budget: float, delta: float, lo: float, hi: float, method: str = "betting"
) -> tuple[int, list[float]]:
    """Walk the configurations ``losses[0], losses[1], ...`` (``[P, n]``, safe to fast) and certify.

    ``H_j: E[loss_j] > budget`` is rejected when ``UCB_j <= budget``; the walk stops at the first
    ``H_j`` not rejected. Returns ``(index of the last certified configuration or -1, the UCBs computed
    — one per configuration tested, the failing one included)``. Family-wise error <= ``delta``.
    """
    if method not in UCB_METHODS:
        raise CalibrationError(f"unknown bound {method!r}; use one of {', '.join(UCB_METHODS)}")
    ucb = UCB_METHODS[method]
    return fixed_sequence(range(len(losses)), lambda j: ucb(losses[j], delta, lo, hi), lambda u: u <= budget)


def fixed_sequence(candidates: Iterable[Any], evaluate: Callable[[Any], Any],
                   rejects: Callable[[Any], bool]) -> tuple[int, list[Any]]:
    """Fixed-sequence testing: evaluate ``candidates`` in their order until the first whose result is not rejected.

    ``evaluate(candidate)`` gives the result (e.g. an upper bound); ``rejects(result)``: the candidate's null
    hypothesis ("it breaks the budget") is rejected at the level each test is run at. The walk stops at the first
    candidate not rejected, so the family-wise error stays at that level with no multiplicity correction; a
    candidate past it is never evaluated. Returns ``(index of the last rejected candidate or -1, the results
    computed — the failing one included)``. Also the sparsity budget's walk
    (:func:`dyncompile.passes.sparsify_activations.fixed_sequence_walk`).
    """
    chosen, results = -1, []
    for j, c in enumerate(candidates):
        r = evaluate(c)
        results.append(r)
        if not rejects(r):
            break
        chosen = j
    return chosen, results


# --------------------------------------------------------------------------------------------------
# losses, paths, the learned policy


def exit_losses(exit_probs: np.ndarray, reference_pred: np.ndarray, labels: np.ndarray | None) -> np.ndarray:
    """``[E, N]`` loss of each row if it stopped at each exit (module docstring), float64."""
    pred = np.asarray(exit_probs).argmax(-1)
    ref = np.asarray(reference_pred)
    if labels is None:
        return (pred != ref[None, :]).astype(np.float64)
    y = np.asarray(labels)
    return (pred != y[None, :]).astype(np.float64) - (ref != y).astype(np.float64)[None, :]


_first_exit = first_exit


def smooth_risk(policy: ExitPolicy, exit_probs: np.ndarray, losses: np.ndarray) -> np.ndarray:
    """``[E, N]`` expected disagreement ``1 - sigmoid(score)`` of a fitted :class:`ExitPolicy`.

    The last exit gets its observed loss. Up to a factor this is the expected loss: all a path needs to
    order settings.
    """
    s = policy.scores(exit_probs)
    risk = 1.0 / (1.0 + np.exp(np.clip(s, -50, 50)))
    risk[-1] = losses[-1]
    return risk


def threshold_path(
    scores: np.ndarray, losses: np.ndarray, costs: Sequence[float], points: int = 48, max_gap: float = 0.01
) -> list[np.ndarray]:
    """Threshold configurations (confidence space: exit ``e`` fires when ``score > tc[e]``) from safe to fast.

    For ``lam`` on a geometric grid, exact per-exit coordinate ascent of ``-mean cost - lam * mean loss``
    from "no exit" (the calibration's own optimiser), the grid refined by bisection wherever neighbouring
    settings differ by more than ``max_gap`` in mean cost; configurations sorted by their cost on these
    rows, highest first, duplicates and "no exit at all" dropped. Uses only the rows given (the path part).
    """
    cost = np.asarray(costs, np.float64)
    cas = Cascade(np.asarray(scores, np.float64), -np.asarray(losses, np.float64)[None], np.array([-np.inf]), cost)
    never = np.full(len(cost), np.inf)
    n = scores.shape[1]
    never_cost = cas.evaluate(never)[0]
    found: dict[tuple, tuple[float, np.ndarray]] = {}

    def at(lam: float) -> float:
        tc = cas.ascend(never, lam=lam)
        c, _ = cas.evaluate(tc)
        key = tuple(np.round(tc, 12))
        if c < never_cost - 1e-9 and key not in found:
            found[key] = (c, tc)
        return c / n

    lams = list(np.geomspace(1e4, 1e-2, points))
    mean_cost = [at(float(lam)) for lam in lams]
    # refine where neighbouring settings are far apart in cost (bisection in log lam): a fine path keeps the
    # fixed-sequence walk from jumping over the last safe setting
    for _ in range(4 * points):
        gaps = [(abs(mean_cost[i + 1] - mean_cost[i]), i) for i in range(len(lams) - 1)
                if math.log(lams[i] / lams[i + 1]) > 1e-4]  # a jump no lam in between resolves stays a jump
        if not gaps or max(gaps)[0] <= max_gap:
            break
        i = max(gaps)[1]
        mid = math.sqrt(lams[i] * lams[i + 1])
        lams.insert(i + 1, mid)
        mean_cost.insert(i + 1, at(mid))
    return [tc for _, tc in sorted(found.values(), key=lambda ct: -ct[0])]


def _fit_logistic(x: np.ndarray, t: np.ndarray, ridge: float) -> np.ndarray:
    w = np.zeros(x.shape[1])
    for _ in range(100):
        pr = 1.0 / (1.0 + np.exp(-np.clip(x @ w, -50, 50)))
        grad = x.T @ (pr - t) + ridge * np.r_[w[:-1], 0.0]
        hess = (x * (pr * (1 - pr))[:, None]).T @ x + ridge * np.diag(np.r_[np.ones(x.shape[1] - 1), 1e-6])
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.abs(step).max() < 1e-9:
            break
    return w


fit_logistic = _fit_logistic  # public name (passes/routing fits its router head with it)


def fit_exit_policy(exit_probs: np.ndarray, reference_pred: np.ndarray, ridge: float = 1.0) -> ExitPolicy:
    """Fit the learned exit policy: per exit but the last, a ridge logistic regression of agreement.

    The target is ``1[exit answer == reference answer]``, the features
    :data:`~dyncompile.runtime.rules.exit_policy.POLICY_FEATURES`; standardisation is folded into the weights.

    Exits where every row agrees (or none does) get a constant score (the log-odds, clipped).
    """
    p = np.asarray(exit_probs)
    ref = np.asarray(reference_pred)
    n_exits, n, _ = p.shape
    weights: list[list[float] | None] = []
    biases: list[float | None] = []
    aucs: list[float | None] = []
    for e in range(n_exits - 1):
        x = policy_features(p[e], p[e - 1] if e > 0 else None)
        t = (p[e].argmax(-1) == ref).astype(np.float64)
        mu, sd = x.mean(0), x.std(0)
        sd = np.where(sd > 1e-9, sd, np.inf)
        z = (x - mu) / sd
        if t.min() == t.max():
            w = np.zeros(x.shape[1])
            b = float(np.clip(math.log((t.mean() + 0.5 / n) / (1 - t.mean() + 0.5 / n)), -20, 20))
        else:
            wz = _fit_logistic(np.c_[z, np.ones(n)], t, ridge)
            w = wz[:-1] / sd
            b = float(wz[-1] - (mu * w).sum())
        weights.append([float(v) for v in w])
        biases.append(b)
        s = x @ w + b
        aucs.append(_auc(s, t))
    weights.append(None)
    biases.append(None)
    return ExitPolicy(weights, biases, {"rows": int(n), "ridge": ridge, "features": list(POLICY_FEATURES),
                                        "auc_in_sample": aucs})


def _auc(s: np.ndarray, t: np.ndarray) -> float | None:
    pos, neg = s[t == 1], s[t == 0]
    if len(pos) == 0 or len(neg) == 0:
        return None
    order = np.argsort(np.r_[pos, neg], kind="stable")
    ranks = np.empty(len(order))
    ranks[order] = np.arange(1, len(order) + 1)
    return round(float((ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg))), 4)


# --------------------------------------------------------------------------------------------------
# the certificate


@dataclasses.dataclass
class Certificate:
    """What a certified calibration promises and on what evidence.

    Attributes:
        mode: ``"labels"`` (expected accuracy drop) or ``"agreement"`` (expected disagreement rate).
        confidence: ``1 - delta``; ``None`` for the uncertified mode (``--confidence none``).
        delta: the allowed probability that the promise fails (over the calibration draw).
        budget: the budget asked, points.
        rows: calibration rows the bound is computed on (the test part).
        path_rows: calibration rows the path (and the learned policy) were built on.
        method: ``"betting"`` (Waudby-Smith–Ramdas) or ``"bernstein"`` (Maurer–Pontil).
        certified: whether the budget is certified (a configuration with UCB <= budget exists on the path).
        observed: mean loss of the chosen configuration on the test part, points.
        bound: its UCB, points (the certified upper bound of the expected loss on new data).
        point: index of the chosen configuration on the path (safe to fast); -1 = none.
        path_length: configurations on the path.
        safest_bound: UCB of the safest configuration, points — the smallest budget this path can certify.
        expected_speedup: ``1 / mean cost`` of the chosen configuration on the test part.
        split, seed: path fraction and split seed.
        split_check: the same certification on other splits of the same rows (``None``: not run):
            ``seeds``, their ``expected_speedups`` (1.0 where a split certifies nothing), ``median`` and
            ``rank`` (1 + the number of those splits that certify more speed than this one).
    """

    mode: str
    confidence: float | None
    delta: float | None
    budget: float
    rows: int
    path_rows: int
    method: str
    certified: bool
    observed: float
    bound: float | None
    point: int
    path_length: int
    safest_bound: float | None
    expected_speedup: float
    split: float
    seed: int
    split_check: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able record (with its format tag), as stored in a plan."""
        return {"format": CERTIFICATE_FORMAT, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Certificate:
        """Read a record written by :meth:`to_dict`; :class:`CalibrationError` for anything else."""
        if not isinstance(d, dict) or d.get("format") != CERTIFICATE_FORMAT:
            raise CalibrationError(f"not an exit certificate (expected format {CERTIFICATE_FORMAT!r})")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def describe(self) -> str:
        """One line for people (see :func:`describe_certificate`)."""
        return describe_certificate(self.to_dict())


def _pts(x: float) -> str:
    return f"{x:.1f}" if abs(x * 10 - round(x * 10)) < 1e-9 else f"{x:g}"


def describe_certificate(d: dict[str, Any]) -> str:
    """One line for ``inspect`` from a certificate dict (as stored in a plan)."""
    what = "points of accuracy" if d.get("mode") == "labels" else "points of disagreement with the full model"
    if d.get("confidence") is None:
        return (f"budget {_pts(d['budget'])} {what} NOT certified (--confidence none): kept on the {d['rows']} "
                f"calibration rows only (observed {d['observed']:.2f}); new data may exceed it")
    conf = f"{100 * d['confidence']:g} %"
    if not d.get("certified"):
        return (f"budget {_pts(d['budget'])} {what} NOT certifiable at {conf} confidence on {d['rows']} rows "
                f"(smallest certifiable {d['safest_bound']:.2f})")
    text = (f"budget {_pts(d['budget'])} {what} certified at {conf} confidence on {d['rows']} rows: observed "
            f"{d['observed']:.2f}, bound {d['bound']:.2f} ({d['method']} bound, path of {d['path_length']} "
            f"configurations built on {d['path_rows']} other rows)")
    check = d.get("split_check")
    if check:
        sp = check["expected_speedups"]
        text += (f"; expected speedup {d['expected_speedup']:.2f}x, {len(sp)} other splits of the rows certify "
                 f"{min(sp):.2f}x-{max(sp):.2f}x (median {check['median']:.2f}x), this split ranks {check['rank']} "
                 f"of {len(sp) + 1}")
    return text


def split_check_warning(cert: Certificate) -> str | None:
    """The warning a certificate whose split certifies more speed than every other split checked gets (else None)."""
    check = cert.split_check
    if not check or check["rank"] != 1 or not cert.certified:
        return None
    sp = check["expected_speedups"]
    return (f"the calibration split (seed {cert.seed}) certifies {cert.expected_speedup:.2f}x, more than each of "
            f"{len(sp)} other splits of the same rows ({min(sp):.2f}x-{max(sp):.2f}x, median {check['median']:.2f}x): its "
            f"certifying rows look favourable, and a {100 * cert.confidence:g} % certificate's misses come from such "
            "splits; on new data "
            f"expect the drop nearer the budget than the observed {cert.observed:.2f} points (a lower --budget or a "
            "higher --confidence buys margin)")


@dataclasses.dataclass
class CertifiedExits:
    """Result of :func:`certify_exits`: thresholds in the criterion's units (+ the learned policy)."""

    thresholds: list[float | None]
    criterion: str
    certificate: Certificate
    policy: ExitPolicy | None
    exit_histogram: list[int]
    path: list[dict[str, Any]]
    warnings: list[str] = dataclasses.field(default_factory=list)


def parse_confidence(value: Any) -> float | None:
    """``--confidence``: a probability in (0, 1) (``90%`` also reads 0.9), or ``none``; raises CalibrationError."""
    if value is None:
        return DEFAULT_CONFIDENCE
    if isinstance(value, str) and value.strip().lower() in ("none", "off", "uncertified"):
        return None
    text = str(value).strip()
    try:
        c = float(text.rstrip("%")) / (100.0 if text.endswith("%") else 1.0)
    except ValueError:
        raise CalibrationError(f"--confidence must be a probability like 0.9 (or 90%) or 'none', got {value!r}") from None
    if not 0.0 < c < 1.0:
        raise CalibrationError(f"--confidence must lie strictly between 0 and 1 (e.g. 0.9), or be 'none'; got {value!r}")
    return c


def _split(n: int, split: float, seed: int, strata: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Stratified seeded split: (path rows, test rows in a shuffled order)."""
    rng = np.random.default_rng(seed)
    a, b = [], []
    for c in np.unique(strata):
        idx = np.flatnonzero(strata == c)
        idx = idx[rng.permutation(len(idx))]
        k = int(round(split * len(idx)))
        a.append(idx[:k])
        b.append(idx[k:])
    test = np.concatenate(b)
    return np.sort(np.concatenate(a)), test[rng.permutation(len(test))]


stratified_split = _split  # public name (passes/routing splits its calibration rows with it)


def certify_scores(
    scores: np.ndarray,
    losses: np.ndarray,
    costs: Sequence[float],
    path_rows: np.ndarray,
    test_rows: np.ndarray,
    *,
    budget: float,
    confidence: float | None,
    mode: str,
    method: str = "betting",
    split: float = DEFAULT_SPLIT,
    seed: int = 0,
    path_risk: np.ndarray | None = None,
) -> tuple[np.ndarray, Certificate, list[dict[str, Any]]]:
    """The generic Learn-then-Test step on stored per-row arrays.

    ``scores``/``losses`` are ``[E, N]`` (exit fires when ``score > threshold``; the last exit always stops),
    ``costs`` ``[E]``.

    ``path_risk`` ``[E, N]``: a smooth per-row risk estimate to build the path on (default: ``losses``;
    the observed 0/1 losses of a few hundred rows make a path that jumps straight to aggressive settings).
    Returns ``(confidence thresholds [E] (inf = never), certificate, path summary)``. With
    ``confidence=None`` (uncertified) the path is built on ``path_rows`` and the fastest configuration
    whose observed loss on ``test_rows`` is within the budget is taken (pass the same rows for both
    to reproduce a plain in-sample calibration). Raises :class:`CertificationError` when no configuration
    can be certified.
    """
    lo, hi = (-1.0, 1.0) if mode == "labels" else (0.0, 1.0)
    cost = np.asarray(costs, np.float64)
    risk = losses if path_risk is None else path_risk
    path = threshold_path(scores[:, path_rows], risk[:, path_rows], cost)
    sb, lb = scores[:, test_rows], losses[:, test_rows]
    cols = np.arange(len(test_rows))
    path_losses = np.stack([lb[_first_exit(sb, tc), cols] for tc in path]) if path else np.zeros((0, len(cols)))
    path_costs = [float(cost[_first_exit(sb, tc)].mean()) for tc in path]
    b = budget / 100.0
    delta = None if confidence is None else 1.0 - confidence
    if confidence is None:
        ok = [j for j in range(len(path)) if path_losses[j].mean() <= b + 1e-12]
        chosen = max(ok, key=lambda j: (-path_costs[j], -j)) if ok else -1
        bounds: list[float] = []
    else:
        chosen, bounds = fixed_sequence_test(path_losses, b, delta, lo, hi, method)
    sa = scores[:, path_rows]
    summary = [
        {"cost_path_rows": round(float(cost[_first_exit(sa, path[j])].mean()), 5),
         "cost_test_rows": round(path_costs[j], 5),
         "observed": round(100 * float(path_losses[j].mean()), 4),
         "bound": round(100 * bounds[j], 4) if j < len(bounds) else None}
        for j in range(len(path))
    ]
    safest = 100 * bounds[0] if bounds else None
    n_exits = scores.shape[0]
    tc = path[chosen] if chosen >= 0 else np.full(n_exits, np.inf)
    ex = _first_exit(sb, tc)
    cert = Certificate(
        mode=mode, confidence=confidence, delta=delta, budget=float(budget), rows=int(len(test_rows)),
        path_rows=int(len(path_rows)), method=method if confidence is not None else "none",
        certified=bool(chosen >= 0) if confidence is not None else False,
        observed=round(100 * float(lb[ex, cols].mean()), 4),
        bound=round(100 * bounds[chosen], 4) if chosen >= 0 and bounds else None,
        point=int(chosen), path_length=len(path), safest_bound=None if safest is None else round(safest, 4),
        expected_speedup=round(float(1.0 / cost[ex].mean()), 4), split=float(split), seed=int(seed),
    )
    if confidence is not None and chosen < 0:
        if not path:
            raise CertificationError(
                f"budget {budget:g} cannot be certified: no exit configuration saves compute on the "
                f"{len(path_rows)} path rows without loss; use more calibration rows or --confidence none", None
            )
        need = math.ceil(safest * 10 - 1e-9) / 10
        raise CertificationError(
            f"budget {budget:g} points cannot be certified at {100 * confidence:g} % confidence on "
            f"{len(test_rows)} calibration rows (the safest exit setting has observed {100 * path_losses[0].mean():.2f} "
            f"and bound {safest:.2f}): use --budget {need:g} or more, more calibration rows, a lower --confidence, "
            "or --confidence none (uncertified)",
            need,
        )
    return tc, cert, summary


def certify_exits(
    exit_probs: np.ndarray,
    final_probs: np.ndarray,
    labels: np.ndarray | None,
    costs: Sequence[float],
    *,
    budget: float,
    confidence: float | None = DEFAULT_CONFIDENCE,
    criterion: str = "entropy",
    patience: int = 2,
    split: float = DEFAULT_SPLIT,
    seed: int = 0,
    method: str = "betting",
    reference_probs: np.ndarray | None = None,
    path_rows: np.ndarray | None = None,
    split_check: int = SPLIT_CHECK_SEEDS,
) -> CertifiedExits:
    """Certified thresholds from per-row arrays (no ONNX Runtime): the function to rerun a calibration.

    Args:
        exit_probs: ``[E, N, C]`` probabilities of every exit, the last being the full model's own output
            (out-of-fold probabilities for fitted heads).
        final_probs: ``[N, C]`` the full model's probabilities.
        labels: ``[N]`` gold labels (accuracy-drop mode) or ``None`` (agreement mode).
        costs: ``[E]`` cumulative relative cost of stopping at each exit (full model = 1.0).
        budget: points (accuracy drop, or disagreement rate without labels).
        confidence: ``1 - delta``, or ``None`` for the uncertified (in-sample) mode.
        criterion: ``entropy``, ``maxprob``, ``patience`` or ``learned`` (policy fitted on the path rows).
        patience: consecutive agreeing exits the ``patience`` criterion needs.
        split: fraction of rows that build the path (and fit the learned policy); the rest certify.
        seed: of the stratified split.
        method: ``betting`` or ``bernstein``.
        reference_probs: the model the budget is measured against (default ``final_probs``), e.g. the
            fp32 original of an int8 model.
        path_rows: explicit indices of the path rows (overrides ``split``/``seed``; the rest certify).
        split_check: other split seeds (``seed + 1`` on) to certify on as well, recorded in the certificate's
            ``split_check`` with a warning when this split certifies more speed than each of them (0: none; no
            check with explicit ``path_rows`` or uncertified).
    """
    p = np.asarray(exit_probs)
    if p.ndim != 3 or p.shape[1] == 0:
        raise CalibrationError(f"exit_probs must be [E, N, C] with N >= 1, got shape {p.shape}")
    n_exits, n, c = p.shape
    final = np.asarray(final_probs)
    if final.shape != (n, c):
        raise CalibrationError(f"final_probs must be [N, C] = ({n}, {c}), got {final.shape}")
    if criterion not in ("entropy", "maxprob", "patience", "learned"):
        raise CalibrationError(f"unknown criterion {criterion!r}; use entropy, maxprob, patience or learned")
    if not 0.0 < split < 1.0:
        raise CalibrationError(f"split (the path fraction) must lie in (0, 1), got {split}")
    try:
        budget = float(budget)
    except (TypeError, ValueError) as exc:
        raise CalibrationError(f"budget must be a number of points, got {budget!r}") from exc
    if not math.isfinite(budget) or budget < 0:
        raise CalibrationError(f"budget must be a finite number of points >= 0, got {budget}")
    ref_pred = (final if reference_probs is None else np.asarray(reference_probs)).argmax(-1)
    y = None if labels is None else np.asarray(labels).astype(np.int64)
    if y is not None and y.shape != (n,):
        raise CalibrationError(f"labels must have shape ({n},), got {y.shape}")
    mode = "agreement" if y is None else "labels"
    strata = ref_pred if y is None else y
    if confidence is None:  # uncertified: path and choice on every row (a plain in-sample calibration)
        a, b = np.arange(n), np.random.default_rng(seed).permutation(n)
    elif path_rows is None:
        a, b = _split(n, split, seed, strata)
    else:
        a = np.sort(np.asarray(path_rows, np.int64))
        rest = np.setdiff1d(np.arange(n), a)
        b = rest[np.random.default_rng(seed).permutation(len(rest))]
        split = len(a) / n
    if len(a) < 20 or len(b) < 20:
        raise CertificationError(
            f"{n} calibration rows are too few to certify a budget (split {len(a)} path / {len(b)} test rows); "
            "use a few hundred rows or more (a few thousand for budgets near 1 point)"
        )
    losses = exit_losses(p, ref_pred, y)
    # fitted on the path rows only: the learned criterion's score, and for every criterion the smooth
    # per-row risk estimate the path is built on
    fitted = fit_exit_policy(p[:, a], ref_pred[a])
    policy = fitted if criterion == "learned" else None
    scores = fitted.scores(p) if criterion == "learned" else exit_scores(p, criterion, patience)
    tc, cert, summary = certify_scores(
        scores, losses, costs, a, b, budget=budget, confidence=confidence, mode=mode, method=method,
        split=split, seed=seed, path_risk=smooth_risk(fitted, p, losses),
    )
    warnings = []
    if confidence is not None and path_rows is None and split_check > 0:
        speeds = []
        for s in range(seed + 1, seed + 1 + int(split_check)):
            a2, b2 = _split(n, split, s, strata)
            fitted2 = fit_exit_policy(p[:, a2], ref_pred[a2])
            try:
                _, other, _ = certify_scores(
                    fitted2.scores(p) if criterion == "learned" else scores, losses, costs, a2, b2, budget=budget,
                    confidence=confidence, mode=mode, method=method, split=split, seed=s,
                    path_risk=smooth_risk(fitted2, p, losses),
                )
                speeds.append(other.expected_speedup)
            except CertificationError:
                speeds.append(1.0)  # this split certifies no exit: the full model's speed
        cert.split_check = {"seeds": list(range(seed + 1, seed + 1 + int(split_check))), "expected_speedups": speeds,
                            "median": round(float(np.median(speeds)), 4),
                            "rank": 1 + sum(v > cert.expected_speedup for v in speeds)}
        w = split_check_warning(cert)
        if w:
            warnings.append(w)
    ex = _first_exit(scores, tc)  # every calibration row (the drift guard's reference histogram)
    return CertifiedExits(
        thresholds=criterion_thresholds(tc, criterion, c), criterion=criterion, certificate=cert, policy=policy,
        exit_histogram=np.bincount(ex, minlength=n_exits).astype(int).tolist(), path=summary, warnings=warnings,
    )


def uncertified_exits(p: np.ndarray, final: np.ndarray, labels: np.ndarray | None, costs: Sequence[float], *,
                      budget: float, criterion: str, patience: int = 2, reference_probs: np.ndarray | None = None
                      ) -> CertifiedExits:
    """The early-exit pass's ``--confidence none``: the in-sample calibration, as a certificate of nothing.

    :func:`~dyncompile.passes.early_exit.calibrate.calibrate_against_reference` on every row (the learned
    criterion's policy is fitted on every row too): the one search for every uncertified early-exit decision.
    Arguments as :func:`certify_exits`.
    """
    y = None if labels is None else np.asarray(labels).astype(np.int64)
    ref_pred = np.asarray(final if reference_probs is None else reference_probs).argmax(-1)
    policy = fit_exit_policy(p, ref_pred) if criterion == "learned" else None
    cal = calibrate_against_reference(p, final, y, costs, budget=budget, criterion=criterion, patience=patience,
                                      reference_probs=reference_probs, policy=policy)
    ex = exit_decisions(p, cal, policy)
    n = p.shape[1]
    observed = exit_losses(p, ref_pred, y)[ex, np.arange(n)].mean()
    cert = Certificate(
        mode="agreement" if y is None else "labels", confidence=None, delta=None, budget=float(budget), rows=n,
        path_rows=n, method="none", certified=False, observed=round(100 * float(observed), 4), bound=None, point=-1,
        path_length=0, safest_bound=None, expected_speedup=round(cal.expected_speedup, 4), split=0.0, seed=0,
    )
    return CertifiedExits(thresholds=cal.thresholds, criterion=criterion, certificate=cert, policy=policy,
                          exit_histogram=cal.exit_histogram, path=[], warnings=list(cal.warnings))


def certified_calibration(
    oof_probs: np.ndarray,
    teacher: np.ndarray,
    labels: np.ndarray | None,
    exits: Sequence[int],
    num_layers: int,
    *,
    budget: float,
    confidence: float | None,
    criterion: str,
    patience: int = 2,
    reference_probs: np.ndarray | None = None,
    split: float = DEFAULT_SPLIT,
    seed: int = 0,
    method: str = "betting",
    split_check: int = SPLIT_CHECK_SEEDS,
) -> tuple[CertifiedExits, dict[str, Any]]:
    """:func:`certify_exits` for head exits + the full model as the last exit (costs ``k / L``).

    Also returns the ``calibration`` record the early-exit pass writes into the plan.
    """
    exit_probs = np.concatenate([np.asarray(oof_probs, np.float32), np.asarray(teacher, np.float32)[None]])
    costs = [k / num_layers for k in exits] + [1.0]
    if confidence is None:
        res = uncertified_exits(exit_probs, np.asarray(teacher), labels, costs, budget=budget, criterion=criterion,
                                patience=patience, reference_probs=reference_probs)
    else:
        res = certify_exits(
            exit_probs, teacher, labels, costs, budget=budget, confidence=confidence, criterion=criterion,
            patience=patience, split=split, seed=seed, method=method, reference_probs=reference_probs,
            split_check=split_check,
        )
    c = res.certificate
    record = {
        "format": "dyncompile.exit_calibration/v1",
        "method": "learn-then-test" if confidence is not None else "in-sample (uncertified)",
        "criterion": criterion,
        "budget": float(budget),
        "metric": "accuracy" if labels is not None else "agreement",
        "costs": costs,
        "expected_speedup": c.expected_speedup,
        "observed_loss": c.observed,
        "exit_histogram": res.exit_histogram,
        "warnings": res.warnings,
        "n_rows": int(exit_probs.shape[1]),
        "thresholds_all_exits": dict(zip(map(str, exits), res.thresholds[:-1])),
        "rows": int(exit_probs.shape[1]),
        "path": res.path,
    }
    return res, record


def policy_metadata(policy: ExitPolicy, exits: Sequence[int], keep: Sequence[int]) -> dict[int, dict[str, Any]]:
    """Per kept exit layer: ``{"weights", "bias", "prev_head"}`` for the ``dyncompile.early_exit`` metadata.

    ``prev_head`` is the previous exit's head output, ``None`` for the first exit.
    """
    out = {}
    for j in keep:
        out[exits[j]] = {
            "weights": policy.weights[j],
            "bias": policy.biases[j],
            "prev_head": f"exit_logits_{exits[j - 1]}" if j > 0 else None,
        }
    return out


def uncertified_certificate(calibration: dict[str, Any], labels: bool) -> dict[str, Any]:
    """The ``certificate`` record of ``--confidence none`` (today's in-sample calibration), honestly named."""
    n = int(calibration.get("rows") or calibration.get("n_rows") or 0)
    if labels and calibration.get("expected_accuracy") is not None and calibration.get("baseline_accuracy") is not None:
        observed = calibration["baseline_accuracy"] - calibration["expected_accuracy"]
    else:
        observed = 100.0 - float(calibration.get("expected_agreement") or 100.0)
    return Certificate(
        mode="labels" if labels else "agreement", confidence=None, delta=None, budget=float(calibration["budget"]),
        rows=n, path_rows=n, method="none", certified=False, observed=round(float(observed), 4), bound=None, point=-1,
        path_length=0, safest_bound=None, expected_speedup=round(float(calibration.get("expected_speedup") or 1.0), 4),
        split=0.0, seed=0,
    ).to_dict()
