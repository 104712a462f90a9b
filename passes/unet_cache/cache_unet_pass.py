"""``cache-unet``: DeepCache-style feature caching across denoising steps, cut at a U-Net skip connection.

Scope: the U-Net of a pipeline-folder compile (``dyncompile PIPELINE_DIR --passes cache-unet{...}``). The pass
finds the skip Concats of the graph (:mod:`.structure`), picks a cut depth, and adds the deep feature at that
cut (the up-path tensor the skip Concat joins with a shallow skip) as a second graph output. The ``diffusion``
emitter then writes two graphs: the full U-Net (with that output) and the shallow graph cut out of the final
graph (the deep feature as an input; only the shallow down blocks and the up blocks after the cut), and a
``feature_cache`` block in ``diffusion_denoise``: refresh steps run the full graph, the others the shallow one
on the cached feature. Because the shallow graph is cut at emit time, passes that run after this one (e.g.
``quantize-int8``) apply to both graphs.

Choice of cut and schedule: given (``depth=``, ``interval=``, ``warmup=``, ``refresh_steps=``; ``schedules=`` for
a table by step count, ``STEPS:INTERVAL[:WARMUP[:FINAL]]`` rows joined by ``/``), or calibrated
on calibration prompts (``--calib PROMPTS.jsonl``, TRAIN captions; seed 1,000,000 + line index unless the line
has a ``seed``). The quality measure is the bench's: mean SSIM to the ``reference_steps`` image of the same
prompt and seed, compared with the uncached loop at the same ``steps``, with the asset's noise (``noise=torch``:
``torch.randn`` seeded per prompt, as the bench; ``noise=numpy`` needs no torch). The reference images and the
uncached loop are computed once. The candidates (depth <= ``max_depth``, ``intervals``, and each schedule form:
uniform, denser refresh early (``warmup``), late (``final``) or both, over ``steps/10`` and ``steps/5`` steps) are
tried in order of estimated cost (MACs of the shallow graph, from shape inference); the first within
``max_ssim_drop`` — the cheapest — wins. If none is, the pass stops with an error that names the nearest
candidate. The choice, its measured quality and its worst prompt go into the plan (``feature_cache.calibration``).

A table by step count (``steps=5/10/15/20/30``, or ``steps=grid``: the grid of a ``step-saver`` that ran
before): each step count gets its own cheapest rule within ``max_ssim_drop`` of the uncached loop *at that step
count* (on all calibration prompts), and "no caching" (interval 1) when no candidate is; the cut depth is shared
(one shallow graph): the depth with the lowest mean estimated cost over the rows wins (``depth=`` fixes it). The
table and each row's measured quality go into the plan (``feature_cache.schedules``); the runtime picks the row
from the step count each prompt runs (StepSaver's per-prompt counts).

Invariants: the noise prediction output is unchanged (the full graph only gains an output; ``interval`` 1 gives
the uncached loop's outputs); a graph without a skip Concat is left alone with a warning that says why; a
second run with the same options reports ``modified=False``.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np
import onnx_ir as ir

from dyncompile.errors import PassConfigError
from dyncompile.passes import _keys
from dyncompile.passes._infra import register_pass
from dyncompile.passes.unet_cache.structure import (
    annotate,
    find_skip_concats,
    node_macs,
    part_cost,
    shallow_model,
)

logger = logging.getLogger(__name__)

__all__ = ["CacheUNetFeaturesPass", "refresh_count", "schedule"]


def _ints(v, what: str) -> list[int] | None:
    if v is None or v == "":
        return None
    try:
        out = [int(x) for x in (v.split("/") if isinstance(v, str) else v)]
    except (TypeError, ValueError):
        raise PassConfigError(f"cache-unet {what}={v!r}: integers separated by '/' (e.g. 0/1/2/4)") from None
    return out


def _table(v) -> list[dict] | None:
    """``STEPS:INTERVAL[:WARMUP[:FINAL]]`` rows joined by ``/`` (``5:1/10:2:0:3``) -> the plan's ``schedules`` rows."""
    if v is None or v == "":
        return None
    rows = []
    try:
        for part in str(v).split("/"):
            f = [int(x) for x in part.split(":")]
            if not 2 <= len(f) <= 4 or min(f) < 0 or f[0] < 1 or f[1] < 1:
                raise ValueError
            f += [0] * (4 - len(f))
            rows.append({"steps": f[0], "interval": f[1], "warmup": f[2], "final": f[3], "refresh_steps": None,
                         "quality": None})
    except ValueError:
        raise PassConfigError(f"cache-unet schedules={v!r}: rows STEPS:INTERVAL[:WARMUP[:FINAL]] joined by '/', e.g. "
                              "5:1/10:2:0:3/20:3:0:5 (interval 1 = no caching at that step count)") from None
    if [r["steps"] for r in rows] != sorted({r["steps"] for r in rows}):
        raise PassConfigError(f"cache-unet schedules={v!r}: the rows' step counts must increase")
    return rows


