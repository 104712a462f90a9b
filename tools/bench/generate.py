"""Speculative decoding benchmark: a plan's speculative step against its target alone, same process, interleaved.

``dyncompile bench generate PLAN --prompts prompts.jsonl`` (or ``dyncompile bench PLAN ...`` for a text-generation
plan) runs every prompt through the target alone
(``speculative=False``: the same ORT session, plain autoregressive decoding) and through the plan's
speculative step, in alternating order, and reports tokens/s (all new tokens / all generation time, prefill
included, plus the decode-only rate), time to first token (TTFT: the prefill call) and time per output token after
it (TPOT), each as a mean over prompts and as a paired per-prompt ratio to the target alone with a bootstrap
interval, the speedup, acceptance rate, tokens per target call, accepted drafts
per round, the runtime's own overhead per round, and whether every greedy output was token-identical.
Optionally the PyTorch peers a user would pick instead run in the same rotation (``--torch HF_DIR``:
transformers ``generate``; with ``prompt_lookup_num_tokens`` for prompt-lookup plans, ``assistant_model=``
with ``--torch-assistant HF_DIR``, or ``assistant_early_exit=k`` for split-drafter plans).

Prompt files are JSONL with ``prompt`` (or ``text``) and optional ``chat`` (bool), ``kind``, ``id``,
``max_new_tokens``; :mod:`dyncompile.tools.bench.prompt_sets` writes them from real text available offline
(``python -m dyncompile.tools.bench.prompt_sets --out DIR``). ``--peers`` hands the run to the peers harness
(``dyncompile bench peers``); ``python -m dyncompile.tools.bench.generate curve MODEL.onnx --name N`` measures a
decoder's verification cost by tokens per call.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from dyncompile.runtime.decode.generate import prompt_ids_of
from dyncompile.tools.bench.common import RENDER_HELP, machine_info, render_requested
from dyncompile.tools.bench.prompt_sets import read_prompts

logger = logging.getLogger(__name__)

__all__ = ["main", "markdown_report", "plan_runners", "run_bench", "torch_runners", "tree_plot"]


# ------------------------------------------------------------------------------------------- runners


@dataclasses.dataclass
class Run:
    ids: list[int]
    seconds: float
    stats: dict[str, Any] | None = None


@dataclasses.dataclass
class Runner:
    name: str
    fn: Callable[[list[int], int], Run]
    kind: str = "onnx"


def plan_runners(model, *, io_binding: bool = False, copy_rollback: bool = False,
                 label: str | None = None, tree: bool = False, tree_sizes: tuple[int, ...] = (),
                 max_drafts: tuple[int, ...] = (), stop_below: tuple[float, ...] = ()) -> list[Runner]:
    """Runners of one plan: its target alone, its speculative step (+ IOBinding / copy-rollback variants).

    ``label`` names the runners after another plan (``--also``: the prompt ids come from the benchmarked plan's
    tokenizer, so the plans must share a vocabulary). ``tree`` (a plan compiled with ``speculative{tree=true}``):
    the speculative step with chains and with adaptive draft trees; ``tree_sizes``: also fixed trees of that
    many drafted nodes each. ``max_drafts``: also the (chain) speculative step with each of these longest drafts
    (the ``max_draft`` generation option; the adaptive policy still picks each round's length): for tuning the
    plan's ``speculative{max_draft=…}`` on a calibration prompt set. ``stop_below``: also the speculative step with
    each of these drafter-confidence stops (the ``stop_below`` generation option; tune ``speculative{stop_below=…}``
    the same way). Both are chain options, so these runners draft chains also on a plan whose default is a tree.
    A hybrid plan (``speculative{hybrid=true}``) also gets its two parts alone (the ``hybrid`` generation option),
    in the same modes as its own speculative runners; a plan whose drafter has an int8 twin for its calls of many rows
    also runs without it (``drafter_rows=False``).
    """
    def target(ids, n, **opts):
        r = model.generate(ids, max_new_tokens=n, speculative=False, **opts)
        return Run(r.token_ids, r.stats.seconds, r.stats.to_dict())

    def spec(ids, n, **opts):
        r = model.generate(ids, max_new_tokens=n, **opts)
        st = r.stats.to_dict()
        st["rounds_detail"] = list(getattr(model.handlers[-1], "last_rounds", []))
        return Run(r.token_ids, r.stats.seconds, st)

    runners = [Runner("target alone (ORT)", target)]
    if model.plan.steps[0].kind != "generate":
        if tree or tree_sizes:
            runners.append(Runner("speculative chain (ORT)", lambda ids, n, **o: spec(ids, n, tree=False, **o)))
            runners.append(Runner("speculative tree, adaptive (ORT)", lambda ids, n, **o: spec(ids, n, tree=True, **o)))
            for size in tree_sizes:
                runners.append(Runner(f"speculative tree, {size} nodes (ORT)",
                                      lambda ids, n, size=size, **o: spec(ids, n, tree={"adaptive": False,
                                                                                        "max_nodes": size}, **o)))
        else:
            runners.append(Runner("speculative (ORT)", spec))
        for m in max_drafts:  # the runtime cuts the plan's first draft length down to the cap
            runners.append(Runner(f"speculative, max draft {m} (ORT)",
                                  lambda ids, n, m=m, **o: spec(ids, n, max_draft=m, tree=False, **o)))
        for b in stop_below:
            runners.append(Runner(f"speculative, stop below {b:g} (ORT)",
                                  lambda ids, n, b=b, **o: spec(ids, n, stop_below=b, tree=False, **o)))
        if (model.plan.steps[0].params.get("drafter") or {}).get("rows_model"):  # the drafter's int8 twin off too
            runners.append(Runner("speculative, no int8 twin for the drafter's prompt (ORT)",
                                  lambda ids, n, **o: spec(ids, n, drafter_rows=False, **o)))
        if (model.plan.steps[0].params.get("drafter") or {}).get("prompt_lookup"):  # a hybrid: each part alone too
            modes = [(" chain", {"tree": False}), (" tree, adaptive", {"tree": True})] if tree or tree_sizes else [("", {})]
            for part, value in (("drafter alone", False), ("prompt lookup alone", "prompt-lookup")):
                for mode, extra in modes:
                    runners.append(Runner(f"speculative{mode}, {part} (ORT)",
                                          lambda ids, n, v=value, e=extra, **o: spec(ids, n, hybrid=v, **e, **o)))
    if label:
        runners = [dataclasses.replace(r, name=f"{r.name}: {label}") for r in runners]
        return runners
    if io_binding:  # every runner again with the cache bound (on the CUDA EP it then stays in GPU memory)
        runners += [Runner(r.name.replace("(ORT)", "(ORT, IOBinding)"),
                           lambda ids, n, fn=r.fn: fn(ids, n, io_binding=True)) for r in list(runners)]
    if copy_rollback:
        runners.append(Runner("speculative (ORT, copy rollback)", lambda ids, n: spec(ids, n, rollback="copy")))
    return runners


def torch_runners(hf_dir: str, *, plan, threads: int | None, assistant_dir: str | None = None) -> list[Runner]:
    import os

    # OpenMP threads that spin while waiting make PyTorch 5-20x slower on a shared 2-core machine (measured:
    # SmolLM2 decode 720 ms/token vs 43 ms/token); ORT's sessions stop spinning when a call returns.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assistant = AutoModelForCausalLM.from_pretrained(assistant_dir, dtype=torch.float32).eval() if assistant_dir else None
    logger.info("PyTorch models loaded in %.1f s", time.perf_counter() - t0)
    step = plan.steps[0].params
    eos = list((step.get("generation") or {}).get("eos_token_ids") or [])
    drafter = (step.get("drafter") or {})

    def make(extra):
        def fn(ids, n):
            x = torch.tensor([ids])
            kw = {"max_new_tokens": n, "do_sample": False, "attention_mask": torch.ones_like(x),
                  "pad_token_id": eos[0] if eos else None, "eos_token_id": eos or None, **extra}
            with torch.inference_mode():
                t = time.perf_counter()
                out = model.generate(x, **kw)
                dt = time.perf_counter() - t
            return Run(out[0, len(ids):].tolist(), dt)
        return fn

    runners = [Runner("PyTorch generate (greedy)", make({}), "torch")]
    if drafter.get("kind") == "prompt-lookup":
        runners.append(Runner("PyTorch generate(prompt_lookup_num_tokens=10)", make({"prompt_lookup_num_tokens": 10}),
                              "torch"))
    if assistant is not None:
        runners.append(Runner("PyTorch generate(assistant_model=...)", make({"assistant_model": assistant}), "torch"))
    if drafter.get("name") == "split":
        k = (plan.policy.get("split_drafter") or {}).get("layers")
        if k:
            runners.append(Runner(f"PyTorch generate(assistant_early_exit={k})", make({"assistant_early_exit": k}),
                                  "torch"))
    return runners


# ------------------------------------------------------------------------------------------- the benchmark


def run_bench(model, prompts: list[dict[str, Any]], runners: list[Runner], *, max_new_tokens: int = 128,
              progress: bool = True) -> dict[str, Any]:
    """Every prompt through every runner (rotating order); the first runner is the baseline."""
    from tqdm.auto import tqdm

    handler = model.handlers[-1]  # the generate / speculative_generate step: its tokenizer and chat template
    encoded = [prompt_ids_of(p["prompt"], handler.codec, handler.gen, chat=p["chat"]) for p in prompts]
    skipped = {}
    for r in list(runners):  # warm-up: sessions, allocators, torch kernels
        try:
            r.fn(encoded[0][:64], 8)
        except Exception as e:  # noqa: BLE001 - a peer that cannot run here is reported, not fatal
            if r.kind != "torch":
                raise
            logger.warning("skipping %s: %s: %s", r.name, type(e).__name__, e)
            skipped[r.name] = f"{type(e).__name__}: {e}"[:300]
            runners.remove(r)
    results: dict[str, list[Run]] = {r.name: [] for r in runners}
    order = list(range(len(runners)))
    for i in tqdm(range(len(prompts)), desc="prompts", disable=not progress, leave=False):
        n = int(prompts[i].get("max_new_tokens") or max_new_tokens)
        order = order[1:] + order[:1]
        for j in order:
            results[runners[j].name].append(runners[j].fn(encoded[i], n))
    base = runners[0].name
    rows = []
    for r in runners:
        runs = results[r.name]
        rows.append({"name": r.name, "kind": r.kind, **_summary(runs, results[base], prompts, encoded)})
    b = rows[0]
    for r, row in zip(runners, rows):
        row["paired"] = _paired(results[r.name], results[base])
    for row in rows:
        row["speedup"] = round(row["tokens_per_s"] / b["tokens_per_s"], 3)
        row["speedup_decode"] = round(row["decode_tokens_per_s"] / b["decode_tokens_per_s"], 3) if row.get(
            "decode_tokens_per_s") and b.get("decode_tokens_per_s") else None
        row["speedup_median_per_prompt"] = round(float(np.median(
            [rb.seconds / rr.seconds for rb, rr in zip(results[base], results[row["name"]])])), 3)
    per_prompt = []
    for i, p in enumerate(prompts):
        entry = {"id": p["id"], "kind": p["kind"], "prompt_tokens": len(encoded[i])}
        for r in runners:
            run = results[r.name][i]
            entry[r.name] = {"new_tokens": len(run.ids), "seconds": round(run.seconds, 4),
                             "identical": run.ids == results[base][i].ids,
                             **({k: run.stats[k] for k in ("acceptance_rate", "tokens_per_target_call")} if run.stats else {})}
        per_prompt.append(entry)
    by_kind = {}
    for kind in dict.fromkeys(p["kind"] for p in prompts):
        idx = [i for i, p in enumerate(prompts) if p["kind"] == kind]
        sub = []
        for r in runners:
            s = _summary([results[r.name][i] for i in idx], [results[base][i] for i in idx], [prompts[i] for i in idx],
                         [encoded[i] for i in idx])
            sub.append({"name": r.name, **s})
        for row in sub:
            row["speedup"] = round(row["tokens_per_s"] / sub[0]["tokens_per_s"], 3)
        by_kind[kind] = sub
    return {"baseline": base, "max_new_tokens": max_new_tokens, "prompts": len(prompts), "results": rows,
            "by_kind": by_kind, "per_prompt": per_prompt, "skipped": skipped}


def _ttft_tpot(run: Run) -> tuple[float, float] | None:
    """One generation's time to first token (the prefill call and its token) and time per output token after it
    (seconds); None when the runner does not report its prefill (the PyTorch peers)."""
    if not run.stats or run.stats.get("prefill_seconds") is None:
        return None
    pre = float(run.stats["prefill_seconds"])
    return pre, max(run.seconds - pre, 1e-9) / max(len(run.ids) - 1, 1)


def _paired(runs: list[Run], base: list[Run]) -> dict[str, Any]:
    """Per-prompt ratios against the baseline runner, geometric mean with a 95 % bootstrap interval over prompts:
    tokens/s end to end (> 1: faster), TTFT and TPOT as time ratios (< 1: faster)."""
    from dyncompile.tools.bench.common import paired_ratio

    out: dict[str, Any] = {"tokens_per_s": paired_ratio([len(r.ids) / r.seconds for r in runs],
                                                        [len(r.ids) / r.seconds for r in base])}
    tt = [_ttft_tpot(r) for r in runs]
    tb = [_ttft_tpot(r) for r in base]
    if all(x is not None for x in tt + tb):
        out["ttft"] = paired_ratio([x[0] for x in tt], [x[0] for x in tb])
        out["tpot"] = paired_ratio([x[1] for x in tt], [x[1] for x in tb])
    return out


def _summary(runs: list[Run], base: list[Run], prompts, encoded) -> dict[str, Any]:
    new = sum(len(r.ids) for r in runs)
    secs = sum(r.seconds for r in runs)
    out: dict[str, Any] = {
        "new_tokens": new,
        "seconds": round(secs, 3),
        "tokens_per_s": round(new / secs, 3) if secs else None,
        "identical": sum(r.ids == b.ids for r, b in zip(runs, base)),
        "of": len(runs),
    }
    stats = [r.stats for r in runs if r.stats]
    if stats:
        pre = sum(s["prefill_seconds"] for s in stats)
        out["prefill_seconds"] = round(pre, 3)
        out["decode_tokens_per_s"] = round((new - len(runs)) / max(secs - pre, 1e-9), 3)
        tt = [_ttft_tpot(r) for r in runs]
        if all(x is not None for x in tt):  # means over prompts, as serving benchmarks report them
            out["ttft_ms"] = round(1e3 * float(np.mean([x[0] for x in tt])), 2)
            out["tpot_ms"] = round(1e3 * float(np.mean([x[1] for x in tt])), 2)
        drafted = sum(s["drafted"] for s in stats)
        accepted = sum(s["accepted"] for s in stats)
        calls = sum(s["target_calls"] for s in stats)
        rounds = sum(s["rounds"] for s in stats)
        out["target_calls"] = calls
        out["tokens_per_target_call"] = round(new / calls, 3) if calls else None
        if any(s.get("drafter") for s in stats):
            out["acceptance_rate"] = round(accepted / drafted, 4) if drafted else None
            out["accepted_drafts_per_round"] = round(accepted / rounds, 3) if rounds else None
            out["drafter_seconds"] = round(sum(s["drafter_seconds"] for s in stats), 3)
        if any("rounds_detail" in s for s in stats):  # decode rounds: tokens per verification call, tree sizes
            det = [rd for s in stats for rd in s.get("rounds_detail", [])]
            if det:
                out["tokens_per_verify_call"] = round(sum(a + 1 for _, a in det) / len(det), 3)
                out["mean_tree_nodes"] = round(sum(d for d, _ in det) / len(det), 2)
        overhead = sum(s["overhead_seconds"] for s in stats)
        out["overhead_ms_per_round"] = round(1e3 * overhead / max(1, rounds + len(stats)), 3)
        out["overhead_share"] = round(overhead / secs, 4) if secs else None
    return out


def tree_plot(report: dict[str, Any], path: Path) -> None:
    """PNG: tokens per verification call against drafted nodes per call (chain, adaptive and fixed trees), and
    the plan's measured verification cost curve v(s) beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    groups = [("all", report["results"])] + [(k, rows) for k, rows in report.get("by_kind", {}).items()
                                             if len(report.get("by_kind", {})) > 1]
    for kind, rows in groups:
        pts = sorted((r["mean_tree_nodes"], r["tokens_per_verify_call"], r["name"]) for r in rows
                     if r.get("mean_tree_nodes") is not None)
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-" if kind == "all" else ".--", label=kind)
        for x, y, name in pts:
            if kind == "all":
                short = name.replace("speculative ", "").replace(" (ORT)", "")
                ax.annotate(short, (x, y), fontsize=7, xytext=(3, -9), textcoords="offset points")
    ax.set_xlabel("drafted nodes per target call (mean)")
    ax.set_ylabel("tokens per target call (decode rounds)")
    ax.set_title(f"{report.get('plan_name', '')}: tokens/call vs tree size")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    curve = report.get("verify_cost") or {}
    if curve:
        xs = sorted(int(k) for k in curve)
        bx.plot(xs, [curve[str(x)] for x in xs], "s-")
        bx.set_xlabel("tokens in one target call (s)")
        bx.set_ylabel("v(s) = time(s) / time(1)")
        bx.set_title("verification cost (measured at compile time)")
        bx.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown_report(report: dict[str, Any]) -> str:
    def table(rows):
        # (header, key, format); "identical" is the pair identical/of
        cols = [("runner", "name", "{}"), ("tokens/s", "tokens_per_s", "{:.2f}"), ("speedup", "speedup", "{:.2f}x"),
                ("decode tokens/s", "decode_tokens_per_s", "{:.2f}")]
        if any(r.get("tpot_ms") is not None for r in rows):
            cols += [("TTFT ms", "ttft_ms", "{:.1f}"), ("TPOT ms", "tpot_ms", "{:.2f}")]
        if any(r.get("mean_tree_nodes") is not None for r in rows):
            cols += [("drafted nodes/call", "mean_tree_nodes", "{:.1f}"),
                     ("tokens/verify call", "tokens_per_verify_call", "{:.2f}")]
        else:
            cols += [("acceptance", "acceptance_rate", "{:.3f}")]
        cols += [("tokens/target call", "tokens_per_target_call", "{:.2f}"),
                 ("accepted drafts/round", "accepted_drafts_per_round", "{:.2f}"), ("identical (greedy)", None, ""),
                 ("overhead ms/round", "overhead_ms_per_round", "{:.2f}")]
        lines = ["| " + " | ".join(h for h, _, _ in cols) + " |", "|" + "---|" * len(cols)]
        for r in rows:
            cells = [f"{r['identical']}/{r['of']}" if k is None else "–" if r.get(k) is None else fmt.format(r[k])
                     for _, k, fmt in cols]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    m = report.get("machine", {})
    out = [f"## {report.get('plan_name', 'plan')}: {report['prompts']} prompts, greedy, {report['max_new_tokens']} new "
           f"tokens, {report.get('provider', 'cpu')}", "",
           f"machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, onnxruntime {m.get('onnxruntime', '?')}, "
           f"{m.get('date', '')}", "", table(report["results"])]
    paired = [r for r in report["results"][1:] if r.get("paired")]
    if paired:
        out += ["", f"paired by prompt against {report['results'][0]['name']} (geometric mean over prompts, 95 % bootstrap "
                "interval; an interval containing 1.00x leaves the ranking open):", "",
                "| runner | tok/s ratio (> 1: faster) | TTFT time ratio (< 1: faster) | TPOT time ratio (< 1: faster) |",
                "|---|---|---|---|"]
        for r in paired:
            cells = ["–" if r["paired"].get(k) is None else
                     "{ratio:.3f}x ({lo:.3f}–{hi:.3f})".format(**r["paired"][k]) for k in ("tokens_per_s", "ttft", "tpot")]
            out.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    if len(report.get("by_kind", {})) > 1:
        for kind, rows in report["by_kind"].items():
            out += ["", f"### {kind} prompts", "", table(rows)]
    if report.get("verify_cost"):
        vc = report["verify_cost"]
        out += ["", "Verification cost v(s) (target time for s tokens in one call / one token, measured at compile "
                "time on this machine): " + ", ".join(f"v({k}) = {vc[k]:.2f}" for k in sorted(vc, key=int))]
    if report.get("load"):
        out += ["", f"load average (uptime) before / after: {report['load'].get('before')} / {report['load'].get('after')}"]
    return "\n".join(out) + "\n"


