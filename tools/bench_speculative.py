"""Speculative decoding benchmark: a plan's speculative step against its target alone, same process, interleaved.

``dyncompile bench PLAN --prompts prompts.jsonl`` runs every prompt through the target alone
(``speculative=False``: the same ORT session, plain autoregressive decoding) and through the plan's
speculative step, in alternating order, and reports tokens/s (all new tokens / all generation time, prefill
included, plus the decode-only rate), the speedup, acceptance rate, tokens per target call, accepted drafts
per round, the runtime's own overhead per round, and whether every greedy output was token-identical.
Optionally the PyTorch peers a user would pick instead run in the same rotation (``--torch HF_DIR``:
transformers ``generate``; with ``prompt_lookup_num_tokens`` for prompt-lookup plans, ``assistant_model=``
with ``--torch-assistant HF_DIR``, or ``assistant_early_exit=k`` for split-drafter plans).

``python -m dyncompile.tools.bench_speculative prompts --out DIR`` writes the prompt sets from real text
available offline: ``code.jsonl`` (code completion: a Python standard-library file cut after a function's
signature and docstring) and ``grounded.jsonl`` (a passage or function given in the prompt, then asked to be
repeated, corrected, edited or mined; chat template on).

Prompt files are JSONL with ``prompt`` (or ``text``) and optional ``chat`` (bool), ``kind``, ``id``,
``max_new_tokens``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["build_prompt_sets", "format_generation", "main", "markdown_report", "run_bench"]

BENCH_SESSION_CONFIG = {"session.intra_op.allow_spinning": "0"}


def format_generation(res) -> str:
    """The CLI's view of a :class:`~dyncompile.runtime.generate.GenerationResult`."""
    s = res.stats
    parts = [f"{s.new_tokens} tokens in {s.seconds:.2f} s ({s.tokens_per_s:.1f} tokens/s)",
             f"{s.target_calls} target calls ({s.tokens_per_target_call:.2f} tokens/call)"]
    if s.drafter:
        acc = s.acceptance_rate
        parts.append(f"drafter {s.drafter}: acceptance {acc:.2f}" if acc is not None else f"drafter {s.drafter}: no drafts")
    parts.append(f"stop: {s.stop_reason}")
    text = res.text if res.text is not None else " ".join(map(str, res.token_ids))
    return text + "\n--\n" + ", ".join(parts)


# ------------------------------------------------------------------------------------------- prompt sets

STDLIB = Path(sysconfig.get_paths()["stdlib"])
#: files whose functions become code-completion prompts (calibrate split drafters on *other* files)
CODE_FILES = ("bisect.py", "heapq.py", "textwrap.py", "shlex.py", "fnmatch.py", "colorsys.py", "base64.py",
              "csv.py", "calendar.py", "statistics.py", "difflib.py", "ipaddress.py")
GROUNDED_DOC_FILES = ("json/__init__.py", "argparse.py", "textwrap.py", "string.py", "heapq.py", "csv.py",
                      "shlex.py", "difflib.py", "calendar.py", "fractions.py")


def _functions(src: str) -> list[tuple[int, int, str]]:
    """(start, end of docstring line, name) of top-level/method defs with a docstring."""
    out = []
    for m in re.finditer(r"^( *)def (\w+)\(.*?\):\n(\1    )(\"\"\"|''')", src, re.M | re.S):
        start = m.start()
        q = m.group(4)
        close = src.find(q, m.end())
        if close < 0:
            continue
        line_end = src.find("\n", close) + 1
        if 0 < line_end - start < 1200:
            out.append((start, line_end, m.group(2)))
    return out


