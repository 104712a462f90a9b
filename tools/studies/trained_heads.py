"""Linear vs trained exit heads against the oracle, certified budgets, re-split violations, agreement curve.

Runs a model ONCE over movie-calib (hidden states of every exit cached, float16) and then over movie-test and
movie-train with the heads applied batch by batch (no cache), so that:

* linear heads (the Newton fit of ``heads=fitted``) and trained heads (``heads=trained``) are fitted on
  movie-calib exactly as the early-exit pass fits them (same code, same folds);
* per exit: movie-calib out-of-fold agreement with the full model; on movie-test the agreement and the AUC of
  "this exit's argmax == the full model's" scored by the head's max probability (the ranking the exit rule uses);
* the oracle: each movie-test row stops at the first exit whose head already agrees with the full model
  (zero change), mean-exit-layer speedup ``L / mean layer``;
* certified thresholds (budget, confidence 0.9, entropy) on movie-calib, labels (``accuracy``) or not
  (``agreement``): drop, agreement and layer speedup on movie-test;
* the re-split violation rate (heads fixed, thresholds re-split over movie-calib ∪ movie-test halves);
* the agreement curve: certified disagreement bound vs observed vs number of unlabeled certifying rows
  (movie-calib out-of-fold rows first, then movie-train rows, which no head saw; labels unused).

Movie-test is used for reporting only: nothing here is chosen on it. Another task's splits are read with
``--prefix`` (``<prefix>-calib/test/train.jsonl``, e.g. the ``minilm-l6-bbc-news`` model's ``data/`` folder, with
``--max-length 64``, what its plan tokenizes to); ``--uncertified`` adds the ``--confidence none`` thresholds.

    python -m dyncompile.tools.studies.trained_heads --models minilm-l6-sentiment --out bench-results/early-exit-trained

Writes ``heads-<model>.json``, ``probs-<model>.npz`` (per-row arrays, to rerun the analysis) and
``agreement-curve.png``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["analyse", "collect_and_fit", "main"]

CONFIDENCE = 0.9


def _apply_trained(heads, probs_out, rows, mask, hiddens):
    for e, (head, h) in enumerate(zip(heads, hiddens)):
        z = head.logits(head.features(np.asarray(h, np.float32), mask))
        z = z - z.max(1, keepdims=True)
        p = np.exp(z)
        probs_out[e][rows] = p / p.sum(1, keepdims=True)


def collect_and_fit(model_name: str, data_dir: Path, *, extra_split: str | None = "movie-train",
                    extra_rows: int | None = None, progress: bool = True, train_options: dict | None = None,
                    prefix: str = "movie", max_length: int = 512) -> dict:
    """Fit linear and trained heads on movie-calib; probabilities of both on movie-test (and ``extra_split``).

    ``prefix`` names the split files: ``<prefix>-calib/test/train.jsonl`` in ``data_dir`` (another task's
    splits, e.g. ``bbc``); the returned dict keeps the keys ``calib``, ``movie-test``, ``movie-train``.
    ``max_length``: tokens per row (512, the default, is what the movie runs used; give the model's own
    ``max_length`` — what the compiled plan tokenizes to — for texts longer than it).
    """
    import onnx_ir as ir

    from dyncompile.io import read_jsonl
    from dyncompile.models import model_dir
    from dyncompile.passes.early_exit.fit_exit_heads import collect_exit_features, find_exit_cuts
    from dyncompile.passes.early_exit.newton import fit_exit_heads_newton
    from dyncompile.passes.early_exit.train_heads import HiddenCache, train_exit_heads

    mdir = model_dir(model_name)
    model = ir.load(mdir / "model.onnx")
    num_layers, cuts, _ = find_exit_cuts(model)
    exits = [k for k in sorted(cuts) if k < num_layers]
    names = [cuts[k] for k in exits]
    kw = dict(tokenizer_file=mdir / "tokenizer.json", max_length=max_length, pooling="cls+mean", progress=progress)
    calib = read_jsonl(data_dir / f"{prefix}-calib.jsonl")
    cache = HiddenCache()
    t0 = time.perf_counter()
    c0 = time.process_time()
    feats_c, teacher_c = collect_exit_features(model, names, [r["text"] for r in calib], on_batch=cache.add, **kw)
    collect_s = (time.perf_counter() - t0, time.process_time() - c0)
    y_c = np.array([r["label"] for r in calib])
    t0, c0 = time.perf_counter(), time.process_time()
    lin = fit_exit_heads_newton(feats_c, teacher_c, y_c)
    lin_s = (time.perf_counter() - t0, time.process_time() - c0)
    t0, c0 = time.perf_counter(), time.process_time()
    tr = train_exit_heads(cache, teacher_c, y_c, **(train_options or {}))
    tr_s = (time.perf_counter() - t0, time.process_time() - c0)
    logger.info("%s: cache %.0f MB; collect %.1f s, linear %.1f s, trained %.1f s", model_name, cache.nbytes() / 1e6,
                collect_s[0], lin_s[0], tr_s[0])
    del cache
    out: dict[str, Any] = {
        "model": model_name, "exits": exits, "num_layers": num_layers,
        "calib": {"teacher": teacher_c, "labels": y_c, "linear": lin.oof_probs, "trained": tr.oof_probs},
        "seconds": {"collect_calib": collect_s, "fit_linear": lin_s, "train_trained": tr_s},
        "oof_agreement": {"linear": lin.oof_agreement, "trained": tr.oof_agreement},
        "train_config": tr.config,
    }
    for split, limit in (("movie-test", None), (extra_split, extra_rows)):
        if split is None:
            continue
        rows = read_jsonl(data_dir / f"{prefix}-{split.split('-', 1)[1]}.jsonl")[:limit]
        n = len(rows)
        tprobs = [np.zeros((n, teacher_c.shape[1]), np.float32) for _ in exits]
        feats, teacher = collect_exit_features(
            model, names, [r["text"] for r in rows],
            on_batch=lambda r, m, hs, out=tprobs: _apply_trained(tr.heads, out, r, m, hs), **kw)
        out[split] = {
            "teacher": teacher, "labels": np.array([r.get("label", -1) for r in rows]),
            "linear": np.stack([h.predict_proba(f) for h, f in zip(lin.heads, feats)]), "trained": np.stack(tprobs),
        }
    return out


def _auc(score: np.ndarray, target: np.ndarray) -> float | None:
    from dyncompile.passes.early_exit.certify import _auc as auc

    return auc(score, target.astype(bool))


def _apply(tc_thresholds, criterion, probs, teacher, labels, costs):
    from dyncompile.tools.studies.early_exit_resplit import threshold_rule

    rule = threshold_rule(tc_thresholds, criterion, costs)
    p = np.concatenate([probs, teacher[None].astype(np.float32)])
    ex = rule.decide(p)
    pred = p.argmax(2)[ex, np.arange(p.shape[1])]
    full = teacher.argmax(1)
    return {
        "drop": round(100 * float((full == labels).mean() - (pred == labels).mean()), 2),
        "agreement": round(100 * float((pred == full).mean()), 2),
        "layer_speedup": round(float(1.0 / np.asarray(costs)[ex].mean()), 3),
    }


def analyse(d: dict, *, budget: float = 1.0, splits: int = 60, uncertified: bool = False) -> dict:
    """Per-exit AUC/agreement, oracle, certified (accuracy / agreement), re-split violation rate, per head kind.

    ``uncertified``: also the thresholds of ``--confidence none`` (``uncertified_<metric>``: the in-sample
    calibration on every calibration row, ``uncertified_exits``; no bound).
    """
    from dyncompile.passes.early_exit.certify import CertificationError, certified_calibration
    from dyncompile.tools.studies.early_exit_resplit import resplit

    exits, L = d["exits"], d["num_layers"]
    costs = [k / L for k in exits] + [1.0]
    cal, test = d["calib"], d["movie-test"]
    full_t = test["teacher"].argmax(1)
    rep: dict[str, Any] = {"model": d["model"], "exits": exits, "num_layers": L, "budget": budget,
                           "confidence": CONFIDENCE, "seconds": d["seconds"], "train_config": d["train_config"],
                           "full_accuracy_test": round(100 * float((full_t == test["labels"]).mean()), 2)}
    for kind in ("linear", "trained"):
        pt = test[kind]
        right = pt.argmax(2) == full_t[None]
        per_exit = [{"layer": k, "oof_agreement_calib": d["oof_agreement"][kind][j],
                     "agreement_test": round(100 * float(right[j].mean()), 2),
                     "auc_exit_right_test": _auc(pt[j].max(1), right[j])} for j, k in enumerate(exits)]
        first = np.where(right.any(0), right.argmax(0), len(exits))
        oracle = float(1.0 / np.asarray(costs)[first].mean())
        r: dict[str, Any] = {"per_exit": per_exit, "oracle_layer_speedup_test": round(oracle, 3)}
        for metric in ("accuracy", "agreement"):
            lab = cal["labels"] if metric == "accuracy" else None
            for mode, conf in (("certified", CONFIDENCE), ("uncertified", None)) if uncertified else (
                    ("certified", CONFIDENCE),):
                try:
                    res, _ = certified_calibration(cal[kind], cal["teacher"], lab, exits, L, budget=budget,
                                                   confidence=conf, criterion="entropy")
                    c = res.certificate
                    r[f"{mode}_{metric}"] = {"observed": c.observed, "bound": c.bound,
                                             "expected_speedup_calib": c.expected_speedup,
                                             **_apply(res.thresholds, "entropy", pt, test["teacher"], test["labels"],
                                                      costs)}
                except CertificationError as e:
                    r[f"{mode}_{metric}"] = {"error": str(e)}
        probs = np.concatenate([cal[kind], pt], axis=1)
        teacher = np.concatenate([cal["teacher"], test["teacher"]])
        labels = np.concatenate([cal["labels"], test["labels"]])
        rs = resplit([], teacher, labels, exits, L, methods=["certified"], budget=budget, splits=splits,
                     heads="fixed", fixed_probs=probs, progress=False)
        r["resplit"] = rs["methods"]["certified"] if "methods" in rs else rs
        rep[kind] = r
    return rep


def agreement_curve(d: dict, kind: str, sizes, *, seeds: int = 5) -> list[dict]:
    """Certified disagreement bound vs observed vs number of unlabeled certifying rows (agreement mode).

    Rows: movie-calib (out-of-fold) then movie-train (unseen by the heads), shuffled per seed; the whole
    Learn-then-Test calibration on the first ``n``; measured on movie-test: disagreement and layer speedup.
    """
    from dyncompile.passes.early_exit.certify import CertificationError, certify_exits

    exits, L = d["exits"], d["num_layers"]
    costs = [k / L for k in exits] + [1.0]
    cal, extra, test = d["calib"], d.get("movie-train"), d["movie-test"]
    probs = cal[kind] if extra is None else np.concatenate([cal[kind], extra[kind]], axis=1)
    teacher = cal["teacher"] if extra is None else np.concatenate([cal["teacher"], extra["teacher"]])
    out = []
    for n in sizes:
        if n > probs.shape[1]:
            continue
        for s in range(seeds):
            idx = np.random.default_rng(s).permutation(probs.shape[1])[:n]
            p = np.concatenate([probs[:, idx], teacher[idx][None].astype(np.float32)])
            row = {"rows": int(n), "seed": s}
            for budget in (1.0, 2.0):
                try:
                    res = certify_exits(p, teacher[idx], None, costs, budget=budget, confidence=CONFIDENCE, seed=s,
                                       split_check=0)  # the study re-splits itself
                    m = _apply(res.thresholds, "entropy", test[kind], test["teacher"], test["labels"], costs)
                    row[f"b{budget:g}"] = {"bound": res.certificate.bound, "observed": res.certificate.observed,
                                           "test_disagreement": round(100 - m["agreement"], 2),
                                           "test_drop": m["drop"], "layer_speedup": m["layer_speedup"]}
                except CertificationError:
                    row[f"b{budget:g}"] = None
            out.append(row)
    return out


def _plot_curve(curves: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    def mean(rows, key, n, b):
        v = [r[b][key] for r in rows if r["rows"] == n and r.get(b) and r[b].get(key) is not None]
        return float(np.mean(v)) if v else np.nan

    for name, rows in curves.items():
        for budget, ls in (("b1", "-"), ("b2", "--")):
            sizes = sorted({r["rows"] for r in rows if r.get(budget)})
            tag = f"{name.split('-')[0]} budget {budget[1:]}"
            axes[0].plot(sizes, [mean(rows, "bound", n, budget) for n in sizes], ls, marker="o", label=f"{tag}: bound")
            axes[0].plot(sizes, [mean(rows, "observed", n, budget) for n in sizes], ls, marker="x",
                         label=f"{tag}: observed (certifying rows)")
            axes[0].plot(sizes, [mean(rows, "test_disagreement", n, budget) for n in sizes], ls, marker=".",
                         label=f"{tag}: movie-test")
            axes[1].plot(sizes, [mean(rows, "layer_speedup", n, budget) for n in sizes], ls, marker="o", label=tag)
    for ax in axes:
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    axes[0].set_xlabel("unlabeled certifying rows")
    axes[1].set_xlabel("unlabeled certifying rows")
    axes[0].set_ylabel("disagreement with the full model (points)")
    axes[1].set_ylabel("layer speedup on movie-test")
    axes[0].set_title("certified bound vs observed (confidence 0.9)")
    axes[1].set_title("what more unlabeled text buys")
    axes[0].legend(fontsize=6)
    axes[1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


_SPLITS = ("calib", "movie-test", "movie-train")
_ARRAYS = ("teacher", "labels", "linear", "trained")


def save_probs(d: dict, path: Path) -> None:
    """The per-row arrays of :func:`collect_and_fit` as a plain npz (no pickle) + the facts as JSON inside."""
    arrays = {f"{sp}/{k}": d[sp][k] for sp in _SPLITS if sp in d for k in _ARRAYS}
    meta = {k: d[k] for k in ("model", "exits", "num_layers", "seconds", "oof_agreement", "train_config")}
    np.savez_compressed(path, meta=np.array(json.dumps(_jsonable(meta))), **arrays)


def load_probs(path: Path) -> dict:
    """Read :func:`save_probs`' file back."""
    z = np.load(path, allow_pickle=False)
    d = json.loads(str(z["meta"]))
    for key in z.files:
        if "/" in key:
            sp, k = key.split("/")
            d.setdefault(sp, {})[k] = z[key]
    return d


