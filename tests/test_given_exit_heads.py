"""early-exit{heads=given}: a DeeBERT-style graph that already outputs per-layer logits."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx_ir as ir
from helpers import DATA, ort_session

import dyncompile
from dyncompile.models.synthetic import tiny_encoder_classifier
from dyncompile.passes.early_exit.exit_heads import ExitHead
from dyncompile.passes.early_exit.fit_exit_heads import EARLY_EXIT_KEY, attach_exit_heads


def _deebert_model(minilm, tmp_path):
    m = tiny_encoder_classifier(num_layers=4, hidden=256, vocab=30522)
    lns = [n for n in m.graph if n.op_type == "LayerNormalization"]
    cuts = {k: lns[k].outputs[0].name for k in (1, 2, 3)}
    rng = np.random.default_rng(3)
    heads = {k: ExitHead("cls", [(rng.standard_normal((256, 2)).astype(np.float32), np.zeros(2, np.float32), "none")])
             for k in cuts}
    attach_exit_heads(m, heads=heads, cuts=cuts, thresholds={k: None for k in cuts}, num_layers=4)
    del m.metadata_props[EARLY_EXIT_KEY]  # a plain graph with extra outputs, as a DeeBERT export would be
    for v in m.graph.outputs[1:]:
        v.name = v.name.replace("exit_logits_", "deebert_layer_")
    d = tmp_path / "deebert"
    d.mkdir()
    ir.save(m, d / "model.onnx")
    shutil.copy(minilm.tokenizer_path, d / "tokenizer.json")
    return d / "model.onnx"


def test_given_heads_are_wired_calibrated_and_lowered(minilm, tmp_path):
    path = _deebert_model(minilm, tmp_path)
    calib = tmp_path / "calib.jsonl"
    calib.write_text("\n".join((DATA / "movie-calib.jsonl").read_text().splitlines()[:200]) + "\n")
    res = dyncompile.compile(path, "early-exit", tmp_path / "out", calib=str(calib), heads="given", budget=100.0,
                             lowering="staged", progress=False)
    assert [r.name for r in res.pipeline.records] == ["WireGivenExitHeadsPass", "InsertEarlyExitPass"]
    pol = res.plan.policy["early_exit"]
    assert set(pol["thresholds"]) <= {"1", "2", "3"} and any(t is not None for t in pol["thresholds"].values())
    m = dyncompile.load(res.plan_dir, optimization="disable")
    rows = [json.loads(x)["text"] for x in (DATA / "movie-test.jsonl").read_text().splitlines()[:16]]
    feeds = m.encode(rows)
    st = m.run_feeds(dict(feeds))
    ref = dict(zip([o.name for o in ort_session(path).get_outputs()], ort_session(path).run(None, feeds)))
    for k in (1, 2, 3):
        sel = st["exit_layer"] == k
        np.testing.assert_allclose(st["logits"][sel], ref[f"deebert_layer_{k}"][sel], rtol=0, atol=1e-5)
    assert (st["exit_layer"] < 4).any()


def test_given_heads_refused_on_a_plain_classifier(minilm, tmp_path, capsys):
    from dyncompile.tools.cli import main

    calib = tmp_path / "calib.jsonl"
    calib.write_text("\n".join((DATA / "movie-calib.jsonl").read_text().splitlines()[:200]) + "\n")
    rc = main([str(minilm.onnx_path), "--passes", "early-exit{heads=given}", "--calib", str(calib), "-o", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "per-layer logits" in err and "Traceback" not in err
