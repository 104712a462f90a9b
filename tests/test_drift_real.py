"""Drift guard end to end on the real MiniLM-L6: quiet on movie-test, fires on out-of-domain text."""

from __future__ import annotations

import json

import pytest
from helpers import DATA

import dyncompile
from dyncompile.tools.cli import main
from dyncompile.tools.studies.ood_text import stdlib_docstrings

CALIB_ROWS = 600
ROWS = 300


@pytest.fixture(scope="module")
def staged_plan(minilm, module_tmp):
    d = module_tmp("drift")
    calib = d / "calib.jsonl"
    calib.write_text("\n".join((DATA / "movie-calib.jsonl").read_text().splitlines()[:CALIB_ROWS]) + "\n")
    # uncertified thresholds: on 600 rows a certified plan exits almost only at two layers, a histogram too coarse
    # for this test's effect size (the guard itself is the same for both)
    res = dyncompile.compile(minilm.onnx_path, "early-exit", d / "plan", calib=str(calib), lowering="staged",
                             confidence="none", progress=False)
    return res.plan_dir


def test_plan_records_the_calibration_exit_distribution(staged_plan):
    plan = json.loads((staged_plan / "plan.json").read_text())
    dist = plan["policy"]["early_exit"]["calibration"]["exit_distribution"]
    assert dist["layers"] == [1, 2, 3, 4, 5, 6]
    assert sum(dist["counts"]) == dist["rows"] == CALIB_ROWS


def test_quiet_on_movie_test_fires_on_stdlib_docstrings(staged_plan, caplog):
    m = dyncompile.load(staged_plan)
    texts = [json.loads(x)["text"] for x in (DATA / "movie-test.jsonl").read_text().splitlines()[:ROWS]]
    m(texts)
    quiet = m.drift_report()
    assert quiet.rows == ROWS and not quiet.drift, quiet.message
    m.task_api.reset_exit_log()
    with caplog.at_level("WARNING", logger="dyncompile.runtime.drift"):
        m(stdlib_docstrings(ROWS))
        loud = m.drift_report()
    assert loud.drift and loud.verdict == "drift", loud.message
    assert "drift guard" in caplog.text


def test_cli_run_prints_exit_histograms(staged_plan, capsys):
    assert main(["run", str(staged_plan), "--data", str(DATA / "movie-test.jsonl"), "--limit", "150"]) == 0
    out = capsys.readouterr().out
    assert "exit layers vs calibration" in out and "calibration" in out and "drift" in out
