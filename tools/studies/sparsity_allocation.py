"""Per-layer sparsity allocation (TEAL's greedy search) against one uniform quantile, on held-out perplexity.

``sparsify-activations`` drops the same share (one calibration quantile) of every MLP input. TEAL (Liu et al.
2024, section 4.2) allocates sparsity within each block greedily instead: raise the sparsity of the block's input
whose next step adds the least to the block's output error, until the block skips its share of the bytes. This study
measures whether such an allocation buys more skipped weight bytes within a perplexity budget than the uniform
quantile does, independently of any kernel:

* sites: each gated MLP's two inputs, ``x`` (read by gate and up, 2/3 of the MLP's bytes) and ``h`` (read by down);
  per site and level, the TEAL threshold is that quantile of ``|v|`` on the pass's calibration text (dense model);
* local error: for each layer, the dense ``x`` of the first calibration windows (``--error-tokens``) goes through
  that layer's MLP in numpy with both inputs thresholded; the error of a level pair is the squared distance of the
  MLP's output from the dense output, over the squared norm of the residual stream the output is added to (so
  layers compare on one scale);
* each layer's greedy path: from (0, 0), step whichever of ``x`` / ``h`` adds the least error per byte skipped;
* **within-block** (TEAL): every layer walks its own path to the same share of its MLP bytes;
* **across layers**: one greedy over every layer's path, the next step going to the layer whose step adds the least
  error per byte, until the model skips a target share of the step's weight bytes;
* held-out perplexity (standard-library files never used for calibration, the same windows as ``sparsity_sites``)
  of each allocation and of the uniform quantile, per-window paired against the dense model (bootstrap interval),
  the sparsity achieved there, and the perfect-kernel step bound ``1 / (1 - skipped share)``.

    python -m dyncompile.tools.studies.sparsity_allocation ~/.cache/dyncompile/models/qwen2.5-coder-1.5b \\
        --out bench-results/contextual-sparsity --name qwen15-allocation
"""

from __future__ import annotations

import argparse
import heapq
import logging
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from dyncompile.passes.sparsify_activations import greedy_paths, linear_sites, mlp_layers, residual_after
from dyncompile.tools.studies.sparsity_sites import (
    OFF,
    _feeds,
    add_thresholds,
    calibrate,
    evaluate,
    study_dir,
    study_parser,
    write_study,
)

logger = logging.getLogger(__name__)

STEP = 0.05
MAX_LEVEL = 0.7
BLOCK_SHARES = (0.25, 0.30, 0.35)  # within-block targets: share of each MLP's bytes
MODEL_SHARES = (0.184, 0.22, 0.257)  # across-layer targets: share of the step's weight bytes (uniform 0.25/0.30/0.35)
UNIFORM = (0.25, 0.30)
BOOTSTRAP = 2000


# ----------------------------------------------------------------------------------------------- allocation


def within_block(paths: Sequence[Sequence[tuple[int, int, float, float]]], share: float,
                 mlp_bytes: Sequence[float]) -> list[tuple[int, int]]:
    """TEAL: each layer's first point on its path that skips at least ``share`` of its MLP bytes (its last if none)."""
    out = []
    for path, total in zip(paths, mlp_bytes, strict=True):
        point = next((p for p in path if p[3] >= share * total - 1e-9), path[-1])
        out.append((point[0], point[1]))
    return out


def across_layers(paths: Sequence[Sequence[tuple[int, int, float, float]]], target_bytes: float) -> list[tuple[int, int]]:
    """One greedy over every layer's path: the next step goes to the layer whose step adds the least error per byte
    skipped, until the layers skip ``target_bytes`` together (or every path is at its end)."""
    at = [0] * len(paths)
    heap = []

    def push(layer: int) -> None:
        k = at[layer]
        if k + 1 < len(paths[layer]):
            a, b = paths[layer][k], paths[layer][k + 1]
            heapq.heappush(heap, ((b[2] - a[2]) / max(b[3] - a[3], 1e-30), layer))

    for layer in range(len(paths)):
        push(layer)
    skipped = 0.0
    while heap and skipped < target_bytes - 1e-9:
        _, layer = heapq.heappop(heap)
        a, b = paths[layer][at[layer]], paths[layer][at[layer] + 1]
        skipped += b[3] - a[3]
        at[layer] += 1
        push(layer)
    return [(paths[layer][k][0], paths[layer][k][1]) for layer, k in enumerate(at)]


