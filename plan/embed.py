"""Schema of sentence-embedding plans: ``policy.pooling``, and reading it from a sentence-transformers folder.

A sentence-embedding plan (task ``sentence-embedding``; ``feature-extraction`` is read as the same) runs its model
with a ``run_model`` step; the model returns token embeddings (``last_hidden_state``, ``[batch, seq, hidden]``) and
the runtime pools them as ``policy.pooling`` says: the mean over the tokens the attention mask keeps (``mean``),
the first token (``cls``) or the per-dimension maximum over kept tokens (``max``), then divides by the L2 norm
when ``normalize`` is true. A sentence-transformers folder says the same in ``modules.json`` (whether a
``Normalize`` module follows) and ``1_Pooling/config.json`` (``pooling_mode_mean_tokens``, ...):
:func:`pooling_from_sentence_transformers` reads them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Literal

from dyncompile.errors import DataError
from dyncompile.plan._typed import _field, from_json

__all__ = [
    "EMBEDDING_TASKS",
    "POLICIES",
    "PoolingPolicy",
    "pooling_from_sentence_transformers",
]

#: plan tasks whose runtime API returns pooled embeddings (``model.encode(texts)``)
EMBEDDING_TASKS = ("sentence-embedding", "feature-extraction")

PoolingMode = Literal["mean", "cls", "max"]

#: sentence-transformers' ``1_Pooling/config.json`` keys -> our pooling modes (the ones the runtime implements)
_ST_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max"}
#: modes sentence-transformers knows that the runtime does not implement (refused by name)
_ST_UNSUPPORTED = ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken")


@dataclasses.dataclass(frozen=True)
class PoolingPolicy:
    """``policy.pooling``: how token embeddings become one vector per text.

    Attributes:
        mode: ``mean`` (over tokens the attention mask keeps), ``cls`` (the first token) or ``max``.
        normalize: divide each vector by its L2 norm (sentence-transformers' ``Normalize`` module).
        output: the model output holding the token embeddings ``[batch, seq, hidden]``.
        dimension: the embedding size (the model's hidden size), checked against the output at run time.
        source: where the pooling was read from (e.g. ``1_Pooling/config.json``), for the record.
    """

    mode: PoolingMode
    normalize: bool = False
    output: str = "last_hidden_state"
    dimension: int | None = _field(None, lo=1, hi=1_000_000)
    source: str | None = None


POLICIES: dict[str, type] = {"pooling": PoolingPolicy}
"""This module's policy names -> schema (merged into :data:`dyncompile.plan.POLICY_SCHEMAS`)."""


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: not a readable JSON file ({e})") from None


def _pooling_dir(folder: Path, modules: list[Any]) -> tuple[Path, bool]:
    """The folder of the Pooling module named in ``modules.json`` and whether a Normalize module follows."""
    pool, normalize = None, False
    for i, m in enumerate(modules):
        kind = str(m.get("type", "")) if isinstance(m, dict) else ""
        if kind.endswith("Pooling") and pool is None:
            pool = str(m.get("path", ""))
        elif kind.endswith("Normalize"):
            normalize = True
        elif not isinstance(m, dict):
            raise DataError(f"{folder / 'modules.json'}: entry {i} is not an object")
    if pool is None:
        raise DataError(f"{folder / 'modules.json'} names no Pooling module, so there is no pooling to read")
    path = (folder / pool).resolve()
    if not path.is_relative_to(folder.resolve()):
        raise DataError(f"{folder / 'modules.json'}: the Pooling module path {pool!r} leaves the folder")
    return path, normalize


def pooling_from_sentence_transformers(folder: str | Path, *, dimension: int | None = None) -> dict[str, Any] | None:
    """``policy.pooling`` (as JSON) of a sentence-transformers folder, or None when it is not one.

    Reads ``modules.json`` (the Pooling module's folder, and whether a ``Normalize`` module follows) and that
    folder's ``config.json`` (default ``1_Pooling/config.json`` when there is no ``modules.json``).

    Raises:
        DataError: a file is not readable JSON, it selects no pooling mode, several, or one the runtime does not
            implement (named).
    """
    folder = Path(folder)
    modules_file = folder / "modules.json"
    if modules_file.is_file():
        modules = _read_json(modules_file)
        if not isinstance(modules, list):
            raise DataError(f"{modules_file}: expected a list of modules")
        pool_dir, normalize = _pooling_dir(folder, modules)
    elif (folder / "1_Pooling" / "config.json").is_file():
        pool_dir, normalize = folder / "1_Pooling", False
    else:
        return None
    cfg_file = pool_dir / "config.json"
    cfg = _read_json(cfg_file)
    if not isinstance(cfg, dict):
        raise DataError(f"{cfg_file}: expected a JSON object")
    unsupported = [k for k in _ST_UNSUPPORTED if cfg.get(k)]
    if unsupported:
        raise DataError(f"{cfg_file}: pooling {unsupported[0]!r} is not implemented (mean, cls and max tokens are)")
    modes = [mode for key, mode in _ST_MODES.items() if cfg.get(key)]
    if len(modes) != 1:
        raise DataError(f"{cfg_file}: expected exactly one of {', '.join(_ST_MODES)} to be true, got "
                        f"{modes or 'none'} (concatenated poolings are not implemented)")
    dim = cfg.get("word_embedding_dimension", dimension)
    policy = {"mode": modes[0], "normalize": normalize, "output": "last_hidden_state",
              "dimension": dim if isinstance(dim, int) and not isinstance(dim, bool) else dimension,
              "source": str(cfg_file.relative_to(folder)) if cfg_file.is_relative_to(folder) else cfg_file.name}
    from_json(PoolingPolicy, policy, str(cfg_file))  # the same checks a plan gets at load
    return policy
