"""Export through Optimum's ONNX exporter (``optimum-onnx``), run in its own Python environment.

``optimum-onnx`` requires ``transformers<4.58`` while dyncompile's ``export`` extra needs ``transformers>=5``, so
the exporter runs as a subprocess (``python -m optimum.exporters.onnx``) with the python of an environment that
has it: ``--optimum-python``, else ``$DYNCOMPILE_OPTIMUM_PYTHON``, else ``.venv-optimum`` beside the checkout
(``make setup-optimum``), else the current python when it has ``optimum.exporters.onnx``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from dyncompile.models._core import RecipeError

logger = logging.getLogger(__name__)

ENV_VAR = "DYNCOMPILE_OPTIMUM_PYTHON"
VENV_NAME = ".venv-optimum"
#: the Optimum task for each kind of head ``dyncompile export`` handles
TASKS = {"decoder": "text-generation-with-past", "classifier": "text-classification", "encoder": "feature-extraction"}
HOW_TO = (f"make one with `make setup-optimum` in the dyncompile checkout (it creates {VENV_NAME}), or point "
          f"--optimum-python / ${ENV_VAR} at a python with `pip install torch==2.13.0 'optimum-onnx[onnxruntime]' "
          "'transformers<4.58'`")
_TIMEOUT_S = 1800


def _checkout_python() -> Path:
    return Path(__file__).resolve().parents[1] / VENV_NAME / "bin" / "python"


#: pythons this process has seen import the exporter: a probe starts torch and transformers there (seconds), and an
#: environment that had the exporter keeps it; a failed probe is not remembered (the environment may be set up next)
_PROBED: set[str] = set()


def _has_exporter(python: str) -> bool:
    if os.path.abspath(python) == os.path.abspath(sys.executable):  # not resolve(): venv pythons are symlinks
        try:
            return importlib.util.find_spec("optimum.exporters.onnx") is not None
        except (ImportError, ValueError):
            return False
    if os.path.abspath(python) in _PROBED:
        return True
    try:
        r = subprocess.run([python, "-c", "import optimum.exporters.onnx"], capture_output=True, timeout=300,
                           check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    if r.returncode == 0:
        _PROBED.add(os.path.abspath(python))
    return r.returncode == 0


def find_optimum_python(explicit: str | None = None, *, required: bool = False) -> str | None:
    """The python to run Optimum's exporter with, or None (RecipeError when ``required``) when there is none.

    An explicit path (argument, then ``$DYNCOMPILE_OPTIMUM_PYTHON``) must work; the fallbacks are tried in turn.
    """
    given = explicit or os.environ.get(ENV_VAR)
    if given:
        if not _has_exporter(given):
            where = "--optimum-python" if explicit else f"${ENV_VAR}"
            raise RecipeError(f"{where} {given} cannot import optimum.exporters.onnx; {HOW_TO}")
        return given
    for cand in (str(_checkout_python()), sys.executable):
        if Path(cand).is_file() and _has_exporter(cand):
            return cand
    if required:
        raise RecipeError(f"the Optimum exporter needs its own environment and none was found; {HOW_TO}")
    return None


def _onnx_inputs(path: Path) -> list[str]:
    import onnx

    g = onnx.load(str(path), load_external_data=False).graph
    inits = {i.name for i in g.initializer}
    return [i.name for i in g.input if i.name not in inits]


def export_with_optimum(src: Path, out: Path, arch: str, kind: str, python: str) -> dict[str, Any]:
    """Run ``python -m optimum.exporters.onnx`` on ``src`` into ``out`` (atomically); return a summary.

    ``src`` is already checked (config.json, a supported architecture); ``out`` must not exist. The folder
    Optimum writes must hold ``model.onnx`` and ``config.json``; anything else is a RecipeError.
    """
    task = TASKS[kind]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    dest = tmp / "export"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONNOUSERSITE": "1"}
    env.pop("PYTHONPATH", None)  # the other environment must not see this one's packages
    cmd = [python, "-m", "optimum.exporters.onnx", "--model", str(src), "--task", task]
    if kind == "encoder":
        cmd += ["--library-name", "transformers"]  # last_hidden_state, as the built-in exporter writes
    try:
        logger.info("running %s", " ".join(cmd))
        try:
            r = subprocess.run([*cmd, str(dest)], capture_output=True, text=True, env=env, timeout=_TIMEOUT_S,
                               check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RecipeError(f"could not run Optimum's exporter with {python}: {e}") from None
        if r.returncode != 0:
            lines = [ln for ln in (r.stderr or r.stdout).strip().splitlines() if ln.strip()]
            raise RecipeError(f"Optimum's exporter failed on {src} ({arch}, task {task}): "
                              f"{lines[-1] if lines else f'exit code {r.returncode}'}")
        missing = [f for f in ("model.onnx", "config.json") if not (dest / f).is_file()]
        if missing:
            raise RecipeError(f"Optimum's exporter wrote no {' or '.join(missing)} for {src} (task {task}); "
                              "dyncompile reads single-file exports (model.onnx beside config.json)")
        if out.exists():
            raise RecipeError(f"{out} exists; give a new folder (dyncompile export does not overwrite)")
        os.replace(dest, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("exported %s (%s) with Optimum to %s", arch, kind, out)
    return {"architecture": arch, "kind": kind, "task": task, "inputs": _onnx_inputs(out / "model.onnx"),
            "python": python}
