"""Early-exit benchmark on the real sentiment classifiers (issue: early exit as a compiler pass).

For each model: heads are fitted once on movie-calib (timed), thresholds calibrated for every budget,
and for the main budgets both lowerings are compiled into plans. All plans and the original model are
then measured interleaved in one process on movie-test: accuracy (and agreement with the original)
from the very same runs as the batch-1 latency (median/p90) and the batch-32 throughput; the If graph
with exits that never fire measures the full-path overhead. A budget sweep gives the accuracy–speedup
curve (test accuracy and layer speedup of per-row exits, computed from the heads' outputs on test,
plus the measured points). Writes JSON, markdown and a PNG.

    python -m dyncompile.tools.bench_early_exit                       # both models, ~25 min on 2 cores
    python -m dyncompile.tools.bench_early_exit --models minilm-l6-sentiment --batch1-rows 300
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "sentiment"


def _prob(x):
    z = np.exp(x - x.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


@dataclasses.dataclass
class FittedExits:
    """Exit heads fitted once on a model (after every inner layer), to be calibrated at several budgets."""

    num_layers: int
    exits: list[int]
    cuts: dict[int, str]
    fit: Any  # exit_heads.ExitFit
    teacher: np.ndarray  # the full model's probabilities on the calibration rows [N, C]
    probe_seconds: float
    fit_seconds: float  # probe + fit
    kw: dict[str, Any]  # tokenizer_file, max_length, pooling (to run the same features on other rows)


def fit_exits_once(model, texts: Sequence[str], labels, *, tokenizer_file, max_length: int, pooling: str = "cls+mean") -> FittedExits:
    """Run ``model`` (onnx-ir) on the calibration texts with every layer exposed and fit one head per exit."""
    from dyncompile.passes.early_exit.exit_heads import fit_exit_heads
    from dyncompile.passes.early_exit.fit_exit_heads import collect_exit_features, find_exit_cuts

    num_layers, cuts, _ = find_exit_cuts(model)
    exits = list(range(1, num_layers))
    kw = dict(tokenizer_file=tokenizer_file, max_length=max_length, pooling=pooling)
    t0 = time.perf_counter()
    feats, teacher = collect_exit_features(model, [cuts[k] for k in exits], texts, **kw)
    t_probe = time.perf_counter() - t0
    fit = fit_exit_heads(feats, teacher.astype(np.float32), None if labels is None else np.asarray(labels), pooling=pooling)
    return FittedExits(num_layers, exits, cuts, fit, teacher, t_probe, time.perf_counter() - t0, kw)


def exit_plan(src, plan_dir, fitted: FittedExits, thresholds, lowering: str, criterion: str = "entropy",
              *, pre_passes: Sequence = (), provider: str | None = None, reason: str | None = None) -> Path:
    """Compile ``src`` with ``pre_passes`` + the fitted heads at ``thresholds`` (one per exit) + the lowering."""
    import dyncompile
    from dyncompile.passes import InsertEarlyExitPass
    from dyncompile.passes.early_exit.fit_exit_heads import AttachExitHeadsPass, exits_to_keep

    exits = fitted.exits
    keep = exits_to_keep(list(thresholds), criterion, 2)
    heads = {exits[j]: fitted.fit.heads[j] for j in keep}
    passes = [
        *pre_passes,
        AttachExitHeadsPass(
            heads, {k: fitted.cuts[k] for k in heads}, {exits[j]: thresholds[j] for j in keep}, fitted.num_layers, criterion
        ),
        InsertEarlyExitPass(lowering, provider=provider, reason=reason),
    ]
    return dyncompile.compile(src, passes, plan_dir, force=True, progress=False).plan_dir


def bench_model(name: str, args, out: Path) -> dict:
    import onnx_ir as ir

    import dyncompile
    from dyncompile.io import read_jsonl, texts_and_labels
    from dyncompile.models import build_model
    from dyncompile.passes.early_exit.exit_heads import exit_decisions
    from dyncompile.passes.early_exit.fit_exit_heads import calibrate_exits, collect_exit_features
    from dyncompile.tools.bench import BENCH_SESSION_CONFIG, bench_runners, plan_runner, reference_runner

    art = build_model(name)
    cfg = art.config
    calib_t, calib_y = texts_and_labels(read_jsonl(Path(args.data_dir) / "movie-calib.jsonl"), cfg["labels"])
    test_t, test_y = texts_and_labels(read_jsonl(Path(args.data_dir) / "movie-test.jsonl"), cfg["labels"])
    calib_y, test_y = np.asarray(calib_y), np.asarray(test_y)
    model = ir.load(art.onnx_path)
    fitted = fit_exits_once(model, calib_t, calib_y, tokenizer_file=art.tokenizer_path, max_length=cfg.get("max_length", 64))
    num_layers, cuts, exits, fit, teacher, kw = fitted.num_layers, fitted.cuts, fitted.exits, fitted.fit, fitted.teacher, fitted.kw
    t_probe, t_fit = fitted.probe_seconds, fitted.fit_seconds
    logger.info("%s: probe %.1fs, probe+fit %.1fs", name, t_probe, t_fit)
    # heads' outputs on test: for the offline curve only (never used to choose anything)
    tfeats, tteacher = collect_exit_features(model, [cuts[k] for k in exits], test_t, **kw)
    test_probs = np.stack([h.predict_proba(f) for h, f in zip(fit.heads, tfeats)] + [tteacher.astype(np.float32)])
    full_acc = float((tteacher.argmax(-1) == test_y).mean() * 100)

    curve, cals = [], {}
    for b in sorted(set(args.sweep) | set(args.budgets)):
        cal = calibrate_exits(fit.oof_probs, teacher, calib_y, exits, num_layers, budget=b, criterion=args.criterion, patience=2)
        cals[b] = cal
        ex = exit_decisions(test_probs, cal)
        layers = np.array(exits + [num_layers])[ex]
        pred = test_probs[ex, np.arange(len(test_y))].argmax(-1)
        curve.append(
            {
                "budget": b,
                "calib_expected_speedup": round(cal.expected_speedup, 3),
                "calib_expected_accuracy": None if cal.expected_accuracy is None else round(cal.expected_accuracy, 2),
                "test_accuracy": round(float((pred == test_y).mean() * 100), 2),
                "test_layer_speedup": round(num_layers / float(layers.mean()), 3),
                "test_mean_exit_layer": round(float(layers.mean()), 3),
            }
        )

    plans = {}
    runners = []
    probe_plan = None

    def make_plan(tag, thresholds, lowering):
        return exit_plan(art.onnx_path, out / "plans" / f"{name}-{tag}", fitted, thresholds, lowering, args.criterion)

    never = make_plan("if-never", [None] * len(exits), "if")
    for b in args.budgets:
        for low in args.lowerings:
            plans[(b, low)] = make_plan(f"b{b}-{low}", list(cals[b].thresholds[:-1]), low)
    load_kw = dict(provider=args.provider, session_config=BENCH_SESSION_CONFIG)
    first = dyncompile.load(never, **load_kw)
    probe_plan = first
    runners.append(reference_runner("original", art.onnx_path, probe_plan, budget=None, lowering=None))
    runners.append(plan_runner("If, exits never fire", first, budget=None, lowering="if-never"))
    for (b, low), d in plans.items():
        m = dyncompile.load(d, **load_kw)
        runners.append(plan_runner(f"{low}, budget {b}", m, budget=b, lowering=low))
    report = bench_runners(runners, test_t, test_y, batch_size=32, batch1_rows=args.batch1_rows)
    report.update(
        model=name,
        provider=first.provider,
        num_layers=num_layers,
        original_test_accuracy=round(full_acc, 2),
        calib_rows=len(calib_t),
        fit_seconds=round(t_fit, 1),
        probe_seconds=round(t_probe, 1),
        fit_config=fit.config,
        oof_accuracy=fit.oof_accuracy,
        oof_agreement=fit.oof_agreement,
        calibrations={str(b): cals[b].to_dict() for b in args.budgets},
        curve=curve,
    )
    return report


def _markdown(reports: list[dict], machine: dict) -> str:
    from dyncompile.tools.bench import markdown_table

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
        xs = [c["test_layer_speedup"] for c in r["curve"]]
        ys = [c["test_accuracy"] for c in r["curve"]]
        ax.plot(xs, ys, "o-", label="per-row exits (layer speedup), budget sweep")
        for c in r["curve"]:
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dyncompile.tools.bench_early_exit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="minilm-l6-sentiment,mpnet-base-sentiment")
    p.add_argument("--budgets", default="0.5,1.0,2.0")
    p.add_argument("--sweep", default="0,0.25,0.5,0.75,1.0,1.5,2.0,3.0,4.0,6.0")
    p.add_argument("--lowerings", default="if,staged")
    p.add_argument("--criterion", default="entropy", choices=["entropy", "maxprob", "patience"])
    p.add_argument("--batch1-rows", type=int, default=None, help="rows in the batch-1 pass (default: all 1,500)")
    p.add_argument("--provider", default="cpu", help="execution provider of every session (original and plans)")
    p.add_argument("--data-dir", default=str(DATA))
    p.add_argument("--out", default="bench-results/early-exit")
    args = p.parse_args(argv)
    args.budgets = [float(x) for x in args.budgets.split(",")]
    args.sweep = [float(x) for x in args.sweep.split(",")]
    args.lowerings = args.lowerings.split(",")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from dyncompile.io import write_json_atomic
    from dyncompile.tools.bench import machine_info

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
