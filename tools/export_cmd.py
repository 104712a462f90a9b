"""``dyncompile export HF_DIR -o OUT``: a Hugging Face model folder -> an Optimum-style ONNX folder.

Optimum's ONNX exporter (the ``optimum-onnx`` package; ``optimum`` 2.x itself no longer ships one) requires
``transformers<4.58`` while dyncompile's ``export`` extra needs ``transformers>=5``, so the export goes through
dyncompile's own torch.onnx path (:func:`dyncompile.models._export.export_hf_folder`) and writes the folder
layout ``optimum-cli export onnx`` writes: ``model.onnx`` (Optimum's input/output names, decoders with a KV
cache) beside ``config.json``, ``generation_config.json`` and the tokenizer files. Folders exported by
``optimum-cli`` in another environment are read as input by ``dyncompile FOLDER`` unchanged.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

logger = logging.getLogger(__name__)


def export_command(args: argparse.Namespace) -> int:
    """Run the export and print a one-line summary; errors are RecipeError (one ``error:`` line, exit 2)."""
    from dyncompile.models._export import export_hf_folder

    info = export_hf_folder(Path(args.hf_dir), Path(args.out))
    print(f"exported {info['architecture']} ({info['kind']}) to {args.out}: inputs {', '.join(info['inputs'][:3])}"
          f"{', ...' if len(info['inputs']) > 3 else ''}; ORT vs PyTorch max |diff| {info['max_abs_diff']:.2g}")
    print(f"next: dyncompile {args.out} --passes verify,cleanup -o PLAN/")
    return 0
