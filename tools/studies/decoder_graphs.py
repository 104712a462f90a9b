"""Decoder-graph benchmark: the same decoder as different ONNX graphs, greedy target-alone generation, interleaved.

``python -m dyncompile.tools.studies.decoder_graphs --variant unfused=MODEL.onnx --variant fused=PLAN/model.onnx
--variant builder=DIR/model.onnx --prompts code.jsonl`` drives every graph through the runtime's
:class:`~dyncompile.runtime.decode.kv_cache.KVDecoder` (the object the ``generate`` plan step uses; numpy past tensors,
``dyncompile.load``'s session config: threads spin only while a call runs, ``--threads``), one prompt at a time, rotating which graph
goes first, and reports per graph: prefill seconds (all prompts), decode tokens/s (tokens after the first / decode
seconds), tokens/s including prefill, the median per-prompt decode ms/token, and its fidelity against the first
variant: greedy tokens identical (per prompt; first divergence) and the max |logit| difference of the prefill's
last position. Every variant generates exactly ``--max-new-tokens`` tokens (EOS is not a stop here), so each
does the same work.

An onnxruntime-genai model-builder graph (a ``genai_config.json`` beside it; no ``position_ids`` input, symbolic
head dim) is driven by the same KVDecoder with a spec read from that config (``copy`` rollback; one prompt per
cache, so nothing is rolled back here).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from dyncompile.errors import DataError
from dyncompile.runtime.decode.kv_cache import KVDecoder
from dyncompile.tools.bench.common import (
    RENDER_HELP,
    graph_decoder_spec,
    graph_session,
    load_avg,
    machine_info,
    render_requested,
    write_report,
)
from dyncompile.tools.bench.prompt_sets import read_prompts

logger = logging.getLogger(__name__)

__all__ = ["main", "run_bench"]


def _greedy(dec: KVDecoder, ids: list[int], n: int) -> tuple[list[int], float, list[float], np.ndarray]:
    """Greedy tokens, prefill seconds, seconds of each decode step, prefill logits of the last position."""
    dec.reset()
    t0 = time.perf_counter()
    logits = dec.forward(ids)
    prefill = time.perf_counter() - t0
    last = logits[-1].copy()
    out = [int(last.argmax())]
    steps = []
    for _ in range(n - 1):
        t = time.perf_counter()
        out.append(int(dec.forward([out[-1]])[-1].argmax()))
        steps.append(time.perf_counter() - t)
    return out, prefill, steps, last


def _greedy_interleaved(decs: list[KVDecoder], ids: list[int], n: int) -> list[dict[str, Any]]:
    """:func:`_greedy` for several decoders at once, one decode step of each in turn."""
    outs, pre, steps, lasts = [], [], [[] for _ in decs], []
    for dec in decs:
        dec.reset()
        t0 = time.perf_counter()
        last = dec.forward(ids)[-1].copy()
        pre.append(time.perf_counter() - t0)
        lasts.append(last)
        outs.append([int(last.argmax())])
    for _ in range(n - 1):
        for k, dec in enumerate(decs):
            t = time.perf_counter()
            outs[k].append(int(dec.forward([outs[k][-1]])[-1].argmax()))
            steps[k].append(time.perf_counter() - t)
    return [{"tokens": o, "prefill_s": p, "decode_s": sum(st), "step_ms_median": 1000 * statistics.median(st),
             "last_logits": la} for o, p, st, la in zip(outs, pre, steps, lasts)]


#: calls per size and graph in ``--verify-sizes`` (their median is kept)
VERIFY_REPEATS = 3


def _verify_calls(decs: list[KVDecoder], tokens: list[int], sizes: list[int],
                  repeats: int = VERIFY_REPEATS) -> list[dict[int, float]]:
    """Seconds of one call on ``s`` new tokens (the first ``s`` generated tokens, as a verification of ``s - 1``
    drafts is) on top of each decoder's cache, for each ``s`` in ``sizes``: the variants in turn, size by size,
    ``repeats`` times (median); each call is rolled back, so every variant sees the same cache."""
    out: list[dict[int, list[float]]] = [{s_: [] for s_ in sizes} for _ in decs]
    for _ in range(repeats):
        for s_ in sizes:
            for k, dec in enumerate(decs):
                keep = dec.length
                t = time.perf_counter()
                dec.forward(tokens[:s_])
                out[k][s_].append(time.perf_counter() - t)
                dec.truncate(keep)
    return [{s_: statistics.median(v) for s_, v in o.items()} for o in out]


def run_bench(variants: list[tuple[str, Path, str | None]], prompts: list[list[int]], *, max_new_tokens: int,
              threads: int, one_session: bool = False, step_interleaved: bool = False,
              verify_sizes: list[int] | None = None) -> dict[str, Any]:
    """Greedy generation of every prompt with every variant (rotating order); per-variant timings and fidelity.

    Each variant is (name, path, reference name or None for the first variant). Speed is reported robustly for a
    shared machine: per prompt, the median decode step and the prefill time are divided by the first variant's on
    the same prompt (paired), and the medians of those ratios are reported next to the totals. ``one_session``
    holds one ORT session at a time (made again for every prompt: for models whose variants do not fit in memory
    together). ``step_interleaved`` alternates the variants at every decode step (all sessions held): on a
    machine whose load changes by the second this is the only fair comparison of decode speed. ``verify_sizes``
    (with ``step_interleaved``) also times, after each prompt's generation, one call on ``s`` tokens for each size
    (what verifying ``s - 1`` drafts costs), the variants in turn; reported per size as milliseconds, as the cost
    relative to the same variant's one-token call, and paired against the first variant.
    """
    import gc

    def make(j: int) -> KVDecoder:
        name, path, _ = variants[j]
        t0 = time.perf_counter()
        dec = KVDecoder(graph_session(path, threads), graph_decoder_spec(path), role=name)
        logger.info("session %s: %.1f s", name, time.perf_counter() - t0)
        return dec

    decs = [None] * len(variants) if one_session else [make(j) for j in range(len(variants))]
    rec: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in variants}
    load_start = load_avg()
    try:
        from tqdm import tqdm

        it = tqdm(list(enumerate(prompts)), desc="prompts", unit="prompt")
    except ImportError:  # pragma: no cover
        it = list(enumerate(prompts))
    for k, ids in it:
        order = list(range(len(variants)))
        order = order[k % len(order):] + order[: k % len(order)]
        if step_interleaved:
            turn = [decs[j] for j in order]
            runs = _greedy_interleaved(turn, ids, max_new_tokens)
            if verify_sizes:
                calls = _verify_calls(turn, runs[0]["tokens"], sorted({1, *verify_sizes}))
                for r, c in zip(runs, calls):
                    r["verify_s"] = c
            for j, r in zip(order, runs):
                rec[variants[j][0]].append(r)
            continue
        for j in order:
            dec = decs[j] or make(j)
            toks, tp, steps, last = _greedy(dec, ids, max_new_tokens)
            if one_session:
                del dec
                gc.collect()
            rec[variants[j][0]].append({"tokens": toks, "prefill_s": tp, "decode_s": sum(steps),
                                        "step_ms_median": 1000 * statistics.median(steps), "last_logits": last})
    first = rec[variants[0][0]]
    results = []
    for name, path, ref_name in variants:
        ref_name = ref_name or variants[0][0]
        rows, ref = rec[name], rec[ref_name]
        prefill = sum(r["prefill_s"] for r in rows)
        decode = sum(r["decode_s"] for r in rows)
        n_dec = (max_new_tokens - 1) * len(rows)
        same = [r["tokens"] == q["tokens"] for r, q in zip(rows, ref)]
        first_div = [next((i for i, (a, b) in enumerate(zip(r["tokens"], q["tokens"])) if a != b), None)
                     for r, q in zip(rows, ref)]
        results.append({
            "name": name,
            "model": str(path),
            "prefill_s_total": round(prefill, 3),
            "decode_tok_s": round(n_dec / decode, 3),
            "tok_s_incl_prefill": round(max_new_tokens * len(rows) / (prefill + decode), 3),
            "decode_step_ms_median": round(statistics.median(r["step_ms_median"] for r in rows), 2),
            "decode_step_ratio_vs_first_median": round(statistics.median(
                r["step_ms_median"] / f["step_ms_median"] for r, f in zip(rows, first)), 3),
            "prefill_ratio_vs_first_median": round(statistics.median(
                r["prefill_s"] / f["prefill_s"] for r, f in zip(rows, first)), 3),
            "per_prompt": [{"prefill_s": round(r["prefill_s"], 3), "decode_s": round(r["decode_s"], 3),
                            "step_ms_median": round(r["step_ms_median"], 2)} for r in rows],
            "fidelity_reference": ref_name,
            "greedy_identical_prompts": f"{sum(same)}/{len(same)}",
            "first_divergence": [d for d in first_div if d is not None],
            "prefill_last_logit_max_abs_diff": float(max(np.abs(r["last_logits"] - q["last_logits"]).max()
                                                         for r, q in zip(rows, ref))),
        })
        if rows and "verify_s" in rows[0]:
            sizes = sorted(rows[0]["verify_s"])
            results[-1]["verify_calls"] = {str(s_): {
                "ms_median": round(1000 * statistics.median(r["verify_s"][s_] for r in rows), 2),
                "cost_vs_one_token_median": round(statistics.median(r["verify_s"][s_] / r["verify_s"][1] for r in rows), 3),
                "ratio_vs_first_median": round(statistics.median(r["verify_s"][s_] / f["verify_s"][s_]
                                                                 for r, f in zip(rows, first)), 3),
            } for s_ in sizes}
    return {"results": results, "load_avg_start": load_start, "load_avg_end": load_avg()}


def markdown_report(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        f"# {report['title']}",
        "",
        f"{report['prompts']} prompts, greedy, {report['max_new_tokens']} new tokens each (EOS not a stop), "
        f"{report['threads']} intra-op threads, dyncompile.load's session settings; {m['cpu']} ({m['cores']} cores), ORT {m['onnxruntime']}, "
        f"{m['date']}; load average at start {report['load_avg_start']}, end {report['load_avg_end']}.",
        "Decode step = median step time of a prompt; the ratios are per prompt against the first row (paired, so "
        "load drift between prompts cancels), median over prompts: below 1 is faster. Totals (tok/s) include any "
        "stall of the shared machine. Fidelity: greedy tokens and prefill last-position logits against the row named.",
        "",
        "| graph | decode step ms (median) | decode step vs first | prefill vs first | decode tok/s (total) | "
        "prefill s (total) | tok/s incl. prefill | greedy identical | vs | max abs logit diff |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['name']} | {r['decode_step_ms_median']} | {r['decode_step_ratio_vs_first_median']} | "
            f"{r['prefill_ratio_vs_first_median']} | {r['decode_tok_s']} | {r['prefill_s_total']} | "
            f"{r['tok_s_incl_prefill']} | {r['greedy_identical_prompts']} | {r['fidelity_reference']} | "
            f"{r['prefill_last_logit_max_abs_diff']:.2e} |"
        )
    if any("verify_calls" in r for r in report["results"]):
        sizes = list(report["results"][0]["verify_calls"])
        lines += ["", "One call on s new tokens (a verification of s - 1 drafts), after each prompt, the graphs in turn "
                  f"(median over prompts of each prompt's median of {VERIFY_REPEATS}): ms / cost relative to the same graph's one-token "
                  "call / time relative to the first row (paired per prompt; below 1 is faster):", "",
                  "| graph | " + " | ".join(f"s = {x}" for x in sizes) + " |", "|---|" + "---|" * len(sizes)]
        for r in report["results"]:
            v = r.get("verify_calls") or {}
            lines.append(f"| {r['name']} | " + " | ".join(
                f"{v[x]['ms_median']} / {v[x]['cost_vs_one_token_median']}x / {v[x]['ratio_vs_first_median']}x"
                if x in v else "–" for x in sizes) + " |")
    return "\n".join(lines) + "\n"


def render_markdown(report: dict) -> str:
    """The markdown this harness writes beside its JSON report, from the JSON alone (``--render JSON``)."""
    return markdown_report(report)


def _encode(prompts: list[dict[str, Any]], tokenizer: Path, max_prompt_tokens: int) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    out = []
    for p in prompts:
        ids = tok.encode(p["prompt"], add_special_tokens=False).ids
        if not ids:
            raise DataError(f"prompt {p['id']} encodes to no tokens")
        out.append(ids[-max_prompt_tokens:])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m dyncompile.tools.studies.decoder_graphs",
        description="Compare decoder graphs of one model (unfused export, fuse-decoder, onnxruntime-genai builder, "
        "int4 variants): greedy target-alone prefill and decode speed, interleaved, with token identity.",
        epilog="Example: --variant unfused=~/.cache/dyncompile/models/smollm2-135m/model.onnx "
        "--variant fused=plans/smollm2-fused/model.onnx --prompts bench-results/speculative-qwen/code.jsonl",
    )
    ap.add_argument("--variant", action="append", required=True, metavar="NAME=MODEL.onnx[@REF]",
                    help="a graph to run (repeat); fidelity is checked against variant REF (default: the first), "
                    "e.g. fused-int4=plan/model.onnx@int4")
    ap.add_argument("--prompts", required=True, help="JSONL prompts (python -m dyncompile.tools.bench.prompt_sets)")
    ap.add_argument("--tokenizer", required=True, help="tokenizer.json shared by every variant")
    ap.add_argument("--limit", type=int, default=8, help="number of prompts (default 8)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=2048, help="keep the last N prompt tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--one-session", action="store_true",
                    help="hold one ORT session at a time (re-created per prompt): variants that do not fit in memory together")
    ap.add_argument("--step-interleaved", action="store_true",
                    help="alternate the variants at every decode step (fairest on a busy machine; all sessions held)")
    ap.add_argument("--verify-sizes", default="", metavar="S,S,...",
                    help="with --step-interleaved: also time one call on S new tokens per size after each prompt (the "
                    "cost of verifying S - 1 drafts), e.g. 2,5,9,17")
    ap.add_argument("--title", default="decoder graphs")
    ap.add_argument("--out", default="bench-results/decoder-graphs")
    ap.add_argument("--stem", required=True, help="file name stem of the JSON / markdown report")
    ap.add_argument("--render", metavar="JSON", help=RENDER_HELP)
    rendered = render_requested(argv, render_markdown)
    if rendered is not None:
        return rendered
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    variants = []
    for v in args.variant:
        name, sep, rest = v.partition("=")
        path, _, ref = rest.partition("@")
        p = Path(path).expanduser()
        if not sep or not name or not p.is_file():
            raise SystemExit(f"error: --variant {v!r}: expected NAME=PATH[@REF] with an existing .onnx file")
        if ref and ref not in [n for n, _, _ in variants]:
            raise SystemExit(f"error: --variant {v!r}: reference {ref!r} must name an earlier variant")
        variants.append((name, p, ref or None))
    prompts = read_prompts(args.prompts, limit=args.limit)
    ids = _encode(prompts, Path(args.tokenizer).expanduser(), args.max_prompt_tokens)
    report = {"title": args.title, "prompts": len(ids), "prompt_tokens": [len(i) for i in ids],
              "max_new_tokens": args.max_new_tokens, "threads": args.threads, "machine": machine_info()}
    if args.one_session and args.step_interleaved:
        raise SystemExit("error: --one-session and --step-interleaved exclude each other")
    try:
        sizes = [int(x) for x in args.verify_sizes.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"error: --verify-sizes {args.verify_sizes!r}: expected integers, e.g. 2,5,9,17") from None
    if sizes and (not args.step_interleaved or min(sizes) < 1 or max(sizes) > args.max_new_tokens):
        raise SystemExit("error: --verify-sizes needs --step-interleaved and sizes from 1 to --max-new-tokens")
    report["one_session_at_a_time"] = args.one_session
    report["step_interleaved"] = args.step_interleaved
    report.update(run_bench(variants, ids, max_new_tokens=args.max_new_tokens, threads=args.threads,
                            one_session=args.one_session, step_interleaved=args.step_interleaved,
                            verify_sizes=sizes))
    report["markdown"] = markdown_report(report)
    jp, mp = write_report(report, Path(args.out), args.stem)
    print(report["markdown"])
    print(f"wrote {jp} and {mp}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
