"""``dyncompile models list | build NAME``: real models into ONNX, offline."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

__all__ = ["models_command"]


def models_command(args: argparse.Namespace) -> int:
    from dyncompile import models
    from dyncompile.models._core import is_complete

    if args.action in (None, "list"):
        home = Path(args.home).expanduser() if getattr(args, "home", None) else models.model_home()
        recipes = models.list_models()
        width = max([22, *(len(r.name) for r in recipes)])
        for r in recipes:
            built = "built" if is_complete(models.model_dir(r.name, home)) else "-"
            print(f"  {r.name:<{width}} {built:<6} {r.task:<20} {r.description}")
        print(f"cache: {home}; build one with `dyncompile models build NAME`")
        return 0
    t0 = time.perf_counter()
    art = models.build_model(args.name, home=args.home, assets_dir=args.assets, force=args.force, progress=not args.quiet)
    print(f"{art.name}: {art.onnx_path}  ({time.perf_counter() - t0:.1f} s)")
    return 0
