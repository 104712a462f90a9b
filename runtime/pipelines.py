"""APIs a transformers / Optimum user already knows, on a loaded plan.

* :func:`make_pipeline` — ``dyncompile.pipeline(task, plan)``: callables that take what a
  ``transformers.pipeline`` of the same task takes and return the same structures
  (``text-classification``: ``[{"label", "score"}]``; ``text-generation``: ``[{"generated_text"}]``;
  ``feature-extraction``: nested lists ``[1, tokens, hidden]``).
* :class:`ORTModelForSequenceClassification` — Optimum's class of that name, on a plan:
  ``from_pretrained(plan_dir)``, then ``model(**tokenizer_outputs).logits``.

The plan decides what runs (early exit, speculative decoding, routing); these wrappers only translate the calling
convention.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from dyncompile.errors import DataError

__all__ = [
    "FeatureExtractionPipeline",
    "ORTModelForSequenceClassification",
    "PIPELINES",
    "SequenceClassifierOutput",
    "TextClassificationPipeline",
    "TextGenerationPipeline",
    "make_pipeline",
]

#: transformers' other names of the tasks
TASK_ALIASES = {"sentiment-analysis": "text-classification"}


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


class _Pipeline:
    """A task's calling convention over a loaded plan (``self.model``)."""

    task = ""

    def __init__(self, model: Any, keep: Any = None) -> None:
        """Wrap ``model`` (a loaded plan); ``keep`` is held for the pipeline's lifetime (a temporary plan folder)."""
        self.model = model
        self._keep = keep

    def __repr__(self) -> str:
        """The task and the plan directory."""
        return f"{type(self).__name__}(task={self.task!r}, plan={self.model.plan.directory})"


class TextClassificationPipeline(_Pipeline):
    """``transformers.pipeline("text-classification")``'s calling convention."""

    task = "text-classification"

    def _scores(self, texts: list[str], function_to_apply: str | None, batch_size: int) -> np.ndarray:
        labels = self.model.plan.labels or []
        fn = (function_to_apply or ("sigmoid" if len(labels) == 1 else "softmax")).lower()
        if fn not in ("softmax", "sigmoid", "none"):
            raise DataError(f"function_to_apply must be 'softmax', 'sigmoid' or 'none', got {function_to_apply!r}")
        if fn == "softmax":
            return self.model.predict_proba(texts, batch_size=batch_size)
        logits = np.concatenate([
            np.asarray(self.model.run_feeds(self.model.encode(texts[i:i + batch_size]))["logits"], np.float64)
            for i in range(0, len(texts), batch_size)
        ])
        return _sigmoid(logits) if fn == "sigmoid" else logits

    def __call__(self, inputs: str | Sequence[str], **kwargs: Any) -> list:
        """Classify ``inputs`` (a text or a list of texts).

        Args:
            inputs: one text or a list of texts.
            **kwargs: ``top_k`` (an int, or None for every label; given, each text gets a list sorted by score),
                ``function_to_apply`` (``"softmax"``, ``"sigmoid"``, ``"none"``), ``batch_size``.

        Returns:
            As transformers: ``[{"label", "score"}]`` for a text, one dict per text for a list; with ``top_k``
            a list of dicts per text (a list of such lists for a list of texts).
        """
        legacy = "top_k" not in kwargs
        top_k = kwargs.pop("top_k", 1)
        fn = kwargs.pop("function_to_apply", None)
        batch_size = kwargs.pop("batch_size", 32)
        if kwargs:
            raise DataError(f"unknown text-classification pipeline arguments: {sorted(kwargs)}")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise DataError(f"top_k must be a positive integer or None, got {top_k!r}")
        single = isinstance(inputs, str)
        texts = [inputs] if single else list(inputs)
        if not texts or not all(isinstance(t, str) for t in texts):
            raise DataError("give a text or a list of texts to classify")
        scores = self._scores(texts, fn, batch_size)
        names = self.model.plan.labels or [f"LABEL_{i}" for i in range(scores.shape[1])]
        out: list = []
        for row in scores:
            if legacy and top_k == 1:
                k = int(np.argmax(row))
                out.append({"label": names[k], "score": float(row[k])})
                continue
            ranked = [{"label": names[i], "score": float(row[i])} for i in range(len(row))]
            if not legacy:
                ranked.sort(key=lambda d: d["score"], reverse=True)
                ranked = ranked if top_k is None else ranked[:top_k]
            out.append(ranked)
        return out if not (single and not legacy) else out[0]


class TextGenerationPipeline(_Pipeline):
    """``transformers.pipeline("text-generation")``'s calling convention (greedy unless ``do_sample``)."""

    task = "text-generation"

    def _one(self, prompt: str, kw: dict[str, Any], full: bool) -> list[dict[str, str]]:
        res = self.model.generate(prompt, **kw)
        text = res.text if res.text is not None else ""
        return [{"generated_text": prompt + text if full else text}]

    def __call__(self, inputs: str | Sequence[str], **kwargs: Any) -> list:
        """Continue ``inputs`` (a prompt or a list of prompts).

        Args:
            inputs: one prompt or a list of prompts.
            **kwargs: ``max_new_tokens`` (default 256), ``do_sample``, ``temperature``, ``return_full_text``
                (default True: the prompt, then the continuation), ``seed``, and any keyword of
                ``CompiledModel.generate`` (``stop``, ``chat``, speculative options).

        Returns:
            As transformers: ``[{"generated_text": str}]`` for a prompt, a list of those for a list of prompts.
        """
        full = bool(kwargs.pop("return_full_text", True))
        if kwargs.pop("num_return_sequences", 1) != 1:
            raise DataError("num_return_sequences other than 1 is not supported; call once per sequence")
        kw = {"max_new_tokens": kwargs.pop("max_new_tokens", 256), "sample": bool(kwargs.pop("do_sample", False)),
              **kwargs}
        if isinstance(inputs, str):
            return self._one(inputs, kw, full)
        prompts = list(inputs)
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise DataError("give a prompt or a list of prompts")
        return [self._one(p, kw, full) for p in prompts]


