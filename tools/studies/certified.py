"""Certified early exit on the real sentiment classifiers: entropy vs learned policy, speed next to quality.

For each model: exit heads are fitted once on movie-calib (the pass's recipe: K-fold cross-fitting,
out-of-fold probabilities), then for every (criterion, confidence, budget) the thresholds are chosen
from the calibration rows alone (:func:`dyncompile.passes.early_exit.certify.certified_calibration`:
Learn-then-Test on a 30/70 split, or ``--confidence none``), lowered to the If graph (batch 1 on the
CPU EP exits per row) and measured on movie-test interleaved with the original in one process:
accuracy, drop against the original, agreement, mean exit layer and batch-1 latency from the very same
runs. movie-test is never used to choose anything.

    python -m dyncompile.tools.studies.certified --models minilm-l6-sentiment,mpnet-base-sentiment \\
        --budgets 1.0 --confidences 0.9,none --criteria entropy,learned --out bench-results/early-exit-certified

``--features DIR`` caches the pooled calibration/test features per model (``DIR/NAME.npz``), so a rerun
only fits, certifies and measures.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from dyncompile.tools.bench.common import RENDER_HELP, render_requested

logger = logging.getLogger(__name__)


def _features(name: str, art, data_dir: Path, cache: Path | None) -> dict[str, Any]:
    from dyncompile.io import read_jsonl, texts_and_labels
    from dyncompile.passes.early_exit.fit_exit_heads import collect_exit_features, find_exit_cuts

    model = ir.load(art.onnx_path)
    num_layers, cuts, _ = find_exit_cuts(model)
    exits = list(range(1, num_layers))
    cfg = art.config
    out: dict[str, Any] = {"L": num_layers, "exits": exits, "cuts": cuts}
    f = None if cache is None else cache / f"{name}.npz"
    if f is not None and f.is_file():
        z = np.load(f, allow_pickle=False)
        for split in ("calib", "test"):
            out[split] = ([z[f"{split}_f{j}"] for j in range(len(exits))], z[f"{split}_teacher"], z[f"{split}_y"])
        out["probe_seconds"] = None
        logger.info("%s: features from %s", name, f)
    else:
        t0 = time.perf_counter()
        for split in ("calib", "test"):
            texts, y = texts_and_labels(read_jsonl(data_dir / f"movie-{split}.jsonl"), cfg["labels"])
            feats, teacher = collect_exit_features(model, [cuts[k] for k in exits], texts, tokenizer_file=art.tokenizer_path,
                                                   max_length=cfg.get("max_length", 64), pooling="cls+mean")
            out[split] = (feats, teacher, np.asarray(y))
        out["probe_seconds"] = round(time.perf_counter() - t0, 1)
        if f is not None:
            f.parent.mkdir(parents=True, exist_ok=True)
            arrays = {"L": num_layers, "exits": np.array(exits)}
            for split in ("calib", "test"):
                feats, teacher, y = out[split]
                arrays |= {f"{split}_f{j}": x for j, x in enumerate(feats)}
                arrays |= {f"{split}_teacher": teacher, f"{split}_y": y}
            np.savez(f, **arrays)
    return out


def _decide(test_probs: np.ndarray, thresholds, criterion: str, policy) -> np.ndarray:
    from dyncompile.runtime.rules.exit_rule import confidence_thresholds, exit_scores, first_exit

    scores = exit_scores(test_probs, criterion, 2, policy)
    tc = confidence_thresholds(thresholds, "maxprob" if criterion == "learned" else criterion)  # learned: as is
    return first_exit(scores, tc)


def batch1_runs(runners, texts, labels, *, rows: int | None = None, warmup: int = 5) -> dict[str, Any]:
    """Batch 1 only: every row through every runner (order rotated per row), one process; the first
    runner is the baseline. Same figures as ``bench_runners``' batch-1 pass."""
    from dyncompile.tools.bench.common import interleaved_batch1

    n = len(texts) if rows is None else min(rows, len(texts))
    lat, probs, exits = interleaved_batch1(runners, texts, n, warmup=warmup)
    pred = {k: np.array([np.asarray(p).argmax() for p in v], np.int64) for k, v in probs.items()}
    layer = {k: np.array([-1 if e is None else e for e in v], np.int64) for k, v in exits.items()}
    y = np.asarray(labels[:n])
    base = runners[0].name
    results = []
    for r in runners:
        b1 = {"rows": n, "accuracy": round(float((pred[r.name] == y).mean() * 100), 3),
              "agreement": round(float((pred[r.name] == pred[base]).mean() * 100), 3),
              "latency_ms_median": round(float(np.median(lat[r.name]) * 1e3), 3),
              "latency_ms_p90": round(float(np.percentile(lat[r.name], 90) * 1e3), 3),
              "latency_ms_mean": round(float(np.mean(lat[r.name]) * 1e3), 3)}
        if (layer[r.name] >= 0).all():
            b1["mean_exit_layer"] = round(float(layer[r.name].mean()), 3)
            b1["exit_histogram"] = {str(k): int(v) for k, v in zip(*np.unique(layer[r.name], return_counts=True))}
        results.append({"name": r.name, **r.info, "batch1": b1})
    for row in results:
        row["speedup_batch1_median"] = round(results[0]["batch1"]["latency_ms_median"] / row["batch1"]["latency_ms_median"], 3)
        row["speedup_batch1_mean"] = round(results[0]["batch1"]["latency_ms_mean"] / row["batch1"]["latency_ms_mean"], 3)
    return {"baseline": base, "batch_size": 1, "results": results}


