"""The ``dyncompile`` command line.

Forms::

    dyncompile MODEL.onnx --passes verify,cleanup -o OUT/    compile (the main form)
    dyncompile inspect MODEL.onnx | PLAN_DIR                   structure report
    dyncompile run PLAN_DIR --text "..." | --data FILE.jsonl   run a plan
    dyncompile bench PLAN_DIR --data FILE.jsonl                compiled vs original, same process
    dyncompile bench PLAN_DIR --prompts FILE.jsonl [--peers]   generation plans (+ onnxruntime-genai, OpenVINO GenAI)
    dyncompile export-genai PLAN_DIR -o FOLDER                 a generation plan as an onnxruntime-genai folder
    dyncompile route --candidates A/ B/ --calib F -o R/        a cascade / router over plans
    dyncompile models list | build NAME                        real models -> ONNX (offline)
    dyncompile passes                                          list the passes

User mistakes print one ``error: ...`` line (what, where, how to fix) and exit 2; no traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from dyncompile.errors import DataError, DyncompileError

logger = logging.getLogger("dyncompile")

SUBCOMMANDS = ("inspect", "run", "bench", "route", "export-genai", "models", "passes", "train-drafter")

EPILOG = """\
examples:
  dyncompile models build minilm-l6-sentiment
  dyncompile ~/.cache/dyncompile/models/minilm-l6-sentiment/model.onnx --passes verify,cleanup -o out/
  dyncompile run out/ --text "A gorgeous, witty movie."
  dyncompile run out/ --data ../shared/data/sentiment/movie-test.jsonl --compare
  dyncompile inspect out/
  dyncompile MODEL.onnx --passes early-exit --calib ../shared/data/sentiment/movie-calib.jsonl --budget 1.0 -o ee/

  dyncompile route --candidates minilm/ mpnet/ --calib movie-calib.jsonl --budget 1.0 -o routed/

other commands (each has --help): inspect, run, bench, route, export-genai, models, passes, train-drafter
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
    p.add_argument("model", help="input ONNX model (never modified)")
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
    ee.add_argument("--heads", choices=["fitted", "given"],
                    help="fitted (default): fit exit heads; given: use per-layer logits the graph already outputs")
    p.add_argument(
        "--provider",
        help="execution provider the plan is for (cpu, openvino, cuda, directml): --lowering auto and quantize-int8{format=auto} pick per provider",
    )
    sd = p.add_argument_group("speculative decoding (--passes speculative, split-drafter,speculative)")
    sd.add_argument("--drafter", help="DRAFT.onnx (a decoder with the target's tokenizer) or prompt-lookup; "
                    "split-drafter,speculative builds one from the target (--calib TEXT)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.add_argument("-v", "--verbose", action="count", default=0, help="-v: per-pass timing; -vv: debug")
    return p


def safe_text(text: object, *, keep_newlines: bool = True) -> str:
    """``text`` with control and other non-printable characters escaped (``\\x1b``), so that strings from
    a plan or a model (labels, task, generated text) cannot drive the terminal (escape-sequence injection)."""
    out = []
    for ch in str(text):
        if ch == "\n" and keep_newlines or ch == "\t" or ch.isprintable():
            out.append(ch)
        else:
            out.append(ch.encode("unicode_escape").decode("ascii") if ord(ch) < 0x10000 else f"\\U{ord(ch):08x}")
    return "".join(out)


def _setup_logging(verbose: int) -> None:
    level = logging.WARNING if verbose <= 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


def _cmd_compile(argv: list[str]) -> int:
    args = _compile_parser().parse_args(argv)
    _setup_logging(args.verbose)
    from dyncompile.passes.compiler import compile_model

    opts = {
        k: getattr(args, k)
        for k in ("calib", "budget", "confidence", "exits", "criterion", "lowering", "never_exit", "drafter", "provider",
                  "heads", "batch_sizes")
        if getattr(args, k) not in (None, False)
    }
    t0 = time.perf_counter()
    res = compile_model(
        args.model,
        passes=args.passes,
        output_dir=args.output,
        force=args.force,
        verify=args.verify,
        dump_ir=args.dump_ir,
        tokenizer=args.tokenizer,
        model_config=args.model_config,
        progress=not args.quiet,
        opt_level=args.opt_level,
        **opts,
    )
    print(res.summary())
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0


def _cmd_passes(argv: list[str]) -> int:
    argparse.ArgumentParser(prog="dyncompile passes", description="List the registered passes.").parse_args(argv)
    from dyncompile.passes import known_passes
    from dyncompile.passes.presets import describe_presets

    for name, help_ in known_passes().items():
        print(f"  {name:<16} {help_}")
    print("\n".join(describe_presets()))
    return 0


def _cmd_inspect(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="dyncompile inspect",
        description="Structure report of an ONNX model (inputs/outputs, op histogram, family, layers, cut tensors, "
        "parameters) or of a plan directory (files, steps, policy).",
    )
    p.add_argument("path", help="MODEL.onnx or a plan directory")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--verify",
        action="store_true",
        help="check every file of the plan against its sha256 and print one digest of the whole plan (plan.json "
        "+ every file, canonical order) to compare with the digest its publisher gives",
    )
    p.add_argument("-v", "--verbose", action="count", default=0)
    args = p.parse_args(argv)
    _setup_logging(args.verbose)
    if args.verify:
        from dyncompile.plan import plan_digest

        digest = plan_digest(args.path)
        print(json.dumps({"plan": str(Path(args.path).resolve()), "sha256": digest}) if args.json
              else f"{digest}  {safe_text(args.path)}")
        return 0
    from dyncompile.tools.inspect_report import inspect_path

    print(safe_text(inspect_path(args.path, as_json=args.json)))
    return 0


