"""The text-classification task API: ``model.classify(texts)`` / ``model(texts)``, ``predict_proba``, ``drift_report``.

Plans of any task no other technique registers (e.g. ``unknown``, a plain compiled encoder) get this API too,
so that ``predict_proba`` runs them on texts when they carry a tokenizer; ``classify`` is for
``text-classification`` plans only.

Steps report per-row extras in the state: ``exit_layer`` (early exit: one per row, or one per batch for an
If graph) and ``candidate`` (routed plans: the index of the answering candidate). A step that takes the raw
texts instead of token arrays (``takes_text``; routed plans, whose candidates tokenize for themselves) is fed
``{"texts": [...]}``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from dyncompile.errors import DataError, PlanError
from dyncompile.runtime.registry import TaskAPI, register_task
from dyncompile.runtime.rules.exit_rule import softmax

logger = logging.getLogger(__name__)

__all__ = ["ClassifierAPI", "Prediction"]


@dataclasses.dataclass
class Prediction:
    """A classifier's answer for one text."""

    label: str
    score: float
    probabilities: dict[str, float]
    exit_layer: int | None = None
    candidate: str | None = None  # routed plans: the candidate that answered

    def __repr__(self) -> str:
        """One line: label, score and the exit layer / candidate when there is one."""
        extra = f", exit_layer={self.exit_layer}" if self.exit_layer is not None else ""
        extra += f", candidate={self.candidate!r}" if self.candidate is not None else ""
        return f"Prediction(label={self.label!r}, score={self.score:.4f}{extra})"


