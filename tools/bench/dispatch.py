"""``dyncompile bench``: an explicit harness per subcommand, or the harness a plan's kind calls for.

Forms::

    dyncompile bench classify PLAN --data FILE.jsonl        classifier plan vs its original model
    dyncompile bench generate PLAN --prompts FILE.jsonl     text-generation plan: speculative vs target alone
    dyncompile bench peers PLAN --prompts FILE.jsonl        text-generation plan vs onnxruntime-genai / OpenVINO GenAI
    dyncompile bench route ROUTED --data FILE.jsonl         routed plan vs its candidates, random routing, the oracle
    dyncompile bench quality --reference NAME=PLAN ...      decoder plans' perplexity / top-1 / KL vs a reference
    dyncompile bench serve --classify A/ B/ --data FILE     plans behind `dyncompile serve` under load
    dyncompile bench PLAN [ARGS]                            the harness of PLAN's kind, read from its plan.json

Without a subcommand the harness is picked from what the plan *is* (its ``task`` and step kinds in
``plan.json``), never from the flags on the command line.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

from dyncompile.errors import DataError

__all__ = ["HARNESSES", "harness_for_plan", "main"]

#: subcommand -> (module with ``main(argv)``, one line for ``dyncompile bench --help``)
HARNESSES: dict[str, tuple[str, str]] = {
    "classify": ("dyncompile.tools.bench.classify", "a classifier plan against its original model (--data)"),
    "generate": ("dyncompile.tools.bench.generate",
                 "a text-generation plan: speculative decoding against its target alone (--prompts)"),
    "peers": ("dyncompile.tools.bench.peers",
              "a text-generation plan against onnxruntime-genai and OpenVINO GenAI (--prompts, --peers)"),
    "route": ("dyncompile.tools.bench.routed",
              "a routed plan against its candidates alone, random routing and the oracle (--data)"),
    "serve": ("dyncompile.tools.bench.serve",
              "plans behind `dyncompile serve` under a bounded load on loopback (throughput, p50/p99, errors)"),
    "quality": ("dyncompile.tools.bench.quality",
                "decoder plans' perplexity, top-1 agreement and KL against a reference plan"),
}

ROUTED_STEP_KINDS = ("cascade", "route")


def _help() -> str:
    lines = ["usage: dyncompile bench {" + ",".join(HARNESSES) + "} ...", "       dyncompile bench PLAN [ARGS]", "",
             "Measure a compiled plan against its baseline in one process, interleaved: quality next to speed.", "",
             "harnesses (each has --help):"]
    lines += [f"  {name:<10} {text}" for name, (_, text) in HARNESSES.items()]
    lines += ["", "dyncompile bench PLAN [ARGS] (no subcommand) runs the harness of the plan's kind, read from its",
              "plan.json: a routed plan -> route, a text-generation plan -> generate (with --peers: peers),",
              "any other classifier plan -> classify. (A plan folder named like a harness: give it as ./NAME.)", "",
              "Reports (JSON + markdown) go to --report-dir (default: the current directory)."]
    return "\n".join(lines)


def harness_for_plan(path: str | Path) -> str:
    """The subcommand for the plan in ``path``, from its ``plan.json`` (its task and step kinds).

    Raises :class:`DataError` when ``path`` holds no plan, or a plan no harness measures (text-to-image)."""
    from dyncompile.plan import PLAN_FILENAME

    file = Path(path) / PLAN_FILENAME
    if not file.is_file():
        raise DataError(f"{path} is not a plan folder (no {PLAN_FILENAME}); give a plan folder or a harness: "
                        f"dyncompile bench {{{','.join(HARNESSES)}}} ... (see `dyncompile bench --help`)")
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{file}: not readable JSON ({e}); recompile the plan") from None
    if not isinstance(raw, dict):
        raise DataError(f"{file}: not a plan (a JSON object is expected); recompile the plan")
    task = raw.get("task")
    steps = raw.get("steps") if isinstance(raw.get("steps"), list) else []
    if task == "text-to-image":
        raise DataError(
            f"{path} is a text-to-image plan; benchmark it with `python -m dyncompile.tools.studies.stepsaver {path} "
            "--runs RUNS.npz` (step counts) or `python -m dyncompile.tools.studies.diffusion_plans` (plans side by side)")
    if any(isinstance(s, dict) and s.get("kind") in ROUTED_STEP_KINDS for s in steps):
        return "route"
    if task == "text-generation":
        return "generate"
    return "classify"


def main(argv: list[str] | None = None) -> int:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_help())
        return 0 if argv else 2
    if argv[0] in HARNESSES:
        name, rest = argv[0], argv[1:]
    elif argv[0].startswith("-"):
        raise DataError(f"dyncompile bench: give a harness ({', '.join(HARNESSES)}) or a PLAN folder first, "
                        f"got {argv[0]!r}; see `dyncompile bench --help`")
    else:
        name, rest = harness_for_plan(argv[0]), argv
    return importlib.import_module(HARNESSES[name][0]).main(rest)
