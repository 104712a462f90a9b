"""Does a decoder target give a row the same logits whatever the number of rows in the call? (int4 targets)

Speculative decoding verifies ``k`` drafted tokens in one call of the target; greedy output is token-identical to
the target alone only if each row's logits do not depend on how many rows the call holds. For each plan (a decoder
compiled with ``quantize-int4{...}``) and each held-out window: prefill the first ``--prefix`` tokens, then run the
next ``M`` tokens (``M = 1 .. --max-rows``) in one call, and the same ``M`` tokens one call each; the report is, per
``M``, the max and mean absolute logit difference of a row between the two, and how many rows' argmax differ.

    python -m dyncompile.tools.studies.int4_row_invariance --plans fp32=DIR int4-acc4=DIR ... --out DIR --name qwen05
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np


def row_deviation(dec, ids: list[int], prefix: int, max_rows: int) -> list[dict[str, Any]]:
    """Per call size ``M``: the logits of ``ids[prefix : prefix + M]`` in one call against one call per token."""
    dec.reset()
    dec.forward(np.asarray(ids[:prefix], np.int64))
    single = np.stack([np.asarray(dec.forward(np.asarray([t], np.int64)), np.float64)[-1]
                       for t in ids[prefix : prefix + max_rows]])
    out = []
    for m in range(1, max_rows + 1):
        dec.reset()
        dec.forward(np.asarray(ids[:prefix], np.int64))
        multi = np.asarray(dec.forward(np.asarray(ids[prefix : prefix + m], np.int64)), np.float64)
        d = np.abs(multi - single[:m])
        out.append({"rows": m, "max": float(d.max()), "mean": float(d.mean()),
                    "argmax_differs": int((multi.argmax(-1) != single[:m].argmax(-1)).sum())})
    return out


def greedy_identity(dec, prompt: list[int], new_tokens: int, seed: int = 0) -> dict[str, Any]:
    """Greedy decoding three ways from ``prompt``: one-row calls (the target alone today), two-row calls (the token
    and a copy of it, the copy's row and cache slot dropped: every row is computed in a call of >= 2 rows), and
    verification-like calls of 2..8 rows over the two-row output (a speculative target's calls, any acceptance).

    Returns whether the two-row greedy output is token- and logit-identical to the chunked one, and how the
    one-row output compares with it.
    """
    rng = np.random.default_rng(seed)

    def greedy(pad: bool) -> tuple[list[int], np.ndarray]:
        dec.reset()
        last = np.asarray(dec.forward(np.asarray(prompt, np.int64)), np.float64)[-1]
        toks, rows = [], []
        for _ in range(new_tokens):
            t = int(last.argmax())
            toks.append(t)
            rows.append(last)
            n = dec.length
            last = np.asarray(dec.forward(np.asarray([t, t] if pad else [t], np.int64)), np.float64)[0]
            if pad:
                dec.truncate(n + 1)
        return toks, np.stack(rows)

    one, one_rows = greedy(False)
    two, two_rows = greedy(True)
    dec.reset()
    chunked = [np.asarray(dec.forward(np.asarray(prompt, np.int64)), np.float64)[-1]]
    i = 0
    while i < new_tokens - 1:
        k = int(min(rng.integers(2, 9), new_tokens - 1 - i))
        if k < 2:  # a last single token: a two-row call as above
            n = dec.length
            chunked.append(np.asarray(dec.forward(np.asarray([two[i]] * 2, np.int64)), np.float64)[0])
            dec.truncate(n + 1)
            i += 1
            continue
        chunked.extend(np.asarray(dec.forward(np.asarray(two[i : i + k], np.int64)), np.float64))
        i += k
    chunked = np.stack(chunked[:new_tokens])
    div = next((j for j, (a, b) in enumerate(zip(one, two, strict=True)) if a != b), None)
    upto = new_tokens if div is None else div
    return {"tokens": new_tokens,
            "two_row_vs_chunked_max_logit_diff": float(np.abs(two_rows - chunked).max()),
            "two_row_vs_chunked_tokens_equal": bool((chunked.argmax(-1) == np.asarray(two)).all()),
            "one_row_vs_two_row_tokens_equal": one == two,
            "one_row_vs_two_row_first_divergence": div,
            "one_row_vs_chunked_max_logit_diff_before_divergence": float(np.abs(one_rows[:upto] - chunked[:upto]).max())
            if upto else 0.0}


def run(plans: list[tuple[str, Path]], windows: int, window_tokens: int, prefix: int, max_rows: int,
        greedy_prompts: int = 0, new_tokens: int = 32) -> dict[str, Any]:
    import dyncompile
    from dyncompile.tools.bench.common import machine_info
    from dyncompile.tools.bench.quality import _decoder, heldout_windows

    rows, greedy = [], []
    wins = None
    for name, d in plans:
        dec, codec = _decoder(dyncompile.load(d))
        if wins is None:
            wins = heldout_windows(codec, windows, window_tokens)
        per_m: dict[int, list[dict[str, Any]]] = {}
        for w in wins:
            for r in row_deviation(dec, w, prefix, max_rows):
                per_m.setdefault(r["rows"], []).append(r)
        for w in wins[:greedy_prompts]:
            g = greedy_identity(dec, w[:prefix], new_tokens)
            greedy.append({"plan": name, **g})
        for m, rs in sorted(per_m.items()):
            rows.append({"plan": name, "rows": m, "max_abs_logit_diff": max(r["max"] for r in rs),
                         "mean_abs_logit_diff": float(np.mean([r["mean"] for r in rs])),
                         "argmax_differs": sum(r["argmax_differs"] for r in rs), "positions": m * len(rs)})
        del dec
    return {"rows": rows, "greedy": greedy, "windows": windows, "window_tokens": window_tokens, "prefix": prefix,
            "plans": {n: Path(d).name for n, d in plans}, "machine": machine_info()}


def markdown(report: dict[str, Any]) -> str:
    """Per plan and call size: max / mean |logit difference| of a row against its 1-row call, argmax flips."""
    out = [f"Row logits in an M-row call vs one call per row ({report['windows']} held-out windows, prefix "
           f"{report['prefix']} tokens)", "",
           "| plan | M | max abs logit diff | mean abs logit diff | argmax differs / rows |", "|---|---|---|---|---|"]
    for r in report["rows"]:
        out.append(f"| {r['plan']} | {r['rows']} | {r['max_abs_logit_diff']:.2e} | {r['mean_abs_logit_diff']:.2e} | "
                   f"{r['argmax_differs']} / {r['positions']} |")
    if report.get("greedy"):
        out += ["", "Greedy decoding: one-row calls, two-row calls (token + copy, copy dropped), and 2..8-row "
                "verification calls over the two-row output", "",
                "| plan | tokens | two-row = chunked (tokens) | max logit diff two-row vs chunked | one-row = two-row (tokens) "
                "| first divergence | max logit diff one-row vs chunked before it |", "|---|---|---|---|---|---|---|"]
        for g in report["greedy"]:
            out.append(f"| {g['plan']} | {g['tokens']} | {g['two_row_vs_chunked_tokens_equal']} | "
                       f"{g['two_row_vs_chunked_max_logit_diff']:.2e} | {g['one_row_vs_two_row_tokens_equal']} | "
                       f"{g['one_row_vs_two_row_first_divergence']} | "
                       f"{g['one_row_vs_chunked_max_logit_diff_before_divergence']:.2e} |")
    return "\n".join(out) + "\n"


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
    p.add_argument("--plans", nargs="+", required=True, metavar="LABEL=DIR", help="compiled decoder plan directories")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--window-tokens", type=int, default=64)
    p.add_argument("--prefix", type=int, default=48)
    p.add_argument("--max-rows", type=int, default=8)
    p.add_argument("--greedy-prompts", type=int, default=0, help="greedy decoding checks on this many windows")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.prefix + a.max_rows > a.window_tokens:
        p.error("--prefix + --max-rows must be at most --window-tokens")
    plans = [(x.split("=", 1)[0], Path(x.split("=", 1)[1])) for x in a.plans]
    report = run(plans, a.windows, a.window_tokens, a.prefix, a.max_rows, a.greedy_prompts, a.new_tokens)
    report["markdown"] = markdown(report)
    from dyncompile.tools.bench.common import write_report

    jp, mp = write_report(report, Path(a.out), a.name)
    print(report["markdown"])
    print(f"written: {jp} {mp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
