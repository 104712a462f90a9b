"""dyncompile: a graph-compiler pass framework over ONNX for dynamic execution."""

from __future__ import annotations

from dyncompile._version import __version__

__all__ = ["__version__", "compile", "load", "route"]


def load(plan_dir, provider: str = "cpu", **kwargs):
    """Load a compiled plan directory and return a callable model (see :func:`dyncompile.runtime.load`)."""
    from dyncompile.runtime import load as _load

    return _load(plan_dir, provider=provider, **kwargs)


def compile(model_path, passes="verify,cleanup", output_dir=None, **kwargs):  # noqa: A001 - public API name
    """Compile an ONNX model with a pass pipeline into a plan directory (see :func:`dyncompile.passes.compiler.compile_model`)."""
    from dyncompile.passes.compiler import compile_model

    return compile_model(model_path, passes=passes, output_dir=output_dir, **kwargs)


def route(candidates, calib, output_dir, **kwargs):
    """Compile a routed plan (cascade or learned router) over candidate plan folders, cheapest first, calibrated
    to a certified quality budget on ``calib`` (see :func:`dyncompile.passes.routing.driver.route`).

    The candidates run on the runtime executor, which the routing compiler (a pass) may not import: this
    function hands it the plan loader and the executable-check lookup."""
    from dyncompile.passes.routing.driver import route as _route
    from dyncompile.runtime import load as _load
    from dyncompile.runtime.routing.route import get_check

    return _route(candidates, calib, output_dir, load=_load, get_check=get_check, **kwargs)
