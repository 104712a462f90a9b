"""Step-saver bench on held-out prompts: fixed 100/50/30, uniform at the predictor's mean, per-prompt
predicted, online rule, oracle — speed next to quality, from the same runs.

Inputs: a step-saver plan, and the runs of held-out TEST prompts (``tools/studies/stepsaver_data.py generate``: the
plan's denoising loop at every step count 5..20, 25, 30, 50, 100, 200 per prompt, the asset's seeds, with
per-run seconds on one ORT thread). Each setting is a choice of step count per prompt, applied to those
runs: ``predicted`` through the plan's own ``diffusion_encode`` + ``predict_steps`` steps, ``online`` through
the plan's stop rule on the recorded x0 trajectory (the exact rule of the runtime loop). A second part runs
the plan end to end (``generate_images``, every policy, interleaved, one process) on a few prompts: images/s
ratios of the real runtime, and a check that its images equal the ones the bench picked from the runs.

Metrics: SSIM to the 200-step image (mean; share >= 0.95), texture adherence (prompts naming a texture whose
image lands in the named per-class tertile bin, thresholds from TRAIN captions' measured values),
FD-proxy (Fréchet distance of the proxy classifier's features against the 10k real test images), conditional
accuracy (proxy classifier vs the prompt's class); paired bootstrap CIs for predicted vs uniform at the same
mean. Writes JSON + markdown + a PNG grid + a quality-vs-steps plot.
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
from dyncompile.io import shared_dir, write_json_atomic
from dyncompile.passes.step_saver import calibrate as cal
from dyncompile.passes.step_saver.metrics import frechet, texture
from dyncompile.runtime.diffusion.denoise import StopRule
from dyncompile.tools.bench.common import RENDER_HELP, bootstrap_diff, render_requested

logger = logging.getLogger(__name__)

CLASSES = ["t-shirt", "trousers", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle boot"]
TEXTURES = ["plain", "textured", "patterned"]
TAU = 0.95


def texture_thresholds() -> dict[str, list[float]]:
    rows = [json.loads(x) for x in gzip.open(shared_dir() / "assets/fashion-diffusion/prompts/train-captions.jsonl.gz", "rt")]
    out = {}
    for c in CLASSES:
        t = np.array([r["measured"]["texture"] for r in rows if r["class"] == c])
        out[c] = np.quantile(t, [1 / 3, 2 / 3]).tolist()
    return out


def texture_adherence(images: np.ndarray, rows: list[dict], thr) -> dict[str, float]:
    tex = texture(images)
    got = np.array([np.searchsorted(thr[r["class"]], tex[i], side="right") for i, r in enumerate(rows)])
    named = np.array(["texture" in r["in_prompt"] for r in rows])
    want = np.array([TEXTURES.index(r["attributes"]["texture"]) for r in rows])
    hit = (got == want) & named
    out = {"all": float(hit[named].mean()), "n": int(named.sum())}
    for i, w in enumerate(TEXTURES):
        sel = named & (want == i)
        out[w] = float((got == want)[sel].mean()) if sel.any() else float("nan")
    out["_hits"] = hit  # per-prompt (for the bootstrap), dropped from the JSON
    out["_named"] = named
    return out


class Proxy:
    def __init__(self, path: Path) -> None:
        import onnxruntime as ort

        self.s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    def __call__(self, u8: np.ndarray):
        x = u8.astype(np.float32) / 127.5 - 1.0
        x = np.pad(x, ((0, 0), (2, 2), (2, 2)), constant_values=-1.0)[:, None]
        logits, feats = [], []
        for i in range(0, len(x), 512):
            lg, ft = self.s.run(["logits", "features"], {"image": x[i : i + 512]})
            logits.append(lg)
            feats.append(ft)
        return np.concatenate(logits), np.concatenate(feats)


def read_idx_images(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        data = f.read()
    n, h, w = (int.from_bytes(data[i : i + 4], "big") for i in (4, 8, 12))
    return np.frombuffer(data, np.uint8, offset=16).reshape(n, h, w)


def render_markdown(report: dict) -> str:
    """The markdown this harness writes beside its JSON report, from the JSON alone (``--render JSON``)."""
    return markdown(report)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dyncompile.tools.studies.stepsaver", description=__doc__.split("\n")[0])
    p.add_argument("plan")
    p.add_argument("--runs", required=True, help="runs of held-out TEST prompts (stepsaver_data generate)")
    p.add_argument("--traj20", help="runs with the 20-step x0 trajectory (online rule variant over 20 steps)")
    p.add_argument("--calib-traj20", help="TRAIN runs with the 20-step trajectory (to calibrate that variant)")
    p.add_argument("--real-images", default="/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz")
    p.add_argument("--e2e", type=int, default=6, help="prompts for the end-to-end plan run (0: skip)")
    p.add_argument("--out", default="bench-results/stepsaver")
    p.add_argument("--render", metavar="JSON", help=RENDER_HELP)
    rendered = render_requested(argv, render_markdown)
    if rendered is not None:
        return rendered
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return run(args)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(args) -> int:
    import dyncompile
    from dyncompile.runtime.diffusion import predict_steps as head_predict

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not Path(args.real_images).is_file():
        raise DataError(f"real test images not found: {args.real_images} (apt-get download dataset-fashion-mnist; dpkg -x)")
    d, meta = cal.load_runs(args.runs)
    if meta["split"] != "test":
        raise DataError(f"{args.runs} holds {meta['split']} prompts; the bench reports on held-out TEST prompts")
    rows = meta["rows"]
    n = len(rows)
    counts = [int(c) for c in d["counts"]]
    images, ssim_all, secs = d["images"], d["ssim"], d["seconds"]
    model = dyncompile.load(args.plan)
    kinds = [h.step.kind for h in model.handlers]
    if "predict_steps" not in kinds:
        raise DataError(f"{args.plan} has no predict_steps step; compile it with --passes step-saver")
    enc, pred_h = model.handlers[0], model.handlers[kinds.index("predict_steps")]
    st = enc.run({"prompts": [r["prompt"] for r in rows]})
    predicted, _ = head_predict(pred_h.p, st["text_features"])
    pol = model.plan.policy["step_saver"]

    ar = np.arange(n)
    col = {c: i for i, c in enumerate(counts)}

    def pick(steps: np.ndarray) -> dict:
        idx = np.array([col[int(s)] for s in steps])
        return {"steps": steps, "images": images[ar, idx], "ssim": ssim_all[ar, idx], "seconds": secs[ar, idx]}

    settings: dict[str, dict] = {}
    for k in (200, 100, 50, 30):
        settings[f"fixed {k}"] = pick(np.full(n, k))
    mean_pred = float(predicted.mean())
    lo = int(np.floor(mean_pred))
    frac = mean_pred - lo
    uni = np.full(n, lo)
    uni[np.random.default_rng(0).permutation(n)[: int(round(frac * n))]] = lo + 1  # same mean as the predictor
    settings[f"uniform at the predictor's mean ({mean_pred:.2f})"] = pick(uni)
    settings[f"uniform {int(round(mean_pred))}"] = pick(np.full(n, int(round(mean_pred))))
    settings["predicted per prompt"] = pick(predicted.astype(int))
    grid_all = [c for c in (5, 10, 15, 20, 30, 50, 100, 200)]
    oracle = cal.min_steps(ssim_all[:, [col[g] for g in grid_all]], grid_all, TAU)
    settings["oracle (per-prompt minimum, SSIM ≥ 0.95)"] = pick(oracle)

    def online(rule: StopRule, change, traj_x0, traj_ssim, sec_full):
        stop = cal.stop_outcomes(change, rule)
        return {"steps": stop, "images": traj_x0[ar, stop - 1], "ssim": traj_ssim[ar, stop - 1],
                "seconds": sec_full * stop / rule.max_steps}

    sr = pol["stop_rule"]
    rule50 = StopRule(sr["threshold"], sr["max_steps"], sr["min_steps"])
    settings[f"online rule (x0 change < {rule50.threshold:.4f}, max {rule50.max_steps})"] = online(
        rule50, d["traj_change"], d["traj_x0"], d["traj_ssim"], secs[:, col[rule50.max_steps]])
    if args.traj20 and args.calib_traj20:
        c20, _ = cal.load_runs(args.calib_traj20)
        rule20, rep20 = cal.calibrate_stop_rule(c20["traj_change"], c20["traj_ssim"], TAU,
                                                pol["calibration"]["target_share_converged"], 20, sr["min_steps"])
        e20, m20 = cal.load_runs(args.traj20)
        if [r["prompt"] for r in m20["rows"]] != [r["prompt"] for r in rows]:
            raise DataError(f"{args.traj20} holds other prompts than {args.runs}")
        settings[f"online rule (x0 change < {rule20.threshold:.4f}, max 20)"] = online(
            rule20, e20["traj_change"], e20["traj_x0"], e20["traj_ssim"], secs[:, col[20]])

    thr = texture_thresholds()
    proxy = Proxy(shared_dir() / "assets/fashion-diffusion/proxy/classifier.onnx")
    real = read_idx_images(Path(args.real_images))
    _, real_feats = proxy(real)
    cls = np.array([CLASSES.index(r["class"]) for r in rows])
    base = settings["fixed 100"]
    report = {}
    for name, s in settings.items():
        logits, feats = proxy(s["images"])
        tex = texture_adherence(s["images"], rows, thr)
        s["tex"] = tex
        s["cond_ok"] = logits.argmax(1) == cls
        ips = n / s["seconds"].sum()
        report[name] = {
            "mean_steps": float(s["steps"].mean()),
            "images_per_s_1thread": ips,
            "speedup_vs_fixed_100": float(base["seconds"].sum() / s["seconds"].sum()),
            "mean_ssim_to_200": float(s["ssim"].mean()),
            "share_ssim_ge_0.95": float((s["ssim"] >= TAU).mean()),
            "texture_adherence": {k: v for k, v in tex.items() if not k.startswith("_")},
            "fd_proxy": frechet(feats, real_feats),
            "cond_acc": float(s["cond_ok"].mean()),
        }
    uname = next(k for k in settings if k.startswith("uniform at"))
    P, U = settings["predicted per prompt"], settings[uname]
    cis = {
        "share_ssim_ge_0.95": bootstrap_diff(P["ssim"] >= TAU, U["ssim"] >= TAU),
        "mean_ssim_to_200": bootstrap_diff(P["ssim"], U["ssim"]),
        "texture_adherence": bootstrap_diff(P["tex"]["_hits"], U["tex"]["_hits"], P["tex"]["_named"]),
        "mean_steps": [float(P["steps"].mean()), float(U["steps"].mean())],
    }
    online_names = [k for k in settings if k.startswith("online")]
    # uniform at the online rule's mean too (its own 'same mean' comparison)
    fixed_curve = {c: {"mean_ssim": float(ssim_all[:, col[c]].mean()), "share": float((ssim_all[:, col[c]] >= TAU).mean()),
                       "images_per_s_1thread": float(n / secs[:, col[c]].sum())} for c in counts}
    e2e = end_to_end(model, rows[: args.e2e], settings, uni[: args.e2e]) if args.e2e else None
    result = {
        "plan": str(Path(args.plan).resolve()), "runs": str(Path(args.runs).resolve()), "prompts": n,
        "prompt_set": f"first {n} TEST captions in eval_rank order (held out; never used for calibration)",
        "seeds": "torch.randn(generator=manual_seed(eval_rank)) — the asset's seeds", "tau": TAU,
        "run_machine": meta["run"][0], "calibration": pol["calibration"], "settings": report,
        "predicted_vs_uniform_same_mean": cis, "fixed_curve": {str(k): v for k, v in fixed_curve.items()},
        "online_settings": online_names, "end_to_end": e2e,
    }
    write_json_atomic(out / "stepsaver.json", result)
    (out / "stepsaver.md").write_text(markdown(result))
    plot(result, out / "quality_vs_steps.png")
    grid_png(settings, rows, out / "samples_grid.png")
    print((out / "stepsaver.md").read_text())
    return 0


def end_to_end(model, rows, settings, uni) -> dict:
    """The plan itself, every policy, interleaved in one process: images/s and agreement with the bench's picks."""

    prompts = [r["prompt"] for r in rows]
    seeds = [r["seed"] for r in rows]
    m = len(rows)
    runs = {"fixed 100": {"steps": 100}, "fixed 50": {"steps": 50}, "fixed 30": {"steps": 30},
            "predicted per prompt": {"policy": "predicted"}, "online (plan's rule)": {"policy": "online"}}
    times = {k: [] for k in runs} | {"uniform at the predictor's mean": []}
    steps = {k: [] for k in times}
    agree = {}
    for i in range(m):
        for name, kw in runs.items():
            t0 = time.perf_counter()
            r = model.generate_images(prompts[i], seed=[seeds[i]], noise_source="torch", **kw)
            times[name].append(time.perf_counter() - t0)
            steps[name].append(int(r.steps[0]))
            ref = settings.get(name) or next(v for k, v in settings.items() if k.startswith("online rule") and "max 50" in k)
            agree.setdefault(name, []).append(int(np.abs(r.images[0].astype(int) - ref["images"][i].astype(int)).max()))
        t0 = time.perf_counter()
        model.generate_images(prompts[i], seed=[seeds[i]], noise_source="torch", steps=int(uni[i]))
        times["uniform at the predictor's mean"].append(time.perf_counter() - t0)
        steps["uniform at the predictor's mean"].append(int(uni[i]))
    base = sum(times["fixed 100"])
    return {"prompts": m, "threads": "ORT default (2 cores, shared machine)",
            "images_per_s": {k: m / sum(v) for k, v in times.items()},
            "mean_steps": {k: float(np.mean(v)) for k, v in steps.items()},
            "speedup_vs_fixed_100": {k: base / sum(v) for k, v in times.items()},
            "max_uint8_diff_vs_bench_images": {k: max(v) for k, v in agree.items()}}


