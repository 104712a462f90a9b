"""The ``dyncompile`` command line.

Forms::

    dyncompile MODEL.onnx --passes verify,cleanup -o OUT/    compile (the main form)
    dyncompile inspect MODEL.onnx | PLAN_DIR                   structure report
    dyncompile run PLAN_DIR --text "..." | --data FILE.jsonl   run a plan
    dyncompile bench classify|generate|peers|route|quality ... one benchmark harness (each has --help)
    dyncompile bench PLAN_DIR [ARGS]                           the harness of the plan's kind (from plan.json)
    dyncompile export HF_DIR -o FOLDER                         a Hugging Face folder -> Optimum-style ONNX folder
    dyncompile export-genai PLAN_DIR -o FOLDER                 a generation plan as an onnxruntime-genai folder
    dyncompile export-eagle3 HEAD --target M -o FOLDER         an EAGLE-3 head as the reference checkpoint
    dyncompile route --candidates A/ B/ --calib F -o R/        a cascade / router over plans
    dyncompile serve PLAN_DIR...                               serve plans over HTTP (Ray Serve, OpenAI-compatible)
    dyncompile models list | build NAME                        real models -> ONNX (offline)
    dyncompile passes                                          list the passes

User mistakes print one ``error: ...`` line (what, where, how to fix) and exit 2; no traceback.

This module is the parsers and the dispatch only; each command's body lives in its own module
(:mod:`~dyncompile.tools.compile_cmd`, :mod:`~dyncompile.tools.run`, :mod:`~dyncompile.tools.inspect_report`,
:mod:`~dyncompile.tools.route_cmd`, :mod:`~dyncompile.tools.models_cmd`, :mod:`~dyncompile.tools.bench.dispatch`, ...).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from dyncompile.errors import DyncompileError
from dyncompile.runtime.providers import MEMORY_MODES
from dyncompile.tools._text import safe_text

logger = logging.getLogger("dyncompile")

EPILOG = """\
examples:
  dyncompile models build minilm-l6-sentiment
  dyncompile ~/.cache/dyncompile/models/minilm-l6-sentiment/model.onnx --passes verify,cleanup -o out/
  dyncompile run out/ --text "A gorgeous, witty movie."
  dyncompile run out/ --data ../shared/data/sentiment/movie-test.jsonl --compare
  dyncompile inspect out/
  dyncompile MODEL.onnx --passes early-exit --calib ../shared/data/sentiment/movie-calib.jsonl --budget 1.0 -o ee/

  dyncompile route --candidates minilm/ mpnet/ --calib movie-calib.jsonl --budget 1.0 -o routed/

other commands (each has --help): inspect, run, serve, bench, route, export, export-genai, export-eagle3, models,
  passes, train-drafter
