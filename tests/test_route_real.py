"""Routing and cascades on the real MiniLM-L6 → MPNet-base pair: golden behaviour of the routed
plans on a small movie-calib subset — every branch forced, the cascade equal row by row to its definition,
the learned router's ONNX equal to its numpy head, and an impossible budget refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import DATA, run_cli

import dyncompile
from dyncompile.io import read_jsonl, texts_and_labels
from dyncompile.passes.early_exit.certify import CertificationError
from dyncompile.runtime.rules.exit_rule import confidence, confidence_thresholds

ROWS = 120
FORCED = 40  # rows of the forced-threshold checks (see there)
COSTS = {"minilm": 5.0, "mpnet": 40.0}  # given (timing is not a test's business); the plans record source=given


@pytest.fixture(scope="module")
def pair(minilm, mpnet, module_tmp):
    root = module_tmp("route")
    plans = {}
    for name, art in (("minilm", minilm), ("mpnet", mpnet)):
        plans[name] = dyncompile.compile(art.onnx_path, "cleanup", root / name, progress=False).plan_dir
    rows = read_jsonl(DATA / "movie-calib.jsonl", limit=ROWS)
    calib = root / "calib.jsonl"
    calib.write_text("".join(json.dumps(r) + "\n" for r in rows))
    models = {n: dyncompile.load(d) for n, d in plans.items()}
    texts, y = texts_and_labels(rows, models["minilm"].plan.labels)
    probs = {n: m.predict_proba(texts) for n, m in models.items()}
    outputs = {str(plans[n]): probs[n] for n in plans}
    cascade = dyncompile.route([plans["minilm"], plans["mpnet"]], calib, root / "cascade", budget=2.0, confidence="none",
                               costs=COSTS, outputs=outputs)
    return {"root": root, "plans": plans, "calib": calib, "texts": texts, "y": np.asarray(y), "probs": probs,
            "outputs": outputs, "cascade": cascade}


def _with_threshold(src, dst, t):
    import shutil

    shutil.copytree(src, dst)
    raw = json.loads((dst / "plan.json").read_text())
    raw["steps"][0]["rule"]["thresholds"] = [t]
    (dst / "plan.json").write_text(json.dumps(raw))
    return dst


def test_cascade_is_minilm_where_confident_else_mpnet(pair):
    plan_dir = pair["cascade"].plan_dir
    m = dyncompile.load(plan_dir)
    t = m.task_api.text_step.rule.thresholds[0]
    got = m.predict_proba(pair["texts"], batch_size=16)
    cand = m.last_info["candidate"]
    pm, pb = pair["probs"]["minilm"], pair["probs"]["mpnet"]
    stop = confidence(pm, "entropy") > confidence_thresholds([t], "entropy")[0]
    assert 0 < stop.sum() < len(stop), "the calibrated threshold should split this subset (both branches taken)"
    np.testing.assert_array_equal(cand, np.where(stop, 0, 1))
    np.testing.assert_allclose(got, np.where(stop[:, None], pm, pb), atol=2e-5)
    preds = m(pair["texts"][:3])
    assert [p.candidate for p in preds] == [["minilm", "mpnet"][c] for c in cand[:3]]


@pytest.mark.parametrize("threshold, alone", [(np.log(2) + 1, "minilm"), (None, "mpnet")])
def test_forced_thresholds_give_each_model_alone(pair, tmp_path, threshold, alone):
    """Entropy threshold log(C) + 1 always fires (MiniLM answers everything); None never fires (MPNet)."""
    d = _with_threshold(pair["cascade"].plan_dir, tmp_path / f"forced-{alone}", threshold)
    m = dyncompile.load(d)
    # FORCED rows, not all ROWS: a forced threshold sends every row to one model whatever the row, so the claim is
    # row by row and does not grow with the row count; 40 rows still make a full batch of 32 and a partial one
    got = m.predict_proba(pair["texts"][:FORCED], batch_size=32)
    np.testing.assert_allclose(got, pair["probs"][alone][:FORCED], atol=2e-5)
    assert set(m.last_info["candidate"].tolist()) == {0 if alone == "minilm" else 1}


def test_learned_router_onnx_equals_numpy_head(pair):
    import onnxruntime as ort

    from dyncompile.passes.routing.router import bag_features, find_token_embedding
    from dyncompile.runtime.text import TextEncoder

    res = dyncompile.route([pair["plans"]["minilm"], pair["plans"]["mpnet"]], pair["calib"], pair["root"] / "learned",
                           rule="learned", budget=2.0, confidence="none", costs={**COSTS, "router": 0.1},
                           outputs=pair["outputs"], force=True)
    plan = dyncompile.load(res.plan_dir).plan
    enc = TextEncoder.from_plan(plan, plan.tokenizer)
    feeds = enc(pair["texts"][:40])
    sess = ort.InferenceSession(str(plan.path_of("router")), providers=["CPUExecutionProvider"])
    onnx_scores = sess.run(None, {"input_ids": feeds["input_ids"], "attention_mask": feeds["attention_mask"]})[0]
    table = find_token_embedding(dyncompile.load(pair["plans"]["minilm"]).plan.path_of("model"))
    head_scores = res.fit.router.scores(bag_features(feeds["input_ids"], feeds["attention_mask"], table))
    assert np.abs(head_scores).max() > 0.05, "a fitted head, not a constant"
    np.testing.assert_allclose(onnx_scores, head_scores, rtol=1e-4, atol=1e-4)
    # the routed plan follows the router: rows above the threshold go to MiniLM
    m = dyncompile.load(res.plan_dir)
    m.predict_proba(pair["texts"][:40], batch_size=8)
    t = m.task_api.text_step.thresholds[0]
    np.testing.assert_array_equal(m.last_info["candidate"], np.where(head_scores[:, 0] > t, 0, 1))


def test_impossible_budget_is_refused(pair, tmp_path):
    with pytest.raises(CertificationError, match="--budget"):
        dyncompile.route([pair["plans"]["minilm"], pair["plans"]["mpnet"]], pair["calib"], tmp_path / "r", budget=0.0,
                         costs=COSTS, outputs=pair["outputs"])
    assert not (tmp_path / "r").exists()


def test_cli_inspect_and_run_show_the_candidates(pair, capsys):
    d = pair["cascade"].plan_dir
    rc, out, err = run_cli(capsys, "inspect", d)
    assert rc == 0, err
    assert "cascade: 2 candidates" in out and "5.000 ms/call (given" in out and "(verified)" in out
    assert "rule:    confidence" in out
    rc, out, err = run_cli(capsys, "run", d, "--text", "A gorgeous, witty, wonderful movie.")
    assert rc == 0, err
    assert "answered by minilm" in out and "positive" in out
