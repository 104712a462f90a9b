"""Interop and peers: ``dyncompile export-genai`` writes an onnxruntime-genai folder whose config maps
the plan's decoder IO exactly (CI, no peer needed), and onnxruntime-genai generates the plan's greedy tokens from
it (needs the peer's environment: ``$DYNCOMPILE_PEER_VENVS/ortgenai``; skipped without it). ``dyncompile bench
--peers`` runs its worker processes end to end (dyncompile workers only in CI) and refuses a missing peer cleanly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from helpers import assert_clean_error, run_cli

import dyncompile
from dyncompile.errors import DataError
from dyncompile.models.synthetic_decoder import tiny_decoder, write_decoder_dir, write_word_tokenizer
from dyncompile.passes.compiler import compile_model
from dyncompile.tools.export_genai import export_genai

VOCAB = 16
EOS = VOCAB - 1  # onnxruntime-genai requires the eos id inside the vocabulary
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 7, 8, 9, 10, 11, 7, 7, 8]]
PEER_PY = Path(os.environ.get("DYNCOMPILE_PEER_VENVS", "/nonexistent")) / "ortgenai" / "bin" / "python"


@pytest.fixture(scope="module")
def plans(module_tmp):
    root = module_tmp("genai")
    target = write_decoder_dir(root / "target", tiny_decoder(num_layers=3, vocab=VOCAB, seed=0), eos=EOS)
    write_word_tokenizer(root / "target", VOCAB)
    draft = write_decoder_dir(root / "draft", tiny_decoder(num_layers=1, vocab=VOCAB, seed=1), eos=EOS)
    write_word_tokenizer(root / "draft", VOCAB)
    calib = root / "calib.txt"
    calib.write_text(" ".join(f"w{i % VOCAB}" for i in range(0, 1800, 7)))
    # -O0: onnxruntime-genai feeds neither attention_bias nor logits_to_keep, which the -O2 lowering adds
    return {
        "root": root,
        "plain": compile_model(target, "verify", root / "plain", opt_level=0).plan_dir,
        "external": compile_model(target, "speculative{draft_length=3}", root / "external", drafter=str(draft),
                                  opt_level=0).plan_dir,
        "prompt-lookup": compile_model(target, "speculative", root / "pl", drafter="prompt-lookup",
                                       opt_level=0).plan_dir,
        "split": compile_model(target, "split-drafter{layers=1,min_speedup=0},speculative", root / "split",
                               calib=str(calib), opt_level=0).plan_dir,
    }


def _expand(pattern: str, n: int) -> list[str]:
    return [pattern.replace("%d", str(i)) for i in range(n)]


def _graph_io(path: Path) -> tuple[list[str], list[str]]:
    m = onnx.load(str(path), load_external_data=False)
    return [i.name for i in m.graph.input], [o.name for o in m.graph.output]


def _check_decoder_block(block: dict, folder: Path, layers: int) -> None:
    ins, outs = _graph_io(folder / block["filename"])
    i, o = block["inputs"], block["outputs"]
    named_in = [i["input_ids"], i["attention_mask"], i["position_ids"]]
    kv_in = [n for pair in zip(_expand(i["past_key_names"], layers), _expand(i["past_value_names"], layers)) for n in pair]
    kv_out = [n for pair in zip(_expand(o["present_key_names"], layers), _expand(o["present_value_names"], layers))
              for n in pair]
    assert named_in + kv_in == ins  # every graph input, in the graph's order
    assert [o["logits"], *kv_out] == outs
    assert block["num_hidden_layers"] == layers


def test_external_drafter_folder(plans, tmp_path):
    out, notes = export_genai(plans["external"], tmp_path / "g")
    cfg = json.loads((out / "genai_config.json").read_text())
    plan = json.loads((Path(plans["external"]) / "plan.json").read_text())
    step = plan["steps"][0]
    m = cfg["model"]
    _check_decoder_block(m["decoder"], out, 3)
    _check_decoder_block(m["draft"], out, 1)
    assert m["draft"]["filename"] != m["decoder"]["filename"]
    assert m["vocab_size"] == VOCAB and m["eos_token_id"] == EOS
    assert m["decoder"]["num_key_value_heads"] == step["target"]["kv"][0]["shape"][0]
    assert m["decoder"]["head_size"] == step["target"]["kv"][0]["shape"][1]
    assert cfg["speculative"] == {"max_draft_tokens": 3}
    assert cfg["search"]["past_present_share_buffer"] is False and cfg["search"]["do_sample"] is False
    for f in (m["decoder"]["filename"], m["draft"]["filename"]):  # the plan's bytes, not a re-export
        assert (out / f).read_bytes() == (Path(plans["external"]) / f).read_bytes()
    assert any("adaptive draft length" in n for n in notes)
    assert "not carried over" in (out / "DYNCOMPILE-EXPORT.txt").read_text()


def test_prompt_lookup_and_plain_folders(plans, tmp_path):
    out, notes = export_genai(plans["prompt-lookup"], tmp_path / "pl", max_draft_tokens=6)
    cfg = json.loads((out / "genai_config.json").read_text())
    assert "draft" not in cfg["model"]
    assert cfg["speculative"] == {"max_draft_tokens": 6, "ngram_size": 4}  # dyncompile's max_ngram 3 + 1
    assert any("no fallback to shorter n-grams" in n for n in notes)
    out, _ = export_genai(plans["plain"], tmp_path / "plain")
    cfg = json.loads((out / "genai_config.json").read_text())
    assert "speculative" not in cfg and "draft" not in cfg["model"]
    _check_decoder_block(cfg["model"]["decoder"], out, 3)


def test_the_export_shares_no_inode_with_the_plan(plans, tmp_path):
    """An edit of the exported folder never reaches the plan's hashed files (no hard links)."""
    plan = Path(plans["plain"])
    out, _ = export_genai(plan, tmp_path / "plain")
    onnx_files = sorted(out.glob("*.onnx"))
    assert onnx_files
    for f in onnx_files:
        assert f.stat().st_ino != (plan / f.name).stat().st_ino, f
        before = (plan / f.name).read_bytes()
        f.write_bytes(b"edited")
        assert (plan / f.name).read_bytes() == before


