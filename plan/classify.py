"""Schemas of classifier plans: ``run_model``, ``early_exit_staged`` and ``policy.early_exit``."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from dyncompile.errors import PlanError
from dyncompile.plan._typed import _field, from_json

__all__ = [
    "Criterion",
    "EarlyExitPolicy",
    "POLICIES",
    "RunModelParams",
    "STEPS",
    "Segment",
    "StagedEarlyExitParams",
    "check_threshold",
]

Criterion = Literal["entropy", "maxprob", "patience", "learned"]


def check_threshold(t: float | None, criterion: str, where: str) -> None:
    """Refuse an exit threshold that does not fit ``criterion`` (an entropy >= 0, a probability in [0, 1]).

    Raises:
        PlanError: ``t`` is out of the criterion's range; the message names ``where``.
    """
    if t is None:
        return
    if criterion == "learned":  # a logit score: any finite number (finiteness is checked for every float)
        return
    if criterion == "entropy" and t < 0:
        raise PlanError(f"{where} must be >= 0 (an entropy in nats) for criterion 'entropy', got {t}")
    if criterion != "entropy" and not 0.0 <= t <= 1.0:
        raise PlanError(f"{where} must be in [0, 1] (a probability) for criterion {criterion!r}, got {t}")


@dataclasses.dataclass(frozen=True)
class RunModelParams:
    """``run_model``: run one ONNX file; ``outputs`` renames ONNX outputs in the state."""

    model: str
    outputs: dict[str, str] = _field(factory=dict)

    def file_keys(self) -> list[tuple[str, str]]:
        """The plan files this step names, as ``(field, file key)`` pairs."""
        return [("model", self.model)]


@dataclasses.dataclass(frozen=True)
class Segment:
    """One segment of a staged early-exit plan (``head`` is None for the final segment)."""

    model: str
    layer: int = _field(lo=0, hi=100_000)
    cut_in: str | None = None
    cut_out: str | None = None
    head: str | None = None
    threshold: float | None = None
    output: str | None = None
    score: str | None = None  # learned criterion: the segment's exit-score output (fires when score > threshold)
    prev_head: str | None = None  # learned criterion: input fed with the previous exit's head logits


@dataclasses.dataclass(frozen=True)
class StagedEarlyExitParams:
    """``early_exit_staged``: run ``segments`` in order; rows whose exit test fires leave the batch."""

    segments: list[Segment]
    criterion: Criterion
    output: str
    patience: int = _field(2, lo=1, hi=1000)
    num_layers: int | None = _field(None, lo=1, hi=100_000)

    def _check(self, where: str) -> None:
        if not self.segments:
            raise PlanError(f"{where}.segments must list at least one segment")
        for i, s in enumerate(self.segments):
            last = i == len(self.segments) - 1
            if last and (s.head is not None or not s.output):
                raise PlanError(f"{where}.segments[{i}]: the last segment needs 'output' and no 'head'")
            if not last and (s.head is None or not s.cut_out):
                raise PlanError(f"{where}.segments[{i}]: an exit segment needs 'head' and 'cut_out'")
            if bool(i) != bool(s.cut_in):
                raise PlanError(f"{where}.segments[{i}]: every segment but the first needs 'cut_in' (the first none)")
            check_threshold(s.threshold, self.criterion, f"{where}.segments[{i}].threshold")

    def file_keys(self) -> list[tuple[str, str]]:
        """The plan files this step names, as ``(field, file key)`` pairs."""
        return [(f"segments[{j}].model", s.model) for j, s in enumerate(self.segments)]


@dataclasses.dataclass(frozen=True)
class EarlyExitPolicy:
    """``policy.early_exit``: the criterion and per-layer thresholds (plus calibration records)."""

    _extra = True  # calibration / exit_stats / fit records are informational

    criterion: Criterion = "entropy"
    patience: int = _field(2, lo=1, hi=1000)
    num_layers: int | None = _field(None, lo=1, hi=100_000)
    lowering: Literal["if", "staged"] | None = None
    lowering_choice: Any = None
    thresholds: dict[str, float | None] = _field(factory=dict)
    certificate: Any = None  # passes/early_exit/certify.py Certificate.to_dict(): what the budget promise rests on
    exit_policy: Any = None  # criterion 'learned': the per-exit policy weights (also in the graph / segments)

    def _check(self, where: str) -> None:
        for k, t in self.thresholds.items():
            if not k.isdigit():
                raise PlanError(f"{where}.thresholds: key {k!r} must be a layer number")
            check_threshold(t, self.criterion, f"{where}.thresholds.{k}")


STEPS: dict[str, Any] = {
    "run_model": lambda d, where: from_json(RunModelParams, d, where),
    "early_exit_staged": lambda d, where: from_json(StagedEarlyExitParams, d, where),
}
"""This module's step kinds -> ``build(params_json, where)`` (merged into :data:`dyncompile.plan.STEP_SCHEMAS`)."""

POLICIES: dict[str, type] = {"early_exit": EarlyExitPolicy}
"""This module's policy names -> schema (merged into :data:`dyncompile.plan.POLICY_SCHEMAS`)."""
