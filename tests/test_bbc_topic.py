"""A second task: the ``minilm-l6-bbc-news`` recipe (5-class BBC News topics, fine-tuned on the CPU) and early exit
on it. Slow (the first build fine-tunes for minutes on 2 cores; later runs reuse the cached model)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import ort_session

import dyncompile

pytestmark = pytest.mark.slow

CALIB_ROWS = 400


@pytest.fixture(scope="module")
def bbc():
    from dyncompile.models import build_model

    return build_model("minilm-l6-bbc-news", progress=False)


def _rows(art, split):
    return [json.loads(x) for x in (art.dir / "data" / f"bbc-{split}.jsonl").read_text().splitlines()]


def test_recipe_artifacts_splits_and_recorded_accuracy(bbc):
    """Splits are disjoint, complete and hashed; the recorded accuracy (PyTorch, at build) is what the ONNX
    model gives on bbc-test (one row = 0.2 points: ORT may flip at most a near-tie)."""
    from dyncompile.models._core import sha256_file
    from dyncompile.models._topic import BBC_LABELS
    from dyncompile.models.evaluate import classifier_accuracy

    cfg = bbc.config
    assert cfg["labels"] == list(BBC_LABELS) and cfg["family"] == "bert" and cfg["num_layers"] == 6
    ids = {}
    for split, n in (("train", 1000), ("calib", 725), ("test", 500)):
        rows = _rows(bbc, split)
        assert len(rows) == n == cfg["data"][split]["rows"]
        assert sha256_file(bbc.dir / cfg["data"][split]["file"]) == cfg["data"][split]["sha256"]
        ids[split] = {r["id"] for r in rows}
        assert {r["label"] for r in rows} == set(range(5))
    assert not (ids["train"] & ids["calib"] or ids["train"] & ids["test"] or ids["calib"] & ids["test"])
    acc = classifier_accuracy(bbc, bbc.dir / "data" / "bbc-test.jsonl", batch_size=64)
    assert acc.total == 500
    assert abs(100 * acc.accuracy - cfg["accuracy"]["bbc-test"]) <= 0.2 + 1e-9, (acc, cfg["accuracy"])


@pytest.mark.parametrize("heads", ["fitted", "trained"])
def test_early_exit_on_five_classes(bbc, module_tmp, heads):
    """The pass finds the 6 BERT layers of the new model, fits/trains 5-class heads on bbc-calib, and the staged
    plan with every exit disabled reproduces the original logits; with exits on, some rows leave early."""
    lines = (bbc.dir / "data" / "bbc-calib.jsonl").read_text().splitlines()[:CALIB_ROWS]
    d = module_tmp(heads)
    calib = d / "calib.jsonl"
    calib.write_text("\n".join(lines) + "\n")
    kw = dict(calib=str(calib), progress=False, heads=heads, lowering="staged", confidence="none")
    never = dyncompile.compile(bbc.onnx_path, "early-exit", d / "never", never_exit=True, **kw)
    live = dyncompile.compile(bbc.onnx_path, "early-exit", d / "live", budget=1.0, **kw)
    texts = [r["text"] for r in _rows(bbc, "test")[:32]]
    m = dyncompile.load(never.plan_dir, optimization="disable")
    ref = ort_session(bbc.onnx_path)
    from dyncompile.runtime.text import TextEncoder

    enc = TextEncoder(bbc.tokenizer_path, max_length=512)
    for t in texts[:6]:
        feeds = enc([t])
        inputs = {i.name: feeds[i.name] for i in ref.get_inputs()}
        np.testing.assert_allclose(m.run_feeds(dict(inputs))["logits"], ref.run(None, inputs)[0], rtol=0, atol=1e-5)
    ee = dyncompile.load(live.plan_dir)
    p = ee.predict_proba(texts)
    assert p.shape == (32, 5)
    assert ee.last_info["exit_layer"].min() < 6
