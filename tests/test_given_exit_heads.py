"""early-exit{heads=given}: a DeeBERT-style graph that already outputs per-layer logits."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx_ir as ir
from helpers import DATA, assert_clean_error, ort_session, run_cli

import dyncompile
from dyncompile.models.synthetic import tiny_encoder_classifier
from dyncompile.passes import _keys
from dyncompile.passes.early_exit import WireGivenExitHeadsPass
from dyncompile.passes.early_exit.attach_exit_heads import attach_exit_heads
from dyncompile.passes.early_exit.heads import ExitHead

BUDGET = 5.0  # points: 10 of the 200 calibration rows


def _deebert_model(minilm, tmp_path):
    m = tiny_encoder_classifier(num_layers=4, hidden=256, vocab=30522)
    lns = [n for n in m.graph if n.op_type == "LayerNormalization"]
    cuts = {k: lns[k].outputs[0].name for k in (1, 2, 3)}
    rng = np.random.default_rng(3)
    heads = {k: ExitHead("cls", [(rng.standard_normal((256, 2)).astype(np.float32), np.zeros(2, np.float32), "none")])
             for k in cuts}
    attach_exit_heads(m, heads=heads, cuts=cuts, thresholds={k: None for k in cuts}, num_layers=4)
    del m.metadata_props[_keys.EARLY_EXIT]  # a plain graph with extra outputs, as a DeeBERT export would be
    for v in m.graph.outputs[1:]:
        v.name = v.name.replace("exit_logits_", "deebert_layer_")
    d = tmp_path / "deebert"
    d.mkdir()
    ir.save(m, d / "model.onnx")
    shutil.copy(minilm.tokenizer_path, d / "tokenizer.json")
    return d / "model.onnx"


def _calib(tmp_path, rows=200):
    lines = (DATA / "movie-calib.jsonl").read_text().splitlines()[:rows]
    calib = tmp_path / "calib.jsonl"
    calib.write_text("\n".join(lines) + "\n")
    return calib, [json.loads(x) for x in lines]


def test_given_heads_are_wired_calibrated_and_lowered(minilm, tmp_path):
    path = _deebert_model(minilm, tmp_path)
    calib, rows = _calib(tmp_path)
    res = dyncompile.compile(path, "early-exit", tmp_path / "out", calib=str(calib), heads="given", budget=BUDGET,
                             lowering="staged", progress=False)
    # -O2 on the CPU EP fuses the encoder's attention first (presets; key-padding-mask, fuse-gelu and
    # tabulate-length-values, also inserted, are skipped where they find nothing); then the passes early-exit builds
    assert [r.name for r in res.pipeline.records] == [
        "FuseEncoderAttentionPass", "KeyPaddingMaskPass", "FuseGeluPass", "TabulateLengthValuesPass", "RaiseOpsetPass",
        "WireGivenExitHeadsPass", "InsertEarlyExitPass"]
    m = dyncompile.load(res.plan_dir, optimization="disable")
    # calibrated: run by the runtime on the calibration rows, the plan keeps its promise there (the
    # calibrator's numpy decisions vs the ONNX heads + runtime rule: at most one row may flip at a threshold)
    labels = np.array([r["label"] for r in rows])
    feeds = m.encode([r["text"] for r in rows])
    st = m.run_feeds(dict(feeds))
    full = ort_session(path).run(["logits"], feeds)[0]
    drop = ((full.argmax(-1) == labels).mean() - (st["logits"].argmax(-1) == labels).mean()) * 100
    assert drop <= BUDGET + 100 / len(rows)
    assert (st["exit_layer"] < 4).mean() >= 0.25  # and it spends the budget: a quarter of the rows or more exit early
    # the rows that exit return the given heads' own logits
    texts = [json.loads(x)["text"] for x in (DATA / "movie-test.jsonl").read_text().splitlines()[:16]]
    feeds = m.encode(texts)
    st = m.run_feeds(dict(feeds))
    ref = dict(zip([o.name for o in ort_session(path).get_outputs()], ort_session(path).run(None, feeds)))
    for k in (1, 2, 3):
        sel = st["exit_layer"] == k
        np.testing.assert_allclose(st["logits"][sel], ref[f"deebert_layer_{k}"][sel], rtol=0, atol=1e-5)


def test_wire_pass_second_run_is_a_no_op(minilm, tmp_path):
    path = _deebert_model(minilm, tmp_path)
    _, rows = _calib(tmp_path, rows=120)
    model = ir.load(path)
    wire = WireGivenExitHeadsPass([r["text"] for r in rows], [r["label"] for r in rows],
                                  tokenizer_file=minilm.tokenizer_path, max_length=64, budget=BUDGET, progress=False)
    assert wire(model).modified is True
    outputs = [v.name for v in model.graph.outputs]
    assert outputs[0] == "logits" and all(n.startswith("exit_logits_") for n in outputs[1:])
    assert wire(model).modified is False
    assert [v.name for v in model.graph.outputs] == outputs


def test_given_heads_refused_on_a_plain_classifier(minilm, tmp_path, capsys):
    calib, _ = _calib(tmp_path)
    rc, _, err = run_cli(capsys, minilm.onnx_path, "--passes", "early-exit{heads=given}", "--calib", calib, "-o", tmp_path / "o")
    assert_clean_error(rc, err, "per-layer logits")


def test_given_heads_refuse_the_learned_criterion(minilm, tmp_path, capsys):
    path = _deebert_model(minilm, tmp_path)
    calib, _ = _calib(tmp_path)
    rc, _, err = run_cli(capsys, path, "--passes", "early-exit{heads=given}", "--criterion", "learned", "--calib",
                         calib, "--confidence", "none", "-o", tmp_path / "o")
    assert_clean_error(rc, err, "--criterion learned needs fitted heads")
    assert not (tmp_path / "o").exists()
