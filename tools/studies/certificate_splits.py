"""How much a certified exit plan owes to its calibration split: the compile's certificate re-run on many split seeds.

``dyncompile ... --passes ...,early-exit --budget B`` splits its calibration rows once (seed 0): the *path* rows
build the threshold path (and fit the learned exit policy), the *certifying* rows test it (Learn then Test, fixed
sequence, 90 % by default). The promise "drop ≤ B with probability ≥ 90 %" is over the draw of calibration rows,
and the split is part of that draw — but every compile of the same model on the same file makes the *same* split,
so one unlucky split is shipped again by every plan compiled from that file.

This study fits the exit heads exactly as the early-exit pass does (same functions: :func:`collect_exit_features`,
:func:`train_exit_heads` or the Newton fit, :func:`certified_calibration`) on a plan compiled *without* exits
(fp32, or int8 as the compile would see it), once; it then certifies again for split seeds ``0..N-1`` and applies
each certified setting to test rows that no head, threshold or policy saw (the shipped heads, as the plan runs
them). Per budget and seed: certified or refused, the bound, the expected speedup (layer cost), and on the test
rows the drop against the fp32 original and the layer speedup. For seed 0 (what the compile ships) it also
gives the loss at the chosen setting on the path rows and on the certifying rows, which separates a lucky split
from lucky calibration rows. The test rows are used for reporting only: nothing here is chosen on them.

    dyncompile MODEL --passes "quantize-int8{format=dynamic,activations=per-token}" -o int8-plan/
    python -m dyncompile.tools.studies.certificate_splits --plan int8-plan --heads trained --criterion learned \\
        --train-text movie-train.jsonl --budgets 1.0,0.5 --seeds 30 --name NAME --out bench-results/certificate-splits

Writes ``NAME.json`` / ``NAME.md`` (``--render NAME.json`` re-renders the markdown) and ``NAME.npz`` (the per-row
probabilities; ``--from-npz NAME.npz`` reruns the analysis without running a model, e.g. with another criterion).

``--merge K`` asks instead what a certificate *merged over K splits* would ship: each of K seeds certifies at
confidence ``1 - delta / K``, so that with probability ``>= 1 - delta`` all K settings are within the budget at
once (the union bound) and any of them may be shipped — the fastest, or the median. Seeds ``0..N-1`` make
``N // K`` such groups; per group and budget: the shipped setting's expected speedup and its test drop ("median":
the lower median, the ``(K + 1) // 2``-th slowest).

``--shift`` asks whether the calibration rows and the test rows are alike for these exits (:func:`shift`: per exit,
the drop, the disagreement with the fp32 original and who is right when they disagree, on both files; permutation
tests of exchangeability for the drop and for the label-free disagreement; the test file's own noise on the share
of certificates over budget). ``--metric agreement`` certifies the disagreement rate instead of the accuracy drop,
as the compile's ``--metric agreement`` does.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

ARRAYS = ("oof", "teacher", "labels", "reference", "test_exits", "test_teacher", "test_labels", "test_reference")


def collect(plan_dir: Path, calib: Path, test: Path, train_text: Path | None, heads: str, batch_size: int = 32,
            progress: bool = True) -> dict[str, Any]:
    """Run the plan's model (and its fp32 original) on the rows; fit the heads as the early-exit pass does.

    Returns the per-row arrays of :data:`ARRAYS` plus ``exits`` and ``num_layers``: ``oof`` ``[E, N, C]`` the
    heads' out-of-fold probabilities on the calibration rows, ``teacher`` ``[N, C]`` the model's own output,
    ``reference`` ``[N, C]`` the fp32 original's, and the same for the test rows with the shipped heads.
    """
    import onnx_ir as ir

    import dyncompile
    from dyncompile.io import read_jsonl, texts_and_labels
    from dyncompile.passes.early_exit.fit_exit_heads import collect_exit_features, find_exit_cuts

    compiled = dyncompile.load(plan_dir)
    plan = compiled.plan
    if "early_exit" in plan.policy:
        raise SystemExit(f"{plan_dir}: this plan already has exits; give one compiled without early-exit")
    model = ir.load(Path(plan.directory) / plan.files["model"].path)
    reference = ir.load(plan.original_model("bench"))
    num_layers, cuts, _ = find_exit_cuts(model)
    pooling = "cls+mean"  # the fitted heads' pooling when early-exit is given none (trained heads pool their own)
    exits = [k for k in sorted(cuts) if k < num_layers]
    cut_names = [cuts[k] for k in exits]
    kw = dict(tokenizer_file=Path(plan.directory) / plan.files["tokenizer"].path, max_length=int(plan.tokenizer["max_length"]),
              batch_size=batch_size, progress=progress)
    cal_texts, cal_y = texts_and_labels(read_jsonl(calib), plan.labels)
    test_texts, test_y = texts_and_labels(read_jsonl(test), plan.labels)
    n = len(cal_texts)
    if heads == "trained":
        from dyncompile.passes.early_exit.train_heads import HiddenCache, train_exit_heads

        cache = HiddenCache()
        _, teacher = collect_exit_features(model, cut_names, cal_texts, pooling="cls", on_batch=cache.add, **kw)
        teacher_all = teacher
        if train_text is not None:
            train_texts = [r["text"] for r in read_jsonl(train_text)]
            _, extra = collect_exit_features(model, cut_names, train_texts, pooling="cls",
                                             on_batch=lambda rows, mask, hs: cache.add(rows + n, mask, hs), **kw)
            teacher_all = np.concatenate([teacher, extra])
        fit = train_exit_heads(cache, teacher_all, np.asarray(cal_y), n_calibration=n)
        del cache
    else:
        from dyncompile.passes.early_exit.newton import fit_exit_heads_newton

        features, teacher = collect_exit_features(model, cut_names, cal_texts, pooling=pooling, **kw)
        fit = fit_exit_heads_newton(features, teacher, np.asarray(cal_y), pooling=pooling)
    test_exits: list[list[np.ndarray]] = [[] for _ in exits]
    test_rows: list[np.ndarray] = []

    def apply_heads(rows, mask, hiddens):  # the shipped heads on the test rows, batch by batch
        test_rows.append(np.asarray(rows))
        for e, (head, h) in enumerate(zip(fit.heads, hiddens, strict=True)):
            test_exits[e].append(head.predict_proba(head.features(np.asarray(h, np.float32), mask)))

    _, test_teacher = collect_exit_features(model, cut_names, test_texts, pooling="cls", on_batch=apply_heads, **kw)
    order = np.argsort(np.concatenate(test_rows))
    test_probs = np.stack([np.concatenate(p)[order] for p in test_exits])
    _, ref_cal = collect_exit_features(reference, [], cal_texts, pooling="cls", **kw)
    _, ref_test = collect_exit_features(reference, [], test_texts, pooling="cls", **kw)
    passes = [*plan.provenance.get("passes", []), f"exit heads: {heads}"]
    return {
        "passes": np.asarray(passes), "oof": np.asarray(fit.oof_probs, np.float32), "teacher": teacher.astype(np.float32),
        "labels": np.asarray(cal_y, np.int64), "reference": ref_cal.astype(np.float32),
        "test_exits": test_probs.astype(np.float32), "test_teacher": test_teacher.astype(np.float32),
        "test_labels": np.asarray(test_y, np.int64), "test_reference": ref_test.astype(np.float32),
        "exits": np.asarray(exits, np.int64), "num_layers": np.int64(num_layers),
    }


def _decisions(certified, p: np.ndarray) -> np.ndarray:
    """Exit index per row of ``p`` ``[E, N, C]`` under a certified setting (the runtime's exit rule)."""
    from dyncompile.runtime.rules.exit_rule import exit_scores, first_exit, first_exits

    if certified.criterion == "learned":
        tc = np.array([np.inf if t is None else float(t) for t in certified.thresholds], np.float64)
        return first_exit(exit_scores(p, "learned", policy=certified.policy), tc)
    return first_exits(p, certified.thresholds, certified.criterion, 2)


def _losses(certified, exit_probs: np.ndarray, final: np.ndarray, reference: np.ndarray, labels: np.ndarray):
    """(per-row loss against the fp32 original, exit index) of a certified setting."""
    from dyncompile.passes.early_exit.certify import exit_losses

    p = np.concatenate([exit_probs, final[None]]).astype(np.float64)
    fe = _decisions(certified, p)
    return exit_losses(p, reference.argmax(-1), labels)[fe, np.arange(p.shape[1])], fe


def _test_outcome(certified, a: dict[str, Any]) -> tuple[float, float, float]:
    """(drop, disagreement with the fp32 original, both in points; layer speedup) of a certified setting on the test rows."""
    loss, fe = _losses(certified, a["test_exits"], a["test_teacher"], a["test_reference"], a["test_labels"])
    p = np.concatenate([a["test_exits"], a["test_teacher"][None]])
    disagreement = p[fe, np.arange(p.shape[1])].argmax(-1) != a["test_reference"].argmax(-1)
    costs = np.r_[np.asarray(a["exits"], np.float64) / int(a["num_layers"]), 1.0]
    return 100.0 * float(loss.mean()), 100.0 * float(disagreement.mean()), float(1.0 / costs[fe].mean())


def _split_losses(certified, a: dict[str, Any], seed: int, split: float) -> dict[str, float]:
    """Loss (points) at the certified setting on the path rows and on the certifying rows of that split."""
    from dyncompile.passes.early_exit.certify import stratified_split

    loss, _ = _losses(certified, a["oof"], a["teacher"], a["reference"], a["labels"])
    path, cert = stratified_split(len(loss), split, seed, a["labels"])
    return {"path_rows": round(100.0 * float(loss[path].mean()), 2),
            "certifying_rows": round(100.0 * float(loss[cert].mean()), 2),
            "all_rows": round(100.0 * float(loss.mean()), 2)}


def _certify(a: dict[str, Any], budget: float, criterion: str, confidence: float, seed: int, metric: str = "accuracy"):
    """The compile's certificate of the stored arrays for one split seed (no split check), or None where refused.

    ``metric="agreement"`` certifies the disagreement rate with the fp32 original (no labels), as ``--metric agreement``.
    """
    from dyncompile.passes.early_exit.certify import CertificationError, certified_calibration

    labels = a["labels"] if metric == "accuracy" else None
    try:
        certified, _ = certified_calibration(
            a["oof"], a["teacher"], labels, [int(k) for k in a["exits"]], int(a["num_layers"]), budget=budget,
            confidence=confidence, criterion=criterion, reference_probs=a["reference"], seed=seed, split_check=0,
        )
    except CertificationError:
        return None
    return certified


def analyse(a: dict[str, Any], budgets: list[float], seeds: int, criterion: str, confidence: float = 0.9,
            metric: str = "accuracy") -> dict[str, Any]:
    """Certify for every budget and split seed; apply each certified setting to the test rows.

    ``metric="agreement"``: the budgets bound the disagreement with the fp32 original; the test rows then report
    the disagreement too (and the share over budget is the disagreement's).
    """
    from dyncompile.passes.early_exit.certify import DEFAULT_SPLIT

    y, yt = a["labels"], a["test_labels"]
    out: dict[str, Any] = {
        "calibration_rows": int(len(y)), "test_rows": int(len(yt)), "criterion": criterion, "confidence": confidence,
        "exits": [int(k) for k in a["exits"]], "num_layers": int(a["num_layers"]), "split": DEFAULT_SPLIT,
        "model_drop_test": round(100.0 * float((a["test_reference"].argmax(-1) == yt).mean()
                                               - (a["test_teacher"].argmax(-1) == yt).mean()), 2),
        "model_drop_calibration": round(100.0 * float((a["reference"].argmax(-1) == y).mean()
                                                      - (a["teacher"].argmax(-1) == y).mean()), 2),
        "oof_agreement": [round(100.0 * float((a["oof"][e].argmax(-1) == a["teacher"].argmax(-1)).mean()), 2)
                          for e in range(len(a["exits"]))],
        "test_agreement": [round(100.0 * float((a["test_exits"][e].argmax(-1) == a["test_teacher"].argmax(-1)).mean()), 2)
                           for e in range(len(a["exits"]))],
        "budgets": [],
    }
    if metric != "accuracy":
        out["metric"] = metric
    for budget in budgets:
        rows = []
        for seed in range(seeds):
            certified = _certify(a, budget, criterion, confidence, seed, metric)
            if certified is None:
                rows.append({"seed": seed, "certified": False})
                continue
            c = certified.certificate
            drop, disagreement, speedup = _test_outcome(certified, a)
            row = {"seed": seed, "certified": True, "bound": c.bound, "observed": c.observed,
                   "expected_speedup": c.expected_speedup, "test_drop": round(drop, 2), "test_speedup": round(speedup, 3)}
            if metric != "accuracy":
                row["test_disagreement"] = round(disagreement, 2)
            if seed == 0:
                row["losses_at_setting"] = _split_losses(certified, a, seed, c.split)
            rows.append(row)
        ok = [r for r in rows if r["certified"]]
        speed = [r["expected_speedup"] if r["certified"] else 1.0 for r in rows]  # a refused split exits nowhere
        drops = np.array([r["test_drop"] for r in ok]) if ok else np.zeros(0)
        summary = {
            "budget": budget, "seeds": seeds, "certified": len(ok),
            "expected_speedup_mean": round(float(np.mean([r["expected_speedup"] for r in ok])), 3) if ok else None,
            "expected_speedup_range": [min(r["expected_speedup"] for r in ok), max(r["expected_speedup"] for r in ok)] if ok else None,
            "test_speedup_mean": round(float(np.mean([r["test_speedup"] for r in ok])), 3) if ok else None,
            "test_drop_mean": round(float(drops.mean()), 2) if ok else None,
            "test_drop_quartiles": [round(float(q), 2) for q in np.quantile(drops, [0.25, 0.5, 0.75])] if ok else None,
            "test_drop_over_budget": round(float((drops > budget).mean()), 3) if ok else None,
            **({"test_disagreement_mean": round(float(np.mean([r["test_disagreement"] for r in ok])), 2),
                "test_disagreement_over_budget": round(float(np.mean([r["test_disagreement"] > budget for r in ok])), 3),
                "test_drop_max": round(float(drops.max()), 2)} if metric != "accuracy" and ok else {}),
            "seed0": rows[0] if rows else None,
            "seed0_rank": 1 + sum(v > speed[0] for v in speed),  # by expected speedup, refused seeds at 1x
            "rows": rows,
        }
        out["budgets"].append(summary)
    return out


def merged(a: dict[str, Any], budgets: list[float], seeds: int, k: int, criterion: str, confidence: float = 0.9
           ) -> dict[str, Any]:
    """Certificates merged over ``k`` splits (module docstring): per group of ``k`` seeds, the fastest and the median."""
    each = 1.0 - (1.0 - confidence) / k
    out: dict[str, Any] = {"merge": k, "confidence": confidence, "confidence_each": round(each, 6), "criterion": criterion,
                           "calibration_rows": int(len(a["labels"])), "test_rows": int(len(a["test_labels"])),
                           "groups": seeds // k, "budgets": []}
    for budget in budgets:
        per_seed = []
        for seed in range(k * (seeds // k)):
            certified = _certify(a, budget, criterion, each, seed)
            if certified is None:
                per_seed.append((1.0, 0.0))  # refused: the model without exits, no drop from the exits
                continue
            drop, _, _ = _test_outcome(certified, a)
            per_seed.append((float(certified.certificate.expected_speedup), round(drop, 2)))
        groups = [sorted(per_seed[g * k : (g + 1) * k]) for g in range(seeds // k)]  # slowest first
        picks = {}
        for pick, index in (("fastest", -1), ("median", (k - 1) // 2)):
            chosen = [group[index] for group in groups]
            drops = np.array([d for _, d in chosen])
            picks[pick] = {"expected_speedup": [round(v, 3) for v, _ in chosen], "test_drop": drops.tolist(),
                           "test_drop_mean": round(float(drops.mean()), 2),
                           "test_drop_over_budget": round(float((drops > budget).mean()), 3)}
        out["budgets"].append({"budget": budget, **picks})
    return out


def _per_exit_losses(a: dict[str, Any], part: str) -> tuple[np.ndarray, np.ndarray]:
    """``[E+1, N]`` label loss and disagreement of every row stopped at each exit (the last: the model without exits)."""
    from dyncompile.passes.early_exit.certify import exit_losses

    ex, fin, ref, y = ((a["oof"], a["teacher"], a["reference"], a["labels"]) if part == "calibration" else
                       (a["test_exits"], a["test_teacher"], a["test_reference"], a["test_labels"]))
    p = np.concatenate([ex, fin[None]]).astype(np.float64)
    r = ref.argmax(-1)
    return exit_losses(p, r, y), exit_losses(p, r, None)


def _disagreement_split(loss: np.ndarray, dis: np.ndarray) -> dict[str, float]:
    """Disagreement with the fp32 original (%), and among the disagreeing rows the share the original gets right."""
    n = int(dis.sum())
    # on a disagreeing row the original is right exactly where the loss is +1 (the exit's answer is then wrong)
    return {"disagreement": round(100.0 * float(dis.mean()), 2), "disagreeing_rows": n,
            "original_right": round(float((loss[dis > 0] > 0).mean()), 3) if n else None,
            "drop": round(100.0 * float(loss.mean()), 2)}


def _borderline(a: dict[str, Any], ks: tuple[int, ...], permutations: int, seed: int) -> dict[str, Any]:
    """The fp32 original's accuracy on the ``k`` rows of each file it is least sure of, and a permutation test.

    Least sure = smallest top-1 minus top-2 probability of the original (any number of classes). No exit and no
    quantized model is involved: this asks whether the two files' labels treat the original's borderline answers
    alike. Pooled rows are re-split into files of the same sizes ``permutations`` times; p is two-sided, per ``k``.
    """
    ref = np.concatenate([a["reference"], a["test_reference"]]).astype(np.float64)
    labels = np.concatenate([a["labels"], a["test_labels"]])
    nc, n = len(a["labels"]), len(labels)
    top = np.sort(ref, axis=-1)
    order = np.argsort(top[:, -1] - top[:, -2], kind="stable")  # least sure first
    right = (ref.argmax(-1) == labels)[order].astype(np.float64)
    ks = np.asarray([k for k in ks if k <= min(nc, n - nc)])

    def right_counts(is_test: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # [len(ks)] each: test, calibration
        return np.cumsum(right[is_test])[ks - 1], np.cumsum(right[~is_test])[ks - 1]

    observed_test = order >= nc
    t, c = right_counts(observed_test)
    observed = (t - c) / ks  # test minus calibration accuracy on the lowest k rows
    rng = np.random.default_rng([seed, 1])  # its own stream: the report's other draws stay as they were
    hits = np.zeros(len(ks))
    for _ in range(permutations):
        pt, pc = right_counts(rng.permutation(observed_test))
        hits += np.abs((pt - pc) / ks) >= np.abs(observed) - 1e-12
    rows = [{"k": int(k), "calibration": round(float(c[i] / k), 3), "test": round(float(t[i] / k), 3),
             "difference": round(float(observed[i]), 3),
             "p_two_sided": round(float((hits[i] + 1) / (permutations + 1)), 4)} for i, k in enumerate(ks)]
    return {"permutations": permutations, "rows": rows}


def shift(a: dict[str, Any], budgets: list[float], seeds: int, criterion: str, confidence: float = 0.9,
          permutations: int = 20000, bootstraps: int = 2000, seed: int = 0) -> dict[str, Any]:
    """Are the calibration rows and the test rows alike for these exits, or is the test file an unlucky draw?

    1. Per exit, every row stopped there (no threshold, nothing chosen on any rows): the drop against the fp32
       original, the disagreement with it, and among the disagreeing rows the share the original gets right, on the
       calibration rows (out-of-fold heads) and on the test rows (shipped heads), with the difference and its
       standard error.
    2. Permutation tests of exchangeability (calibration and test rows pooled and re-drawn ``permutations`` times,
       two-sided): for the drop averaged over the exits (needs labels) and for the disagreement averaged over the
       exits (label-free).
    3. Per budget, over split seeds ``0..seeds-1``: the share of certified settings whose test drop exceeds the
       budget, with a bootstrap interval over the test rows (all seeds share the one test file, so its noise moves
       them together), and the disagreement split of the certified settings on both parts.
    4. The fp32 original alone on the rows each file's labels decide the cost of flipping: its accuracy on the
       ``k`` rows it is least sure of, per file, with a permutation test (:func:`_borderline`).
    """
    lc, dc = _per_exit_losses(a, "calibration")
    lt, dt = _per_exit_losses(a, "test")
    exits = [int(k) for k in a["exits"]] + [int(a["num_layers"])]
    per_exit = []
    for e, layer in enumerate(exits):
        c, t = _disagreement_split(lc[e], dc[e]), _disagreement_split(lt[e], dt[e])
        se = 100.0 * float(np.sqrt(lt[e].var(ddof=1) / lt.shape[1] + lc[e].var(ddof=1) / lc.shape[1]))
        per_exit.append({"layer": layer, "calibration": c, "test": t, "drop_difference": round(t["drop"] - c["drop"], 2),
                         "drop_difference_se": round(se, 2)})
    rng = np.random.default_rng(seed)
    nc = lc.shape[1]
    pooled = {"drop": np.concatenate([lc, lt], 1), "disagreement": np.concatenate([dc, dt], 1)}
    tests = {}
    for name, x in pooled.items():
        total, n = x.sum(1), x.shape[1]

        def stat(test_idx, x=x, total=total, n=n):  # mean over exits of (test mean - calibration mean), points
            ts = x[:, test_idx].sum(1)
            return 100.0 * float((ts / (n - nc) - (total - ts) / nc).mean())

        observed = stat(np.arange(nc, n))
        hits = sum(abs(stat(rng.permutation(n)[nc:])) >= abs(observed) - 1e-12 for _ in range(permutations))
        tests[name] = {"observed": round(observed, 3), "p_two_sided": round((hits + 1) / (permutations + 1), 4)}
    boot = rng.integers(0, lt.shape[1], (bootstraps, lt.shape[1]))
    per_budget = []
    for budget in budgets:
        test_loss, cal_split, test_split = [], [], []
        for s in range(seeds):
            certified = _certify(a, budget, criterion, confidence, s)
            if certified is None:
                continue
            lt_s, fe_t = _losses(certified, a["test_exits"], a["test_teacher"], a["test_reference"], a["test_labels"])
            lc_s, fe_c = _losses(certified, a["oof"], a["teacher"], a["reference"], a["labels"])
            test_loss.append(lt_s)
            cal_split.append(_disagreement_split(lc_s, dc[fe_c, np.arange(nc)]))
            test_split.append(_disagreement_split(lt_s, dt[fe_t, np.arange(dt.shape[1])]))
        row: dict[str, Any] = {"budget": budget, "seeds": seeds, "certified": len(test_loss)}
        if test_loss:
            tl = np.asarray(test_loss)
            share = (100.0 * tl.mean(1) > budget).mean()
            shares = (100.0 * tl[:, boot].mean(2) > budget).mean(0)  # [bootstraps]
            row.update({
                "test_drop_over_budget": round(float(share), 3),
                "test_drop_over_budget_interval": [round(float(q), 3) for q in np.quantile(shares, [0.05, 0.95])],
                **{f"{part}_{k}": round(float(np.mean([d[k] for d in split if d[k] is not None])), 3)
                   for part, split in (("calibration", cal_split), ("test", test_split))
                   for k in ("disagreement", "original_right", "drop")},
            })
        per_budget.append(row)
    return {"shift": True, "criterion": criterion, "confidence": confidence, "calibration_rows": int(nc),
            "test_rows": int(lt.shape[1]), "permutations": permutations, "bootstraps": bootstraps,
            "per_exit": per_exit, "exchangeability": tests, "budgets": per_budget,
            "borderline": _borderline(a, (50, 100, 200, 400), permutations, seed)}


def markdown_shift(report: dict[str, Any]) -> str:
    t = report["exchangeability"]
    lines = [f"Calibration rows {report['calibration_rows']} (out-of-fold heads), test rows {report['test_rows']} "
             "(shipped heads). Every row stopped at one exit — nothing chosen on any rows:", "",
             "| exit (layer) | disagreement with fp32, calibration / test | original right among the disagreeing rows, "
             "calibration / test | drop, calibration / test (points) | test − calibration (± s.e.) |",
             "|---|---|---|---|---|"]
    for r in report["per_exit"]:
        c, s = r["calibration"], r["test"]
        right = " / ".join("–" if v is None else f"{v:.2f}" for v in (c["original_right"], s["original_right"]))
        lines.append(f"| {r['layer']} | {c['disagreement']:.2f} % / {s['disagreement']:.2f} % | {right} | "
                     f"{c['drop']:+.2f} / {s['drop']:+.2f} | {r['drop_difference']:+.2f} ± {r['drop_difference_se']:.2f} |")
    lines += ["", f"Exchangeability of the two files (pooled rows re-drawn {report['permutations']} times, two-sided), "
              "mean over the exits of test minus calibration: drop "
              f"{t['drop']['observed']:+.2f} points (p = {t['drop']['p_two_sided']:.4f}); disagreement "
              f"{t['disagreement']['observed']:+.2f} points, label-free (p = {t['disagreement']['p_two_sided']:.4f}).", "",
              f"Certified settings over split seeds (criterion {report['criterion']}, confidence "
              f"{report['confidence']:g}); interval: 90 % bootstrap over the test rows ({report['bootstraps']} draws):", "",
              "| budget | seeds certified | share with test drop > budget [interval] | disagreement, calibration / test | "
              "original right among the disagreeing rows, calibration / test | drop, calibration (all rows) / test |",
              "|---|---|---|---|---|---|"]
    for b in report["budgets"]:
        if not b["certified"]:
            lines.append(f"| {b['budget']:g} | 0 / {b['seeds']} | – | – | – | – |")
            continue
        lo, hi = b["test_drop_over_budget_interval"]
        lines.append(f"| {b['budget']:g} | {b['certified']} / {b['seeds']} | {b['test_drop_over_budget']:.2f} "
                     f"[{lo:.2f}, {hi:.2f}] | {b['calibration_disagreement']:.2f} % / {b['test_disagreement']:.2f} % | "
                     f"{b['calibration_original_right']:.2f} / {b['test_original_right']:.2f} | "
                     f"{b['calibration_drop']:+.2f} / {b['test_drop']:+.2f} |")
    if "borderline" in report:
        bl = report["borderline"]
        lines += ["", "The fp32 original alone on the rows it is least sure of in each file (smallest top-1 − top-2 "
                  "probability; no exit, no quantized model): a row flipped there costs a point only where the "
                  f"original was right. Permutation p: files re-drawn {bl['permutations']} times, two-sided.", "",
                  "| rows (least sure first) | original's accuracy, calibration / test | test − calibration | p |",
                  "|---|---|---|---|"]
        lines += [f"| {r['k']} | {r['calibration']:.2f} / {r['test']:.2f} | {r['difference']:+.2f} | "
                  f"{r['p_two_sided']:.4f} |" for r in bl["rows"]]
    return "\n".join(lines) + "\n"


def markdown_merged(report: dict[str, Any]) -> str:
    lines = [f"Certificates merged over {report['merge']} calibration splits ({report['groups']} groups of seeds), each "
             f"split certified at {report['confidence_each']:.4g} so that all {report['merge']} hold together at "
             f"{report['confidence']:g}; criterion {report['criterion']}; {report['calibration_rows']} calibration rows, "
             f"{report['test_rows']} test rows.", "",
             "| budget | shipped | expected speedup per group (layers) | test drop per group | test drop, mean | "
             "share of groups with test drop > budget |", "|---|---|---|---|---|---|"]
    for b in report["budgets"]:
        for pick in ("fastest", "median"):
            r = b[pick]
            lines.append(f"| {b['budget']:g} | {pick} of the group | {', '.join(f'{v:.2f}x' for v in r['expected_speedup'])} | "
                         f"{', '.join(f'{d:+.2f}' for d in r['test_drop'])} | {r['test_drop_mean']:+.2f} | "
                         f"{r['test_drop_over_budget']:.2f} |")
    return "\n".join(lines) + "\n"


def markdown(report: dict[str, Any]) -> str:
    if "merge" in report:
        return markdown_merged(report)
    if report.get("shift"):
        return markdown_shift(report)
    lines = [f"Calibration rows {report['calibration_rows']}, test rows {report['test_rows']}, criterion "
             f"{report['criterion']}, confidence {report['confidence']:g}; heads' agreement with the model, exits "
             f"{', '.join(map(str, report['exits']))}: out-of-fold on the calibration rows "
             f"{' / '.join(f'{v:.1f}' for v in report['oof_agreement'])} %, shipped heads on the test rows "
             f"{' / '.join(f'{v:.1f}' for v in report['test_agreement'])} %. The model without exits: "
             f"{report['model_drop_calibration']:+.2f} points on the calibration rows, {report['model_drop_test']:+.2f} "
             "on the test rows (against the fp32 original).", "",
             "| budget | split seeds certified | expected speedup, mean [min, max] | test layer speedup, mean | "
             "test drop, mean | test drop, quartiles | share of seeds with test drop > budget | seed 0 (the compile's): "
             "bound, expected speedup, test drop | seed 0's rank by expected speedup (refused = 1x) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for b in report["budgets"]:
        s0 = b["seed0"]
        s0txt = (f"{s0['bound']:.2f}, {s0['expected_speedup']:.2f}x, {s0['test_drop']:+.2f}" if s0 and s0["certified"]
                 else "refused")
        if not b["certified"]:
            lines.append(f"| {b['budget']:g} | 0 / {b['seeds']} | – | – | – | – | – | {s0txt} | – |")
            continue
        lo, hi = b["expected_speedup_range"]
        q = b["test_drop_quartiles"]
        lines.append(f"| {b['budget']:g} | {b['certified']} / {b['seeds']} | {b['expected_speedup_mean']:.2f}x "
                     f"[{lo:.2f}, {hi:.2f}] | {b['test_speedup_mean']:.2f}x | {b['test_drop_mean']:+.2f} | "
                     f"{q[0]:+.2f} / {q[1]:+.2f} / {q[2]:+.2f} | {b['test_drop_over_budget']:.2f} | {s0txt} | "
                     f"{b['seed0_rank']} of {b['seeds']} |")
    if report.get("metric") == "agreement":
        lines += ["", "Metric agreement: each budget bounds the disagreement with the fp32 original (points), not the "
                  "accuracy drop; on the test rows:", "",
                  "| budget | disagreement, mean | share of seeds with disagreement > budget | accuracy drop, max |",
                  "|---|---|---|---|"]
        lines += [f"| {b['budget']:g} | {b['test_disagreement_mean']:.2f} | {b['test_disagreement_over_budget']:.2f} | "
                  f"{b['test_drop_max']:+.2f} |" for b in report["budgets"] if b["certified"]]
    seed0 = [(b["budget"], b["seed0"]["losses_at_setting"]) for b in report["budgets"]
             if b["seed0"] and b["seed0"].get("losses_at_setting")]
    if seed0:
        lines += ["", "Seed 0's certified setting, loss (points against the fp32 original) on each part of the rows:", "",
                  "| budget | path rows | certifying rows | all calibration rows | test rows |", "|---|---|---|---|---|"]
        for budget, los in seed0:
            b = next(x for x in report["budgets"] if x["budget"] == budget)
            lines.append(f"| {budget:g} | {los['path_rows']:+.2f} | {los['certifying_rows']:+.2f} | {los['all_rows']:+.2f} | "
                         f"{b['seed0']['test_drop']:+.2f} |")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> Path | None:
    """Expected speedup vs test drop, one point per split seed and budget (seed 0 ringed); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no %s", path.name)
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for b, color in zip(report["budgets"], ["tab:blue", "tab:orange", "tab:green", "tab:red"], strict=False):
        ok = [r for r in b["rows"] if r["certified"]]
        if not ok:
            continue
        ax.scatter([r["expected_speedup"] for r in ok], [r["test_drop"] for r in ok], s=18, color=color,
                   label=f"budget {b['budget']:g} ({len(ok)}/{b['seeds']} seeds certified)")
        ax.axhline(b["budget"], color=color, lw=0.8, ls="--")
        if b["seed0"]["certified"]:
            ax.scatter([b["seed0"]["expected_speedup"]], [b["seed0"]["test_drop"]], s=110, facecolors="none",
                       edgecolors=color, lw=1.5)
    ax.set_xlabel("certified expected speedup (layers), per split seed")
    ax.set_ylabel("drop on the test rows (points)")
    ax.set_title("one point per calibration split; ringed: seed 0, what the compile ships", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path


def render_markdown(report: dict[str, Any]) -> str:
    """The markdown this study writes beside its JSON report, from the JSON alone (``--render JSON``)."""
    return markdown(report)


def main(argv: list[str] | None = None) -> int:
    from dyncompile.tools.bench.common import DATA, machine_info, render_requested, write_report

    rendered = render_requested(argv, render_markdown)
    if rendered is not None:
        return rendered
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", type=Path, help="a plan compiled without early-exit (the model the exits are fitted on)")
    p.add_argument("--heads", choices=["trained", "fitted"], default="trained")
    p.add_argument("--criterion", choices=["learned", "entropy", "maxprob"], default="learned",
                   help="the exit criterion to certify (default learned)")
    p.add_argument("--calib", type=Path, default=DATA / "movie-calib.jsonl")
    p.add_argument("--test", type=Path, default=DATA / "movie-test.jsonl")
    p.add_argument("--train-text", type=Path, help="extra distillation text for trained heads (as --train-text)")
    p.add_argument("--budgets", default="1.0,0.5", help="comma-separated budgets in points (default 1.0,0.5)")
    p.add_argument("--seeds", type=int, default=30, help="split seeds 0..N-1 (default 30)")
    p.add_argument("--name", required=True, help="report stem")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--from-npz", type=Path, metavar="NPZ",
                   help="the per-row arrays a previous run wrote (its NAME.npz): rerun the analysis without a model, "
                        "e.g. with another --criterion")
    p.add_argument("--merge", type=int, metavar="K",
                   help="report certificates merged over K splits instead (module docstring): seeds 0..N-1 in groups of K")
    p.add_argument("--metric", choices=["accuracy", "agreement"], default="accuracy",
                   help="what the budget bounds, as the compile's --metric (default accuracy: the drop against the fp32 "
                        "original; agreement: the disagreement with it, no labels)")
    p.add_argument("--shift", action="store_true",
                   help="report instead whether the calibration and test rows behave alike for these exits "
                        "(per-exit drop and disagreement on both, permutation tests, the test file's own noise)")
    p.add_argument("-q", "--quiet", action="store_true")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if a.quiet else logging.INFO, format="%(message)s")
    try:
        budgets = [float(x) for x in a.budgets.split(",")]
    except ValueError:
        p.error(f"--budgets must be comma-separated numbers of points, got {a.budgets!r}")
    if a.seeds < 1:
        p.error(f"--seeds must be a positive number, got {a.seeds}")
    if a.merge is not None and not 2 <= a.merge <= a.seeds:
        p.error(f"--merge K needs 2 <= K <= --seeds, got {a.merge}")
    if a.merge and a.shift:
        p.error("--merge and --shift are two different reports: give one")
    if a.metric != "accuracy" and (a.merge or a.shift):
        p.error("--metric agreement goes with the plain split report, not --merge or --shift")
    npz = a.out / f"{a.name}.npz"
    if a.from_npz:
        if not a.from_npz.is_file():
            p.error(f"--from-npz: {a.from_npz} does not exist; run once without --from-npz")
        with np.load(a.from_npz, allow_pickle=False) as z:
            missing = [k for k in ARRAYS if k not in z.files]
            if missing:
                p.error(f"--from-npz: {a.from_npz} lacks {', '.join(missing)}; give a NAME.npz this study wrote")
            arrays = {k: z[k] for k in z.files}
        npz = a.from_npz
    else:
        if a.plan is None:
            p.error("--plan is required (unless --from-npz)")
        from dyncompile.errors import DyncompileError

        try:
            arrays = collect(a.plan, a.calib, a.test, a.train_text, a.heads, progress=not a.quiet)
        except DyncompileError as e:
            p.error(str(e))
        a.out.mkdir(parents=True, exist_ok=True)
        tmp = npz.with_suffix(".tmp.npz")
        np.savez_compressed(tmp, **arrays)
        tmp.replace(npz)
    if a.merge:
        report = merged(arrays, budgets, a.seeds, a.merge, a.criterion)
    elif a.shift:
        report = shift(arrays, budgets, a.seeds, a.criterion)
    else:
        report = analyse(arrays, budgets, a.seeds, a.criterion, metric=a.metric)
    report.update({"passes": [str(x) for x in arrays.get("passes", [])], "arrays": npz.name, "heads": a.heads, "data": {"calib": a.calib.name, "test": a.test.name,
                                              "train_text": a.train_text.name if a.train_text else None},
                   "machine": machine_info()})
    report["markdown"] = markdown(report)
    jp, mp = write_report(report, a.out, a.name)
    png = None if a.merge or a.shift else plot(report, a.out / f"{a.name}.png")
    print(report["markdown"])
    print(f"written: {jp} {mp} {npz}" + (f" {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
