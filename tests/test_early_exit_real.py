"""Early exit end to end on the real MiniLM-L6 sentiment classifier (fit, calibrate, both lowerings)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import DATA, assert_clean_error, ort_session, run_cli, tolerance

import dyncompile
from dyncompile.errors import ProviderError
from dyncompile.tools.cli import main

CALIB_ROWS = 400  # a slice of movie-calib keeps CI fast; the benchmark uses all 2,000
TEST_ROWS = 600  # movie-test rows for the budget check (never used to choose anything)
BUDGET = 2.0


@pytest.fixture(scope="module")
def small_calib(module_tmp):
    lines = (DATA / "movie-calib.jsonl").read_text().splitlines()[:CALIB_ROWS]
    p = module_tmp("calib") / "calib.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


@pytest.fixture(scope="module")
def test_rows():
    rows = [json.loads(x) for x in (DATA / "movie-test.jsonl").read_text().splitlines()[:64]]
    return [r["text"] for r in rows], np.array([r["label"] for r in rows])


def _compile(minilm, out, calib, **opts):
    opts.setdefault("confidence", "none")  # 400 rows certify little; certified plans: test_certified_real.py
    return dyncompile.compile(minilm.onnx_path, "early-exit", out, calib=str(calib), progress=False, **opts)


@pytest.fixture(scope="module")
def never_plans(minilm, small_calib, module_tmp):
    d = module_tmp("never")
    return {
        low: _compile(minilm, d / low, small_calib, never_exit=True, lowering=low, exits="2,4")
        for low in ("if", "staged")
    }


@pytest.mark.parametrize("lowering", ["if", "staged"])
def test_never_exit_reproduces_original(never_plans, minilm, test_rows, lowering, provider):
    texts, _ = test_rows
    if lowering == "if" and provider == "openvino":
        # Known OpenVINO EP 1.24 limitation: an op it cannot run inside an If branch fails session creation.
        # The runtime says so and how to fix it; --lowering auto --provider openvino picks staged.
        with pytest.raises(ProviderError, match="--lowering staged"):
            dyncompile.load(never_plans[lowering].plan_dir, provider=provider).ctx.session("model")
        return
    m = dyncompile.load(never_plans[lowering].plan_dir, provider=provider, optimization="disable")
    ref = ort_session(minilm.onnx_path)
    for bs in (1, 7):
        for i in range(0, 21, bs):
            feeds = m.encode(texts[i : i + bs])
            want = ref.run(None, feeds)[0]
            st = m.run_feeds(dict(feeds))
            np.testing.assert_allclose(st["logits"], want, rtol=0, atol=tolerance(provider))
            assert (np.asarray(st["exit_layer"]) == 6).all()


def test_if_graph_structure_on_real_model(never_plans):
    import onnx

    plan = never_plans["if"].plan
    path = plan.directory / plan.files["model"].path
    onnx.checker.check_model(onnx.load(str(path)), full_check=True)
    proto = onnx.load(str(path))
    ifs = [n for n in proto.graph.node if n.op_type == "If"]
    assert len(ifs) == 1 and [o.name for o in proto.graph.output] == ["logits", "exit_layer"]
    inner = next(a.g for a in ifs[0].attribute if a.name == "else_branch")
    # layers 3-6 weights are initializers of the subgraphs that use them (CPU EP pre-packing)
    assert any("layer.3" in i.name for i in inner.initializer)
    assert not any("layer.3" in i.name for i in proto.graph.initializer)


@pytest.fixture(scope="module")
def fitted(minilm, small_calib, module_tmp):
    d = module_tmp("fit")
    return {low: _compile(minilm, d / low, small_calib, budget=BUDGET, lowering=low) for low in ("if", "staged")}


def test_budget_and_speedup_hold_on_movie_test(fitted, never_plans, movie_test_rows):
    """The calibration's promise, checked on rows it never saw.

    Accuracy: the drop against the full model is at most the budget plus 3 standard errors of two sample
    means (the calibration rows' estimate and this one's): a row's change in correctness is -1, 0 or +1 and
    is non-zero only where the two disagree, so its variance is at most the disagreement rate q.
    Speed: the mean exit layer on these rows matches the calibration's expected one within 3 standard
    errors of the same two samples.
    """
    rows = movie_test_rows[:TEST_ROWS]
    texts, labels = [r["text"] for r in rows], np.array([r["label"] for r in rows])
    ee = dyncompile.load(fitted["staged"].plan_dir, optimization="disable")
    pred = ee.predict_proba(texts).argmax(-1)
    layers = ee.last_info["exit_layer"]
    full = dyncompile.load(never_plans["staged"].plan_dir, optimization="disable").predict_proba(texts).argmax(-1)
    q = float((pred != full).mean())
    se = np.sqrt(1 / TEST_ROWS + 1 / CALIB_ROWS)
    drop = ((full == labels).mean() - (pred == labels).mean()) * 100
    assert drop <= BUDGET + 3 * 100 * np.sqrt(q) * se, (drop, q)
    cal = fitted["staged"].plan.policy["early_exit"]["calibration"]
    expected_layer = 6 / cal["expected_speedup"]
    assert abs(layers.mean() - expected_layer) <= 3 * layers.std() * se, (layers.mean(), expected_layer)
    assert 6 / layers.mean() > 2.0, layers.mean()  # README: 3.23x at this budget with 2,000 calibration rows


def test_if_and_staged_agree_at_batch_1(fitted, test_rows, provider):
    texts, _ = test_rows
    if provider == "openvino":
        pytest.skip("If graphs do not load on the OpenVINO EP 1.24 (asserted in test_never_exit_reproduces_original)")
    a = dyncompile.load(fitted["if"].plan_dir, provider=provider)
    b = dyncompile.load(fitted["staged"].plan_dir, provider=provider)
    pa, ea = [], []
    for t in texts:  # the If graph exits per batch: at batch 1 that is per row
        pa.append(a.predict_proba([t]))
        ea.append(int(a.last_info["exit_layer"][0]))
    pa, ea = np.concatenate(pa), np.array(ea)
    pb = b.predict_proba(texts, batch_size=16)  # staged: per-row exits, any batch size
    eb = b.last_info["exit_layer"]
    np.testing.assert_array_equal(ea, eb)
    np.testing.assert_allclose(pa, pb, atol=1e-4)
    assert ea.min() < 6  # some rows exit early


def test_run_prints_exit_layer(fitted, capsys):
    rc = main(["run", str(fitted["staged"].plan_dir), "--text", "A gorgeous, witty, seductive movie."])
    out = capsys.readouterr().out
    assert rc == 0 and "positive" in out and "exit after layer" in out


# --- bad input: one clear error each (through the CLI) ---


def _cli_error(capsys, *argv):
    rc, _, err = run_cli(capsys, *argv)
    assert_clean_error(rc, err)
    return err


def test_bad_calibration_files(capsys, tmp_path, minilm):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert "holds no rows" in _cli_error(capsys, minilm.onnx_path, "--passes", "early-exit", "--calib", empty, "-o", tmp_path / "o")
    notext = tmp_path / "notext.jsonl"
    notext.write_text('{"sentence": "hi", "label": 1}\n')
    assert "'text'" in _cli_error(capsys, minilm.onnx_path, "--passes", "early-exit", "--calib", notext, "-o", tmp_path / "o")
    one = tmp_path / "one.jsonl"
    rows = [json.loads(x) for x in (DATA / "movie-calib.jsonl").read_text().splitlines()[:300]]
    one.write_text("".join(json.dumps({"text": r["text"], "label": 1}) + "\n" for r in rows))
    assert "label 1" in _cli_error(capsys, minilm.onnx_path, "--passes", "early-exit", "--calib", one, "-o", tmp_path / "o")
    few = tmp_path / "few.jsonl"
    few.write_text("".join(json.dumps(r) + "\n" for r in rows[:20]))
    assert "at least 100" in _cli_error(capsys, minilm.onnx_path, "--passes", "early-exit", "--calib", few, "-o", tmp_path / "o")
    missing = _cli_error(capsys, minilm.onnx_path, "--passes", "early-exit", "-o", tmp_path / "o")
    assert "--calib" in missing
    assert not (tmp_path / "o").exists()


def test_negative_budget(capsys, tmp_path, minilm, small_calib):
    err = _cli_error(capsys, minilm.onnx_path, "--passes", "early-exit", "--calib", small_calib, "--budget", "-1", "-o", tmp_path / "o")
    assert "budget" in err and ">= 0" in err


def test_not_a_classifier(capsys, tmp_path, small_calib, smollm2):
    err = _cli_error(capsys, smollm2.onnx_path, "--passes", "early-exit", "--calib", small_calib, "-o", tmp_path / "o")
    assert "classifier" in err


def test_no_layer_structure(capsys, tmp_path, small_calib, minilm):
    import shutil

    import onnx_ir as ir

    from dyncompile.models.synthetic import tiny_mlp

    d = tmp_path / "mlp"
    d.mkdir()
    m = tiny_mlp()
    m.graph.outputs[0].shape = ir.Shape(["batch", 4])
    ir.save(m, d / "model.onnx")
    shutil.copy(minilm.tokenizer_path, d / "tokenizer.json")
    err = _cli_error(capsys, d / "model.onnx", "--passes", "early-exit", "--calib", small_calib, "-o", tmp_path / "o")
    assert "no repeated layer structure" in err


@pytest.mark.parametrize(
    "target,want", [("cpu", "if"), ("cuda", "if"), ("openvino", "staged"), ("directml", "staged")]
)
def test_auto_lowering_is_ep_aware(target, want):
    from dyncompile.passes.early_exit.insert_early_exit import choose_lowering

    lowering, reason = choose_lowering(target)
    assert lowering == want and len(reason) > 20


def test_auto_lowering_recorded_in_plan(minilm, small_calib, tmp_path, capsys):
    res = _compile(minilm, tmp_path / "ov", small_calib, lowering="auto", provider="openvino", exits="3", budget=1.0)
    choice = res.plan.policy["early_exit"]["lowering_choice"]
    assert choice["lowering"] == "staged" and choice["provider"] == "openvino" and "If" in choice["reason"]
    assert [s.kind for s in res.plan.steps] == ["early_exit_staged"]
    assert main(["inspect", str(res.plan_dir)]) == 0
    assert "lowering_choice" in capsys.readouterr().out
