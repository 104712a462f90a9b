"""Tokenisation for plans with a text front end (HF ``tokenizer.json`` through the `tokenizers` library)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dyncompile.errors import DataError

__all__ = ["TextEncoder"]


class TextEncoder:
    """Encode texts into the int64 feeds an exported HF encoder expects.

    Truncates to ``max_length`` and pads to the longest row of the batch (attention masks make the
    result independent of padding) or to ``max_length`` with ``padding="max_length"``.
    """

    def __init__(self, tokenizer_file: str | Path | Any, *, max_length: int = 512, padding: str = "longest") -> None:
        from tokenizers import Tokenizer

        # a path, or a tokenizers.Tokenizer already built (the runtime's, from hash-checked bytes)
        is_tok = isinstance(tokenizer_file, Tokenizer)
        self.tokenizer = tokenizer_file if is_tok else Tokenizer.from_file(str(tokenizer_file))
        self.max_length = int(max_length)
        if padding not in ("longest", "max_length"):
            raise ValueError(f"padding must be 'longest' or 'max_length', not {padding!r}")
        self.padding = padding
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(self.max_length)
        pad = self.tokenizer.padding
        self.pad_id = pad["pad_id"] if pad else self._guess_pad_id()

    def _guess_pad_id(self) -> int:
        for tok in ("[PAD]", "<pad>", "<|endoftext|>"):
            i = self.tokenizer.token_to_id(tok)
            if i is not None:
                return i
        return 0

    @classmethod
    def from_plan(cls, plan, spec: dict[str, Any]) -> TextEncoder:
        return cls(plan.path_of(spec["file"]), max_length=spec.get("max_length", 512), padding=spec.get("padding", "longest"))

    def __call__(self, texts: Sequence[str]) -> dict[str, np.ndarray]:
        if isinstance(texts, str):
            texts = [texts]
        if not len(texts):
            raise DataError("no texts given")
        encs = self.tokenizer.encode_batch(list(texts))
        width = self.max_length if self.padding == "max_length" else max(len(e.ids) for e in encs)
        n = len(encs)
        ids = np.full((n, width), self.pad_id, dtype=np.int64)
        mask = np.zeros((n, width), dtype=np.int64)
        types = np.zeros((n, width), dtype=np.int64)
        for i, e in enumerate(encs):
            k = len(e.ids)
            ids[i, :k] = e.ids
            mask[i, :k] = e.attention_mask
            types[i, :k] = e.type_ids
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
