"""Which activations to sparsify: the MLPs' inputs only, or every linear layer's input (TEAL), at one perplexity budget.

``sparsify-activations`` skips weight rows of a decoder's gated MLPs (gate/up read the post-norm ``x``, down reads
``h``). TEAL (Liu et al. 2024) thresholds the input of *every* linear layer, attention projections included
(q/k/v share the post-norm input, o reads the attention output). Sparsifying more sites skips more bytes per
step at a given sparsity, but each site also costs perplexity, so within a fixed budget the sparsity per site
falls. This study answers the question the contextual-sparsity issue leaves open ("and attention heads, if it
pays") on the quality side, independently of any kernel:

* sites: the inputs of the constant-weight float ``MatMul`` s of the main graph, the LM head excluded, grouped by
  input value (:func:`~dyncompile.passes.sparsify_activations.linear_sites`, what ``sparsify-activations{sites=all}``
  thresholds); a site is ``mlp`` when it is a gated MLP's ``x`` or ``h``, ``attention`` otherwise;
* per site, the TEAL threshold: the ``s``-quantile of ``|v|`` on calibration text through the dense model (the
  pass's own calibration windows: CPython standard-library files, the benchmarks' prompt files excluded);
* the graph gets one ``Where(|v| <= t, 0, v)`` per site, with ``t`` a graph input, so one session evaluates every
  level: threshold ``-1`` reproduces the dense model exactly (tested);
* per site set (``mlp``, ``attention``, ``all``) and level: held-out perplexity on other standard-library files, the sparsity
  achieved there, and the share of the step's weight bytes that a perfect kernel would skip
  (``sum_site achieved x bytes / weight_reads``), i.e. an upper bound on the memory-bound step's speedup,
  ``1 / (1 - skipped share)``.

    python -m dyncompile.tools.studies.sparsity_sites ~/.cache/dyncompile/models/smollm2-135m \\
        --out bench-results/contextual-sparsity --name smollm2-sites
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from dyncompile.passes.sparsify_activations import Site, abs_samples, heldout_stats, linear_sites

logger = logging.getLogger(__name__)

LEVELS = tuple(round(0.05 * k, 2) for k in range(0, 11))  # 0 .. 0.5
OFF = -1.0  # a threshold no |v| is below: the site is dense
SETS = ("mlp", "attention", "all")  # which sites get thresholds


def _kind(site: Site) -> str:
    """``mlp`` (a gated MLP's ``x`` or ``h``) or ``attention``."""
    return "attention" if site.kind == "attention" else "mlp"


def add_thresholds(model: ir.Model, sites: Sequence[Site]) -> list[str]:
    """Insert ``Where(Abs(v) <= t_i, 0, v)`` before each site's MatMuls, ``t_i`` a float scalar graph input named
    ``sparsity_threshold.{i}``; expose each site's (unthresholded) value as an output. Returns the input names."""
    g = model.graph
    zero = ir.val("sparsity_zero", const_value=ir.tensor(np.zeros((), np.float32), name="sparsity_zero"))
    g.register_initializer(zero)
    names = []
    for i, site in enumerate(sites):
        t = ir.val(f"sparsity_threshold.{i}", ir.DataType.FLOAT, ir.Shape([]))
        g.inputs.append(t)
        names.append(t.name)
        first = site.consumers[0]
        a = ir.node("Abs", [site.value], name=f"sparsity_site.{i}/abs")
        le = ir.node("LessOrEqual", [a.outputs[0], t], name=f"sparsity_site.{i}/le")
        wh = ir.node("Where", [le.outputs[0], zero, site.value], name=f"sparsity_site.{i}/where")
        if site.value.dtype is None:  # an untyped intermediate: a float MatMul's input is float
            site.value.dtype = ir.DataType.FLOAT
        wh.outputs[0].dtype, wh.outputs[0].shape = site.value.dtype, site.value.shape
        for n in (a, le, wh):
            g.insert_before(first, n)
        for mm in site.consumers:
            mm.replace_input_with(0, wh.outputs[0])
        if site.value not in g.outputs:
            g.outputs.append(site.value)
    return names


def _feeds(spec, window, thresholds: Sequence[float], names: Sequence[str]) -> dict[str, np.ndarray]:
    from dyncompile.passes.speculative.probe import prefill_feeds

    feeds = prefill_feeds(spec, list(window))
    feeds.update({n: np.asarray(t, np.float32) for n, t in zip(names, thresholds, strict=True)})
    return feeds


def evaluate(sess, spec, windows, sites: Sequence[Site], names: Sequence[str], thresholds: Sequence[float],
             reference: Sequence[np.ndarray] | None = None, *, greedy: bool = False,
             nll: list[tuple[float, int]] | None = None):
    """Perplexity of ``windows`` with ``thresholds`` per site, per site the share of entries at or below its
    threshold, and the per-window greedy tokens (with ``reference``, the dense model's: the share that agree too);
    ``nll`` gets each window's summed NLL and predictions (:func:`heldout_stats`)."""
    outs = [spec["logits"], *[s.value.name for s in sites]]
    return heldout_stats(((w, sess.run(outs, _feeds(spec, w, thresholds, names))) for w in windows), thresholds,
                         reference, greedy=greedy, nll=nll)


def calibrate(sess, spec, windows, sites: Sequence[Site], names: Sequence[str]) -> dict[str, np.ndarray]:
    """A sample of ``|v|`` per site (by value name) over ``windows`` through the dense model (every threshold off),
    drawn as the pass draws its own."""
    outs = [s.value.name for s in sites]
    off = [OFF] * len(sites)
    return abs_samples((sess.run(outs, _feeds(spec, w, off, names)) for w in windows), outs)


def run(model_dir: Path, *, levels: Sequence[float] = LEVELS, budget: float = 2.0, calib_tokens: int = 4096,
        heldout_tokens: int = 8192, window: int = 256, progress: bool = True) -> dict[str, Any]:
    """The study on the decoder in ``model_dir`` (``model.onnx`` + ``tokenizer.json``)."""
    from dyncompile.passes.sparsify_activations import corpus_windows
    from dyncompile.passes.speculative.decoder_spec import decoder_spec
    from dyncompile.passes.speculative.probe import session_for, weight_reads
    from dyncompile.tools.bench.common import machine_info

    t0 = time.perf_counter()
    model = ir.load(str(model_dir / "model.onnx"))
    spec = decoder_spec(model, "model", what="model to study")
    total_bytes = weight_reads(model)
    sites = linear_sites(model, spec.get("vocab_size"))
    if not any(_kind(s) == "mlp" for s in sites):
        raise SystemExit(f"{model_dir}: no gated MLP found (sparsify-activations cannot fire on this model)")
    names = add_thresholds(model, sites)
    sess = session_for(model)
    calib = corpus_windows(model_dir / "tokenizer.json", tokens=calib_tokens, window=window, part="calib")
    held = corpus_windows(model_dir / "tokenizer.json", tokens=heldout_tokens, window=window, part="heldout")
    samples = calibrate(sess, spec, calib, sites, names)
    dense_ppl, _, dense_top1, _ = evaluate(sess, spec, held, sites, names, [OFF] * len(sites), greedy=True)
    site_bytes = np.array([s.weight_bytes for s in sites], np.float64)
    is_mlp = np.array([_kind(s) == "mlp" for s in sites])
    rows = []
    for which in SETS:
        on = np.array([which in ("all", _kind(s)) for s in sites])
        for lv in levels:
            ts = [float(np.quantile(samples[s.value.name], lv)) if (on[j] and lv > 0) else OFF
                  for j, s in enumerate(sites)]
            ppl, below, _, agree = evaluate(sess, spec, held, sites, names, ts, dense_top1)
            below = np.where(on, below, 0.0)
            skipped = float((below * site_bytes).sum() / total_bytes)
            row = {"sites": which, "sparsity": lv, "perplexity": round(ppl, 4),
                   "increase_pct": round(100.0 * (ppl / dense_ppl - 1.0), 3), "top1_agreement": round(agree, 4),
                   "achieved_mlp": round(float(below[is_mlp].mean()), 4),
                   "achieved_attention": round(float(below[~is_mlp].mean()), 4),
                   "skipped_bytes_share": round(skipped, 4), "perfect_kernel_bound": round(1.0 / (1.0 - skipped), 4)}
            rows.append(row)
            if progress:
                logger.info("%s %.2f: perplexity %.3f (+%.2f %%), skipped bytes %.1f %%", which, lv, ppl,
                            row["increase_pct"], 100 * skipped)
    best = {}
    for which in SETS:
        ok = [r for r in rows if r["sites"] == which and r["increase_pct"] <= budget]
        best[which] = max(ok, key=lambda r: r["skipped_bytes_share"]) if ok else None
    kinds = {k: {"sites": sum(_kind(s) == k for s in sites),
                 "weight_bytes": int(sum(s.weight_bytes for s in sites if _kind(s) == k))} for k in ("mlp", "attention")}
    return {
        "model": model_dir.name, "budget_pct": budget, "dense_perplexity": round(dense_ppl, 4),
        "weight_reads_bytes": int(total_bytes), "site_kinds": kinds,
        "other_bytes_share": round(1.0 - float(site_bytes.sum()) / total_bytes, 4),
        "calibration": {"windows": len(calib), "tokens": sum(map(len, calib))},
        "heldout": {"windows": len(held), "tokens": sum(map(len, held))},
        "rows": rows, "best_within_budget": best, "seconds": round(time.perf_counter() - t0, 1),
        "machine": machine_info(),
    }


def render_markdown(r: dict[str, Any]) -> str:
    """The markdown table of a stored report (``bench-results/contextual-sparsity/*-sites.md``)."""
    k = r["site_kinds"]
    tb = r["weight_reads_bytes"]
    out = [f"# Sparsity sites: {r['model']}", "",
           f"Dense held-out perplexity {r['dense_perplexity']} ({r['heldout']['tokens']} tokens of standard-library "
           f"files never used for calibration; calibration {r['calibration']['tokens']} tokens). Weight bytes a step "
           f"reads: {tb / 1e6:.1f} MB — MLP inputs ({k['mlp']['sites']} sites) {100 * k['mlp']['weight_bytes'] / tb:.0f} %, "
           f"attention inputs ({k['attention']['sites']} sites) {100 * k['attention']['weight_bytes'] / tb:.0f} %, "
           f"the rest (LM head) {100 * r['other_bytes_share']:.0f} %.", "",
           "| sites | sparsity (calibration quantile) | perplexity | increase % | top-1 agreement with dense "
           "| achieved MLP / attention (held-out) | weight bytes skipped | perfect-kernel step bound |",
           "|---|---|---|---|---|---|---|---|"]
    for x in r["rows"]:
        out.append(f"| {x['sites']} | {x['sparsity']:.2f} | {x['perplexity']:.3f} | {x['increase_pct']:+.2f} | "
                   f"{x['top1_agreement']:.3f} | {x['achieved_mlp']:.2f} / {x['achieved_attention']:.2f} | {100 * x['skipped_bytes_share']:.1f} % | "
                   f"{x['perfect_kernel_bound']:.3f}x |")
    out.append("")
    for which, b in r["best_within_budget"].items():
        if b is None:
            out.append(f"- {which}: no level within {r['budget_pct']} %.")
        else:
            out.append(f"- {which}: the most bytes skipped within {r['budget_pct']} % is at sparsity {b['sparsity']:.2f} "
                       f"({b['increase_pct']:+.2f} %): {100 * b['skipped_bytes_share']:.1f} % of the step's weight bytes, "
                       f"a step bound of {b['perfect_kernel_bound']:.3f}x with a kernel that costs nothing but the rows it reads.")
    m = r["machine"]
    out += ["", f"Machine: {m.get('cpu')}, {m.get('cores')} cores, onnxruntime {m.get('onnxruntime')}, {m.get('date')}; "
            f"{r['seconds']} s."]
    return "\n".join(out) + "\n"


def study_parser(prog: str, description: str, *, example: str, suffix: str, heldout_tokens: int) -> argparse.ArgumentParser:
    """The arguments every sparsity study over one decoder folder takes (model folder, report, budget, text)."""
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("model_dir", type=Path, help=f"a decoder folder, e.g. ~/.cache/dyncompile/models/{example}")
    ap.add_argument("--out", type=Path, required=True, help="folder for NAME.json and NAME.md")
    ap.add_argument("--name", default=None, help=f"report name (default: MODEL-{suffix})")
    ap.add_argument("--budget", type=float, default=2.0, help="held-out perplexity increase allowed, percent (2)")
    ap.add_argument("--calib-tokens", type=int, default=4096, help="calibration tokens (4096, as the pass)")
    ap.add_argument("--heldout-tokens", type=int, default=heldout_tokens, help=f"held-out tokens ({heldout_tokens})")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("-q", "--quiet", action="store_true")
    return ap


def study_dir(ap: argparse.ArgumentParser, a: argparse.Namespace, *tokens: int) -> Path:
    """The checked decoder folder of parsed ``a`` (``tokens``: more token counts that must hold a window)."""
    d = a.model_dir.expanduser()
    if not (d / "model.onnx").is_file() or not (d / "tokenizer.json").is_file():
        ap.error(f"{d} is not a decoder folder (model.onnx + tokenizer.json); build one with "
                 "`dyncompile models build smollm2-135m`")
    if not a.budget > 0 or a.window < 8 or min(a.calib_tokens, a.heldout_tokens, *tokens) < a.window:
        ap.error("--budget must be > 0, --window >= 8, and every token count (--calib-tokens, --heldout-tokens, ...) "
                 ">= --window")
    logging.basicConfig(level=logging.WARNING if a.quiet else logging.INFO, format="%(message)s")
    return d


def write_study(a: argparse.Namespace, d: Path, suffix: str, r: dict[str, Any], md: str) -> None:
    """``NAME.json`` (atomic) and ``NAME.md`` under ``--out``; the markdown printed."""
    from dyncompile.io import write_json_atomic

    name = a.name or f"{d.name}-{suffix}"
    a.out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(a.out / f"{name}.json", r)
    (a.out / f"{name}.md").write_text(md, encoding="utf-8")
    print(md)


def main(argv: list[str] | None = None) -> int:
    ap = study_parser(
        "python -m dyncompile.tools.studies.sparsity_sites",
        "Held-out perplexity and skippable weight bytes when TEAL thresholds cover the MLP inputs only "
        "or every linear layer's input (attention included), on one decoder folder (model.onnx + tokenizer.json).",
        example="smollm2-135m", suffix="sites", heldout_tokens=8192)
    ap.add_argument("--levels", default=None,
                    help="comma-separated sparsity levels in [0, 1) (default: 0, 0.05, ..., 0.5)")
    a = ap.parse_args(argv)
    d = study_dir(ap, a)
    try:
        levels = LEVELS if a.levels is None else tuple(sorted({round(float(x), 4) for x in a.levels.split(",")}))
    except ValueError:
        ap.error(f"--levels {a.levels!r}: give comma-separated numbers, e.g. 0,0.2,0.3")
    if not levels or not all(0.0 <= x < 1.0 for x in levels):
        ap.error(f"--levels {a.levels!r}: every level must be in [0, 1)")
    r = run(d, levels=levels, budget=a.budget, calib_tokens=a.calib_tokens, heldout_tokens=a.heldout_tokens, window=a.window,
            progress=not a.quiet)
    write_study(a, d, "sites", r, render_markdown(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
