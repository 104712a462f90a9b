"""Routing / cascade bench: the routed plans against each candidate alone, random routing at the same cost and
the oracle, accuracy next to measured batch-1 wall-clock (one interleaved run, medians), and the rule's
cost–quality curve (PNG).

Two forms:

* ``dyncompile bench route ROUTED/ --data movie-test.jsonl`` (or ``dyncompile bench ROUTED/ ...``): one routed plan, its candidates alone (the sub-plans
  inside it), random routing between its cheapest and last candidate at the routed plan's measured cost,
  the oracle (the cheapest candidate that is right; its wall-clock from the same run's per-row latencies),
  and the router overhead (learned rule) on its own.
* ``python -m dyncompile.tools.bench.routed --sentiment --plans DIR`` (DIR holds ``minilm``, ``minilm-ee``,
  ``mpnet``, ``mpnet-ee`` plans): compiles the cascades MiniLM→MPNet and MiniLM→MPNet-EE (reference MPNet
  plain) and the learned router MiniLM→MPNet on movie-calib with ``dyncompile.route``, then measures all of
  them with MiniLM, MiniLM-EE, MPNet, MPNet-EE (MPNet's own early exit at the same budget) on movie-test,
  and the re-split check: calib + test pooled, halves re-drawn ``--resplits`` times, the cascade certified
  on one half and measured on the other; reported: how often the held-out drop exceeds the budget.

Costs on the curve are the candidates' measured batch-1 medians from the same run (a configuration's cost
is the mean over rows of the candidates it ran); the marked points are measured end to end.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np

from dyncompile.tools.bench.common import (
    DATA,
    RENDER_HELP,
    Runner,
    interleaved_batch1,
    load_avg,
    machine_info,
    plan_runner,
    render_requested,
)

logger = logging.getLogger(__name__)

__all__ = ["main"]


def _texts_labels(path: Path, labels: list[str]) -> tuple[list[str], np.ndarray]:
    from dyncompile.io import read_jsonl, texts_and_labels

    t, y = texts_and_labels(read_jsonl(path), labels)
    if y is None:
        from dyncompile.errors import DataError

        raise DataError(f"{path}: the bench reports accuracy and needs a 'label' on every row")
    return t, np.asarray(y, np.int64)


def _random_runner(name: str, cheap, big, p_cheap: float, seed: int = 0) -> Runner:
    rng = np.random.default_rng(seed)

    def fn(texts):
        m = cheap if rng.random() < p_cheap else big
        return m.predict_proba(texts, batch_size=len(texts)), None

    return Runner(name, fn, {"p_cheap": round(p_cheap, 4)})


def _router_runner(routed) -> Runner:
    h = routed.task_api.text_step

    def fn(texts):
        h.scores(list(texts))
        return np.zeros((len(texts), 2)), None

    return Runner("router-only", fn, {})


def _candidate_runner(name: str, model) -> Runner:
    def fn(texts):
        p = model.predict_proba(texts, batch_size=len(texts))
        c = model.last_info.get("candidate")
        return p, c

    return Runner(name, fn, {})


def measure(runners: list[Runner], texts, y, rows: int) -> dict[str, Any]:
    lat, probs, extra = interleaved_batch1(runners, texts, rows)
    out = {}
    for r in runners:
        p = np.stack(probs[r.name])
        out[r.name] = {
            "lat_ms": lat[r.name] * 1e3,
            "pred": p.argmax(-1),
            "probs": p,
            "extra": extra[r.name],
        }
    return out


def _row(name, m, y, base_ms, info=None) -> dict[str, Any]:
    acc = float((m["pred"] == y).mean() * 100)
    med = float(np.median(m["lat_ms"]))
    return {"name": name, "accuracy": round(acc, 2), "latency_ms_median": round(med, 3),
            "latency_ms_mean": round(float(np.mean(m["lat_ms"])), 3), "speedup_vs_reference": round(base_ms / med, 3),
            **(info or {})}


def _table(rows: list[dict], ref: str) -> str:
    lines = [f"| configuration | accuracy b1 (%) | drop vs {ref} (pts) | p50 ms b1 | mean ms b1 | speedup vs {ref} (median) | note |",
             "|---|---|---|---|---|---|---|"]
    ref_acc = next(r["accuracy"] for r in rows if r["name"] == ref)
    for r in rows:
        lines.append(f"| {r['name']} | {r['accuracy']} | {round(ref_acc - r['accuracy'], 2)} | {r['latency_ms_median']} | "
                     f"{r['latency_ms_mean']} | {r['speedup_vs_reference']}x | {r.get('note', '')} |")
    return "\n".join(lines)


def _sweep(stage_probs: list[np.ndarray], y, stage_ms: list[float], criterion: str = "entropy") -> list[tuple[float, float]]:
    """Cascade threshold sweep on per-row outputs: (mean ms, accuracy %) per threshold."""
    from dyncompile.runtime.rules.exit_rule import confidence

    p0 = stage_probs[0]
    conf = confidence(p0, criterion)
    pts = []
    for t in np.quantile(conf, np.linspace(0, 1, 41)):
        stop = conf >= t
        pred = np.where(stop, p0.argmax(-1), stage_probs[-1].argmax(-1))
        ms = stage_ms[0] + (~stop).mean() * sum(stage_ms[1:])
        pts.append((float(ms), float((pred == y).mean() * 100)))
    return pts


def _plot(path: Path, points: dict[str, tuple[float, float]], curves: dict[str, list[tuple[float, float]]],
          random_line: tuple[tuple[float, float], tuple[float, float]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    for name, pts in curves.items():
        xs, ys = zip(*sorted(pts))
        ax.plot(xs, ys, "-", lw=1, alpha=0.7, label=f"{name} (threshold sweep)")
    (x0, y0), (x1, y1) = random_line
    ax.plot([x0, x1], [y0, y1], "k--", lw=1, label="random routing")
    for name, (x, yv) in points.items():
        marker = "*" if ("cascade" in name or "route" in name) else "o"
        ax.plot([x], [yv], marker, ms=11 if marker == "*" else 7)
        ax.annotate(name, (x, yv), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.set_xlabel("batch-1 wall-clock per row, ms (median, this CPU)")
    ax.set_ylabel("accuracy on movie-test (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _oracle(preds: list[np.ndarray], lat: list[np.ndarray], y) -> tuple[float, float]:
    """Cheapest candidate that is right (else the cheapest): accuracy and mean ms from per-row latencies."""
    right = np.stack([p == y for p in preds])
    pick = np.where(right.any(0), right.argmax(0), 0)
    acc = float(right.any(0).mean() * 100)
    ms = float(np.stack(lat)[pick, np.arange(len(y))].mean())
    return acc, ms


def bench_plan(plan_dir: Path, data: Path, out: Path, rows: int) -> dict[str, Any]:
    """``dyncompile bench route ROUTED/``: the generic form (module docstring)."""
    import dyncompile

    kw = dict(provider="cpu")
    routed = dyncompile.load(plan_dir, **kw)
    h = routed.task_api.text_step
    texts, y = _texts_labels(data, routed.plan.labels)
    rows = min(rows, len(texts))
    names = h.names
    runners = [plan_runner(n, m) for n, m in zip(names, h.models)]
    runners.append(_candidate_runner("routed", routed))
    cal = routed.plan.policy["routing"]["calibration"]
    ms = [c.cost.ms for c in h.params.candidates]
    exp = float(cal["expected_speedup"])
    ref_ms = routed.plan.policy["routing"].get("reference_ms", ms[-1])
    target = ref_ms / exp
    p_cheap = float(np.clip((ms[-1] - target) / max(ms[-1] - ms[0], 1e-9), 0, 1))
    runners.append(_random_runner("random-same-cost", h.models[0], h.models[-1], p_cheap))
    if h.kind == "route":
        runners.append(_router_runner(routed))
    res = measure(runners, texts, y, rows)
    yy = y[:rows]
    last = names[-1]
    base = float(np.median(res[last]["lat_ms"]))
    table = [_row(n, res[n], yy, base) for n in names]
    table.append(_row("routed", res["routed"], yy, base, {"note": f"answers per candidate {np.bincount(np.array(res['routed']['extra']), minlength=len(names)).tolist()}"}))
    table.append(_row("random-same-cost", res["random-same-cost"], yy, base, {"note": f"p(cheapest) = {p_cheap:.3f}"}))
    acc, oms = _oracle([res[n]["pred"] for n in names], [res[n]["lat_ms"] for n in names], yy)
    table.append({"name": "oracle", "accuracy": round(acc, 2), "latency_ms_median": None, "latency_ms_mean": round(oms, 3),
                  "speedup_vs_reference": round(base / oms, 3), "note": "cheapest right candidate; mean of this run's per-row latencies"})
    overhead = None
    if "router-only" in res:
        r_ms = float(np.median(res["router-only"]["lat_ms"])) if "router-only" in res else float("nan")
        overhead = {"router_ms_median": round(r_ms, 4), "cheapest_ms_median": round(float(np.median(res[names[0]]["lat_ms"])), 3),
                    "percent_of_cheapest": round(100 * r_ms / float(np.median(res[names[0]]["lat_ms"])), 2)}
    report = {"plan": str(plan_dir), "data": str(data), "rows": rows, "machine": machine_info(), "results": table,
              "router_overhead": overhead, "certificate": routed.plan.policy["routing"].get("certificate")}
    out.mkdir(parents=True, exist_ok=True)
    pts = {r["name"]: (r["latency_ms_median"] or r["latency_ms_mean"], r["accuracy"]) for r in table if r["name"] != "random-same-cost"}
    _plot(out / "route.png", pts, {}, ((pts[names[0]][0], pts[names[0]][1]), (pts[last][0], pts[last][1])),
          f"{plan_dir.name}: routed vs candidates (batch 1, load {load_avg()})")
    report["markdown"] = render_markdown(report).removesuffix("\n")
    from dyncompile.io import write_json_atomic

    write_json_atomic(out / "route.json", report)
    (out / "route.md").write_text(report["markdown"] + "\n")
    return report


def _plan_markdown(report: dict[str, Any]) -> str:
    """The markdown of a routed plan's report (``route.json``): the candidates come first in its table, then
    ``routed``; the last candidate is the reference."""
    table = report["results"]
    names = [r["name"] for r in table[: next(i for i, r in enumerate(table) if r["name"] == "routed")]]
    oracle = next(r for r in table if r["name"] == "oracle")
    md = _table([r for r in table if r["latency_ms_median"] is not None], names[-1])
    md += f"\n\noracle: {oracle['accuracy']:.2f} % at {oracle['latency_ms_mean']:.2f} ms mean per row"
    if report.get("router_overhead"):
        md += f"\n\nrouter overhead: {report['router_overhead']}"
    return md + "\n"


def _sentiment_markdown(report: dict[str, Any]) -> str:
    """The markdown of the sentiment subject's report (``route-sentiment.json``)."""
    table, overhead, m = report["results"], report["router_overhead"], report["machine"]
    oracle = next(r for r in table if r["name"].startswith("oracle"))
    md = ["# Routing and cascades — sentiment (MiniLM-L6 → MPNet-base), movie-test, batch 1", "",
          f"{report['rows_batch1']} test rows, every configuration interleaved per row in one process; load "
          f"{report['load_before']} → {report['load_after']}; {m['cpu']}; {m['date']}", "",
          _table([r for r in table if r["latency_ms_median"] is not None], "mpnet"), "",
          f"oracle (cheapest right model): {oracle['accuracy']:.2f} % at {oracle['latency_ms_mean']:.2f} ms mean per row", "",
          f"router overhead (learned rule): {overhead['learned_router_ms_median']:.3f} ms median = "
          f"{overhead['percent_of_cheapest']} % of MiniLM's {overhead['minilm_ms_median']:.2f} ms; the confidence rule "
          "adds none (it reads MiniLM's own output)"]
    if report.get("resplit"):
        md += ["", "## Re-split check (calib + test pooled, halves re-drawn)", "", "```",
               json.dumps(report["resplit"], indent=1), "```"]
    return "\n".join(md) + "\n"


