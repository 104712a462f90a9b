"""What the Hugging Face files beside an exported model say about it, as ``dyncompile-model.json`` fields.

A folder written by ``optimum-cli export onnx`` (or ``save_pretrained`` + any ONNX export) holds the model
beside ``config.json``, ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json`` and, for
decoders, ``generation_config.json``. :func:`hf_model_config` reads them into the fields a
``dyncompile-model.json`` carries (task, labels, max length, special tokens, positions, chat template); the
compiler lays a ``dyncompile-model.json`` found beside the model over them (it is the override).

:func:`task_from_architectures` is the one place that maps a transformers architecture name to a task
(:data:`ARCHITECTURE_TASKS`, checked in order); extend the table for a new task.

The files may come from strangers: every value is type-checked, and a wrong one is one
:class:`~dyncompile.errors.DataError` naming the file and the key.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from dyncompile.errors import DataError

logger = logging.getLogger(__name__)

__all__ = ["ARCHITECTURE_TASKS", "HF_FILES", "hf_model_config", "resolve_model_dir", "task_from_architectures"]

#: The Hugging Face files read beside a model.
HF_FILES = ("config.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")

#: ``(architecture name suffix, task)``, checked in order; the first suffix that ends the name wins.
ARCHITECTURE_TASKS: list[tuple[str, str]] = [
    ("ForSequenceClassification", "text-classification"),
    ("ForTokenClassification", "token-classification"),
    ("ForQuestionAnswering", "question-answering"),
    ("ForCausalLM", "text-generation"),
    ("LMHeadModel", "text-generation"),
    ("ForMaskedLM", "fill-mask"),
    ("Model", "feature-extraction"),
]

#: transformers writes this (int(1e30)) as ``model_max_length`` when a tokenizer sets no limit
_NO_LIMIT = 10**20
_MAX_FILE = 16 * 2**20
_ID_LIMIT = 2**31


def task_from_architectures(architectures: Any) -> str | None:
    """The task of the first ``config.json`` architecture the table knows, or None.

    Args:
        architectures: ``config.json``'s ``architectures`` (a list of class names), or None.

    Returns:
        A task name of :data:`ARCHITECTURE_TASKS`, or None when no architecture matches.
    """
    for arch in architectures or []:
        for suffix, task in ARCHITECTURE_TASKS:
            if isinstance(arch, str) and arch.endswith(suffix):
                return task
    return None


def resolve_model_dir(path: Path) -> Path:
    """The ONNX file of a model folder (``model.onnx``, else its only ``*.onnx``); other paths unchanged.

    Args:
        path: what the user gave: an ONNX file, a model folder or a diffusers pipeline folder.

    Returns:
        ``path`` itself unless it is a folder without ``model_index.json`` holding the model's ONNX file.

    Raises:
        DataError: a folder (not a diffusers pipeline) with no ONNX file or several and no ``model.onnx``.
    """
    if not path.is_dir() or (path / "model_index.json").is_file():
        return path
    if (path / "model.onnx").is_file():
        return path / "model.onnx"
    found = sorted(p.name for p in path.glob("*.onnx"))
    if len(found) == 1:
        return path / found[0]
    what = f"several ONNX files ({', '.join(found[:4])})" if found else "no ONNX file"
    raise DataError(
        f"{path} is a folder with {what} and no model.onnx (nor model_index.json of a diffusers pipeline): give "
        "the ONNX file to compile"
    )


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    if path.stat().st_size > _MAX_FILE:
        raise DataError(f"{path} is larger than {_MAX_FILE >> 20} MiB; not a model config")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise DataError(f"{path} is not valid JSON ({' '.join(str(e).split())[:120]}); fix or remove it") from None
    if not isinstance(data, dict):
        raise DataError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _bad(path: Path, key: str, what: str, value: Any) -> DataError:
    return DataError(f"{path}: {key} must be {what}, got {str(value)[:60]!r}; fix it, or override it in "
                     "dyncompile-model.json beside the model")


def _int(data: dict, key: str, path: Path, lo: int = 0) -> int | None:
    v = data.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise _bad(path, key, f"an integer >= {lo}", v)
    return v


def _ids(data: dict, key: str, path: Path) -> list[int] | None:
    v = data.get(key)
    if v is None:
        return None
    items = v if isinstance(v, list) else [v]
    if not items or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < _ID_LIMIT for x in items):
        raise _bad(path, key, "a token id or a list of token ids", v)
    return items


def _labels(cfg: dict, path: Path) -> list[str] | None:
    raw = cfg.get("id2label")
    if raw is None:
        return None
    if not isinstance(raw, dict) or not raw:
        raise _bad(path, "id2label", "an object {index: label}", raw)
    try:
        by_index = {int(k): v for k, v in raw.items()}
    except ValueError:
        raise _bad(path, "id2label", "an object with integer keys", raw) from None
    if sorted(by_index) != list(range(len(by_index))) or not all(isinstance(v, str) for v in by_index.values()):
        raise _bad(path, "id2label", "labels (strings) for the indices 0..n-1", raw)
    return [by_index[i] for i in range(len(by_index))]


def _token_text(v: Any) -> str | None:
    """A special token as ``special_tokens_map.json`` / ``tokenizer_config.json`` write it (text or AddedToken)."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) and v else None