Python API: dyncompile.compile(model, passes, output_dir), dyncompile.load(plan_dir, provider="cpu")
"""


def _compile_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dyncompile",
        description="Compile an ONNX model with a pass pipeline into a plan directory (plan.json + ONNX files) "
        "that `dyncompile run` / dyncompile.load() execute on ONNX Runtime.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", help="input ONNX model, or a Hugging Face / Optimum model folder holding one (never modified)")
    p.add_argument(
        "--passes",
        default="verify,cleanup",
        help="comma-separated pipeline, e.g. 'verify,cleanup' or 'early-exit{lowering=staged}' "
        "(default: %(default)s; `dyncompile passes` lists them)",
    )
    p.add_argument("-o", "--output", help="plan directory to create (default: MODEL_DIR/MODEL-compiled)")
    p.add_argument("-O", "--opt-level", type=int, choices=[0, 1, 2], default=2,
                   help="0: exactly --passes; 1, 2 (default): also the lowering passes that pay on --provider "
                   "(`dyncompile passes` lists them)")
    p.add_argument("--force", action="store_true", help="replace the output directory if it exists")
    p.add_argument("--verify", action="store_true", help="run the ONNX checker (full check) after every pass")
    p.add_argument("--dump-ir", metavar="DIR", help="write the IR after each pass as DIR/NNN_PassName.onnx.txt")
    p.add_argument("--tokenizer", help="tokenizer.json to bundle (default: the one beside the model)")
    p.add_argument("--model-config", help="dyncompile-model.json (default: the one beside the model)")
    ee = p.add_argument_group("early exit (--passes early-exit)")
    ee.add_argument("--calib", help="calibration data: JSONL with a 'text' field (and 'label' if known)")
    ee.add_argument("--budget", type=float, help="max accuracy drop in points on the calibration data (default 1.0)")
    ee.add_argument("--exits", help="layers to place exits after, e.g. 2,4,6 (default: every layer)")
    ee.add_argument("--criterion", choices=["entropy", "maxprob", "patience", "learned"],
                    help="exit criterion (default entropy; learned: a fitted per-exit policy on the heads' probabilities)")
    ee.add_argument("--confidence", help="probability that the budget holds on new data, e.g. 0.9 (default), "
                    "or 'none': uncertified, the budget is kept on the calibration rows only")
    ee.add_argument("--lowering", choices=["if", "staged", "auto"], help="If-graph or staged plan (default auto)")
    ee.add_argument("--batch-sizes", help="batch sizes the plan will serve, e.g. 1,32: --lowering auto picks staged "
                    "when one is > 1")
    ee.add_argument("--never-exit", action="store_true", help="thresholds that never fire (fidelity check)")
    ee.add_argument("--heads", choices=["fitted", "trained", "given"],
                    help="fitted (default): fit linear exit heads; trained: attention-pooling + MLP heads distilled "
                    "from the full model (needs PyTorch); given: use per-layer logits the graph already outputs")
    ee.add_argument("--train-text", metavar="FILE",
                    help="with --heads trained: more text (JSONL 'text'; labels ignored) for the heads to distil "
                    "on; calibration and the certificate still use --calib alone. Thousands of rows make better "
                    "heads (MPNet: exits that agree more, certified exits that fire earlier)")
    ee.add_argument("--metric", choices=["accuracy", "agreement"],
                    help="what --budget bounds: accuracy drop (default; uses the labels) or disagreement with the "
                    "full model (no labels needed; also bounds the accuracy drop)")
    p.add_argument(
        "--provider",
        help="execution provider the plan is for (cpu, openvino, cuda, directml): --lowering auto and quantize-int8{format=auto} pick per provider",
    )
    sd = p.add_argument_group("speculative decoding (--passes speculative, split-drafter,speculative)")
    sd.add_argument("--drafter", help="DRAFT.onnx (a decoder with the target's tokenizer), prompt-lookup or lookahead; "
                    "split-drafter,speculative builds one from the target (--calib TEXT)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.add_argument("-v", "--verbose", action="count", default=0, help="-v: per-pass timing; -vv: debug")
    return p


def _setup_logging(verbose: int) -> None:
    level = logging.WARNING if verbose <= 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


def _passes_parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog="dyncompile passes", description="List the registered passes.")


def _inspect_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dyncompile inspect",
        description="Structure report of an ONNX model (inputs/outputs, op histogram, family, layers, cut tensors, "
        "parameters) or of a plan directory (files, steps, policy).",
    )
    p.add_argument("path", help="MODEL.onnx, a model folder holding one, or a plan directory")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--verify",
        action="store_true",
        help="check every file of the plan against its sha256 and print one digest of the whole plan (plan.json "
        "+ every file, canonical order) to compare with the digest its publisher gives",
    )
    p.add_argument("-v", "--verbose", action="count", default=0)
    return p


def _run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dyncompile run",
        description="Run a compiled plan. Classifiers: --text prints label + probabilities; --data FILE.jsonl "
        "prints accuracy (and with --compare the max probability difference to the original model).",
    )
    p.add_argument("plan", help="plan directory (from `dyncompile MODEL.onnx -o DIR`)")
    p.add_argument("--text", action="append", help="input text (repeatable)")
    p.add_argument("--data", help="JSONL file with 'text' (and 'label') fields")
    p.add_argument("--limit", type=int, help="use only the first N rows of --data")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--provider", default="cpu", help="cpu | openvino | cuda | directml (default: cpu)")
    p.add_argument("--fallback", help="provider to use, with a warning, if --provider is not available")
    p.add_argument("--no-spinning", action="store_true",
                   help="ORT's intra-op threads wait without spinning between work items: for a machine whose cores "
                   "other busy processes share (spinning, the default, decodes ~5-10 %% faster on cores the process "
                   "has to itself and 10-15 %% slower on oversubscribed ones)")
    p.add_argument("--memory", choices=tuple(MEMORY_MODES), default="auto",
                   help="how ONNX Runtime allocates tensors: auto (default: no memory arena and no memory pattern for a "
                   "classifier plan whose exits are If nodes, the batch-1 form, 1.01-1.05x a row; ORT's defaults "
                   "otherwise; several-row calls of such a plan run in an extra session with ORT's defaults), arena (ORT's "
                   "defaults, one session), malloc (both off)")
    p.add_argument("--compare", action="store_true", help="also run the original model and compare probabilities")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    g = p.add_argument_group("text generation (decoder plans)")
    g.add_argument("--prompt", help="text to continue")
    g.add_argument("--max-new-tokens", type=int, default=128, help="stop after N new tokens (default %(default)s)")
    g.add_argument("--sample", action="store_true", help="sample (exact speculative sampling) instead of greedy")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default %(default)s)")
    g.add_argument("--seed", type=int, help="sampling seed")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--target-only", action="store_true", help="run the plan's target alone (no drafter)")
    g.add_argument("--cuda-graph", action="store_true",
                   help="CUDA EP: replay one-token decode steps as a CUDA graph (a float16 causal-attention plan "
                   "without trim-logits; otherwise it runs without and says why with -v)")
    d = p.add_argument_group("text to image (diffusion plans: --prompt TEXT --seed N -o OUT.png)")
    d.add_argument("-o", "--output", help="PNG to write (several prompts: OUT-0.png, OUT-1.png, ...)")
    d.add_argument("--force", action="store_true", help="replace existing PNG files (-o); without it they are refused")
    d.add_argument("--steps", type=int, help="fixed number of denoising steps (default: the plan's step policy)")
    d.add_argument("--guidance", type=float, help="classifier-free guidance scale, >= 1 (default: the plan's)")
    d.add_argument("--policy", choices=["fixed", "predicted", "online"], help="step policy (default: the plan's)")
    d.add_argument("--cache-interval", type=int, help="cache-unet plans: refresh the deep features every N steps "
                   "(1 = caching off; default: the plan's calibrated schedule)")
    p.add_argument("-v", "--verbose", action="count", default=0)
    return p


ROUTE_EPILOG = """\
rules:
  confidence  cascade: run the cheapest candidate; keep its answer when its confidence (--criterion entropy or
              maxprob) passes the calibrated threshold, else go on to the next (zero router overhead)
  learned     route: a small ONNX router (bag of the first candidate's token embeddings + a logistic head,
              fitted on calib) reads the text before any candidate runs and picks one
  check       cascade: keep a candidate's answer when the executable check --check NAME passes on it
              (decoders: --judge NAME decides which answers are right, to measure quality)

