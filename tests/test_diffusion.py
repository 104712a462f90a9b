"""Text-to-image plans on the real fashion-diffusion pipeline: scheduler math, fidelity to an independent
reference loop, the CLI, and one clear error per bad input."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import SHARED

import dyncompile
from dyncompile.errors import DataError, PlanError
from dyncompile.runtime.rules.schedulers import DDIMScheduler, make_scheduler

ASSET = SHARED / "assets" / "fashion-diffusion"
TEXT_ASSET = SHARED / "assets" / "minilm-l6-sentiment"
SCHED = json.loads((ASSET / "scheduler" / "scheduler_config.json").read_text())
PROMPT = "a dark patterned pullover"


@pytest.fixture(scope="module")
def pipeline_dir() -> Path:
    from dyncompile.models import build_model

    return build_model("fashion-diffusion", progress=False).dir


@pytest.fixture(scope="module")
def plan_dir(pipeline_dir, module_tmp) -> Path:
    out = module_tmp("fd") / "plan"
    dyncompile.compile(pipeline_dir, "verify,cleanup", out, progress=False)
    return out


@pytest.fixture(scope="module")
def plan(plan_dir):
    return dyncompile.load(plan_dir, provider="cpu")


# ------------------------------------------------------------------------------------------ scheduler


def _reference_ddim(n: int):
    """Closed-form DDIM (eta 0) written from the paper, float64: (timesteps, step(eps, t, x))."""
    T = 1000
    betas = np.linspace(1e-4, 0.02, T, dtype=np.float64)
    abar = np.cumprod(1 - betas)
    ts = [T - 1 - round(i * T / n) for i in range(n)]  # trailing: 999, 999 - T/n, ...

    def step(eps, t, x):
        prev = t - T // n
        a_t, a_prev = abar[t], (abar[prev] if prev >= 0 else 1.0)
        x0 = (x - np.sqrt(1 - a_t) * eps) / np.sqrt(a_t)
        return np.sqrt(a_prev) * x0 + np.sqrt(1 - a_prev) * eps

    return ts, step


@pytest.mark.parametrize("n", [5, 10, 30, 50, 200])
def test_ddim_matches_closed_form(n):
    sched = make_scheduler(SCHED)
    ts, ref_step = _reference_ddim(n)
    assert sched.timesteps(n) == ts
    if n == 5:
        assert ts == [999, 799, 599, 399, 199]  # the asset README's example
    rng = np.random.default_rng(n)
    x = rng.standard_normal((2, 1, 32, 32)).astype(np.float32)
    for t in ts:
        eps = rng.standard_normal(x.shape).astype(np.float32)
        got, x0 = sched.step(eps, t, x, n)
        want = ref_step(eps.astype(np.float64), t, x.astype(np.float64))
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
        x = got


def test_ddim_matches_the_assets_own_ddim():
    """fd_model.DDIM is the asset's scheduler, checked bit-identical to diffusers' DDIMScheduler there."""
    torch = pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("fd_model", ASSET / "build" / "fd_model.py")
    fd = importlib.util.module_from_spec(spec)
    sys.modules["fd_model"] = fd
    try:
        spec.loader.exec_module(fd)
    finally:
        sys.modules.pop("fd_model", None)
    ref = fd.DDIM(SCHED)
    sched = make_scheduler(SCHED)
    rng = np.random.default_rng(1)
    for n in (5, 15, 30):
        assert sched.timesteps(n) == ref.timesteps(n)
        x = rng.standard_normal((1, 1, 32, 32)).astype(np.float32)
        for t in ref.timesteps(n):
            eps = rng.standard_normal(x.shape).astype(np.float32)
            want = ref.step(torch.from_numpy(eps), t, torch.from_numpy(x), n).numpy()
            got, _ = sched.step(eps, t, x, n)
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)  # float32 rounding (1 ulp)
            x = got


@pytest.mark.parametrize(
    "change, message",
    [
        ({"_class_name": "EulerDiscreteScheduler"}, "not implemented"),
        ({"thresholding": True}, "thresholding"),
        ({"timestep_spacing": "karras"}, "timestep_spacing"),
        ({"beta_schedule": "squaredcos_cap_v2"}, "beta_schedule"),
        ({"prediction_type": "flow"}, "prediction_type"),
    ],
)
def test_unsupported_scheduler_configs_are_refused(change, message):
    with pytest.raises(PlanError, match=message):
        make_scheduler({**SCHED, **change})


# ------------------------------------------------------------------------------------------ fidelity


def _reference_images(prompt: str, n: int, seed: int, scale: float = 3.0):
    """The asset README's sampling loop, written independently of dyncompile: BERT in PyTorch, the asset's
    U-Net file in ONNX Runtime, closed-form DDIM in float64, CFG on [uncond; cond]."""
    torch = pytest.importorskip("torch")
    import onnxruntime as ort
    from transformers import AutoTokenizer, BertModel

    tok = AutoTokenizer.from_pretrained(str(TEXT_ASSET))
    bert = BertModel.from_pretrained(str(TEXT_ASSET), dtype=torch.float32).eval()
    b = tok(["", prompt], max_length=12, padding="max_length", truncation=True, return_tensors="pt")
    with torch.no_grad():
        ctx = bert(**b).last_hidden_state.numpy()
    unet = ort.InferenceSession(str(ASSET / "unet" / "model.onnx"), providers=["CPUExecutionProvider"])
    x = torch.randn((1, 1, 32, 32), generator=torch.Generator().manual_seed(seed)).numpy().astype(np.float64)
    ts, step = _reference_ddim(n)
    for t in ts:
        e = unet.run(["out_sample"], {"sample": np.concatenate([x, x]).astype(np.float32),
                                      "timestep": np.array([t, t], np.int64), "encoder_hidden_states": ctx})[0]
        eps = e[:1] + scale * (e[1:] - e[:1])
        x = step(eps.astype(np.float64), t, x)
    return x


def test_fixed_steps_equal_an_independent_reference_loop(plan):

    for n in (5, 12):
        ref = _reference_images(PROMPT, n, seed=7)
        res = plan.generate_images(PROMPT, seed=7, steps=n, noise_source="torch")
        assert res.steps.tolist() == [n] and res.unet_calls == n  # one U-Net call per step: [uncond; cond] batched
        diff = float(np.abs(res.samples.astype(np.float64) - ref).max())
        assert diff <= 1e-4, f"{n} steps: max |plan - reference| = {diff}"
        ref_u8 = np.round((np.clip(ref[0, 0, 2:30, 2:30], -1, 1) + 1) * 127.5)
        assert np.abs(res.images[0].astype(int) - ref_u8).max() <= 1
        assert res.images.shape == (1, 28, 28) and res.images.dtype == np.uint8


def test_batched_prompts_equal_single_prompts(plan):

    prompts = [PROMPT, "an image of trousers", "photo of a small plain sandal"]
    both = plan.generate_images(prompts, seed=[3, 4, 5], steps=4)
    for i, p in enumerate(prompts):
        one = plan.generate_images(p, seed=3 + i, steps=4)
        np.testing.assert_allclose(both.samples[i], one.samples[0], atol=2e-5)
    assert len({both.images[i].tobytes() for i in range(3)}) == 3


def test_guidance_one_runs_the_conditional_half_only(plan):

    r = plan.generate_images(PROMPT, seed=1, steps=3, guidance=1.0)
    assert r.images.shape == (1, 28, 28)


# ------------------------------------------------------------------------------------------ CLI and errors


def _cli(capsys, *argv):
    from dyncompile.tools.cli import main

    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_run_writes_a_png(plan_dir, tmp_path, capsys):
    out = tmp_path / "out.png"
    rc, stdout, err = _cli(capsys, "run", plan_dir, "--prompt", PROMPT, "--seed", 0, "--steps", 6, "-o", out)
    assert rc == 0, err
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and "6 steps" in stdout
    from PIL import Image

    img = np.asarray(Image.open(out))
    assert img.shape == (28, 28) and img.dtype == np.uint8 and img.std() > 10


def _one_error(rc, err):
    assert rc == 2
    lines = [ln for ln in err.strip().splitlines() if ln]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--prompt", ""], "prompt #0 is empty"),
        (["--prompt", PROMPT, "--steps", "0"], "number of denoising steps"),
        (["--prompt", PROMPT, "--steps", "-3"], "number of denoising steps"),
        (["--prompt", PROMPT, "--guidance", "0.5"], "guidance scale must be >= 1"),
    ],
)
def test_bad_run_inputs_are_one_error(plan_dir, tmp_path, capsys, extra, message):
    rc, _, err = _cli(capsys, "run", plan_dir, *extra, "-o", tmp_path / "x.png")
    assert message in _one_error(rc, err)
    assert not (tmp_path / "x.png").exists()


def _pipeline_copy(src: Path, dst: Path, drop: str | None = None, sched: dict | None = None) -> Path:
    dst.mkdir()
    for p in src.rglob("*"):
        if p.is_file():
            rel = p.relative_to(src)
            if drop and str(rel) == drop:
                continue
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            (dst / rel).symlink_to(p)
    if sched is not None:
        (dst / "scheduler" / "scheduler_config.json").unlink()
        (dst / "scheduler" / "scheduler_config.json").write_text(json.dumps(sched))
    return dst


@pytest.mark.parametrize(
    "drop, sched, message",
    [
        ("unet/model.onnx", None, "missing its U-Net"),
        ("text_encoder/model.onnx", None, "missing its text encoder"),
        ("scheduler/scheduler_config.json", None, "missing its scheduler config"),
        (None, {**SCHED, "_class_name": "PNDMScheduler"}, "scheduler type 'PNDMScheduler' is not implemented"),
    ],
)
def test_bad_pipeline_folders_are_one_error(pipeline_dir, tmp_path, capsys, drop, sched, message):
    bad = _pipeline_copy(pipeline_dir, tmp_path / "pipe", drop, sched)
    rc, _, err = _cli(capsys, bad, "--passes", "verify", "-o", tmp_path / "plan", "-q")
    assert message in _one_error(rc, err)
    assert not (tmp_path / "plan").exists()


def test_tampered_step_params_are_refused(plan_dir, tmp_path):
    bad = tmp_path / "plan"
    shutil.copytree(plan_dir, bad)
    raw = json.loads((bad / "plan.json").read_text())
    raw["steps"][-1]["guidance_scale"] = 0.2
    (bad / "plan.json").write_text(json.dumps(raw))
    with pytest.raises(PlanError, match="guidance_scale"):
        dyncompile.load(bad)
    raw["steps"][-1]["guidance_scale"] = 3.0
    raw["steps"][-1]["num_inference_steps"] = True
    (bad / "plan.json").write_text(json.dumps(raw))
    with pytest.raises(PlanError, match="num_inference_steps"):
        dyncompile.load(bad)
    raw["steps"][-1]["num_inference_steps"] = 50
    raw["steps"][-1]["run_this"] = "import os"
    (bad / "plan.json").write_text(json.dumps(raw))
    with pytest.raises(PlanError, match="unknown field 'run_this'"):
        dyncompile.load(bad)
    del raw["steps"][-1]["run_this"]
    raw["steps"][-1]["scheduler"]["_class_name"] = "LMSDiscreteScheduler"
    (bad / "plan.json").write_text(json.dumps(raw))
    with pytest.raises(PlanError, match="not implemented"):
        dyncompile.load(bad)


def test_api_errors(plan):

    with pytest.raises(DataError, match="empty"):
        plan.generate_images(["ok", " "])
    with pytest.raises(DataError, match="policy"):
        plan.generate_images(PROMPT, policy="sometimes")
    with pytest.raises(DataError, match="no step predictor"):
        plan.generate_images(PROMPT, policy="predicted")


def test_scheduler_rejects_bad_step_counts():
    s = DDIMScheduler(SCHED)
    for bad in (0, -1, 1001, 2.5):
        with pytest.raises(ValueError):
            s.timesteps(bad)


def test_bench_of_a_diffusion_plan_is_one_error(plan_dir, capsys):
    rc, _, err = _cli(capsys, "bench", plan_dir, "--data", "x.jsonl")
    assert "text-to-image plan" in _one_error(rc, err)
