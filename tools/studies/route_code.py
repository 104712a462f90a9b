"""Routing on HumanEval from the outcome tables: small model, large model, the doctest cascade, a learned router.

``python -m dyncompile.tools.studies.route_code --small outcomes-S.jsonl --large outcomes-L.jsonl
--cost-model cost.json --out bench-results/route-code`` (seconds, no model run) evaluates, on the problems
present in both tables:

* each model alone: pass@1 (hidden tests) and total cost;
* ``cascade``: the small model, then the ``python-doctest`` check (the prompt's own examples, sandboxed);
  the large model only when the check fails. Prompts without examples: ``escalate`` (default) or ``trust``.
  Cost = small + check + large on the escalated problems; quality = the kept answer's hidden-test pass;
* ``router+cascade`` (learned, prompt features only): a logistic score of "the small model's answer will be
  right" sends low-scoring prompts straight to the large model, the rest through the cascade; its
  threshold is chosen on a calibration half with ``passes.early_exit.certify`` (fixed-sequence testing of
  ``loss = 1[wrong] - 1[large wrong]`` against a pass@1 budget at a confidence level) and evaluated on the
  other half, over many random splits (mean and spread);
* ``random``: each problem to the large model with probability q, q chosen so the expected cost equals the
  cascade's (expected pass@1 in closed form);
* ``oracle``: the small answer when it is right, else the large one, each problem paying only the model it
  uses (a lower bound on cost at the best quality the pair allows).

Costs in three currencies: ``measured`` (the rows' wall ms, taken on a shared machine whose load varied),
``modelled`` (prompt tokens x prefill ms/token + new tokens x decode ms/token of each model, from the
interleaved cost model, plus the measured check time) and the check overhead on its own (sandbox wall ms,
against the small model's per-problem latency). Writes ``route-code.json``, ``route-code.md`` and
``route-code.png`` (the cost-quality plane).

``--live N`` then re-runs N problems end to end with the real plans (small greedy completion, the check,
the large model on failure) and compares completions and outcomes with the tables; it writes
``live-check.json``, which later table-only runs include in the report.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dyncompile.errors import DataError
from dyncompile.io import write_json_atomic
from dyncompile.tools.bench.common import RENDER_HELP, render_requested

logger = logging.getLogger(__name__)

FEATURES = ("log_prompt_tokens", "n_examples", "has_examples", "log_doc_chars", "n_helper_defs", "n_args")


# ------------------------------------------------------------------------------------------- table


def read_table(path: str | Path) -> dict[str, dict[str, Any]]:
    p = Path(path)
    if not p.exists():
        raise DataError(f"outcome table {p} does not exist; make it with python -m dyncompile.tools.studies.humaneval generate")
    rows = {}
    for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            rows[r["task_id"]] = r
        except (ValueError, KeyError):
            raise DataError(f"{p}:{i}: not an outcome row (JSON with task_id)") from None
    return rows


def prompt_features(prompt: str, entry_point: str, prompt_tokens: int, n_examples: int) -> list[float]:
    """Features of the prompt alone (nothing generated): see ``FEATURES``."""
    import ast

    doc_chars = 0
    helpers = 0
    n_args = 0
    try:
        tree = ast.parse(prompt + "    pass\n")
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                if node.name == entry_point:
                    doc_chars = len(ast.get_docstring(node) or "")
                    n_args = len(node.args.args)
                else:
                    helpers += 1
    except SyntaxError:
        doc_chars = len(prompt)
    return [float(np.log(max(prompt_tokens, 1))), float(n_examples), float(n_examples > 0),
            float(np.log1p(doc_chars)), float(helpers), float(n_args)]


class Arrays:
    """Per-problem arrays of the joined tables (problems present in both, in task order)."""

    def __init__(self, small: dict[str, dict], large: dict[str, dict], problems: dict[str, dict] | None,
                 cost_model: dict[str, Any] | None, small_name: str | None = None, large_name: str | None = None):
        ids = sorted(set(small) & set(large), key=lambda t: int(t.split("/")[-1]) if t.split("/")[-1].isdigit() else t)
        if not ids:
            raise DataError("the two outcome tables have no problem in common")
        self.ids = ids
        s = [small[t] for t in ids]
        g = [large[t] for t in ids]
        self.ok_s = np.array([r["hidden"]["passed"] for r in s], bool)
        self.ok_l = np.array([r["hidden"]["passed"] for r in g], bool)
        self.doc_s = np.array([r["doctest"]["passed"] for r in s], bool)
        self.n_ex = np.array([r["doctest"]["n_examples"] for r in s], int)
        self.check_ms = np.array([1e3 * r["doctest"]["seconds"] if r["doctest"]["n_examples"] else 0.0 for r in s])
        # tables generated elsewhere (tools/studies/humaneval_torch.py on the GPU machine) have no CPU wall time: their costs
        # are modelled only
        timed = all("wall_ms" in r for r in s + g)
        self.wall_s = np.array([r["wall_ms"] for r in s], float) if timed else None
        self.wall_l = np.array([r["wall_ms"] for r in g], float) if timed else None
        self.load_s = np.array([r.get("load1", np.nan) for r in s], float)
        self.load_l = np.array([r.get("load1", np.nan) for r in g], float)
        self.mod_s = self.mod_l = None
        if cost_model:
            pm = cost_model["per_model"]
            sn = small_name or s[0]["model"]
            ln = large_name or g[0]["model"]
            if sn not in pm or ln not in pm:
                raise DataError(f"cost model has {sorted(pm)}, not {sn!r} and {ln!r}; pass --small-name/--large-name")

            def modelled(rows, c):
                return np.array([r["prompt_tokens"] * c["prefill_ms_per_token"] + r["new_tokens"] * c["decode_ms_per_token"]
                                 for r in rows])

            self.mod_s, self.mod_l = modelled(s, pm[sn]), modelled(g, pm[ln])
        feats = []
        for r in s:
            p = (problems or {}).get(r["task_id"])
            prompt = p["prompt"] if p else ""
            entry = p["entry_point"] if p else ""
            feats.append(prompt_features(prompt, entry, r["prompt_tokens"], r["doctest"]["n_examples"]))
        self.x = np.array(feats)

    def costs(self, currency: str) -> tuple[np.ndarray, np.ndarray]:
        if currency == "measured":
            return self.wall_s, self.wall_l
        if self.mod_s is None:
            raise DataError("modelled costs need --cost-model")
        return self.mod_s, self.mod_l


# ------------------------------------------------------------------------------------------- policies


def cascade_keep(a: Arrays, no_examples: str) -> np.ndarray:
    """Which problems keep the small model's answer under the doctest cascade."""
    keep = a.doc_s.copy()
    if no_examples == "trust":
        keep |= a.n_ex == 0
    return keep


