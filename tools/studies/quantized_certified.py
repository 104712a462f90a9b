"""int8 under one certified budget: fp32, int8 (naive / accuracy-aware), early exit, int8 x early exit, cascade, batch 1.

Takes plan directories compiled by the pipelines a user runs (``dyncompile MODEL --passes ...``; the README of
the study lists them) and measures them with the fp32 original interleaved in one process, batch 1, on the rows
of ``--data`` (movie-test: never used to choose anything): per plan the accuracy, its change (with a paired 95 % bootstrap
interval over rows: is a drop on these rows consistent with the certified bound?) and the agreement
with the fp32 original from the very same runs as the latency (median/p90), the paired speedup over fp32 with a
95 % bootstrap interval over rows (:func:`~dyncompile.tools.bench.common.paired_ratio`, the geometric mean of
per-row ratios) and the total-time ratio (:func:`~dyncompile.tools.bench.common.total_time_ratio`, what throughput
follows when per-row costs are bimodal, as in a cascade or an early exit), and what the plan
promises (the certified bound and the budget split of ``policy``). Writes JSON + markdown.

    python -m dyncompile.tools.studies.quantized_certified --name minilm --plans fp32-int8=DIR ... --out DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

from dyncompile.tools.bench.common import DATA


def promise(policy: dict[str, Any]) -> dict[str, Any]:
    """What a plan certifies: the pipeline bound (early exit) and/or the int8 search's own, with the split."""
    out: dict[str, Any] = {}
    # early exit's certificate, or a cascade's (policy.routing): both bound the whole plan against its reference
    cert = ((policy.get("early_exit") or {}).get("certificate") or (policy.get("routing") or {}).get("certificate")
            or {})
    if cert:
        out.update(budget=cert.get("budget"), confidence=cert.get("confidence"), certified=cert.get("certified"),
                   observed_calib=cert.get("observed"), bound=cert.get("bound"),
                   expected_speedup_layers=cert.get("expected_speedup"))
    q = policy.get("quantization")
    if isinstance(q, dict):
        qc = q.get("certificate") or {}
        out.update(int8_share=q.get("share"), int8_target=q.get("target_points"), int8_fp32_matmuls=len(q["excluded"]),
                   int8_matmuls=len(q["table"]), int8_observed_calib=qc.get("observed"), int8_bound=qc.get("bound"),
                   int8_certified=qc.get("certified"))
    if "budget_split" in policy:
        out["budget_split"] = policy["budget_split"]
    return out


def parse_plan(text: str) -> tuple[str, Path, str]:
    """``LABEL=DIR[,memory=MODE]`` -> ``(label, dir, memory mode)`` (``dyncompile.load``'s ``memory``, default auto)."""
    from dyncompile.errors import DataError
    from dyncompile.runtime.providers import MEMORY_MODES

    label, sep, rest = text.partition("=")
    if not sep or not label or not rest:
        raise DataError(f"--plans: {text!r} is not LABEL=DIR[,memory=MODE]")
    where, sep, mode = rest.partition(",memory=")
    mode = mode if sep else "auto"
    if mode not in MEMORY_MODES:
        raise DataError(f"--plans {label}: memory must be one of {', '.join(MEMORY_MODES)}, got {mode!r}")
    return label, Path(where), mode


def run(plans: list[tuple[str, Path, str]], data: Path, limit: int | None, warmup: int, progress: bool,
        provider: str = "cpu", block: int = 1, peers: list[str] = ()) -> dict[str, Any]:
    import dyncompile
    from dyncompile.io import read_jsonl, texts_and_labels
    from dyncompile.tools.bench.common import (
        bootstrap_diff,
        interleaved_batch1,
        machine_info,
        paired_ratio,
        plan_runner,
        reference_runner,
        total_time_ratio,
    )

    compiled = [(name, dyncompile.load(d, provider=provider, memory=mode)) for name, d, mode in plans]
    first = compiled[0][1]
    texts, labels = texts_and_labels(read_jsonl(data, limit=limit), first.plan.labels)
    runners = [reference_runner("fp32 original", str(first.plan.original_model("bench")), first)]
    runners += [plan_runner(name, c) for name, c in compiled]
    if peers:
        from dyncompile.tools.studies.encoder_peers import peer_runner

        runners += [peer_runner(text, first) for text in peers]
    lat, probs, exits = interleaved_batch1(runners, texts, len(texts), warmup=warmup, progress=progress, block=block)
    y = np.asarray(labels)
    ref = np.stack(probs[runners[0].name]).argmax(-1)
    base_lat = np.asarray(lat[runners[0].name])
    rows = []
    plan_of = [None, *[c for _, c in compiled], *[None] * len(peers)]
    memory_of = [None, *[mode for _, _, mode in plans], *[None] * len(peers)]
    for r, c, mode in zip(runners, plan_of, memory_of, strict=True):
        pred = np.stack(probs[r.name]).argmax(-1)
        ex = exits[r.name]
        row = {
            "name": r.name,
            "accuracy": round(100 * float((pred == y).mean()), 2),
            "delta_vs_fp32": round(100 * float((pred == y).mean() - (ref == y).mean()), 2),
            "delta_vs_fp32_ci": [round(100 * v, 2) for v in bootstrap_diff(pred == y, ref == y)[1:]],
            "agreement_fp32": round(100 * float((pred == ref).mean()), 2),
            "mean_exit_layer": None if ex[0] is None else round(float(np.mean([int(np.asarray(e).reshape(-1)[0]) for e in ex])), 2),
            "p50_ms": round(1e3 * float(np.median(lat[r.name])), 2),
            "p90_ms": round(1e3 * float(np.percentile(lat[r.name], 90)), 2),
            "speedup": paired_ratio(1.0 / np.asarray(lat[r.name]), 1.0 / base_lat),
            "time_ratio": total_time_ratio(lat[r.name], base_lat),
            "plan": None if c is None else Path(c.plan.directory).name,  # no machine paths in stored reports
            "promise": {} if c is None else promise(c.plan.policy),
        }
        if c is not None:  # dyncompile.load's memory mode and the session options it set
            row["memory"] = {"mode": mode, "session_options": c.ctx.memory_options}
        if r.info.get("peer"):
            row["peer"] = r.info
        rows.append(row)
    return {"data": Path(data).name, "rows": len(texts), "batch": 1, "provider": provider, "interleave_block": block,
            "results": rows, "machine": machine_info()}


