"""``dyncompile MODEL.onnx --passes ... -o OUT/`` (compile) and ``dyncompile passes`` (list the passes)."""

from __future__ import annotations

import argparse
import time

__all__ = ["compile_command", "passes_command"]

#: compile options that are forwarded to the passes when given (the parser's pass-option arguments)
PASS_OPTIONS = ("calib", "budget", "confidence", "exits", "criterion", "lowering", "never_exit", "drafter", "provider",
                "heads", "batch_sizes", "metric", "train_text")


def compile_command(args: argparse.Namespace) -> int:
    from dyncompile.passes.compiler import compile_model

    opts = {k: getattr(args, k) for k in PASS_OPTIONS if getattr(args, k) not in (None, False)}
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


def passes_command(args: argparse.Namespace) -> int:
    from dyncompile.passes import known_passes
    from dyncompile.passes.presets import describe_presets

    for name, help_ in known_passes().items():
        print(f"  {name:<16} {help_}")
    print("\n".join(describe_presets()))
    return 0
