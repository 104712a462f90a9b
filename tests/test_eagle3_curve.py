"""The held-out agreement curve study: the runs chain of a continued head, and a second head drawn beside it."""

import json

from dyncompile.tools.studies import eagle3_curve


def _head(path, layout, curve, training_extra=None):
    path.mkdir()
    training = {"layout": layout, "tokens_seen": curve[-1]["tokens"], **(training_extra or {})}
    if layout is None:  # a head from before the reference layout existed
        del training["layout"]
    info = {"format": "dyncompile.eagle_head/v3", "feature_layers": [2, 12, 21], "corpus": {"source": "stdlib"},
            "target": "t.gguf", "training": training, "curve": curve, "eval": {"ttt_agreement": curve[-1]["agreement"]}}
    (path / "eagle_head.json").write_text(json.dumps(info))
    return path


def test_curve_runs_and_compare(tmp_path):
    first = {"layout": "reference", "tokens_seen": 200}
    ref = _head(tmp_path / "ref", "reference",
                [{"tokens": 100, "agreement": [0.5, 0.4]}, {"tokens": 200, "agreement": [0.6, 0.5]},
                 {"tokens": 300, "agreement": [0.62, 0.52]}], {"continued_from": first})
    fc = _head(tmp_path / "fc", None, [{"tokens": 100, "agreement": [0.45, 0.35]}])
    assert eagle3_curve.main([str(ref), "--out", str(tmp_path / "o"), "--name", "c", "--compare", str(fc)]) == 0
    report = json.loads((tmp_path / "o" / "c.json").read_text())
    assert [c["run"] for c in report["curve"]] == [1, 1, 2]  # the continued run starts after 200 tokens
    assert report["layout"] == "reference"
    assert report["compare"] == [{"head": "fc", "layout": "fc", "curve": [{"tokens": 100, "agreement": [0.45, 0.35]}],
                                  "final_eval_all_heldout_windows": {"ttt_agreement": [0.45, 0.35]}}]
    assert (tmp_path / "o" / "c.png").stat().st_size > 0


def test_curve_without_compare_has_no_compare_key(tmp_path):
    ref = _head(tmp_path / "ref", "reference", [{"tokens": 100, "agreement": [0.5]}])
    assert eagle3_curve.main([str(ref), "--out", str(tmp_path / "o"), "--name", "c"]) == 0
    assert "compare" not in json.loads((tmp_path / "o" / "c.json").read_text())
