"""tools/bench/quality: teacher-forced perplexity / top-1 agreement / KL of decoder plans against a reference,
on held-out standard-library text (real SmolLM2-135M; the int4 plan is the quantize-int4 pass's output)."""

from __future__ import annotations

import numpy as np
import pytest

import dyncompile
from dyncompile.errors import DataError
from dyncompile.tools.bench import quality as dq

RECIPE = "explicit-attention,fuse-decoder,pack-matmuls,trim-logits"


@pytest.fixture(scope="module")
def plans(smollm2, module_tmp):
    from dyncompile.passes.compiler import compile_model

    root = module_tmp("dq")
    fp32 = compile_model(smollm2.onnx_path, RECIPE, root / "fp32", progress=False, opt_level=0).plan_dir
    int4 = compile_model(smollm2.onnx_path, f"{RECIPE},quantize-int4{{lm_head_bits=4}}", root / "int4",
                         progress=False, opt_level=0).plan_dir
    head8 = compile_model(smollm2.onnx_path, f"{RECIPE},quantize-int4", root / "head8", progress=False,
                          opt_level=0).plan_dir  # default
    return {name: dyncompile.load(d, threads=2) for name, d in (("fp32", fp32), ("int4", int4), ("head8", head8))}


def test_windows_rotate_over_files_and_refuse_prompt_set_files(plans):
    codec = plans["fp32"].handlers[-1].codec
    w = dq.heldout_windows(codec, 3, 64, files=("functools.py", "enum.py", "queue.py"))
    assert [len(x) for x in w] == [64, 64, 64]
    # one window from each file, not three from the first
    texts = [codec.decode(x) for x in w]
    src = [(dq.STDLIB / f).read_text() for f in ("functools.py", "enum.py", "queue.py")]
    assert all(codec.decode(codec.encode(s)[:64]) == t for s, t in zip(src, texts))
    with pytest.raises(DataError, match="prompt-set"):
        dq.heldout_windows(codec, 1, 64, files=("functools.py", "bisect.py"))
    with pytest.raises(DataError, match="windows"):
        dq.heldout_windows(codec, 10_000, 64, files=("glob.py",))


def test_scores_int4_against_fp32_with_a_self_comparison_as_negative_control(plans):
    codec = plans["fp32"].handlers[-1].codec
    windows = dq.heldout_windows(codec, 4, 128)
    rep = dq.score_plans(plans["fp32"], {"self": plans["fp32"], "int4": plans["int4"]}, windows, boot=200)
    ref, self_, int4 = rep["rows"]
    assert rep["positions"] == 4 * 127
    # the plan against itself: the same logits, so full agreement, no divergence, ratio 1
    assert self_["top1_agreement"] == 1.0 and self_["mean_kl"] < 1e-9 and abs(self_["perplexity_ratio"] - 1) < 1e-9
    # int4 weights move the distribution: some positions change their top-1, KL > 0, perplexity up
    assert 0.5 < int4["top1_agreement"] < 1.0 and int4["mean_kl"] > 1e-3
    assert int4["perplexity_ratio"] > 1.0
    lo, hi = int4["top1_agreement_ci95"]
    assert lo <= int4["top1_agreement"] <= hi
    # alignment: the rows predict the NEXT token; the same tokens shuffled (same unigram counts) are far less likely
    rng = np.random.default_rng(0)
    shuffled = [list(rng.permutation(w)) for w in windows]
    bad = dq.score_plans(plans["fp32"], {}, shuffled)["rows"][0]
    assert ref["perplexity"] < 40 and bad["perplexity"] > 5 * ref["perplexity"]


def test_cli_writes_report(plans, tmp_path):
    fp32_dir = plans["fp32"].plan.directory
    rc = dq.main(["--reference", f"fp32={fp32_dir}", "--plan", f"same={fp32_dir}", "--windows", "2",
                  "--window-tokens", "32", "--report-dir", str(tmp_path), "--name", "q"])
    assert rc == 0
    md = (tmp_path / "q.md").read_text()
    assert "| same | " in md and "1.0000" in md
    with pytest.raises(DataError, match="does not exist"):
        dq.main(["--reference", f"fp32={tmp_path / 'nope'}", "--plan", f"x={fp32_dir}"])


def _bits(plan_dir):
    import onnx

    m = onnx.load(str(plan_dir / "model.onnx"), load_external_data=False)
    return sorted(next(a.i for a in n.attribute if a.name == "bits") for n in m.graph.node if n.op_type == "MatMulNBits")


def test_a_tied_lm_head_stays_float(plans):
    """SmolLM2's head shares its weight with the embedding Gather: ORT's quantizer leaves it in float whatever
    lm_head_bits says (the layers are int4 either way)."""
    b4, b8 = _bits(plans["int4"].plan.directory), _bits(plans["head8"].plan.directory)
    assert b4 == b8 == [4] * 120  # 30 layers x (packed q/k/v, o, packed gate/up, down)


def test_an_8_bit_lm_head_is_closer_to_fp32(tmp_path):
    """quantize-int4's default 8-bit LM head on an untied decoder: the head (and only it) is an 8-bit MatMulNBits,
    and the plan's distribution moves less from fp32 than with lm_head_bits=4 (random token windows)."""
    from dyncompile.models.synthetic_decoder import tiny_decoder, write_decoder_dir, write_word_tokenizer
    from dyncompile.passes.compiler import compile_model

    vocab = 512
    src = write_decoder_dir(tmp_path / "src", tiny_decoder(num_layers=2, vocab=vocab, seed=0), eos=vocab + 1)
    write_word_tokenizer(tmp_path / "src", vocab)
    dirs = {name: compile_model(src, passes, tmp_path / name, progress=False, opt_level=0).plan_dir
            for name, passes in (("fp32", "verify"), ("head4", "quantize-int4{lm_head_bits=4}"),
                                 ("head8", "quantize-int4"), ("head0", "quantize-int4{lm_head_bits=0}"))}
    b4, b8, b0 = (_bits(dirs[k]) for k in ("head4", "head8", "head0"))
    assert set(b4) == {4} and b8 == sorted(b4[:-1] + [8]) and b0 == b4[:-1]
    loaded = {k: dyncompile.load(d, threads=2) for k, d in dirs.items()}
    rng = np.random.default_rng(0)
    windows = [list(rng.integers(0, vocab, 64)) for _ in range(6)]
    rep = dq.score_plans(loaded["fp32"], {k: loaded[k] for k in ("head4", "head8", "head0")}, windows, boot=100)
    kl = {r["plan"]: r["mean_kl"] for r in rep["rows"][1:]}
    assert kl["head0"] < kl["head8"] < kl["head4"]
