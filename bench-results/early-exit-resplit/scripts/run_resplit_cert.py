"""Run the re-split bench with helper cert's committed certify.py without merging it.

cert's ``passes/early_exit/certify.py`` and ``runtime/exit_policy.py`` are read from git at ``CERT_COMMIT``
(default: the ``cert`` branch) and registered through the bench's hook
(:func:`dyncompile.tools.bench_early_exit_resplit.register_certified`). Its certify.py predates the ee split
and imports ``_Cascade`` from ``exit_heads``; that name is pointed at ``calibrate._Cascade`` (same class).

    PYTHONPATH=... python run_resplit_cert.py --models minilm-l6-sentiment --splits 60 --heads fixed
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import dyncompile.passes.early_exit as pkg
import dyncompile.passes.early_exit.exit_heads as eh
from dyncompile.passes.early_exit import calibrate

REPO = Path(pkg.__file__).resolve().parents[2]
COMMIT = os.environ.get("CERT_COMMIT", "cert")


def load(name: str, path: str):
    src = subprocess.check_output(["git", "-C", str(REPO), "show", f"{COMMIT}:{path}"], text=True)
    mod = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    mod.__file__ = f"<git {COMMIT}:{path}>"
    sys.modules[name] = mod
    exec(compile(src, mod.__file__, "exec"), mod.__dict__)
    return mod


if __name__ == "__main__":
    eh._Cascade = calibrate._Cascade
    load("dyncompile.runtime.exit_policy", "runtime/exit_policy.py")
    pkg.certify = load("dyncompile.passes.early_exit.certify", "passes/early_exit/certify.py")
    sha = subprocess.check_output(["git", "-C", str(REPO), "rev-parse", "--short", COMMIT], text=True).strip()
    os.environ["DYNCOMPILE_CERT_COMMIT"] = sha
    print("cert commit", sha, flush=True)
    from dyncompile.tools import bench_early_exit_resplit as rs

    sys.exit(rs.main(sys.argv[1:]))
