"""``step-saver``: a per-prompt denoising step count (and an online stop rule) lowered into a diffusion plan.

Scope: the U-Net of a pipeline-folder compile (``dyncompile PIPELINE_DIR --passes step-saver``). The pass
does not change the graph; it records in the model's metadata what the ``diffusion`` emitter lowers into
the plan: a ``predict_steps`` step (a linear head on the text encoder's mean-pooled states, ``log2`` of the
step count, rounded up onto the calibration grid) that picks each prompt's count before the loop, and an
online stop rule for ``diffusion_denoise`` (stop when the x0 prediction stops changing).

Invariants: calibration uses TRAIN captions only (a labels file of another split is refused); the graph is
untouched (a plan with ``--steps N`` reproduces the pipeline exactly); a second run with the same options
reports ``modified=False``.

Sketch: runs (grid counts + the reference schedule + the x0 trajectory of ``online_max_steps``) for the
calibration prompts -> labels ``min_steps(tau)`` -> ridge head with cross-validated offset for the quality
target ``1 - budget/100`` (share of prompts whose image reaches SSIM >= tau to the reference) -> stop-rule
threshold for the same target -> ``default_policy``: the one with fewer mean steps on calibration (or as
given).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnx_ir as ir

from dyncompile.errors import DataError, PassConfigError
from dyncompile.io import sha256_file
from dyncompile.passes import _keys
from dyncompile.passes._infra import register_pass
from dyncompile.passes.step_saver import calibrate as cal
from dyncompile.passes.step_saver.pipeline import read_pipeline

logger = logging.getLogger(__name__)

__all__ = ["StepSaverPass"]


def _pipeline_features(pipe, prompts: list[str]):
    """Text states and pooled features of prompts through the pipeline's own text encoder and tokenizer."""
    import onnxruntime as ort

    from dyncompile.runtime.diffusion.denoise import mean_pool
    from dyncompile.runtime.text import TextEncoder

    conv = pipe.conventions
    tok = TextEncoder(pipe.tokenizer, max_length=int(conv["tokenizer_max_length"]), padding=conv["tokenizer_padding"])
    sess = ort.InferenceSession(str(pipe.text_encoder), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    ctx, feats = [], []
    null = None
    for i in range(0, len(prompts), 256):
        feeds = tok([conv["null_prompt"], *prompts[i : i + 256]])
        h = sess.run([conv["text_encoder_output"]], {n: feeds[n] for n in names})[0].astype(np.float32)
        null = h[:1]
        ctx.append(h[1:])
        feats.append(mean_pool(h[1:], feeds["attention_mask"][1:]))
    return np.concatenate(ctx), null, np.concatenate(feats)


class StepSaverPass(ir.passes.InPlacePass):
    """Fit the step predictor and the online stop rule on calibration prompts; record them for the plan.

    Args:
        pipeline_dir: the pipeline folder being compiled.
        labels: a runs file of TRAIN prompts (``tools/stepsaver_data.py generate``; several joined with ``+``); or
        calib: a JSONL of calibration prompts (``prompt`` or ``text``; optional ``seed``) to generate the runs here.
        tau: SSIM to the reference image that counts as converged (default 0.95).
        budget: percentage points of calibration prompts allowed to miss ``tau`` (default 10).
        grid: step counts the predictor chooses from (default: the runs' counts up to 50).
        reference_steps: the long schedule (default 200); online_max_steps / online_min_steps of the stop rule.
        default_policy: ``auto`` (fewer mean steps on calibration), ``predicted`` or ``online``.
    """

    def __init__(self, pipeline_dir, *, labels=None, calib=None, tau=0.95, budget=10.0, grid=None, reference_steps=200,
                 online_max_steps=50, online_min_steps=3, default_policy="auto", limit=256, workers=1) -> None:
        super().__init__()
        if not pipeline_dir:
            raise PassConfigError("step-saver runs on a pipeline folder: dyncompile PIPELINE_DIR --passes step-saver ...")
        if (labels is None) == (calib is None):
            raise PassConfigError("step-saver needs labels=RUNS.npz (TRAIN-prompt runs) or --calib PROMPTS.jsonl, not both")
        if not 0 < tau < 1:
            raise PassConfigError(f"step-saver tau={tau} must be in (0, 1)")
        if not 0 <= budget < 100:
            raise PassConfigError(f"step-saver budget={budget} must be in [0, 100) percentage points")
        if default_policy not in ("auto", "predicted", "online"):
            raise PassConfigError(f"step-saver default_policy={default_policy!r}: auto, predicted or online")
        self.pipeline_dir = str(pipeline_dir)
        self.labels = labels
        self.calib = calib
        self.tau = float(tau)
        self.budget = float(budget)
        self.grid = [int(g) for g in str(grid).split("/")] if grid else None
        self.reference_steps = int(reference_steps)
        self.online_max_steps = int(online_max_steps)
        self.online_min_steps = int(online_min_steps)
        self.default_policy = default_policy
        self.limit = int(limit)
        self.workers = int(workers)

    def __repr__(self) -> str:
        src = f"labels={self.labels!r}" if self.labels else f"calib={self.calib!r}"
        return (f"StepSaverPass({src}, tau={self.tau}, budget={self.budget}, grid={self.grid}, "
                f"reference_steps={self.reference_steps}, online_max_steps={self.online_max_steps}, "
                f"default_policy={self.default_policy!r})")

    def _fingerprint(self) -> str:
        return repr(self)

    def _runs(self, pipe) -> tuple[dict[str, np.ndarray], list[dict], dict]:
        if self.labels:
            p = Path(str(self.labels).split("+")[0])
            runs, meta = cal.load_runs(self.labels)
            if meta.get("split") != "train":
                raise PassConfigError(
                    f"{p} holds runs of {meta.get('split')!r} prompts; calibrate on TRAIN captions only "
                    "(held-out prompts are for reporting)"
                )
            want = meta.get("unet_sha256")
            have = sha256_file(pipe.unet)
            if want and want != have:  # a re-serialised (cleaned) copy has other bytes but the same function
                logger.warning("%s was generated with U-Net file sha256 %s…, this pipeline's U-Net is %s…: make sure it is "
                               "the same model (a cleaned copy is), else regenerate the runs", p, want[:12], have[:12])
            return runs, meta["rows"], meta
        rows = _read_calib(self.calib, self.limit)
        ctx, null, _ = _pipeline_features(pipe, [r["prompt"] for r in rows])
        from dyncompile.runtime.diffusion.denoise import make_noise

        conv = pipe.conventions
        grid = self.grid or [5, 10, 15, 20, 30, 50]
        counts = sorted(set(grid) | {self.reference_steps, self.online_max_steps})
        noise = make_noise([r["seed"] for r in rows], conv["sample_shape"], "numpy")
        runs = cal.generation_runs(str(pipe.unet), pipe.scheduler_config, float(conv["guidance_scale"]), conv.get("output_crop"),
                                   ctx, null, noise, counts, self.reference_steps, self.online_max_steps, workers=self.workers)
        return runs, rows, {"split": "train", "noise": "numpy"}

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Run the rewrite on ``model`` (scope and invariants: the class docstring)."""
        old = model.metadata_props.get(_keys.STEP_SAVER)
        if old and json.loads(old).get("fingerprint") == self._fingerprint():
            return ir.passes.PassResult(model, modified=False)
        pipe = read_pipeline(self.pipeline_dir)
        runs, rows, meta = self._runs(pipe)
        counts = [int(c) for c in runs["counts"]]
        if self.reference_steps not in counts or self.online_max_steps not in counts:
            raise PassConfigError(f"the runs have step counts {counts}; they need reference_steps={self.reference_steps} "
                                  f"and online_max_steps={self.online_max_steps}")
        grid = self.grid or [c for c in counts if c <= 50]
        missing = [g for g in grid if g not in counts]
        if missing:
            raise PassConfigError(f"grid counts {missing} were not generated (runs have {counts})")
        ssim_grid = runs["ssim"][:, [counts.index(g) for g in grid]]
        labels = cal.min_steps(ssim_grid, grid, self.tau)
        _, _, feats = _pipeline_features(pipe, [r["prompt"] for r in rows])
        target = 1 - self.budget / 100
        head, cv_pred, fit = cal.fit_step_head(feats, np.log2(labels))
        offset, pred_rep = cal.calibrate_offset(cv_pred, ssim_grid, grid, self.tau, target)
        rule, rule_rep = cal.calibrate_stop_rule(runs["traj_change"], runs["traj_ssim"], self.tau, target,
                                                 self.online_max_steps, self.online_min_steps)
        policy = self.default_policy
        if policy == "auto":
            policy = "online" if rule_rep["mean_steps"] < pred_rep["mean_steps"] else "predicted"
        record: dict[str, Any] = {
            "fingerprint": self._fingerprint(),
            "head": {**head, "offset": offset, "grid": grid},
            "stop_rule": rule.to_dict(),
            "default_policy": policy,
            "fixed_steps": int(grid[-1]),
            "calibration": {
                "prompts": len(rows), "split": meta.get("split"), "noise": meta.get("noise"), "tau": self.tau,
                "budget_points": self.budget, "target_share_converged": target, "reference_steps": self.reference_steps,
                "grid": grid, "label_mean_steps": float(labels.mean()),
                "label_quartiles": [float(q) for q in np.quantile(labels, [0.25, 0.5, 0.75])],
                "fit": fit, "predicted_cv": pred_rep, "online": rule_rep,
            },
        }
        model.metadata_props[_keys.STEP_SAVER] = json.dumps(record)
        logger.info("step-saver: predicted %s, online %s, default %s", pred_rep, rule_rep, policy)
        return ir.passes.PassResult(model, modified=True)


def _read_calib(path, limit: int) -> list[dict]:
    import gzip

    p = Path(path)
    if not p.is_file():
        raise DataError(f"calibration prompts not found: {p}")
    opener = gzip.open if p.suffix == ".gz" else open
    rows = []
    with opener(p, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            r = json.loads(line)
            text = r.get("prompt", r.get("text"))
            if not isinstance(text, str) or not text.strip():
                raise DataError(f"{p} line {i + 1}: needs a non-empty 'prompt' (or 'text') field")
            rows.append({"prompt": text, "seed": int(r.get("seed", 1_000_000 + i))})
            if len(rows) >= limit:
                break
    if len(rows) < 8:
        raise DataError(f"{p}: {len(rows)} calibration prompts; the step-saver needs at least 8")
    return rows


@register_pass(
    "step-saver",
    help="diffusion pipelines: per-prompt step count from the text features (fitted head, quality budget) and an "
    "online stop rule; labels=RUNS.npz of TRAIN prompts or --calib PROMPTS.jsonl; tau=0.95, budget=10 (points)",
)
def _make_step_saver(context, labels: str | None = None, tau: float = 0.95, budget: float | None = None,
                     grid: str | None = None, reference_steps: int = 200, online_max_steps: int = 50,
                     online_min_steps: int = 3, default_policy: Literal["auto", "predicted", "online"] = "auto",
                     limit: int = 256, workers: int = 1):
    if budget is None:
        budget = context.options.get("budget")
    return StepSaverPass(
        context.options.get("pipeline_dir"), labels=labels, calib=None if labels else context.options.get("calib"),
        tau=tau, budget=10.0 if budget is None else budget, grid=grid,
        reference_steps=reference_steps, online_max_steps=online_max_steps, online_min_steps=online_min_steps,
        default_policy=default_policy, limit=limit, workers=workers,
    )

