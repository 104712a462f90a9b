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

``--workers N`` splits the prompts over N worker processes (prompt ``i`` to worker ``i % N``; one ORT thread each
with ``--threads 1``), in three rounds: the 200-step references, the settings, then the uniform twins (their step
counts come from the settings' summed times, so every worker runs the same twins). Each worker interleaves the
settings on its own prompts, so the speed ratios are paired within a worker; the report sums the seconds over
the workers and lists each worker's ratios. Each worker writes its images and timings to ``--partials``; a run
that finds a worker's file there reuses it, so the generation can run on one machine (``--generate-only``) and
the metrics on another, from the same files.
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
    p.add_argument("--ss-cached-fixed", help="plan with step-saver and cache-unet with one rule for every step count "
                   "(beside --ss-cached with a table by step count)")
    p.add_argument("--steps", type=int, default=20, help="the step count of 'caching alone' and its uniform twin")
    p.add_argument("--n", type=int, default=64, help="held-out TEST prompts (first n in eval_rank order)")
    p.add_argument("--chunk", type=int, default=8)
    p.add_argument("--timing-n", type=int, default=8, help="prompts the fixed-100 timing runs on")
    p.add_argument("--provider", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--provider-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of the execution provider, over dyncompile's defaults (repeatable), e.g. "
                   "cudnn_conv_algo_search=HEURISTIC: the CUDA EP's default exhaustive search re-times every "
                   "convolution for each new batch shape, which StepSaver's per-prompt step counts keep creating")
    p.add_argument("--ref", help="npz cache of the 200-step reference images (made if absent)")
    p.add_argument("--real-images", required=True, help="Fashion-MNIST t10k-images-idx3-ubyte.gz (FD-proxy)")
    p.add_argument("--out", required=True)
    p.add_argument("--workers", type=int, default=1, help="worker processes (prompt i to worker i %% N)")
    p.add_argument("--partials", help="folder of the workers' files (default OUT/partials)")
    p.add_argument("--generate-only", action="store_true", help="stop once the workers' files exist (no metrics)")
    p.add_argument("--machine-note", default="", help="where the workers ran, for the report")
    p.add_argument("--report-name", help="file stem of the report (default unet-cache)")
    p.add_argument("--shard", help=argparse.SUPPRESS)  # I/N:PHASE, set by the parent for a worker
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.provider_options = dict(o.split("=", 1) for o in args.provider_option)
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


_PLANS = (("plain", "plain"), ("cached", "cached"), ("ss", "ss"), ("ssc", "ss_cached"), ("ssc8", "ss_cached_int8"),
          ("sscf", "ss_cached_fixed"))


def _settings(args, K: int) -> dict[str, tuple]:
    """Setting name -> (plan, generate kwargs), in the order they run."""
    s: dict[str, tuple] = {f"uniform {K}": ("plain", {"steps": K}), f"caching alone, {K} steps": ("cached", {"steps": K})}
    for key, name in (("ss", "StepSaver alone"), ("ss_cached", "caching x StepSaver"),
                      ("ss_cached_int8", "caching x StepSaver x int8"),
                      ("ss_cached_fixed", "caching x StepSaver, one rule for every step count")):
        if getattr(args, key, None):
            s[name] = ({"ss": "ss", "ss_cached": "ssc", "ss_cached_int8": "ssc8", "ss_cached_fixed": "sscf"}[key],
                       {"policy": "predicted"})
    return s


def _twin_name(name: str, mean_steps: float) -> str:
    return f"uniform at the wall-clock of '{name}' ({mean_steps:.2f} steps)"


def _worker(args, rows: list[dict], shard: int, nshard: int, phase: str, part: Path) -> None:
    """One worker: its prompts (``i % nshard == shard``) through one phase; images and timings to ``part``."""
    import dyncompile

    idx = np.arange(len(rows))[shard::nshard]
    mine = [rows[i] for i in idx]
    K = args.steps
    plans = {k: getattr(args, a) for k, a in _PLANS if getattr(args, a, None)}
    need = {"ref": ["plain"], "main": list(plans), "twins": ["plain"]}[phase]
    load = {k: dyncompile.load(plans[k], provider=args.provider, threads=args.threads,
                               provider_options=args.provider_options or None) for k in need}
    out: dict[str, np.ndarray] = {"idx": idx}
    meta: dict = {"machine": machine_info(), "shard": shard, "workers": nshard, "phase": phase}
    if phase == "ref":  # the 200-step references (quality only, not timed)
        out["images"] = np.concatenate([_gen(load["plain"], mine[i:i + 16], steps=200)[0].images
                                        for i in range(0, len(mine), 16)])
    else:
        for m in load.values():  # session warm-up, untimed
            _gen(m, mine[:1], steps=2)
        if phase == "main":
            settings = _settings(args, K)
        else:
            tw = json.loads((part / "twins.json").read_text())
            settings = {_twin_name(a, m): ("plain", {"steps": _mixed_steps(m, len(rows))[idx]}) for a, m in tw.items()}
        res = _chunked(load, settings, mine, args.chunk)
        for j, r in enumerate(res.values()):
            out[f"images_{j}"] = np.concatenate(r["images"])
            out[f"steps_{j}"] = np.concatenate(r["steps"])
        meta["settings"] = {name: {k: r[k] for k in ("seconds", "shallow", "calls")} for name, r in res.items()}
        if phase == "main":  # fixed 100 (the speedup denominator), interleaved with uniform K on the first prompts
            t100 = tK = 0.0
            sub = mine[: args.timing_n]
            for i in range(0, len(sub), 4):
                t100 += _gen(load["plain"], sub[i:i + 4], steps=100)[1]
                tK += _gen(load["plain"], sub[i:i + 4], steps=K)[1]
            meta["fixed_100"] = {"prompts": len(sub), "seconds_100": t100, "seconds_K": tK}
    out["meta"] = np.array(json.dumps(meta))
    tmp = part / f"{phase}-{shard}-of-{nshard}.tmp.npz"
    np.savez(tmp, **out)
    tmp.replace(part / f"{phase}-{shard}-of-{nshard}.npz")


def _chunked(load, settings, rows, chunk) -> dict:
    """Every setting on ``rows``, interleaved in chunks (per-row step counts: one call per count in the chunk)."""
    res = {k: {"images": [], "steps": [], "seconds": 0.0, "shallow": 0, "calls": 0} for k in settings}
    for i in range(0, len(rows), chunk):
        for name, (m, kw) in settings.items():
            kw = dict(kw)
            r0 = rows[i:i + chunk]
            if isinstance(kw.get("steps"), np.ndarray):
                ks = kw.pop("steps")[i:i + chunk]
                imgs = None
                for k in np.unique(ks):
                    sel = np.flatnonzero(ks == k)
                    r, sec = _gen(load[m], [r0[j] for j in sel], steps=int(k), **kw)
                    if imgs is None:
                        imgs = np.zeros((len(ks), *r.images.shape[1:]), np.uint8)
                    imgs[sel] = r.images
                    res[name]["seconds"] += sec
                    res[name]["shallow"] += r.shallow_calls
                    res[name]["calls"] += r.unet_calls
                res[name]["images"].append(imgs)
                res[name]["steps"].append(ks)
                continue
            r, sec = _gen(load[m], r0, **kw)
            res[name]["images"].append(r.images)
            res[name]["steps"].append(np.asarray(r.steps))
            res[name]["seconds"] += sec
            res[name]["shallow"] += r.shallow_calls
            res[name]["calls"] += r.unet_calls
    return res


def _phase(args, rows, phase: str, part: Path) -> list[dict]:
    """Run ``phase`` on every worker whose file is missing (subprocesses when ``--workers`` > 1); read them all."""
    import os
    import subprocess

    N = max(1, args.workers)
    files = [part / f"{phase}-{i}-of-{N}.npz" for i in range(N)]
    todo = [i for i in range(N) if not files[i].is_file()]
    if todo and N == 1:
        _worker(args, rows, 0, 1, phase, part)
    elif todo:
        argv = list(args.argv)
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONUNBUFFERED="1")
        procs = [subprocess.Popen([sys.executable, "-m", "dyncompile.tools.studies.unet_cache", *argv,
                                   "--partials", str(part), "--shard", f"{i}/{N}:{phase}"], env=env) for i in todo]
        bad = [i for i, pr in zip(todo, procs) if pr.wait() != 0]
        if bad:
            raise DataError(f"unet_cache: workers {bad} of the '{phase}' round failed (their output is above)")
    out = []
    for f in files:
        d = np.load(f, allow_pickle=False)
        out.append({k: d[k] for k in d.files if k != "meta"} | {"meta": json.loads(str(d["meta"]))})
    return out