# ----------------------------------------------------------------------------------------------- evaluation


def _evaluate(sess, spec, windows, sites, names: Sequence[str], thresholds: Sequence[float],
              reference: Sequence[np.ndarray] | None = None):
    """Per-window summed NLL and predictions, per site the share of entries at or below its threshold, the greedy
    tokens per window and (with ``reference``) the share of positions agreeing with it."""
    per: list[tuple[float, int]] = []
    _, below, top1, agree = evaluate(sess, spec, windows, sites, names, thresholds, reference, greedy=True, nll=per)
    nll, n = (np.array(v) for v in zip(*per, strict=True))
    return nll, n, below, top1, agree


def paired_increase(nll: np.ndarray, dense_nll: np.ndarray, n: np.ndarray, *, seed: int = 0,
                    reps: int = BOOTSTRAP) -> tuple[float, float, float]:
    """Perplexity increase (percent) over the dense model and a 95 % bootstrap interval, windows resampled in pairs."""
    def inc(idx):
        return 100.0 * (math.exp((nll[idx].sum() - dense_nll[idx].sum()) / n[idx].sum()) - 1.0)

    rng = np.random.default_rng(seed)
    k = len(nll)
    boots = [inc(rng.integers(0, k, k)) for _ in range(reps)]
    lo, hi = np.percentile(boots, [2.5, 97.5])
    return inc(np.arange(k)), float(lo), float(hi)


