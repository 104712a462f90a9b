"""Foreign-model matrix through Optimum's exporter: tiny random-init transformers models of six families, written
by the Optimum environment's transformers 4.x (tests/_optimum_tiny_models.py), exported with
``dyncompile export --exporter optimum`` (``python -m optimum.exporters.onnx`` in that environment), then read by
dyncompile in this one.

Families and sizes as in test_foreign_models.py: BERT, RoBERTa, DistilBERT classifiers (3 layers, hidden 256) and
GPT-2, Llama, Qwen2 decoders (2 layers, hidden 32; Optimum's ``text-generation-with-past``: inputs ``input_ids``,
``past_key_values.N.key/value``, ``attention_mask``, ``position_ids``). For each: ``inspect`` (family and task),
``verify,cleanup`` exact against Optimum's ONNX (<= 1e-5), then early exit on classifiers (a small calibration
file) and speculative prompt lookup at the default ``-O`` on decoders (greedy tokens identical to the target alone
and to transformers' ``generate`` in the Optimum environment). Skipped only when no Optimum environment exists
(``make setup-optimum``) and ``CI`` is not set; under CI it must run.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import assert_clean_error

import dyncompile
from dyncompile.models._optimum import find_optimum_python
from dyncompile.passes.compiler import compile_model

PY = find_optimum_python()
if PY is None and not os.environ.get("CI"):
    pytest.skip("no Optimum environment (make setup-optimum)", allow_module_level=True)

PROMPT = "the movie was good and the plot was"
POSITIVE = ("good", "great", "fun", "love")
CLASSIFIERS = ("bert", "roberta", "distilbert")
DECODERS = ("gpt2", "llama", "qwen2")
SCRIPT = Path(__file__).with_name("_optimum_tiny_models.py")


def _cli(*argv):
    from contextlib import redirect_stderr, redirect_stdout
    from io import StringIO

    from dyncompile.tools.cli import main

    o, e = StringIO(), StringIO()
    with redirect_stdout(o), redirect_stderr(e):
        rc = main([str(a) for a in argv])
    return rc, o.getvalue(), e.getvalue()


@pytest.fixture(scope="module")
def written(module_tmp) -> Path:
    """The six tiny HF folders (``ROOT/FAMILY/hf``), written by the Optimum environment's transformers in one
    subprocess (the same folders one subprocess per family wrote; one torch + transformers start-up instead of six)."""
    assert PY is not None, "CI is set but no Optimum environment was found: run make setup-optimum"
    root = module_tmp("optimum")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([PY, str(SCRIPT), str(root), PROMPT, *CLASSIFIERS, *DECODERS], capture_output=True, text=True,
                       env=env, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    return root


@pytest.fixture(scope="module", params=CLASSIFIERS + DECODERS)
def exported(request, written):
    """A tiny HF folder written by the Optimum environment's transformers and its Optimum export."""
    family = request.param
    root = written / family
    hf, out = root / "hf", root / "onnx"
    rc, stdout, err = _cli("export", hf, "-o", out, "--exporter", "optimum")
    assert rc == 0, err
    assert "exporter: optimum" in stdout
    ref = json.loads((root / "hf.reference.json").read_text())
    cfg = json.loads((hf / "config.json").read_text())
    return SimpleNamespace(family=family, hf=hf, path=out, root=root, decoder=family in DECODERS, ref=ref,
                           vocab=cfg["vocab_size"])


def _calib(path: Path) -> Path:
    rows = [{"text": f"{d} {a} {b} {c}", "label": "POSITIVE" if a in POSITIVE else "NEGATIVE"}
            for a in ("good", "bad", "great", "awful", "fun", "boring", "love", "hate")
            for b in ("movie", "film", "plot", "acting") for c in ("very", "not", "and") for d in ("the", "a")]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _onnx_feeds(sess, vocab: int, batch: int = 2, seq: int = 5) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feeds = {}
    for i in sess.get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = rng.integers(0, vocab, (batch, seq)).astype(np.int64)
        elif i.name == "position_ids":
            feeds[i.name] = np.arange(seq)[None].repeat(batch, 0).astype(np.int64)
        elif i.name in ("attention_mask", "token_type_ids"):
            feeds[i.name] = np.ones((batch, seq), np.int64) * (i.name == "attention_mask")
        else:  # an empty KV cache: [batch, kv_heads, 0, head_dim]
            feeds[i.name] = np.zeros((batch, i.shape[1], 0, i.shape[3]), np.float32)
    return feeds