def schedule(interval: int, warmup: int = 0, final: int = 0, refresh_steps: list[int] | None = None):
    """The plan's refresh rule (:class:`~dyncompile.plan.FeatureCacheParams`) for these options."""
    from dyncompile.plan import FeatureCacheParams

    return FeatureCacheParams("s", "d", "d", 1, interval, warmup, final, refresh_steps)


def refresh_count(k: int, interval: int, warmup: int = 0, refresh_steps: list[int] | None = None, final: int = 0) -> int:
    """How many of ``k`` steps run the full graph (the plan's rule)."""
    p = schedule(interval, warmup, final, refresh_steps)
    return sum(p.refreshes(i, None, k) for i in range(k))


class CacheUNetFeaturesPass(ir.passes.InPlacePass):
    """Add the deep feature at a U-Net skip connection as an output and record the cache schedule for the plan.

    Args:
        pipeline_dir: the pipeline folder (for calibration; None with an explicit depth and interval).
        depth: cut at the depth-th skip Concat counted from the output (1 = highest resolution); None: calibrate.
        interval: refresh every ``interval`` steps (1 = caching off); None: calibrate (at ``depth`` if given).
        schedules: an explicit table by step count, ``STEPS:INTERVAL[:WARMUP[:FINAL]]`` rows joined by ``/`` (e.g. a
            calibrated plan's table, compiled again without calibrating); needs ``depth``.
        warmup: the first ``warmup`` steps always refresh; final: the last ``final`` steps always refresh.
        refresh_steps: an explicit schedule of 0-based refresh steps (``0/1/2/4/8``), then every ``interval``.
        calib: a JSONL of calibration prompts (``prompt`` or ``text``; optional ``seed``): TRAIN captions.
        max_ssim_drop: calibration budget: mean SSIM to the reference image within this of the uncached loop's.
        steps: the step count calibration measures at (an int); several (``5/10/15``) or ``grid`` (the step-saver
            grid): a table with one calibrated rule per step count. reference_steps: the long schedule (200).
        max_depth / intervals: the calibration candidates; limit: calibration prompts used.
        reference: an ``.npz`` file that keeps the reference images (the costliest part of calibration) for the
            next compile: read when its key (prompts, seeds, noise, reference steps, guidance, scheduler, U-Net graph)
            matches, else computed and written.
    """

    def __init__(self, pipeline_dir=None, *, depth=None, interval=None, warmup=0, final=0, refresh_steps=None, calib=None,
                 schedules=None, max_ssim_drop=0.01, steps=20, reference_steps=200, max_depth=3, intervals="2/3/4/5/6", limit=48,
                 noise="torch", reference=None) -> None:
        super().__init__()
        self.depth = None if depth is None else int(depth)
        self.interval = None if interval is None else int(interval)
        self.warmup = int(warmup)
        self.final = int(final)
        self.refresh_steps = _ints(refresh_steps, "refresh_steps")
        if self.refresh_steps is not None and (self.refresh_steps[0] != 0 or self.refresh_steps != sorted(set(self.refresh_steps))):
            raise PassConfigError(f"cache-unet refresh_steps={refresh_steps!r}: increasing step indices starting at 0")
        if self.depth is not None and self.depth < 1:
            raise PassConfigError(f"cache-unet depth={depth}: 1 (the skip connection nearest the output) or more")
        if self.interval is not None and self.interval < 1:
            raise PassConfigError(f"cache-unet interval={interval}: 1 (refresh every step) or more")
        if self.warmup < 0 or self.final < 0:
            raise PassConfigError(f"cache-unet warmup={warmup}, final={final} must be >= 0")
        self.schedules = _table(schedules)
        if self.schedules is not None:
            if self.depth is None:
                raise PassConfigError("cache-unet schedules= (a table by step count) needs depth= (the cut)")
            if self.interval is None:  # the plan's own rule (used where no step count is known): the last row's
                last = self.schedules[-1]
                self.interval, self.warmup, self.final = last["interval"], last["warmup"], last["final"]
        explicit = self.depth is not None and self.interval is not None
        if explicit and calib and (isinstance(steps, str) and not steps.strip().isdigit()):
            raise PassConfigError(f"cache-unet steps={steps!r} (a table by step count) is calibrated: drop interval= "
                                  "(depth= may stay) or give a single steps=")
        if not explicit and not calib:
            raise PassConfigError("cache-unet needs depth= and interval= (e.g. cache-unet{depth=2,interval=3}), or "
                                  "--calib PROMPTS.jsonl (TRAIN captions) to choose them for max_ssim_drop")
        if not explicit and not pipeline_dir:
            raise PassConfigError("cache-unet calibration runs on a pipeline folder: dyncompile PIPELINE_DIR --passes cache-unet")
        if not 0 < float(max_ssim_drop) < 1:
            raise PassConfigError(f"cache-unet max_ssim_drop={max_ssim_drop} must be in (0, 1)")
        self.pipeline_dir = None if pipeline_dir is None else str(pipeline_dir)
        self.calib = None if explicit else str(calib)
        self.max_ssim_drop = float(max_ssim_drop)
        self.grid = isinstance(steps, str) and steps.strip() == "grid"
        self.steps_list = None if self.grid else _ints(str(steps) if isinstance(steps, int) else steps, "steps")
        if self.steps_list is not None and (not self.steps_list or self.steps_list != sorted(set(self.steps_list))
                                            or self.steps_list[0] < 1):
            raise PassConfigError(f"cache-unet steps={steps!r}: a step count, increasing step counts (5/10/15) or 'grid'")
        self.table = self.grid or len(self.steps_list) > 1
        self.steps = None if self.table else self.steps_list[0]
        self.reference_steps = int(reference_steps)
        self.max_depth = int(max_depth)
        self.intervals = _ints(intervals, "intervals") or [2, 3, 4, 5, 6]
        self.limit = int(limit)
        if noise not in ("torch", "numpy"):
            raise PassConfigError(f"cache-unet noise={noise!r}: 'torch' (the asset's seeds, as the bench) or 'numpy'")
        self.noise = noise
        self.reference = None if reference in (None, "") else str(reference)

    def __repr__(self) -> str:
        steps = "grid" if self.grid else "/".join(map(str, self.steps_list))
        table = "" if not self.schedules else ", schedules=" + "/".join(
            f"{r['steps']}:{r['interval']}:{r['warmup']}:{r['final']}" for r in self.schedules)
        src = (f"depth={self.depth}, interval={self.interval}{table}" if self.calib is None else
               f"calib={self.calib!r}, depth={self.depth}, max_ssim_drop={self.max_ssim_drop}, steps={steps}, "
               f"max_depth={self.max_depth}, intervals={self.intervals}, limit={self.limit}, noise={self.noise}")
        return f"CacheUNetFeaturesPass({src}, warmup={self.warmup}, final={self.final}, refresh_steps={self.refresh_steps})"

    def requires(self, model: ir.Model) -> None:
        """Refuse a model that is not a denoiser of (sample, timestep, text states) with one prediction output."""
        g = model.graph
        if len(g.inputs) != 3 or not g.outputs:
            raise ir.passes.PreconditionError(
                f"cache-unet runs on a diffusion U-Net (sample, timestep, encoder_hidden_states) -> noise prediction; "
                f"this graph has inputs {[v.name for v in g.inputs]}")

    def ensures(self, model: ir.Model) -> None:
        """The noise prediction stays the first output; a recorded cut's deep feature is the second."""
        rec = model.metadata_props.get(_keys.UNET_CACHE)
        if rec and [v.name for v in model.graph.outputs][1:2] != [json.loads(rec)["deep_output"]]:
            raise ir.passes.PostconditionError(f"cache-unet must output (prediction, deep feature), got "
                                               f"{[v.name for v in model.graph.outputs]}")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Run the rewrite on ``model`` (scope and invariants: the class docstring)."""
        old = model.metadata_props.get(_keys.UNET_CACHE)
        if old and json.loads(old).get("fingerprint") == repr(self):
            return ir.passes.PassResult(model, modified=False)
        if old:
            raise PassConfigError("cache-unet already ran on this U-Net with other options; compile from the original")
        skips, why = find_skip_concats(model.graph)
        if not skips:
            logger.warning("cache-unet: nothing to cache: %s. The pass applies to diffusers-style U-Nets (down blocks, "
                           "mid block, up blocks joined by channel Concats); the plan runs the U-Net every step", why)
            return ir.passes.PassResult(model, modified=False)
        macs = node_macs(model)
        full = sum(macs.values()) or 1.0
        shares = [part_cost(macs, shallow_model(model, s.deep)) / full for s in skips]
        if self.calib is None:
            if self.depth > len(skips):
                raise PassConfigError(f"cache-unet depth={self.depth}: this U-Net has {len(skips)} skip connections "
                                      f"(depth 1..{len(skips)})")
            depth, interval, warmup, final, refresh = self.depth, self.interval, self.warmup, self.final, self.refresh_steps
            calibration, table = None, self.schedules
        else:
            if self.depth is not None and self.depth > len(skips):
                raise PassConfigError(f"cache-unet depth={self.depth}: this U-Net has {len(skips)} skip connections "
                                      f"(depth 1..{len(skips)})")
            depth, interval, warmup, final, refresh, calibration, table = self._calibrate(model, skips, shares)
        cut = skips[depth - 1]
        annotate(model, [cut.deep])
        deep = next(v for n in model.graph for v in n.outputs if v.name == cut.deep)
        model.graph.outputs.append(deep)
        record: dict[str, Any] = {
            "fingerprint": repr(self),
            "depth": depth, "deep_output": cut.deep, "concat": cut.node, "interval": interval, "warmup": warmup,
            "final": final, "refresh_steps": refresh,
            "structure": {"skip_concats": len(skips), "shallow_mac_share": [round(s, 4) for s in shares]},
            "calibration": calibration, "schedules": table,
        }
        model.metadata_props[_keys.UNET_CACHE] = json.dumps(record)
        logger.info("cache-unet: cut at depth %d (%s), shallow part %.1f%% of the MACs, interval %d, warmup %d, final %d%s",
                    depth, cut.node, 100 * shares[depth - 1], interval, warmup, final,
                    "" if not table else "; by step count: " + ", ".join(
                        f"{r['steps']}: " + ("off" if r["interval"] == 1 else f"{r['interval']}/{r['warmup']}/{r['final']}")
                        for r in table))
        return ir.passes.PassResult(model, modified=True)

    def _candidates(self, steps: int, depths: list[int], shares: list[float]) -> list[tuple]:
        """(estimated cost per step, depth, interval, warmup, final), cheapest first."""
        forms = {(0, 0)}
        for e in {max(1, steps // 10), max(1, steps // 5)}:
            forms |= {(e, 0), (0, e), (e, e)}
        cands, seen = [], set()
        for d in depths:
            for n in self.intervals:
                for w, f in sorted(forms):
                    rule = schedule(n, w, f)
                    pattern = tuple(k for k in range(steps) if rule.refreshes(k, None, steps))
                    if (d, pattern) in seen:  # the same refresh steps as a candidate already listed
                        continue
                    seen.add((d, pattern))
                    full = len(pattern)
                    cost = (full + (steps - full) * shares[d - 1]) / steps
                    if cost < 1:
                        cands.append((round(cost, 6), d, n, w, f))
        return sorted(cands)

    def _search(self, run, ctx, null, noise, ref, steps: int, depths: list[int], shares, scale):
        """The cheapest candidate at ``steps`` within the budget (or None), every candidate tried, the uncached SSIM."""
        from dyncompile.passes.step_saver.metrics import ssim
        from dyncompile.runtime.diffusion.denoise import to_uint8

        base_per = ssim(to_uint8(run.sample(None, None, ctx, null, noise, steps, scale), run.crop), ref)
        base = float(base_per.mean())
        tried, chosen = [], None
        for cost, d, n, w, f in self._candidates(steps, depths, shares):
            img = to_uint8(run.sample(d, schedule(n, w, f), ctx, null, noise, steps, scale), run.crop)
            per = ssim(img, ref)
            m = float(per.mean())
            tried.append({"depth": d, "interval": n, "warmup": w, "final": f, "est_cost": round(cost, 4),
                          "mean_ssim": round(m, 5), "worst_prompt_drop": round(float((base_per - per).max()), 4)})
            logger.info("cache-unet calibration at %d steps: depth %d interval %d warmup %d final %d: est. cost %.3f, "
                        "mean SSIM %.4f (uncached %.4f)", steps, d, n, w, f, cost, m, base)
            if base - m <= self.max_ssim_drop:
                chosen = tried[-1]
                break
        return chosen, tried, base

    def _calibrate(self, model: ir.Model, skips, shares):
        from dyncompile.passes.step_saver.pipeline import read_pipeline
        from dyncompile.passes.step_saver.step_saver_pass import _pipeline_features, _read_calib
        from dyncompile.runtime.diffusion.denoise import make_noise
        from dyncompile.runtime.rules.schedulers import make_scheduler

        step_list = self._step_list(model)
        pipe = read_pipeline(self.pipeline_dir)
        conv = pipe.conventions
        rows = _read_calib(self.calib, self.limit)
        ctx, null, _ = _pipeline_features(pipe, [r["prompt"] for r in rows])
        shape = conv.get("sample_shape") or [int(d) for d in list(model.graph.inputs[0].shape)[1:]]
        noise = make_noise([r["seed"] for r in rows], shape, self.noise)
        scale, crop = float(conv["guidance_scale"]), conv.get("output_crop")
        run = _Runner(model, skips, make_scheduler(pipe.scheduler_config), crop)
        ref = self._reference(model, run, rows, pipe, ctx, null, noise, scale, crop)
        depths = [self.depth] if self.depth is not None else list(range(1, min(self.max_depth, len(skips)) + 1))
        head = {"prompts": len(rows), "split": "calibration", "noise": self.noise, "reference_steps": self.reference_steps,
                "max_ssim_drop": self.max_ssim_drop}
        if not self.table:
            return self._calibrate_one(run, ctx, null, noise, ref, depths, shares, scale, head, len(rows))
        # a table by step count: one rule per step count at a shared depth (one shallow graph)
        per_depth = {}
        for d in depths:
            table = []
            for k in step_list:
                chosen, tried, base = self._search(run, ctx, null, noise, ref, k, [d], shares, scale)
                c = chosen or {"interval": 1, "warmup": 0, "final": 0, "est_cost": 1.0, "mean_ssim": round(base, 5),
                               "worst_prompt_drop": 0.0}
                table.append({"steps": k, "interval": c["interval"], "warmup": c["warmup"], "final": c["final"],
                              "refresh_steps": None, "quality": {
                                  "uncached_mean_ssim": round(base, 5), "mean_ssim": c["mean_ssim"],
                                  "ssim_drop": round(base - c["mean_ssim"], 5), "worst_prompt_drop": c["worst_prompt_drop"],
                                  "est_cost_per_step": c["est_cost"], "tried": tried}})
            per_depth[d] = (float(np.mean([r["quality"]["est_cost_per_step"] for r in table])), table)
        depth = min(per_depth, key=lambda d: (per_depth[d][0], d))
        cost, table = per_depth[depth]
        last = table[-1]
        calibration = head | {"steps": step_list, "by_steps": True, "mean_est_cost_per_step": round(cost, 4),
                              "depths_tried": {str(d): round(c, 4) for d, (c, _) in per_depth.items()}}
        return depth, last["interval"], last["warmup"], last["final"], None, calibration, table

    def _reference(self, model, run, rows, pipe, ctx, null, noise, scale, crop) -> np.ndarray:
        """The ``reference_steps`` images of the calibration prompts (from ``reference=`` when its key matches)."""
        import hashlib
        import os
        from pathlib import Path

        from dyncompile.runtime.diffusion.denoise import to_uint8

        key = hashlib.sha256(json.dumps([[r["prompt"] for r in rows], [r["seed"] for r in rows], self.noise,
                                         self.reference_steps, scale, pipe.scheduler_config, crop]).encode())
        key.update(ir.to_proto(model).graph.SerializeToString())
        key = key.hexdigest()
        path = None if self.reference is None else Path(self.reference)
        if path is not None and path.is_file():
            with np.load(path, allow_pickle=False) as f:
                if str(f["key"]) == key:
                    logger.info("cache-unet calibration: reference images from %s", path)
                    return f["images"]
            logger.warning("cache-unet: %s holds reference images of other prompts, settings or U-Net; computing them "
                           "again and replacing the file", path)
        ref = to_uint8(run.sample(None, None, ctx, null, noise, self.reference_steps, scale), crop)
        if path is not None:
            tmp = path.with_name(path.name + ".tmp.npz")
            np.savez(tmp, images=ref, key=np.array(key))
            os.replace(tmp, path)
        return ref

    def _step_list(self, model: ir.Model) -> list[int]:
        if not self.grid:
            return self.steps_list
        meta = model.metadata_props.get(_keys.STEP_SAVER)
        if not meta:
            raise PassConfigError("cache-unet steps=grid takes the step counts of the step-saver grid: run step-saver "
                                  "before cache-unet (--passes step-saver{...},cache-unet{...}) or list them (steps=5/10/15)")
        return [int(k) for k in json.loads(meta)["head"]["grid"]]

    def _calibrate_one(self, run, ctx, null, noise, ref, depths, shares, scale, head, n):
        chosen, tried, base = self._search(run, ctx, null, noise, ref, self.steps, depths, shares, scale)
        if chosen is None:
            near = max(tried, key=lambda t: t["mean_ssim"]) if tried else None
            nearest = "" if near is None else (
                f"; the nearest was depth {near['depth']}, interval {near['interval']}, warmup {near['warmup']}, final "
                f"{near['final']} at {near['mean_ssim']:.4f} (drop {base - near['mean_ssim']:.4f})")
            raise PassConfigError(f"cache-unet: no candidate keeps mean SSIM within {self.max_ssim_drop} of the uncached "
                                  f"loop's {base:.4f} at {self.steps} steps on {n} calibration prompts "
                                  f"(tried {len(tried)}{nearest}); raise max_ssim_drop or limit=, or give depth= and interval=")
        c = chosen
        calibration = head | {"steps": self.steps, "uncached_mean_ssim": round(base, 5), "chosen_mean_ssim": c["mean_ssim"],
                              "ssim_drop": round(base - c["mean_ssim"], 5), "worst_prompt_drop": c["worst_prompt_drop"],
                              "est_cost_per_step": c["est_cost"], "tried": tried}
        return c["depth"], c["interval"], c["warmup"], c["final"], None, calibration, None


class _Runner:
    """The runtime's denoising loop over in-memory ORT sessions of the full graph and each candidate cut."""

    def __init__(self, model: ir.Model, skips, scheduler, crop) -> None:
        import onnxruntime as ort

        self.model, self.skips, self.scheduler, self.crop = model, skips, scheduler, crop
        self._ort = ort
        self.sessions: dict[int, Any] = {}
        proto = ir.to_proto(model)
        self.plain = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])

    def _pair(self, d: int):
        if d not in self.sessions:
            cut = self.skips[d - 1]
            annotate(self.model, [cut.deep])
            deep = next(v for n in self.model.graph for v in n.outputs if v.name == cut.deep)
            self.model.graph.outputs.append(deep)
            try:
                full = ir.to_proto(self.model)
            finally:
                self.model.graph.outputs.pop()
            shallow = ir.to_proto(shallow_model(self.model, cut.deep))
            self.sessions[d] = (self._ort.InferenceSession(full.SerializeToString(), providers=["CPUExecutionProvider"]),
                                self._ort.InferenceSession(shallow.SerializeToString(), providers=["CPUExecutionProvider"]))
        return self.sessions[d]

    def sample(self, depth, sched, ctx, null, noise, steps, scale) -> np.ndarray:
        from dyncompile.runtime.diffusion.denoise import Denoiser, FeatureCache

        names = [i.name for i in self.plain.get_inputs()]
        s, t, c = names[0], names[1], names[2]
        out0 = self.plain.get_outputs()[0].name

        def plain(x, ts, st):
            return self.plain.run([out0], {s: x, t: ts, c: st})[0]

        cache = None
        if depth is not None:
            full, shallow = self._pair(depth)
            deep = self.skips[depth - 1].deep
            snames = {i.name for i in shallow.get_inputs()}

            def f(x, ts, st):
                e, h = full.run([out0, deep], {s: x, t: ts, c: st})
                return e, h

            def sh(x, ts, st, h):
                feeds = {s: x, t: ts, deep: h}
                if c in snames:
                    feeds[c] = st
                return shallow.run(None, feeds)[0]

            cache = FeatureCache(f, sh, sched.refreshes)
        den = Denoiser(plain, self.scheduler, crop=self.crop, cache=cache)
        out = []
        for i in range(0, len(noise), 16):
            out.append(den.sample(ctx[i:i + 16], null, noise[i:i + 16], steps, scale)["samples"])
        return np.concatenate(out)