def _merge(parts: list[dict], n: int) -> dict[str, dict]:
    """Per setting: images and steps in prompt order, seconds and calls summed, and each worker's seconds."""
    names = list(parts[0]["meta"]["settings"])
    res = {}
    for j, name in enumerate(names):
        first = parts[0][f"images_{j}"]
        imgs = np.zeros((n, *first.shape[1:]), first.dtype)
        steps = np.zeros(n, np.int64)
        for p in parts:
            imgs[p["idx"]] = p[f"images_{j}"]
            steps[p["idx"]] = p[f"steps_{j}"]
        st = [p["meta"]["settings"][name] for p in parts]
        res[name] = {"images": [imgs], "steps": [steps], "seconds": sum(s["seconds"] for s in st),
                     "shallow": sum(s["shallow"] for s in st), "calls": sum(s["calls"] for s in st),
                     "worker_seconds": [s["seconds"] for s in st]}
    return res


def run(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.generate_only and not Path(args.real_images).is_file():
        raise DataError(f"real test images not found: {args.real_images} (apt-get download dataset-fashion-mnist; dpkg -x)")
    rows = select_prompts("test", args.n)
    n = len(rows)
    part = Path(args.partials) if args.partials else out / "partials"
    part.mkdir(parents=True, exist_ok=True)
    if args.shard:  # a worker
        sh, phase = args.shard.split(":")
        i, N = (int(v) for v in sh.split("/"))
        logging.getLogger().setLevel(logging.WARNING)
        _worker(args, rows, i, N, phase, part)
        return 0
    K = args.steps
    # the 200-step reference images (quality only, not timed)
    ref_path = Path(args.ref) if args.ref else None
    if ref_path and ref_path.is_file():
        ref = np.load(ref_path, allow_pickle=False)["images"][:n]
    else:
        rp = _phase(args, rows, "ref", part)
        ref = np.zeros((n, *rp[0]["images"].shape[1:]), np.uint8)
        for p in rp:
            ref[p["idx"]] = p["images"]
        if ref_path:
            np.savez(ref_path, images=ref)
    mp = _phase(args, rows, "main", part)
    res = _merge(mp, n)
    settings = _settings(args, K)
    fx = [p["meta"]["fixed_100"] for p in mp]
    nsub = sum(f["prompts"] for f in fx)
    t100, tK = sum(f["seconds_100"] for f in fx), sum(f["seconds_K"] for f in fx)
    per_step = tK / K / nsub  # seconds per image-step of the uncached plan (the timing subset)
    sec_100 = t100 / nsub
    # uniform at the same wall-clock cost as each cached setting (from the seconds summed over the workers)
    tw = {}
    for name in [s for s in settings if "caching" in s]:
        cost = res[name]["seconds"] / n  # seconds per image
        uni_per_step = res[f"uniform {K}"]["seconds"] / n / K
        tw[name] = round(cost / uni_per_step, 4)
    twf = part / "twins.json"
    if twf.is_file():
        old = json.loads(twf.read_text())
        if old != tw:
            raise DataError(f"{twf} holds twins {old} from other main-round files than these ({tw}); clear {part}")
    else:
        twf.write_text(json.dumps(tw))
    tp = _phase(args, rows, "twins", part)
    twres = _merge(tp, n)
    for a, m in tw.items():
        twres[_twin_name(a, m)]["twin_of"] = a
    res.update(twres)
    twins = list(twres)
    if args.generate_only:
        print(f"worker files in {part}: ref, main, twins for {args.workers} workers")
        return 0

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

    def ratio(base: str, k: str) -> None:
        report[k]["speedup_vs_uniform_same_steps"] = res[base]["seconds"] / res[k]["seconds"]
        if len(res[k]["worker_seconds"]) > 1:  # paired within each worker
            report[k]["speedup_vs_uniform_same_steps_per_worker"] = [
                b / c for b, c in zip(res[base]["worker_seconds"], res[k]["worker_seconds"])]

    ratio(f"uniform {K}", ca)
    if "StepSaver alone" in report:
        for k in ("caching x StepSaver", "caching x StepSaver x int8", "caching x StepSaver, one rule for every step count"):
            if k in report:
                ratio("StepSaver alone", k)
    cis = {}
    for t in twins:
        a = res[t]["twin_of"]
        A, U = per[a], per[t]
        cis[a] = {
            "uniform_twin": t, "twin_seconds_ratio": res[t]["seconds"] / res[a]["seconds"],
            "mean_ssim_to_200": bootstrap_diff(A["ssim"], U["ssim"]),
            "share_ssim_ge_0.95": bootstrap_diff(A["ssim"] >= TAU, U["ssim"] >= TAU),
            "texture_adherence": bootstrap_diff(A["tex"]["_hits"], U["tex"]["_hits"], A["tex"]["_named"]),
        }
    drop = bootstrap_diff(per[ca]["ssim"], per[f"uniform {K}"]["ssim"])
    import dyncompile

    fcs = {}
    for k, a in _PLANS:
        if getattr(args, a, None):
            fc = _fc(dyncompile.load(getattr(args, a), provider="cpu"))
            if fc:
                fcs[k] = fc
    result = {
        "prompts": n, "prompt_set": f"first {n} TEST captions in eval_rank order (held out; never used for calibration)",
        "seeds": "torch.randn(generator=manual_seed(eval_rank)) — the asset's seeds", "tau": TAU,
        "provider": args.provider, "provider_options": args.provider_options,
        "threads": args.threads, "chunk": args.chunk,
        "workers": max(1, args.workers), "machine_note": args.machine_note,
        "fixed_100_seconds_per_image": sec_100, "fixed_100_timing_prompts": nsub,
        "uncached_seconds_per_image_step": per_step, "machine": mp[0]["meta"]["machine"],
        "plans": {k: Path(getattr(args, a)).name for k, a in _PLANS if getattr(args, a, None)},
        "feature_cache": fcs,
        "settings": report, "caching_alone_minus_uniform_same_steps_ssim": drop, "vs_uniform_same_wall_clock": cis,
    }
    stem = "unet-cache" if not args.report_name else args.report_name
    write_json_atomic(out / f"{stem}.json", result)
    (out / f"{stem}.md").write_text(render_markdown(json.loads((out / f"{stem}.json").read_text())))
    grid_png({k: per[k] for k in per}, rows, out / f"{stem}-samples_grid.png" if args.report_name else out / "samples_grid.png",
             cols=min(12, n))
    print((out / f"{stem}.md").read_text())
    return 0


def _fc(model) -> dict | None:
    for h in model.handlers:
        if h.step.kind == "diffusion_denoise":
            fc = h.step.params.get("feature_cache")
            if fc is None:
                return None
            rows = [{k: v for k, v in r.items() if k != "quality"} | {"quality": r.get("quality") and {
                k: v for k, v in r["quality"].items() if k != "tried"}} for r in fc.get("schedules") or []]
            return {k: v for k, v in fc.items() if k not in ("calibration", "schedules")} | {
                "calibration": fc.get("calibration") and {k: v for k, v in fc["calibration"].items() if k != "tried"},
                "schedules": rows or None}
    return None


def _ci(c) -> str:
    return f"{c[0]:+.4f} [{c[1]:+.4f}, {c[2]:+.4f}]"


def markdown(r: dict) -> str:
    """The report as markdown (from the JSON alone)."""
    lines = [f"# cache-unet bench — {r['prompts']} held-out prompts, {r['provider']} EP, {r['threads']} thread(s)", "",
             "| setting | mean steps | shallow calls | images/s | vs fixed 100 | vs same steps uncached | mean SSIM to 200 | "
             "share ≥ 0.95 | texture adherence | FD-proxy | cond. acc |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    if r.get("workers", 1) > 1:
        lines[2:2] = [f"{r['workers']} worker processes ({r['machine_note'] or r['machine'].get('cpu')}); images/s is per "
                      f"worker (prompts over the seconds summed over the workers)", ""]
    for k, s in r["settings"].items():
        same = "" if s["speedup_vs_uniform_same_steps"] is None else f"{s['speedup_vs_uniform_same_steps']:.2f}x"
        lines.append(f"| {k} | {s['mean_steps']:.2f} | {100 * s['shallow_share_of_unet_calls']:.0f} % | {s['images_per_s']:.2f} | "
                     f"{s['speedup_vs_fixed_100']:.2f}x | {same} | {s['mean_ssim_to_200']:.4f} | "
                     f"{100 * s['share_ssim_ge_0.95']:.1f} % | {100 * s['texture_adherence']['all']:.1f} % | "
                     f"{s['fd_proxy']:.2f} | {100 * s['cond_acc']:.1f} % |")
    pw = {k: s["speedup_vs_uniform_same_steps_per_worker"] for k, s in r["settings"].items()
          if s.get("speedup_vs_uniform_same_steps_per_worker")}
    if pw:
        lines += ["", "Speed-up over the same steps uncached, paired within each worker: " + "; ".join(
            f"{k}: median {np.median(v):.2f}x, range {min(v):.2f}x–{max(v):.2f}x" for k, v in pw.items())]
    lines += ["", f"Caching alone minus uniform at the same steps, mean SSIM (paired bootstrap, 95 % CI): "
              f"{_ci(r['caching_alone_minus_uniform_same_steps_ssim'])}", "",
              "Cached setting minus uniform steps at the same wall-clock cost (paired bootstrap over prompts, 95 % CI):", "",
              "| setting | uniform twin | twin time / setting time | Δ mean SSIM | Δ share ≥ 0.95 | Δ texture adherence |",
              "|---|---|---|---|---|---|"]
    for k, c in r["vs_uniform_same_wall_clock"].items():
        lines.append(f"| {k} | {c['uniform_twin']} | {c['twin_seconds_ratio']:.2f} | {_ci(c['mean_ssim_to_200'])} | "
                     f"{_ci(c['share_ssim_ge_0.95'])} | {_ci(c['texture_adherence'])} |")
    for k, fc in r["feature_cache"].items():
        if fc.get("schedules"):
            lines += ["", f"Refresh rule by step count of plan '{k}' (depth {fc['depth']}; calibration prompts' quality):", "",
                      "| steps ≥ | interval | warm-up | final | est. cost per step | uncached SSIM | cached SSIM | drop |",
                      "|---|---|---|---|---|---|---|---|"]
            for row in fc["schedules"]:
                q = row.get("quality") or {}
                f = [q.get(x) for x in ("est_cost_per_step", "uncached_mean_ssim", "mean_ssim", "ssim_drop")]
                lines.append(f"| {row['steps']} | {row['interval']}{' (off)' if row['interval'] == 1 else ''} | "
                             f"{row['warmup']} | {row['final']} | " + " | ".join("" if v is None else f"{v:.4f}" for v in f) + " |")
    lines += ["", "Feature caches: " + json.dumps(r["feature_cache"]), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