class FeatureExtractionPipeline(_Pipeline):
    """``transformers.pipeline("feature-extraction")``'s calling convention: the plan's first output per text."""

    task = "feature-extraction"

    def __call__(self, inputs: str | Sequence[str], **kwargs: Any) -> list:
        """Token features of ``inputs``: ``[1, tokens, hidden]`` nested lists per text (as transformers).

        Args:
            inputs: one text or a list of texts.
            **kwargs: none are supported (transformers' tokenizer arguments come from the plan).
        """
        if kwargs:
            raise DataError(f"unknown feature-extraction pipeline arguments: {sorted(kwargs)}")
        single = isinstance(inputs, str)
        texts = [inputs] if single else list(inputs)
        out = []
        for t in texts:
            state = self.model.run_feeds(self.model.task_api.tokenize([t]))  # token features, not pooled
            out.append(np.asarray(state[self.model.plan.outputs[0]["name"]]).tolist())
        return out[0] if single else out


PIPELINES: dict[str, type[_Pipeline]] = {
    p.task: p for p in (TextClassificationPipeline, TextGenerationPipeline, FeatureExtractionPipeline)
}


def make_pipeline(task: str, model: Any, keep: Any = None) -> _Pipeline:
    """The pipeline of ``task`` over the loaded plan ``model``.

    Args:
        task: a transformers task name (``text-classification`` / ``sentiment-analysis``, ``text-generation``,
            ``feature-extraction``).
        model: a loaded plan (``dyncompile.load``).
        keep: an object the pipeline holds on to (the temporary folder of a plan compiled on the fly).

    Raises:
        DataError: an unknown task, or a plan of another task.
    """
    task = TASK_ALIASES.get(task, task)
    if task not in PIPELINES:
        raise DataError(f"no dyncompile pipeline for task {task!r}; known: {', '.join(sorted(PIPELINES))}")
    plan_task = model.plan.task
    if plan_task != task:
        raise DataError(
            f"the plan at {model.plan.directory} is a {plan_task!r} plan, not {task!r}; ask for "
            f"pipeline({plan_task!r}, ...), or fix the task in dyncompile-model.json beside the model and recompile"
        )
    return PIPELINES[task](model, keep)


# ------------------------------------------------------------------------------------------- Optimum-style class


@dataclasses.dataclass
class SequenceClassifierOutput:
    """What Optimum's ``ORTModelForSequenceClassification`` returns: ``.logits`` (also ``out["logits"]``)."""

    logits: Any

    def __getitem__(self, key: str | int) -> Any:
        """``out["logits"]`` / ``out[0]``, as transformers' ``ModelOutput``."""
        if key in ("logits", 0):
            return self.logits
        raise KeyError(key)


@dataclasses.dataclass
class _Config:
    """The parts of a transformers config a classifier user reads."""

    id2label: dict[int, str]
    label2id: dict[str, int]

    @property
    def num_labels(self) -> int:
        """Number of classes."""
        return len(self.id2label)


class ORTModelForSequenceClassification:
    """Optimum's ``ORTModelForSequenceClassification`` calling convention on a text-classification plan."""

    def __init__(self, model: Any) -> None:
        """Wrap a loaded text-classification plan."""
        if model.plan.task != "text-classification":
            raise DataError(f"the plan at {model.plan.directory} is a {model.plan.task!r} plan, not a text classifier")
        self.model = model
        labels = model.plan.labels or []
        self.config = _Config({i: s for i, s in enumerate(labels)}, {s: i for i, s in enumerate(labels)})

    @classmethod
    def from_pretrained(cls, plan_dir: Any, provider: str = "cpu", **kwargs: Any) -> ORTModelForSequenceClassification:
        """Load the plan at ``plan_dir`` (keyword arguments as :func:`dyncompile.load`)."""
        from dyncompile.runtime.executor import load

        return cls(load(plan_dir, provider=provider, **kwargs))

    def __call__(self, input_ids: Any = None, attention_mask: Any = None, token_type_ids: Any = None,
                 **kwargs: Any) -> SequenceClassifierOutput:
        """Logits of the tokenized batch; torch tensors in give a torch tensor out, numpy arrays a numpy array."""
        given = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
        kwargs.pop("return_dict", None)
        if kwargs:
            raise DataError(f"unknown inputs {sorted(kwargs)}; give the tokenizer's outputs (input_ids, attention_mask, ...)")
        if input_ids is None:
            raise DataError("input_ids is required (call the model with the tokenizer's outputs: model(**enc))")
        is_torch = type(input_ids).__module__.startswith("torch")
        feeds = {}
        for name in self.model.input_names:
            v = given.get(name)
            if v is None and name == "attention_mask":
                v = np.ones(np.shape(input_ids), np.int64)
            elif v is None and name == "token_type_ids":
                v = np.zeros(np.shape(input_ids), np.int64)
            elif v is None:
                raise DataError(f"the plan's model needs input {name!r}")
            feeds[name] = np.asarray(v.cpu().numpy() if is_torch else v, dtype=np.int64)
        logits = np.asarray(self.model.run_feeds(feeds)["logits"])
        if is_torch:
            import torch

            return SequenceClassifierOutput(torch.from_numpy(logits.copy()))
        return SequenceClassifierOutput(logits)

    forward = __call__
