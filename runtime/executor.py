"""Load a plan and run it on ONNX Runtime: a step-kind -> handler registry.

The runtime never re-derives decisions the passes made: it creates one ORT session per ONNX file
the plan names (once, reused across calls) and hands the batch through the plan's ``steps`` in
order; each step's ``kind`` selects a registered handler. Unknown kinds raise :class:`PlanError`.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dyncompile.errors import DataError, PlanError, ProviderError
from dyncompile.plan import Plan, load_plan, load_subplan
from dyncompile.runtime import steps as _steps  # noqa: F401  (registers the built-in step handlers)
from dyncompile.runtime.providers import (
    DEFAULT_SESSION_CONFIG,
    NO_SPINNING_SESSION_CONFIG,
    check_ort_flavours,
    resolve_provider,
)
from dyncompile.runtime.registry import STEP_HANDLERS, StepHandler, register_step
from dyncompile.runtime.rules.exit_rule import softmax

logger = logging.getLogger(__name__)

__all__ = ["STEP_HANDLERS", "register_step", "StepHandler", "RuntimeContext", "CompiledModel", "Prediction", "load"]

def known_step_kinds() -> set[str]:
    """The step kinds this runtime runs (every handler the step index registers)."""
    return set(STEP_HANDLERS)


class RuntimeContext:
    """Sessions for the plan's ONNX files, created lazily once and reused."""

    def __init__(
        self,
        plan: Plan,
        provider: str = "cpu",
        *,
        fallback: str | None = None,
        threads: int | None = None,
        optimization: str = "all",
        provider_options: dict[str, Any] | None = None,
        session_config: dict[str, str] | None = None,
        spinning: bool = True,
    ) -> None:
        import onnxruntime as ort

        self.ort = ort
        # EP chatter (e.g. OpenVINO's unused-input notes) stays out of stderr; ORT's own error lines too (the
        # runtime turns ORT failures into one clear error), unless debugging
        self.log_severity = 3 if logger.isEnabledFor(logging.DEBUG) else 4
        ort.set_default_logger_severity(self.log_severity)
        self.plan = plan
        self.providers = resolve_provider(provider, fallback=fallback, options=provider_options)
        self.provider = self.providers[0][0]
        if self.provider == "CUDAExecutionProvider" and hasattr(ort, "preload_dlls"):
            ort.preload_dlls()  # CUDA/cuDNN from the nvidia-* wheels (or a matching PyTorch), if present
        self.threads = threads
        if not isinstance(spinning, bool):
            raise DataError(f"spinning must be True or False, got {spinning!r}")
        self.session_config = {**DEFAULT_SESSION_CONFIG, **({} if spinning else NO_SPINNING_SESSION_CONFIG),
                               **(session_config or {})}
        levels = {
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        }
        if optimization not in levels:
            raise DataError(f"optimization must be one of {', '.join(levels)}, got {optimization!r}")
        self.optimization = levels[optimization]
        self._sessions: dict[str, Any] = {}

    def load_candidate(self, candidate) -> CompiledModel:
        """A routed plan's candidate as a loaded model: its sub-plan checked like a top-level plan, run with this
        context's provider, threads, optimisation level and session options (sessions of its own)."""
        sub = load_subplan(self.plan, candidate, known_step_kinds=known_step_kinds())
        ctx = copy.copy(self)
        ctx.plan = sub
        ctx._sessions = {}
        return CompiledModel(sub, ctx)

    def session_options(self):
        so = self.ort.SessionOptions()
        so.graph_optimization_level = self.optimization
        if self.threads:
            so.intra_op_num_threads = int(self.threads)
        so.log_severity_level = self.log_severity
        for k, v in self.session_config.items():
            so.add_session_config_entry(k, str(v))
        return so

    def session(self, file_key: str):
        """The ORT session of plan file ``file_key`` (created on first use)."""
        s = self._sessions.get(file_key)
        if s is None:
            path = self.plan.path_of(file_key)
            try:
                s = self.ort.InferenceSession(str(path), self.session_options(), providers=self.providers)
            except Exception as e:  # ORT raises its own Fail/InvalidGraph types
                if not _is_ort_error(e):
                    raise
                if self.provider == "CPUExecutionProvider":
                    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
                    raise PlanError(
                        f"ONNX Runtime cannot load {path.name} of plan {self.plan.directory}: {first}. The file is "
                        "not a model this ONNX Runtime can run (an op or domain it lacks, or a damaged graph); "
                        "recompile the plan with this dyncompile"
                    ) from None
                lowering = (self.plan.policy.get("early_exit") or {}).get("lowering")
                hint = (
                    " This plan is an If-graph early exit; recompile it for this provider with --lowering staged "
                    "(or --lowering auto --provider NAME), which needs no If nodes."
                    if lowering == "if"
                    else " Try --fallback cpu, or recompile the plan for this provider."
                )
                first = str(e).strip().splitlines()[0][:300]
                raise ProviderError(
                    f"{self.provider} could not load {path.name} of plan {self.plan.directory}: {first}.{hint}"
                ) from None
            if self.provider not in s.get_providers():
                raise ProviderError(
                    f"{self.provider} was asked for, but ONNX Runtime created the session for {path.name} on "
                    f"{s.get_providers()} (the provider failed to initialise: missing CUDA/cuDNN libraries?); "
                    "pass --fallback cpu to accept that"
                )
            logger.debug("session for %s (%s) on %s", file_key, path.name, s.get_providers())
            self._sessions[file_key] = s
        return s


