"""tools/studies/sparsity_allocation.py: per-layer sparsity allocation (TEAL's greedy) against the uniform quantile."""

from __future__ import annotations

import numpy as np
import pytest

from dyncompile.models.synthetic_decoder import tiny_decoder, write_decoder_dir, write_word_tokenizer
from dyncompile.passes.sparsify_activations import GreedyPath, LayerError, linear_sites, mlp_layers
from dyncompile.passes.speculative.decoder_spec import decoder_spec
from dyncompile.passes.speculative.probe import session_for
from dyncompile.tools.studies import sparsity_allocation as A
from dyncompile.tools.studies import sparsity_sites as S

VOCAB = 32
LAYERS = 2


def _model():
    return tiny_decoder(num_layers=LAYERS, hidden=64, heads=4, vocab=VOCAB, mlp="swiglu")


def _path(error, x_bytes, h_bytes, *, levels):
    return GreedyPath(error, x_bytes, h_bytes, levels=levels).full()


def test_greedy_path_steps_the_input_that_costs_least_per_byte():
    # x's steps cost 1 each and skip 2 bytes, h's cost 3 and skip 1 byte: x first, all the way, then h
    path = _path(lambda i, j: 1.0 * i + 3.0 * j, 2.0, 1.0, levels=4)
    assert [(i, j) for i, j, _, _ in path] == [(0, 0), (1, 0), (2, 0), (3, 0), (3, 1), (3, 2), (3, 3)]
    assert [b for *_, b in path] == [0.0, 2.0, 4.0, 6.0, 7.0, 8.0, 9.0]
    # negative control: make h the cheap one per byte and the path goes the other way
    path = _path(lambda i, j: 5.0 * i + 1.0 * j, 2.0, 1.0, levels=3)
    assert [(i, j) for i, j, _, _ in path] == [(0, 0), (0, 1), (0, 2), (1, 2), (2, 2)]
    # convex costs interleave the two inputs
    path = _path(lambda i, j: i * i + j * j, 1.0, 1.0, levels=3)
    assert [(i, j) for i, j, _, _ in path] == [(0, 0), (1, 0), (1, 1), (2, 1), (2, 2)]


def test_within_block_takes_each_layers_first_point_at_the_share():
    paths = [_path(lambda i, j: i + 3.0 * j, 2.0, 1.0, levels=4),
             _path(lambda i, j: 5.0 * i + j, 2.0, 1.0, levels=4)]
    # each layer's MLP has 3 steps of x (2 bytes) and 3 of h (1 byte): 9 bytes; half is 4.5
    assert A.within_block(paths, 0.5, [9.0, 9.0]) == [(3, 0), (1, 3)]
    assert A.within_block(paths, 0.0, [9.0, 9.0]) == [(0, 0), (0, 0)]
    assert A.within_block(paths, 0.99, [9.0, 9.0]) == [(3, 3), (3, 3)]  # the share is past the path: its end


def test_across_layers_spends_bytes_where_error_is_cheapest():
    cheap = _path(lambda i, j: 0.1 * (i + j), 1.0, 1.0, levels=3)
    dear = _path(lambda i, j: 10.0 * (i + j), 1.0, 1.0, levels=3)
    assert A.across_layers([cheap, dear], 3.0) == [(2, 1), (0, 0)]
    assert A.across_layers([dear, cheap], 4.0) == [(0, 0), (2, 2)]
    assert A.across_layers([dear, cheap], 6.0) == [(2, 0), (2, 2)]  # the cheap layer is spent: the dear one moves
    assert A.across_layers([cheap, dear], 100.0) == [(2, 2), (2, 2)]
    # negative control: equal layers share the bytes evenly (ties go to the lower layer first)
    same = [_path(lambda i, j: (i + j) ** 2, 1.0, 1.0, levels=3)] * 2
    assert A.across_layers(same, 2.0) == [(1, 0), (1, 0)]


