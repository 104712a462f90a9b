"""``dyncompile export HF_DIR -o OUT``: a Hugging Face model folder -> an Optimum-style ONNX folder.

Two exporters write the same folder layout (``model.onnx`` with Optimum's input/output names, decoders with a KV
cache, beside ``config.json`` and the tokenizer files):

* ``--exporter optimum``: Optimum's own exporter (``python -m optimum.exporters.onnx``). It lives in the
  ``optimum-onnx`` package, which requires ``transformers<4.58`` while dyncompile's ``export`` extra needs
  ``transformers>=5``, so it runs as a subprocess in its own environment (``make setup-optimum``; see
  :mod:`dyncompile.models._optimum`).
* ``--exporter torch``: dyncompile's own torch.onnx path (:func:`dyncompile.models._export.export_hf_folder`),
  checked against PyTorch in ONNX Runtime.

``--exporter auto`` (the default) takes Optimum's when its environment is found, else the built-in one; the
summary line says which ran.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

logger = logging.getLogger(__name__)


def export_command(args: argparse.Namespace) -> int:
    """Run the export and print a one-line summary; errors are RecipeError (one ``error:`` line, exit 2)."""
    from dyncompile.models._export import check_hf_folder, export_hf_folder
    from dyncompile.models._optimum import export_with_optimum, find_optimum_python

    src, out = Path(args.hf_dir), Path(args.out)
    arch, kind = check_hf_folder(src, out)  # the same refusals whichever exporter runs, before any is looked for
    exporter = getattr(args, "exporter", "auto")
    python = None
    if exporter != "torch":
        python = find_optimum_python(getattr(args, "optimum_python", None), required=exporter == "optimum")
    if python:
        info = export_with_optimum(src, out, arch, kind, python)
        check = f"task {info['task']}; exporter: optimum ({python})"
    else:
        info = export_hf_folder(src, out)
        check = f"ORT vs PyTorch max |diff| {info['max_abs_diff']:.2g}; exporter: torch.onnx (built in)"
    print(f"exported {info['architecture']} ({info['kind']}) to {args.out}: inputs {', '.join(info['inputs'][:3])}"
          f"{', ...' if len(info['inputs']) > 3 else ''}; {check}")
    print(f"next: dyncompile {args.out} --passes verify,cleanup -o PLAN/")
    return 0