def _is_ort_error(e: BaseException) -> bool:
    """An exception raised by ONNX Runtime itself (its pybind types: Fail, InvalidArgument, InvalidGraph...)."""
    return type(e).__module__.startswith("onnxruntime")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


@dataclasses.dataclass
class Prediction:
    """A classifier's answer for one text."""

    label: str
    score: float
    probabilities: dict[str, float]
    exit_layer: int | None = None
    candidate: str | None = None  # routed plans: the candidate that answered

    def __repr__(self) -> str:
        extra = f", exit_layer={self.exit_layer}" if self.exit_layer is not None else ""
        extra += f", candidate={self.candidate!r}" if self.candidate is not None else ""
        return f"Prediction(label={self.label!r}, score={self.score:.4f}{extra})"


class CompiledModel:
    """A loaded plan: call it on texts (classifiers) or feed arrays with :meth:`run_feeds`."""

    def __init__(self, plan: Plan, ctx: RuntimeContext) -> None:
        self.plan = plan
        self.ctx = ctx
        known_step_kinds()
        self.handlers = []
        for step in plan.steps:
            cls = STEP_HANDLERS.get(step.kind)
            if cls is None:
                raise PlanError(f"unknown step kind {step.kind!r}; this runtime knows: {', '.join(sorted(STEP_HANDLERS))}")
            self.handlers.append(cls(step, ctx))
        # routed plans (cascade / route steps) take the raw texts: each candidate tokenizes for itself
        self.routed = next((h for h in self.handlers if getattr(h, "takes_text", False)), None)
        self.encoder = None
        if plan.tokenizer and plan.task != "text-generation" and self.routed is None:  # generation steps hold their own codec
            from dyncompile.runtime.text import TextEncoder

            self.encoder = TextEncoder.from_plan(plan, plan.tokenizer)
        self.last_info: dict[str, Any] = {}
        self._exit_log: list[np.ndarray] = []  # per-row exit layers seen since load (drift guard)
        self._batch_level_rows = 0  # rows whose exit was decided per batch (If graph, batch > 1)

    @property
    def provider(self) -> str:
        return self.ctx.provider

    @property
    def input_names(self) -> list[str]:
        return [i["name"] for i in self.plan.inputs]

    def encode(self, texts: Sequence[str]) -> dict[str, np.ndarray]:
        if self.encoder is None:
            raise DataError("this plan has no tokenizer; feed arrays with run_feeds()")
        feeds = self.encoder(texts)
        empty = np.flatnonzero(feeds["attention_mask"].sum(-1) == 0) if "attention_mask" in feeds else []
        if len(empty):
            raise DataError(f"text {int(empty[0])} encodes to no tokens (empty text?); give some text to classify")
        return {k: v for k, v in feeds.items() if k in self.input_names}

    def run_feeds(self, feeds: dict[str, np.ndarray]) -> dict[str, Any]:
        """Run the steps on prepared input arrays; returns the final state (``logits``, extras)."""
        state: dict[str, Any] = dict(feeds)
        for i, h in enumerate(self.handlers):
            try:
                state = h.run(state)
            except KeyError as e:
                raise PlanError(
                    f"step {i} ({h.kind}) of plan {self.plan.directory} needs {e} , which neither the inputs nor an "
                    f"earlier step provide (inputs given: {sorted(state)[:6]}); the plan and its ONNX files disagree — "
                    "recompile"
                ) from None
            except Exception as e:
                if not _is_ort_error(e):
                    raise
                raise PlanError(
                    f"ONNX Runtime failed in step {i} ({h.kind}) of plan {self.plan.directory}: {_first_line(e)}; the "
                    "plan and its ONNX files disagree, or the input does not fit the model"
                ) from None
        return state

    def predict_proba(self, texts: Sequence[str], batch_size: int = 32) -> np.ndarray:
        """Class probabilities ``[N, C]``; ``self.last_info['exit_layer']`` holds per-row exits if any."""
        if isinstance(texts, str):
            texts = [texts]
        if isinstance(batch_size, bool) or not isinstance(batch_size, int | np.integer) or batch_size < 1:
            raise DataError(f"batch size must be a positive integer, got {batch_size!r}")
        probs, exits, cands = [], [], []
        for i in range(0, len(texts), batch_size):
            chunk = list(texts[i : i + batch_size])
            state = self.run_feeds({"texts": chunk} if self.routed is not None else self.encode(chunk))
            probs.append(softmax(np.asarray(state["logits"], dtype=np.float64)))
            if "candidate" in state:
                cands.append(np.asarray(state["candidate"]).reshape(-1))
            if "exit_layer" in state:  # per row (staged) or one scalar for the whole batch (If graph)
                n = len(probs[-1])
                raw = np.asarray(state["exit_layer"]).reshape(-1)
                exits.append(np.broadcast_to(raw, (n,)).copy())
                if raw.size == n:  # one exit decision per row: what the drift guard compares
                    self._exit_log.append(exits[-1])
                else:
                    self._batch_level_rows += n
        self.last_info = {"exit_layer": np.concatenate(exits) if exits else None}
        if cands:
            self.last_info["candidate"] = np.concatenate(cands)
        return np.concatenate(probs) if probs else np.zeros((0, len(self.plan.labels or [])))

    def exit_layers_seen(self) -> np.ndarray:
        """Per-row exit layers of every row this model classified since load (or :meth:`reset_exit_log`)."""
        return np.concatenate(self._exit_log) if self._exit_log else np.zeros(0, np.int64)

    def reset_exit_log(self) -> None:
        self._exit_log.clear()
        self._batch_level_rows = 0

    def drift_report(self, exit_layers=None, **kwargs):
        """Do the rows seen so far exit like the calibration rows did? (early-exit plans)

        Compares ``exit_layers`` (default: every row classified since load) with the exit-layer
        distribution the compile recorded, by :func:`dyncompile.runtime.drift.check` (keyword arguments:
        ``alpha``, ``min_tv``, ``min_rows``, ``warn``). Logs a warning and returns a verdict with
        ``drift=True`` when they exit in a pattern the calibration did not. If-graph plans decide one exit
        per batch: rows run at batch size > 1 are not counted (run at batch size 1, or compile with
        ``--lowering staged``).
        """
        from dyncompile.runtime.drift import check

        if exit_layers is None:
            exit_layers = self.exit_layers_seen()
            if self._batch_level_rows:
                logger.info(
                    "drift report: %d rows ran through an If-graph plan at batch size > 1 (one exit per batch) "
                    "and are not counted", self._batch_level_rows,
                )
        return check(exit_layers, self.plan.policy, **kwargs)

    def generate(self, prompt, **kwargs):
        """Text generation plans: continue ``prompt`` (see :func:`dyncompile.runtime.decode.generate.generate`).

        Routed plans of decoders: the answering candidate's result; ``self.last_info`` names the candidate
        (and the executable check's verdicts); ``record=`` passes extra input fields to the check."""
        from dyncompile.runtime.decode.generate import generate

        try:
            if self.routed is not None:
                k, res, checks = self.routed.generate(prompt, **kwargs)
                self.last_info = {"candidate": self.routed.names[k], "candidate_index": k, "checks": checks}
                return res
            return generate(self, prompt, **kwargs)
        except Exception as e:
            if not _is_ort_error(e):
                raise
            raise PlanError(
                f"ONNX Runtime failed generating with plan {self.plan.directory}: {_first_line(e)}; the plan and its "
                "ONNX files disagree — recompile"
            ) from None

    def __call__(self, texts: Sequence[str] | str, batch_size: int = 32) -> list[Prediction]:
        if self.plan.task != "text-classification":
            raise DataError(f"calling with texts is for classifiers; this plan's task is {self.plan.task!r}")
        probs = self.predict_proba(texts, batch_size=batch_size)
        labels = self.plan.labels or [str(i) for i in range(probs.shape[1])]
        exits = self.last_info.get("exit_layer")
        cands = self.last_info.get("candidate")
        names = self.routed.names if self.routed is not None else None
        out = []
        for i, p in enumerate(probs):
            k = int(np.argmax(p))
            out.append(
                Prediction(
                    labels[k],
                    float(p[k]),
                    {lab: float(v) for lab, v in zip(labels, p)},
                    None if exits is None else int(exits[i]),
                    None if cands is None or names is None else names[int(cands[i])],
                )
            )
        return out


