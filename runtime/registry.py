"""The step and task registries: a leaf module that step handlers and task APIs import.

A technique's runtime module registers its step handlers (:func:`register_step`) and, for a task it
answers, the task API (:func:`register_task`). The executor imports the step index
(:mod:`dyncompile.runtime.steps`) and looks handlers and task APIs up here, so no step module imports the
executor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dyncompile.errors import DataError

__all__ = [
    "STEP_HANDLERS",
    "TASK_APIS",
    "StepHandler",
    "TaskAPI",
    "first_line",
    "is_ort_error",
    "register_step",
    "register_task",
    "task_api_for",
]

STEP_HANDLERS: dict[str, type[StepHandler]] = {}
TASK_APIS: dict[str, type[TaskAPI]] = {}
_DEFAULT_TASK: list[str] = []  # the task whose API plans of an unregistered task get


def register_step(kind: str) -> Callable[[type], type]:
    """Class decorator registering a :class:`StepHandler` for plan steps of ``kind``."""

    def deco(cls):
        if kind in STEP_HANDLERS:
            raise ValueError(f"step kind {kind!r} registered twice")
        cls.kind = kind
        STEP_HANDLERS[kind] = cls
        return cls

    return deco


def register_task(task: str, *, default: bool = False) -> Callable[[type], type]:
    """Class decorator registering the :class:`TaskAPI` of plans whose ``task`` is ``task``.

    Args:
        task: the plan's ``task`` (``text-classification``, ``text-generation``, ...).
        default: this API also serves plans whose task no module registers (at most one default).
    """

    def deco(cls):
        if task in TASK_APIS:
            raise ValueError(f"task {task!r} registered twice")
        if default and _DEFAULT_TASK:
            raise ValueError(f"default task API registered twice ({_DEFAULT_TASK[0]!r}, {task!r})")
        cls.task = task
        TASK_APIS[task] = cls
        if default:
            _DEFAULT_TASK.append(task)
        return cls

    return deco


def task_api_for(task: str) -> type[TaskAPI]:
    """The task API class of plans whose ``task`` is ``task`` (the default one, else :class:`TaskAPI`)."""
    if task in TASK_APIS:
        return TASK_APIS[task]
    return TASK_APIS[_DEFAULT_TASK[0]] if _DEFAULT_TASK else TaskAPI


def is_ort_error(e: BaseException) -> bool:
    """An exception raised by ONNX Runtime itself (its pybind types: Fail, InvalidArgument, InvalidGraph...)."""
    return type(e).__module__.startswith("onnxruntime")


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (at most 300 characters), or its type name."""
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


class StepHandler:
    """One plan step. ``__init__`` may prepare sessions; ``run`` maps a state dict to a state dict.

    Args:
        step: the plan step (``step.typed`` holds its validated parameters).
        ctx: the runtime context (sessions of the plan's files, provider, options).
    """

    kind = "?"

    def __init__(self, step: Any, ctx: Any) -> None:
        """Keep the step and the context."""
        self.step = step
        self.ctx = ctx

    def run(self, state: dict[str, Any]) -> dict[str, Any]:  # pragma: no cover - interface
        """Run the step on ``state`` and return the new state."""
        raise NotImplementedError


class TaskAPI:
    """The task methods of a loaded plan; ``CompiledModel`` forwards its task methods to it.

    The base class answers every method with one clear error naming the plan's task; a technique's runtime
    module subclasses it for its task and registers it with :func:`register_task`.

    Args:
        model: the loaded plan (``CompiledModel``): its ``plan``, ``handlers`` and ``run_feeds``.
    """

    task = "?"

    def __init__(self, model: Any) -> None:
        """Keep the model."""
        self.model = model

    def _unsupported(self, method: str, wants: str) -> DataError:
        task = self.model.plan.task
        fix = ("; the compile did not learn the model's task: recompile with a config.json naming its architecture "
               'beside the model, or a dyncompile-model.json with "task" (docs/your-own-model.md)'
               if task == "unknown" else "")
        return DataError(f"{method}() is for {wants}; this plan's task is {task!r}{fix}")

    def encode(self, texts: Any, **kwargs: Any) -> Any:
        """Token arrays of texts for the plan's inputs (text-classification plans); embeddings (sentence-embedding)."""
        raise self._unsupported("encode", "classifiers and sentence-embedding plans")

    def classify(self, texts: Any, batch_size: int = 32) -> Any:
        """Classify texts (text-classification plans)."""
        raise self._unsupported("classify", "classifiers (text-classification plans)")

    def predict_proba(self, texts: Any, batch_size: int = 32) -> Any:
        """Class probabilities of texts (text-classification plans)."""
        raise self._unsupported("predict_proba", "classifiers (text-classification plans)")

    def generate(self, prompt: Any, **kwargs: Any) -> Any:
        """Continue a prompt (text-generation plans)."""
        raise self._unsupported("generate", "decoders (text-generation plans)")

    def generate_stream(self, prompt: Any, **kwargs: Any) -> Any:
        """Decoders: continue a prompt, streamed."""
        raise self._unsupported("generate_stream", "decoders (text-generation plans)")

    def generate_images(self, prompts: Any, **kwargs: Any) -> Any:
        """Images for prompts (text-to-image plans)."""
        raise self._unsupported("generate_images", "text-to-image plans")

    def drift_report(self, exit_layers: Any = None, **kwargs: Any) -> Any:
        """Exit-layer drift check (early-exit classifier plans)."""
        raise self._unsupported("drift_report", "early-exit classifiers (text-classification plans)")