def _vocab(tokenizer_json: Path) -> dict[str, int]:
    tok = _read(tokenizer_json)
    model = tok.get("model") if isinstance(tok.get("model"), dict) else {}
    vocab = model.get("vocab")
    out = dict(vocab) if isinstance(vocab, dict) else {}
    for t in tok.get("added_tokens") or []:
        if isinstance(t, dict) and isinstance(t.get("content"), str) and isinstance(t.get("id"), int):
            out[t["content"]] = t["id"]
    return {k: v for k, v in out.items() if isinstance(v, int) and not isinstance(v, bool)}


def _positions(cfg: dict, path: Path) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length"):
        if cfg.get(key) is not None:
            return _int(cfg, key, path, 2)
    return None


def _max_length(tok_cfg: dict, tok_path: Path, cfg: dict, positions: int | None) -> int | None:
    """Tokens an encoder input may hold: ``model_max_length`` (its no-limit sentinel ignored), within the table."""
    v = tok_cfg.get("model_max_length")
    limit = None
    if isinstance(v, float) and v >= _NO_LIMIT:
        v = None
    if v is not None:
        limit = _int(tok_cfg, "model_max_length", tok_path, 1)
        if limit >= _NO_LIMIT:
            limit = None
    if positions is not None:
        # RoBERTa-style models number positions from pad_token_id + 1: two rows of the table are never used
        usable = positions - 2 if cfg.get("model_type") in ("roberta", "xlm-roberta", "camembert") else positions
        limit = usable if limit is None else min(limit, usable)
    return limit


def _special_ids(found: dict[str, dict], paths: dict[str, Path], vocab: dict[str, int]) -> dict[str, Any]:
    """EOS / BOS / PAD ids: generation_config.json, then config.json, then the tokenizer's named tokens."""
    out: dict[str, Any] = {}
    for kind in ("eos", "bos", "pad"):
        key = f"{kind}_token_id"
        ids, stated = None, False
        for name in ("generation_config.json", "config.json"):
            if key in found[name]:  # an explicit null there means "none" (as transformers reads it)
                ids, stated = _ids(found[name], key, paths[name]), True
                break
        if not stated:
            text = _token_text(found["tokenizer_config.json"].get(f"{kind}_token")) or _token_text(
                found["special_tokens_map.json"].get(f"{kind}_token"))
            ids = [vocab[text]] if text is not None and text in vocab else None
        if ids:
            out[key] = ids if kind == "eos" and len(ids) > 1 else ids[0]
    return out