def markdown(r: dict) -> str:
    L = [f"# StepSaver on fashion-diffusion — {r['prompts']} held-out prompts", "",
         f"Prompts: {r['prompt_set']}; seeds: {r['seeds']}; CFG 3, DDIM trailing, eta 0. Runs: "
         f"{r['run_machine']['cpu_count']}-core device machine, ORT {r['run_machine']['onnxruntime']} CPU EP, one thread per worker; "
         "images/s = prompts / summed single-thread seconds of the chosen runs (online: the max-steps run's seconds x stop/max).", "",
         "| setting | mean steps | images/s (1 thread) | speedup vs 100 | mean SSIM to 200 | share SSIM ≥ 0.95 | texture adherence (all / textured / patterned / plain) | FD-proxy | cond. acc |",
         "|---|---|---|---|---|---|---|---|---|"]
    for k, v in r["settings"].items():
        t = v["texture_adherence"]
        L.append(f"| {k} | {v['mean_steps']:.2f} | {v['images_per_s_1thread']:.2f} | {v['speedup_vs_fixed_100']:.2f}x | "
                 f"{v['mean_ssim_to_200']:.4f} | {100 * v['share_ssim_ge_0.95']:.1f} % | {100 * t['all']:.1f} / {100 * t['textured']:.1f} / "
                 f"{100 * t['patterned']:.1f} / {100 * t['plain']:.1f} (n={t['n']}) | {v['fd_proxy']:.2f} | {100 * v['cond_acc']:.1f} % |")
    c = r["predicted_vs_uniform_same_mean"]
    L += ["", f"**Predicted per prompt vs uniform at the same mean** (mean steps {c['mean_steps'][0]:.2f} vs {c['mean_steps'][1]:.2f}; "
          "paired bootstrap over prompts, 95 % CI):", ""]
    for k in ("share_ssim_ge_0.95", "mean_ssim_to_200", "texture_adherence"):
        m, lo, hi = c[k]
        L.append(f"- {k}: {m:+.4f} [{lo:+.4f}, {hi:+.4f}]" + ("  (CI excludes 0)" if lo > 0 or hi < 0 else "  (CI includes 0)"))
    cal_ = r["calibration"]
    L += ["", f"Calibration: {cal_['prompts']} TRAIN captions, tau {cal_['tau']}, target share {cal_['target_share_converged']:.2f}; "
          f"head CV R² {cal_['fit']['cv_r2']:.3f} (ridge λ {cal_['fit']['ridge_lambda']}); predicted (CV) {cal_['predicted_cv']}; "
          f"online {cal_['online']}."]
    if r.get("end_to_end"):
        e = r["end_to_end"]
        L += ["", f"End to end through the plan (`generate_images`, {e['prompts']} prompts, interleaved, {e['threads']}):", "",
              "| policy | mean steps | images/s | speedup vs 100 | max uint8 diff vs bench image |", "|---|---|---|---|---|"]
        for k, v in e["images_per_s"].items():
            L.append(f"| {k} | {e['mean_steps'][k]:.2f} | {v:.2f} | {e['speedup_vs_fixed_100'][k]:.2f}x | "
                     f"{e['max_uint8_diff_vs_bench_images'].get(k, '–')} |")
    return "\n".join(L) + "\n"


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ks = sorted(int(k) for k in r["fixed_curve"])
    for ax, key, lab in ((axes[0], "mean_ssim", "mean SSIM to 200-step"), (axes[1], "share", "share SSIM ≥ 0.95")):
        ax.plot(ks, [r["fixed_curve"][str(k)][key] for k in ks], "o-", color="grey", label="fixed N steps")
        for name, v in r["settings"].items():
            if name.startswith("fixed"):
                continue
            y = v["mean_ssim_to_200"] if key == "mean_ssim" else v["share_ssim_ge_0.95"]
            ax.plot(v["mean_steps"], y, "s", label=name)
        ax.set_xscale("log")
        ax.set_xlabel("mean denoising steps")
        ax.set_ylabel(lab)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def grid_png(settings: dict, rows: list[dict], path: Path, cols: int = 12) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(settings)
    fig, axes = plt.subplots(len(names), cols, figsize=(cols * 0.9, len(names) * 1.0))
    for i, name in enumerate(names):
        for j in range(cols):
            ax = axes[i, j]
            ax.imshow(settings[name]["images"][j], cmap="gray", vmin=0, vmax=255)
            ax.set_xticks([])
            ax.set_yticks([])
            if j == 0:
                ax.set_ylabel(name[:28], fontsize=5, rotation=0, ha="right", va="center")
            if i == 0:
                ax.set_title(rows[j]["prompt"][:22], fontsize=4.5)
            ax.set_xlabel(str(int(settings[name]["steps"][j])), fontsize=5, labelpad=1)
    fig.tight_layout(pad=0.2)
    fig.savefig(path, dpi=150)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