def verify_curve_main(argv: list[str] | None = None) -> int:
    """``curve MODEL.onnx``: the target's verification cost v(s) by tokens per call, on its explicit-attention
    form, in memory (nothing written but the report): what sizes a draft tree can afford on this machine."""
    import json

    import onnx_ir as ir

    from dyncompile.io import write_json_atomic
    from dyncompile.passes.speculative import ExposeAttentionMaskPass, decoder_spec
    from dyncompile.passes.speculative.probe import (
        fastest_times,
        measure_step_rounds,
        relative_verify_costs,
        session_for,
    )

    p = argparse.ArgumentParser(prog="dyncompile-bench-speculative curve",
                                description="Verification cost v(s) of a KV-cache decoder with a 4-D attention "
                                "bias (explicit-attention, applied in memory), by tokens per call.")
    p.add_argument("model", help="decoder ONNX file (KV cache)")
    p.add_argument("--sizes", default="1,2,4,9,16,24,32", help="tokens per call (default: %(default)s)")
    p.add_argument("--past", type=int, default=128, help="tokens already in the cache (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None,
                   help="ORT intra-op threads (default: ONNX Runtime's, one per core; the plan's compile-time probe "
                   "uses that too)")
    p.add_argument("--report-dir", default=".", help="where the JSON goes (default: the current directory)")
    p.add_argument("--name", required=True, help="report file stem")
    args = p.parse_args(argv)
    sizes = sorted({1, *(int(x) for x in args.sizes.split(",") if x.strip())})
    model = ir.load(args.model)
    ExposeAttentionMaskPass()(model)
    spec = decoder_spec(model, "model")
    chunk = [int(i) % max(2, spec.get("vocab_size") or 2) for i in range(1, args.past + 1)]
    load_before = os.getloadavg()
    rounds = measure_step_rounds(session_for(model, args.threads), spec, chunk, sizes, args.repeats)
    report = {"model": Path(args.model).name, "past": args.past, "sizes": sizes, "threads": args.threads,
              "seconds_min": {str(k): round(v, 5) for k, v in fastest_times(rounds).items()},
              "verify_cost": {str(k): v for k, v in relative_verify_costs(rounds).items()},
              "machine": machine_info(),
              "load": {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]}}
    out = Path(args.report_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / f"{args.name}.json", report)
    print(json.dumps({k: report[k] for k in ("seconds_min", "verify_cost", "load")}, indent=1))
    return 0


