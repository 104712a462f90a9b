"""Routing and cascades across whole plans.

Calibrate a decision rule over candidate plans to a certified quality budget (:mod:`.calibrate`, reusing the early-exit certifier), build the learned router's ONNX graph
(:mod:`.router`), and write the self-contained routed plan folder (:mod:`.emit`).

The driver behind ``dyncompile route`` (:mod:`.driver`) runs the candidates on the calibration rows; the
runtime executor it needs for that, which passes may not import, is injected by its caller (``dyncompile.route``).
Everything else here works from per-row arrays.
"""

from __future__ import annotations

from dyncompile.passes.routing.calibrate import (
    RoutingFit,
    calibrate_cascade,
    calibrate_check,
    calibrate_route,
    cascade_costs,
    route_costs,
)
from dyncompile.passes.routing.emit import write_routed_plan
from dyncompile.passes.routing.router import RouterHead, bag_features, build_router_onnx, find_token_embedding

__all__ = [
    "RouterHead",
    "RoutingFit",
    "bag_features",
    "build_router_onnx",
    "calibrate_cascade",
    "calibrate_check",
    "calibrate_route",
    "cascade_costs",
    "find_token_embedding",
    "route_costs",
    "write_routed_plan",
]
