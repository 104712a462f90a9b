"""Which part of a hybrid (prompt lookup + EAGLE) drafter should draft each round: an offline replay.

At every position of the target's greedy continuation of each prompt, this records the length of the context's
longest n-gram match (prompt lookup's, up to its ``max_ngram``), how many of prompt lookup's drafts the target
would accept there, and how many of the EAGLE head's (drafted from the target's true features, as in decoding).
It then replays chains under each rule "prompt lookup when the match has at least ``m`` tokens, else the head"
(plus either part alone) and prices them with the plan's own cost model (its measured verification curve and the
head's draft cost per token), so a rule is chosen without a timed run::

    python -m dyncompile.tools.studies.hybrid_policy PLAN --prompts calib-code.jsonl --prompts calib-grounded.jsonl \\
        --out bench-results/eagle3 --name qwen05-hybrid-policy-calib

``PLAN``: a plan compiled with ``eagle-drafter{head=...}`` and ``speculative{hybrid=true}``. Choose the rule on
calibration prompts; the benchmark prompts only check it. The projection ignores per-call overheads and the
adaptive draft length (every round drafts ``--draft`` tokens where the part has them); the timed benchmark is
``dyncompile bench generate``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def _accepted(draft: list[int], truth: list[int]) -> int:
    n = 0
    for d, t in zip(draft, truth):
        if d != t:
            break
        n += 1
    return n


def record_positions(model, prompt_rows: list[dict], max_new_tokens: int, draft: int) -> list[dict]:
    """Per prompt: the target's greedy continuation and, at each position, the match length and each part's accepted
    drafts (at most ``draft``)."""
    from dyncompile.runtime.decode.drafters import HybridDrafter
    from dyncompile.runtime.decode.eagle import EagleDrafter
    from dyncompile.runtime.decode.generate import _generation_handler, prompt_ids_of

    h = _generation_handler(model)
    hyb = getattr(h, "drafter", None)
    if not (isinstance(hyb, HybridDrafter) and isinstance(hyb.other, EagleDrafter)):
        raise SystemExit("hybrid_policy needs a plan compiled with eagle-drafter{head=...} and speculative{hybrid=true}")
    lookup, head = hyb.lookup, hyb.other
    head.stop_below = 0.0
    out = []
    for row in prompt_rows:
        ids = prompt_ids_of(row["prompt"], h.codec, h.gen, chat=bool(row.get("chat", False)))
        cont = list(model.generate(ids, max_new_tokens=max_new_tokens, speculative=False).token_ids)
        full = [*ids, *cont]
        h.target.reset()
        h.target.forward(full, last=1)  # the true features of every position, as verification calls give them
        head.reset(ids)
        head._store(head._features_of(h.target.last_outputs))
        lookup.reset(ids)
        positions = []
        for k in range(len(cont) - 1):
            seq = full[: len(ids) + k + 1]
            truth = cont[k + 1 :]
            pl, _ = lookup.propose(seq, draft, sample=False, temperature=1.0, rng=None, vocab_size=0)
            e3, _, _ = head._chain(seq, draft, False, 1.0, None, 1 << 30)
            head.decoder.truncate(head.true_len)
            positions.append({"match": lookup.match_size(seq), "lookup": len(pl), "lookup_accepted": _accepted(pl, truth),
                              "head_accepted": _accepted(e3, truth)})
        out.append({"id": row.get("id"), "kind": row.get("kind"), "prompt_tokens": len(ids), "new_tokens": len(cont),
                    "positions": positions})
        print(f"{row.get('id')}: {len(ids)} prompt tokens, {len(cont)} new", file=sys.stderr, flush=True)
    return out


def replay(prompts: list[dict], use_lookup, *, use_head: bool, draft: int, verify, head_cost: float) -> dict:
    """Chains under one rule (``use_lookup(position) -> bool``; else the head if ``use_head``, else no draft):
    tokens per target call and the projected cost per token in target steps."""
    cost = tokens = rounds = 0.0
    for p in prompts:
        pos = p["positions"]
        k = 0
        while k < len(pos):
            x = pos[k]
            if use_lookup(x):
                d = min(x["lookup"], draft)
                a, extra = min(x["lookup_accepted"], d), 0.0
            elif use_head:
                d = draft
                a, extra = min(x["head_accepted"], d), head_cost * d
            else:
                d = a = 0
                extra = 0.0
            cost += verify(1 + d) + extra
            tokens += a + 1
            rounds += 1
            k += a + 1
    return {"tokens_per_call": tokens / rounds, "cost_per_token": cost / tokens, "speedup": tokens / cost}


def analyse(prompts: list[dict], *, max_ngram: int, draft: int, verify_table: dict, head_cost: float) -> dict:
    """Per match length: the parts' mean accepted drafts; per rule: the replay's projection."""
    from dyncompile.runtime.rules.cost_model import verify_cost

    table = {int(k): float(v) for k, v in verify_table.items()}

    def verify(s):
        return verify_cost(s, table)

    by_match = []
    for m in range(max_ngram + 1):
        xs = [x for p in prompts for x in p["positions"] if x["match"] == m]
        if xs:
            by_match.append({"match": m, "positions": len(xs),
                             "lookup_accepted": float(np.mean([min(x["lookup_accepted"], draft) for x in xs])),
                             "head_accepted": float(np.mean([min(x["head_accepted"], draft) for x in xs]))})
    kw = dict(draft=draft, verify=verify, head_cost=head_cost)
    rules = [{"rule": "prompt lookup alone", **replay(prompts, lambda x: x["match"] >= 1, use_head=False, **kw)},
             {"rule": "EAGLE head alone", **replay(prompts, lambda x: False, use_head=True, **kw)}]
    for m in range(1, max_ngram + 1):
        rules.append({"rule": f"hybrid, lookup_min_match={m}", "min_match": m,
                      **replay(prompts, lambda x, m=m: x["match"] >= m, use_head=True, **kw)})
    return {"by_match": by_match, "rules": rules}


def render_markdown(report: dict) -> str:
    """The report's tables (re-rendered from the JSON alone)."""
    lines = [f"# Hybrid drafter: which part drafts ({report['plan']})", "",
             f"Prompts: {', '.join(report['prompt_files'])}; {report['max_new_tokens']} new tokens; chains of "
             f"{report['draft']} drafts; cost model: the plan's verification curve {report['verify_cost']} and "
             f"{report['head_cost']} target steps per head draft. Projection, not a timed run.", ""]
    for name, res in report["sets"].items():
        lines += [f"## {name} ({res['positions']} positions)", "",
                  "| longest match (tokens) | positions | prompt lookup accepts | EAGLE head accepts |", "|---|---|---|---|"]
        lines += [f"| {b['match']} | {b['positions']} | {b['lookup_accepted']:.2f} | {b['head_accepted']:.2f} |"
                  for b in res["by_match"]]
        lines += ["", "| rule | tokens / target call | projected cost per token (target steps) | projected speedup |",
                  "|---|---|---|---|"]
        lines += [f"| {r['rule']} | {r['tokens_per_call']:.2f} | {r['cost_per_token']:.3f} | {r['speedup']:.2f}x |"
                  for r in res["rules"]]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("plan", help="a hybrid plan: eagle-drafter{head=...},...,speculative{hybrid=true}")
    p.add_argument("--prompts", action="append", required=True, help="JSONL prompts (repeatable: one set each)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--draft", type=int, default=8, help="drafts per chain (the plan's max_draft)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True)
    p.add_argument("--name", required=True)
    args = p.parse_args(argv)
    import dyncompile
    from dyncompile.tools.bench.common import write_report

    plan = json.loads((Path(args.plan) / "plan.json").read_text())
    step = plan["steps"][0]
    model = dyncompile.load(args.plan, threads=args.threads)
    report = {"plan": Path(args.plan).name, "prompt_files": [Path(f).name for f in args.prompts],
              "max_new_tokens": args.max_new_tokens, "draft": args.draft,
              "verify_cost": step["draft"].get("verify_cost"), "head_cost": step["draft"].get("draft_cost") or 0.0,
              "sets": {}}
    for f in args.prompts:
        rows = [json.loads(x) for x in Path(f).read_text().splitlines() if x.strip()]
        prompts = record_positions(model, rows, args.max_new_tokens, args.draft)
        res = analyse(prompts, max_ngram=int(step["drafter"].get("max_ngram", 3)), draft=args.draft,
                      verify_table=report["verify_cost"] or {}, head_cost=report["head_cost"])
        report["sets"][Path(f).stem] = {"positions": sum(len(q["positions"]) for q in prompts), **res,
                                        "prompts": prompts}
    report["markdown"] = render_markdown(report)
    write_report(report, Path(args.out), args.name)
    print(report["markdown"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
