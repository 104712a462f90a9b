"""Diffusion plans side by side (e.g. fp32 vs ``quantize-int8`` U-Net) on one provider, same prompts and seeds,
interleaved in one process: images/s next to SSIM / max pixel difference of each plan's images to the first plan's.

    python -m dyncompile.tools.studies.diffusion_plans fp32/ int8/ --provider openvino --steps 13 --n 8 --out DIR
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np

from dyncompile.errors import DyncompileError
from dyncompile.io import write_json_atomic
from dyncompile.tools.bench.common import RENDER_HELP, render_requested


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dyncompile.tools.studies.diffusion_plans", description=__doc__.split("\n")[0])
    p.add_argument("plans", nargs="+")
    p.add_argument("--provider", default="cpu")
    p.add_argument("--steps", type=int, default=13)
    p.add_argument("--n", type=int, default=8, help="held-out TEST prompts (eval_rank order)")
    p.add_argument("--out", required=True)
    p.add_argument("--tag", default="")
    p.add_argument("--noise", choices=["numpy", "torch"], default="numpy", help="initial-noise source (torch: the asset's seeds)")
    p.add_argument("--render", metavar="JSON", help=RENDER_HELP)
    rendered = render_requested(argv, render_markdown)
    if rendered is not None:
        return rendered
    args = p.parse_args(argv)
    try:
        return run(args)
    except DyncompileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(args) -> int:
    import onnxruntime

    import dyncompile
    from dyncompile.passes.step_saver.metrics import ssim
    from dyncompile.tools.studies.stepsaver_data import select_prompts

    rows = select_prompts("test", args.n)
    models = [dyncompile.load(p, provider=args.provider) for p in args.plans]
    imgs = [[] for _ in models]
    secs = [[] for _ in models]
    for m in models:  # warm-up
        m.generate_images(rows[0]["prompt"], seed=0, steps=2)
    for r in rows:
        for j, m in enumerate(models):
            t0 = time.perf_counter()
            res = m.generate_images(r["prompt"], seed=[r["seed"]], steps=args.steps, noise_source=args.noise)
            secs[j].append(time.perf_counter() - t0)
            imgs[j].append(res.images[0])
    ref = np.stack(imgs[0])
    out = {"provider": args.provider, "onnxruntime": onnxruntime.__version__, "steps": args.steps, "prompts": len(rows),
           "machine": platform.node(), "plans": {}}
    for j, pth in enumerate(args.plans):
        a = np.stack(imgs[j])
        out["plans"][pth] = {
            "images_per_s": len(rows) / sum(secs[j]), "median_s": float(np.median(secs[j])),
            "speedup_vs_first": sum(secs[0]) / sum(secs[j]),
            "mean_ssim_vs_first": float(ssim(a, ref).mean()), "min_ssim_vs_first": float(ssim(a, ref).min()),
            "max_uint8_diff_vs_first": int(np.abs(a.astype(int) - ref.astype(int)).max()),
        }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    name = f"plans-{args.provider}{args.tag}"
    write_json_atomic(Path(args.out) / f"{name}.json", out)
    md = render_markdown(out)
    (Path(args.out) / f"{name}.md").write_text(md)
    print(md, end="")
    return 0


def render_markdown(report: dict) -> str:
    """The markdown of a ``plans-PROVIDER.json`` report."""
    lines = [f"# diffusion plans on {report['provider']} (ORT {report['onnxruntime']}), {report['prompts']} held-out "
             f"prompts, {report['steps']} steps", "",
             "| plan | images/s | speedup vs first | mean SSIM vs first | min SSIM | max uint8 diff |", "|---|---|---|---|---|---|"]
    for k, v in report["plans"].items():
        lines.append(f"| {k} | {v['images_per_s']:.2f} | {v['speedup_vs_first']:.2f}x | {v['mean_ssim_vs_first']:.4f} | "
                     f"{v['min_ssim_vs_first']:.4f} | {v['max_uint8_diff_vs_first']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