def run(model_dir: Path, *, calib_tokens: int = 4096, heldout_tokens: int = 4096, window: int = 256,
        error_tokens: int = 512, step: float = STEP, max_level: float = MAX_LEVEL,
        block_shares: Sequence[float] = BLOCK_SHARES, model_shares: Sequence[float] = MODEL_SHARES,
        uniform: Sequence[float] = UNIFORM, budget: float = 2.0, progress: bool = True) -> dict[str, Any]:
    """The study on the decoder in ``model_dir`` (``model.onnx`` + ``tokenizer.json``)."""
    from dyncompile.passes.sparsify_activations import corpus_windows
    from dyncompile.passes.speculative.decoder_spec import decoder_spec
    from dyncompile.passes.speculative.probe import session_for, weight_reads
    from dyncompile.tools.bench.common import machine_info

    t0 = time.perf_counter()
    model = ir.load(str(model_dir / "model.onnx"))
    spec = decoder_spec(model, "model", what="model to study")
    total_bytes = float(weight_reads(model))
    layers, why = mlp_layers(model)
    if not layers:
        raise SystemExit(f"{model_dir}: {why}")
    sites = linear_sites(model, spec.get("vocab_size"), "mlp")  # x0, h0, x1, h1, ...
    residuals = [residual_after(ly.down) for ly in layers]
    if any(r is None for r in residuals):
        raise SystemExit(f"{model_dir}: an MLP output is not added to a residual stream; the error scale is undefined")
    names = add_thresholds(model, sites)
    for r in residuals:
        if r not in model.graph.outputs:
            model.graph.outputs.append(r)
    sess = session_for(model)
    site_names = [s.value.name for s in sites]
    calib = corpus_windows(model_dir / "tokenizer.json", tokens=calib_tokens, window=window, part="calib")
    held = corpus_windows(model_dir / "tokenizer.json", tokens=heldout_tokens, window=window, part="heldout")
    samples = calibrate(sess, spec, calib, sites, names)
    grid = [round(step * k, 4) for k in range(int(round(max_level / step)) + 1)]

    def threshold(name: str, level: float) -> float:
        return float(np.quantile(samples[name], level)) if level > 0 else OFF

    # each layer's greedy path, from the dense inputs of its MLP and the residual norms on the first calibration windows
    t1 = time.perf_counter()
    err_windows = calib[: max(1, math.ceil(error_tokens / window))]
    outs = [*site_names[0::2], *(r.name for r in residuals)]
    runs = (sess.run(outs, _feeds(spec, w, [OFF] * len(sites), names)) for w in err_windows)
    paths, mlp_bytes = [], []
    for k, path in enumerate(greedy_paths(layers, runs, samples, grid)):
        paths.append(path.full())
        mlp_bytes.append((path.x_bytes + path.h_bytes) / step)
        if progress:
            at = within_block([paths[-1]], 0.30, mlp_bytes[-1:])[0]
            logger.info("layer %d: path to 30 %% of its bytes ends at x %.2f / h %.2f", k, grid[at[0]], grid[at[1]])
    error_seconds = time.perf_counter() - t1

    configs: list[tuple[str, float, list[tuple[int, int]]]] = []
    for s in uniform:
        lv = int(round(s / step))
        configs.append(("uniform", s, [(lv, lv)] * len(layers)))
    for s in block_shares:
        configs.append(("within-block", s, within_block(paths, s, mlp_bytes)))
    for s in model_shares:
        configs.append(("across-layers", s, across_layers(paths, s * total_bytes)))

    dense_nll, n, _, dense_top1, _ = _evaluate(sess, spec, held, sites, names, [OFF] * len(sites))
    dense_ppl = math.exp(dense_nll.sum() / n.sum())
    site_bytes = np.array([s.weight_bytes for s in sites], np.float64)
    rows = []
    for kind, target, alloc in configs:
        levels = [lv for pair in alloc for lv in pair]  # x0, h0, x1, h1, ...
        ts = [threshold(name, grid[lv]) for name, lv in zip(site_names, levels, strict=True)]
        nll, _, below, _, agree = _evaluate(sess, spec, held, sites, names, ts, dense_top1)
        inc, lo, hi = paired_increase(nll, dense_nll, n)
        skipped = float((below * site_bytes).sum() / total_bytes)
        row = {"allocation": kind, "target": target, "perplexity": round(math.exp(nll.sum() / n.sum()), 4),
               "increase_pct": round(inc, 3), "increase_ci": [round(lo, 3), round(hi, 3)],
               "top1_agreement": round(float(agree), 4),
               "levels_x": [grid[i] for i, _ in alloc], "levels_h": [grid[j] for _, j in alloc],
               "achieved_x": round(float(below[0::2].mean()), 4), "achieved_h": round(float(below[1::2].mean()), 4),
               "skipped_bytes_share": round(skipped, 4), "perfect_kernel_bound": round(1.0 / (1.0 - skipped), 4)}
        rows.append(row)
        if progress:
            logger.info("%s %.3f: perplexity +%.2f %% [%.2f, %.2f], skipped bytes %.1f %%, bound %.3fx", kind, target,
                        inc, lo, hi, 100 * skipped, row["perfect_kernel_bound"])
    ok = [r for r in rows if r["increase_pct"] <= budget]
    return {
        "model": model_dir.name, "budget_pct": budget, "dense_perplexity": round(dense_ppl, 4),
        "weight_reads_bytes": int(total_bytes), "mlp_bytes_share": round(float(sum(mlp_bytes)) / total_bytes, 4),
        "layers": len(layers), "step": step, "max_level": max_level,
        "calibration": {"windows": len(calib), "tokens": sum(map(len, calib)),
                        "error_tokens": sum(map(len, err_windows))},
        "heldout": {"windows": len(held), "tokens": sum(map(len, held))},
        "rows": rows, "best_within_budget": max(ok, key=lambda r: r["skipped_bytes_share"]) if ok else None,
        "error_seconds": round(error_seconds, 1), "seconds": round(time.perf_counter() - t0, 1),
        "machine": machine_info(),
    }


def _levels(vals: Sequence[float]) -> str:
    return f"{min(vals):.2f}–{max(vals):.2f} (mean {float(np.mean(vals)):.2f})"