def test_layer_error_replays_the_graphs_mlp_with_thresholds():
    """The numpy MLP on a layer's dense input equals the graph's MLP output with the same thresholds on that layer."""
    m = _model()
    spec = decoder_spec(m, "model")
    layers, _ = mlp_layers(m)
    sites = linear_sites(m, spec["vocab_size"], "mlp")
    w = [np.asarray(n.inputs[1].const_value.numpy(), np.float32) for n in (layers[1].gate, layers[1].up, layers[1].down)]
    names = S.add_thresholds(m, sites)
    down_out = layers[1].down.outputs[0]
    m.graph.outputs.append(down_out)
    sess = session_for(m)
    window = [3, 7, 1, 30, 12, 5, 9, 2, 18, 4, 11, 6]
    off = [S.OFF] * len(sites)
    x, y = sess.run([sites[2].value.name, down_out.name], S._feeds(spec, window, off, names))
    x = x.reshape(-1, x.shape[-1])
    tx, th = float(np.quantile(np.abs(x), 0.4)), 0.05
    err = LayerError(x, *w, tx=[-1.0, tx], th=[-1.0, th], norm=1.0)
    np.testing.assert_allclose(err.dense, y.reshape(err.dense.shape), rtol=1e-4, atol=1e-5)
    assert err(0, 0) == 0.0
    ts = list(off)
    ts[2], ts[3] = tx, th  # layer 1's x and h; the layers before stay dense, so its input is unchanged
    _, y_cut = sess.run([sites[2].value.name, down_out.name], S._feeds(spec, window, ts, names))
    want = float(np.square(y_cut.reshape(err.dense.shape).astype(np.float64) - err.dense).sum())
    assert err(1, 1) == pytest.approx(want, rel=1e-3)
    assert err(1, 1) > 0 and err(1, 0) > 0 and err(0, 1) > 0


def test_paired_increase_is_zero_for_the_dense_model_and_brackets_a_shift():
    rng = np.random.default_rng(1)
    dense = rng.uniform(400, 600, 16)
    n = np.full(16, 255)
    assert A.paired_increase(dense, dense, n) == (0.0, 0.0, 0.0)
    inc, lo, hi = A.paired_increase(dense + 255 * 0.01 + rng.normal(0, 0.5, 16), dense, n)
    assert lo < inc < hi and lo < 1.005 < hi


def test_run_reports_every_allocation(tmp_path):
    d = tmp_path / "tiny"
    write_decoder_dir(d, _model(), eos=99)
    write_word_tokenizer(d, VOCAB)
    r = A.run(d, calib_tokens=64, heldout_tokens=64, window=32, error_tokens=32, step=0.1, max_level=0.5,
              uniform=(0.0, 0.3), block_shares=(0.0, 0.3), model_shares=(0.1,), progress=False)
    rows = {(x["allocation"], x["target"]): x for x in r["rows"]}
    assert set(rows) == {("uniform", 0.0), ("uniform", 0.3), ("within-block", 0.0), ("within-block", 0.3),
                         ("across-layers", 0.1)}
    for zero in (rows[("uniform", 0.0)], rows[("within-block", 0.0)]):
        assert zero["increase_pct"] == 0.0 and zero["top1_agreement"] == 1.0 and zero["skipped_bytes_share"] == 0.0
    assert rows[("uniform", 0.3)]["levels_x"] == [0.3] * LAYERS == rows[("uniform", 0.3)]["levels_h"]
    blk = rows[("within-block", 0.3)]
    for lx, lh in zip(blk["levels_x"], blk["levels_h"], strict=True):  # each layer skips at least 30 % of its bytes
        assert (2 * lx + lh) / 3 >= 0.3 - 1e-9
    assert rows[("across-layers", 0.1)]["skipped_bytes_share"] > 0
    assert r["layers"] == LAYERS
    md = A.render_markdown(r)
    assert md.count("\n| within-block |") == 2 and "perfect-kernel step bound" in md


def test_cli_writes_the_report_and_refuses_bad_input(tmp_path, capsys):
    import json

    with pytest.raises(SystemExit) as e:
        A.main([str(tmp_path), "--out", str(tmp_path / "out")])
    assert e.value.code == 2 and "not a decoder folder" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    d = tmp_path / "tiny"
    write_decoder_dir(d, _model(), eos=99)
    write_word_tokenizer(d, VOCAB)
    common = [str(d), "--calib-tokens", "64", "--heldout-tokens", "64", "--window", "32", "--error-tokens", "32", "-q"]
    assert A.main([*common, "--out", str(tmp_path / "out"), "--uniform", "0.2", "--block-shares", "0.3",
                   "--model-shares", "0.05,0.1"]) == 0
    r = json.loads((tmp_path / "out" / "tiny-allocation.json").read_text())
    assert [(x["allocation"], x["target"]) for x in r["rows"]] == [
        ("uniform", 0.2), ("within-block", 0.3), ("across-layers", 0.05), ("across-layers", 0.1)]
    assert (tmp_path / "out" / "tiny-allocation.md").read_text() == A.render_markdown(r)
    capsys.readouterr()
    for args, msg in ((["--uniform", "1.2"], "must be in [0, 1)"), (["--model-shares", "a"], "comma-separated"),
                      (["--error-tokens", "8"], ">= --window")):
        with pytest.raises(SystemExit) as e:
            A.main([*common[:-3], *args, "-q", "--out", str(tmp_path / "bad")])
        assert e.value.code == 2 and msg in capsys.readouterr().err
        assert not (tmp_path / "bad").exists()