@register_pass(
    "cache-unet",
    help="diffusion U-Nets: DeepCache-style feature caching: cut at a skip connection, run the deep part only on "
    "refresh steps; depth=D,interval=N (warmup=W, final=F, refresh_steps=0/1/2/4; schedules=5:1/10:2:0:3 per step "
    "count) or --calib PROMPTS.jsonl with "
    "max_ssim_drop=0.01 (steps=20; steps=5/10/15 or steps=grid: one calibrated rule per step count)",
)
def _make_cache_unet(context, depth: int | None = None, interval: int | None = None, warmup: int = 0, final: int = 0,
                     refresh_steps: str | None = None, schedules: str | None = None, max_ssim_drop: float = 0.01,
                     steps: str = "20",
                     reference_steps: int = 200, max_depth: int = 3, intervals: str = "2/3/4/5/6", limit: int = 48,
                     noise: str = "torch", reference: str | None = None):
    return CacheUNetFeaturesPass(
        context.options.get("pipeline_dir"), depth=depth, interval=interval, warmup=warmup, final=final, refresh_steps=refresh_steps,
        schedules=schedules,
        calib=context.options.get("calib"), max_ssim_drop=max_ssim_drop, steps=steps, reference_steps=reference_steps,
        max_depth=max_depth, intervals=intervals, limit=limit, noise=noise, reference=reference,
    )
