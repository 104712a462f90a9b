"""CLI: every user mistake is one clear `error:` line, exit code 2, no traceback, input untouched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import assert_clean_error, run_cli

from dyncompile.tools.cli import main


def test_help_teaches(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for word in ("--passes", "examples:", "dyncompile models build", "dyncompile run", "--verify", "--dump-ir"):
        assert word in out


def test_missing_file(capsys, tmp_path):
    rc, _, err = run_cli(capsys, tmp_path / "nope.onnx", "-o", tmp_path / "out")
    assert_clean_error(rc, err, "model file not found", "nope.onnx")
    assert not (tmp_path / "out").exists()


def test_not_onnx(capsys, tmp_path):
    bad = tmp_path / "notes.onnx"
    bad.write_text("this is not a model\n")
    rc, _, err = run_cli(capsys, bad, "-o", tmp_path / "out")
    assert_clean_error(rc, err, "not a valid ONNX model")
    assert bad.read_text() == "this is not a model\n" and not (tmp_path / "out").exists()


def test_truncated_onnx(capsys, tmp_path, tiny_encoder_path):
    data = tiny_encoder_path.read_bytes()
    cut = tmp_path / "cut.onnx"
    cut.write_bytes(data[: len(data) // 3])
    rc, _, err = run_cli(capsys, cut, "-o", tmp_path / "out")
    assert_clean_error(rc, err, "truncated")
    assert not (tmp_path / "out").exists()


def test_empty_file(capsys, tmp_path):
    (tmp_path / "e.onnx").write_bytes(b"")
    rc, _, err = run_cli(capsys, tmp_path / "e.onnx", "-o", tmp_path / "out")
    assert_clean_error(rc, err, "empty")


def test_unknown_pass(capsys, tmp_path, tiny_encoder_path):
    rc, _, err = run_cli(capsys, tiny_encoder_path, "--passes", "verify,teleport", "-o", tmp_path / "out")
    assert_clean_error(rc, err, "unknown pass 'teleport'", "known passes: ", "cleanup")


def test_output_exists_refused_untouched_then_force(capsys, tmp_path, tiny_encoder_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    before = tiny_encoder_path.read_bytes()
    rc, _, err = run_cli(capsys, tiny_encoder_path, "-o", out)
    assert_clean_error(rc, err, "already exists", "--force")
    assert (out / "keep.txt").read_text() == "mine"
    rc, _, err = run_cli(capsys, tiny_encoder_path, "-o", out, "--force")  # --force replaces only a plan (#9)
    assert_clean_error(rc, err, "not a dyncompile plan", "keep.txt")
    assert (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    for what in ("an empty directory", "a plan"):
        rc, outp, err = run_cli(capsys, tiny_encoder_path, "-o", out, "--force")
        assert rc == 0, (what, err)
        assert (out / "plan.json").is_file()
    assert tiny_encoder_path.read_bytes() == before


def test_tampered_plan(capsys, tmp_path, tiny_encoder_path):
    out = tmp_path / "out"
    assert run_cli(capsys, tiny_encoder_path, "-o", out)[0] == 0
    data = (out / "model.onnx").read_bytes()
    (out / "model.onnx").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    rc, _, err = run_cli(capsys, "run", out, "--text", "hello")
    assert_clean_error(rc, err, "modified after compile", "model.onnx")


def test_run_without_input(capsys, tmp_path, tiny_encoder_path):
    out = tmp_path / "out"
    assert run_cli(capsys, tiny_encoder_path, "-o", out)[0] == 0
    rc, _, err = run_cli(capsys, "run", out)
    assert_clean_error(rc, err, "--text", "--data")


def test_inspect_plan_and_passes(capsys, tmp_path, tiny_encoder_path):
    out = tmp_path / "out"
    assert run_cli(capsys, tiny_encoder_path, "--passes", "verify,cleanup", "-o", out, "--verify")[0] == 0
    rc, text, _ = run_cli(capsys, "inspect", out)
    assert rc == 0 and "run_model" in text and "verified" in text
    rc, text, _ = run_cli(capsys, "passes")
    assert rc == 0 and "verify" in text and "cleanup" in text


def test_inspect_model_prints_the_structure_report(capsys, tiny_encoder_path):
    """`dyncompile inspect MODEL.onnx` runs the graph analysis (tiny_encoder_classifier: 4 blocks, CLS head)."""
    rc, text, err = run_cli(capsys, "inspect", tiny_encoder_path)
    assert rc == 0, err
    for line in ("Layers: 4 found", "Family guess: encoder (LayerNorm encoder", "Task guess: text-classification"):
        assert line in text, line
    assert "pooling=cls" in text and "after layer   4: " in text


def test_dump_ir_from_cli(capsys, tmp_path, tiny_encoder_path):
    rc, _, err = run_cli(capsys, tiny_encoder_path, "--passes", "verify,cleanup", "-o", tmp_path / "o", "--dump-ir", tmp_path / "ir")
    assert rc == 0, err
    assert (tmp_path / "ir" / "002_CleanupGraphPass.onnx.txt").is_file()


@pytest.mark.parametrize("module", ["dyncompile.tools.cli", "dyncompile"])
def test_console_script_prints_no_traceback(tmp_path, module):
    """Through a real process (what a user sees; ``python -m dyncompile`` too): one line on stderr, exit code 2."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-m", module, str(tmp_path / "missing.onnx")],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).parent,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.startswith("error: model file not found")


def test_plan_directory_gets_ordinary_permissions(tmp_path, tiny_encoder_path):
    """The temp dir a plan is built in (mkdtemp: 0700) is opened up to what mkdir would give before publishing."""
    from dyncompile.passes.compiler import compile_model

    old = os.umask(0o022)
    try:
        out = compile_model(tiny_encoder_path, "verify", tmp_path / "out").plan_dir
    finally:
        os.umask(old)
    assert (out.stat().st_mode & 0o777) == 0o755


def test_models_without_action_lists_recipes_and_build_state(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("DYNCOMPILE_HOME", str(tmp_path / "empty-home"))
    rc, out, err = run_cli(capsys, "models")
    assert rc == 0 and "qwen2.5-coder-1.5b" in out and "smollm2-135m" in out
    assert "built" not in out.split("cache:")[0]  # nothing is built in an empty cache


def test_train_text_mistakes(capsys, tmp_path, tiny_encoder_path):
    """--train-text: a missing file, or heads that do not train, is one clear error and no output."""
    from helpers import DATA

    calib = DATA / "movie-calib.jsonl"
    common = (tiny_encoder_path, "--passes", "early-exit", "--calib", calib, "-o", tmp_path / "out")
    rc, _, err = run_cli(capsys, *common, "--heads", "trained", "--train-text", tmp_path / "nope.jsonl")
    assert_clean_error(rc, err, "data file not found", "nope.jsonl")
    rc, _, err = run_cli(capsys, *common, "--train-text", calib)
    assert_clean_error(rc, err, "--train-text", "--heads trained")
    assert not (tmp_path / "out").exists()