def load(
    plan_dir: str | Path,
    provider: str = "cpu",
    *,
    fallback: str | None = None,
    threads: int | None = None,
    optimization: str = "all",
    provider_options: dict[str, Any] | None = None,
    session_config: dict[str, str] | None = None,
    spinning: bool = True,
    verify_hashes: bool = True,
) -> CompiledModel:
    """Load a compiled plan directory for execution on ``provider`` (``cpu``, ``openvino``, ``cuda``, ``directml``).

    Args:
        plan_dir: directory holding ``plan.json`` and the files it names (hashes are verified).
        provider: execution provider short name.
        fallback: provider to use (with a warning) when ``provider`` is not installed.
        threads: ORT intra-op threads (default: ORT's choice, all cores).
        optimization: ORT graph optimisation level: ``all``, ``extended``, ``basic`` or ``disable``.
        provider_options: options for the provider, over dyncompile's defaults.
        session_config: ORT session config entries over dyncompile's defaults
            (:data:`~dyncompile.runtime.providers.DEFAULT_SESSION_CONFIG`).
        spinning: intra-op threads spin while a call runs and stop when it returns (default): ~5-10 % faster
            decoding when the process has its cores to itself. ``False`` lets them wait without spinning
            (:data:`~dyncompile.runtime.providers.NO_SPINNING_SESSION_CONFIG`), 10-15 % faster when other busy
            processes compete for the cores.
        verify_hashes: check every file's sha256 against the plan (default on).
    """
    check_ort_flavours()
    plan = load_plan(plan_dir, verify_hashes=verify_hashes, known_step_kinds=known_step_kinds())
    ctx = RuntimeContext(
        plan,
        provider,
        fallback=fallback,
        threads=threads,
        optimization=optimization,
        provider_options=provider_options,
        session_config=session_config,
        spinning=spinning,
    )
    return CompiledModel(plan, ctx)
