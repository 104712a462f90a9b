"""``dyncompile route``: the command line of the routed-plan compiler (:mod:`dyncompile.passes.routing.driver`)."""

from __future__ import annotations

import argparse
import time

from dyncompile.errors import DataError

__all__ = ["main"]

ROUTE_EPILOG = """\
rules:
  confidence  cascade: run the cheapest candidate; keep its answer when its confidence (--criterion entropy or
              maxprob) passes the calibrated threshold, else go on to the next (zero router overhead)
  learned     route: a small ONNX router (bag of the first candidate's token embeddings + a logistic head,
              fitted on calib) reads the text before any candidate runs and picks one
  check       cascade: keep a candidate's answer when the executable check --check NAME passes on it
              (decoders: --judge NAME decides which answers are right, to measure quality)

The budget is points of accuracy lost against --reference (default: the last candidate), certified at
--confidence (Learn-then-Test, the early-exit certifier); without labels, points of disagreement.

examples:
  dyncompile route --candidates minilm/ mpnet/ --calib movie-calib.jsonl --budget 1.0 -o routed/
  dyncompile route --candidates minilm/ mpnet-ee/ --reference mpnet/ --calib movie-calib.jsonl -o routed-ee/
  dyncompile route --candidates minilm/ mpnet/ --rule learned --calib movie-calib.jsonl -o router/
  dyncompile inspect routed/            candidates, measured costs, rule, certificate
  dyncompile run routed/ --text "..."   the answer and the candidate that gave it
  dyncompile bench routed/ --data movie-test.jsonl
"""


def main(argv: list[str]) -> int:
    """``dyncompile route ARGS``: parse, compile the routed plan, print its summary; returns the exit code."""
    from dyncompile.tools.cli import _setup_logging, safe_text

    p = argparse.ArgumentParser(
        prog="dyncompile route",
        description="Compile a routed plan over candidate plans (cheapest first): a cascade that escalates when the "
        "cheaper model is unsure, or a learned router that picks a model before any runs. Measures each "
        "candidate's cost on --provider, calibrates the rule on --calib to a certified --budget, and writes "
        "a self-contained plan folder (candidates inside, hash-checked).",
        epilog=ROUTE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--candidates", nargs="+", required=True, metavar="PLAN_DIR",
                   help="plan folders, cheapest first (plain, early-exit, quantized, decoder plans)")
    p.add_argument("--calib", required=True, help="JSONL: 'text' (+ 'label') per row; decoders: 'prompt' + the check's fields")
    p.add_argument("-o", "--output", required=True, help="routed plan folder to create")
    p.add_argument("--budget", type=float, default=1.0, help="points of accuracy (or agreement) to give up (default 1.0)")
    p.add_argument("--confidence", help="probability the budget holds on new data (default 0.9), or 'none'")
    p.add_argument("--rule", choices=["confidence", "learned", "check"], default="confidence",
                   help="decision rule (default: confidence)")
    p.add_argument("--criterion", choices=["entropy", "maxprob"], default="entropy", help="confidence rule's measure")
    p.add_argument("--check", help="check rule: name of a registered executable check (e.g. python-doctest)")
    p.add_argument("--judge", help="check rule on decoders: registered check that says whether an answer is right")
    p.add_argument("--reference", help="plan folder the budget is measured against (default: the last candidate)")
    p.add_argument("--metric", choices=["accuracy", "agreement"], help="default: accuracy when every row has a label")
    p.add_argument("--limit", type=int, help="use only the first N calibration rows")
    p.add_argument("--cost-rows", type=int, default=40, help="rows to time each candidate on, batch 1 (default 40)")
    p.add_argument("--provider", default="cpu", help="execution provider to measure costs on (default cpu)")
    p.add_argument("--force", action="store_true", help="replace the output folder if it is a plan")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.add_argument("-v", "--verbose", action="count", default=0)
    args = p.parse_args(argv)
    _setup_logging(args.verbose)
    for flag, value in (("--limit", args.limit), ("--cost-rows", args.cost_rows)):
        if value is not None and value < 1:
            raise DataError(f"{flag} must be >= 1, got {value}")
    import dyncompile

    t0 = time.perf_counter()
    res = dyncompile.route(args.candidates, args.calib, args.output, budget=args.budget, confidence=args.confidence,
                           rule=args.rule, criterion=args.criterion, check=args.check, judge=args.judge,
                           reference=args.reference, metric=args.metric, limit=args.limit, cost_rows=args.cost_rows,
                           provider=args.provider, force=args.force, progress=not args.quiet)
    print(safe_text(res.summary()))
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0
