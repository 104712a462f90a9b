"""Runtime: load a plan (``plan.json`` + ONNX files) and run it on ORT sessions.

Names are imported lazily, so that importing a leaf module (``dyncompile.runtime.text``) does not load
the executor and every step handler.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "STEP_HANDLERS": "dyncompile.runtime.registry",
    "CompiledModel": "dyncompile.runtime.executor",
    "Prediction": "dyncompile.runtime.classify",
    "LoadOptions": "dyncompile.runtime.executor",
    "RuntimeContext": "dyncompile.runtime.executor",
    "StepHandler": "dyncompile.runtime.registry",
    "load": "dyncompile.runtime.executor",
    "register_step": "dyncompile.runtime.registry",
    "register_task": "dyncompile.runtime.registry",
    "TaskAPI": "dyncompile.runtime.registry",
    "PLAN_FORMAT": "dyncompile.plan",
    "FileRef": "dyncompile.plan",
    "Plan": "dyncompile.plan",
    "Step": "dyncompile.plan",
    "load_plan": "dyncompile.plan",
    "save_plan": "dyncompile.plan",
    "PROVIDERS": "dyncompile.runtime.providers",
    "check_ort_flavours": "dyncompile.runtime.providers",
    "installed_ort_flavours": "dyncompile.runtime.providers",
    "resolve_provider": "dyncompile.runtime.providers",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