def render_markdown(report: dict) -> str:
    """The markdown this harness writes beside its JSON report, from the JSON alone (``--render JSON``)."""
    return markdown_report(report)


def _positive_ints(text: str, flag: str) -> tuple[int, ...]:
    """``"4,8,16"`` -> ``(4, 8, 16)``; a clean error naming ``flag`` otherwise."""
    from dyncompile.errors import DataError

    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise DataError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if any(x < 1 for x in vals):
        raise DataError(f"{flag} must be >= 1, got {text!r}")
    return vals


def _probabilities(text: str, flag: str) -> tuple[float, ...]:
    """``"0.2,0.4"`` -> ``(0.2, 0.4)``, each in [0, 1]; a clean error naming ``flag`` otherwise."""
    from dyncompile.errors import DataError

    try:
        vals = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise DataError(f"{flag} must be comma-separated probabilities, got {text!r}") from None
    if any(not 0.0 <= x <= 1.0 for x in vals):
        raise DataError(f"{flag} must be probabilities in [0, 1], got {text!r}")
    return vals


def _peers_requested(argv: list[str] | None) -> bool:
    """Whether this harness's own ``--peers`` option is given (it hands the run to the peers harness)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--peers")
    return pre.parse_known_args(argv)[0].peers is not None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="dyncompile bench generate",
        description="Benchmark a text-generation plan: speculative decoding against the plan's target alone, "
        "interleaved in one process (tokens/s, speedup, acceptance, tokens per target call, identical outputs).",
    )
    p.add_argument("plan", help="plan directory (speculative_generate or generate step)")
    p.add_argument("--prompts", required=True, help="JSONL with 'prompt' (+ 'chat', 'kind', 'id')")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, help="use the first N prompts")
    p.add_argument("--provider", default="cpu")
    p.add_argument("--threads", type=int, help="ORT intra-op threads (and torch threads)")
    p.add_argument("--io-binding", action="store_true", help="also run the target alone and the speculative step with ORT IOBinding")
    p.add_argument("--cuda-graph", action="store_true",
                   help="also run the target alone and the speculative step with one-token steps replayed as CUDA graphs "
                   "(the plan loaded again with cuda_graph=True; CUDA EP, a float16 causal-attention plan)")
    p.add_argument("--copy-rollback", action="store_true",
                   help="also run the speculative step rolling the KV cache back by copies instead of masks")
    p.add_argument("--also", metavar="PLAN", action="append", default=[],
                   help="also run another plan with the same tokenizer (its target alone and its speculative step), "
                   "e.g. the fp32 plan next to an int4 one; 'identical' then compares with this plan's target")
    p.add_argument("--tree", action="store_true",
                   help="plans compiled with speculative{tree=true}: run the speculative step with chains and with "
                   "adaptive draft trees (same process, interleaved) and write a PNG of tokens/call vs tree size")
    p.add_argument("--tree-sizes", default="", metavar="N,N,...",
                   help="with --tree: also fixed draft trees of these many drafted nodes (e.g. 4,8,16,32)")
    p.add_argument("--max-drafts", default="", metavar="N,N,...",
                   help="also the speculative step with each of these longest drafts (e.g. 8,16,24,32; tune on "
                   "`prompt_sets --split calib` prompts, then compile with speculative{max_draft=N})")
    p.add_argument("--stop-below", default="", metavar="P,P,...",
                   help="also the speculative step with a model or EAGLE drafter ending each chain after a token it gives "
                   "less than P probability (e.g. 0.2,0.4,0.6; 0 drafts every round's full length); tune on "
                   "calibration prompts, then compile with speculative{stop_below=P}")
    p.add_argument("--torch", metavar="HF_DIR", help="also run transformers generate on this PyTorch model")
    p.add_argument("--torch-assistant", metavar="HF_DIR", help="with --torch: assistant_model for transformers")
    p.add_argument("--report-dir", default=".", help="where JSON + markdown go (default: the current directory)")
    p.add_argument("--name", help="report file stem (default: the plan directory's name)")
    p.add_argument("--peers", metavar="NAMES",
                   help="measure against peer runtimes instead: the `dyncompile bench peers` harness runs with these "
                   "arguments (its options apply; `dyncompile bench peers --help` lists them)")
    p.add_argument("-q", "--quiet", action="store_true")
    p.add_argument("--render", metavar="JSON", help=RENDER_HELP)
    rendered = render_requested(argv, render_markdown)
    if rendered is not None:
        return rendered
    if _peers_requested(argv):
        from dyncompile.tools.bench.peers import main as peers_main

        return peers_main(argv)
    args = p.parse_args(argv)
    import dyncompile
    from dyncompile.errors import DataError
    from dyncompile.io import write_json_atomic

    if args.max_new_tokens <= 0:
        raise DataError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    model = dyncompile.load(args.plan, provider=args.provider, threads=args.threads)
    if model.plan.task != "text-generation":
        raise DataError(f"{args.plan} is a {model.plan.task!r} plan; --prompts is for text-generation plans (use --data)")
    prompts = read_prompts(args.prompts, args.limit)
    sizes = _positive_ints(args.tree_sizes, "--tree-sizes")
    max_drafts = _positive_ints(args.max_drafts, "--max-drafts")
    stops = _probabilities(args.stop_below, "--stop-below")
    draft = (model.plan.steps[0].params.get("draft") or {})
    if (args.tree or sizes) and not draft.get("tree"):
        raise DataError(f"{args.plan} was not compiled for draft trees: compile with "
                        "--passes explicit-attention,speculative{tree=true} to use --tree")
    load_before = os.getloadavg()
    runners = plan_runners(model, io_binding=args.io_binding, copy_rollback=args.copy_rollback, tree=args.tree,
                           tree_sizes=sizes, max_drafts=max_drafts, stop_below=stops)
    if args.cuda_graph:
        graphed = dyncompile.load(args.plan, provider=args.provider, threads=args.threads, cuda_graph=True)
        runners += [dataclasses.replace(r, name=r.name.replace("(ORT)", "(ORT, CUDA graph)")) for r in plan_runners(graphed)]
    for other in args.also:
        extra = dyncompile.load(other, provider=args.provider, threads=args.threads)
        runners += plan_runners(extra, label=Path(other).resolve().name)
    if args.torch:
        runners += torch_runners(args.torch, plan=model.plan, threads=args.threads, assistant_dir=args.torch_assistant)
    report = run_bench(model, prompts, runners, max_new_tokens=args.max_new_tokens, progress=not args.quiet)
    name = args.name or Path(args.plan).resolve().name
    report.update({"plan": str(Path(args.plan).resolve()), "plan_name": name, "prompts_file": str(args.prompts),
                   "provider": model.provider, "machine": machine_info(),
                   "drafter": (model.plan.steps[0].params.get("drafter") or {}).get("name")
                   or (model.plan.steps[0].params.get("drafter") or {}).get("kind"),
                   "verify_cost": draft.get("verify_cost"), "tree_policy": draft.get("tree"),
                   "load": {"before": [round(x, 2) for x in load_before],
                            "after": [round(x, 2) for x in os.getloadavg()]}})
    report["markdown"] = markdown_report(report)
    out = Path(args.report_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{name}-{Path(args.prompts).stem}"
    write_json_atomic(out / f"{stem}.json", report)
    (out / f"{stem}.md").write_text(report["markdown"])
    written = [out / f"{stem}.json", out / f"{stem}.md"]
    if args.tree or sizes:
        tree_plot(report, out / f"{stem}.png")
        written.append(out / f"{stem}.png")
    print(report["markdown"])
    print("written: " + " ".join(map(str, written)))
    return 0


if __name__ == "__main__":
    import sys

    argv = sys.argv[1:]
    if argv and argv[0] == "curve":
        sys.exit(verify_curve_main(argv[1:]))
    sys.exit(main(argv))
