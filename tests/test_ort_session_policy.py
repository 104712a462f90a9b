"""``policy.ort_session``: ORT CPU fusions measured slow are switched off in a plan's CPU sessions and in the
compile's calibration sessions alike; a plan may name only the fusions dyncompile measures."""

from __future__ import annotations

import json

import pytest

import dyncompile
import dyncompile.runtime.providers as providers
from dyncompile.errors import PlanError
from dyncompile.passes.compiler import compile_model
from dyncompile.plan import load_plan

SLOW = {"disabled_optimizers": ["SkipLayerNormFusion"], "measured_us": {"SkipLayerNormFusion": [250.0, 40.0]},
        "onnxruntime": "test"}
FAST = {"disabled_optimizers": [], "measured_us": {"SkipLayerNormFusion": [60.0, 68.0]}, "onnxruntime": "test"}


def test_a_fusion_is_switched_off_only_with_a_margin():
    assert providers.fusion_is_slow(250.0, 40.0)
    assert not providers.fusion_is_slow(60.0, 68.0)  # the fused kernel is faster (onnxruntime 1.24)
    assert not providers.fusion_is_slow(59.0, 40.0)  # 1.48x: close calls stay on ORT's default
    assert providers.fusion_is_slow(60.0, 40.0)


def test_the_measurement_lists_only_what_it_measured_slow():
    rec = providers.slow_cpu_fusions()
    assert set(rec["measured_us"]) == set(providers.OPTIONAL_CPU_FUSIONS)
    for fusion, (fused, unfused) in rec["measured_us"].items():
        assert fused > 0 and unfused > 0
        assert (fusion in rec["disabled_optimizers"]) == providers.fusion_is_slow(fused, unfused)
    assert providers.calibration_disabled_optimizers() == rec["disabled_optimizers"]


def _ops_run(compiled, text: str) -> set[str]:
    """The op types ORT ran for one row in the plan's (CPU) session, from its profiler."""
    import os
    import tempfile

    ctx = compiled.ctx
    so = ctx.session_options()
    so.enable_profiling = True
    with tempfile.TemporaryDirectory() as tmp:
        so.profile_file_prefix = os.path.join(tmp, "prof")
        sess = ctx.ort.InferenceSession(str(compiled.plan.path_of("model")),
                                        so, providers=ctx.providers, disabled_optimizers=ctx.disabled_optimizers or None)
        feeds = compiled.encode([text])
        sess.run(None, {i.name: feeds[i.name] for i in sess.get_inputs()})
        events = json.loads(open(sess.end_profiling()).read())
    return {e["args"]["op_name"] for e in events if e.get("cat") == "Node" and "op_name" in e.get("args", {})}


@pytest.fixture(scope="module")
def minilm_plans(minilm, tmp_path_factory):
    root = tmp_path_factory.mktemp("ort_session")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(providers, "slow_cpu_fusions", lambda: SLOW)
        slow = compile_model(minilm.onnx_path, "verify,cleanup", root / "slow", progress=False, opt_level=0)
        ov = compile_model(minilm.onnx_path, "verify,cleanup", root / "ov", progress=False, opt_level=0,
                           provider="openvino")
        mp.setattr(providers, "slow_cpu_fusions", lambda: FAST)
        fast = compile_model(minilm.onnx_path, "verify,cleanup", root / "fast", progress=False, opt_level=0)
    return {"slow": slow.plan_dir, "fast": fast.plan_dir, "openvino": ov.plan_dir}


def test_a_cpu_classifier_plan_records_the_measurement(minilm_plans):
    pol = json.loads((minilm_plans["slow"] / "plan.json").read_text())["policy"]
    assert pol["ort_session"] == SLOW
    assert "ort_session" not in json.loads((minilm_plans["fast"] / "plan.json").read_text())["policy"]
    # a plan for another provider: its sessions are not ORT's CPU EP fusions' to change
    assert "ort_session" not in json.loads((minilm_plans["openvino"] / "plan.json").read_text())["policy"]


def test_the_runtime_switches_the_fusion_off_and_the_answers_stay(minilm_plans):
    slow = dyncompile.load(minilm_plans["slow"], provider="cpu")
    fast = dyncompile.load(minilm_plans["fast"], provider="cpu")
    assert slow.ctx.disabled_optimizers == ["SkipLayerNormFusion"] and fast.ctx.disabled_optimizers == []
    text = "A gripping, beautifully shot film with a weak last act."
    assert "SkipLayerNormalization" not in _ops_run(slow, text)
    assert "SkipLayerNormalization" in _ops_run(fast, text)  # negative control: ORT's default fuses it
    a, b = slow.predict_proba([text]), fast.predict_proba([text])
    assert abs(a - b).max() < 1e-5


def test_a_plan_may_name_only_measured_fusions(minilm_plans, tmp_path):
    import shutil

    d = tmp_path / "p"
    shutil.copytree(minilm_plans["slow"], d)
    plan = json.loads((d / "plan.json").read_text())
    plan["policy"]["ort_session"]["disabled_optimizers"] = ["ConstantFolding"]
    (d / "plan.json").write_text(json.dumps(plan))
    with pytest.raises(PlanError, match=r"policy\.ort_session\.disabled_optimizers\[0\].*SkipLayerNormFusion"):
        load_plan(d)
    plan["policy"]["ort_session"] = {"disabled_optimizers": ["SkipLayerNormFusion"], "session_options": {"x": 1}}
    (d / "plan.json").write_text(json.dumps(plan))
    with pytest.raises(PlanError, match="session_options"):
        load_plan(d)