def _jsonable(x):
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dyncompile.tools.studies.trained_heads", description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="minilm-l6-sentiment")
    ap.add_argument("--data", type=Path, default=None, help="folder with movie-calib/test/train.jsonl")
    ap.add_argument("--prefix", default="movie", help="split files <prefix>-calib/test/train.jsonl (default movie)")
    ap.add_argument("--max-length", type=int, default=512,
                    help="tokens per row (default 512; give the model's max_length, as the plan uses, for long texts)")
    ap.add_argument("--uncertified", action="store_true",
                    help="also report the uncertified (--confidence none) thresholds next to the certified ones")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--extra-rows", type=int, default=None, help="movie-train rows to use as unlabeled rows")
    ap.add_argument("--splits", type=int, default=60)
    ap.add_argument("--curve-sizes", default="250,500,1000,2000,4000,8000")
    ap.add_argument("--from-npz", action="store_true", help="reuse probs-<model>.npz under --out")
    ap.add_argument("--plot-only", action="store_true", help="redraw agreement-curve.png from heads-*.json under --out")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from dyncompile.tools.bench.common import load_avg, machine_info

    data = args.data or Path(__import__("os").environ.get("DYNCOMPILE_SHARED", ".")) / "data" / "sentiment"
    args.out.mkdir(parents=True, exist_ok=True)
    curves = {}
    if args.plot_only:
        for p in sorted(args.out.glob("heads-*.json")):
            rep = json.loads(p.read_text())
            curves[rep["model"]] = rep["agreement_curve_trained"]
        _plot_curve(curves, args.out / "agreement-curve.png")
        return 0
    for name in args.models.split(","):
        npz = args.out / f"probs-{name}.npz"
        reused = args.from_npz and npz.is_file()
        if reused:
            d = load_probs(npz)
        else:
            d = collect_and_fit(name, data, extra_rows=args.extra_rows, prefix=args.prefix,
                                max_length=args.max_length)
            save_probs(d, npz)
        rep = analyse(d, splits=args.splits, uncertified=args.uncertified)
        rep["data_prefix"] = args.prefix
        rep["max_length"] = None if reused else args.max_length  # a reused npz does not record it
        sizes = [int(s) for s in args.curve_sizes.split(",")]
        curve = agreement_curve(d, "trained", sizes)
        curves[name] = curve
        rep["agreement_curve_trained"] = curve
        rep["machine"] = machine_info()
        rep["load_avg"] = load_avg()
        (args.out / f"heads-{name}.json").write_text(json.dumps(_jsonable(rep), indent=1))
        print(json.dumps(_jsonable({k: rep[k] for k in ("model", "full_accuracy_test", "seconds")}), indent=None))
        for kind in ("linear", "trained"):
            r = rep[kind]
            print(kind, "oracle", r["oracle_layer_speedup_test"], "AUC",
                  [e["auc_exit_right_test"] and round(e["auc_exit_right_test"], 3) for e in r["per_exit"]],
                  "agree", [e["agreement_test"] for e in r["per_exit"]])
            print("  cert acc", r["certified_accuracy"], "\n  cert agr", r["certified_agreement"])
            if args.uncertified:
                print("  uncert acc", r["uncertified_accuracy"], "\n  uncert agr", r["uncertified_agreement"])
            print("  resplit", {k: v for k, v in r["resplit"].items() if not isinstance(v, list)})
    _plot_curve(curves, args.out / "agreement-curve.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