def markdown(report: dict[str, Any]) -> str:
    total = all("time_ratio" in r for r in report["results"])  # reports written before it have no such column
    with_ci = any(r.get("delta_vs_fp32_ci") for r in report["results"])  # reports written before it have none
    lines = ["| plan | acc (%) | " + ("Δ vs fp32 [95 % CI]" if with_ci else "Δ vs fp32") + " | agree fp32 (%) | mean exit | p50 (ms) | p90 (ms) | speedup b1 [95 % CI] | "
             + ("total time ratio [95 % CI] | " if total else "")
             + "certified bound (budget) | int8 bound (target), fp32 MatMuls |",
             "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if total else "")]
    for r in report["results"]:
        s, p = r["speedup"], r["promise"]
        t = r.get("time_ratio")
        tcol = f"{t['ratio']:.2f}x [{t['lo']:.2f}, {t['hi']:.2f}] | " if total else ""
        bound = f"{p['bound']:.2f} ({p['budget']:g})" if p.get("bound") is not None else "–"
        q = (f"{p['int8_bound']:.2f} ({p['int8_target']:g}), {p['int8_fp32_matmuls']}/{p['int8_matmuls']}"
             if p.get("int8_bound") is not None else "–")
        ci = r.get("delta_vs_fp32_ci")
        delta = f"{r['delta_vs_fp32']:+.2f}" + (f" [{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci and (r["plan"] or r.get("peer")) else "")
        lines.append(f"| {r['name']} | {r['accuracy']} | {delta} | {r['agreement_fp32']} | "
                     f"{r['mean_exit_layer'] if r['mean_exit_layer'] is not None else '–'} | {r['p50_ms']} | {r['p90_ms']} | "
                     f"{s['ratio']:.2f}x [{s['lo']:.2f}, {s['hi']:.2f}] | {tcol}{bound} | {q} |")
    return "\n".join(lines)


def render_markdown(report: dict[str, Any]) -> str:
    """The markdown this study writes beside its JSON report, from the JSON alone (``--render JSON``)."""
    return markdown(report)


def main(argv: list[str] | None = None) -> int:
    from dyncompile.tools.bench.common import render_requested

    rendered = render_requested(argv, render_markdown)
    if rendered is not None:
        return rendered
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", required=True, help="report stem (e.g. the model)")
    p.add_argument("--plans", nargs="+", required=True, metavar="LABEL=DIR[,memory=MODE]",
                   help="compiled plan directories; ',memory=arena' (or malloc) loads one with that dyncompile.load "
                        "memory mode instead of auto")
    p.add_argument("--data", default=str(DATA / "movie-test.jsonl"))
    p.add_argument("--limit", type=int)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--provider", default="cpu", help="execution provider of every session (cpu, openvino)")
    p.add_argument("--block", type=int, default=1, metavar="ROWS",
                   help="interleave the runners by blocks of ROWS rows (default 1: row by row, every runner starts "
                        "with the caches the previous one left; e.g. 25: each runs warm, as serving alone)")
    p.add_argument("--peer", action="append", default=[], metavar="LABEL=KIND:PATH",
                   help="a peer's model run beside the plans: openvino:DIR (NNCF int8, prepared by "
                        "python -m dyncompile.tools.studies.encoder_peers) or onnxruntime:FILE (e.g. Optimum's int8); "
                        "',precision=f32' after an openvino path sets its inference precision, ',pad=64' a static input "
                        "shape with every row padded to it")
    p.add_argument("--out", required=True)
    p.add_argument("-q", "--quiet", action="store_true")
    a = p.parse_args(argv)
    if a.block < 1:
        p.error(f"--block must be a positive number of rows, got {a.block}")
    from dyncompile.errors import DataError

    try:
        plans = [parse_plan(x) for x in a.plans]
    except DataError as e:
        p.error(str(e))
    labels = ["fp32 original", *[name for name, _, _ in plans], *[x.split("=", 1)[0] for x in a.peer]]
    if len(set(labels)) < len(labels):
        p.error(f"every runner needs its own label; repeated: {sorted({x for x in labels if labels.count(x) > 1})}")
    if a.peer:
        from dyncompile.tools.studies.encoder_peers import parse_peer

        try:
            for text in a.peer:
                parse_peer(text)
        except DataError as e:
            p.error(str(e))
    report = run(plans, Path(a.data), a.limit, a.warmup, not a.quiet, a.provider, a.block, a.peer)
    report["markdown"] = markdown(report)
    from dyncompile.tools.bench.common import write_report

    jp, mp = write_report(report, Path(a.out), a.name)
    print(report["markdown"])
    print(f"written: {jp} {mp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