def _read_jsonl(path: str | Path, limit: int | None = None) -> list[dict]:
    from dyncompile.io import read_jsonl

    return read_jsonl(path, limit=limit)


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


def _cmd_run(argv: list[str]) -> int:
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
    d = p.add_argument_group("text to image (diffusion plans: --prompt TEXT --seed N -o OUT.png)")
    d.add_argument("-o", "--output", help="PNG to write (several prompts: OUT-0.png, OUT-1.png, ...)")
    d.add_argument("--steps", type=int, help="fixed number of denoising steps (default: the plan's step policy)")
    d.add_argument("--guidance", type=float, help="classifier-free guidance scale, >= 1 (default: the plan's)")
    d.add_argument("--policy", choices=["fixed", "predicted", "online"], help="step policy (default: the plan's)")
    p.add_argument("-v", "--verbose", action="count", default=0)
    args = p.parse_args(argv)
    _setup_logging(args.verbose)
    for flag, value in (("--batch-size", args.batch_size), ("--limit", args.limit)):
        if value is not None and value < 1:
            raise DataError(f"{flag} must be >= 1, got {value}")
    import dyncompile

    model = dyncompile.load(args.plan, provider=args.provider, fallback=args.fallback, spinning=not args.no_spinning)
    if model.plan.task == "text-to-image":
        from dyncompile.tools.diffusion_cli import run_text_to_image

        return run_text_to_image(model, args)
    if args.prompt is not None:
        res = model.generate(args.prompt, max_new_tokens=args.max_new_tokens, sample=args.sample,
                             temperature=args.temperature, seed=args.seed, chat=args.chat,
                             speculative=not args.target_only)
        if model.routed is not None:
            print(f"(answered by {safe_text(model.last_info.get('candidate'))}; checks {model.last_info.get('checks')})")
        print(json.dumps({"text": res.text, "token_ids": res.token_ids, "stats": res.stats.to_dict()}, indent=2)
              if args.json else safe_text(format_generation(res)))
        return 0
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


