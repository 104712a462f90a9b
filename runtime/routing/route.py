"""``cascade`` and ``route`` steps: run whole plans (candidates) cheapest first, or pick one before any runs.

A routed plan is a folder holding ``plan.json`` (one ``cascade`` or ``route`` step), its candidates as
sub-plan folders (``candidates/NAME/``, each checked against the digest the routed plan records, with the
same loader and hash checks as a top-level plan), and for a learned router its ONNX file. Candidates are
ordered cheapest first; the last one always answers. The rule (:class:`dyncompile.plan.RoutingRule`):

* ``confidence`` (cascade; FrugalGPT / AutoMix style): candidate ``k`` answers the rows whose confidence
  passes ``thresholds[k]`` (the early-exit rule of :func:`dyncompile.runtime.rules.exit_rule.exit_fires` —
  a cascade is early exit across models); the other rows go on to candidate ``k + 1``. Classifiers only.
* ``learned`` (route; RouteLLM style): the router ONNX reads the input before any candidate runs and
  outputs ``[B, K-1]`` scores; row ``b`` goes to the first ``k`` with ``score[b, k] > thresholds[k]``.
* ``check`` (cascade): candidate ``k``'s answer is kept when the executable check passes on it.

Executable checks are registered by name (:func:`register_check`, :func:`get_check`; a plan names one,
it never carries code). The interface, for whoever adds one (e.g. ``runtime/routing/code_check.py`` registers
``python-doctest``)::

    @register_check("my-check")
    def my_check(input_record: dict, output: dict) -> bool: ...

``input_record`` is the input as given (``{"text": ...}`` for classifiers, ``{"prompt": ...}`` plus any
fields the caller passes with ``record=`` for generation); ``output`` is the candidate's answer
(``{"label", "probabilities"}`` for classifiers, ``{"text", "token_ids"}`` for generation). Return
``True`` to accept the answer. An unknown name raises :class:`~dyncompile.errors.PlanError` at load.

Candidates may be any plan dyncompile can compile — plain, early-exit, quantized classifiers, or
``generate`` / ``speculative_generate`` decoders (then the input is a prompt and :meth:`RoutedStep.generate`
runs; the confidence rule is not defined for generation, the ``check`` and ``learned`` rules are).
The step writes ``state[output]`` (``[B, C]`` logits, each row the answering candidate's) and
``state["candidate"]`` (``[B]`` index of the answering candidate).
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from dyncompile.errors import DataError, PlanError
from dyncompile.plan import STEP_SCHEMAS
from dyncompile.runtime.registry import StepHandler, register_step
from dyncompile.runtime.rules.exit_rule import exit_fires, softmax

logger = logging.getLogger(__name__)

__all__ = ["CHECKS", "RoutedStep", "get_check", "register_check"]

CHECKS: dict[str, Callable[[dict, dict], bool]] = {}
#: modules that register checks on import, by check name (imported on first use)
_CHECK_MODULES = {"python-doctest": "dyncompile.runtime.routing.code_check"}


def register_check(name: str) -> Callable:
    """Decorator registering ``fn(input_record: dict, output: dict) -> bool`` as executable check ``name``."""

    def deco(fn):
        if name in CHECKS and CHECKS[name] is not fn:
            raise ValueError(f"check {name!r} registered twice")
        CHECKS[name] = fn
        return fn

    return deco


def get_check(name: str) -> Callable[[dict, dict], bool]:
    """The check registered as ``name``; raises :class:`PlanError` for an unknown name."""
    if name not in CHECKS and name in _CHECK_MODULES:
        try:
            importlib.import_module(_CHECK_MODULES[name])
        except ImportError as e:
            raise PlanError(f"executable check {name!r} is not available in this dyncompile ({e})") from None
    fn = CHECKS.get(name)
    if fn is None:
        known = sorted(set(CHECKS) | set(_CHECK_MODULES))
        raise PlanError(f"unknown executable check {name!r}; this runtime knows: {', '.join(known) or 'none'}")
    return fn


class RoutedStep(StepHandler):
    """Shared part of ``cascade`` and ``route``: the candidates as loaded models (``CompiledModel``)."""

    takes_text = True  # fed the raw inputs ({"texts": [...]}) — every candidate tokenizes with its own tokenizer

    def __init__(self, step, ctx) -> None:
        """Load every candidate as a model and resolve the rule's check."""
        super().__init__(step, ctx)
        p = step.typed or STEP_SCHEMAS[self.kind](step.params, f"{self.kind} step")
        self.params = p
        self.rule = p.rule
        self.output = p.output
        self.names = [c.name for c in p.candidates]
        self.models = [ctx.load_candidate(c) for c in p.candidates]
        self.task = p.candidates[0].task
        self.per_row = [(m.plan.policy.get("early_exit") or {}).get("lowering") == "if" for m in self.models]
        self.check = get_check(self.rule.check) if self.rule.kind == "check" else None
        if self.rule.kind == "confidence" and self.task != "text-classification":
            raise PlanError(f"a confidence cascade needs classifier candidates; these do {self.task!r} (use a check rule)")

    # -- classification ---------------------------------------------------------------------------
    def _probs(self, k: int, texts: list[str], rows: np.ndarray) -> np.ndarray:
        """Candidate ``k``'s probabilities on ``rows`` of the batch ``texts``.

        An If-lowered early-exit candidate decides one exit per batch; it runs row by row so that every row
        gets the per-row decision its calibration (at batch 1) measured.
        """
        bs = 1 if self.per_row[k] else max(1, len(rows))
        return self.models[k].predict_proba([texts[i] for i in rows], batch_size=bs)

    def run(self, state: dict[str, Any]) -> dict[str, Any]:
        """Answer each text with the first candidate the rule accepts (or the one the router picks)."""
        texts = state.get("texts")
        if texts is None:
            raise DataError(f"a {self.kind} plan takes texts; call it on texts (or `dyncompile run PLAN --text ...`)")
        if self.task != "text-classification":
            raise DataError(f"this {self.kind} plan routes {self.task!r} candidates; use generate(prompt)")
        texts = list(texts)
        b = len(texts)
        chosen = np.full(b, -1, np.int64)
        result: np.ndarray | None = None
        order = self.assign(texts)  # route: a fixed candidate per row; cascade: None (decided as we go)
        active = np.arange(b)
        for k in range(len(self.models)):
            last = k == len(self.models) - 1
            rows = active if order is None else np.flatnonzero(order == k)
            if rows.size == 0:
                continue
            probs = self._probs(k, texts, rows)
            if result is None:
                result = np.zeros((b, probs.shape[1]), np.float32)
            if order is None and not last:
                keep = self.accepts(k, [texts[i] for i in rows], probs)
            else:
                keep = np.ones(len(rows), bool)
            done = rows[keep]
            result[done] = np.log(np.clip(probs[keep], 1e-30, 1.0)).astype(np.float32)  # logits up to a constant
            chosen[done] = k
            if order is None:
                active = rows[~keep]
                if active.size == 0:
                    break
        state[self.output] = result
        state["candidate"] = chosen
        return state

    def assign(self, texts: list[str]) -> np.ndarray | None:
        """The candidate per row chosen before any runs (None: a cascade decides as it goes)."""
        return None

    def accepts(self, k: int, texts: list[str], probs: np.ndarray) -> np.ndarray:
        """Which rows' answers of candidate ``k`` the rule keeps."""
        if self.rule.kind == "confidence":
            return exit_fires(probs.astype(np.float64), self.rule.thresholds[k], self.rule.criterion)
        labels = self.models[k].plan.labels or [str(i) for i in range(probs.shape[1])]
        out = []
        for t, p in zip(texts, probs):
            answer = {"label": labels[int(np.argmax(p))], "probabilities": {lab: float(v) for lab, v in zip(labels, p)}}
            out.append(bool(self.check({"text": t}, answer)))
        return np.array(out, bool)

    # -- generation --------------------------------------------------------------------------------
    def generate(self, prompt, *, record: dict | None = None, **kwargs):
        """Generation candidates: returns ``(candidate index, GenerationResult, per-candidate check results)``."""
        if self.task != "text-generation":
            raise DataError(f"generate() is for routed decoder plans; this one routes {self.task!r} candidates")
        record = dict(record or {})
        record.setdefault("prompt", prompt)
        if self.rule.kind == "learned":
            k = int(self.assign([prompt if isinstance(prompt, str) else str(prompt)])[0])
            return k, self.models[k].generate(prompt, **kwargs), []
        checks = []
        stops = getattr(self.check, "stop_sequences", None)  # e.g. python-doctest: end of the function
        if stops and "stop" not in kwargs:
            kwargs["stop"] = list(stops)
        last = len(self.models) - 1
        for k, m in enumerate(self.models[:last]):
            res = m.generate(prompt, **kwargs)
            ok = bool(self.check(record, {"text": res.text, "token_ids": list(res.token_ids)}))
            checks.append(ok)
            if ok:
                return k, res, checks
        return last, self.models[last].generate(prompt, **kwargs), checks


