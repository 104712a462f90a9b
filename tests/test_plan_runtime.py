"""Plan round trip and validation; runtime providers and step registry; the Python API."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from helpers import ort_session, random_token_feeds, tolerance

import dyncompile
from dyncompile.errors import OutputExistsError, PlanError, ProviderError
from dyncompile.runtime import load_plan, resolve_provider
from dyncompile.runtime.providers import check_ort_flavours, installed_ort_flavours


@pytest.fixture()
def tiny_plan(tiny_encoder_path, tmp_path):
    res = dyncompile.compile(tiny_encoder_path, "verify,cleanup", tmp_path / "plan", progress=False)
    return res.plan_dir


def test_plan_round_trip(tiny_plan):
    plan = load_plan(tiny_plan)
    assert plan.format == "dyncompile.plan/v1"
    assert plan.files["model"].path == "model.onnx" and len(plan.files["model"].sha256) == 64
    assert [s.kind for s in plan.steps] == ["run_model"]
    assert [i["name"] for i in plan.inputs] == ["input_ids", "attention_mask"]
    assert json.loads((tiny_plan / "plan.json").read_text()) == plan.to_dict()


def test_compiled_plan_reproduces_original(tiny_plan, tiny_encoder_path, provider):
    m = dyncompile.load(tiny_plan, provider=provider, optimization="disable")
    feeds = random_token_feeds()
    got = m.run_feeds(feeds)["logits"]
    want = ort_session(tiny_encoder_path).run(None, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=tolerance(provider))


def test_sessions_created_once_and_reused(tiny_plan, provider):
    m = dyncompile.load(tiny_plan, provider=provider)
    assert m.ctx.session("model").get_providers()[0] == m.provider
    s1 = m.ctx.session("model")
    m.run_feeds(random_token_feeds())
    m.run_feeds(random_token_feeds(seed=1))
    assert m.ctx.session("model") is s1 and len(m.ctx._sessions) == 1


def test_tampered_model_is_detected(tiny_plan):
    with open(tiny_plan / "model.onnx", "ab") as f:
        f.write(b"\0")
    with pytest.raises(PlanError, match="modified after compile"):
        dyncompile.load(tiny_plan)


def _edit_plan(plan_dir, fn):
    p = plan_dir / "plan.json"
    d = json.loads(p.read_text())
    fn(d)
    p.write_text(json.dumps(d))


def test_unknown_version(tiny_plan):
    _edit_plan(tiny_plan, lambda d: d.update(format="dyncompile.plan/v99"))
    with pytest.raises(PlanError, match="unknown plan format"):
        load_plan(tiny_plan)


def test_path_escaping_plan_dir(tiny_plan):
    _edit_plan(tiny_plan, lambda d: d["files"]["model"].update(path="../model.onnx"))
    with pytest.raises(PlanError, match="escapes the plan directory"):
        load_plan(tiny_plan)
    _edit_plan(tiny_plan, lambda d: d["files"]["model"].update(path="/etc/passwd"))
    with pytest.raises(PlanError, match="escapes the plan directory"):
        load_plan(tiny_plan)


def test_unknown_step_kind(tiny_plan):
    _edit_plan(tiny_plan, lambda d: d["steps"].append({"kind": "teleport"}))
    with pytest.raises(PlanError, match="unknown kind 'teleport'"):
        dyncompile.load(tiny_plan)


def test_missing_plan_and_missing_file(tiny_plan, tmp_path):
    with pytest.raises(PlanError, match="no plan at"):
        load_plan(tmp_path / "nothing")
    (tiny_plan / "model.onnx").unlink()
    with pytest.raises(PlanError, match="missing"):
        load_plan(tiny_plan)


def test_malformed_json(tiny_plan):
    (tiny_plan / "plan.json").write_text("{not json")
    with pytest.raises(PlanError, match="not valid JSON"):
        load_plan(tiny_plan)


def test_output_dir_exists_refused_then_force(tiny_encoder_path, tiny_plan):
    before = {p.name: p.read_bytes() for p in tiny_plan.iterdir()}
    with pytest.raises(OutputExistsError, match="--force"):
        dyncompile.compile(tiny_encoder_path, "verify", tiny_plan, progress=False)
    assert {p.name: p.read_bytes() for p in tiny_plan.iterdir()} == before
    dyncompile.compile(tiny_encoder_path, "verify", tiny_plan, force=True, progress=False)
    assert load_plan(tiny_plan).provenance["passes"] == ["VerifyModelPass(full_check=True)"]
    leftovers = [p for p in tiny_plan.parent.iterdir() if p.name.startswith(".")]
    assert leftovers == []


@pytest.mark.parametrize("existing", [False, True])
def test_failed_compile_leaves_no_partial_output(tiny_encoder_path, tmp_path, monkeypatch, existing):
    """A failure mid-write (the model files are already written, plan.json is not) leaves no output, no
    temp folder, and an existing output (with --force) exactly as it was."""
    import dyncompile.passes.compiler as compiler

    seen = []

    def boom(plan, directory):
        seen.append(sorted(p.name for p in directory.iterdir()))
        raise RuntimeError("disk full")

    out = tmp_path / "out"
    if existing:
        dyncompile.compile(tiny_encoder_path, "verify", out, progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()} if existing else None
    monkeypatch.setattr(compiler, "save_plan", boom)  # the plan writer the compile driver calls
    with pytest.raises(RuntimeError, match="disk full"):
        dyncompile.compile(tiny_encoder_path, "verify", out, force=existing, progress=False)
    assert len(seen) == 1 and any(name.endswith(".onnx") for name in seen[0]), seen  # it failed mid-write
    assert "plan.json" not in seen[0]
    if existing:
        assert [p.name for p in tmp_path.iterdir()] == ["out"]
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    else:
        assert list(tmp_path.iterdir()) == []


def test_input_model_untouched(tiny_encoder_path, tmp_path):
    before = tiny_encoder_path.read_bytes()
    dyncompile.compile(tiny_encoder_path, "verify,cleanup", tmp_path / "o", progress=False)
    assert tiny_encoder_path.read_bytes() == before


# --- providers (simulated provider lists: no GPU / OpenVINO needed) ---


def test_provider_short_names_map_to_ort():
    avail = ["OpenVINOExecutionProvider", "CUDAExecutionProvider", "DmlExecutionProvider", "CPUExecutionProvider"]
    assert resolve_provider("cpu", available=avail) == [("CPUExecutionProvider", {})]
    ov = resolve_provider("openvino", available=avail)
    assert ov[0] == ("OpenVINOExecutionProvider", {"device_type": "CPU", "precision": "FP32"})
    assert ov[-1][0] == "CPUExecutionProvider"
    assert resolve_provider("cuda", available=avail)[0] == ("CUDAExecutionProvider", {"use_tf32": "0"})
    assert resolve_provider("directml", available=avail)[0][0] == "DmlExecutionProvider"


def test_missing_provider_names_available_and_extra():
    with pytest.raises(ProviderError) as e:
        resolve_provider("openvino", available=["CPUExecutionProvider"])
    msg = str(e.value)
    assert "dyncompile[openvino]" in msg and "available: cpu" in msg and "--fallback cpu" in msg


def test_fallback_warns_and_uses_cpu(caplog):
    with caplog.at_level("WARNING"):
        got = resolve_provider("cuda", available=["CPUExecutionProvider"], fallback="cpu")
    assert got == [("CPUExecutionProvider", {})]
    assert "falling back" in caplog.text


def test_unknown_provider():
    with pytest.raises(ProviderError, match="unknown provider 'tpu'"):
        resolve_provider("tpu", available=["CPUExecutionProvider"])


@pytest.mark.openvino  # asserts the environment it runs in: the OpenVINO one too
def test_two_ort_flavours_detected():
    with pytest.raises(ProviderError, match="two ONNX Runtime flavours"):
        check_ort_flavours(["onnxruntime", "onnxruntime-openvino"])
    assert len(installed_ort_flavours()) == 1  # this environment is clean


def test_load_with_unavailable_provider(tiny_plan):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("CUDA is available here")
    with pytest.raises(ProviderError, match="not available"):
        dyncompile.load(tiny_plan, provider="cuda")
    m = dyncompile.load(tiny_plan, provider="cuda", fallback="cpu")
    assert m.provider == "CPUExecutionProvider"


def test_plan_dir_can_be_moved(tiny_plan, tmp_path):
    moved = tmp_path / "elsewhere"
    shutil.move(str(tiny_plan), moved)
    m = dyncompile.load(moved)
    assert m.run_feeds(random_token_feeds())["logits"].shape == (3, 2)