The budget is points of accuracy lost against --reference (default: the last candidate), certified at
--confidence (Learn-then-Test, the early-exit certifier); without labels, points of disagreement.

examples:
  dyncompile route --candidates minilm/ mpnet/ --calib movie-calib.jsonl --budget 1.0 -o routed/
  dyncompile route --candidates minilm/ mpnet-ee/ --reference mpnet/ --calib movie-calib.jsonl -o routed-ee/
  dyncompile route --candidates minilm/ mpnet/ --rule learned --calib movie-calib.jsonl -o router/
  dyncompile inspect routed/            candidates, measured costs, rule, certificate
  dyncompile run routed/ --text "..."   the answer and the candidate that gave it
  dyncompile bench routed/ --data movie-test.jsonl
"""


def _route_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dyncompile route",
        description="Compile a routed plan over candidate plans (cheapest first): a cascade that escalates when the "
        "cheaper model is unsure, or a learned router that picks a model before any runs. Measures each "
        "candidate's cost on --provider, calibrates the rule on --calib to a certified --budget, and writes "
        "a self-contained plan folder (candidates inside, hash-checked).",
        epilog=ROUTE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--candidates", nargs="+", required=True, metavar="PLAN_DIR",
                   help="plan folders, cheapest first (plain, early-exit, quantized, decoder plans)")
    p.add_argument("--calib", required=True, help="JSONL: 'text' (+ 'label') per row; decoders: 'prompt' + the check's fields")
    p.add_argument("-o", "--output", required=True, help="routed plan folder to create")
    p.add_argument("--budget", type=float, default=1.0, help="points of accuracy (or agreement) to give up (default 1.0)")
    p.add_argument("--confidence", help="probability the budget holds on new data (default 0.9), or 'none'")
    p.add_argument("--rule", choices=["confidence", "learned", "check"], default="confidence",
                   help="decision rule (default: confidence)")
    p.add_argument("--criterion", choices=["entropy", "maxprob"], default="entropy", help="confidence rule's measure")
    p.add_argument("--check", help="check rule: name of a registered executable check (e.g. python-doctest)")
    p.add_argument("--judge", help="check rule on decoders: registered check that says whether an answer is right")
    p.add_argument("--reference", help="plan folder the budget is measured against (default: the last candidate)")
    p.add_argument("--metric", choices=["accuracy", "agreement"], help="default: accuracy when every row has a label")
    p.add_argument("--limit", type=int, help="use only the first N calibration rows")
    p.add_argument("--cost-rows", type=int, default=40, help="rows to time each candidate on, batch 1 (default 40)")
    p.add_argument("--provider", default="cpu", help="execution provider to measure costs on (default cpu)")
    p.add_argument("--force", action="store_true", help="replace the output folder if it is a plan")
    p.add_argument("--link", action="store_true",
                   help="hard-link the candidates' model weights instead of copying them (saves disk; the plans then "
                   "share those files, so an edit of one changes the other)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.add_argument("-v", "--verbose", action="count", default=0)
    return p


def _export_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dyncompile export",
        description="Export a Hugging Face model folder (config.json, weights, tokenizer files) to ONNX in the "
        "folder layout optimum-cli export onnx writes (model.onnx + config/tokenizer files; decoders with a KV "
        "cache), checked against PyTorch in ONNX Runtime. Exporters: Optimum's (optimum-onnx, in its own "
        "environment: make setup-optimum) or the built-in torch.onnx one (the export extra).",
    )
    p.add_argument("hf_dir", help="Hugging Face model folder (save_pretrained output); never modified")
    p.add_argument("-o", "--out", required=True, help="new output folder (must not exist)")
    p.add_argument("--exporter", choices=("auto", "optimum", "torch"), default="auto",
                   help="optimum: python -m optimum.exporters.onnx in the Optimum environment; torch: the built-in "
                   "torch.onnx exporter; auto (default): optimum when its environment is found, else torch")
    p.add_argument("--optimum-python", metavar="PATH",
                   help="python of the Optimum environment (default: $DYNCOMPILE_OPTIMUM_PYTHON, else .venv-optimum "
                   "beside the checkout, else this python if it has optimum.exporters.onnx)")
    p.add_argument("-v", "--verbose", action="count", default=0)
    return p


def _models_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dyncompile models",
        description="Build real models into ONNX, offline, from packages and ../shared/assets "
        "(cache: $DYNCOMPILE_HOME, default ~/.cache/dyncompile).",
    )
    sub = p.add_subparsers(dest="action")
    sub.add_parser("list", help="list the recipes and which are built (the default action)")
    b = sub.add_parser("build", help="build a model (idempotent)")
    b.add_argument("name")
    b.add_argument("--force", action="store_true", help="rebuild even if present")
    b.add_argument("--assets", help="folder with the fine-tuned assets (default ../shared/assets; env DYNCOMPILE_ASSETS)")
    b.add_argument("--home", help="cache directory (default $DYNCOMPILE_HOME or ~/.cache/dyncompile)")
    b.add_argument("-q", "--quiet", action="store_true")
    p.add_argument("-v", "--verbose", action="count", default=0)
    return p


def _parsed(parser: Callable[[], argparse.ArgumentParser], command: Callable[[argparse.Namespace], int]):
    """A command that parses its arguments with ``parser``, sets up logging (``-v``) and runs ``command``."""

    def run(argv: list[str]) -> int:
        args = parser().parse_args(argv)
        if hasattr(args, "verbose"):
            _setup_logging(args.verbose)
        return command(args)

    return run


def _compile(args: argparse.Namespace) -> int:
    from dyncompile.tools.compile_cmd import compile_command

    return compile_command(args)


def _passes(args: argparse.Namespace) -> int:
    from dyncompile.tools.compile_cmd import passes_command

    return passes_command(args)


def _inspect(args: argparse.Namespace) -> int:
    from dyncompile.tools.inspect_report import inspect_command

    return inspect_command(args)


def _run(args: argparse.Namespace) -> int:
    from dyncompile.tools.run import run_command

    return run_command(args)


def _route(args: argparse.Namespace) -> int:
    from dyncompile.tools.route_cmd import route_command

    return route_command(args)


def _models(args: argparse.Namespace) -> int:
    from dyncompile.tools.models_cmd import models_command

    return models_command(args)


def _bench(argv: list[str]) -> int:
    from dyncompile.tools.bench.dispatch import main as bench_main

    return bench_main(argv)


def _train_drafter(argv: list[str]) -> int:
    _setup_logging(0)
    from dyncompile.tools.train_drafter import main as train_main  # torch is imported there, when it runs

    return train_main(argv)


def _export(args: argparse.Namespace) -> int:
    from dyncompile.tools.export_cmd import export_command

    return export_command(args)


def _serve(argv: list[str]) -> int:
    from dyncompile.tools.serve.command import parser, serve_command

    args = parser().parse_args(argv)
    _setup_logging(args.verbose)
    return serve_command(args)


def _export_genai(argv: list[str]) -> int:
    from dyncompile.tools.export_genai import main as export_main

    return export_main(argv)


def _export_eagle3(argv: list[str]) -> int:
    from dyncompile.tools.export_eagle3 import main as export_main

    return export_main(argv)


#: subcommand -> a function of its arguments (the compile form is the default, without a subcommand)
COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "inspect": _parsed(_inspect_parser, _inspect),
    "run": _parsed(_run_parser, _run),
    "bench": _bench,
    "route": _parsed(_route_parser, _route),
    "export": _parsed(_export_parser, _export),
    "export-genai": _export_genai,
    "export-eagle3": _export_eagle3,
    "serve": _serve,
    "models": _parsed(_models_parser, _models),
    "passes": _parsed(_passes_parser, _passes),
    "train-drafter": _train_drafter,
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in COMMANDS:
            return COMMANDS[argv[0]](argv[1:])
        if not argv:
            _compile_parser().print_help()
            return 2
        return _parsed(_compile_parser, _compile)(argv)
    except DyncompileError as e:
        print(f"error: {safe_text(e, keep_newlines=False)}", file=sys.stderr)
        return e.exit_code
    except BrokenPipeError:  # output piped into e.g. `head`, which stopped reading: not an error
        try:
            import os

            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0
    except OSError as e:  # a path the user gave that cannot be read or written (permissions, missing folder)
        where = f" {e.filename}" if getattr(e, "filename", None) else ""
        print(f"error: cannot access{safe_text(where, keep_newlines=False)}: {e.strerror or e}; check the path "
              "and its permissions", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
