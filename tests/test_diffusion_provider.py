"""A diffusion plan (fp32 and with an int8 U-Net) on the provider under test ($DYNCOMPILE_TEST_PROVIDER; CI runs
this file again with provider="openvino"): same images as the CPU EP within tolerance."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import INT8_PAIRS_SATURATE

import dyncompile

PROMPTS = ["a dark patterned pullover", "an image of a bag", "ankle boot: dark, plain"]


@pytest.fixture(scope="module")
def pipeline_dir() -> Path:
    from dyncompile.models import build_model

    return build_model("fashion-diffusion", progress=False).dir


@pytest.mark.parametrize("passes, atol, max_u8", [
    ("verify,cleanup", 1e-4, 1),
    # the default reduce_range=auto: 7-bit weights where the CPU's u8s8 kernels saturate (x86 without VNNI)
    ("verify,cleanup,quantize-int8", None, None),
    # 8-bit weights forced: the negative control on such a CPU (measured SSIM 0.80 there), close elsewhere
    ("verify,cleanup,quantize-int8{reduce_range=false}", None, None),
])
def test_plan_on_provider_matches_cpu(pipeline_dir, tmp_path, provider, passes, atol, max_u8):
    from dyncompile.passes.step_saver.metrics import ssim

    fp32 = tmp_path / "fp32"
    dyncompile.compile(pipeline_dir, "verify,cleanup", fp32, progress=False)
    plan = tmp_path / "plan"
    dyncompile.compile(pipeline_dir, passes, plan, provider=provider, progress=False)
    ref = dyncompile.load(fp32, provider="cpu").generate_images(PROMPTS, seed=0, steps=5)
    got = dyncompile.load(plan, provider=provider).generate_images(PROMPTS, seed=0, steps=5)
    assert got.steps.tolist() == [5, 5, 5]
    if atol is not None:  # fp32 on another provider: the same numbers
        assert float(np.abs(got.samples - ref.samples).max()) <= atol
        assert int(np.abs(got.images.astype(int) - ref.images.astype(int)).max()) <= max_u8
    elif "reduce_range=false" in passes and provider == "cpu" and INT8_PAIRS_SATURATE:
        assert float(ssim(got.images, ref.images).min()) < 0.9  # saturated int16 pair sums: visibly different
    else:  # int8 MatMul weights in the U-Net's attention: close, not equal
        assert float(ssim(got.images, ref.images).min()) >= 0.98
