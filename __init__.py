"""dyncompile: a graph-compiler pass framework over ONNX for dynamic execution."""

from __future__ import annotations

from dyncompile._version import __version__

__all__ = ["ORTModelForSequenceClassification", "__version__", "compile", "load", "pipeline", "route"]


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


def pipeline(task: str, model, *, provider: str = "cpu", passes: str = "verify,cleanup", **kwargs):
    """A ``transformers.pipeline``-style callable of ``task`` over a plan (see :mod:`dyncompile.runtime.pipelines`).

    ``model`` is a plan directory, a loaded plan, or a model to compile first: an ONNX file or a Hugging Face /
    Optimum model folder (compiled with ``passes`` into a temporary plan the pipeline keeps while it lives).
    ``task``: ``text-classification`` (``sentiment-analysis``), ``text-generation`` or ``feature-extraction``;
    the calls return what transformers' pipelines of that task return. Other keyword arguments go to :func:`load`.
    """
    import tempfile
    from pathlib import Path

    from dyncompile.runtime.pipelines import make_pipeline

    if hasattr(model, "plan"):
        return make_pipeline(task, model)
    path = Path(model)
    keep = None
    if not (path / "plan.json").is_file():
        keep = tempfile.TemporaryDirectory(prefix="dyncompile-pipeline-")
        path = compile(path, passes, Path(keep.name) / "plan", progress=False).plan_dir
    return make_pipeline(task, load(path, provider=provider, **kwargs), keep)


def __getattr__(name: str):
    if name == "ORTModelForSequenceClassification":  # Optimum's class of that name, on a plan
        from dyncompile.runtime.pipelines import ORTModelForSequenceClassification

        return ORTModelForSequenceClassification
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
