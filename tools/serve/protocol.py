"""Request checking and response shapes of the HTTP API (OpenAI's for completions, chat, images, embeddings).

Pure functions over parsed JSON: no Ray, no web framework. A bad request is one :class:`RequestError` (HTTP
400) naming the field and how to fix it.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any

from dyncompile.errors import DataError

__all__ = ["RequestError", "CompletionRequest", "completion_request", "finish_reason", "StopCutter",
           "texts_of", "error_body"]

MAX_STOPS = 4


class RequestError(DataError):
    """A request the API cannot answer as sent (HTTP 400)."""


def error_body(message: str, code: int) -> dict[str, Any]:
    """OpenAI's error shape (its client reads ``error.message``)."""
    kind = "invalid_request_error" if code < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def _number(body: dict, key: str, default: float, low: float, high: float) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not low <= v <= high:
        raise RequestError(f"{key} must be a number in [{low:g}, {high:g}], got {v!r}")
    return float(v)


def _int(body: dict, key: str, default: int | None, low: int) -> int | None:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise RequestError(f"{key} must be an integer >= {low}, got {v!r}")
    return v


class CompletionRequest:
    """A checked ``/v1/completions`` or ``/v1/chat/completions`` request."""

    def __init__(self, prompt: Any, chat: bool, max_tokens: int, temperature: float, seed: int | None,
                 stop: list[str], stream: bool, include_usage: bool) -> None:
        self.prompt = prompt  # text, token ids, or (chat) a list of messages
        self.chat = chat
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.seed = seed
        self.stop = stop
        self.stream = stream
        self.include_usage = include_usage
        self.speculative = True
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def generate_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``CompiledModel.generate`` (temperature 0: greedy; else the exact sampler)."""
        kw: dict[str, Any] = {"max_new_tokens": self.max_tokens, "sample": self.temperature > 0,
                              "temperature": self.temperature if self.temperature > 0 else 1.0, "seed": self.seed}
        if self.stop:
            kw["stop"] = list(self.stop)
        if not self.speculative:
            kw["speculative"] = False
        return kw


_UNSUPPORTED_DEFAULTS = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "top_logprobs": None,
                         "suffix": None, "logit_bias": None, "presence_penalty": 0, "frequency_penalty": 0,
                         "tools": None, "tool_choice": None, "functions": None, "response_format": None}


def completion_request(body: Any, *, chat: bool) -> CompletionRequest:
    """Check an OpenAI completions (``chat=False``) or chat completions request body."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    for key, default in _UNSUPPORTED_DEFAULTS.items():
        v = body.get(key)
        if v is not None and v != default and not (key == "response_format" and v == {"type": "text"}):
            raise RequestError(f"{key}={v!r} is not supported by this server (leave it out or use {default!r})")
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p != 1.0:
        raise RequestError(f"top_p={top_p:g} is not supported: the plan's exact sampler draws from the full "
                           "temperature softmax (speculative sampling stays exact); leave top_p out or set it to 1")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list of {'role': ..., 'content': ...}")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise RequestError(f"messages[{i}] must be an object with a string 'role'")
            c = m.get("content")
            if isinstance(c, list):  # content parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in c):
                    raise RequestError(f"messages[{i}].content: only text parts are supported")
                c = "".join(p["text"] for p in c)
            if not isinstance(c, str):
                raise RequestError(f"messages[{i}].content must be a string")
            messages[i] = {"role": m["role"], "content": c}
        prompt: Any = messages
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # one prompt in a list
        if isinstance(prompt, list):
            if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
                raise RequestError("prompt must be a string, or one list of token ids (one prompt per request)")
        elif not isinstance(prompt, str) or not prompt:
            raise RequestError("prompt must be a non-empty string")
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, key, 16 if not chat else 256, 1)
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop] if stop else []
    elif isinstance(stop, list) and all(isinstance(s, str) and s for s in stop) and len(stop) <= MAX_STOPS:
        stops = list(stop)
    else:
        raise RequestError(f"stop must be a string or a list of at most {MAX_STOPS} non-empty strings")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream must be true or false")
    so = body.get("stream_options") or {}
    if not isinstance(so, dict):
        raise RequestError("stream_options must be an object")
    speculative = body.get("speculative", True)  # dyncompile's extension: False runs the plan's target alone
    if not isinstance(speculative, bool):
        raise RequestError("speculative must be true or false")
    req = CompletionRequest(prompt, chat, max_tokens, _number(body, "temperature", 1.0, 0.0, 2.0),
                            _int(body, "seed", None, 0), stops, stream, bool(so.get("include_usage", False)))
    req.speculative = speculative
    return req


def finish_reason(stop_reason: str, cut: bool) -> str:
    """OpenAI's finish reason for the runtime's stop reason (``cut``: a stop string ended the text)."""
    if cut or stop_reason in ("eos", "stop_sequence"):
        return "stop"
    return "length"


class StopCutter:
    """Text deltas of a growing continuation, cut before the first stop string (OpenAI leaves it out).

    ``feed(full_text)`` returns the new text that is safe to send: it holds back a tail that could still be the
    start of a stop string, and a trailing U+FFFD (a character whose bytes are not all decoded yet).
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.sent = 0
        self.cut = False

    def _cut_at(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def feed(self, text: str, final: bool = False) -> str:
        """The next safe delta of ``text`` (the whole continuation so far); ``final``: the generation ended."""
        if self.cut:
            return ""
        end = self._cut_at(text)
        if end is not None:
            self.cut = True
        elif final:
            end = len(text)
        else:
            end = len(text) - self.hold
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
        if end <= self.sent:
            return ""
        delta = text[self.sent:end]
        self.sent = end
        return delta

    def full(self, text: str) -> str:
        """The whole answer: ``text`` cut before its first stop string."""
        end = self._cut_at(text)
        if end is not None:
            self.cut = True
            return text[:end]
        return text


def texts_of(body: Any, *, limit: int) -> tuple[list[str], bool]:
    """The texts of a classify/embeddings request (``input``: a string or a list); and whether one was a string."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    x = body.get("input", body.get("text"))
    single = isinstance(x, str)
    texts = [x] if single else x
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise RequestError("input must be a string or a non-empty list of strings")
    if len(texts) > limit:
        raise RequestError(f"at most {limit} texts per request (the server's max batch size); got {len(texts)}: "
                           "split the request")
    empty = [i for i, t in enumerate(texts) if not t.strip()]
    if empty:
        raise RequestError(f"input[{empty[0]}] is empty; give some text")
    return texts, single
