"""``kill -9`` during compile, route and export-genai leaves no partial output, and a rerun succeeds.

Each command runs as a subprocess on tiny inputs; the test polls until the command's staging folder
(``.OUT.tmp-*``, :func:`dyncompile.io.atomic_output_dir`) appears beside the output, waits a little (several
points per command: right away, mid-way, near the end) and sends SIGKILL. Then:

* the output is absent, or complete (the command finished before the kill): a plan loads with every hash
  checked, an onnxruntime-genai folder has its config and every file it names;
* nothing else visible appeared beside it (only dot-folders, the staging ones);
* the inputs are unchanged, byte for byte;
* a rerun to the same output succeeds; it removes the staging folders the killed process left (they carry
  dyncompile's mark, and their process is gone) and leaves alone a look-alike folder dyncompile did not make.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import run_cli
from hostile_plans import classifier_dir, decoder_dir, generate_plan, run_model_plan, tree_state, word_calib

import dyncompile
from dyncompile.io import STAGING_MARK

DELAYS = (0.0, 0.15, 0.5)  # seconds from the staging folder's appearance to SIGKILL


@pytest.fixture(scope="module")
def inputs(module_tmp):
    root = module_tmp("kill-inputs")
    model = classifier_dir(root / "cls-model")
    return {
        "root": root,
        "model": model,
        "a": run_model_plan(model, root / "a"),
        "b": run_model_plan(model, root / "b"),
        "decoder": generate_plan(decoder_dir(root / "dec-model"), root / "dec"),
        "calib": word_calib(root / "calib.jsonl", n=2000),  # a calibration of a few seconds
    }


def _args(cmd: str, inputs: dict, out: Path) -> list:
    if cmd == "compile":
        return [inputs["model"], "--passes", "early-exit", "--calib", inputs["calib"], "--budget", "100",
                "--confidence", "none", "-o", out, "-q"]
    if cmd == "route":
        return ["route", "--candidates", inputs["a"], inputs["b"], "--calib", inputs["calib"], "--budget", "100",
                "--confidence", "none", "-o", out]
    return ["export-genai", inputs["decoder"], "-o", out]


def _complete(cmd: str, out: Path) -> None:
    """``out`` is a whole output of ``cmd``."""
    assert not (out / STAGING_MARK).exists()
    if cmd == "export-genai":
        cfg = json.loads((out / "genai_config.json").read_text())
        assert (out / cfg["model"]["decoder"]["filename"]).is_file()
        assert (out / "tokenizer.json").is_file()
    else:
        dyncompile.load(out)  # every file there, every hash right


def _kill_when_staging(proc: subprocess.Popen, out: Path, delay: float) -> bool:
    """SIGKILL ``proc`` ``delay`` s after its staging folder appears; True if it was still running then."""
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if any(out.parent.glob(f".{out.name}.tmp-*")):
            time.sleep(delay)
            if proc.poll() is not None:
                return False
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            return proc.returncode == -signal.SIGKILL  # it may have exited between the poll and the kill
        time.sleep(0.002)
    proc.wait(timeout=120)
    return False


@pytest.mark.parametrize("cmd", ["compile", "route", "export-genai"])
def test_kill_9_leaves_no_partial_output_and_a_rerun_succeeds(inputs, tmp_path, capsys, cmd):
    before = tree_state(inputs["root"])
    killed = 0
    for delay in DELAYS:
        parent = tmp_path / f"d{delay}"
        parent.mkdir()
        out = parent / "out"
        proc = subprocess.Popen([sys.executable, "-m", "dyncompile.tools.cli", *map(str, _args(cmd, inputs, out))],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        was_killed = _kill_when_staging(proc, out, delay)
        killed += was_killed
        visible = sorted(p.name for p in parent.iterdir() if not p.name.startswith("."))
        if out.exists():  # it finished before the kill (or was killed after its final rename): a whole output
            _complete(cmd, out)
            assert visible == ["out"]
            continue
        assert was_killed, proc.stderr.read().decode()[-2000:]
        assert visible == [], f"{cmd} killed after {delay} s left {visible}"
        left = [p for p in parent.iterdir() if p.name.startswith(".out.")]
        foreign = parent / ".out.tmp-not-ours"  # a look-alike dyncompile did not make: never removed
        foreign.mkdir()
        (foreign / "keep.txt").write_text("mine")
        rc, _, err = run_cli(capsys, *_args(cmd, inputs, out))
        assert rc == 0, err
        _complete(cmd, out)
        assert (foreign / "keep.txt").read_text() == "mine"
        marked = [p for p in left if p.exists() and (p / STAGING_MARK).exists()]
        assert marked == [], f"the rerun left the killed process's staging folders {marked}"
        assert sorted(p.name for p in parent.iterdir() if not p.name.startswith(".")) == ["out"]
    assert killed >= 1, f"{cmd} always finished before the kill: nothing was tested"
    assert tree_state(inputs["root"]) == before, "an input changed"