def _chat_template(tok_cfg: dict, tok_path: Path, folder: Path) -> str | None:
    v = tok_cfg.get("chat_template")
    if isinstance(v, list):  # [{"name": "default", "template": ...}, ...]
        v = next((t.get("template") for t in v if isinstance(t, dict) and t.get("name") == "default"), None)
    if v is not None and not isinstance(v, str):
        raise _bad(tok_path, "chat_template", "a Jinja2 template (a string)", v)
    jinja = folder / "chat_template.jinja"
    if v is None and jinja.is_file() and jinja.stat().st_size <= _MAX_FILE:
        try:
            v = jinja.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise DataError(f"{jinja} is not UTF-8 text; fix or remove it") from None
    return v or None


def _architecture_task(cfg: dict, path: Path) -> str | None:
    arch = cfg.get("architectures")
    if arch is not None and not (isinstance(arch, list) and all(isinstance(a, str) for a in arch)):
        raise _bad(path, "architectures", "a list of class names", arch)
    return task_from_architectures(arch)


def hf_model_config(model_path: Path) -> dict[str, Any]:
    """The ``dyncompile-model.json`` fields the Hugging Face files beside ``model_path`` give (possibly none).

    Args:
        model_path: the ONNX file; its folder is searched for :data:`HF_FILES` and ``tokenizer.json``.

    Returns:
        A dict with any of ``task`` (``sentence-embedding`` with its ``pooling`` for a bare encoder in a
        sentence-transformers folder), ``labels``, ``max_length``, ``max_position_embeddings``, ``eos_token_id``,
        ``bos_token_id``, ``pad_token_id``, ``chat_template``, ``padding_side``, ``num_layers``,
        ``hidden_size``, ``vocab_size`` and ``model_type``; empty when there are no such files.

    Raises:
        DataError: a file that is not a JSON object, or a value of the wrong type (names the file and key).
    """
    folder = model_path.parent
    paths = {name: folder / name for name in HF_FILES}
    found = {name: _read(p) for name, p in paths.items()}
    cfg, tok_cfg = found["config.json"], found["tokenizer_config.json"]
    out: dict[str, Any] = {}
    task = _architecture_task(cfg, paths["config.json"])
    if task == "feature-extraction":  # a bare encoder: a sentence-transformers folder says how to pool it
        from dyncompile.plan.embed import pooling_from_sentence_transformers

        pooling = pooling_from_sentence_transformers(folder)
        if pooling is not None:
            task, out["pooling"] = "sentence-embedding", pooling
    if task is not None:
        out["task"] = task
    if task in ("text-classification", "token-classification"):
        labels = _labels(cfg, paths["config.json"])
        if labels is not None:
            out["labels"] = labels
    positions = _positions(cfg, paths["config.json"])
    if positions is not None:
        out["max_position_embeddings"] = positions
    limit = _max_length(tok_cfg, paths["tokenizer_config.json"], cfg, positions)
    if limit is not None:
        out["max_length"] = limit
    out.update(_special_ids(found, paths, _vocab(folder / "tokenizer.json")))
    template = _chat_template(tok_cfg, paths["tokenizer_config.json"], folder)
    if template is not None:
        out["chat_template"] = template
    side = tok_cfg.get("padding_side")
    if side is not None:
        if side not in ("left", "right"):
            raise _bad(paths["tokenizer_config.json"], "padding_side", "'left' or 'right'", side)
        out["padding_side"] = side
    for key, names in (("num_layers", ("num_hidden_layers", "n_layer")), ("hidden_size", ("hidden_size", "n_embd")),
                       ("vocab_size", ("vocab_size",))):
        name = next((n for n in names if cfg.get(n) is not None), None)
        if name is not None:
            out[key] = _int(cfg, name, paths["config.json"], 1)
    if isinstance(cfg.get("model_type"), str):
        out["model_type"] = cfg["model_type"]
    if out:
        logger.info("read %s beside %s", ", ".join(n for n in HF_FILES if found[n]), model_path)
    return out