def test_refusals(plans, tmp_path, capsys):
    with pytest.raises(DataError, match="shares the target's KV cache"):
        export_genai(plans["split"], tmp_path / "s")
    assert not (tmp_path / "s").exists()
    with pytest.raises(DataError, match="1..16"):
        export_genai(plans["external"], tmp_path / "k", max_draft_tokens=17)
    rc, _, err = run_cli(capsys, "export-genai", plans["split"], "-o", tmp_path / "s2")
    assert_clean_error(rc, err, "split drafter", "not exportable")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("keep")
    rc, _, err = run_cli(capsys, "export-genai", plans["plain"], "-o", tmp_path / "taken")
    assert rc == 2 and (tmp_path / "taken" / "x").read_text() == "keep"


def test_bench_peers_workers_and_missing_peer(plans, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(f"w{t}" for t in p)}) + "\n" for p in PROMPTS))
    rc, _, err = run_cli(capsys, "bench", plans["external"], "--prompts", prompts, "--peers", "ortgenai",
                         "--peer-model", f"ortgenai={tmp_path}", "--peer-python", "ortgenai=/nonexistent/python")
    assert_clean_error(rc, err, "/nonexistent/python", "--peer-python")
    env_path = os.pathsep.join(p for p in [str(Path(dyncompile.__file__).parent.parent), os.environ.get("PYTHONPATH")] if p)
    r = subprocess.run([sys.executable, "-m", "dyncompile.tools.bench.peers", str(plans["external"]), "--prompts",
                        str(prompts), "--peers", "none", "--spinning-on", "--max-new-tokens", "12", "-q", "--repeat", "2",
                        "--session-variant", "no spin:session.intra_op.allow_spinning=0",
                        "--plan-variant", f"pl:{plans['prompt-lookup']}",
                        "--report-dir", str(tmp_path / "rep"), "--name", "t"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": env_path}, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads((tmp_path / "rep" / "t.json").read_text())
    names = [x["name"] for x in rep["results"]]
    assert names[0] == "dyncompile target alone" and "dyncompile speculative, spinning on" in names
    for row in rep["results"]:  # greedy speculative and the spinning setting change no token; two passes each
        assert row["identical"] == row["of"] == 2 * len(PROMPTS), row
        assert row["new_tokens"] == 12 * 2 * len(PROMPTS)
        assert len(row["decode_tokens_per_s_per_pass"]) == 2 and all(v > 0 for v in row["decode_tokens_per_s_per_pass"])
    assert "decode tok/s of each pass" in (tmp_path / "rep" / "t.md").read_text()
    # --sequential-peers loads every peer once before dyncompile's pass: a peer that cannot load fails at once
    r = subprocess.run([sys.executable, "-m", "dyncompile.tools.bench.peers", str(plans["external"]), "--prompts",
                        str(prompts), "--peers", "ortgenai", "--peer-model", f"ortgenai={tmp_path}", "--peer-python",
                        "ortgenai=/bin/false", "--sequential-peers", "-q", "--report-dir", str(tmp_path / "rep2")],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": env_path}, timeout=600)
    assert r.returncode != 0 and "peer worker ortgenai failed to load" in r.stderr
    assert "starting dyncompile" not in r.stderr and not (tmp_path / "rep2").exists()
    assert rep["workers"]["dyncompile"]["settings"]["session_config"] == {
        "session.intra_op.allow_spinning": "1", "session.force_spinning_stop": "1"}
    assert rep["workers"]["dyncompile-spin-on"]["settings"]["session_config"] == {
        "session.intra_op.allow_spinning": "1", "session.force_spinning_stop": "0"}
    assert {"dyncompile target alone, no spin", "dyncompile speculative, no spin"} <= set(names)
    # the plan variant (the same target with a prompt-lookup drafter) runs in its own worker, paired with the main
    assert {"dyncompile target alone, pl", "dyncompile speculative (prompt-lookup), pl"} <= set(names)
    assert rep["workers"]["dyncompile-plan-0"]["command"][rep["workers"]["dyncompile-plan-0"]["command"].index(
        "--model") + 1] == str(plans["prompt-lookup"])
    main_spec = next(n for n in names if n.startswith("dyncompile speculative (") and "," not in n)
    assert ("dyncompile speculative (prompt-lookup), pl", main_spec) in {(c["dyncompile"], c["peer"])
                                                                        for c in rep["paired"]}
    assert rep["workers"]["dyncompile-variant-1"]["settings"]["session_config"] == {
        "session.intra_op.allow_spinning": "0", "session.force_spinning_stop": "1"}
    rc, _, err = run_cli(capsys, "bench", plans["external"], "--prompts", prompts, "--peers", "none",
                         "--session-variant", "no-entries")
    assert_clean_error(rc, err, "--session-variant 'no-entries'", "LABEL:KEY=VALUE")
    rc, _, err = run_cli(capsys, "bench", plans["external"], "--prompts", prompts, "--peers", "none",
                         "--plan-variant", f"x:{tmp_path}")
    assert_clean_error(rc, err, f"--plan-variant 'x:{tmp_path}'", "no plan.json")


@pytest.mark.skipif(not PEER_PY.exists(), reason="needs onnxruntime-genai's environment ($DYNCOMPILE_PEER_VENVS/ortgenai)")
@pytest.mark.parametrize("kind", ["plain", "external", "prompt-lookup"])
def test_onnxruntime_genai_generates_the_plan_tokens(plans, kind, tmp_path):
    out, _ = export_genai(plans[kind], tmp_path / kind)
    model = dyncompile.load(plans[kind])
    driver = Path(dyncompile.__file__).parent / "tools" / "bench" / "peer_worker.py"
    reqs = "".join(json.dumps({"ids": p, "max_new_tokens": 20, "mode": "greedy"}) + "\n" for p in PROMPTS)
    r = subprocess.run([str(PEER_PY), str(driver), "--backend", "ortgenai", "--model", str(out), "--threads", "1"],
                       input=reqs, capture_output=True, text=True, timeout=600)
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert lines[0]["ready"], r.stderr[-2000:]
    for p, rep in zip(PROMPTS, lines[1:]):
        want = model.generate(p, max_new_tokens=20, speculative=False).token_ids
        assert rep["ids"] == list(want) and len(want) > 2, (kind, p)
        if kind != "plain":  # it really speculated
            assert rep["stats"].get("rounds", 0) > 0, rep


def test_load_default_session_config_spins_only_inside_a_run(plans, capsys):
    """The default: threads spin during a call and stop after it; ``spinning=False`` / ``run --no-spinning`` turn
    spinning off; an explicit session_config entry wins; a non-bool is refused; greedy tokens do not change."""
    so = dyncompile.load(plans["plain"]).ctx.session_options()
    assert so.get_session_config_entry("session.intra_op.allow_spinning") == "1"
    assert so.get_session_config_entry("session.force_spinning_stop") == "1"
    off = dyncompile.load(plans["plain"], spinning=False)
    assert off.ctx.session_options().get_session_config_entry("session.intra_op.allow_spinning") == "0"
    ref = dyncompile.load(plans["plain"]).generate(PROMPTS[0], max_new_tokens=12)
    assert off.generate(PROMPTS[0], max_new_tokens=12).token_ids == ref.token_ids
    m = dyncompile.load(plans["plain"], session_config={"session.intra_op.allow_spinning": "0"})
    assert m.ctx.session_options().get_session_config_entry("session.intra_op.allow_spinning") == "0"
    with pytest.raises(DataError, match="spinning must be True or False"):
        dyncompile.load(plans["plain"], spinning="yes")
    text = " ".join(f"w{t}" for t in PROMPTS[0])
    want = dyncompile.load(plans["plain"]).generate(text, max_new_tokens=12).text
    rc, out, _ = run_cli(capsys, "run", plans["plain"], "--prompt", text, "--max-new-tokens", "12", "--no-spinning")
    assert rc == 0 and out.startswith(want + "\n--\n"), out