def evaluate_routes(a: Arrays, rows: np.ndarray, cs: np.ndarray, cl: np.ndarray, *, keep: np.ndarray,
                    direct_large: np.ndarray | None = None) -> dict[str, float]:
    """Quality and cost on ``rows`` of: large directly where ``direct_large``, else small -> check -> (keep or large)."""
    dl = np.zeros(len(a.ids), bool) if direct_large is None else direct_large
    ran_small = ~dl
    kept = ran_small & keep
    ok = np.where(kept, a.ok_s, a.ok_l)
    cost = np.where(ran_small, cs + a.check_ms, 0.0) + np.where(kept, 0.0, cl)
    r = rows
    return {
        "pass_at_1": float(ok[r].mean()),
        "cost_ms": float(cost[r].sum()),
        "escalated": float((ran_small & ~keep)[r].mean()),
        "direct_large": float(dl[r].mean()),
        "kept_small": float(kept[r].mean()),
    }


def fit_logistic(x: np.ndarray, t: np.ndarray, ridge: float = 1.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Standardised features + intercept, ridge logistic regression (Newton): ``(w, mean, std)``."""
    from dyncompile.passes.early_exit.certify import fit_logistic

    mu, sd = x.mean(0), x.std(0) + 1e-9
    z = np.c_[(x - mu) / sd, np.ones(len(x))]
    return fit_logistic(z, t.astype(float), ridge), mu, sd


def logistic_score(x: np.ndarray, w: np.ndarray, mu: np.ndarray, sd: np.ndarray) -> np.ndarray:
    z = np.c_[(x - mu) / sd, np.ones(len(x))]
    return 1.0 / (1.0 + np.exp(-np.clip(z @ w, -50, 50)))


def certified_router(a: Arrays, calib: np.ndarray, cs: np.ndarray, cl: np.ndarray, keep: np.ndarray, *,
                     budget: float, confidence: float | None) -> dict[str, Any]:
    """Fit the prompt-feature score on ``calib`` (half path / half test), then certify the pre-routing threshold.

    Path: thresholds on the score from "everything straight to the large model" (loss 0 by definition,
    cost = large alone) down to "everything through the cascade", ordered safe to fast. Loss of a problem:
    ``1[routed answer wrong] - 1[large alone wrong]`` in ``{-1, 0, 1}``; fixed-sequence test of
    ``E[loss] <= budget`` with the betting bound (``certify.fixed_sequence_test``), or with
    ``confidence=None`` the cheapest threshold whose observed loss on the test part is within budget.
    """
    from dyncompile.passes.early_exit.certify import fixed_sequence_test

    rng = np.random.default_rng(int(calib.sum()) + len(calib))
    perm = rng.permutation(calib)
    path_rows, test_rows = perm[: len(perm) // 2], perm[len(perm) // 2:]
    t = np.where(keep, a.ok_s, a.ok_l)  # what the cascade would answer correctly
    w, mu, sd = fit_logistic(a.x[path_rows], t[path_rows])
    score = logistic_score(a.x, w, mu, sd)
    # thresholds: direct_large = score < thr; thr = +inf (all large) first, then descending scores, then -inf
    cand = np.r_[np.inf, np.sort(np.unique(score[path_rows]))[::-1], -np.inf]
    ok_route = {}
    losses, costs = [], []
    for thr in cand:
        dl = score < thr
        kept = ~dl & keep
        ok = np.where(kept, a.ok_s, a.ok_l)
        loss = ok_route[thr] = (~ok).astype(float) - (~a.ok_l).astype(float)
        losses.append(loss[test_rows])
        costs.append(float((np.where(~dl, cs + a.check_ms, 0.0) + np.where(kept, 0.0, cl))[path_rows].mean()))
    # keep the path monotone in the path part's cost (safe = expensive first)
    order = np.argsort(-np.asarray(costs), kind="stable")
    losses_arr = np.stack([losses[i] for i in order])
    b = budget / 100.0
    if confidence is None:
        good = [j for j in range(len(order)) if losses_arr[j].mean() <= b + 1e-12]
        chosen = max(good) if good else -1
    else:
        chosen, _ = fixed_sequence_test(losses_arr, b, 1.0 - confidence, -1.0, 1.0, "betting")
    thr = cand[order[chosen]] if chosen >= 0 else np.inf
    return {"threshold": float(thr), "direct_large": score < thr, "weights": w.tolist(), "certified": chosen >= 0}


# ------------------------------------------------------------------------------------------- the bench


def summarise(vals: list[float]) -> dict[str, float]:
    v = np.asarray(vals, float)
    return {"mean": round(float(v.mean()), 4), "std": round(float(v.std()), 4),
            "p05": round(float(np.percentile(v, 5)), 4), "p95": round(float(np.percentile(v, 95)), 4)}


def run_bench(a: Arrays, *, splits: int, seed: int, budget: float, confidence: float | None) -> dict[str, Any]:
    n = len(a.ids)
    all_rows = np.arange(n)
    currencies = (["measured"] if a.wall_s is not None else []) + (["modelled"] if a.mod_s is not None else [])
    if not currencies:
        raise DataError("the outcome tables have no 'wall_ms': pass --cost-model to state costs as modelled CPU time")
    report: dict[str, Any] = {"problems": n, "currencies": {}}
    for cur in currencies:
        cs, cl = a.costs(cur)
        large_cost = float(cl.sum())
        res: dict[str, Any] = {}

        def add(name, r, res=res, large_cost=large_cost):
            r = dict(r)
            r["cost_vs_large"] = round(r["cost_ms"] / large_cost, 4)
            res[name] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}

        add("small alone", {"pass_at_1": float(a.ok_s.mean()), "cost_ms": float(cs.sum())})
        add("large alone", {"pass_at_1": float(a.ok_l.mean()), "cost_ms": large_cost})
        for pol in ("escalate", "trust"):
            keep = cascade_keep(a, pol)
            cas = evaluate_routes(a, all_rows, cs, cl, keep=keep)
            add(f"cascade (no examples: {pol})", cas)
            # random routing at the cascade's cost: large with probability q
            q = float(np.clip((cas["cost_ms"] - cs.sum()) / max(large_cost - cs.sum(), 1e-9), 0.0, 1.0))
            add(f"random at cascade cost ({pol})", {"pass_at_1": float((1 - q) * a.ok_s.mean() + q * a.ok_l.mean()),
                                                     "cost_ms": float((1 - q) * cs.sum() + q * large_cost), "q_large": q})
        oracle_ok = a.ok_s | a.ok_l
        add("oracle", {"pass_at_1": float(oracle_ok.mean()), "cost_ms": float(np.where(a.ok_s, cs, cl).sum())})
        # re-splits: the cascade (no fitted parameter) and the certified learned router, on eval halves
        rng = np.random.default_rng(seed)
        keep = cascade_keep(a, "escalate")
        split_rows: dict[str, dict[str, list[float]]] = {}
        for _ in range(splits):
            perm = rng.permutation(n)
            calib, ev = perm[: n // 2], perm[n // 2:]
            ev_large = cl[ev].sum()
            entries = {
                "large alone": {"pass_at_1": float(a.ok_l[ev].mean()), "cost_ms": float(ev_large)},
                "cascade (no examples: escalate)": evaluate_routes(a, ev, cs, cl, keep=keep),
            }
            for conf in ([confidence] if confidence is not None else []) + [None]:
                rt = certified_router(a, calib, cs, cl, keep, budget=budget, confidence=conf)
                key = f"router+cascade (certified {100 * conf:g} %)" if conf is not None else "router+cascade (uncertified)"
                e = evaluate_routes(a, ev, cs, cl, keep=keep, direct_large=rt["direct_large"])
                e["certified"] = float(rt["certified"])
                entries[key] = e
            for k, e in entries.items():
                d = split_rows.setdefault(k, {})
                d.setdefault("pass_at_1", []).append(e["pass_at_1"])
                d.setdefault("cost_vs_large", []).append(e["cost_ms"] / ev_large)
                d.setdefault("delta_pass_at_1_vs_large", []).append(e["pass_at_1"] - float(a.ok_l[ev].mean()))
                if "escalated" in e:
                    d.setdefault("direct_large", []).append(e["direct_large"])
                if "certified" in e:
                    d.setdefault("certified", []).append(e["certified"])
        res["resplits"] = {k: {m: summarise(v) for m, v in d.items()} for k, d in split_rows.items()}
        report["currencies"][cur] = res
    # check overhead vs the cheapest candidate's latency (per problem with examples)
    has = a.n_ex > 0
    report["check_overhead"] = {
        "problems_with_examples": int(has.sum()),
        "problems_without_examples": int((~has).sum()),
        "check_ms_median": round(float(np.median(a.check_ms[has])), 2),
        "check_ms_mean": round(float(a.check_ms[has].mean()), 2),
    }
    if a.wall_s is not None:
        report["check_overhead"]["small_latency_ms_median_measured"] = round(float(np.median(a.wall_s)), 2)
        report["check_overhead"]["check_vs_small_latency_measured"] = round(float(a.check_ms.sum() / a.wall_s.sum()), 4)
    if a.mod_s is not None:
        report["check_overhead"]["check_vs_small_latency_modelled"] = round(float(a.check_ms.sum() / a.mod_s.sum()), 4)
    report["agreement"] = {
        "small_pass": int(a.ok_s.sum()), "large_pass": int(a.ok_l.sum()),
        "both": int((a.ok_s & a.ok_l).sum()), "small_only": int((a.ok_s & ~a.ok_l).sum()),
        "large_only": int((~a.ok_s & a.ok_l).sum()),
        "doctest_pass_small": int(a.doc_s.sum()),
        "doctest_pass_and_hidden_fail_small": int((a.doc_s & ~a.ok_s).sum()),
        "doctest_fail_and_hidden_pass_small": int((~a.doc_s & a.ok_s & (a.n_ex > 0)).sum()),
    }
    report["load1"] = {"small": summarise(a.load_s[np.isfinite(a.load_s)].tolist() or [np.nan]),
                       "large": summarise(a.load_l[np.isfinite(a.load_l)].tolist() or [np.nan])}
    return report


def markdown(report: dict[str, Any]) -> str:
    out = [f"# Routing on HumanEval: {report['small']} -> {report['large']}", "",
           f"{report['problems']} problems (in both tables). {report['how']}", ""]
    for cur, res in report["currencies"].items():
        out += [f"## Cost: {cur}", "", "| route | pass@1 (%) | cost vs large alone | escalated | direct to large |",
                "|---|---|---|---|---|"]
        for k, r in res.items():
            if k == "resplits":
                continue
            esc = f"{100 * r['escalated']:.1f} %" if "escalated" in r else "–"
            dl = f"{100 * r['direct_large']:.1f} %" if "direct_large" in r else "–"
            out.append(f"| {k} | {100 * r['pass_at_1']:.1f} | {r['cost_vs_large']:.3f}x | {esc} | {dl} |")
        out += ["", f"Re-splits ({report['splits']} random halves; evaluated on the eval half; mean ± std [p05, p95]):", "",
                "| route | pass@1 (%) | Δ pass@1 vs large (points) | cost vs large | certified |", "|---|---|---|---|---|"]
        for k, d in res["resplits"].items():
            p, dp, c = d["pass_at_1"], d["delta_pass_at_1_vs_large"], d["cost_vs_large"]
            cert = f"{100 * d['certified']['mean']:.0f} % of splits" if "certified" in d else "–"
            out.append(f"| {k} | {100 * p['mean']:.1f} ± {100 * p['std']:.1f} | {100 * dp['mean']:+.1f} ± {100 * dp['std']:.1f} "
                       f"[{100 * dp['p05']:+.1f}, {100 * dp['p95']:+.1f}] | {c['mean']:.3f} ± {c['std']:.3f} "
                       f"[{c['p05']:.3f}, {c['p95']:.3f}] | {cert} |")
        out.append("")
    co = report["check_overhead"]
    out += ["## The check", "",
            f"python-doctest on {co['problems_with_examples']} prompts with examples ({co['problems_without_examples']} have none): "
            f"median {co['check_ms_median']} ms per sandboxed run; all checks together = "
            + (f"{100 * co['check_vs_small_latency_measured']:.2f} % of the small model's measured time "
               if "check_vs_small_latency_measured" in co else "")
            + (f"({100 * co['check_vs_small_latency_modelled']:.2f} % of its modelled time)" if "check_vs_small_latency_modelled" in co else "")
            + ".", "", "Agreement: " + ", ".join(f"{k} {v}" for k, v in report["agreement"].items()), ""]
    if "live" in report:
        lv = report["live"]
        out += ["## Live re-check", "", f"{lv['n']} problems ({', '.join(r['task_id'] for r in lv['rows'])}) re-run end to end "
                f"({lv['time_utc']}, load {lv['load_avg']}): "
                f"completions identical to the table {lv['completions_identical']}/{lv['n_runs']} generations, check outcomes "
                f"identical {lv['doctest_outcomes_identical']}/{lv['n']}, routing decisions identical "
                f"{lv['decisions_identical']}/{lv['n']}, final hidden-test outcomes identical {lv['hidden_outcomes_identical']}/{lv['n']}.", ""]
    return "\n".join(out)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curs = list(report["currencies"])
    fig, axes = plt.subplots(1, len(curs), figsize=(6 * len(curs), 4.5), squeeze=False)
    for ax, cur in zip(axes[0], curs):
        res = report["currencies"][cur]
        for k, r in res.items():
            if k == "resplits":
                continue
            ax.scatter(r["cost_vs_large"], 100 * r["pass_at_1"], s=40)
            ax.annotate(k, (r["cost_vs_large"], 100 * r["pass_at_1"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        s, lg = res["small alone"], res["large alone"]
        ax.plot([s["cost_vs_large"], 1.0], [100 * s["pass_at_1"], 100 * lg["pass_at_1"]], "k:", lw=1, label="random mix")
        ax.axvline(0.7, color="r", lw=0.8, ls="--", label="target 0.7x")
        ax.set_xlabel(f"cost vs large alone ({cur})")
        ax.set_ylabel("pass@1 (%)")
        ax.set_title(f"HumanEval, {report['problems']} problems")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------------- live


def live_check(small_rows, large_rows, problems, args) -> dict[str, Any]:
    """Re-run ``args.live`` problems end to end with the real plans; compare with the tables."""
    from dyncompile.runtime.routing.code_check import check_examples
    from dyncompile.tools.bench.common import load_avg
    from dyncompile.tools.studies.humaneval import GreedyCompleter, hidden_test, load_cpu_plan

    ids = sorted(set(small_rows) & set(large_rows))
    rng = np.random.default_rng(args.seed + 1)
    picks = [ids[i] for i in sorted(rng.choice(len(ids), size=min(args.live, len(ids)), replace=False))]
    small = GreedyCompleter(load_cpu_plan(args.small_plan, None), "small")
    large = None
    rows = []
    for t in picks:
        p = problems[t]
        g = small.complete(p["prompt"], args.max_new_tokens)
        doc = check_examples(p["prompt"], p["entry_point"], g["completion"])
        escalate = not doc.passed
        rec = {"task_id": t, "small_completion_identical": g["completion"] == small_rows[t]["completion"],
               "small_doctest": doc.passed, "table_small_doctest": small_rows[t]["doctest"]["passed"],
               "escalated": escalate, "table_escalated": not small_rows[t]["doctest"]["passed"],
               "small_wall_ms": g["wall_ms"], "check_ms": round(1e3 * doc.seconds, 2)}
        final = g["completion"]
        if escalate:
            if large is None:
                large = GreedyCompleter(load_cpu_plan(args.large_plan, None), "large")
            gl = large.complete(p["prompt"], args.max_new_tokens)
            rec["large_completion_identical"] = gl["completion"] == large_rows[t]["completion"]
            rec["large_wall_ms"] = gl["wall_ms"]
            final = gl["completion"]
            table_ok = large_rows[t]["hidden"]["passed"]
        else:
            table_ok = small_rows[t]["hidden"]["passed"]
        rec["hidden_passed"] = hidden_test(p, final)["passed"]
        rec["table_hidden_passed"] = table_ok
        rows.append(rec)
        logger.info("live %s: %s", t, rec)
    n_runs = sum(1 + ("large_completion_identical" in r) for r in rows)
    comp = sum(r["small_completion_identical"] + r.get("large_completion_identical", 0) for r in rows)
    return {"n": len(rows), "n_runs": n_runs, "completions_identical": int(comp),
            "doctest_outcomes_identical": int(sum(r["small_doctest"] == r["table_small_doctest"] for r in rows)),
            "hidden_outcomes_identical": int(sum(r["hidden_passed"] == r["table_hidden_passed"] for r in rows)),
            "decisions_identical": int(sum(r["escalated"] == r["table_escalated"] for r in rows)),
            "rows": rows, "load_avg": load_avg(), "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def render_markdown(report: dict) -> str:
    """The markdown this harness writes beside its JSON report, from the JSON alone (``--render JSON``)."""
    return markdown(report)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dyncompile.tools.studies.route_code",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", required=True, help="outcome table of the small model (JSONL)")
    ap.add_argument("--large", required=True, help="outcome table of the large model (JSONL)")
    ap.add_argument("--cost-model", help="costmodel JSON (python -m dyncompile.tools.studies.humaneval costmodel)")
    ap.add_argument("--small-name")
    ap.add_argument("--large-name")
    ap.add_argument("--out", required=True, help="output folder (route-code.json/.md/.png)")
    ap.add_argument("--splits", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget", type=float, default=2.0, help="pass@1 points the learned router may lose vs the large model")
    ap.add_argument("--confidence", type=float, default=0.9)
    ap.add_argument("--live", type=int, default=0, help="re-run N problems end to end with the plans")
    ap.add_argument("--small-plan")
    ap.add_argument("--large-plan")
    ap.add_argument("--max-new-tokens", type=int, default=384)
    ap.add_argument("--render", metavar="JSON", help=RENDER_HELP)
    rendered = render_requested(argv, render_markdown)
    if rendered is not None:
        return rendered
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from dyncompile.errors import DyncompileError
    from dyncompile.tools.studies.humaneval import load_problems

    try:
        small, large = read_table(args.small), read_table(args.large)
        problems = {p["task_id"]: p for p in load_problems()}
        cm = json.loads(Path(args.cost_model).read_text()) if args.cost_model else None
        a = Arrays(small, large, problems, cm, args.small_name, args.large_name)
        report = run_bench(a, splits=args.splits, seed=args.seed, budget=args.budget, confidence=args.confidence)
        report.update({
            "small": args.small_name or next(iter(small.values()))["model"],
            "large": args.large_name or next(iter(large.values()))["model"],
            "tables": {"small": str(args.small), "large": str(args.large)},
            "splits": args.splits, "budget_points": args.budget, "confidence": args.confidence,
            "how": ("pass@1 = greedy completion passes HumanEval's hidden tests (sandboxed); costs summed over the "
                    "problems; the cascade's cost includes the small model, the check and the large model on escalation."),
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        })
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        if args.live:
            if not (args.small_plan and args.large_plan):
                raise DataError("--live needs --small-plan and --large-plan")
            write_json_atomic(out / "live-check.json", live_check(small, large, problems, args))
        if (out / "live-check.json").exists():  # the latest live re-check (kept across table-only reruns)
            report["live"] = json.loads((out / "live-check.json").read_text())
    except DyncompileError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    write_json_atomic(out / "route-code.json", report)
    (out / "route-code.md").write_text(markdown(report))
    try:
        plot(report, out / "route-code.png")
    except ImportError:
        logger.warning("matplotlib not installed: no PNG")
    sys.stdout.write(markdown(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