def bench_model(name: str, args, out: Path) -> dict:
    import dyncompile
    from dyncompile.io import read_jsonl, texts_and_labels
    from dyncompile.models import build_model
    from dyncompile.passes import InsertEarlyExitPass
    from dyncompile.passes.early_exit import AttachExitHeadsPass
    from dyncompile.passes.early_exit.calibrate import calibrate_exits
    from dyncompile.passes.early_exit.certify import (
        CertificationError,
        certified_calibration,
        policy_metadata,
        uncertified_certificate,
    )
    from dyncompile.passes.early_exit.fit import fit_exit_heads
    from dyncompile.passes.early_exit.fit_exit_heads import exits_to_keep
    from dyncompile.tools.bench.common import (
        bench_runners,
        plan_runner,
        reference_runner,
    )

    art = build_model(name)
    data_dir = Path(args.data_dir)
    feats = _features(name, art, data_dir, Path(args.features) if args.features else None)
    num_layers, exits, cuts = feats["L"], feats["exits"], feats["cuts"]
    cf, ct, cy = feats["calib"]
    tf, tt, ty = feats["test"]
    t0 = time.perf_counter()
    fit = fit_exit_heads(cf, ct.astype(np.float32), cy, pooling="cls+mean")
    fit_s = time.perf_counter() - t0
    test_probs = np.stack([h.predict_proba(f) for h, f in zip(fit.heads, tf)] + [tt.astype(np.float32)])
    if args.features:  # per-row arrays for offline reruns of the calibration (certify_exits needs nothing else)
        np.savez(Path(args.features) / f"{name}-probs.npz", oof=fit.oof_probs, calib_teacher=ct, calib_y=cy,
                 test_probs=test_probs, test_y=ty)
    full_pred = tt.argmax(1)
    full_acc = float((full_pred == ty).mean() * 100)
    layers_of = np.array(exits + [num_layers])

    configs, plans = [], {}
    for crit in args.criteria:
        for conf in args.confidences:
            for b in args.budgets:
                tag = f"{crit}-c{conf if conf is not None else 'none'}-b{b}"
                t1 = time.perf_counter()
                policy = None
                try:
                    if conf is None and crit != "learned":  # today's calibration, as --confidence none compiles it
                        cal = calibrate_exits(fit.oof_probs, ct, cy, exits, num_layers, budget=b, criterion=crit, patience=2)
                        thresholds = list(cal.thresholds)
                        record = {k: v for k, v in cal.to_dict().items() if k != "thresholds"} | {"rows": len(cy)}
                        cert = uncertified_certificate(record, True)
                    else:
                        res, record = certified_calibration(fit.oof_probs, ct, cy, exits, num_layers, budget=b,
                                                            confidence=conf, criterion=crit)
                        thresholds, policy, cert = res.thresholds, res.policy, res.certificate.to_dict()
                except CertificationError as e:
                    configs.append({"tag": tag, "criterion": crit, "confidence": conf, "budget": b, "error": str(e),
                                    "certifiable_budget": e.certifiable_budget})
                    logger.warning("%s %s: %s", name, tag, e)
                    continue
                calib_s = time.perf_counter() - t1
                ex = _decide(test_probs, thresholds, crit, policy)
                pred = test_probs[ex, np.arange(len(ty))].argmax(1)
                row = {
                    "tag": tag, "criterion": crit, "confidence": conf, "budget": b, "calibration_seconds": round(calib_s, 2),
                    "certificate": cert, "thresholds": thresholds[:-1],
                    "offline_test": {"drop": round(full_acc - float((pred == ty).mean() * 100), 3),
                                     "agreement": round(float((pred == full_pred).mean() * 100), 3),
                                     "layer_speedup": round(num_layers / float(layers_of[ex].mean()), 3)},
                }
                configs.append(row)
                thr = thresholds[:-1]
                learned = crit == "learned"
                keep = exits_to_keep(thr, "patience" if learned else crit, 2)
                passes = [AttachExitHeadsPass({exits[j]: fit.heads[j] for j in keep}, {exits[j]: cuts[exits[j]] for j in keep},
                                              {exits[j]: thr[j] for j in keep}, num_layers, crit,
                                              extra={"certificate": cert, "calibration": record},
                                              policies=policy_metadata(policy, exits, keep) if learned else None)]
                passes.append(InsertEarlyExitPass("if", provider="cpu", reason="bench: batch 1 on the CPU EP"))
                plans[tag] = dyncompile.compile(art.onnx_path, passes, out / "plans" / f"{name}-{tag}", force=True,
                                                progress=False).plan_dir

    load_kw = dict(provider="cpu")
    test_t, test_y = texts_and_labels(read_jsonl(data_dir / "movie-test.jsonl"), art.config["labels"])
    loaded = {tag: dyncompile.load(d, **load_kw) for tag, d in plans.items()}
    first = next(iter(loaded.values()))
    runners = [reference_runner("original", art.onnx_path, first, tag=None)]
    runners += [plan_runner(tag, m, tag=tag) for tag, m in loaded.items()]
    if args.batch32:
        report = bench_runners(runners, test_t, test_y, batch_size=32, batch1_rows=args.batch1_rows)
    else:
        report = batch1_runs(runners, test_t, test_y, rows=args.batch1_rows)
    by_tag = {c["tag"]: c for c in configs}
    for r in report["results"][1:]:
        r["config"] = by_tag[r["tag"]]
    report.update(model=name, num_layers=num_layers, original_test_accuracy=round(full_acc, 2), calib_rows=len(cy),
                  fit_seconds=round(fit_s, 1), probe_seconds=feats["probe_seconds"], configs=configs,
                  oof_agreement=fit.oof_agreement)
    return report