@register_step("cascade")
class CascadeStep(RoutedStep):
    """Candidates cheapest first; each row stops at the first candidate whose answer the rule accepts."""


@register_step("route")
class RouteStep(RoutedStep):
    """A learned router (ONNX, reads the input before any candidate runs) picks one candidate per row."""

    def __init__(self, step, ctx) -> None:
        super().__init__(step, ctx)
        from dyncompile.runtime.text import TextEncoder

        plan = ctx.plan
        if not plan.tokenizer:
            raise PlanError(f"routed plan {plan.directory}: a learned router needs the plan's 'tokenizer'")
        self.encoder = TextEncoder.from_plan(plan, plan.tokenizer)
        self.router = ctx.session(self.rule.router)
        self.router_inputs = [i.name for i in self.router.get_inputs()]
        self.thresholds = np.array([np.inf if t is None else t for t in self.rule.thresholds], np.float64)
        # candidates whose tokenizer is the router's (same file bytes, same spec) reuse the router's encoding
        tok = plan.files[plan.tokenizer["file"]].sha256
        spec = {k: plan.tokenizer.get(k) for k in ("max_length", "padding")}
        self.shared = []
        for m in self.models:
            t = m.plan.tokenizer
            same = (getattr(m.task_api, "encoder", None) is not None and t is not None and m.plan.files[t["file"]].sha256 == tok
                    and {k: t.get(k) for k in ("max_length", "padding")} == spec)
            self.shared.append(same)
        self._local = threading.local()  # the router's encoding of the calling thread's batch (``feeds``)

    def scores(self, texts: list[str]) -> np.ndarray:
        """``[B, K-1]`` router scores (larger: the cheaper candidate is more likely right)."""
        feeds = self.encoder(texts)
        self._local.feeds = feeds
        out = self.router.run([self.rule.router_output], {n: feeds[n] for n in self.router_inputs})[0]
        return np.asarray(out, np.float64).reshape(len(texts), -1)

    def _probs(self, k: int, texts: list[str], rows: np.ndarray) -> np.ndarray:
        feeds, m = getattr(self._local, "feeds", None), self.models[k]
        if not self.shared[k] or feeds is None or (self.per_row[k] and len(rows) > 1):
            return super()._probs(k, texts, rows)
        sub = {n: feeds[n][rows] for n in m.input_names if n in feeds}
        if "attention_mask" in sub:  # drop padding none of these rows needs
            width = max(1, int(sub["attention_mask"].sum(-1).max()))
            sub = {n: np.ascontiguousarray(v[:, :width]) if v.ndim == 2 else v for n, v in sub.items()}
        state = m.run_feeds(sub)
        return softmax(np.asarray(state["logits"], np.float64))

    def run(self, state: dict[str, Any]) -> dict[str, Any]:
        try:
            return super().run(state)
        finally:
            self._local.feeds = None

    def assign(self, texts: list[str]) -> np.ndarray:
        s = self.scores(texts)
        fires = np.concatenate([s > self.thresholds[None, :], np.ones((len(texts), 1), bool)], axis=1)
        return fires.argmax(axis=1)
