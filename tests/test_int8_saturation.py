"""ONNX Runtime's u8 x s8 int8 kernels on x86 CPUs without VNNI add pairs of products in int16 with saturation:
:func:`~dyncompile.runtime.providers.int8_pairs_saturate` predicts it (checked against ORT itself on this machine),
7-bit weights (``quantize-int8{reduce_range=true}``) are exact everywhere, and loading a plan with 8-bit int8
weights on such a CPU logs one warning that says what and how to fix it; ``reduce_range=auto`` (the default) picks
7-bit weights for every int8 format where the compiling CPU saturates."""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from helpers import tiny_classifier_dir

import dyncompile
from dyncompile.runtime import providers


def _matmul_integer(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """One ``MatMulInteger(x: uint8, w: int8 constant)`` in ONNX Runtime's CPU EP."""
    xv = ir.Value(name="x", type=ir.TensorType(ir.DataType.UINT8), shape=ir.Shape([None, w.shape[0]]))
    wv = ir.Value(name="w", const_value=ir.tensor(w))
    node = ir.node("MatMulInteger", [xv, wv])
    node.outputs[0].name = "y"
    graph = ir.Graph([xv], node.outputs, nodes=[node], initializers=[wv], opset_imports={"": 18})
    data = ir.to_proto(ir.Model(graph, ir_version=10)).SerializeToString()
    return ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_the_saturation_prediction_matches_onnx_runtime_on_this_cpu():
    k = 64
    x = np.full((4, k), 255, np.uint8)
    full = _matmul_integer(np.full((k, 16), 127, np.int8), x)
    exact = 255 * 127 * k
    if providers.int8_pairs_saturate():  # every pair 2 x 255 x 127 = 64,770 is clipped to 32,767
        assert (full == 32767 * (k // 2)).all()
    else:
        assert (full == exact).all()
    # 7-bit weights: a pair is at most 2 x 255 x 63 = 32,130, exact on every CPU
    assert (_matmul_integer(np.full((k, 16), 63, np.int8), x) == 255 * 63 * k).all()


def test_loading_an_8_bit_int8_plan_on_a_saturating_cpu_warns_once(minilm, tmp_path, caplog, monkeypatch):
    d, _ = tiny_classifier_dir(tmp_path, minilm)
    plans = {name: dyncompile.compile(d / "model.onnx", passes, tmp_path / name, progress=False).plan.directory
             for name, passes in (("int8", "quantize-int8{reduce_range=false}"),
                                  ("int8-7bit", "quantize-int8{reduce_range=true}"),
                                  ("fp32", "verify,cleanup"))}
    monkeypatch.setattr(providers, "int8_pairs_saturate", lambda: True)
    said = {}
    for name, plan in plans.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dyncompile.runtime.providers"):
            dyncompile.load(plan)
        said[name] = [r.getMessage() for r in caplog.records if "VNNI" in r.getMessage()]
    assert len(said["int8"]) == 1 and "quantize-int8{reduce_range=true}" in said["int8"][0]
    assert "Recompile on this machine" in said["int8"][0]
    assert said["int8-7bit"] == [] and said["fp32"] == []
    monkeypatch.setattr(providers, "int8_pairs_saturate", lambda: False)  # a CPU with VNNI: nothing to say
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dyncompile.runtime.providers"):
        dyncompile.load(plans["int8"])
    assert not [r for r in caplog.records if "VNNI" in r.getMessage()]


@pytest.mark.parametrize("rec, warns", [
    ("QuantizeDynamicInt8Pass(per_channel=False, op_types=['MatMul'])", True),
    ("QuantizeDynamicInt8Pass(per_channel=False, reduce_range=True, op_types=['MatMul'])", False),
    ("QuantizeStaticInt8Pass(per_channel=True, symmetric_activations=False)", True),
    ("QuantizeWeightsInt4Pass(block_size=32)", False),
])
def test_the_warning_reads_the_recorded_pass_list(rec, warns, monkeypatch):
    monkeypatch.setattr(providers, "int8_pairs_saturate", lambda: True)
    assert providers.warn_if_int8_saturates(["VerifyModelPass(full_check=True)", rec], "CPUExecutionProvider") is warns
    assert providers.warn_if_int8_saturates([rec], "OpenVINOExecutionProvider") is False


@pytest.mark.parametrize("saturates", [True, False])
@pytest.mark.parametrize("spec, repr_prefix", [
    ("quantize-int8{format=dynamic}", "QuantizeDynamicInt8Pass("),
    ("quantize-int8{format=dynamic,activations=per-token}", "QuantizeDynamicInt8PerTokenPass("),
    ("quantize-int8{format=dynamic,activations=mixed}", "QuantizeDynamicInt8MixedPass("),
    ("quantize-int8{format=static}", "QuantizeStaticInt8Pass("),
])
def test_auto_reduce_range_follows_the_compiling_cpu(spec, repr_prefix, saturates, monkeypatch, tmp_path):
    """The default reduce_range=auto is 7-bit weights on a CPU whose int8 kernels saturate (and the pass says so
    in its repr, which the runtime's warning reads), 8-bit elsewhere and on other providers; true/false win."""
    from dyncompile.passes import CompileContext, build_passes

    calib = tmp_path / "calib.jsonl"
    calib.write_text('{"text": "a", "label": 0}\n')
    monkeypatch.setattr(providers, "int8_pairs_saturate", lambda: saturates)
    ctx = CompileContext(model_path=tmp_path / "m.onnx", options={"calib": str(calib)})
    if "static" in spec:  # the static format reads its activation feeds in its factory; none are needed here
        monkeypatch.setattr("dyncompile.passes.quantize_weights._static_feeds", lambda context, rows: [{}])
    p = build_passes(spec, ctx)[0]
    assert repr(p).startswith(repr_prefix) and p.reduce_range is saturates
    assert ("reduce_range=True" in repr(p)) is saturates
    if "format=dynamic}" in spec:  # 7-bit weights: one scale per output channel unless per_channel=false
        assert p.per_channel is saturates
        assert build_passes("quantize-int8{format=dynamic,per_channel=false}", ctx)[0].per_channel is False
    assert providers.warn_if_int8_saturates([repr(p)], "CPUExecutionProvider") is False  # auto: nothing to warn about
    for forced in (True, False):
        assert build_passes(spec.replace("}", f",reduce_range={str(forced).lower()}}}"), ctx)[0].reduce_range is forced
    ov = CompileContext(model_path=tmp_path / "m.onnx", options={"calib": str(calib), "provider": "openvino"})
    if "activations" not in spec:  # OpenVINO runs its own int8 kernels: auto keeps 8 bits there
        assert build_passes(spec, ov)[0].reduce_range is False


def test_reduce_range_weights_are_exact_on_every_cpu():
    """The 7-bit weights every int8 format writes with reduce_range=true stay in [-64, 64]: ORT's u8 x s8 product
    pairs then fit int16 (2 x 255 x 64 = 32,640), checked against ORT here at the extremes."""
    from dyncompile.passes.quantize_weights import REDUCED_WEIGHT_MAX, _int8_weight

    k = 64
    x = np.full((4, k), 255, np.uint8)
    q, _ = _int8_weight(np.r_[np.full((k - 1, 16), 1.0), np.full((1, 16), -1.0)].astype(np.float32), qmax=REDUCED_WEIGHT_MAX)
    assert q.max() == REDUCED_WEIGHT_MAX and q.min() == -REDUCED_WEIGHT_MAX
    assert (_matmul_integer(np.full((k, 16), REDUCED_WEIGHT_MAX, np.int8), x) == 255 * REDUCED_WEIGHT_MAX * k).all()
