"""``dyncompile route --candidates A/ B/ --calib F -o R/``: a cascade or router over plans (``dyncompile.route``)."""

from __future__ import annotations

import argparse
import time

from dyncompile.errors import DataError
from dyncompile.tools._text import safe_text

__all__ = ["route_command"]


def route_command(args: argparse.Namespace) -> int:
    for flag, value in (("--limit", args.limit), ("--cost-rows", args.cost_rows)):
        if value is not None and value < 1:
            raise DataError(f"{flag} must be >= 1, got {value}")
    import dyncompile

    t0 = time.perf_counter()
    res = dyncompile.route(args.candidates, args.calib, args.output, budget=args.budget, confidence=args.confidence,
                           rule=args.rule, criterion=args.criterion, check=args.check, judge=args.judge,
                           reference=args.reference, metric=args.metric, limit=args.limit, cost_rows=args.cost_rows,
                           provider=args.provider, force=args.force, link=args.link, progress=not args.quiet)
    print(safe_text(res.summary()))
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0
