"""Runtime: load a plan (``plan.json`` + ONNX files) and run it on ONNX Runtime sessions."""

from dyncompile.runtime.executor import (
    STEP_HANDLERS,
    CompiledModel,
    Prediction,
    RuntimeContext,
    StepHandler,
    load,
    register_step,
)
from dyncompile.runtime.plan import PLAN_FORMAT, FileRef, Plan, Step, load_plan, save_plan
from dyncompile.runtime.providers import (
    PROVIDERS,
    check_ort_flavours,
    installed_ort_flavours,
    resolve_provider,
)

__all__ = [
    "PLAN_FORMAT",
    "PROVIDERS",
    "STEP_HANDLERS",
    "CompiledModel",
    "FileRef",
    "Plan",
    "Prediction",
    "RuntimeContext",
    "Step",
    "StepHandler",
    "check_ort_flavours",
    "installed_ort_flavours",
    "load",
    "load_plan",
    "register_step",
    "resolve_provider",
    "save_plan",
]
