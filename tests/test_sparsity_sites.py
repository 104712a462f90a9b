"""tools/studies/sparsity_sites.py: which linear-layer inputs TEAL thresholds cover, and what they cost in quality."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dyncompile.models.synthetic_decoder import tiny_decoder, write_decoder_dir, write_word_tokenizer
from dyncompile.passes.speculative.decoder_spec import decoder_spec
from dyncompile.passes.speculative.probe import prefill_feeds, session_for
from dyncompile.tools.studies import sparsity_sites as S

VOCAB = 32
LAYERS = 2


def _model():
    return tiny_decoder(num_layers=LAYERS, hidden=64, heads=4, vocab=VOCAB, mlp="swiglu")


def _const_matmuls(model):
    return [n for n in model.graph if n.op_type == "MatMul" and n.inputs[1].const_value is not None]


def test_sites_group_matmuls_by_input_and_leave_the_lm_head_out():
    m = _model()
    spec = decoder_spec(m, "model")
    sites = S.linear_sites(m, spec["vocab_size"])
    kinds = [S._kind(s) for s in sites]
    # per layer: q/k/v's shared input and o's input (attention), gate/up's shared x and down's h (mlp)
    assert kinds == ["attention", "attention", "mlp", "mlp"] * LAYERS
    assert [s.kind for s in sites if S._kind(s) == "mlp"] == ["gate_up", "down"] * LAYERS
    assert [len(s.consumers) for s in sites] == [3, 1, 2, 1] * LAYERS
    lm_head = [n for n in _const_matmuls(m) if n.inputs[1].const_value.shape[1] == VOCAB]
    covered = [n for s in sites for n in s.consumers]
    assert len(lm_head) == 1 and lm_head[0] not in covered
    assert len(covered) == len(_const_matmuls(m)) - 1
    for s in sites:
        assert s.weight_bytes == sum(n.inputs[1].const_value.nbytes for n in s.consumers)
        assert all(n.inputs[0] is s.value for n in s.consumers)


def test_thresholds_off_reproduce_the_dense_model_and_on_change_it():
    window = [3, 7, 1, 30, 12, 5, 9, 2, 18, 4, 11, 6]
    dense = _model()
    spec = decoder_spec(dense, "model")
    ref = session_for(dense).run([spec["logits"]], prefill_feeds(spec, window))[0]
    m = _model()
    sites = S.linear_sites(m, spec["vocab_size"])
    names = S.add_thresholds(m, sites)
    assert len(names) == len(sites)
    sess = session_for(m)
    off = sess.run([spec["logits"]], S._feeds(spec, window, [S.OFF] * len(sites), names))[0]
    np.testing.assert_array_equal(off, ref)
    for j in range(len(sites)):  # each site's threshold reaches the output on its own
        ts = [S.OFF] * len(sites)
        ts[j] = 1e30
        out = sess.run([spec["logits"]], S._feeds(spec, window, ts, names))[0]
        assert np.abs(out - ref).max() > 1e-4, f"site {j} ({sites[j].kind}) changed nothing"


def test_calibrated_thresholds_drop_the_asked_share_on_the_calibration_text():
    m = _model()
    spec = decoder_spec(m, "model")
    sites = S.linear_sites(m, spec["vocab_size"])
    names = S.add_thresholds(m, sites)
    sess = session_for(m)
    rng = np.random.default_rng(0)
    windows = [list(rng.integers(0, VOCAB, 16)) for _ in range(3)]
    samples = S.calibrate(sess, spec, windows, sites, names)  # every entry (tiny model: under the sample cap)
    level = 0.3
    assert list(samples) == [s.value.name for s in sites]
    for j, site in enumerate(sites):  # one site at a time: its input is the dense model's, as calibrated
        a = samples[site.value.name]
        ts = [S.OFF] * len(sites)
        ts[j] = float(np.quantile(a, level))
        _, below, _, agree = S.evaluate(sess, spec, windows, sites, names, ts, reference=None)
        assert agree is None
        assert abs(below[j] - level) <= 1.0 / len(a) + 1e-12
        assert np.all(np.delete(below, j) == 0)  # OFF drops nothing elsewhere


def test_run_reports_every_site_set_and_level(tmp_path):
    d = tmp_path / "tiny"
    write_decoder_dir(d, _model(), eos=99)
    write_word_tokenizer(d, VOCAB)
    r = S.run(d, levels=(0.0, 0.4), calib_tokens=64, heldout_tokens=64, window=32, progress=False)
    rows = {(x["sites"], x["sparsity"]): x for x in r["rows"]}
    assert set(rows) == {(s, lv) for s in S.SETS for lv in (0.0, 0.4)}
    for s in S.SETS:
        zero = rows[(s, 0.0)]
        assert zero["increase_pct"] == 0.0 and zero["top1_agreement"] == 1.0 and zero["skipped_bytes_share"] == 0.0
    assert rows[("mlp", 0.4)]["achieved_attention"] == 0.0 and rows[("mlp", 0.4)]["achieved_mlp"] > 0
    assert rows[("attention", 0.4)]["achieved_mlp"] == 0.0 and rows[("attention", 0.4)]["achieved_attention"] > 0
    both = rows[("all", 0.4)]["skipped_bytes_share"]
    assert both > rows[("mlp", 0.4)]["skipped_bytes_share"] and both > rows[("attention", 0.4)]["skipped_bytes_share"]
    assert r["site_kinds"]["mlp"]["sites"] == 2 * LAYERS and r["site_kinds"]["attention"]["sites"] == 2 * LAYERS
    assert set(r["best_within_budget"]) == set(S.SETS)
    md = S.render_markdown(r)
    assert md.count("\n| mlp |") == 2 and "perfect-kernel step bound" in md


def test_cli_refuses_a_folder_without_a_decoder(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        S.main([str(tmp_path), "--out", str(tmp_path / "out")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "not a decoder folder" in err and "dyncompile models build" in err
    assert not (tmp_path / "out").exists()


def test_cli_levels_choose_the_rows_and_bad_levels_are_refused(tmp_path, capsys):
    d = tmp_path / "tiny"
    write_decoder_dir(d, _model(), eos=99)
    write_word_tokenizer(d, VOCAB)
    common = [str(d), "--calib-tokens", "64", "--heldout-tokens", "64", "--window", "32", "-q"]
    assert S.main([*common, "--out", str(tmp_path / "out"), "--name", "t", "--levels", "0.4,0,0.4"]) == 0
    r = json.loads((tmp_path / "out" / "t.json").read_text())
    assert sorted({x["sparsity"] for x in r["rows"]}) == [0.0, 0.4] and len(r["rows"]) == 2 * len(S.SETS)
    capsys.readouterr()
    for bad, msg in (("1.5", "must be in [0, 1)"), ("0.1,x", "comma-separated numbers")):
        with pytest.raises(SystemExit) as e:
            S.main([*common, "--out", str(tmp_path / "bad"), "--levels", bad])
        assert e.value.code == 2 and msg in capsys.readouterr().err
        assert not (tmp_path / "bad").exists()
