"""Drift guard for early-exit plans: do inputs exit in the pattern the calibration saw?

An early-exit plan's accuracy budget was calibrated on rows of one distribution; its promise holds for
new rows of the same distribution. A cheap, label-free symptom of new rows from *another* distribution
is that they leave the network at other layers than the calibration rows did. The compile stores the
calibration's exit-layer distribution in the plan (``policy.early_exit.calibration.exit_distribution``:
per exit layer, how many calibration rows stop there, from the out-of-fold heads, i.e. heads that had
not seen those rows — the behaviour to expect on new rows); :func:`check` compares an observed
histogram with it.

Test: a chi-square test of homogeneity on the 2 x K table (calibration counts vs observed counts),
adjacent layers merged until every expected count is >= 5 (the chi-square approximation's usual
condition), so the calibration sample's own noise is accounted for. The guard fires when

* ``p < alpha`` (default 0.01): under "same distribution" it fires with probability <= ``alpha``
  (the false-alarm rate; asymptotic, checked by simulation in the tests), **and**
* the total-variation distance between the two histograms is >= ``min_tv`` (default 0.10: at least a
  tenth of the rows exit elsewhere), so that a shift too small to matter for the budget, which a large
  sample would still detect, does not raise an alarm. This only lowers the false-alarm rate.

With fewer than ``min_rows`` observed rows (default 100) the verdict is ``"too few rows"`` (no alarm).
Exit layers must be per row: a staged plan, or an If-graph plan run at batch size 1 (an If graph exits
a whole batch at once).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dyncompile.errors import DataError
from dyncompile.runtime.rules.chi2 import homogeneity_test

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_ALPHA",
    "DEFAULT_MIN_ROWS",
    "DEFAULT_MIN_TV",
    "DriftVerdict",
    "calibration_distribution",
    "check",
    "format_histograms",
]

DEFAULT_ALPHA = 0.01
DEFAULT_MIN_TV = 0.10
DEFAULT_MIN_ROWS = 100

@dataclasses.dataclass
class DriftVerdict:
    """What :func:`check` found.

    Attributes:
        drift: ``True`` when the inputs exit in a pattern the calibration did not (see the module docstring).
        verdict: ``"drift"``, ``"ok"`` or ``"too few rows"``.
        rows: observed rows.
        layers: the exit layers (bins), ascending; the last is the full model.
        observed, calibration: row counts per layer.
        p_value, statistic, df: the chi-square homogeneity test.
        tv: total-variation distance between the two histograms (0..1).
        alpha, min_tv, min_rows: the thresholds used.
        message: one line for people.
    """

    drift: bool
    verdict: str
    rows: int
    layers: list[int]
    observed: list[int]
    calibration: list[int]
    p_value: float | None
    statistic: float | None
    df: int | None
    tv: float | None
    alpha: float
    min_tv: float
    min_rows: int
    message: str

    def to_dict(self) -> dict[str, Any]:
        """The verdict as a JSON-ready dict."""
        return dataclasses.asdict(self)


def calibration_distribution(policy: Mapping[str, Any]) -> tuple[list[int], list[int]] | None:
    """``(layers, counts)`` of the calibration's exit histogram from a plan's ``policy``, or ``None``."""
    ee = (policy or {}).get("early_exit") or {}
    dist = (ee.get("calibration") or {}).get("exit_distribution")
    if not dist:
        return None
    return [int(x) for x in dist["layers"]], [int(x) for x in dist["counts"]]


def _observed_counts(exit_layers: Sequence[int] | np.ndarray | Mapping[int, int], layers: list[int]) -> np.ndarray:
    if isinstance(exit_layers, Mapping):
        items = {int(k): int(v) for k, v in exit_layers.items()}
    else:
        arr = np.asarray(exit_layers).reshape(-1).astype(np.int64)
        items = {int(k): int(v) for k, v in zip(*np.unique(arr, return_counts=True))}
    unknown = sorted(set(items) - set(layers))
    if unknown:
        raise DataError(
            f"exit layers {unknown} are not exits of this plan (its exits: {layers}); pass the exit layers this "
            "plan's runs reported"
        )
    return np.array([items.get(k, 0) for k in layers], np.int64)


def check(
    exit_layers: Sequence[int] | np.ndarray | Mapping[int, int],
    reference: Mapping[str, Any] | tuple[Sequence[int], Sequence[int]],
    *,
    alpha: float = DEFAULT_ALPHA,
    min_tv: float = DEFAULT_MIN_TV,
    min_rows: int = DEFAULT_MIN_ROWS,
    warn: bool = True,
) -> DriftVerdict:
    """Compare observed per-row exit layers with the calibration's exit-layer distribution.

    Args:
        exit_layers: the exit layer of every observed row (or a ``{layer: count}`` histogram).
        reference: a plan's ``policy`` dict (``plan.policy``) or ``(layers, counts)``.
        alpha: false-alarm rate of the chi-square test under "same distribution".
        min_tv: smallest total-variation distance that counts as drift.
        min_rows: fewer observed rows give the verdict ``"too few rows"``.
        warn: log a warning when drift is found.

    Raises:
        DataError: the plan has no calibration exit distribution, or a layer that is not one of its exits.
    """
    if not 0 < alpha < 1 or not 0 <= min_tv <= 1 or min_rows < 1:
        raise DataError(f"need 0 < alpha < 1, 0 <= min_tv <= 1 and min_rows >= 1; got {alpha}, {min_tv}, {min_rows}")
    if isinstance(reference, tuple):
        layers, ref_counts = [int(x) for x in reference[0]], [int(x) for x in reference[1]]
    else:
        dist = calibration_distribution(reference)
        if dist is None:
            raise DataError(
                "this plan records no calibration exit distribution (not an early-exit plan, or compiled before "
                "the drift guard existed); recompile it with --passes early-exit"
            )
        layers, ref_counts = dist
    ref = np.asarray(ref_counts, np.int64)
    obs = _observed_counts(exit_layers, layers)
    n = int(obs.sum())
    common = dict(rows=n, layers=layers, observed=obs.tolist(), calibration=ref.tolist(), alpha=alpha, min_tv=min_tv,
                  min_rows=min_rows)
    if n < min_rows:
        return DriftVerdict(drift=False, verdict="too few rows", p_value=None, statistic=None, df=None, tv=None,
                            message=f"{n} rows observed; the drift check needs at least {min_rows}", **common)
    tv = float(0.5 * np.abs(obs / n - ref / ref.sum()).sum())
    stat, df, p = homogeneity_test(ref, obs)
    drift = bool(p < alpha and tv >= min_tv)
    mean_obs = float((np.asarray(layers) * obs).sum() / n)
    mean_ref = float((np.asarray(layers) * ref).sum() / ref.sum())
    msg = (
        f"{'DRIFT' if drift else 'no drift'}: {n} rows exit at mean layer {mean_obs:.2f} vs {mean_ref:.2f} on the "
        f"calibration rows (total variation {tv:.3f}, chi-square p = {p:.2g}; alarm when p < {alpha:g} and TV >= {min_tv:g})"
    )
    if drift:
        msg += "; the accuracy budget was calibrated on other data and may not hold for these inputs"
        if warn:
            logger.warning("early-exit drift guard: %s", msg)
    return DriftVerdict(drift=drift, verdict="drift" if drift else "ok", p_value=p, statistic=stat, df=df, tv=tv,
                        message=msg, **common)


def format_histograms(v: DriftVerdict) -> str:
    """Observed vs calibration exit histograms side by side (percent of rows per exit layer)."""
    n_ref = max(sum(v.calibration), 1)
    n_obs = max(v.rows, 1)
    lines = [f"{'exit layer':>10}  {'observed':>16}  {'calibration':>16}"]
    for layer, o, c in zip(v.layers, v.observed, v.calibration):
        lines.append(f"{layer:>10}  {o:>7d} ({100 * o / n_obs:5.1f}%)  {c:>7d} ({100 * c / n_ref:5.1f}%)")
    lines.append(v.message)
    return "\n".join(lines)