def _cmd_bench(argv: list[str]) -> int:
    from dyncompile.tools.diffusion_cli import refuse_diffusion_bench

    refuse_diffusion_bench(argv)
    plan_arg = next((a for a in argv if not a.startswith("-")), None)
    if plan_arg is not None and _is_routed(plan_arg):
        from dyncompile.tools.bench_route import main as bench_route

        return bench_route(argv)
    if any(a == "--peers" or a.startswith("--peers=") for a in argv):  # generation plans against peer runtimes
        from dyncompile.tools.bench_peers import main as bench_peers

        return bench_peers(argv)
    if any(a == "--prompts" or a.startswith("--prompts=") for a in argv):  # generation plans
        from dyncompile.tools.bench_speculative import main as bench_generation

        return bench_generation(argv)
    from dyncompile.tools.bench import main as bench_main

    return bench_main(argv)


def _cmd_train_drafter(argv: list[str]) -> int:
    _setup_logging(0)
    from dyncompile.tools.train_drafter import main as train_main  # torch is imported there, when it runs

    return train_main(argv)


def _cmd_export_genai(argv: list[str]) -> int:
    from dyncompile.tools.export_genai import main as export_main

    return export_main(argv)


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


def _cmd_route(argv: list[str]) -> int:
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
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.add_argument("-v", "--verbose", action="count", default=0)
    args = p.parse_args(argv)
    _setup_logging(args.verbose)
    for flag, value in (("--limit", args.limit), ("--cost-rows", args.cost_rows)):
        if value is not None and value < 1:
            raise DataError(f"{flag} must be >= 1, got {value}")
    import dyncompile

    t0 = time.perf_counter()
    res = dyncompile.route(args.candidates, args.calib, args.output, budget=args.budget, confidence=args.confidence,
                           rule=args.rule, criterion=args.criterion, check=args.check, judge=args.judge,
                           reference=args.reference, metric=args.metric, limit=args.limit, cost_rows=args.cost_rows,
                           provider=args.provider, force=args.force, progress=not args.quiet)
    print(safe_text(res.summary()))
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0


def _is_routed(path: str) -> bool:
    from dyncompile.plan import PLAN_FILENAME, is_plan_dir

    if not is_plan_dir(path):
        return False
    try:
        raw = json.loads((Path(path) / PLAN_FILENAME).read_text())
        return any(isinstance(s, dict) and s.get("kind") in ("cascade", "route") for s in raw.get("steps", []))
    except (OSError, ValueError, AttributeError):
        return False


def _cmd_models(argv: list[str]) -> int:
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
    args = p.parse_args(argv)
    _setup_logging(args.verbose)
    from dyncompile import models
    from dyncompile.models._core import is_complete

    if args.action in (None, "list"):
        home = Path(args.home).expanduser() if getattr(args, "home", None) else models.model_home()
        for r in models.list_models():
            built = "built" if is_complete(models.model_dir(r.name, home)) else "-"
            print(f"  {r.name:<22} {built:<6} {r.task:<20} {r.description}")
        print(f"cache: {home}; build one with `dyncompile models build NAME`")
        return 0
    t0 = time.perf_counter()
    art = models.build_model(args.name, home=args.home, assets_dir=args.assets, force=args.force, progress=not args.quiet)
    print(f"{art.name}: {art.onnx_path}  ({time.perf_counter() - t0:.1f} s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "inspect": _cmd_inspect,
        "run": _cmd_run,
        "bench": _cmd_bench,
        "route": _cmd_route,
        "export-genai": _cmd_export_genai,
        "models": _cmd_models,
        "passes": _cmd_passes,
        "train-drafter": _cmd_train_drafter,
    }
    try:
        if argv and argv[0] in commands:
            return commands[argv[0]](argv[1:])
        if not argv:
            _compile_parser().print_help()
            return 2
        return _cmd_compile(argv)
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