def _function_source(src: str, start: int, max_lines: int = 40) -> str | None:
    """The whole def starting at ``start`` (up to the next line indented no deeper), or None if longer."""
    lines = src[start:].split("\n")
    indent = len(lines[0]) - len(lines[0].lstrip())
    out = [lines[0]]
    for line in lines[1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        out.append(line)
        if len(out) > max_lines:
            return None
    text = "\n".join(out).rstrip()
    return "\n".join(line[indent:] for line in text.split("\n"))


def _code_prompts(n: int, context_chars: int = 1500) -> list[dict[str, Any]]:
    rows = []
    for fname in CODE_FILES:
        path = STDLIB / fname
        if not path.is_file():
            continue
        src = path.read_text(encoding="utf-8")
        funcs = [f for f in _functions(src) if f[0] > context_chars]
        if not funcs:
            continue
        start, end, name = funcs[len(funcs) // 2]
        begin = src.rfind("\n", 0, start - context_chars) + 1
        rows.append({"id": f"code:{fname}:{name}", "kind": "code", "chat": False, "prompt": src[begin:end]})
        if len(rows) >= n:
            break
    return rows


def _typos(text: str, rng: np.random.Generator, every: int = 9) -> str:
    words = text.split(" ")
    for i in range(3, len(words), every):
        w = words[i]
        if len(w) > 4 and w.isalpha():
            j = int(rng.integers(1, len(w) - 2))
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2 :]
    return " ".join(words)


def _grounded_prompts(n: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    rows = []
    docs = []
    for fname in GROUNDED_DOC_FILES:
        path = STDLIB / fname
        if not path.is_file():
            continue
        src = path.read_text(encoding="utf-8")
        m = re.search(r'^(?:r?"""|\'\'\')(.*?)(?:"""|\'\'\')', src, re.S | re.M)
        if m and len(m.group(1).strip()) > 300:
            docs.append((fname, m.group(1).strip()[:700]))
    funcs = []
    for fname in CODE_FILES[::-1]:
        path = STDLIB / fname
        if path.is_file():
            src = path.read_text(encoding="utf-8")
            for s, _, name in _functions(src):
                body = _function_source(src, s)
                if body is not None:
                    funcs.append((fname, name, body))
                    break
    tasks = []
    for i, (fname, doc) in enumerate(docs):
        if i % 2 == 0:
            tasks.append((f"repeat:{fname}", f"Repeat the following text exactly.\n\n{doc}"))
        else:
            tasks.append((f"typos:{fname}", "Correct the spelling mistakes in the following text and write out the "
                          f"corrected text in full.\n\n{_typos(doc, rng)}"))
    for i, (fname, name, body) in enumerate(funcs):
        if i % 2 == 0:
            tasks.append((f"hints:{fname}:{name}", "Rewrite the following Python function, adding type hints. Keep "
                          f"everything else exactly the same.\n\n```python\n{body}\n```"))
        else:
            tasks.append((f"rename:{fname}:{name}", f"Rewrite the following Python function, renaming `{name}` to "
                          f"`{name}_v2`. Keep everything else exactly the same.\n\n```python\n{body}\n```"))
    order = [t for pair in zip(tasks[: len(docs)], tasks[len(docs) :]) for t in pair] + tasks[2 * min(len(docs), len(funcs)) :]
    for tid, prompt in order[:n]:
        rows.append({"id": tid, "kind": "grounded", "chat": True, "prompt": prompt})
    return rows


def build_prompt_sets(out_dir: str | Path, n_code: int = 8, n_grounded: int = 8) -> dict[str, Path]:
    """Write ``code.jsonl`` and ``grounded.jsonl`` (and ``all.jsonl``) into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sets = {"code": _code_prompts(n_code), "grounded": _grounded_prompts(n_grounded)}
    sets["all"] = sets["code"] + sets["grounded"]
    paths = {}
    for name, rows in sets.items():
        p = out / f"{name}.jsonl"
        p.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        paths[name] = p
    return paths


def read_prompts(path: str | Path, limit: int | None = None) -> list[dict[str, Any]]:
    from dyncompile.errors import DataError

    p = Path(path)
    if not p.is_file():
        raise DataError(f"prompts file not found: {p} (make one with `python -m dyncompile.tools.bench_speculative prompts`)")
    rows = []
    for lineno, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{p}:{lineno}: not valid JSON ({e.msg})") from None
        text = row.get("prompt", row.get("text")) if isinstance(row, dict) else None
        if not isinstance(text, str) or not text.strip():
            raise DataError(f"{p}:{lineno}: each line needs a non-empty string field 'prompt' (or 'text')")
        rows.append({"id": row.get("id", f"{p.stem}:{lineno}"), "kind": row.get("kind", p.stem),
                     "chat": bool(row.get("chat", False)), "prompt": text, "max_new_tokens": row.get("max_new_tokens")})
        if limit is not None and len(rows) >= limit:
            break
    if not rows:
        raise DataError(f"{p} holds no prompts")
    return rows


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
                 label: str | None = None) -> list[Runner]:
    """Runners of one plan: its target alone, its speculative step (+ IOBinding / copy-rollback variants).

    ``label`` names the runners after another plan (``--also``: the prompt ids come from the benchmarked plan's
    tokenizer, so the plans must share a vocabulary).
    """
    def target(ids, n, **opts):
        r = model.generate(ids, max_new_tokens=n, speculative=False, **opts)
        return Run(r.token_ids, r.stats.seconds, r.stats.to_dict())

    def spec(ids, n, **opts):
        r = model.generate(ids, max_new_tokens=n, **opts)
        return Run(r.token_ids, r.stats.seconds, r.stats.to_dict())

    runners = [Runner("target alone (ORT)", target)]
    if model.plan.steps[0].kind != "generate":
        runners.append(Runner("speculative (ORT)", spec))
    if label:
        runners = [dataclasses.replace(r, name=f"{r.name}: {label}") for r in runners]
        return runners
    if io_binding:  # both sides with the cache bound (on the CUDA EP it then stays in GPU memory)
        runners.append(Runner("target alone (ORT, IOBinding)", lambda ids, n: target(ids, n, io_binding=True)))
        runners.append(Runner("speculative (ORT, IOBinding)", lambda ids, n: spec(ids, n, io_binding=True)))
    if copy_rollback:
        runners.append(Runner("speculative (ORT, copy rollback)", lambda ids, n: spec(ids, n, rollback="copy")))
    return runners


def torch_runners(hf_dir: str, *, plan, threads: int | None, assistant_dir: str | None = None) -> list[Runner]:
    import os

    # OpenMP threads that spin while waiting make PyTorch 5-20x slower on a shared 2-core machine (measured:
    # SmolLM2 decode 720 ms/token vs 43 ms/token); ORT's sessions run with spinning off too.
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

    from dyncompile.runtime.generate import TextCodec, prompt_ids_of

    codec = TextCodec(model.plan.path_of(model.plan.tokenizer["file"])) if model.plan.tokenizer else None
    gen = model.handlers[-1].gen
    encoded = [prompt_ids_of(p["prompt"], codec, gen, chat=p["chat"]) for p in prompts]
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
        overhead = sum(s["overhead_seconds"] for s in stats)
        out["overhead_ms_per_round"] = round(1e3 * overhead / max(1, rounds + len(stats)), 3)
        out["overhead_share"] = round(overhead / secs, 4) if secs else None
    return out


def markdown_report(report: dict[str, Any]) -> str:
    def table(rows):
        lines = ["| runner | tokens/s | speedup | decode tokens/s | acceptance | tokens/target call | accepted drafts/round "
                 "| identical (greedy) | overhead ms/round |", "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            def f(k, fmt="{}", r=r):
                v = r.get(k)
                return "–" if v is None else fmt.format(v)
            lines.append(
                f"| {r['name']} | {f('tokens_per_s', '{:.2f}')} | {f('speedup', '{:.2f}x')} | "
                f"{f('decode_tokens_per_s', '{:.2f}')} | {f('acceptance_rate', '{:.3f}')} | "
                f"{f('tokens_per_target_call', '{:.2f}')} | {f('accepted_drafts_per_round', '{:.2f}')} | "
                f"{r['identical']}/{r['of']} | {f('overhead_ms_per_round', '{:.2f}')} |"
            )
        return "\n".join(lines)

    m = report.get("machine", {})
    out = [f"## {report.get('plan_name', 'plan')}: {report['prompts']} prompts, greedy, {report['max_new_tokens']} new "
           f"tokens, {report.get('provider', 'cpu')}", "",
           f"machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, onnxruntime {m.get('onnxruntime', '?')}, "
           f"{m.get('date', '')}", "", table(report["results"])]
    if len(report.get("by_kind", {})) > 1:
        for kind, rows in report["by_kind"].items():
            out += ["", f"### {kind} prompts", "", table(rows)]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="dyncompile bench",
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
    p.add_argument("--copy-rollback", action="store_true",
                   help="also run the speculative step rolling the KV cache back by copies instead of masks")
    p.add_argument("--also", metavar="PLAN", action="append", default=[],
                   help="also run another plan with the same tokenizer (its target alone and its speculative step), "
                   "e.g. the fp32 plan next to an int4 one; 'identical' then compares with this plan's target")
    p.add_argument("--torch", metavar="HF_DIR", help="also run transformers generate on this PyTorch model")
    p.add_argument("--torch-assistant", metavar="HF_DIR", help="with --torch: assistant_model for transformers")
    p.add_argument("--report-dir", default="bench-results", help="where JSON + markdown go (default: %(default)s)")
    p.add_argument("--name", help="report file stem (default: the plan directory's name)")
    p.add_argument("-q", "--quiet", action="store_true")
    args = p.parse_args(argv)
    import dyncompile
    from dyncompile.errors import DataError
    from dyncompile.io import write_json_atomic
    from dyncompile.tools._bench_common import machine_info

    if args.max_new_tokens <= 0:
        raise DataError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    model = dyncompile.load(args.plan, provider=args.provider, threads=args.threads, session_config=BENCH_SESSION_CONFIG)
    if model.plan.task != "text-generation":
        raise DataError(f"{args.plan} is a {model.plan.task!r} plan; --prompts is for text-generation plans (use --data)")
    prompts = read_prompts(args.prompts, args.limit)
    runners = plan_runners(model, io_binding=args.io_binding, copy_rollback=args.copy_rollback)
    for other in args.also:
        extra = dyncompile.load(other, provider=args.provider, threads=args.threads, session_config=BENCH_SESSION_CONFIG)
        runners += plan_runners(extra, label=Path(other).resolve().name)
    if args.torch:
        runners += torch_runners(args.torch, plan=model.plan, threads=args.threads, assistant_dir=args.torch_assistant)
    report = run_bench(model, prompts, runners, max_new_tokens=args.max_new_tokens, progress=not args.quiet)
    name = args.name or Path(args.plan).resolve().name
    report.update({"plan": str(Path(args.plan).resolve()), "plan_name": name, "prompts_file": str(args.prompts),
                   "provider": model.provider, "machine": machine_info(),
                   "drafter": (model.plan.steps[0].params.get("drafter") or {}).get("name")
                   or (model.plan.steps[0].params.get("drafter") or {}).get("kind")})
    report["markdown"] = markdown_report(report)
    out = Path(args.report_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{name}-{Path(args.prompts).stem}"
    write_json_atomic(out / f"{stem}.json", report)
    (out / f"{stem}.md").write_text(report["markdown"])
    print(report["markdown"])
    print(f"written: {out / (stem + '.json')} {out / (stem + '.md')}")
    return 0


def _prompts_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m dyncompile.tools.bench_speculative prompts",
                                description="Write code.jsonl / grounded.jsonl / all.jsonl prompt sets.")
    p.add_argument("--out", required=True)
    p.add_argument("--code", type=int, default=8)
    p.add_argument("--grounded", type=int, default=8)
    args = p.parse_args(argv)
    for name, path in build_prompt_sets(args.out, args.code, args.grounded).items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    import sys

    argv = sys.argv[1:]
    if argv and argv[0] == "prompts":
        sys.exit(_prompts_main(argv[1:]))
    sys.exit(main(argv))
