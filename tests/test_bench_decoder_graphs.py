"""The decoder-graph benches build their own ORT sessions: they must carry dyncompile.load's default session config
(threads stop spinning when a call returns), or idle sessions' spinning threads slow the one that steps (it
measured 2-3 interleaved sessions at twice their single-session step time with ORT's plain spinning)."""

from __future__ import annotations

from dyncompile.models.synthetic_decoder import tiny_decoder, write_decoder_dir
from dyncompile.runtime.providers import DEFAULT_SESSION_CONFIG
from dyncompile.tools.bench.common import graph_session


def test_bench_sessions_use_the_load_defaults(tmp_path):
    folder = write_decoder_dir(tmp_path / "d", tiny_decoder(num_layers=1, vocab=16, seed=0), eos=15)
    so = graph_session(folder, 1).get_session_options()  # write_decoder_dir returns the model path
    assert DEFAULT_SESSION_CONFIG  # the load default this test guards
    for k, v in DEFAULT_SESSION_CONFIG.items():
        assert so.get_session_config_entry(k) == v


def test_verify_call_costs_are_paired_against_the_first_graph(tmp_path):
    """--verify-sizes: a lowered copy (matmul-to-conv) against the original, stepped in turn: same greedy tokens,
    one row per call size, the first graph's paired ratio exactly 1 and every graph's one-token cost exactly 1."""
    import onnx_ir as ir
    import onnx_ir.passes.common  # noqa: F401

    from dyncompile.passes.matmul_to_conv import MatMulToConvPass
    from dyncompile.tools.studies.decoder_graphs import markdown_report, run_bench

    model = tiny_decoder(num_layers=2, vocab=16, seed=0)
    a = write_decoder_dir(tmp_path / "a", model, eos=15)
    lowered = tiny_decoder(num_layers=2, vocab=16, seed=0)
    ir.passes.common.ShapeInferencePass()(lowered)  # the generated graph carries no activation shapes; exports do
    assert MatMulToConvPass()(lowered).modified
    assert any(n.op_type == "Conv" for n in lowered.graph)
    b = write_decoder_dir(tmp_path / "b", ir.from_proto(ir.to_proto(lowered)), eos=15)
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10]]
    rep = run_bench([("matmul", a, None), ("conv", b, None)], prompts, max_new_tokens=8, threads=1,
                    step_interleaved=True, verify_sizes=[3, 5])
    rows = {r["name"]: r for r in rep["results"]}
    assert rows["conv"]["greedy_identical_prompts"] == "2/2"
    for r in rows.values():
        v = r["verify_calls"]
        assert list(v) == ["1", "3", "5"]
        assert v["1"]["cost_vs_one_token_median"] == 1.0
        assert all(x["ms_median"] > 0 for x in v.values())
    assert all(x["ratio_vs_first_median"] == 1.0 for x in rows["matmul"]["verify_calls"].values())
    rep.update(title="t", prompts=2, max_new_tokens=8, threads=1,
               machine={"cpu": "c", "cores": 1, "onnxruntime": "o", "date": "d"})
    md = markdown_report(rep)
    assert "| graph | s = 1 | s = 3 | s = 5 |" in md and "| conv |" in md
