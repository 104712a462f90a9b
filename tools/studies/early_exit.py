"""Early-exit benchmark on the real sentiment classifiers, compiled by the ``early-exit`` pass.

For each model, every measured plan is what ``dyncompile MODEL --passes early-exit --calib movie-calib``
gives (the ``early-exit`` pass through :func:`dyncompile.compile`, heads fitted on every inner layer): for
the main budgets both lowerings, plus an If graph compiled with ``never_exit`` (every head computed, none
fires: the full-path overhead). All plans and the original model are then measured interleaved in one
process on movie-test: accuracy (and agreement with the original) from the very same runs as the batch-1
latency (median/p90) and the batch-32 throughput.

A budget sweep gives the accuracy–speedup curve offline (test accuracy and layer speedup of per-row exits,
from the heads' outputs on test): one fit with the pass's own recipe (:func:`fit_exit_heads_newton`,
:func:`calibrate_exits`, the functions :class:`FitExitHeadsPass` calls), calibrated at every budget; the
report records whether its thresholds at the main budgets equal the compiled plans' (they should: same
recipe, same seed). Writes JSON, markdown and a PNG.

    python -m dyncompile.tools.studies.early_exit                       # both models, ~40 min on 2 cores
    python -m dyncompile.tools.studies.early_exit --models minilm-l6-sentiment --batch1-rows 300
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import numpy as np

from dyncompile.tools.bench.common import DATA, RENDER_HELP, compile_early_exit, render_requested

logger = logging.getLogger(__name__)


def offline_curve(art, calib_t, calib_y, test_t, test_y, budgets, criterion: str,
                  confidence: float | None = None) -> tuple[list[dict], dict]:
    """Accuracy–speedup curve on movie-test from one fit (the pass's recipe) calibrated at every budget.

    ``confidence`` (or criterion ``learned``): thresholds as the pass chooses them with ``--confidence``
    (:func:`~dyncompile.passes.early_exit.certify.certified_calibration`); a budget that cannot be certified
    gets a curve point with the error and the budget that could be.
    """
    import onnx_ir as ir

    from dyncompile.passes.early_exit.calibrate import calibrate_exits, exit_decisions
    from dyncompile.passes.early_exit.fit import DEFAULT_POOLING
    from dyncompile.passes.early_exit.fit_exit_heads import collect_exit_features, find_exit_cuts
    from dyncompile.passes.early_exit.newton import fit_exit_heads_newton

    model = ir.load(art.onnx_path)
    num_layers, cuts, _ = find_exit_cuts(model)
    exits = list(range(1, num_layers))
    kw = dict(tokenizer_file=art.tokenizer_path, max_length=int(art.config.get("max_length", 512)), pooling=DEFAULT_POOLING)
    feats, teacher = collect_exit_features(model, [cuts[k] for k in exits], calib_t, **kw)
    fit = fit_exit_heads_newton(feats, teacher, calib_y, pooling=DEFAULT_POOLING)
    tfeats, tteacher = collect_exit_features(model, [cuts[k] for k in exits], test_t, **kw)
    test_probs = np.stack([h.predict_proba(f) for h, f in zip(fit.heads, tfeats)] + [tteacher.astype(np.float32)])
    curve, thresholds = [], {}
    from dyncompile.passes.early_exit.certify import CertificationError, certified_calibration
    from dyncompile.runtime.rules.exit_rule import confidence_thresholds, exit_scores, first_exit

    for b in budgets:
        if confidence is not None or criterion == "learned":
            try:
                res, rec = certified_calibration(fit.oof_probs, teacher, calib_y, exits, num_layers, budget=b,
                                                 confidence=confidence, criterion=criterion)
            except CertificationError as e:
                curve.append({"budget": b, "error": str(e), "certifiable_budget": e.certifiable_budget})
                continue
            thresholds[b] = {str(k): t for k, t in zip(exits, res.thresholds[:-1])}
            scores = exit_scores(test_probs, criterion, 2, res.policy)
            ex = first_exit(scores, confidence_thresholds(res.thresholds, "maxprob" if criterion == "learned" else criterion))
            expected_speedup, expected_acc = res.certificate.expected_speedup, None
        else:
            cal = calibrate_exits(fit.oof_probs, teacher, calib_y, exits, num_layers, budget=b, criterion=criterion,
                                  patience=2)
            thresholds[b] = {str(k): t for k, t in zip(exits, cal.thresholds[:-1])}
            ex = exit_decisions(test_probs, cal)
            expected_speedup, expected_acc = cal.expected_speedup, cal.expected_accuracy
        layers = np.array(exits + [num_layers])[ex]
        pred = test_probs[ex, np.arange(len(test_y))].argmax(-1)
        curve.append(
            {
                "budget": b,
                "calib_expected_speedup": round(expected_speedup, 3),
                "calib_expected_accuracy": None if expected_acc is None else round(expected_acc, 2),
                "test_accuracy": round(float((pred == test_y).mean() * 100), 2),
                "test_layer_speedup": round(num_layers / float(layers.mean()), 3),
                "test_mean_exit_layer": round(float(layers.mean()), 3),
            }
        )
    facts = {"original_test_accuracy": round(float((tteacher.argmax(-1) == test_y).mean() * 100), 2),
             "fit_config": fit.config, "oof_accuracy": fit.oof_accuracy, "oof_agreement": fit.oof_agreement,
             "thresholds": thresholds}
    return curve, facts


def bench_model(name: str, args, out: Path) -> dict:
    import dyncompile
    from dyncompile.io import read_jsonl, texts_and_labels
    from dyncompile.models import build_model
    from dyncompile.tools.bench.common import (
        bench_runners,
        plan_runner,
        reference_runner,
    )

    art = build_model(name)
    cfg = art.config
    calib = Path(args.data_dir) / "movie-calib.jsonl"
    calib_t, calib_y = texts_and_labels(read_jsonl(calib), cfg["labels"])
    test_t, test_y = texts_and_labels(read_jsonl(Path(args.data_dir) / "movie-test.jsonl"), cfg["labels"])
    calib_y, test_y = np.asarray(calib_y), np.asarray(test_y)

    plans, seconds, policies = {}, {}, {}

    def make_plan(tag, **options):
        res, secs = compile_early_exit(art.onnx_path, out / "plans" / f"{name}-{tag}", calib, criterion=args.criterion,
                                       provider=args.provider,
                                       confidence="none" if args.confidence is None else args.confidence, **options)
        seconds[tag] = round(secs, 1)
        policies[tag] = res.plan.policy["early_exit"]
        logger.info("%s %s: compiled in %.1fs", name, tag, secs)
        return res.plan_dir

    never = make_plan("if-never", budget=max(args.budgets), lowering="if", never_exit=True)
    for b in args.budgets:
        for low in args.lowerings:
            plans[(b, low)] = make_plan(f"b{b}-{low}", budget=b, lowering=low)
    curve, facts = offline_curve(art, calib_t, calib_y, test_t, test_y, sorted(set(args.sweep) | set(args.budgets)),
                                 args.criterion, args.confidence)
    same = {str(b): facts["thresholds"].get(b) == policies[f"b{b}-{low}"]["calibration"]["thresholds_all_exits"]
            for b in args.budgets for low in args.lowerings[:1]}
    if not all(same.values()):
        logger.warning("%s: the offline curve's thresholds differ from the compiled plans' at budgets %s", name,
                       [b for b, ok in same.items() if not ok])

    load_kw = dict(provider=args.provider)
    first = dyncompile.load(never, **load_kw)
    runners = [reference_runner("original", art.onnx_path, first, budget=None, lowering=None),
               plan_runner("If, every head computed, none fires", first, budget=None, lowering="if-never")]
    for (b, low), d in plans.items():
        runners.append(plan_runner(f"{low}, budget {b}", dyncompile.load(d, **load_kw), budget=b, lowering=low))
    report = bench_runners(runners, test_t, test_y, batch_size=32, batch1_rows=args.batch1_rows)
    num_layers = policies["if-never"]["num_layers"]
    report.update(
        model=name,
        provider=first.provider,
        num_layers=num_layers,
        original_test_accuracy=facts["original_test_accuracy"],
        calib_rows=len(calib_t),
        compile_seconds=seconds,
        fit_seconds=policies["if-never"]["fit"]["seconds"],
        fit_config=facts["fit_config"],
        oof_accuracy=facts["oof_accuracy"],
        oof_agreement=facts["oof_agreement"],
        calibrations={str(b): policies[f"b{b}-{args.lowerings[0]}"]["calibration"] for b in args.budgets},
        curve=curve,
        curve_thresholds_match_plans=same,
    )
    return report


def _markdown(reports: list[dict], machine: dict) -> str:
    from dyncompile.tools.bench.common import markdown_table

    parts = [
        f"Machine: {machine['cpu']}, {machine['cores']} cores, {machine.get('gpu') or 'no GPU'}, onnxruntime "
        f"{machine['onnxruntime']}, provider {reports[0].get('provider')}, {machine['date']}.\n"
    ]
    for r in reports:
        parts.append(
            f"### {r['model']} ({r['num_layers']} layers; heads fitted on {r['calib_rows']} movie-calib rows in "
            f"{r['fit_seconds']} s; reported on movie-test, batch-1 pass over {r['results'][0]['batch1']['rows']} rows)\n"
        )
        parts.append(markdown_table(r))
        parts.append("\nBudget sweep (per-row exits; layer speedup = L / mean exit layer, from the heads' outputs on test):\n")
        parts.append("| budget | calib: expected speedup | calib: expected acc | test acc | test layer speedup |\n|---|---|---|---|---|")
        for c in r["curve"]:
            if "error" in c:
                parts.append(f"| {c['budget']} | not certifiable (smallest: {c['certifiable_budget']}) | | | |")
                continue
            parts.append(
                f"| {c['budget']} | {c['calib_expected_speedup']}x | {c['calib_expected_accuracy']} | {c['test_accuracy']} "
                f"(full {r['original_test_accuracy']}) | {c['test_layer_speedup']}x |"
            )
        parts.append("")
    return "\n".join(parts)


def _plot(reports: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(reports), figsize=(6 * len(reports), 4.5), squeeze=False)
    for ax, r in zip(axes[0], reports):
        pts = [c for c in r["curve"] if "error" not in c]
        xs = [c["test_layer_speedup"] for c in pts]
        ys = [c["test_accuracy"] for c in pts]
        ax.plot(xs, ys, "o-", label="per-row exits (layer speedup), budget sweep")
        for c in pts:
            ax.annotate(str(c["budget"]), (c["test_layer_speedup"], c["test_accuracy"]), fontsize=7)
        for res in r["results"][1:]:
            if res.get("budget") is None:
                continue
            ax.plot(res["speedup_batch1_median"], res["batch1"]["accuracy"], "s" if res["lowering"] == "if" else "^",
                    label=f"measured {res['name']} (median latency speedup, b1)")
        ax.axhline(r["original_test_accuracy"], color="gray", ls="--", lw=1, label="original")
        ax.set_xlabel("speedup (x)")
        ax.set_ylabel("movie-test accuracy (%)")
        ax.set_title(r["model"])
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def render_markdown(report: dict) -> str:
    """The markdown of a stored ``early_exit.json`` report."""
    return _markdown(report["reports"], report["machine"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dyncompile.tools.studies.early_exit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="minilm-l6-sentiment,mpnet-base-sentiment")
    p.add_argument("--budgets", default="0.5,1.0,2.0")
    p.add_argument("--sweep", default="0,0.25,0.5,0.75,1.0,1.5,2.0,3.0,4.0,6.0")
    p.add_argument("--lowerings", default="if,staged")
    p.add_argument("--criterion", default="entropy", choices=["entropy", "maxprob", "patience", "learned"])
    p.add_argument("--confidence", default="none",
                   help="as the pass's --confidence (e.g. 0.9: certified budgets); default none, this bench's "
                   "historical uncertified calibration (tools/studies/certified.py compares both)")
    p.add_argument("--batch1-rows", type=int, default=None, help="rows in the batch-1 pass (default: all 1,500)")
    p.add_argument("--provider", default="cpu", help="execution provider of every session (original and plans)")
    p.add_argument("--data-dir", default=str(DATA))
    p.add_argument("--out", default="bench-results/early-exit")
    p.add_argument("--render", metavar="JSON", help=RENDER_HELP)
    rendered = render_requested(argv, render_markdown)
    if rendered is not None:
        return rendered
    args = p.parse_args(argv)
    args.budgets = [float(x) for x in args.budgets.split(",")]
    from dyncompile.passes.early_exit.certify import CalibrationError, parse_confidence

    try:
        args.confidence = parse_confidence(args.confidence)
    except CalibrationError as e:
        p.error(str(e))
    args.sweep = [float(x) for x in args.sweep.split(",")]
    args.lowerings = args.lowerings.split(",")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from dyncompile.io import write_json_atomic
    from dyncompile.tools.bench.common import machine_info

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    reports = []
    for name in args.models.split(","):
        reports.append(bench_model(name, args, out))
        write_json_atomic(out / "early_exit.json", {"machine": machine, "reports": reports})
    md = _markdown(reports, machine)
    (out / "early_exit.md").write_text(md)
    _plot(reports, out / "early_exit.png")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
