"""Compatibility names for the module split into :mod:`.heads`, :mod:`.fit` and :mod:`.calibrate`.

New code imports from those modules (and the exit rule from :mod:`dyncompile.runtime.exit_rule`);
this module only keeps older imports working and can go once nothing imports it.
"""

from dyncompile.passes.early_exit.calibrate import (
    CRITERIA,
    Calibration,
    calibrate_thresholds,
    exit_decisions,
    exit_scores,
)
from dyncompile.passes.early_exit.checks import CalibrationError
from dyncompile.passes.early_exit.fit import FitResult, fit_exit_heads
from dyncompile.passes.early_exit.heads import ACTIVATIONS, POOLINGS, ExitHead, pool_features
from dyncompile.runtime.exit_rule import softmax as _softmax  # noqa: F401  (tests/test_quantize.py)

__all__ = [
    "ACTIVATIONS",
    "CRITERIA",
    "POOLINGS",
    "Calibration",
    "CalibrationError",
    "ExitHead",
    "FitResult",
    "calibrate_thresholds",
    "exit_decisions",
    "exit_scores",
    "fit_exit_heads",
    "pool_features",
]
