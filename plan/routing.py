"""Schemas of routed plans: ``cascade`` and ``route`` steps over whole sub-plans, and ``policy.routing``.

A routed plan carries its candidates as sub-plan folders inside its own folder; each candidate records the
digest of its sub-plan (:func:`dyncompile.plan.plan_digest`), checked when the routed plan is loaded.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from dyncompile.errors import PlanError
from dyncompile.plan._typed import _field, _short, from_json
from dyncompile.plan.classify import check_threshold

__all__ = [
    "POLICIES",
    "RULE_KINDS",
    "STEPS",
    "Candidate",
    "CandidateCost",
    "RouteParams",
    "RoutedParams",
    "RoutingPolicy",
    "RoutingRule",
]

RULE_KINDS = ("confidence", "learned", "check")
_HEX = "0123456789abcdef"


@dataclasses.dataclass(frozen=True)
class CandidateCost:
    """A candidate's cost: median wall-clock ms per call on ``provider`` at ``batch``.

    Measured at compile time, or ``given`` by the user for plans that cannot be timed there.
    """

    ms: float = _field(lo=0.0, hi=1e9)
    provider: str = "cpu"
    batch: int = _field(1, lo=1, hi=1_000_000)
    source: Literal["measured", "given"] = "measured"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One candidate of a ``route``/``cascade`` step.

    A sub-plan folder inside the routed plan, its digest (:func:`dyncompile.plan.plan_digest`; checked when
    the routed plan is loaded) and its cost.
    """

    name: str
    plan: str
    digest: str
    cost: CandidateCost
    task: str
    labels: list[str] | None = None

    def _check(self, where: str) -> None:
        if len(self.digest) != 64 or any(c not in _HEX for c in self.digest):
            raise PlanError(f"{where}.digest must be 64 lowercase hex digits (a plan digest), got {_short(self.digest)}")
        if not self.name or not all(c.isalnum() or c in "-_." for c in self.name):
            raise PlanError(f"{where}.name must be letters, digits, '-', '_' or '.', got {_short(self.name)}")


@dataclasses.dataclass(frozen=True)
class RoutingRule:
    """The decision rule of a routed plan.

    * ``confidence`` (cascade): candidate ``k`` answers when its ``criterion`` confidence passes
      ``thresholds[k]`` (entropy: ``H < t``; maxprob: ``max p > t``; ``None``: never); the last always answers.
    * ``learned`` (route): the ONNX ``router`` file reads the input before any candidate runs and outputs one
      score per candidate but the last; the first ``k`` with ``score_k > thresholds[k]`` answers.
    * ``check`` (cascade): candidate ``k`` answers when the registered executable check ``check`` passes on
      (input, its output); the last always answers.
    """

    kind: Literal["confidence", "learned", "check"]
    thresholds: list[float | None] = _field(factory=list)
    criterion: Literal["entropy", "maxprob"] | None = None
    router: str | None = None
    router_output: str = "route_scores"
    check: str | None = None

    def _check(self, where: str) -> None:
        if self.kind == "confidence":
            if self.criterion is None:
                raise PlanError(f"{where}: a confidence rule needs 'criterion' (entropy or maxprob)")
            for i, t in enumerate(self.thresholds):
                check_threshold(t, self.criterion, f"{where}.thresholds[{i}]")
        if self.kind == "learned" and not self.router:
            raise PlanError(f"{where}: a learned rule needs 'router' (the file key of the router ONNX model)")
        if self.kind == "check" and not self.check:
            raise PlanError(f"{where}: a check rule needs 'check' (the name of a registered executable check)")
        if self.kind != "learned" and self.router is not None:
            raise PlanError(f"{where}: 'router' belongs to a learned rule, not to a {self.kind!r} rule")
        if self.kind != "check" and self.check is not None:
            raise PlanError(f"{where}: 'check' belongs to a check rule, not to a {self.kind!r} rule")


@dataclasses.dataclass(frozen=True)
class RoutedParams:
    """``cascade`` and ``route`` steps: ``candidates`` cheapest first, the last is the fallback.

    ``cascade`` runs the candidates cheapest first and stops when the rule accepts; ``route`` has a learned
    router pick one candidate before any runs.
    """

    candidates: list[Candidate]
    rule: RoutingRule
    output: str = "logits"

    _kind = "cascade"

    def _check(self, where: str) -> None:
        if len(self.candidates) < 2:
            raise PlanError(f"{where}.candidates must list at least two sub-plans, got {len(self.candidates)}")
        names = [c.name for c in self.candidates]
        if len(set(names)) != len(names):
            raise PlanError(f"{where}.candidates: names must be unique, got {names}")
        plans = [c.plan for c in self.candidates]
        if len(set(plans)) != len(plans):
            raise PlanError(f"{where}.candidates: each candidate needs its own sub-plan folder, got {plans}")
        if len(self.rule.thresholds) != len(self.candidates) - 1 and self.rule.kind != "check":
            raise PlanError(
                f"{where}.rule.thresholds must have one value per candidate but the last "
                f"({len(self.candidates) - 1}), got {len(self.rule.thresholds)}"
            )
        tasks = {c.task for c in self.candidates}
        if len(tasks) != 1:
            raise PlanError(f"{where}.candidates: all candidates must do the same task, got {sorted(tasks)}")
        labels = {tuple(c.labels) if c.labels is not None else None for c in self.candidates}
        if len(labels) != 1:
            raise PlanError(f"{where}.candidates: all candidates must share one label set, got {sorted(map(str, labels))}")
        want = ("learned",) if self._kind == "route" else ("confidence", "check")
        if self.rule.kind not in want:
            raise PlanError(f"{where}.rule.kind {self.rule.kind!r} does not fit a {self._kind!r} step (use {' or '.join(want)})")

    def file_keys(self) -> list[tuple[str, str]]:
        """The plan files this step names (a learned rule's router), as ``(field, file key)`` pairs."""
        return [("rule.router", self.rule.router)] if self.rule.router is not None else []

    def sub_plans(self) -> list[tuple[str, str, str]]:
        """The sub-plan folders this step names, as ``(field, candidate name, folder)`` triples."""
        return [(f"candidates[{j}].plan", c.name, c.plan) for j, c in enumerate(self.candidates)]


@dataclasses.dataclass(frozen=True)
class RouteParams(RoutedParams):
    """``route``: a learned router picks one candidate before any runs (see :class:`RoutedParams`)."""

    _kind = "route"


@dataclasses.dataclass(frozen=True)
class RoutingPolicy:
    """``policy.routing``: the budget the rule was calibrated to, its certificate and calibration record."""

    _extra = True  # calibration records are informational

    budget: float | None = _field(None, lo=0.0, hi=100.0)
    reference: str | None = None
    metric: Literal["accuracy", "agreement", "check"] | None = None
    certificate: Any = None  # passes/early_exit/certify.py Certificate.to_dict()
    router_overhead_ms: float | None = _field(None, lo=0.0, hi=1e9)


STEPS: dict[str, Any] = {
    "cascade": lambda d, where: from_json(RoutedParams, d, where),
    "route": lambda d, where: from_json(RouteParams, d, where),
}
"""This module's step kinds -> ``build(params_json, where)`` (merged into :data:`dyncompile.plan.STEP_SCHEMAS`)."""

POLICIES: dict[str, type] = {"routing": RoutingPolicy}
"""This module's policy names -> schema (merged into :data:`dyncompile.plan.POLICY_SCHEMAS`)."""
