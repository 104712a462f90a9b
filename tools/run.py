"""``dyncompile run PLAN``: run a compiled plan (classifier, sentence embedder, decoder, routed or text-to-image)."""

from __future__ import annotations

import argparse
import json

from dyncompile.errors import DataError
from dyncompile.plan import EMBEDDING_TASKS
from dyncompile.tools._text import safe_text

__all__ = ["format_generation", "run_command"]


def format_generation(res) -> str:
    """The CLI's view of a :class:`~dyncompile.runtime.decode.generate.GenerationResult`."""
    s = res.stats
    parts = [f"{s.new_tokens} tokens in {s.seconds:.2f} s ({s.tokens_per_s:.1f} tokens/s)",
             f"{s.target_calls} target calls ({s.tokens_per_target_call:.2f} tokens/call)"]
    if s.drafter:
        acc = s.acceptance_rate
        parts.append(f"drafter {s.drafter}: acceptance {acc:.2f}" if acc is not None else f"drafter {s.drafter}: no drafts")
    parts.append(f"stop: {s.stop_reason}")
    text = res.text if res.text is not None else " ".join(map(str, res.token_ids))
    return text + "\n--\n" + ", ".join(parts)


def _print_embeddings(model, args: argparse.Namespace) -> int:
    """``run --text`` on a sentence-embedding plan: each vector's dimensions, norm and first values (--json: all)."""
    vecs = model.encode(args.text, batch_size=args.batch_size or 32)
    if args.json:
        print(json.dumps([{"text": t, "embedding": v.tolist()} for t, v in zip(args.text, vecs)]))
        return 0
    for text, v in zip(args.text, vecs):
        head = " ".join(f"{x:+.4f}" for x in v[:4])
        print(f"dims={v.shape[0]} norm={float((v.astype('float64') ** 2).sum() ** 0.5):.4f} [{head} ...]  | "
              f"{safe_text(text, keep_newlines=False)}")
    return 0


def run_command(args: argparse.Namespace) -> int:
    for flag, value in (("--batch-size", args.batch_size), ("--limit", args.limit)):
        if value is not None and value < 1:
            raise DataError(f"{flag} must be >= 1, got {value}")
    import dyncompile

    model = dyncompile.load(args.plan, provider=args.provider, fallback=args.fallback, spinning=not args.no_spinning,
                            cuda_graph=args.cuda_graph, memory=args.memory)
    if model.plan.task == "text-to-image":
        from dyncompile.tools.diffusion_cli import run_text_to_image

        return run_text_to_image(model, args)
    if args.prompt is not None:
        res = model.generate(args.prompt, max_new_tokens=args.max_new_tokens, sample=args.sample,
                             temperature=args.temperature, seed=args.seed, chat=args.chat,
                             speculative=not args.target_only)
        if "candidate" in model.last_info:
            print(f"(answered by {safe_text(model.last_info.get('candidate'))}; checks {model.last_info.get('checks')})")
        print(json.dumps({"text": res.text, "token_ids": res.token_ids, "stats": res.stats.to_dict()}, indent=2)
              if args.json else safe_text(format_generation(res)))
        return 0
    if args.text and model.plan.task in EMBEDDING_TASKS:
        return _print_embeddings(model, args)
    if args.text:
        preds = model(args.text, batch_size=args.batch_size)
        if args.json:
            print(json.dumps([p.__dict__ for p in preds], indent=2))
        for text, pred in zip(args.text, preds):
            probs = "  ".join(f"{safe_text(k)}={v:.4f}" for k, v in pred.probabilities.items())
            ex = f"  (exit after layer {pred.exit_layer})" if pred.exit_layer is not None else ""
            ex += f"  (answered by {safe_text(pred.candidate)})" if pred.candidate is not None else ""
            print(f"{safe_text(pred.label):<10} {probs}{ex}  | {safe_text(text, keep_newlines=False)}")
        return 0
    if not args.data:
        raise DataError("give --text TEXT or --data FILE.jsonl (classifiers) or --prompt TEXT (decoders); see `dyncompile run --help`")
    from dyncompile.tools.evaluate import evaluate_plan

    report = evaluate_plan(model, args.data, limit=args.limit, batch_size=args.batch_size, compare=args.compare)
    print(json.dumps(report, indent=2) if args.json else safe_text(report["text"]))
    return 0
