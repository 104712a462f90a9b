"""Certified budgets and the learned policy end to end on the real MiniLM-L6 (fit, certify, lower, inspect)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import DATA, assert_clean_error, run_cli

import dyncompile

CALIB_ROWS = 400  # certifies only a loose budget; the benchmark certifies 1.0 on all 2,000 movie-calib rows


@pytest.fixture(scope="module")
def calib_files(module_tmp):
    lines = (DATA / "movie-calib.jsonl").read_text().splitlines()[:CALIB_ROWS]
    d = module_tmp("calib")
    (d / "labels.jsonl").write_text("\n".join(lines) + "\n")
    (d / "text.jsonl").write_text("".join(json.dumps({"text": json.loads(x)["text"]}) + "\n" for x in lines))
    return d


@pytest.fixture(scope="module")
def learned_plan(minilm, calib_files, module_tmp):
    out = module_tmp("learned") / "p"
    return dyncompile.compile(minilm.onnx_path, "early-exit", out, calib=str(calib_files / "labels.jsonl"), budget=6.0,
                              confidence=0.9, criterion="learned", lowering="if", progress=False)


def test_certificate_recorded_and_inspected(learned_plan, capsys):
    pol = learned_plan.plan.policy["early_exit"]
    cert = pol["certificate"]
    assert cert["certified"] and cert["confidence"] == 0.9 and cert["mode"] == "labels"
    assert cert["rows"] + cert["path_rows"] == CALIB_ROWS and cert["bound"] <= 6.0
    assert pol["criterion"] == "learned" and pol["exit_policy"]["format"] == "dyncompile.exit_policy/v1"
    rc, out, _ = run_cli(capsys, "inspect", learned_plan.plan_dir)
    assert rc == 0
    assert f"budget 6.0 points of accuracy certified at 90 % confidence on {cert['rows']} rows: observed" in out


def test_learned_plan_runs_and_exits_early(learned_plan):
    rows = [json.loads(x) for x in (DATA / "movie-test.jsonl").read_text().splitlines()[:48]]
    m = dyncompile.load(learned_plan.plan_dir, provider="cpu")
    layers = []
    for r in rows:  # batch 1: the If graph decides per row
        m.predict_proba([r["text"]])
        layers.append(int(m.last_info["exit_layer"][0]))
    assert min(layers) < 6


def test_agreement_mode_without_labels(minilm, calib_files, tmp_path, capsys):
    rc, out, err = run_cli(capsys, minilm.onnx_path, "--passes", "early-exit", "--calib", calib_files / "text.jsonl",
                           "--budget", "8", "--lowering", "staged", "-q", "-o", tmp_path / "p")
    assert rc == 0, err
    rc, out, _ = run_cli(capsys, "inspect", tmp_path / "p")
    assert "points of disagreement with the full model certified at 90 % confidence" in out


def test_uncertifiable_budget_is_one_clear_error(minilm, calib_files, tmp_path, capsys):
    rc, _, err = run_cli(capsys, minilm.onnx_path, "--passes", "early-exit", "--calib", calib_files / "labels.jsonl",
                         "--budget", "0.1", "-q", "-o", tmp_path / "p")
    assert_clean_error(rc, err, "cannot be certified at 90 % confidence", "use --budget")
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("bad", ["1.5", "abc"])
def test_bad_confidence_is_one_clear_error(minilm, calib_files, tmp_path, capsys, bad):
    rc, _, err = run_cli(capsys, minilm.onnx_path, "--passes", "early-exit", "--calib", calib_files / "labels.jsonl",
                         "--confidence", bad, "-q", "-o", tmp_path / "p")
    assert_clean_error(rc, err, "--confidence")


def test_uncertified_mode_is_named_so(minilm, calib_files, tmp_path, capsys):
    res = dyncompile.compile(minilm.onnx_path, "early-exit", tmp_path / "p", calib=str(calib_files / "labels.jsonl"),
                             budget=2.0, confidence="none", exits="2,4", progress=False)
    cert = res.plan.policy["early_exit"]["certificate"]
    assert cert["confidence"] is None and not cert["certified"]
    rc, out, _ = run_cli(capsys, "inspect", res.plan_dir)
    assert "NOT certified (--confidence none)" in out
    np.testing.assert_equal(cert["rows"], CALIB_ROWS)
