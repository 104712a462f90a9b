"""Text front ends of plans (HF ``tokenizer.json`` through the `tokenizers` library) and chat templates.

* :class:`TextEncoder` — classifier feeds: truncation, padding, int64 arrays;
* :class:`TextCodec` — generation: token ids of a prompt and text of generated ids, no truncation or padding;
* :func:`render_chat` — a plan's chat template, rendered in a Jinja2 *sandbox*: the template travels inside
  ``plan.json``, so it is data from whoever wrote the plan and must not reach Python internals (an
  unsandboxed template can run shell commands through ``cycler.__init__.__globals__``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
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


#: bounds on what a plan's chat template may make the runtime do (real HF templates: a few kB, a few hundred
#: traced lines, outputs of the prompt's size plus a few hundred characters)
MAX_TEMPLATE_CHARS = 256 * 1024  # the template's source
MAX_TEMPLATE_STEPS = 200_000  # Python lines the compiled template executes (loop iterations, macro calls)
MAX_TEMPLATE_SECONDS = 2.0  # wall-clock time of one render
MAX_TEMPLATE_OUTPUT = 1 << 20  # characters a template may add beyond the conversation it is given (and any value)
_TEMPLATE_FILE = "<template>"


class _Limits:
    """The budget of one render: steps, a deadline and the largest value (characters or items) allowed."""

    def __init__(self, prompt_chars: int) -> None:
        """A fresh budget for a render over a conversation of ``prompt_chars`` characters."""
        import time

        self.steps = 0
        self.deadline = time.monotonic() + MAX_TEMPLATE_SECONDS
        self.max_size = MAX_TEMPLATE_OUTPUT + 2 * prompt_chars

    def refuse(self, what: str) -> None:
        """Stop the render: ``what`` is over its limit."""
        raise ChatTemplateError(f"the plan's chat template exceeded a limit ({what}); {_FIX}")

    def check_size(self, value: Any, what: str) -> Any:
        """``value`` unless it is a string or container larger than the limit."""
        if _size(value, self.max_size) > self.max_size:
            self.refuse(f"{what} larger than {self.max_size} characters or items")
        return value


def _size(v: Any, cap: int) -> int:
    """Characters of a string, or items plus characters of a container one level deep (stops past ``cap``)."""
    from jinja2.utils import Namespace

    if isinstance(v, str | bytes):
        return len(v)
    if isinstance(v, Namespace):
        v = object.__getattribute__(v, "_Namespace__attrs")
    if isinstance(v, dict):
        v = list(v.values())
    if isinstance(v, list | tuple):
        total = len(v)
        for x in v:
            if total > cap:
                break
            total += len(x) if isinstance(x, str | bytes) else 0
        return total
    return 0


_LIMITS: Any = None  # set per render on the rendering thread (threading.local)


def _limits() -> _Limits | None:
    return getattr(_LIMITS, "value", None)


def _estimate_binop(op: str, a: Any, b: Any, cap: int) -> bool:
    """True when ``a op b`` is cheap to compute and small (checked before computing it)."""
    if op == "*":
        for seq, n in ((a, b), (b, a)):
            if isinstance(seq, str | bytes | list | tuple) and isinstance(n, int):
                return max(n, 0) * max(_size(seq, cap), 1) <= cap
        if isinstance(a, int) and isinstance(b, int):
            return a.bit_length() + b.bit_length() <= 8 * cap
        return True
    if op == "**":
        if isinstance(a, int) and isinstance(b, int):
            return b <= 0 or abs(a) <= 1 or max(a.bit_length(), 1) * b <= 8 * cap
        return not (isinstance(b, int | float) and abs(b) > 10_000)
    if op == "+" and isinstance(a, str | bytes | list | tuple):
        return _size(a, cap) + _size(b, cap) <= cap
    if op == "%" and isinstance(a, str):
        import re

        return not re.search(r"%[-+ #0]*(\*|\d{5,})|\.(\*|\d{5,})", a)
    return True


def _check_call_args(args: Sequence[Any], kwargs: dict[str, Any], lim: _Limits) -> None:
    for v in (*args, *kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_TEMPLATE_OUTPUT:
            lim.refuse(f"an argument of {v} (at most {MAX_TEMPLATE_OUTPUT})")


def _check_replace(name: str, value: Any, args: Sequence[Any], lim: _Limits) -> None:
    if name == "replace" and isinstance(value, str) and len(args) >= 2 and isinstance(args[1], str) and args[0]:
        if value.count(str(args[0])) * len(args[1]) > lim.max_size:
            lim.refuse("a replace() result too large")


def _bounded_filter(name: str, f):
    """``f`` with its integer arguments and its result checked against the render's limits.

    The wrapper takes the context (``pass_context``), which also keeps Jinja2 from running the filter at compile
    time on constant arguments (outside the limits).
    """
    from jinja2.utils import _PassArg, pass_context

    passed = _PassArg.from_obj(f)

    @pass_context
    def run(context, *args, **kwargs):
        lim = _limits()
        if lim is not None:
            _check_call_args(args, kwargs, lim)
            if args:
                _check_replace(name, args[0], args[1:], lim)
        if passed is _PassArg.context:
            args = (context, *args)
        elif passed is _PassArg.eval_context:
            args = (context.eval_ctx, *args)
        elif passed is _PassArg.environment:
            args = (context.environment, *args)
        out = f(*args, **kwargs)
        return out if lim is None else lim.check_size(out, f"the {name} filter's result")

    run.__name__ = getattr(f, "__name__", name)
    return run


def _bounded_environment():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        """The sandbox with sizes checked on every call, filter and operator that can make a large value."""

        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def call_binop(self, context, operator, left, right):
            lim = _limits()
            if lim is not None and not _estimate_binop(operator, left, right, lim.max_size):
                lim.refuse(f"the {operator!r} operator would make a value too large")
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja2's signature
            lim = _limits()
            if lim is not None:
                _check_call_args(args, kwargs, lim)
                owner = getattr(__obj, "__self__", None)
                _check_replace(getattr(__obj, "__name__", ""), owner, args, lim)
            out = super().call(__context, __obj, *args, **kwargs)
            return out if lim is None else lim.check_size(out, "a call's result")

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, optimized=False)  # no constant folding at compile time
    env.filters = {k: _bounded_filter(k, f) for k, f in env.filters.items()}
    return env


@functools.lru_cache(maxsize=8)
def _compiled_template(template: str):
    import jinja2

    if len(template) > MAX_TEMPLATE_CHARS:
        raise ChatTemplateError(
            f"the plan's chat template is {len(template)} characters, over the limit of {MAX_TEMPLATE_CHARS}; {_FIX}"
        )
    # The plan is data: no attribute of a Python internal, no mutation of what is passed in (as transformers
    # renders HF chat templates), and bounded work (_Limits).
    env = _bounded_environment()
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(
            f"the plan's chat template is not valid Jinja2 (line {e.lineno}: {_one_line(e.message)}); {_FIX}"
        ) from None


def _tracer(lim: _Limits):
    """A ``sys.settrace`` function that counts the template's lines and checks time and local values' sizes."""
    import time

    def local(frame, event, arg):
        if event == "line":
            lim.steps += 1
            if lim.steps > MAX_TEMPLATE_STEPS:
                lim.refuse(f"more than {MAX_TEMPLATE_STEPS} steps")
            if time.monotonic() > lim.deadline:
                lim.refuse(f"rendering took more than {MAX_TEMPLATE_SECONDS:g} s")
            for v in frame.f_locals.values():
                lim.check_size(v, "a value")
        return local

    def on_call(frame, event, arg):
        return local if frame.f_code.co_filename == _TEMPLATE_FILE else None

    return on_call


def _messages(prompt: str | Sequence[Mapping[str, str]]) -> list[dict[str, str]]:
    """One user turn for a string; a checked copy of a list of role/content messages."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, Sequence) or not prompt:
        raise ChatTemplateError("a chat needs a non-empty list of messages, each {'role': ..., 'content': ...}")
    out = []
    for i, m in enumerate(prompt):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ChatTemplateError(f"message {i} must be {{'role': str, 'content': str}}, got {str(m)[:80]!r}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _render_bounded(compiled, messages: list[dict[str, str]]) -> str:
    """Render ``compiled`` on ``messages`` within :class:`_Limits` (steps, time, value and output sizes)."""
    import sys
    import threading

    global _LIMITS
    if _LIMITS is None:
        _LIMITS = threading.local()
    lim = _Limits(sum(len(m["content"]) + len(m["role"]) for m in messages))
    parts: list[str] = []
    total = 0
    previous = sys.gettrace()
    _LIMITS.value = lim
    sys.settrace(_tracer(lim))
    try:
        for chunk in compiled.generate(messages=messages, add_generation_prompt=True):
            total += len(chunk)
            if total > lim.max_size:
                lim.refuse(f"output longer than {lim.max_size} characters")
            parts.append(chunk)
    finally:
        sys.settrace(previous)
        _LIMITS.value = None
    return "".join(parts)


def render_chat(template: str | None, prompt: str | Sequence[Mapping[str, str]]) -> str:
    """``prompt`` as one user turn plus the assistant prefix, through the plan's chat ``template`` (sandboxed).

    ``prompt`` may also be a conversation: a list of ``{"role": ..., "content": ...}`` messages (strings), as
    OpenAI's chat API sends them; the assistant prefix follows the last.

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
    messages = _messages(prompt)
    compiled = _compiled_template(template)
    try:
        return _render_bounded(compiled, messages)
    except ChatTemplateError:
        raise
    except jinja2.sandbox.SecurityError as e:
        raise ChatTemplateError(
            f"the plan's chat template tried an unsafe operation, refused ({_one_line(e)}); {_FIX}"
        ) from None
    except (MemoryError, RecursionError) as e:
        raise ChatTemplateError(
            f"the plan's chat template exceeded a limit ({type(e).__name__}); {_FIX}"
        ) from None
    except Exception as e:  # noqa: BLE001 - any failure of the plan's template is the plan's problem
        raise ChatTemplateError(
            f"the plan's chat template failed to render ({type(e).__name__}: {_one_line(e)}); {_FIX}"
        ) from None
