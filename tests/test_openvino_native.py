"""Native OpenVINO as a second consumer of the single-file If graph (runs in the OpenVINO CI environment).

`openvino` reads the early-exit If graph, compiles it for CPU in f32 and reproduces ONNX Runtime's outputs
for every branch, on the generated encoder and on the real MiniLM-L6 plan.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from helpers import ort_session

pytestmark = pytest.mark.openvino
ov = pytest.importorskip("openvino", reason="native OpenVINO runs in the OpenVINO environment (make test installs it)")


def _ov_run(model_or_path, feeds):
    core = ov.Core()
    src = model_or_path
    if isinstance(model_or_path, ir.Model):
        import tempfile
        from pathlib import Path

        d = Path(tempfile.mkdtemp())
        ir.save(model_or_path, d / "m.onnx")
        src = str(d / "m.onnx")
    compiled = core.compile_model(core.read_model(str(src)), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    req = compiled.create_infer_request()
    res = req.infer(feeds)
    return {o.get_any_name(): res[o] for o in compiled.outputs}


@pytest.mark.parametrize("exit_at", [None, 1, 2, 3])
def test_native_openvino_reproduces_ort_every_branch(exit_at):
    from helpers import EE_FEEDS, lower_if, with_heads

    m = lower_if(with_heads({exit_at: 10.0} if exit_at else {}))
    want_logits, want_layer = ort_session(m).run(None, EE_FEEDS)
    got = _ov_run(m, EE_FEEDS)
    assert int(np.asarray(got["exit_layer"]).reshape(())) == int(want_layer) == (exit_at or 4)
    np.testing.assert_allclose(got["logits"], want_logits, rtol=0, atol=1e-4)


def test_native_openvino_on_real_minilm_if_graph(minilm, tmp_path):
    from helpers import DATA

    import dyncompile

    res = dyncompile.compile(
        minilm.onnx_path, "early-exit", tmp_path / "ee", calib=str(DATA / "movie-calib.jsonl"), lowering="if",
        budget=2.0, exits="2,4", progress=False,
    )
    path = res.plan.directory / res.plan.files["model"].path
    m = dyncompile.load(res.plan_dir)
    texts = [
        "A gorgeous, witty, seductive movie.",
        "It's not a bad film, just forgettable, and the middle drags on far longer than it should.",
        "The plot is tedious and the acting is wooden.",
    ]
    seen = set()
    sess = ort_session(path, disable_all=False)
    for t in texts + [texts[0] + " " + texts[1]]:
        feeds = m.encode([t])
        want_logits, want_layer = sess.run(None, feeds)
        got = _ov_run(path, feeds)
        assert int(np.asarray(got["exit_layer"]).reshape(())) == int(want_layer)
        np.testing.assert_allclose(got["logits"], want_logits, rtol=0, atol=1e-3)
        seen.add(int(want_layer))
    assert len(seen) >= 2, f"only exits {seen} exercised"
