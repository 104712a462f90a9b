"""dyncompile: a graph-compiler pass framework over ONNX for dynamic execution."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "compile", "load", "route"]


def load(plan_dir, provider: str = "cpu", **kwargs):
    """Load a compiled plan directory and return a callable model (see :func:`dyncompile.runtime.load`)."""
    from dyncompile.runtime import load as _load

    return _load(plan_dir, provider=provider, **kwargs)


def compile(model_path, passes="verify,cleanup", output_dir=None, **kwargs):  # noqa: A001 - public API name
    """Compile an ONNX model with a pass pipeline into a plan directory (see :func:`dyncompile.tools.compile`)."""
    from dyncompile.passes.compiler import compile_model

    return compile_model(model_path, passes=passes, output_dir=output_dir, **kwargs)


def route(candidates, calib, output_dir, **kwargs):
    """Compile a routed plan (cascade or learned router) over candidate plan folders, cheapest first, calibrated
    to a certified quality budget on ``calib`` (see :func:`dyncompile.passes.routing.driver.route`)."""
    from dyncompile.passes.routing.driver import route as _route

    return _route(candidates, calib, output_dir, **kwargs)
