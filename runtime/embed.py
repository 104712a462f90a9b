"""The sentence-embedding task API: ``model.encode(texts)`` -> one vector per text.

The plan's model returns token embeddings; :func:`pool` turns them into one vector per text as the plan's
``policy.pooling`` says (:class:`~dyncompile.plan.embed.PoolingPolicy`: mean over kept tokens, first token or
max, then optionally L2-normalized), which is what sentence-transformers computes for the same folder.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from dyncompile.errors import DataError, PlanError
from dyncompile.plan import EMBEDDING_TASKS, PoolingPolicy, from_json
from dyncompile.runtime.registry import TaskAPI, register_task

logger = logging.getLogger(__name__)

__all__ = ["EmbeddingAPI", "pool"]


def pool(tokens: np.ndarray, mask: np.ndarray | None, policy: PoolingPolicy) -> np.ndarray:
    """One vector per row of ``tokens`` ``[batch, seq, hidden]`` (``mask`` ``[batch, seq]``: 1 = a real token).

    Computed in float64 and returned as float32; rows whose mask keeps no token are refused.
    """
    x = np.asarray(tokens, dtype=np.float64)
    if x.ndim != 3:
        raise DataError(f"the model output {policy.output!r} has shape {x.shape}; pooling needs [batch, seq, hidden]")
    m = np.ones(x.shape[:2]) if mask is None else np.asarray(mask, dtype=np.float64)[:, : x.shape[1]]
    if policy.mode == "cls":
        out = x[:, 0]
    elif policy.mode == "max":
        out = np.where(m[..., None] > 0, x, -np.inf).max(axis=1)
    else:
        out = (x * m[..., None]).sum(axis=1) / np.maximum(m.sum(axis=1, keepdims=True), 1e-9)
    if policy.normalize:
        out = out / np.maximum(np.linalg.norm(out, axis=-1, keepdims=True), 1e-12)  # sentence-transformers' eps
    return out.astype(np.float32)


class EmbeddingAPI(TaskAPI):
    """Sentence-embedding plans: texts in, one (pooled, optionally normalized) vector per text out.

    Args:
        model: the loaded plan; :meth:`encode` needs its ``policy.pooling`` and a tokenizer (a feature-extraction
            plan without them loads, and ``run_feeds`` returns its token embeddings).
    """

    def __init__(self, model: Any) -> None:
        """Read the pooling policy and the plan's tokenizer."""
        super().__init__(model)
        plan = model.plan
        raw = (plan.policy or {}).get("pooling")
        self.pooling: PoolingPolicy | None = None if raw is None else from_json(PoolingPolicy, raw, "policy.pooling")
        outputs = [o.get("name") for o in plan.outputs or [] if isinstance(o, dict)]
        if self.pooling is not None and outputs and self.pooling.output not in outputs:
            raise PlanError(f"policy.pooling.output {self.pooling.output!r} is not an output of the plan's model "
                            f"({', '.join(map(str, outputs))})")
        self.encoder = None
        if plan.tokenizer:
            from dyncompile.runtime.text import TextEncoder

            self.encoder = TextEncoder.from_plan(plan, plan.tokenizer)

    def _feeds(self, texts: list[str]) -> dict[str, np.ndarray]:
        if self.encoder is None:
            raise DataError("this plan has no tokenizer; feed arrays with run_feeds() and pool them yourself")
        feeds = self.encoder(texts)
        mask = feeds.get("attention_mask")
        empty = np.flatnonzero(mask.sum(-1) == 0) if mask is not None else []
        if len(empty):
            raise DataError(f"text {int(empty[0])} encodes to no tokens (empty text?); give some text to embed")
        return feeds

    def tokenize(self, texts: list[str]) -> dict[str, np.ndarray]:
        """The model's input arrays for ``texts`` (the plan's tokenizer), without running or pooling."""
        feeds = self._feeds(texts)
        return {k: v for k, v in feeds.items() if k in self.model.input_names}

    def encode(self, texts: Sequence[str] | str, batch_size: int = 32) -> np.ndarray:
        """Embeddings ``[N, dimension]`` (float32) of ``texts``, pooled as the plan says."""
        if isinstance(texts, str):
            texts = [texts]
        if isinstance(batch_size, bool) or not isinstance(batch_size, int | np.integer) or batch_size < 1:
            raise DataError(f"batch size must be a positive integer, got {batch_size!r}")
        if not all(isinstance(t, str) for t in texts):
            raise DataError("encode() takes a text or a list of texts")
        if self.pooling is None:
            raise PlanError(f"this {self.model.plan.task} plan records no policy.pooling, so its token embeddings "
                            "cannot be pooled; recompile it from a model with a sentence-transformers pooling config "
                            "(dyncompile-model.json 'pooling')")
        out = []
        for i in range(0, len(texts), batch_size):
            feeds = self._feeds(list(texts[i : i + batch_size]))
            state = self.model.run_feeds({k: v for k, v in feeds.items() if k in self.model.input_names})
            if self.pooling.output not in state:
                raise PlanError(f"the plan's model returned no {self.pooling.output!r} (policy.pooling.output)")
            vecs = pool(state[self.pooling.output], feeds.get("attention_mask"), self.pooling)
            if self.pooling.dimension is not None and vecs.shape[-1] != self.pooling.dimension:
                raise PlanError(f"the model's embeddings have {vecs.shape[-1]} dimensions, policy.pooling.dimension "
                                f"says {self.pooling.dimension}")
            out.append(vecs)
        self.model.last_info = {}
        dim = self.pooling.dimension or 0
        return np.concatenate(out) if out else np.zeros((0, dim), np.float32)


for _task in EMBEDDING_TASKS:
    register_task(_task)(EmbeddingAPI)