@register_task("text-classification", default=True)
class ClassifierAPI(TaskAPI):
    """Classifier plans: texts in, class probabilities / predictions out, with the exit log of the drift guard.

    Args:
        model: the loaded plan.
    """

    #: the drift guard keeps the exit layers of at most this many recent rows (4 bytes each: 4 MiB)
    EXIT_LOG_WINDOW = 1 << 20

    def __init__(self, model: Any) -> None:
        """Find the text-taking step, if any, and the plan's tokenizer."""
        super().__init__(model)
        plan = model.plan
        self.text_step = next((h for h in model.handlers if getattr(h, "takes_text", False)), None)
        self.encoder = None
        if plan.tokenizer and self.text_step is None:
            from dyncompile.runtime.text import TextEncoder

            self.encoder = TextEncoder.from_plan(plan, plan.tokenizer)
        # per-row exit layers of the most recent rows (drift guard): a ring of at most EXIT_LOG_WINDOW rows,
        # 4 bytes a row, grown by doubling up to the window, so a long-running server's memory stays bounded
        self._exit_log = np.zeros(0, np.int32)
        self._exit_rows = 0  # rows logged since load or reset (the ring holds the last min(this, window))
        self._batch_level_rows = 0  # rows whose exit was decided per batch (If graph, batch > 1)
        self._log_lock = threading.Lock()  # calls from several threads add to the log

    def encode(self, texts: Sequence[str]) -> dict[str, np.ndarray]:
        """Token arrays of ``texts`` for the plan's inputs (the plan's tokenizer)."""
        if self.encoder is None:
            raise DataError("this plan has no tokenizer; feed arrays with run_feeds()")
        feeds = self.encoder(texts)
        empty = np.flatnonzero(feeds["attention_mask"].sum(-1) == 0) if "attention_mask" in feeds else []
        if len(empty):
            raise DataError(f"text {int(empty[0])} encodes to no tokens (empty text?); give some text to classify")
        return {k: v for k, v in feeds.items() if k in self.model.input_names}

    def predict_proba(self, texts: Sequence[str] | str, batch_size: int = 32) -> np.ndarray:
        """Class probabilities ``[N, C]``; ``model.last_info['exit_layer']`` holds per-row exits if any."""
        return self._predict(texts, batch_size)[0]

    def _predict(self, texts: Sequence[str] | str, batch_size: int) -> tuple[np.ndarray, dict[str, Any]]:
        """Probabilities and this call's per-row extras (exit layers, candidates), also set as ``last_info``."""
        if isinstance(texts, str):
            texts = [texts]
        if isinstance(batch_size, bool) or not isinstance(batch_size, int | np.integer) or batch_size < 1:
            raise DataError(f"batch size must be a positive integer, got {batch_size!r}")
        probs, exits, cands = [], [], []
        for i in range(0, len(texts), batch_size):
            chunk = list(texts[i : i + batch_size])
            state = self.model.run_feeds({"texts": chunk} if self.text_step is not None else self.encode(chunk))
            if "logits" not in state:
                raise PlanError(
                    f"plan {self.model.plan.directory}: its steps computed {sorted(state)[:8]} but no 'logits' "
                    "(a step's output names a value nothing writes); the plan and its ONNX files disagree — recompile it"
                )
            probs.append(softmax(np.asarray(state["logits"], dtype=np.float64)))
            if "candidate" in state:
                cands.append(np.asarray(state["candidate"]).reshape(-1))
            if "exit_layer" in state:
                exits.append(self._log_exits(state["exit_layer"], len(probs[-1])))
        info: dict[str, Any] = {"exit_layer": np.concatenate(exits) if exits else None}
        if cands:
            info["candidate"] = np.concatenate(cands)
        self.model.last_info = info  # per thread (CompiledModel.last_info)
        return (np.concatenate(probs) if probs else np.zeros((0, len(self.model.plan.labels or []))), info)

    def _log_exits(self, exit_layer: Any, n: int) -> np.ndarray:
        """Per-row exits of a batch of ``n`` rows (an If graph gives one for the whole batch); logs per-row ones."""
        raw = np.asarray(exit_layer).reshape(-1)
        rows = np.broadcast_to(raw, (n,)).copy()
        with self._log_lock:
            if raw.size == n:  # one exit decision per row: what the drift guard compares
                self._append_exits(rows)
            else:
                self._batch_level_rows += n
        return rows

    def _append_exits(self, rows: np.ndarray) -> None:
        """Add a batch's per-row exits to the ring of the last :attr:`EXIT_LOG_WINDOW` rows (caller holds the lock)."""
        window = self.EXIT_LOG_WINDOW
        rows = rows[-window:]
        end = self._exit_rows + len(rows)
        if end > len(self._exit_log) and len(self._exit_log) < window:  # still growing: keep the rows in order
            grown = np.zeros(min(window, max(end, 2 * len(self._exit_log), 1024)), np.int32)
            grown[: self._exit_rows] = self._exit_log[: self._exit_rows]
            self._exit_log = grown
        size = len(self._exit_log)
        start = self._exit_rows % size
        if start + len(rows) <= size:  # the common case: one slice, no index arrays per call
            self._exit_log[start : start + len(rows)] = rows
        else:  # wraps around the ring's end
            self._exit_log[(start + np.arange(len(rows))) % size] = rows
        self._exit_rows = end

    def classify(self, texts: Sequence[str] | str, batch_size: int = 32) -> list[Prediction]:
        """One :class:`Prediction` per text (label, score, probabilities, exit layer, answering candidate)."""
        if self.model.plan.task != "text-classification":
            raise self._unsupported("classify", "classifiers (text-classification plans)")
        probs, info = self._predict(texts, batch_size)  # this call's extras, whatever other threads do meanwhile
        labels = self.model.plan.labels or [str(i) for i in range(probs.shape[1])]
        exits = info.get("exit_layer")
        cands = info.get("candidate")
        names = getattr(self.text_step, "names", None)
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

    def exit_layers_seen(self) -> np.ndarray:
        """Per-row exit layers of the rows classified since load (or :meth:`reset_exit_log`), oldest first.

        Every row, or the most recent :attr:`EXIT_LOG_WINDOW` once more have been seen.
        """
        with self._log_lock:
            n, size = self._exit_rows, len(self._exit_log)
            if n <= size:
                return self._exit_log[:n].astype(np.int64)
            return np.roll(self._exit_log, -(n % size)).astype(np.int64)

    def reset_exit_log(self) -> None:
        """Forget the exit layers seen so far."""
        with self._log_lock:
            self._exit_log = np.zeros(0, np.int32)
            self._exit_rows = 0
            self._batch_level_rows = 0

    def drift_report(self, exit_layers: Any = None, **kwargs: Any) -> Any:
        """Do the rows seen so far exit like the calibration rows did? (early-exit plans).

        Compares ``exit_layers`` (default: :meth:`exit_layers_seen`, the recent rows classified) with the exit-layer
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
        return check(exit_layers, self.model.plan.policy, **kwargs)