def _markdown(reports: list[dict], machine: dict) -> str:
    parts = [
        f"Machine: {machine['cpu']}, {machine['cores']} cores, onnxruntime {machine['onnxruntime']}, CPU EP, "
        f"{machine['date']}; load average at the start {machine.get('load_avg')}.\n",
        "Exit heads fitted on movie-calib (2,000 rows, out-of-fold probabilities); thresholds from movie-calib alone; "
        "If graph; measured on movie-test (batch 1: every row through every plan, rotating order, one process). "
        "'drop' = original accuracy − plan accuracy on the same rows (positive = worse).\n",
    ]
    for r in reports:
        base = r["results"][0]
        parts.append(f"### {r['model']} ({r['num_layers']} layers; original {base['batch1']['accuracy']:.2f} % on "
                     f"{base['batch1']['rows']} rows, p50 {base['batch1']['latency_ms_median']} ms)\n")
        parts.append("| criterion | confidence | budget | certificate (calib) | drop b1 (points) | agree b1 | mean exit layer "
                     "| p50 b1 | **speedup b1** | speedup b32 |\n|---|---|---|---|---|---|---|---|---|---|")
        for res in r["results"][1:]:
            c = res["config"]
            cert = c["certificate"]
            if cert.get("confidence") is None:
                cs = f"none (observed {cert['observed']:.2f} on {cert['rows']} rows)"
            else:
                cs = f"bound {cert['bound']:.2f}, observed {cert['observed']:.2f} on {cert['rows']} rows"
            b1 = res["batch1"]
            drop = base["batch1"]["accuracy"] - b1["accuracy"]
            parts.append(
                f"| {c['criterion']} | {c['confidence'] if c['confidence'] is not None else 'none'} | {c['budget']} | {cs} | "
                f"{drop:+.2f} | {b1.get('agreement', float('nan')):.2f} | {b1.get('mean_exit_layer', '–')} | "
                f"{b1['latency_ms_median']} ms | **{res['speedup_batch1_median']}x** | "
                f"{res.get('speedup_batch32_throughput', '–')}x |"
            )
        for c in r["configs"]:
            if "error" in c:
                parts.append(f"\n{c['tag']}: {c['error']}")
        parts.append("")
    return "\n".join(parts)


def render_markdown(report: dict) -> str:
    """The markdown of a stored ``certified.json`` report."""
    return _markdown(report["reports"], report["machine"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dyncompile.tools.studies.certified", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="minilm-l6-sentiment,mpnet-base-sentiment")
    p.add_argument("--budgets", default="1.0")
    p.add_argument("--confidences", default="0.9,none", help="comma-separated, 'none' = uncertified")
    p.add_argument("--criteria", default="entropy,learned")
    p.add_argument("--batch1-rows", type=int, default=None, help="rows in the batch-1 pass (default: all 1,500)")
    p.add_argument("--batch32", action="store_true", help="also the batch-32 throughput pass (bench_runners)")
    p.add_argument("--features", default=None, help="cache directory for pooled features (NAME.npz)")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--out", default="bench-results/early-exit-certified")
    p.add_argument("--render", metavar="JSON", help=RENDER_HELP)
    rendered = render_requested(argv, render_markdown)
    if rendered is not None:
        return rendered
    args = p.parse_args(argv)
    from dyncompile.io import shared_dir, write_json_atomic

    args.data_dir = args.data_dir or str(shared_dir() / "data" / "sentiment")
    args.budgets = [float(x) for x in args.budgets.split(",")]
    args.confidences = [None if x.strip().lower() == "none" else float(x) for x in args.confidences.split(",")]
    args.criteria = args.criteria.split(",")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from dyncompile.tools.bench.common import load_avg, machine_info

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_info() | {"load_avg": load_avg()}
    reports = []
    for name in args.models.split(","):
        reports.append(bench_model(name, args, out))
        reports[-1]["load_avg_after"] = load_avg()
        write_json_atomic(out / "certified.json", {"machine": machine, "argv": sys.argv[1:], "reports": reports})
    md = _markdown(reports, machine)
    (out / "certified.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
