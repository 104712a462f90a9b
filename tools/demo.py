"""``make demo`` / ``python -m dyncompile.tools.demo``: the main job on the real default model.

1. build the fine-tuned MiniLM-L6 sentiment classifier into ONNX (offline, cached);
2. compile it with ``verify,cleanup`` and check it reproduces the original on movie-test;
3. compile it with ``early-exit`` calibrated on movie-calib (budget 1 point);
4. benchmark original vs early exit on movie-test in one process: accuracy next to speed.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from dyncompile.tools.bench.common import DATA


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dyncompile.tools.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="minilm-l6-sentiment")
    p.add_argument("--data-dir", default=str(DATA), help="folder with movie-calib.jsonl and movie-test.jsonl")
    p.add_argument("--out", default="demo-out", help="where the compiled plans and reports go")
    p.add_argument("--budget", type=float, default=1.0)
    p.add_argument("--batch1-rows", type=int, default=None,
                   help="rows of the batch-1 pass (default: all 1,500; the drop is read from it, and a few hundred rows are too few to read a 1-point budget: one standard error is ~0.9 points at 500 rows)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    import dyncompile
    from dyncompile import models
    from dyncompile.errors import DyncompileError
    from dyncompile.tools.bench.classify import bench_classifier
    from dyncompile.tools.bench.common import write_report
    from dyncompile.tools.evaluate import evaluate_plan

    try:
        data = Path(args.data_dir)
        out = Path(args.out)
        print(f"== 1. building {args.model} (cached after the first time)")
        art = models.build_model(args.model)
        print(f"   {art.onnx_path}")

        print("== 2. dyncompile MODEL --passes verify,cleanup")
        base = dyncompile.compile(art.onnx_path, "verify,cleanup", out / "verify-cleanup", force=True)
        compiled = dyncompile.load(base.plan_dir)
        rep = evaluate_plan(compiled, data / "movie-test.jsonl", compare=True)
        print("   " + rep["text"].replace("\n", "\n   "))

        print(f"== 3. dyncompile MODEL --passes early-exit --calib movie-calib.jsonl --budget {args.budget} "
              "--confidence 0.9")
        ee = dyncompile.compile(
            art.onnx_path, "early-exit", out / "early-exit", force=True,
            calib=str(data / "movie-calib.jsonl"), budget=args.budget, confidence=0.9, lowering="if",
        )
        pol = ee.plan.policy.get("early_exit", {})
        cal = pol.get("calibration", {})
        from dyncompile.passes.early_exit.certify import describe_certificate

        print(f"   thresholds {pol.get('thresholds')}; expected on calib: speedup {cal.get('expected_speedup', 0):.2f}x")
        print(f"   {describe_certificate(pol['certificate'])}")
        print(f"   (the promise: with probability >= 0.9 over the calibration draw, the expected drop on new text like "
              f"movie-calib is <= {args.budget:g} points; the rows below are one sample of such text)")

        print("== 4. original vs early exit on movie-test (interleaved, same process)")
        report, _ = bench_classifier(ee.plan_dir, data / "movie-test.jsonl", batch1_rows=args.batch1_rows,
                                     name=f"early-exit (budget {args.budget})")
        write_report(report, out, "demo-bench")
        print(report["markdown"])
        orig, ee_row = report["results"][0]["batch1"], report["results"][1]["batch1"]
        if "accuracy" in orig:
            drop = orig["accuracy"] - ee_row["accuracy"]
            print(f"   accuracy drop on these {ee_row['rows']} rows (batch 1, per-row exits): {drop:.2f} points — "
                  f"{'within' if drop <= args.budget else 'OVER'} the budget of {args.budget:g} certified at 90 % "
                  f"confidence (the promise is about the expected drop; these rows are one sample of it)")
        print(f"   machine: {report['machine']}")
    except DyncompileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