def render_markdown(r: dict[str, Any]) -> str:
    """The markdown table of a stored report (``bench-results/contextual-sparsity/*-allocation.md``)."""
    out = [f"# Sparsity allocation: {r['model']}", "",
           f"Dense held-out perplexity {r['dense_perplexity']} ({r['heldout']['tokens']} tokens of standard-library "
           f"files never used for calibration; thresholds from {r['calibration']['tokens']} calibration tokens, local "
           f"MLP errors on the first {r['calibration']['error_tokens']} of them). {r['layers']} gated MLPs, "
           f"{100 * r['mlp_bytes_share']:.1f} % of the {r['weight_reads_bytes'] / 1e9:.2f} GB a step reads. Levels on a "
           f"{r['step']} grid up to {r['max_level']}.", "",
           "| allocation | target | perplexity | increase % [95 % CI, paired by window] | top-1 agreement "
           "| x levels | h levels | achieved x / h (held-out) | weight bytes skipped | perfect-kernel step bound |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for x in r["rows"]:
        lo, hi = x["increase_ci"]
        out.append(f"| {x['allocation']} | {x['target']:.3f} | {x['perplexity']:.3f} | {x['increase_pct']:+.2f} "
                   f"[{lo:+.2f}, {hi:+.2f}] | {x['top1_agreement']:.3f} | {_levels(x['levels_x'])} | "
                   f"{_levels(x['levels_h'])} | {x['achieved_x']:.2f} / {x['achieved_h']:.2f} | "
                   f"{100 * x['skipped_bytes_share']:.1f} % | {x['perfect_kernel_bound']:.3f}x |")
    out.append("")
    b = r["best_within_budget"]
    if b is None:
        out.append(f"No allocation stays within {r['budget_pct']} %.")
    else:
        out.append(f"The most bytes skipped within {r['budget_pct']} %: {b['allocation']} at {b['target']:.3f} "
                   f"({b['increase_pct']:+.2f} %), {100 * b['skipped_bytes_share']:.1f} % of the step's weight bytes, "
                   f"a step bound of {b['perfect_kernel_bound']:.3f}x with a kernel that costs nothing but the rows it "
                   "reads.")
    m = r["machine"]
    out += ["", f"Machine: {m.get('cpu')}, {m.get('cores')} cores, onnxruntime {m.get('onnxruntime')}, {m.get('date')}; "
            f"{r['seconds']} s ({r['error_seconds']} s of local errors)."]
    return "\n".join(out) + "\n"


def _shares(text: str | None, default: Sequence[float], what: str, ap: argparse.ArgumentParser) -> tuple[float, ...]:
    if text is None:
        return tuple(default)
    try:
        vals = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        ap.error(f"{what} {text!r}: give comma-separated numbers, e.g. 0.25,0.3")
    if not all(0.0 <= v < 1.0 for v in vals):
        ap.error(f"{what} {text!r}: every value must be in [0, 1)")
    return vals


def main(argv: list[str] | None = None) -> int:
    ap = study_parser(
        "python -m dyncompile.tools.studies.sparsity_allocation",
        "Held-out perplexity and skippable weight bytes of per-layer sparsity allocations (TEAL's within-block "
        "greedy, and one greedy across layers) against the uniform quantile, on one decoder folder.",
        example="qwen2.5-coder-1.5b", suffix="allocation", heldout_tokens=4096)
    ap.add_argument("--error-tokens", type=int, default=512, help="calibration tokens for the local MLP errors (512)")
    ap.add_argument("--uniform", default=None, help="uniform levels to evaluate beside (default 0.25,0.3)")
    ap.add_argument("--block-shares", default=None, help="within-block targets, share of each MLP's bytes "
                    "(default 0.25,0.3,0.35)")
    ap.add_argument("--model-shares", default=None, help="across-layer targets, share of the step's weight bytes "
                    "(default 0.184,0.22,0.257: what uniform 0.25 / 0.30 / 0.35 skip on Qwen2.5-Coder-1.5B)")
    a = ap.parse_args(argv)
    d = study_dir(ap, a, a.error_tokens)
    uniform = _shares(a.uniform, UNIFORM, "--uniform", ap)
    block = _shares(a.block_shares, BLOCK_SHARES, "--block-shares", ap)
    model = _shares(a.model_shares, MODEL_SHARES, "--model-shares", ap)
    r = run(d, calib_tokens=a.calib_tokens, heldout_tokens=a.heldout_tokens, window=a.window,
            error_tokens=a.error_tokens, uniform=uniform, block_shares=block, model_shares=model, budget=a.budget,
            progress=not a.quiet)
    write_study(a, d, "allocation", r, render_markdown(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