def test_export_layout_and_input_untouched(exported):
    assert (exported.path / "model.onnx").is_file() and (exported.path / "config.json").is_file()
    assert not list(exported.root.glob(".onnx.*"))  # the temporary folder is gone
    assert not list(exported.hf.glob("*.onnx"))  # nothing written into the input


def test_inspect_names_family_and_task(exported):
    rc, out, err = _cli("inspect", exported.path)
    assert rc == 0, err
    task = "text-generation" if exported.decoder else "text-classification"
    assert f"From config.json: model_type {exported.family}; task {task}" in out
    if exported.decoder:
        assert "Family guess: decoder" in out and "Task guess: text-generation" in out
    else:
        assert f"Family guess: {exported.family} " in out


def test_verify_cleanup_is_exact(exported):
    from helpers import ort_session

    res = compile_model(exported.path, "verify,cleanup", exported.root / "vc", progress=False, opt_level=0)
    assert res.plan.task == ("text-generation" if exported.decoder else "text-classification")
    (onnx_file,) = list(res.plan_dir.glob("*.onnx"))
    before, after = ort_session(exported.path / "model.onnx"), ort_session(onnx_file)
    feeds = _onnx_feeds(before, exported.vocab)
    for a, b in zip(before.run(None, feeds), after.run(None, feeds)):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)


def test_technique(exported, tmp_path):
    """Classifiers: early exit compiles (certified thresholds) and runs; decoders: prompt lookup, token-identical."""
    if exported.decoder:
        tgt = compile_model(exported.path, "verify,cleanup", tmp_path / "t", progress=False).plan_dir
        spec = compile_model(exported.path, "speculative{measure=false}", tmp_path / "s", drafter="prompt-lookup",
                             progress=False).plan_dir
        ref = exported.ref["greedy_ids"]
        assert len(ref) >= 4, ref
        alone = dyncompile.load(tgt).generate(PROMPT, max_new_tokens=16)
        fast = dyncompile.load(spec).generate(PROMPT, max_new_tokens=16)
        assert alone.token_ids == ref
        assert fast.token_ids == ref
        return
    res = compile_model(exported.path, "early-exit{budget=50}", tmp_path / "ee", calib=_calib(tmp_path / "c.jsonl"),
                        progress=False)
    assert res.plan.policy["early_exit"]["certificate"]["certified"]
    rc, out, err = _cli("run", res.plan_dir, "--text", "a good movie")
    assert rc == 0 and ("POSITIVE" in out or "NEGATIVE" in out), err


@pytest.mark.parametrize("exported", ["gpt2"], indirect=True)  # one family is enough
def test_auto_takes_optimum_and_says_which_ran(exported, tmp_path, monkeypatch):
    monkeypatch.delenv("DYNCOMPILE_OPTIMUM_PYTHON", raising=False)
    rc, out, err = _cli("export", exported.hf, "-o", tmp_path / "auto")
    assert rc == 0, err
    assert "exporter: optimum" in out and "past_key_values.0.key" in out
    rc, out, err = _cli("export", exported.hf, "-o", tmp_path / "torch", "--exporter", "torch")
    assert rc == 0, err
    assert "exporter: torch.onnx (built in)" in out


# ------------------------------------------------------------------------------------------ refusals


def test_missing_environment_is_one_error_line(tmp_path, monkeypatch):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    rc, _, err = _cli("export", hf, "-o", tmp_path / "out", "--exporter", "optimum", "--optimum-python",
                      tmp_path / "nope" / "python")
    assert_clean_error(rc, err, "--optimum-python", "make setup-optimum")
    monkeypatch.setenv("DYNCOMPILE_OPTIMUM_PYTHON", str(tmp_path / "nope" / "python"))
    rc, _, err = _cli("export", hf, "-o", tmp_path / "out", "--exporter", "optimum")
    assert_clean_error(rc, err, "DYNCOMPILE_OPTIMUM_PYTHON", "make setup-optimum")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def test_optimum_failure_is_one_error_line_and_leaves_nothing(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()  # a config naming a supported head, but no weights: Optimum's exporter fails
    (hf / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    rc, _, err = _cli("export", hf, "-o", tmp_path / "out", "--exporter", "optimum")
    assert_clean_error(rc, err, "Optimum's exporter failed")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))
    assert sorted(p.name for p in hf.iterdir()) == ["config.json"]
