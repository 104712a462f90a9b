"""Calibrate a routing rule to a certified quality budget — with the early-exit certifier, not a second one.

A cascade is early exit across models: candidate ``k``'s class probabilities play the part of exit ``k``'s
head, the last candidate is the "full model", and the quality reference (default: the most expensive
candidate; e.g. MPNet-base plain when the last stage is MPNet's own early-exit plan) plays the original.
So :func:`calibrate_cascade` hands the per-row arrays to
:func:`dyncompile.passes.early_exit.certify.certify_exits` unchanged (Learn-then-Test, fixed-sequence
testing, betting UCB, seeded 30/70 split, :class:`~dyncompile.passes.early_exit.certify.Certificate`).
The learned router (:func:`calibrate_route`) is fitted on the path part only and certified with the same
:func:`~dyncompile.passes.early_exit.certify.certify_scores`; the executable check (:func:`calibrate_check`)
has no free parameter, so its one configuration is bounded on every row with the same UCB.

Per-row loss (as in early exit): with labels ``1[answer wrong] - 1[reference wrong]`` (its mean: the
accuracy drop against the reference, points); without labels ``1[answer != reference answer]``.
Costs only order the path (the guarantee is on the loss): cascade stage ``k`` costs the sum of the
candidates' measured ms up to ``k``, a routed candidate its own ms plus the router's, both divided by the
reference's ms, so ``expected_speedup`` is against the reference alone.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from dyncompile.passes.early_exit.certify import (
    DEFAULT_CONFIDENCE,
    DEFAULT_SPLIT,
    LEARNED_ALWAYS,
    UCB_METHODS,
    Certificate,
    CertificationError,
    certify_exits,
    certify_scores,
    exit_losses,
    stratified_split,
)
from dyncompile.passes.early_exit.checks import CalibrationError
from dyncompile.passes.routing.router import RouterHead, fit_router_head

logger = logging.getLogger(__name__)

__all__ = ["RoutingFit", "calibrate_cascade", "calibrate_check", "calibrate_route", "cascade_costs", "route_costs"]


@dataclasses.dataclass
class RoutingFit:
    """A calibrated rule: ``thresholds`` per candidate but the last (criterion units / router logits)."""

    kind: str
    thresholds: list[float | None]
    criterion: str | None
    certificate: dict[str, Any]
    calibration: dict[str, Any]
    router: RouterHead | None = None


def cascade_costs(ms: Sequence[float], reference_ms: float) -> list[float]:
    """Relative cost of answering at stage ``k`` of a cascade: every stage up to ``k`` ran."""
    return [float(x) / reference_ms for x in np.cumsum(np.asarray(ms, np.float64))]


def route_costs(ms: Sequence[float], reference_ms: float, router_ms: float) -> list[float]:
    """Relative cost of routing to candidate ``k``: the router, then ``k`` alone."""
    return [(float(x) + router_ms) / reference_ms for x in ms]


def _check_budget(budget: Any) -> float:
    try:
        b = float(budget)
    except (TypeError, ValueError):
        raise CalibrationError(f"--budget must be a number of points, got {budget!r}") from None
    if not math.isfinite(b) or b < 0:
        raise CalibrationError(f"--budget must be a finite number of points >= 0, got {budget!r}")
    return b


def _stack(stage_probs: Sequence[np.ndarray]) -> np.ndarray:
    shapes = {np.asarray(p).shape for p in stage_probs}
    if len(shapes) != 1:
        raise CalibrationError(f"every candidate must give [N, C] probabilities of one shape, got {sorted(shapes)}")
    return np.stack([np.asarray(p, np.float64) for p in stage_probs])


def _record(kind: str, costs: list[float], cert: dict, hist: list[int], path: list, n: int, labels: bool) -> dict:
    return {
        "format": "dyncompile.routing_calibration/v1",
        "rule": kind,
        "method": "learn-then-test" if cert.get("confidence") is not None else "uncertified path (plug-in)",
        "metric": "accuracy" if labels else "agreement",
        "costs": [round(c, 6) for c in costs],
        "expected_speedup": cert.get("expected_speedup"),
        "observed_loss": cert.get("observed"),
        "candidate_histogram": hist,
        "rows": n,
        "path": path,
    }


def calibrate_cascade(
    stage_probs: Sequence[np.ndarray],
    reference_probs: np.ndarray,
    labels: np.ndarray | None,
    ms: Sequence[float],
    reference_ms: float,
    *,
    budget: float,
    confidence: float | None = DEFAULT_CONFIDENCE,
    criterion: str = "entropy",
    split: float = DEFAULT_SPLIT,
    seed: int = 0,
    method: str = "betting",
) -> RoutingFit:
    """Confidence thresholds for a cascade, certified by :func:`certify_exits` (module docstring).

    ``stage_probs``: ``K`` arrays ``[N, C]`` (candidate ``k``'s probabilities on every calibration row);
    ``reference_probs`` ``[N, C]``; ``labels`` ``[N]`` or ``None`` (agreement mode); ``ms`` the candidates'
    measured cost, ``reference_ms`` the reference's.
    """
    if criterion not in ("entropy", "maxprob"):
        raise CalibrationError(f"cascade criterion must be entropy or maxprob, got {criterion!r}")
    budget = _check_budget(budget)
    p = _stack(stage_probs)
    costs = cascade_costs(ms, reference_ms)
    res = certify_exits(
        p, p[-1], labels, costs, budget=budget, confidence=confidence, criterion=criterion, split=split, seed=seed,
        method=method, reference_probs=np.asarray(reference_probs),
    )
    for w in res.warnings:  # the split check's (certify_exits)
        logger.warning("routing certificate: %s", w)
    cert = res.certificate.to_dict()
    return RoutingFit("confidence", list(res.thresholds[:-1]), criterion, cert,
                      _record("confidence", costs, cert, res.exit_histogram, res.path, p.shape[1], labels is not None))


def calibrate_route(
    features: np.ndarray,
    stage_probs: Sequence[np.ndarray],
    reference_probs: np.ndarray,
    labels: np.ndarray | None,
    ms: Sequence[float],
    reference_ms: float,
    router_ms: float,
    *,
    budget: float,
    confidence: float | None = DEFAULT_CONFIDENCE,
    ridge: float = 30.0,
    split: float = DEFAULT_SPLIT,
    seed: int = 0,
    method: str = "betting",
) -> RoutingFit:
    """A learned router: fit :class:`RouterHead` on the path rows, then certify its thresholds.

    The target: candidate ``k`` loses nothing against the reference on the row; the thresholds are certified
    with :func:`certify_scores`.
    """
    budget = _check_budget(budget)
    p = _stack(stage_probs)
    k, n, _ = p.shape
    x = np.asarray(features, np.float64)
    if x.shape[0] != n:
        raise CalibrationError(f"router features have {x.shape[0]} rows, the candidates' outputs {n}")
    ref_pred = np.asarray(reference_probs).argmax(-1)
    y = None if labels is None else np.asarray(labels).astype(np.int64)
    mode = "labels" if y is not None else "agreement"
    losses = exit_losses(p, ref_pred, y)  # [K, N]
    strata = ref_pred if y is None else y
    if confidence is None:
        a, b = np.arange(n), np.random.default_rng(seed).permutation(n)
    else:
        a, b = stratified_split(n, split, seed, strata)
    if len(a) < 20 or len(b) < 20:
        raise CertificationError(
            f"{n} calibration rows are too few to fit and certify a router (split {len(a)} / {len(b)}); use a few "
            "hundred rows or more", None)
    head = fit_router_head(x[a], (losses[:-1, a] <= 0).astype(np.float64), ridge=ridge)
    s = head.scores(x).T  # [K-1, N]
    scores = np.concatenate([s, np.zeros((1, n))])
    risk = np.concatenate([1.0 / (1.0 + np.exp(np.clip(s, -50, 50))), losses[-1:]])
    costs = route_costs(ms, reference_ms, router_ms)
    tc, cert, summary = certify_scores(scores, losses, costs, a, b, budget=budget, confidence=confidence, mode=mode,
                                       method=method, split=split, seed=seed, path_risk=risk)
    thresholds = [None if t == np.inf else (LEARNED_ALWAYS if t == -np.inf else float(t)) for t in tc[:-1]]
    fires = np.concatenate([s > tc[:-1, None], np.ones((1, n), bool)])
    hist = np.bincount(fires.argmax(0), minlength=k).astype(int).tolist()
    cd = cert.to_dict()
    rec = _record("learned", costs, cd, hist, summary, n, y is not None)
    rec["router"] = head.to_dict()
    return RoutingFit("learned", thresholds, None, cd, rec, head)


def calibrate_check(
    passes: np.ndarray,
    correct: np.ndarray,
    reference_correct: np.ndarray,
    ms: Sequence[float],
    reference_ms: float,
    *,
    budget: float,
    confidence: float | None = DEFAULT_CONFIDENCE,
    method: str = "betting",
    seed: int = 0,
) -> RoutingFit:
    """An executable-check cascade, certified.

    ``passes`` ``[K-1, N]`` (the check accepted candidate ``k``'s answer), ``correct`` ``[K, N]`` (the answer is right, e.g. hidden tests pass), ``reference_correct`` ``[N]``.

    The rule has no free parameter, so there is one hypothesis and no path: its mean loss is bounded on
    every row with the UCB of ``method``; a budget below the bound raises :class:`CertificationError`
    naming the budget that can be certified.
    """
    budget = _check_budget(budget)
    ok = np.asarray(passes, bool)
    right = np.asarray(correct, bool)
    ref = np.asarray(reference_correct, bool)
    k, n = right.shape
    if ok.shape != (k - 1, n) or ref.shape != (n,):
        raise CalibrationError(f"passes must be [{k - 1}, {n}] and reference_correct [{n}], got {ok.shape}, {ref.shape}")
    fires = np.concatenate([ok, np.ones((1, n), bool)])
    ans = fires.argmax(0)
    loss = (~right[ans, np.arange(n)]).astype(np.float64) - (~ref).astype(np.float64)
    costs = cascade_costs(ms, reference_ms)
    exp_cost = float(np.mean([costs[a] for a in ans]))
    observed = float(loss.mean())
    if confidence is None:
        bound, certified, delta = None, False, None
    else:
        if n < 20:
            raise CertificationError(f"{n} calibration rows are too few to certify a budget; use a few hundred", None)
        delta = 1.0 - confidence
        order = np.random.default_rng(seed).permutation(n)  # the betting bound needs a value-independent order
        bound = UCB_METHODS[method](loss[order], delta, -1.0, 1.0)
        certified = bound <= budget / 100.0
        if not certified:
            need = math.ceil(100 * bound * 10 - 1e-9) / 10
            raise CertificationError(
                f"budget {budget:g} points cannot be certified for the check cascade at {100 * confidence:g} % "
                f"confidence on {n} rows (observed {100 * observed:.2f}, bound {100 * bound:.2f}): use --budget "
                f"{need:g} or more, more calibration rows, or --confidence none", need)
    cert = Certificate(
        mode="labels", confidence=confidence, delta=delta, budget=float(budget), rows=n, path_rows=0,
        method=method if confidence is not None else "none", certified=bool(certified),
        observed=round(100 * observed, 4), bound=None if bound is None else round(100 * bound, 4), point=0,
        path_length=1, safest_bound=None if bound is None else round(100 * bound, 4),
        expected_speedup=round(1.0 / exp_cost, 4), split=0.0, seed=int(seed),
    ).to_dict()
    hist = np.bincount(ans, minlength=k).astype(int).tolist()
    return RoutingFit("check", [], None, cert, _record("check", costs, cert, hist, [], n, True))
