"""Text front ends of plans (HF ``tokenizer.json`` through the `tokenizers` library) and chat templates.

* :class:`TextEncoder` — classifier feeds: truncation, padding, int64 arrays;
* :class:`TextCodec` — generation: token ids of a prompt and text of generated ids, no truncation or padding;
* :func:`render_chat` — a plan's chat template, rendered in a Jinja2 *sandbox*: the template travels inside
  ``plan.json``, so it is data from whoever wrote the plan and must not reach Python internals (an
  unsandboxed template can run shell commands through ``cycler.__init__.__globals__``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dyncompile.errors import DataError

__all__ = ["ChatTemplateError", "TextCodec", "TextEncoder", "plan_tokenizer", "render_chat"]


def plan_tokenizer(plan):
    """A fresh ``tokenizers.Tokenizer`` of ``plan``'s tokenizer file.

    Built from the bytes :func:`load_plan` read and hash-checked (a file swapped on disk after loading is never
    used).
    """
    from tokenizers import Tokenizer

    from dyncompile.errors import PlanError

    key = plan.tokenizer["file"]
    try:
        return Tokenizer.from_str(plan.content_of(key).decode("utf-8"))
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises plain Exception
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise PlanError(
            f"file {key!r} of plan {plan.directory} is not a tokenizer.json the tokenizers library can read "
            f"({first}); recompile with the model's tokenizer.json"
        ) from None


class TextEncoder:
    """Encode texts into the int64 feeds an exported HF encoder expects.

    Truncates to ``max_length`` and pads to the longest row of the batch (attention masks make the
    result independent of padding) or to ``max_length`` with ``padding="max_length"``.
    """

    def __init__(self, tokenizer_file: str | Path | Any, *, max_length: int = 512, padding: str = "longest") -> None:
        """Load the tokenizer (a file or a ``tokenizers.Tokenizer``); pad to the longest row or to ``max_length``."""
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
        """The classifier encoder of ``plan`` (tokenizer from the hash-checked bytes, see :func:`plan_tokenizer`)."""
        return cls(plan_tokenizer(plan), max_length=spec.get("max_length", 512), padding=spec.get("padding", "longest"))

    def __call__(self, texts: Sequence[str]) -> dict[str, np.ndarray]:
        """Token arrays (``input_ids``, ``attention_mask``, ...) of ``texts``."""
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


class TextCodec:
    """The plan's tokenizer for generation: no truncation, no padding, the model's own special tokens."""

    def __init__(self, source: str | Path | Any) -> None:
        """Load the tokenizer (a file or a ``tokenizers.Tokenizer``)."""
        from tokenizers import Tokenizer

        # a path, or a tokenizers.Tokenizer already built (the runtime's, from hash-checked bytes)
        self.tokenizer = source if isinstance(source, Tokenizer) else Tokenizer.from_file(str(source))
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()

    @classmethod
    def from_plan(cls, plan) -> TextCodec | None:
        """The codec of ``plan``'s tokenizer, or None for a plan without one."""
        return cls(plan_tokenizer(plan)) if plan.tokenizer else None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        return list(self.tokenizer.encode(text).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (special tokens dropped)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


# ------------------------------------------------------------------------------------------- chat templates


class ChatTemplateError(DataError):
    """A plan's chat template that is missing, is not valid Jinja2, fails to render, or tries something unsafe."""


_FIX = "recompile the plan from a model whose dyncompile-model.json has a trusted chat_template, or call without chat"


def _one_line(e: object) -> str:
    return " ".join(str(e).split())


def _raise_exception(message: str):
    raise ChatTemplateError(f"the plan's chat template refused the conversation: {_one_line(message)}")


@functools.lru_cache(maxsize=8)
def _compiled_template(template: str):
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # The plan is data: no attribute of a Python internal, no mutation of what is passed in (as transformers
    # renders HF chat templates).
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(
            f"the plan's chat template is not valid Jinja2 (line {e.lineno}: {_one_line(e.message)}); {_FIX}"
        ) from None


def render_chat(template: str | None, prompt: str) -> str:
    """``prompt`` as one user turn plus the assistant prefix, through the plan's chat ``template`` (sandboxed).

    Raises:
        ChatTemplateError: no template, a template that is not valid Jinja2, one that fails to render, or
            one that reaches for something the sandbox forbids (Python internals, mutating its inputs).
    """
    if not template:
        raise ChatTemplateError("this plan has no chat template (the model config had none); call without chat=True")
    try:
        import jinja2.sandbox
    except ImportError:  # pragma: no cover - jinja2 comes with torch/transformers
        raise ChatTemplateError("chat=True needs jinja2 (pip install jinja2)") from None
    compiled = _compiled_template(template)
    try:
        return compiled.render(messages=[{"role": "user", "content": prompt}], add_generation_prompt=True)
    except ChatTemplateError:
        raise
    except jinja2.sandbox.SecurityError as e:
        raise ChatTemplateError(
            f"the plan's chat template tried an unsafe operation, refused ({_one_line(e)}); {_FIX}"
        ) from None
    except Exception as e:  # noqa: BLE001 - any failure of the plan's template is the plan's problem
        raise ChatTemplateError(
            f"the plan's chat template failed to render ({type(e).__name__}: {_one_line(e)}); {_FIX}"
        ) from None