def render_markdown(report: dict[str, Any]) -> str:
    """The markdown this harness writes beside its JSON report (either form), from the JSON alone."""
    return _sentiment_markdown(report) if "subject" in report else _plan_markdown(report)


# ------------------------------------------------------------------------------------- the sentiment subject


def _cached_probs(model, texts, path: Path, desc: str) -> np.ndarray:
    from dyncompile.passes.routing.driver import candidate_probs

    if path.is_file():
        return np.load(path, allow_pickle=False)
    p = candidate_probs(model, texts, desc=desc)
    np.save(path, p)
    return p


def sentiment(plans: Path, work: Path, out: Path, budget: float, rows: int, resplits: int,
              reuse: bool = False) -> dict[str, Any]:
    import time

    import dyncompile
    from dyncompile.io import write_json_atomic
    from dyncompile.passes.routing import calibrate_cascade

    work.mkdir(parents=True, exist_ok=True)
    kw = dict(provider="cpu")
    import gc

    dirs = {n: plans / n for n in ("minilm", "minilm-ee", "mpnet", "mpnet-ee")}
    labels = dyncompile.load(dirs["minilm"], **kw).plan.labels
    calib = DATA / "movie-calib.jsonl"
    ct, cy = _texts_labels(calib, labels)
    tt, ty = _texts_labels(DATA / "movie-test.jsonl", labels)
    t0 = time.time()
    # per-row outputs as the routed plans run them (If-lowered early exits at batch 1: passes.routing.driver.candidate_probs)
    # (one model in memory at a time: ORT keeps each session's peak batch-32 arena)
    cal = {}
    for n in ("minilm", "mpnet", "mpnet-ee"):
        path = work / f"calib-{n}-v2.npy"
        cal[n] = np.load(path, allow_pickle=False) if path.is_file() else _cached_probs(dyncompile.load(dirs[n], **kw), ct, path, f"calib {n}")
        gc.collect()
    logger.info("calibration outputs in %.0f s", time.time() - t0)
    outputs = {str(dirs[n]): p for n, p in cal.items()}
    for n in ("minilm", "mpnet"):  # plain plans: batch 32 and batch 1 agree (checked below, reported)
        old = work / f"calib-{n}.npy"
        if old.is_file() and not (work / f"calib-{n}-v2.npy").is_file():
            pass
    routed_dirs = {
        "cascade-minilm-mpnet": dict(candidates=[dirs["minilm"], dirs["mpnet"]]),
        "cascade-minilm-mpnet-ee": dict(candidates=[dirs["minilm"], dirs["mpnet-ee"]], reference=dirs["mpnet"]),
        "route-learned-minilm-mpnet": dict(candidates=[dirs["minilm"], dirs["mpnet"]], rule="learned"),
    }
    compiled, refused = {}, {}
    from dyncompile.passes.early_exit.certify import CertificationError

    for name, spec in routed_dirs.items():
        t1 = time.time()
        if reuse and (work / name / "plan.json").is_file():  # compiled by an earlier run of this bench: reuse it
            pl = dyncompile.load(work / name, **kw).plan
            st, pol = pl.steps[0].typed, pl.policy["routing"]
            compiled[name] = {"plan": str(work / name), "compile_s": None, "reused": True,
                              "thresholds": list(st.rule.thresholds), "certificate": pol["certificate"],
                              "costs_ms": {c.name: c.cost.ms for c in st.candidates},
                              "router_ms": pol.get("router_overhead_ms")}
            continue
        try:
            r = dyncompile.route(spec["candidates"], calib, work / name, budget=budget, rule=spec.get("rule", "confidence"),
                                 reference=spec.get("reference"), outputs=outputs, force=True)
        except CertificationError as e:  # reported, not hidden: the table then lacks this plan
            refused[name] = str(e)
            logger.warning("%s: %s", name, e)
            continue
        gc.collect()
        compiled[name] = {"plan": str(r.plan_dir), "compile_s": round(time.time() - t1, 1), "thresholds": r.fit.thresholds,
                          "certificate": r.fit.certificate, "costs_ms": r.costs, "router_ms": r.router_ms}
        logger.info("%s", r.summary())
    gc.collect()
    models = {n: dyncompile.load(d, **kw) for n, d in dirs.items()}  # fresh sessions: batch-1 arenas only
    routed = {}
    for n, c in compiled.items():
        m = dyncompile.load(c["plan"], **kw)  # every check (sub-plan digests) runs here
        # memory on a shared 24 GB machine: the sub-plans are byte-identical to the standalone plans (same
        # digest), so the routed plan runs on the standalone plans' sessions instead of a second MPNet copy
        for k, name in enumerate(m.task_api.text_step.names):
            m.task_api.text_step.models[k] = models[name]
        routed[n] = m
    gc.collect()
    cal_ms = compiled["cascade-minilm-mpnet"]["costs_ms"]
    exp = compiled["cascade-minilm-mpnet"]["certificate"]["expected_speedup"]
    p_cheap = float(np.clip((cal_ms["mpnet"] - cal_ms["mpnet"] / exp) / (cal_ms["mpnet"] - cal_ms["minilm"]), 0, 1))
    runners = [plan_runner(n, m) for n, m in models.items()]
    runners += [_candidate_runner(n, m) for n, m in routed.items()]
    runners.append(_random_runner("random-same-cost", models["minilm"], models["mpnet"], p_cheap))
    if "route-learned-minilm-mpnet" in routed:
        runners.append(_router_runner(routed["route-learned-minilm-mpnet"]))
    load_before = load_avg()
    t0 = time.time()
    res = measure(runners, tt, ty, rows)
    wall = time.time() - t0
    y = ty[:rows]
    base = float(np.median(res["mpnet"]["lat_ms"]))
    table = []
    notes = {"mpnet-ee": f"MPNet's own early exit, certified budget {budget}",
             "minilm-ee": f"MiniLM early exit, budget {budget}",
             "random-same-cost": f"p(MiniLM) = {p_cheap:.3f}: the cascade's calibrated expected cost"}
    for r in runners:
        if r.name == "router-only":
            continue
        info = {"note": notes.get(r.name, "")}
        if r.name in routed:
            hist = np.bincount(np.array(res[r.name]["extra"]), minlength=2).tolist()
            c = compiled[r.name]["certificate"]
            info["note"] = (f"answers per candidate {hist}; certified bound {c.get('bound')} pts at "
                            f"{c.get('confidence')} (budget {budget})")
        table.append(_row(r.name, res[r.name], y, base, info))
    acc, oms = _oracle([res["minilm"]["pred"], res["mpnet"]["pred"]], [res["minilm"]["lat_ms"], res["mpnet"]["lat_ms"]], y)
    table.append({"name": "oracle (MiniLM→MPNet)", "accuracy": round(acc, 2), "latency_ms_median": None,
                  "latency_ms_mean": round(oms, 3), "speedup_vs_reference": round(float(np.mean(res["mpnet"]["lat_ms"])) / oms, 3),
                  "note": "cheapest right model per row; mean of this run's per-row latencies (vs MPNet mean)"})
    r_ms = float(np.median(res["router-only"]["lat_ms"])) if "router-only" in res else float("nan")
    m_ms = float(np.median(res["minilm"]["lat_ms"]))
    overhead = {"learned_router_ms_median": round(r_ms, 4), "minilm_ms_median": round(m_ms, 3),
                "percent_of_cheapest": round(100 * r_ms / m_ms, 2),
                "confidence_rule_extra_ms": 0.0,
                "note": "router = tokenizer + bag-of-embeddings ONNX; the confidence rule reads MiniLM's own output"}
    # curves from the same run's per-row outputs and median latencies
    med = {n: float(np.median(res[n]["lat_ms"])) for n in ("minilm", "mpnet", "mpnet-ee")}
    curves = {
        "cascade MiniLM→MPNet": _sweep([res["minilm"]["probs"], res["mpnet"]["probs"]], y, [med["minilm"], med["mpnet"]]),
        "cascade MiniLM→MPNet-EE": _sweep([res["minilm"]["probs"], res["mpnet-ee"]["probs"]], y, [med["minilm"], med["mpnet-ee"]]),
    }
    pts = {r["name"]: (r["latency_ms_median"] if r["latency_ms_median"] is not None else r["latency_ms_mean"], r["accuracy"])
           for r in table if r["name"] != "random-same-cost"}
    out.mkdir(parents=True, exist_ok=True)
    _plot(out / "route-sentiment.png", pts, curves,
          ((med["minilm"], pts["minilm"][1]), (med["mpnet"], pts["mpnet"][1])),
          f"MiniLM-L6 → MPNet-base on movie-test, batch 1, {rows} rows (load {load_before}); stars: certified plans")
    # re-split check: pooled calib + test, cascade certified on one half, measured on the other
    resplit = None
    ms_all = {**cal_ms, "mpnet-ee": compiled.get("cascade-minilm-mpnet-ee", {}).get("costs_ms", {}).get("mpnet-ee", med["mpnet-ee"])}
    partial = {"results": table, "router_overhead": overhead, "compiled": compiled, "machine": machine_info(),
               "note": "written before the re-split check"}
    write_json_atomic(out / "route-sentiment.partial.json", partial)
    if resplits:
        # pool: movie-calib + the test rows measured above (their batch-1 outputs from the same run)
        tp = {n: np.concatenate([cal[n], res[n]["probs"]]) for n in ("minilm", "mpnet", "mpnet-ee")}
        yall = np.concatenate([cy, y])
        resplit = _resplit(tp, yall, ms_all, budget, resplits, calibrate_cascade)
    report = {
        "subject": "sentiment: MiniLM-L6 → MPNet-base (movie data)", "budget": budget, "rows_batch1": rows,
        "machine": machine_info(), "load_before": load_before, "load_after": load_avg(), "bench_wall_s": round(wall, 1),
        "compiled": compiled, "refused": refused, "results": table, "router_overhead": overhead, "resplit": resplit,
    }
    report["markdown"] = render_markdown(report).removesuffix("\n")
    write_json_atomic(out / "route-sentiment.json", report)
    (out / "route-sentiment.md").write_text(report["markdown"] + "\n")
    return report


