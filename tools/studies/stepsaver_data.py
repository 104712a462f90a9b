"""Step-saver data: prompts -> text states (``prepare``), text states -> generation runs (``generate``).

``prepare`` encodes prompts with a diffusion plan's own text encoder (the ``diffusion_encode`` step) and
draws their initial noise; ``generate`` runs the plan's denoising loop (the runtime's ``Denoiser`` with
the plan's scheduler and guidance) at a list of step counts per prompt, in parallel worker processes
(one ORT thread each), and can run where the text encoder is not (it needs only the U-Net)::

    python -m dyncompile.tools.studies.stepsaver_data prepare PLAN --split train --n 400 --out calib-in.npz
    python -m dyncompile.tools.studies.stepsaver_data generate calib-in.npz --unet PLAN/unet/model.onnx \
        --counts 5,10,15,20,30,50,200 --out calib-runs.npz --workers 16

The runs file of calibration (TRAIN) prompts is the ``labels=`` input of the ``step-saver`` pass; the
runs file of held-out TEST prompts is the input of ``tools/studies/stepsaver.py``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

from dyncompile.errors import DataError
from dyncompile.io import shared_dir

logger = logging.getLogger(__name__)

ASSET = "fashion-diffusion"


def read_captions(split: str, assets: Path | None = None) -> list[dict]:
    root = (assets or shared_dir() / "assets") / ASSET / "prompts"
    path = root / ("train-captions.jsonl.gz" if split == "train" else "test-captions.jsonl")
    if not path.is_file():
        raise DataError(f"caption file not found: {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def select_prompts(split: str, n: int, seed: int = 0) -> list[dict]:
    """TRAIN: a seeded random sample (calibration); TEST: the first n in ``eval_rank`` order (the asset's eval set)."""
    rows = read_captions(split)
    if split == "train":
        idx = np.random.default_rng(seed).choice(len(rows), size=n, replace=False)
        out = [dict(rows[i], seed=1_000_000 + int(i)) for i in idx]
    else:
        rows = sorted(rows, key=lambda r: r["eval_rank"])[:n]
        out = [dict(r, seed=int(r["eval_rank"])) for r in rows]
    return out


def encode_with_plan(plan_dir: str | Path, prompts: list[str], batch: int = 256):
    """Text states and pooled features from the plan's own ``diffusion_encode`` step."""
    import dyncompile

    model = dyncompile.load(plan_dir)
    enc = model.handlers[0]
    if enc.step.kind != "diffusion_encode":
        raise DataError(f"{plan_dir} is not a diffusion plan")
    ctx, feats, null = [], [], None
    for i in range(0, len(prompts), batch):
        st = enc.run({"prompts": prompts[i : i + batch]})
        ctx.append(st["ctx"])
        feats.append(st["text_features"])
        null = st["null_ctx"]
    return np.concatenate(ctx), null, np.concatenate(feats), model


def cmd_prepare(args) -> int:
    from dyncompile.runtime.diffusion.denoise import make_noise

    rows = select_prompts(args.split, args.n, args.seed)
    prompts = [r["prompt"] for r in rows]
    ctx, null, feats, model = encode_with_plan(args.plan, prompts)
    den = next(h for h in model.handlers if h.step.kind == "diffusion_denoise")
    noise_src = "torch" if args.split == "test" else "numpy"  # test: the asset's seeds (torch.randn, seed = eval_rank)
    noise = make_noise([r["seed"] for r in rows], list(den.p.sample_shape), noise_src)
    meta = {"split": args.split, "noise": noise_src, "rows": rows, "plan": str(Path(args.plan).resolve()),
            "scheduler": den.step.params["scheduler"], "guidance": den.p.guidance_scale, "crop": den.p.output_crop}
    np.savez(args.out, ctx=ctx, null_ctx=null, features=feats, noise=noise, meta=json.dumps(meta))
    print(f"{args.out}: {len(rows)} {args.split} prompts, ctx {ctx.shape}")
    return 0


def cmd_generate(args) -> int:
    from dyncompile.passes.step_saver.calibrate import generation_runs

    d = np.load(args.inputs, allow_pickle=False)
    meta = json.loads(str(d["meta"]))
    s0 = args.start
    n = len(d["ctx"]) - s0 if args.limit is None else min(args.limit, len(d["ctx"]) - s0)
    counts = [int(c) for c in args.counts.split(",")]
    t0 = time.perf_counter()
    runs = generation_runs(args.unet, meta["scheduler"], float(meta["guidance"]), meta["crop"], d["ctx"][s0 : s0 + n],
                           d["null_ctx"], d["noise"][s0 : s0 + n], counts, args.ref, args.traj, workers=args.workers)
    wall = time.perf_counter() - t0
    import platform

    import onnxruntime

    info = {"wall_s": wall, "workers": args.workers, "threads_per_worker": 1, "machine": platform.node(),
            "cpu_count": __import__("os").cpu_count(), "onnxruntime": onnxruntime.__version__, "n": n,
            "ref_steps": args.ref, "traj_steps": args.traj}
    from dyncompile.io import sha256_file

    meta = {**meta, "rows": meta["rows"][s0 : s0 + n], "run": info, "unet_sha256": sha256_file(args.unet)}
    np.savez_compressed(args.out, **runs, meta=json.dumps(meta))
    print(json.dumps(info))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dyncompile.tools.studies.stepsaver_data", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("prepare")
    a.add_argument("plan")
    a.add_argument("--split", choices=["train", "test"], required=True)
    a.add_argument("--n", type=int, required=True)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--out", required=True)
    g = sub.add_parser("generate")
    g.add_argument("inputs")
    g.add_argument("--unet", required=True)
    g.add_argument("--counts", required=True)
    g.add_argument("--ref", type=int, default=200)
    g.add_argument("--traj", type=int, default=50)
    g.add_argument("--workers", type=int, default=1)
    g.add_argument("--limit", type=int)
    g.add_argument("--start", type=int, default=0, help="first prompt (row) of the inputs to run")
    g.add_argument("--out", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return cmd_prepare(args) if args.cmd == "prepare" else cmd_generate(args)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
