"""The step-saver pass on the real fashion-diffusion pipeline (tiny calibration: short schedules, 8 TRAIN captions)."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from helpers import SHARED

import dyncompile
from dyncompile.errors import PlanError

ASSET = SHARED / "assets" / "fashion-diffusion"
OPTS = "grid=2/3/5,reference_steps=10,online_max_steps=5,online_min_steps=2,limit=8,budget=25"


@pytest.fixture(scope="module")
def pipeline_dir() -> Path:
    from dyncompile.models import build_model

    return build_model("fashion-diffusion", progress=False).dir


@pytest.fixture(scope="module")
def calib_file(module_tmp) -> Path:
    p = module_tmp("calib") / "train-8.jsonl"
    with gzip.open(ASSET / "prompts" / "train-captions.jsonl.gz", "rt") as f:
        rows = [json.loads(next(f)) for _ in range(8)]
    p.write_text("".join(json.dumps({"prompt": r["prompt"], "seed": i}) + "\n" for i, r in enumerate(rows)))
    return p


@pytest.fixture(scope="module")
def ss_plan_dir(pipeline_dir, calib_file, module_tmp) -> Path:
    out = module_tmp("ss") / "plan"
    dyncompile.compile(pipeline_dir, f"verify,cleanup,step-saver{{{OPTS}}}", out, calib=str(calib_file), progress=False)
    return out


def test_plan_has_the_lowered_predictor_and_stop_rule(ss_plan_dir):
    raw = json.loads((ss_plan_dir / "plan.json").read_text())
    assert [s["kind"] for s in raw["steps"]] == ["diffusion_encode", "predict_steps", "diffusion_denoise"]
    head = raw["steps"][1]
    assert head["grid"] == [2, 3, 5] and len(head["weights"]) == 384
    rule = raw["steps"][2]["stop_rule"]
    assert rule["kind"] == "x0_change" and rule["max_steps"] == 5 and rule["min_steps"] == 2
    cal = raw["policy"]["step_saver"]["calibration"]
    assert cal["prompts"] == 8 and cal["split"] == "train" and cal["target_share_converged"] == 0.75
    assert raw["steps"][2]["default_policy"] in ("predicted", "online")


def test_policies_at_run_time(ss_plan_dir):

    m = dyncompile.load(ss_plan_dir)
    prompts = ["an image of trousers", "light coloured bag with a pattern"]
    pred = m.generate_images(prompts, seed=0, policy="predicted")
    assert set(pred.steps.tolist()) <= {2, 3, 5} and pred.steps.tolist() == pred.predicted_steps.tolist()
    online = m.generate_images(prompts, seed=0, policy="online")
    assert all(2 <= k <= 5 for k in online.steps.tolist())
    fixed = m.generate_images(prompts, seed=0, steps=4)
    assert fixed.steps.tolist() == [4, 4] and fixed.policy == "fixed"


def test_fixed_steps_are_untouched_by_the_pass(ss_plan_dir, pipeline_dir, tmp_path):

    plain = tmp_path / "plain"
    dyncompile.compile(pipeline_dir, "verify,cleanup", plain, progress=False)
    a = dyncompile.load(ss_plan_dir).generate_images("a dark patterned pullover", seed=5, steps=4)
    b = dyncompile.load(plain).generate_images("a dark patterned pullover", seed=5, steps=4)
    np.testing.assert_array_equal(a.samples, b.samples)


def test_second_run_reports_unmodified(ss_plan_dir, pipeline_dir, calib_file):
    from dyncompile.passes.step_saver import StepSaverPass

    model = ir.load(str(ss_plan_dir / "unet" / "model.onnx"))
    kw = dict(grid="2/3/5", reference_steps=10, online_max_steps=5, online_min_steps=2, limit=8, budget=25)
    res = StepSaverPass(str(pipeline_dir), calib=str(calib_file), **kw)(model)
    assert res.modified is False


def test_online_rule_matches_its_offline_replay(ss_plan_dir):
    """The loop's stop rule and the calibration's replay on a recorded trajectory stop at the same step."""
    from dyncompile.passes.step_saver.calibrate import stop_outcomes
    from dyncompile.runtime.diffusion.denoise import StopRule

    m = dyncompile.load(ss_plan_dir)
    st = m.handlers[0].run({"prompts": ["a sneaker", "an image of a bag", "patterned shirt, large"]})
    den = m.handlers[-1].denoiser
    from dyncompile.runtime.diffusion.denoise import make_noise

    noise = make_noise([1, 2, 3], [1, 32, 32])
    full = den.sample(st["ctx"], st["null_ctx"], noise, 8, 3.0, keep_x0=True)
    thr = float(np.nanmedian(full["change"][1:]))
    rule = StopRule(thr, 8, 2)
    stopped = den.sample(st["ctx"], st["null_ctx"], noise, 0, 3.0, stop_rule=rule)
    replay = stop_outcomes(full["change"].T, rule)
    assert stopped["steps"].tolist() == replay.tolist()
    for i, k in enumerate(replay):
        np.testing.assert_allclose(stopped["samples"][i], full["x0"][k - 1, i], atol=1e-6)


def _cli(capsys, *argv):
    from dyncompile.tools.cli import main

    rc = main([str(a) for a in argv])
    return rc, capsys.readouterr().err


def test_labels_of_held_out_prompts_are_refused(pipeline_dir, tmp_path, capsys):
    bad = tmp_path / "runs.npz"
    np.savez(bad, counts=np.array([5, 200]), meta=json.dumps({"split": "test", "rows": []}))
    rc, err = _cli(capsys, pipeline_dir, "--passes", f"step-saver{{labels={bad}}}", "-o", tmp_path / "p", "-q")
    assert rc == 2 and err.startswith("error: ") and "TRAIN captions only" in err and "Traceback" not in err
    rc, err = _cli(capsys, pipeline_dir, "--passes", "step-saver", "-o", tmp_path / "p", "-q")
    assert rc == 2 and "needs labels=" in err


def test_tampered_predictor_is_refused(ss_plan_dir, tmp_path):
    bad = tmp_path / "plan"
    shutil.copytree(ss_plan_dir, bad)
    raw = json.loads((bad / "plan.json").read_text())
    raw["steps"][1]["grid"] = [5, 3]
    (bad / "plan.json").write_text(json.dumps(raw))
    with pytest.raises(PlanError, match="grid"):
        dyncompile.load(bad)
    raw["steps"][1]["grid"] = [2, 3, 5]
    raw["steps"][1]["weights"] = raw["steps"][1]["weights"][:10]
    (bad / "plan.json").write_text(json.dumps(raw))
    with pytest.raises(PlanError, match="mean has 384 values"):
        dyncompile.load(bad)
