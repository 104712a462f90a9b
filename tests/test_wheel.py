"""The wheel works on its own: `python -m build --wheel`, install it into a fresh venv, and run the installed
package (not the checkout): `dyncompile --help`, compile a tiny model and load the plan, and run every
technique's quick start (early exit, speculative decoding, routing, diffusion) with the installed CLI and API.

The repository root is the package (package-dir "dyncompile" = "."), so what ships is decided by the
`packages` list in pyproject.toml; a module that only works from the checkout (a path computed from
``__file__``, a subpackage missing from the list) fails here. Nothing is downloaded: the build runs without
isolation on this venv's setuptools, the wheel is installed with ``--no-deps --no-index``, and the new venv
reads the third-party packages of the test venv through a ``.pth`` line (the checkout's own editable hook in
that folder is not run: ``.pth`` files are only processed in site directories). About 20 s on 2 cores.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import onnx_ir as ir
import pytest

from dyncompile.io import shared_dir

ROOT = Path(__file__).resolve().parent.parent
_SKIP = shutil.ignore_patterns(
    ".git", ".venv*", "__pycache__", "build", "dist", "*.egg-info", ".pytest_cache"
)


def _run(cmd: list, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    res = subprocess.run([str(c) for c in cmd], env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"{cmd}\n{res.stdout}\n{res.stderr}"
    return res


@pytest.fixture(scope="module")
def installed(module_tmp):
    """Build the wheel from a copy of the checkout and install it into a fresh venv: (python, dyncompile, env)."""
    tmp_path = module_tmp("wheel")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # build from a copy: setuptools writes build/ and *.egg-info beside the sources
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=_SKIP)
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", dist, src], env, tmp_path)
    (wheel,) = dist.glob("dyncompile-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "dyncompile/passes/analysis/family.py" in names and "dyncompile/plan/__init__.py" in names
    assert not [
        n for n in names
        if n.startswith(("dyncompile/tests/", "tests/", "dyncompile/bench-results/", "dyncompile/tools/studies/"))
    ]

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], env, tmp_path)
    py = venv / "bin" / "python"
    site = Path(
        _run(
            [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], env, tmp_path
        ).stdout.strip()
    )
    (site / "deps-of-the-test-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run(
        [sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps", "--no-index", wheel],
        env,
        tmp_path,
    )
    run_env = {**env, "DYNCOMPILE_SHARED": str(shared_dir())}  # a wheel has no checkout beside it
    where = _run([py, "-c", "import dyncompile; print(dyncompile.__file__)"], run_env, tmp_path).stdout.strip()
    assert Path(where).is_relative_to(site), where  # the installed copy, not the checkout
    return py, venv / "bin" / "dyncompile", run_env


def test_wheel_installs_and_runs_outside_the_checkout(installed, tmp_path):
    from dyncompile.models.synthetic import tiny_encoder_classifier

    py, cli, run_env = installed
    helped = _run([cli, "--help"], run_env, tmp_path)
    assert "usage: dyncompile" in helped.stdout

    model = tmp_path / "tiny.onnx"
    ir.save(tiny_encoder_classifier(num_layers=2, hidden=64), model)
    _run([cli, model, "--passes", "verify,cleanup", "-o", tmp_path / "plan"], run_env, tmp_path)
    code = (
        "import numpy as np, dyncompile\n"
        f"m = dyncompile.load({str(tmp_path / 'plan')!r})\n"
        "ids = np.arange(10, dtype=np.int64).reshape(2, 5)\n"
        "out = m.run_feeds({'input_ids': ids, 'attention_mask': np.ones_like(ids)})['logits']\n"
        "assert out.shape == (2, 2) and np.isfinite(out).all(), out\n"
        "print(type(m).__module__)\n"
    )
    loaded = _run([py, "-c", code], run_env, tmp_path)
    assert loaded.stdout.strip().startswith("dyncompile.runtime")


def test_every_quick_start_runs_from_the_wheel(installed, tmp_path):
    """Each technique's quick start, CLI and Python API, on tiny models, run by the installed wheel."""
    from hostile_plans import classifier_dir, decoder_dir, diffusion_plan, word_calib

    py, cli, run_env = installed
    model = classifier_dir(tmp_path / "classifier")
    decoder = decoder_dir(tmp_path / "decoder")
    calib = word_calib(tmp_path / "calib.jsonl", n=200)
    diffusion_plan(tmp_path / "diffusion")

    def dc(*args) -> str:
        return _run([cli, *args], run_env, tmp_path).stdout

    # early exit: compile with calibration (uncertified on 200 rows), run
    dc(model, "--passes", "early-exit", "--calib", calib, "--budget", "5", "--confidence", "none", "-o", "ee")
    dc("run", "ee", "--text", "w3 w5 w7 w9")
    # speculative decoding: the default -O2 inserts the lowering passes (inspect says so)
    dc(decoder, "--passes", "speculative", "--drafter", "prompt-lookup", "-o", "pl")
    assert "pipeline (-O2" in dc("inspect", "pl")
    dc("run", "pl", "--prompt", "w1 w2 w3 w1 w2", "--max-new-tokens", "8")
    # routing: a cascade over two plans
    dc(model, "--passes", "verify,cleanup", "-o", "plain")
    dc("route", "--candidates", "ee", "plain", "--calib", calib, "--budget", "5", "--confidence", "none",
       "--cost-rows", "3", "-o", "routed")
    assert "answered by" in dc("run", "routed", "--text", "w3 w5 w7 w9")
    # diffusion: a text-to-image plan to a PNG
    dc("run", "diffusion", "--prompt", "w1 w2", "-o", "img.png")
    assert (tmp_path / "img.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    code = (
        "import dyncompile\n"
        "m = dyncompile.load('ee')\n"
        "p = m.classify(['w3 w5 w7 w9'])[0]\n"
        "assert p.label in ('negative', 'positive') and p.exit_layer is not None, p\n"
        "g = dyncompile.load('pl')\n"
        "a = g.generate('w1 w2 w3 w1 w2', max_new_tokens=8)\n"
        "b = g.generate('w1 w2 w3 w1 w2', max_new_tokens=8, speculative=False)\n"
        "assert a.token_ids == b.token_ids, (a.token_ids, b.token_ids)\n"
        "r = dyncompile.load('routed')\n"
        "r.classify(['w3 w5 w7 w9'])\n"
        "assert 'candidate' in r.last_info, r.last_info\n"
        "d = dyncompile.load('diffusion')\n"
        "res = d.generate_images(['w1 w2'], seed=0)\n"
        "assert len(res.images) == 1\n"
        "print(type(m).__module__)\n"
    )
    assert _run([py, "-c", code], run_env, tmp_path).stdout.strip().startswith("dyncompile.runtime")
