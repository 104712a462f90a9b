"""Optimization levels: the default compile of a decoder inserts the provider's lowering passes and decodes the same
tokens as -O0; -O0 runs exactly the passes named; presets are placed by the registry's order, never repeated, and
skipped with a message where they cannot apply; `dyncompile passes` lists them; early exit's auto lowering follows
the batch sizes the user declares."""

from __future__ import annotations

import json
import logging

import pytest
from helpers import run_cli  # tests/ is on pythonpath

import dyncompile
from dyncompile.errors import PassConfigError
from dyncompile.models.synthetic_decoder import tiny_decoder, write_decoder_dir, write_word_tokenizer
from dyncompile.passes import CompileContext
from dyncompile.passes._infra import build_pipeline
from dyncompile.passes.compiler import compile_model
from dyncompile.passes.presets import PRESET_NEEDS, PRESETS, place, resolve

VOCAB = 16
PROMPTS = ["w1 w2 w3 w1 w2", "w5 w9 w5 w9 w5 w9", "w3"]
CPU_DECODER = [p for p, _ in PRESETS["cpu"]["text-generation"] if p not in PRESET_NEEDS]  # what every decoder gets


@pytest.fixture(scope="module")
def decoder_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("presets") / "src"
    path = write_decoder_dir(d, tiny_decoder(vocab=VOCAB, logit_scale=4.0), eos=None)  # runs the full length
    write_word_tokenizer(d, VOCAB)
    return path


