"""``dyncompile serve PLAN...``: compiled plans behind Ray Serve, one deployment per plan.

Classifier plans answer ``POST /v1/classify`` (dynamic batching with ``@serve.batch`` into the plan, staged
early exit compacting the batch as rows exit); decoder plans the OpenAI-compatible ``/v1/completions`` and
``/v1/chat/completions`` (streaming as server-sent events); text-to-image plans ``/v1/images/generations``;
sentence-embedding plans ``/v1/embeddings``; routed plans like their candidates. Every deployment has ``/health``,
``/v1/models`` and ``/metrics`` (Prometheus text). Replicas, batching, queueing and back-pressure (503 once a
deployment's queue is full) are Ray Serve's; the same deployment runs on a Ray cluster of several machines.

Python::

    from dyncompile.tools.serve import ServeOptions, build_app, start
    urls = start(["ee/", "pl/"], ServeOptions(port=8000))   # {"ee": "http://127.0.0.1:8000/ee", ...}

``build_app(plan_dir, options)`` gives the Ray Serve application of one plan for ``serve.run`` in your own
Ray setup. Ray, FastAPI and prometheus-client come with the ``serve`` extra (``pip install dyncompile[serve]``).
"""

from __future__ import annotations

from dyncompile.tools.serve.options import PlanInfo, ServeOptions, plan_info

__all__ = ["PlanInfo", "ServeOptions", "build_app", "plan_info", "start", "stop"]


def build_app(plan_dir, options: ServeOptions | None = None, *, name: str | None = None):
    """The Ray Serve application of one plan (see :func:`dyncompile.tools.serve.app.build_app`)."""
    from dyncompile.tools.serve.app import build_app as _build

    return _build(plan_dir, options, name=name)


def start(plans, options: ServeOptions | None = None) -> dict[str, str]:
    """Serve ``plans`` (see :func:`dyncompile.tools.serve.app.start`); returns each plan's base URL."""
    from dyncompile.tools.serve.app import start as _start

    return _start(plans, options)


def stop(*, ray_too: bool = True) -> None:
    """Shut Serve down (and Ray, when this process started it)."""
    from dyncompile.tools.serve.app import stop as _stop

    _stop(ray_too=ray_too)
