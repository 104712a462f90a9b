"""Drafters for speculative decoding: a model (external or split from the target) or prompt lookup.

A drafter proposes up to ``n`` tokens continuing the current sequence; the target then checks them all
in one call (:mod:`dyncompile.runtime.speculative`). For exact speculative sampling a drafter also returns
the distribution ``q`` it drew each token from (``None`` means a point mass on the proposed token, as for
prompt lookup).

* :class:`ModelDrafter` runs a decoder graph with its own KV cache. After each verification the cache is
  rolled back to the accepted prefix, and the next proposal first feeds the tokens it has not seen yet.
  A *split* drafter (the target's first ``k`` layers + a bridge + the final norm and LM head) shares
  those layers' KV with the target: after verification it adopts the target's (already rolled back)
  past tensors of layers ``< k`` instead of recomputing them, so each draft step feeds one token.
  Optionally its LM head covers a vocabulary subset (``vocab`` file): index ``j`` of its logits is
  token ``vocab[j]``.
* :class:`PromptLookupDrafter` copies what followed the most recent earlier occurrence of the sequence's
  last ``n``-gram (``n`` from ``max_ngram`` down to ``min_ngram``), in the prompt or the text so far.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from dyncompile.runtime.kv_cache import KVDecoder
from dyncompile.runtime.sampling import probs_from_logits, sample_from

logger = logging.getLogger(__name__)

__all__ = ["Drafter", "ModelDrafter", "PromptLookupDrafter"]


class Drafter:
    """Interface. ``propose`` returns ``(tokens, q)`` with ``q`` a list of full-vocabulary distributions or None."""

    name = "drafter"
    #: drafting costs model calls (timed separately from the target)
    uses_model = False

    def reset(self, prompt_ids: Sequence[int]) -> None:
        pass

    def after_prefill(self, target: KVDecoder) -> None:
        pass

    def propose(self, seq: list[int], n: int, *, sample: bool, temperature: float, rng: np.random.Generator,
                vocab_size: int) -> tuple[list[int], list[np.ndarray] | None]:
        raise NotImplementedError

    def after_verify(self, valid_length: int, target: KVDecoder) -> None:
        """The target's cache now holds ``valid_length`` tokens of the sequence (all but the last one)."""


class ModelDrafter(Drafter):
    uses_model = True

    def __init__(self, decoder: KVDecoder, *, name: str = "model", share_kv: Sequence[int] | None = None,
                 vocab: np.ndarray | None = None) -> None:
        """
        Args:
            decoder: the drafter's decoder.
            name: ``external`` or ``split`` (for the stats).
            share_kv: for each of the drafter's kv entries, the index of the target kv entry holding the same
                tensor (split drafters); ``None`` when the drafter keeps its own cache.
            vocab: token id of each drafter logit, when its head covers a vocabulary subset.
        """
        self.decoder = decoder
        self.name = name
        self.share_kv = list(share_kv) if share_kv is not None else None
        self.vocab = None if vocab is None else np.asarray(vocab, dtype=np.int64)

    def reset(self, prompt_ids: Sequence[int]) -> None:
        self.decoder.reset()

    def _adopt(self, target: KVDecoder) -> None:
        self.decoder.adopt(target, self.share_kv)

    def after_prefill(self, target: KVDecoder) -> None:
        if self.share_kv is not None:
            self._adopt(target)

    def _pick(self, logits: np.ndarray, sample: bool, temperature: float, rng, vocab_size: int):
        if not sample:
            j = int(np.argmax(logits))
            return (int(self.vocab[j]) if self.vocab is not None else j), None
        q = probs_from_logits(logits, temperature)
        j = sample_from(q, rng)
        if self.vocab is not None:
            full = np.zeros(vocab_size, np.float64)
            full[self.vocab] = q
            return int(self.vocab[j]), full
        if q.shape[-1] != vocab_size:  # drafter head larger/smaller than the target's: pad/cut
            full = np.zeros(vocab_size, np.float64)
            m = min(vocab_size, q.shape[-1])
            full[:m] = q[:m]
            return j, full
        return j, q

    def propose(self, seq, n, *, sample, temperature, rng, vocab_size):
        if n <= 0:
            return [], ([] if sample else None)
        dec = self.decoder
        feed = seq[dec.length :]
        if not feed:  # cannot happen: the last token is never in the cache
            dec.truncate(len(seq) - 1)
            feed = seq[-1:]
        tokens: list[int] = []
        qs: list[np.ndarray] = []
        for _ in range(n):
            logits = dec.forward(feed)[-1]
            tok, q = self._pick(logits, sample, temperature, rng, vocab_size)
            if tok >= vocab_size:  # a drafter with a larger vocabulary proposed a token the target lacks
                break
            tokens.append(tok)
            if sample:
                qs.append(q)
            feed = [tok]
        return tokens, (qs if sample else None)

    def after_verify(self, valid_length: int, target: KVDecoder) -> None:
        if self.share_kv is not None:
            self._adopt(target)
        else:
            self.decoder.truncate(min(self.decoder.length, valid_length))


class PromptLookupDrafter(Drafter):
    """Model-free drafts: what followed the last earlier occurrence of the current suffix n-gram."""

    name = "prompt-lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = int(max_ngram)
        self.min_ngram = int(min_ngram)
        self._index: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are indexed

    def reset(self, prompt_ids: Sequence[int]) -> None:
        self._index = {}
        self._indexed = 0

    def _update(self, seq: list[int]) -> None:
        # index every n-gram that ends at e <= len(seq) - 2 (so a following token exists): key -> e
        last = len(seq) - 2
        for e in range(self._indexed, last + 1):
            for n in range(self.min_ngram, self.max_ngram + 1):
                if e - n + 1 < 0:
                    break
                self._index[tuple(seq[e - n + 1 : e + 1])] = e
        self._indexed = max(self._indexed, last + 1)

    def propose(self, seq, n, *, sample, temperature, rng, vocab_size):
        del temperature, rng, vocab_size
        if n <= 0 or len(seq) < 2:
            return [], ([] if sample else None)
        self._update(seq)
        for size in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            e = self._index.get(tuple(seq[-size:]))
            if e is not None:
                tokens = [int(t) for t in seq[e + 1 : e + 1 + n]]
                return tokens, None
        return [], None