@pytest.fixture(scope="module")
def plans(decoder_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("presets_plans")
    return {
        level: compile_model(decoder_dir, "speculative{measure=false}", root / f"o{level}", drafter="prompt-lookup",
                             opt_level=level, progress=False)
        for level in (2, 1, 0)
    }


def test_default_compile_inserts_the_cpu_decoder_preset(plans):
    res = plans[2]
    pipe = res.plan.provenance["pipeline"]
    assert pipe["opt_level"] == 2 and pipe["provider"] == "cpu" and pipe["technique"] == "text-generation"
    assert pipe["inserted"] == CPU_DECODER
    assert pipe["passes"] == [*CPU_DECODER, "speculative"]  # every lowering before the pass that times the graph
    names = [r.name for r in res.pipeline.records]
    assert names[-1] == "SpeculativePass" and len(names) == len(CPU_DECODER) + 1
    assert any(r.modified for r in res.pipeline.records[:-1])  # the lowering really changed the tiny decoder
    assert sum("[-O2 preset]" in p for p in res.plan.provenance["passes"]) == len(CPU_DECODER)


def test_level_one_inserts_only_the_bit_exact_lowerings(plans):
    inserted = plans[1].plan.provenance["pipeline"]["inserted"]
    assert inserted == [p for p, lowest in PRESETS["cpu"]["text-generation"] if lowest <= 1]
    assert 0 < len(inserted) < len(CPU_DECODER)


def test_level_zero_runs_exactly_the_passes_named(plans):
    res = plans[0]
    assert [r.name for r in res.pipeline.records] == ["SpeculativePass"]
    assert res.plan.provenance["pipeline"]["inserted"] == []


def test_default_compile_decodes_the_same_tokens_as_level_zero(plans):
    fast, plain = (dyncompile.load(plans[level].plan_dir) for level in (2, 0))
    for prompt in PROMPTS:
        ref = plain.generate(prompt, max_new_tokens=12, speculative=False)
        assert len(ref.token_ids) == 12
        assert fast.generate(prompt, max_new_tokens=12, speculative=False).token_ids == ref.token_ids
        assert fast.generate(prompt, max_new_tokens=12).token_ids == ref.token_ids
        assert plain.generate(prompt, max_new_tokens=12).token_ids == ref.token_ids


def test_inspect_prints_the_effective_pipeline(plans, capsys):
    rc, out, _ = run_cli(capsys, "inspect", plans[2].plan_dir)
    assert rc == 0
    line = next(x for x in out.splitlines() if x.startswith("pipeline (-O2 on cpu)"))
    assert ", ".join([*CPU_DECODER, "speculative"]) in line


def test_named_passes_are_not_repeated_and_keep_their_place():
    merged, inserted, left_out = place(["fuse-decoder", "speculative"], CPU_DECODER)
    assert merged.count("fuse-decoder") == 1 and not left_out
    assert merged == ["explicit-attention", "fuse-decoder", "pack-matmuls", "trim-logits", "matmul-to-conv",
                      "speculative"]
    assert [merged[i] for i in inserted] == [p for p in CPU_DECODER if p != "fuse-decoder"]


def test_presets_follow_the_registry_order_around_other_passes():
    # split-drafter cuts the drafter from the unlowered graph; pack-matmuls must precede quantize-int4, while
    # matmul-to-conv must follow it
    merged, _, left_out = place(["split-drafter", "quantize-int4", "speculative"], CPU_DECODER)
    assert not left_out
    assert merged == ["split-drafter", "explicit-attention", "fuse-decoder", "pack-matmuls", "trim-logits",
                      "quantize-int4", "matmul-to-conv", "speculative"]
    # pack-matmuls must follow fuse-decoder and precede quantize-int4: named the other way round, it is left out
    merged, inserted, left_out = place(["quantize-int4", "fuse-decoder"], ["pack-matmuls"])
    assert merged == ["quantize-int4", "fuse-decoder"] and inserted == []
    assert "quantize-int4" in left_out["pack-matmuls"]


def test_a_preset_that_cannot_apply_is_skipped_with_a_message(tmp_path, caplog):
    d = tmp_path / "nokv"
    path = write_decoder_dir(d, tiny_decoder(vocab=VOCAB, with_kv=False))  # text-generation, but no KV cache
    write_word_tokenizer(d, VOCAB)
    with caplog.at_level(logging.INFO, logger="dyncompile.passes.presets"):
        res = compile_model(path, "verify", tmp_path / "out", progress=False)
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == len(CPU_DECODER)
    assert all("not a KV-cache decoder" in m for m in skipped)
    assert [r.modified for r in res.pipeline.records] == [False] * (len(CPU_DECODER) + 1)


def test_the_drafter_preset_comes_only_with_its_drafter():
    """quantize-drafter lowers the EAGLE drafter: -O2 inserts it after eagle-drafter, and not for other drafters."""
    context = CompileContext(options={"provider": "cpu"}, model_config={"task": "text-generation"})
    with_eagle = resolve("eagle-drafter{head=h},speculative", context).names()
    assert with_eagle.index("eagle-drafter") < with_eagle.index("quantize-drafter") < with_eagle.index("speculative")
    assert "quantize-drafter" not in resolve("speculative", context).names()
    assert "quantize-drafter" not in resolve("eagle-drafter{head=h},speculative", context, opt_level=1).names()


def test_classifier_compiles_get_no_preset(tiny_encoder_path, tmp_path):
    res = compile_model(tiny_encoder_path, "verify,cleanup", tmp_path / "out", progress=False)
    assert res.plan.provenance["pipeline"]["inserted"] == []
    assert [r.name for r in res.pipeline.records] == ["VerifyModelPass", "CleanupGraphPass"]


def test_empty_provider_rows_insert_nothing():
    context = CompileContext(options={"provider": "openvino"}, model_config={"task": "text-generation"})
    assert resolve("speculative", context).inserted == ()
    with pytest.raises(PassConfigError, match="opt level"):
        resolve("verify", context, opt_level=3)


def test_cuda_decoders_get_the_fused_graph_without_the_cpu_conv_trick():
    context = CompileContext(options={"provider": "cuda"}, model_config={"task": "text-generation"})
    merged = resolve("speculative", context)
    names = merged.names()
    assert [names[i] for i in merged.inserted] == ["explicit-attention", "fuse-decoder", "pack-matmuls", "trim-logits"]
    assert names[-1] == "speculative" and "matmul-to-conv" not in names
    bit_exact = resolve("speculative", context, opt_level=1)
    assert [bit_exact.names()[i] for i in bit_exact.inserted] == ["explicit-attention", "trim-logits"]


def test_passes_command_lists_the_presets(capsys):
    rc, out, _ = run_cli(capsys, "passes")
    assert rc == 0
    cpu = next(x for x in out.splitlines() if x.split()[:2] == ["cpu", "text-generation"])
    assert all(p in cpu for p in CPU_DECODER)
    assert "-O0" in out


def test_bad_opt_level_is_one_clean_error(decoder_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:  # argparse's own one-line error
        run_cli(capsys, decoder_dir, "--passes", "verify", "-O", "5", "-o", tmp_path / "o")
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err and "-O/--opt-level: invalid choice" in err


def _early_exit_lowering(tmp_path, **options) -> tuple[str, str]:
    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join(json.dumps({"text": f"w{i} w{i + 1}", "label": i % 2}) + "\n" for i in range(8)))
    tok = write_word_tokenizer(tmp_path, VOCAB)
    context = CompileContext(options={"calib": str(calib), **options}, tokenizer=tok, progress=False)
    ((_, made),) = build_pipeline("early-exit", context)
    return made[-1].lowering, made[-1].reason


@pytest.mark.parametrize("provider", ["cpu", "cuda"])
def test_early_exit_auto_lowering_follows_declared_batch_sizes(tmp_path, provider):
    single, _ = _early_exit_lowering(tmp_path, provider=provider, batch_sizes="1")
    undeclared, _ = _early_exit_lowering(tmp_path, provider=provider)
    assert single == undeclared == "if"  # one row at a time: the provider decides, as before
    batched, reason = _early_exit_lowering(tmp_path, provider=provider, batch_sizes="1,32")
    assert batched == "staged" and "32" in reason
    assert _early_exit_lowering(tmp_path, provider=provider, batch_sizes="32", lowering="if")[0] == "if"  # user's word


def test_early_exit_batch_sizes_must_be_positive(tmp_path):
    with pytest.raises(PassConfigError, match="batch-sizes"):
        _early_exit_lowering(tmp_path, batch_sizes="1,0")
    assert _early_exit_lowering(tmp_path, provider="openvino", batch_sizes="1")[0] == "staged"  # EP-aware still


@pytest.mark.parametrize("level, provider, inserted", [(2, "cpu", ["fuse-encoder-attention", "key-padding-mask", "fuse-gelu",
                                                                    "tabulate-length-values", "raise-opset"]),
                                                        (1, "cpu", ["tabulate-length-values", "raise-opset"]),
                                                        (0, "cpu", []),
                                                        (2, "openvino", [])])
def test_a_classifier_compile_gets_the_fused_encoder_attention_on_the_cpu_ep(minilm, level, provider, inserted,
                                                                            tmp_path):
    """-O2 for the CPU EP inserts fuse-encoder-attention before the classifier's passes (the real MiniLM: its six
    attentions become MultiHeadAttention, its answers stay the original's), tabulate-length-values (which finds
    nothing to do on MiniLM) and raise-opset (both also at -O1, being bit-exact); -O0 and the OpenVINO EP do not."""
    import numpy as np
    import onnx

    res = compile_model(minilm.onnx_path, "verify,cleanup", tmp_path / "p", opt_level=level, provider=provider,
                        progress=False)
    pipe = res.plan.provenance["pipeline"]
    assert pipe["inserted"] == inserted
    assert pipe["technique"] == "text-classification"
    proto = onnx.load(res.plan_dir / "model.onnx")
    g, fused = proto.graph, level == 2 and provider == "cpu"
    assert {o.domain: o.version for o in proto.opset_import}[""] == (21 if inserted else 18)
    assert sum(n.op_type == "MultiHeadAttention" for n in g.node) == (6 if fused else 0)
    assert sum(n.op_type == "Gelu" for n in g.node) == (6 if fused else 0)
    assert sum(n.op_type == "Erf" for n in g.node) == (0 if fused else 6)
    assert sum(n.op_type == "GatherND" for n in g.node) == (0 if fused else 1)  # the exported mask chain's
    if inserted:  # the answers of the original model (the pass's own test compares logits <= 1e-5)
        rows = ["A gorgeous, witty movie.", "Dull, overlong and badly acted."]
        from dyncompile.tools.evaluate import ReferenceModel

        m = dyncompile.load(res.plan_dir)
        ref = ReferenceModel(minilm.onnx_path, m).predict_proba(rows)
        assert np.abs(m.predict_proba(rows) - ref).max() <= 1e-5