def _resplit(probs: dict[str, np.ndarray], y: np.ndarray, ms: dict[str, float], budget: float, splits: int, calibrate) -> dict:
    from dyncompile.passes.early_exit.certify import CertificationError
    from dyncompile.runtime.rules.exit_rule import first_exits

    out = {}
    n = len(y)
    for name, last in (("cascade-minilm-mpnet", "mpnet"), ("cascade-minilm-mpnet-ee", "mpnet-ee")):
        drops, speed, refused = [], [], 0
        for s in range(splits):
            perm = np.random.default_rng(1000 + s).permutation(n)
            a, b = perm[: n // 2], perm[n // 2 :]
            try:
                fit = calibrate([probs["minilm"][a], probs[last][a]], probs["mpnet"][a], y[a], [ms["minilm"], ms[last]],
                                ms["mpnet"], budget=budget, seed=s)
            except CertificationError:
                refused += 1
                continue
            ex = first_exits(np.stack([probs["minilm"][b], probs[last][b]]), list(fit.thresholds) + [None], "entropy")
            pred = np.where(ex == 0, probs["minilm"][b].argmax(-1), probs[last][b].argmax(-1))
            drop = float(((probs["mpnet"][b].argmax(-1) == y[b]).mean() - (pred == y[b]).mean()) * 100)
            cost = ms["minilm"] + (ex == 1).mean() * ms[last]
            drops.append(drop)
            speed.append(ms["mpnet"] / cost)
        d = np.array(drops)
        out[name] = {"splits": splits, "refused": refused, "mean_drop": round(float(d.mean()), 3) if len(d) else None,
                     "p90_drop": round(float(np.percentile(d, 90)), 3) if len(d) else None,
                     "violation_rate": round(float((d > budget).mean()), 3) if len(d) else None,
                     "mean_cost_model_speedup": round(float(np.mean(speed)), 3) if speed else None}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="dyncompile bench route",
        description="Bench a routed plan against each candidate alone, random routing at the same cost and the "
        "oracle (batch 1, interleaved, medians), with the router overhead; or (--sentiment) the full "
        "MiniLM→MPNet subject with the re-split check.",
    )
    p.add_argument("plan", nargs="?", help="routed plan folder (dyncompile route -o DIR)")
    p.add_argument("--data", help="JSONL with 'text' and 'label' (default: movie-test)")
    p.add_argument("--batch1-rows", type=int, default=300, help="test rows measured at batch 1 (default 300)")
    p.add_argument("--out", help="output folder (default: PLAN-bench beside the plan; --sentiment: the current directory)")
    p.add_argument("--sentiment", action="store_true", help="the MiniLM→MPNet subject (needs --plans)")
    p.add_argument("--plans", help="folder with minilm, minilm-ee, mpnet, mpnet-ee plans")
    p.add_argument("--work", help="folder for the routed plans and cached calibration outputs")
    p.add_argument("--budget", type=float, default=1.0)
    p.add_argument("--resplits", type=int, default=50)
    p.add_argument("--reuse", action="store_true", help="reuse routed plans an earlier run compiled in --work")
    p.add_argument("-v", "--verbose", action="count", default=0)
    p.add_argument("--render", metavar="JSON", help=RENDER_HELP)
    rendered = render_requested(argv, render_markdown)
    if rendered is not None:
        return rendered
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.sentiment:
        from dyncompile.errors import DataError

        if not args.plans or not args.work:
            raise DataError("--sentiment needs --plans DIR (minilm, minilm-ee, mpnet, mpnet-ee) and --work DIR")
        rep = sentiment(Path(args.plans), Path(args.work), Path(args.out or "."),
                        args.budget, args.batch1_rows, args.resplits, args.reuse)
        print(rep["markdown"])
        return 0
    if not args.plan:
        from dyncompile.errors import DataError

        raise DataError("give a routed plan folder, or --sentiment --plans DIR --work DIR")
    data = Path(args.data) if args.data else DATA / "movie-test.jsonl"
    out = Path(args.out) if args.out else Path(args.plan).resolve().parent / f"{Path(args.plan).name}-bench"
    rep = bench_plan(Path(args.plan), data, out, args.batch1_rows)
    print(rep["markdown"])
    print(f"\nwritten: {out}/route.json, route.md, route.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
