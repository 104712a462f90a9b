"""The encoder peers of the quantized-certified study: OpenVINO (+ NNCF int8) and an ONNX file on ONNX Runtime.

Parsing is checked everywhere; the OpenVINO runner and NNCF's int8 run in the OpenVINO CI environment (``make
test`` installs openvino and nncf there) on the real MiniLM-L6 sentiment model.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import DATA

from dyncompile.errors import DataError
from dyncompile.tools.studies.encoder_peers import PEER_KINDS, parse_peer


def test_parse_peer_kinds_paths_and_options(tmp_path):
    (tmp_path / "ov").mkdir()
    (tmp_path / "ov" / "model.xml").write_text("<net/>")
    (tmp_path / "ov" / "model.bin").write_bytes(b"")
    (tmp_path / "q.onnx").write_bytes(b"")
    assert parse_peer(f"NNCF int8=openvino:{tmp_path / 'ov'},precision=f32,pad=64") == (
        "NNCF int8", "openvino", tmp_path / "ov" / "model.xml", {"precision": "f32", "pad": "64"})
    assert parse_peer(f"Optimum=onnxruntime:{tmp_path / 'q.onnx'}") == ("Optimum", "onnxruntime", tmp_path / "q.onnx", {})
    assert parse_peer(f"dir=onnxruntime:{tmp_path}")[2] == tmp_path / "q.onnx"  # a folder holding one ONNX file
    assert set(PEER_KINDS) == {"openvino", "onnxruntime"}


@pytest.mark.parametrize("text, says", [
    ("no-kind", "LABEL=KIND:PATH"),
    ("x=tensorrt:model.onnx", "KIND one of"),
    ("=openvino:model.xml", "LABEL=KIND:PATH"),
    ("x=onnxruntime:{d}/q.onnx,precision=f32", "unknown option"),
    ("x=openvino:{d}/ov,threads=4", "unknown option"),
    ("x=openvino:{d}/ov,pad=0", "positive number of tokens"),
    ("x=openvino:{d}/ov,pad=long", "positive number of tokens"),
    ("x=openvino:{d}/missing.xml", "prepare it first"),
    ("x=onnxruntime:{d}", "2 model files"),
])
def test_parse_peer_errors_say_what_to_do(tmp_path, text, says):
    (tmp_path / "ov").mkdir()
    (tmp_path / "ov" / "model.xml").write_text("<net/>")
    (tmp_path / "q.onnx").write_bytes(b"")
    (tmp_path / "r.onnx").write_bytes(b"")
    with pytest.raises(DataError, match=says):
        parse_peer(text.format(d=tmp_path))


def test_study_cli_refuses_a_bad_peer_before_loading(capsys):
    from dyncompile.tools.studies import quantized_certified

    with pytest.raises(SystemExit) as e:
        quantized_certified.main(["--name", "x", "--plans", "a=missing-plan", "--peer", "x=tensorrt:m.onnx", "--out", "o"])
    assert e.value.code == 2
    assert "KIND one of openvino, onnxruntime" in capsys.readouterr().err


def test_study_cli_refuses_repeated_labels(capsys):
    from dyncompile.tools.studies import quantized_certified

    with pytest.raises(SystemExit) as e:
        quantized_certified.main(["--name", "x", "--plans", "int8=a", "--peer", "int8=onnxruntime:m.onnx", "--out", "o"])
    assert e.value.code == 2
    assert "repeated: ['int8']" in capsys.readouterr().err


@pytest.fixture(scope="module")
def minilm_fp32_plan(minilm, tmp_path_factory):
    import dyncompile

    res = dyncompile.compile(minilm.onnx_path, "verify,cleanup", tmp_path_factory.mktemp("peers") / "fp32",
                             opt_level=0, progress=False)
    return dyncompile.load(res.plan_dir)


TEXTS = ["A gorgeous, witty, seductive movie.", "The plot is tedious and the acting is wooden.",
         "It's not a bad film, just forgettable, and the middle drags on far longer than it should."]


def test_onnxruntime_peer_is_the_original_on_ort(minilm, minilm_fp32_plan):
    from dyncompile.tools.studies.encoder_peers import peer_runner

    r = peer_runner(f"orig=onnxruntime:{minilm.onnx_path}", minilm_fp32_plan)
    probs, exits = r.fn(TEXTS[:1])
    assert exits is None and r.info["peer"] == "onnxruntime"
    np.testing.assert_allclose(probs, minilm_fp32_plan.predict_proba(TEXTS[:1]), rtol=0, atol=1e-5)


@pytest.mark.openvino
def test_openvino_peer_reproduces_ort_in_f32(minilm, minilm_fp32_plan):
    pytest.importorskip("openvino", reason="OpenVINO runs in the OpenVINO environment (make test installs it)")
    from dyncompile.tools.studies.encoder_peers import openvino_runner

    r = openvino_runner("ov", minilm.onnx_path, minilm_fp32_plan, precision="f32")
    assert r.info["inference_precision"] == "f32" and r.info["threads"] == 2
    padded = openvino_runner("ov64", minilm.onnx_path, minilm_fp32_plan, precision="f32", pad=64)
    assert padded.info["input_shape"] == "[1, 64] (padded)" and r.info["input_shape"] == "dynamic"
    for t in TEXTS:  # one row at a time, each its own length; padded to 64, masked
        want = minilm_fp32_plan.predict_proba([t])
        np.testing.assert_allclose(r.fn([t])[0], want, rtol=0, atol=1e-4)
        np.testing.assert_allclose(padded.fn([t])[0], want, rtol=0, atol=1e-4)
    with pytest.raises(DataError, match="shorter than the plan's rows"):
        openvino_runner("short", minilm.onnx_path, minilm_fp32_plan, pad=16)


@pytest.mark.openvino
def test_nncf_int8_quantizes_and_records(minilm, minilm_fp32_plan, tmp_path):
    ov = pytest.importorskip("openvino", reason="OpenVINO runs in the OpenVINO environment (make test installs it)")
    pytest.importorskip("nncf", reason="NNCF is installed in the OpenVINO environment")
    from dyncompile.tools.studies.encoder_peers import nncf_int8, openvino_runner

    with pytest.raises(DataError, match="needs 2100"):
        nncf_int8(minilm_fp32_plan.plan.directory, DATA / "movie-calib.jsonl", tmp_path / "x", rows=100,
                  max_drop=1.0, validation_rows=2000)
    rec = nncf_int8(minilm_fp32_plan.plan.directory, DATA / "movie-calib.jsonl", tmp_path / "q", rows=16)
    assert rec["calibration_rows"] == [0, 16] and rec["method"].startswith("nncf.quantize")
    assert json.loads((tmp_path / "q" / "peer.json").read_text()) == rec
    assert not list((tmp_path / "q").glob(".*"))  # no temporary file left
    ops = {op.get_type_name() for op in ov.Core().read_model(str(tmp_path / "q" / "model.xml")).get_ops()}
    assert "FakeQuantize" in ops  # int8 quantization inserted; the fp32 original has none
    assert "FakeQuantize" not in {op.get_type_name() for op in ov.Core().read_model(str(minilm.onnx_path)).get_ops()}
    r = openvino_runner("int8", tmp_path / "q" / "model.xml", minilm_fp32_plan, precision="f32")
    pos = [r.fn([t])[0].argmax(-1)[0] for t in TEXTS[:2]]
    assert pos == [1, 0]  # clear-cut reviews keep their answers
