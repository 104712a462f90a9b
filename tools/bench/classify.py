"""``dyncompile bench classify``: a compiled classifier plan against its original model, in one process, interleaved.

``dyncompile bench classify PLAN_DIR --data FILE.jsonl`` (or ``dyncompile bench PLAN_DIR ...`` for a
classifier plan) measures, on the same rows and in the same run:
accuracy of the original and the compiled model, agreement, mean exit layer and per-exit histogram,
latency median/p90 at batch 1 (each row runs through every model in rotating order), throughput at
batch 32, and the speedup ratios. Results are printed and written as JSON + markdown. The measurement
itself lives in :mod:`dyncompile.tools.bench.common`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from dyncompile.tools.bench.common import (
    RENDER_HELP,
    bench_runners,
    machine_info,
    markdown_table,
    plan_runner,
    reference_runner,
    render_requested,
    write_report,
)

__all__ = ["bench_classifier", "drift_section", "main", "render_markdown"]


def drift_section(compiled, report: dict[str, Any], name: str = "compiled") -> str | None:
    """Observed (batch 1, the runner called ``name``) vs calibration exit histograms + the drift verdict, into
    ``report["drift"]``."""
    from dyncompile.runtime.drift import calibration_distribution, check, format_histograms

    if calibration_distribution(compiled.plan.policy) is None:
        return None
    row = next((r for r in report["results"] if r["name"] == name), None)
    hist = (row or {}).get("batch1", {}).get("exit_histogram")
    if not hist:
        return None
    verdict = check(hist, compiled.plan.policy)
    report["drift"] = verdict.to_dict()
    return format_histograms(verdict)


def bench_classifier(plan, data, *, limit: int | None = None, batch1_rows: int | None = None, batch_size: int = 32,
                     provider: str = "cpu", fallback: str | None = None, progress: bool = True,
                     name: str = "compiled") -> tuple[dict[str, Any], str | None]:
    """The classify harness: the plan in ``plan`` (its runner called ``name``) against its sha256-checked original
    model on the rows of ``data``, interleaved. Returns the report (with its ``markdown``) and the drift section
    (observed exit layers against calibration; ``None`` without exits)."""
    import dyncompile
    from dyncompile.io import read_jsonl, texts_and_labels
    from dyncompile.tools.evaluate import check_labels_in_range

    compiled = dyncompile.load(plan, provider=provider, fallback=fallback)
    src = str(compiled.plan.original_model("bench"))  # sha256-checked: it compares against the true original
    texts, labels = texts_and_labels(read_jsonl(data, limit=limit), compiled.plan.labels)
    check_labels_in_range(labels, compiled.plan.labels, data)
    runners = [reference_runner("original", src, compiled), plan_runner(name, compiled)]
    report = bench_runners(runners, texts, labels, batch_size=batch_size, batch1_rows=batch1_rows, progress=progress)
    drift = drift_section(compiled, report, name)
    report["machine"] = machine_info()
    report["plan"] = str(Path(plan).resolve())
    report["provider"] = compiled.provider
    report["markdown"] = markdown_table(report)
    return report, drift


def render_markdown(report: dict) -> str:
    """The markdown this harness writes beside its JSON report, from the JSON alone (``--render JSON``)."""
    return markdown_table(report)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="dyncompile bench classify",
        description="Benchmark a compiled classifier plan against its original model on the same data, interleaved "
        "in one process: accuracy, agreement, exit statistics, batch-1 latency, batched throughput, speedups.",
    )
    p.add_argument("plan", help="plan directory")
    p.add_argument("--data", required=True, help="JSONL with 'text' (and 'label')")
    p.add_argument("--limit", type=int, help="use the first N rows")
    p.add_argument("--batch1-rows", type=int, help="rows for the batch-1 latency pass (default: all)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--provider", default="cpu")
    p.add_argument("--fallback")
    p.add_argument("--report-dir", default=".", help="where JSON + markdown go (default: the current directory)")
    p.add_argument("-q", "--quiet", action="store_true")
    p.add_argument("--render", metavar="JSON", help=RENDER_HELP)
    rendered = render_requested(argv, render_markdown)
    if rendered is not None:
        return rendered
    args = p.parse_args(argv)
    from dyncompile.errors import DataError

    if args.batch_size < 1 or (args.limit is not None and args.limit < 1):
        raise DataError("--batch-size and --limit must be >= 1")
    report, drift = bench_classifier(args.plan, args.data, limit=args.limit, batch1_rows=args.batch1_rows,
                                     batch_size=args.batch_size, provider=args.provider, fallback=args.fallback,
                                     progress=not args.quiet)
    jp, mp = write_report(report, Path(args.report_dir), Path(args.plan).resolve().name)
    print(report["markdown"])
    if drift:
        print("\nexit layers at batch 1 vs calibration:\n" + drift)
    print(f"\nmachine: {report['machine']}\nwritten: {jp} {mp}")
    return 0
