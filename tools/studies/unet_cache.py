"""Bench of ``cache-unet`` (feature caching across denoising steps) alone and composed with StepSaver and int8.

Held-out TEST captions (the first ``--n`` in ``eval_rank`` order, the asset's seeds: ``torch.randn`` seeded with
``eval_rank``), every setting through its compiled plan (``generate_images``), interleaved in one process: the
prompts go in chunks, and each chunk runs every setting in turn, so that machine drift hits all settings alike.
Quality next to speed from the same run: mean SSIM to the 200-step image, share >= 0.95, texture adherence,
FD-proxy (proxy classifier features vs the 10k real test images), conditional accuracy. The fair baseline is
uniform steps at the same wall-clock cost as a cached setting (its step count from the measured per-step time
of the uniform plan, floor/ceil mixed over prompts to match the mean); paired bootstrap CIs over prompts::

    python -m dyncompile.tools.studies.unet_cache --plain fd --cached c20 --ss ss --ss-cached ssc \
        --ss-cached-int8 ssc8 --steps 20 --n 64 --out bench-results/unet-cache
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

from dyncompile.errors import DataError
from dyncompile.io import shared_dir, write_json_atomic
from dyncompile.passes.step_saver.metrics import frechet, ssim
from dyncompile.tools.bench.common import bootstrap_diff, machine_info
from dyncompile.tools.studies.stepsaver import (
    CLASSES,
    TAU,
    Proxy,
    grid_png,
    read_idx_images,
    texture_adherence,
    texture_thresholds,
)
from dyncompile.tools.studies.stepsaver_data import select_prompts

logger = logging.getLogger(__name__)


def render_markdown(report: dict) -> str:
    """The markdown this harness writes beside its JSON report, from the JSON alone."""
    return markdown(report)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dyncompile.tools.studies.unet_cache", description=__doc__.split("\n")[0])
    p.add_argument("--plain", required=True, help="plan without caching (verify,cleanup)")
    p.add_argument("--cached", required=True, help="plan with cache-unet")
    p.add_argument("--ss", help="plan with step-saver")
    p.add_argument("--ss-cached", help="plan with step-saver and cache-unet")
    p.add_argument("--ss-cached-int8", help="plan with step-saver, quantize-int8 and cache-unet")
    p.add_argument("--steps", type=int, default=20, help="the step count of 'caching alone' and its uniform twin")
    p.add_argument("--n", type=int, default=64, help="held-out TEST prompts (first n in eval_rank order)")
    p.add_argument("--chunk", type=int, default=8)
    p.add_argument("--timing-n", type=int, default=8, help="prompts the fixed-100 timing runs on")
    p.add_argument("--provider", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ref", help="npz cache of the 200-step reference images (made if absent)")
    p.add_argument("--real-images", required=True, help="Fashion-MNIST t10k-images-idx3-ubyte.gz (FD-proxy)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return run(args)


def _gen(model, rows, **kw):
    t0 = time.perf_counter()
    r = model.generate_images([x["prompt"] for x in rows], seed=[x["seed"] for x in rows], noise_source="torch", **kw)
    return r, time.perf_counter() - t0


def _mixed_steps(mean: float, n: int) -> np.ndarray:
    lo = int(np.floor(mean))
    k = np.full(n, lo)
    k[np.random.default_rng(0).permutation(n)[: int(round((mean - lo) * n))]] = lo + 1
    return np.maximum(k, 1)


def run(args) -> int:
    import dyncompile

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not Path(args.real_images).is_file():
        raise DataError(f"real test images not found: {args.real_images} (apt-get download dataset-fashion-mnist; dpkg -x)")
    rows = select_prompts("test", args.n)
    n = len(rows)
    load = {k: dyncompile.load(v, provider=args.provider, threads=args.threads) for k, v in
            (("plain", args.plain), ("cached", args.cached), ("ss", args.ss), ("ssc", args.ss_cached),
             ("ssc8", args.ss_cached_int8)) if v}
    # the 200-step reference images (quality only, not timed)
    ref_path = Path(args.ref) if args.ref else None
    if ref_path and ref_path.is_file():
        ref = np.load(ref_path, allow_pickle=False)["images"][:n]
    else:
        ref = np.concatenate([_gen(load["plain"], rows[i:i + 16], steps=200)[0].images for i in range(0, n, 16)])
        if ref_path:
            np.savez(ref_path, images=ref)
    K = args.steps
    # settings: name -> (model, kwargs, per-row step counts or None)
    settings: dict[str, tuple] = {f"uniform {K}": ("plain", {"steps": K}), f"caching alone, {K} steps": ("cached", {"steps": K})}
    if "ss" in load:
        settings["StepSaver alone"] = ("ss", {"policy": "predicted"})
    if "ssc" in load:
        settings["caching x StepSaver"] = ("ssc", {"policy": "predicted"})
    if "ssc8" in load:
        settings["caching x StepSaver x int8"] = ("ssc8", {"policy": "predicted"})
    res = {k: {"images": [], "steps": [], "seconds": 0.0, "shallow": 0, "calls": 0} for k in settings}

    def chunked(names):
        for i in range(0, n, args.chunk):
            for name in names:
                m, kw = settings[name][:2]
                kw = dict(kw)
                if isinstance(kw.get("steps"), np.ndarray):  # per-row counts: one call per count in the chunk
                    ks = kw.pop("steps")[i:i + args.chunk]
                    imgs = np.zeros((len(ks), *ref.shape[1:]), np.uint8)
                    for k in np.unique(ks):
                        sel = np.flatnonzero(ks == k)
                        r, sec = _gen(load[m], [rows[i + j] for j in sel], steps=int(k), **kw)
                        imgs[sel] = r.images
                        res[name]["seconds"] += sec
                        res[name]["shallow"] += r.shallow_calls
                        res[name]["calls"] += r.unet_calls
                    res[name]["images"].append(imgs)
                    res[name]["steps"].append(ks)
                    continue
                r, sec = _gen(load[m], rows[i:i + args.chunk], **kw)
                res[name]["images"].append(r.images)
                res[name]["steps"].append(np.asarray(r.steps))
                res[name]["seconds"] += sec
                res[name]["shallow"] += r.shallow_calls
                res[name]["calls"] += r.unet_calls

    chunked(list(settings))
    # fixed 100 (the speedup denominator): timed on the first timing-n prompts, interleaved with uniform K
    t100 = tK = 0.0
    sub = rows[: args.timing_n]
    for i in range(0, len(sub), 4):
        t100 += _gen(load["plain"], sub[i:i + 4], steps=100)[1]
        tK += _gen(load["plain"], sub[i:i + 4], steps=K)[1]
    per_step = tK / K / len(sub)  # seconds per image-step of the uncached plan (the timing subset)
    sec_100 = t100 / len(sub)
    # uniform at the same wall-clock cost as each cached setting
    for name in [s for s in settings if "caching" in s]:
        cost = res[name]["seconds"] / n  # seconds per image
        uni_per_step = res[f"uniform {K}"]["seconds"] / n / K
        mean_steps = cost / uni_per_step
        tw = f"uniform at the wall-clock of '{name}' ({mean_steps:.2f} steps)"
        settings[tw] = ("plain", {"steps": _mixed_steps(mean_steps, n)})
        res[tw] = {"images": [], "steps": [], "seconds": 0.0, "shallow": 0, "calls": 0, "twin_of": name}
    twins = [s for s in settings if s.startswith("uniform at the wall-clock")]
    chunked(twins)

    thr = texture_thresholds()
    proxy = Proxy(shared_dir() / "assets/fashion-diffusion/proxy/classifier.onnx")
    _, real_feats = proxy(read_idx_images(Path(args.real_images)))
    cls = np.array([CLASSES.index(r["class"]) for r in rows])
    report, per = {}, {}
    for name, r in res.items():
        imgs = np.concatenate(r["images"])
        steps = np.concatenate(r["steps"])
        s = ssim(imgs, ref)
        logits, feats = proxy(imgs)
        tex = texture_adherence(imgs, rows, thr)
        per[name] = {"ssim": s, "tex": tex, "images": imgs, "steps": steps}
        ips = n / r["seconds"]
        report[name] = {
            "mean_steps": float(steps.mean()),
            "shallow_share_of_unet_calls": r["shallow"] / max(r["calls"], 1),
            "images_per_s": ips,
            "speedup_vs_fixed_100": sec_100 / (r["seconds"] / n),
            "speedup_vs_uniform_same_steps": None,
            "mean_ssim_to_200": float(s.mean()),
            "share_ssim_ge_0.95": float((s >= TAU).mean()),
            "texture_adherence": {k: v for k, v in tex.items() if not k.startswith("_")},
            "fd_proxy": frechet(feats, real_feats),
            "cond_acc": float((logits.argmax(1) == cls).mean()),
        }
    ca = f"caching alone, {K} steps"
    report[ca]["speedup_vs_uniform_same_steps"] = res[f"uniform {K}"]["seconds"] / res[ca]["seconds"]
    if "StepSaver alone" in report:
        for k in ("caching x StepSaver", "caching x StepSaver x int8"):
            if k in report:
                report[k]["speedup_vs_uniform_same_steps"] = res["StepSaver alone"]["seconds"] / res[k]["seconds"]
    cis = {}
    for tw in twins:
        a = res[tw]["twin_of"]
        A, U = per[a], per[tw]
        cis[a] = {
            "uniform_twin": tw, "twin_seconds_ratio": res[tw]["seconds"] / res[a]["seconds"],
            "mean_ssim_to_200": bootstrap_diff(A["ssim"], U["ssim"]),
            "share_ssim_ge_0.95": bootstrap_diff(A["ssim"] >= TAU, U["ssim"] >= TAU),
            "texture_adherence": bootstrap_diff(A["tex"]["_hits"], U["tex"]["_hits"], A["tex"]["_named"]),
        }
    drop = bootstrap_diff(per[ca]["ssim"], per[f"uniform {K}"]["ssim"])
    result = {
        "prompts": n, "prompt_set": f"first {n} TEST captions in eval_rank order (held out; never used for calibration)",
        "seeds": "torch.randn(generator=manual_seed(eval_rank)) — the asset's seeds", "tau": TAU,
        "provider": args.provider, "threads": args.threads, "chunk": args.chunk,
        "fixed_100_seconds_per_image": sec_100, "fixed_100_timing_prompts": len(sub),
        "uncached_seconds_per_image_step": per_step, "machine": machine_info(),
        "plans": {k: Path(v).name for k, v in (("plain", args.plain), ("cached", args.cached), ("ss", args.ss),
                                                          ("ss_cached", args.ss_cached), ("ss_cached_int8", args.ss_cached_int8)) if v},
        "feature_cache": {k: _fc(m) for k, m in load.items() if _fc(m)},
        "settings": report, "caching_alone_minus_uniform_same_steps_ssim": drop, "vs_uniform_same_wall_clock": cis,
    }
    write_json_atomic(out / "unet-cache.json", result)
    (out / "unet-cache.md").write_text(render_markdown(json.loads((out / "unet-cache.json").read_text())))
    grid_png({k: per[k] for k in per}, rows, out / "samples_grid.png", cols=min(12, n))
    print((out / "unet-cache.md").read_text())
    return 0


def _fc(model) -> dict | None:
    for h in model.handlers:
        if h.step.kind == "diffusion_denoise":
            fc = h.step.params.get("feature_cache")
            return None if fc is None else {k: v for k, v in fc.items() if k != "calibration"} | {
                "calibration": fc.get("calibration") and {k: v for k, v in fc["calibration"].items() if k != "tried"}}
    return None


def _ci(c) -> str:
    return f"{c[0]:+.4f} [{c[1]:+.4f}, {c[2]:+.4f}]"


def markdown(r: dict) -> str:
    """The report as markdown (from the JSON alone)."""
    lines = [f"# cache-unet bench — {r['prompts']} held-out prompts, {r['provider']} EP, {r['threads']} thread(s)", "",
             "| setting | mean steps | shallow calls | images/s | vs fixed 100 | vs same steps uncached | mean SSIM to 200 | "
             "share ≥ 0.95 | texture adherence | FD-proxy | cond. acc |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for k, s in r["settings"].items():
        same = "" if s["speedup_vs_uniform_same_steps"] is None else f"{s['speedup_vs_uniform_same_steps']:.2f}x"
        lines.append(f"| {k} | {s['mean_steps']:.2f} | {100 * s['shallow_share_of_unet_calls']:.0f} % | {s['images_per_s']:.2f} | "
                     f"{s['speedup_vs_fixed_100']:.2f}x | {same} | {s['mean_ssim_to_200']:.4f} | "
                     f"{100 * s['share_ssim_ge_0.95']:.1f} % | {100 * s['texture_adherence']['all']:.1f} % | "
                     f"{s['fd_proxy']:.2f} | {100 * s['cond_acc']:.1f} % |")
    lines += ["", f"Caching alone minus uniform at the same steps, mean SSIM (paired bootstrap, 95 % CI): "
              f"{_ci(r['caching_alone_minus_uniform_same_steps_ssim'])}", "",
              "Cached setting minus uniform steps at the same wall-clock cost (paired bootstrap over prompts, 95 % CI):", "",
              "| setting | uniform twin | twin time / setting time | Δ mean SSIM | Δ share ≥ 0.95 | Δ texture adherence |",
              "|---|---|---|---|---|---|"]
    for k, c in r["vs_uniform_same_wall_clock"].items():
        lines.append(f"| {k} | {c['uniform_twin']} | {c['twin_seconds_ratio']:.2f} | {_ci(c['mean_ssim_to_200'])} | "
                     f"{_ci(c['share_ssim_ge_0.95'])} | {_ci(c['texture_adherence'])} |")
    lines += ["", "Feature caches: " + json.dumps(r["feature_cache"]), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
