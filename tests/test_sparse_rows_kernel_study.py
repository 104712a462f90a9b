"""tools/studies/sparse_rows_kernel: the shipped kernel timed against ORT's MatMul and the lowering's 1x1 Conv."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dyncompile.tools.studies import sparse_rows_kernel as study


def test_study_writes_its_report_and_each_runner_computes_its_product(tmp_path):
    study.main(["--out", str(tmp_path), "--name", "k", "--shapes", "64x48,33x4200", "--sparsity", "0,0.5",
                "--reps", "2", "--weights", "2"])
    report = json.loads((tmp_path / "k.json").read_text())
    assert [(r["projection"], r["sparsity"]) for r in report["rows"]] == [
        ("64 -> 48", 0.0), ("64 -> 48", 0.5), ("33 -> 4200", 0.0), ("33 -> 4200", 0.5)]
    # level s keeps the entries above the s-quantile of |x|; 0 keeps every (non-zero) entry
    assert [r["active_rows"] for r in report["rows"]] == [64, 32, 33, 16]
    for r in report["rows"]:
        for key in ("speedup_vs_conv", "speedup_vs_matmul"):
            assert r[key]["lo"] <= r[key]["ratio"] <= r[key]["hi"] and r[key]["n"] == 2
    assert (tmp_path / "k.md").read_text() == study.render_markdown(report)


def test_a_runner_that_computes_something_else_is_caught(monkeypatch):
    """The study checks each runner's output before timing it: a Conv form with a wrong weight layout fails."""
    real = study._model

    def wrong(kind, ws, threshold=0.0):
        return real(kind, [np.ascontiguousarray(w[::-1]) for w in ws] if kind == "conv" else ws, threshold)

    monkeypatch.setattr(study, "_model", wrong)
    with pytest.raises(AssertionError, match="the conv runner does not compute"):
        study.measure({"64 -> 48": (64, 48)}, [0.0], weights=1, reps=1, threads=1)
