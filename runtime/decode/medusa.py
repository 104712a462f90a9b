"""The ``medusa`` drafter: Medusa-1 heads on the target's last hidden state (Cai et al. 2024).

The heads graph (built by the ``medusa-heads`` pass) reads one row of the target's ``medusa_features`` output (the
hidden state its LM head reads, at the last verified position ``t``) and returns, for each head ``k``, its ``topk``
best tokens for position ``t + k + 2`` with their log-probabilities (``[K, 1, topk]``). Token ``t + 1`` is the
target's own next token (the tree's root), so head ``k`` drafts depth ``k + 1`` of the tree.

Bookkeeping: :meth:`MedusaDrafter.after_prefill` keeps the prompt's last feature row, :meth:`~MedusaDrafter.after_verify`
the row of the accepted path's last node (``outputs[features][path[-1]]``): the hidden state whose next token is the
round's bonus token ``seq[-1]``. No cache, no catch-up: one heads call per round.

The tree (:meth:`MedusaDrafter.propose_tree`) is Medusa's sparse tree, built per round from the heads' confidences:
the ``max_nodes`` most probable paths of the cartesian product of the heads' candidates, a path's score being the
sum of its tokens' head log-probabilities (nodes at most ``max_depth`` deep and ``branching`` children each). A
path never outscores its prefix, so the chosen set is ancestor-closed; nodes enter best-first, so each node's
first child is its best one. Every node is a deterministic candidate (a point mass, ``qs`` ``None``): greedy output
is the target's, and sampling is exact under the tree's multi-candidate rejection sampling
(:mod:`dyncompile.runtime.decode.draft_tree`).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence

import numpy as np

from dyncompile.errors import PlanError
from dyncompile.runtime.decode.draft_tree import DraftTree
from dyncompile.runtime.decode.drafters import Drafter, TreeBudget, Verification
from dyncompile.runtime.decode.kv_cache import KVDecoder, SessionTimer

__all__ = ["MedusaDrafter", "sparse_tree"]

FEATURES_INPUT = "medusa_features"
LOGP_OUTPUT = "medusa_logp"
IDS_OUTPUT = "medusa_ids"


def sparse_tree(root: int, ids: np.ndarray, logp: np.ndarray, budget: TreeBudget) -> DraftTree:
    """The ``budget.max_nodes`` most probable paths over per-depth candidates ``ids``/``logp`` ``[K, topk]``.

    Depth ``d + 1`` of the tree takes its tokens from row ``d``; a path's score is the sum of its log-probabilities.
    """
    tree = DraftTree([int(root)], [-1])
    depth = min(int(ids.shape[0]), budget.max_depth)
    width = min(int(ids.shape[1]), max(1, budget.branching))
    if depth <= 0 or budget.max_nodes <= 0:
        return tree
    # heap of (-score, order, parent node, depth index, candidate index); order breaks ties shallower/earlier first
    heap: list[tuple[float, int, int, int, int]] = []
    order = 0
    for c in range(width):
        heapq.heappush(heap, (-float(logp[0, c]), order, 0, 0, c))
        order += 1
    while heap and tree.drafted < budget.max_nodes:
        neg, _, parent, d, c = heapq.heappop(heap)
        node = tree.add(parent, int(ids[d, c]))
        if d + 1 < depth:
            for c2 in range(width):
                heapq.heappush(heap, (neg - float(logp[d + 1, c2]), order, node, d + 1, c2))
                order += 1
    return tree


class MedusaDrafter(Drafter):
    """Medusa heads: one call per round on the last verified hidden state; a sparse tree of their candidates."""

    name = "medusa"

    def __init__(self, session, *, features: str, heads: int, topk: int, timer: SessionTimer | None = None) -> None:
        """Draft with the heads graph ``session`` from the target output ``features`` (``heads`` x ``topk``)."""
        ins = {i.name for i in session.get_inputs()}
        outs = {o.name for o in session.get_outputs()}
        if FEATURES_INPUT not in ins or not {LOGP_OUTPUT, IDS_OUTPUT} <= outs:
            raise PlanError(f"the Medusa heads graph must read {FEATURES_INPUT!r} and give {LOGP_OUTPUT!r} and "
                            f"{IDS_OUTPUT!r} (it has inputs {sorted(ins)}, outputs {sorted(outs)}); recompile with "
                            "medusa-heads")
        self.session = session
        self.features = features
        self.heads, self.topk = int(heads), int(topk)
        self.timer = timer or SessionTimer()
        self._h: np.ndarray | None = None

    def reset(self, prompt_ids: Sequence[int]) -> None:
        """Start a new prompt: forget the last hidden state."""
        self._h = None

    def _row(self, outputs: dict[str, np.ndarray], index: int) -> np.ndarray:
        f = outputs.get(self.features)
        if f is None:
            raise PlanError(f"the target returned no {self.features!r} output; recompile with the medusa-heads pass")
        return np.asarray(f[index], np.float32)

    def after_prefill(self, target: KVDecoder) -> None:
        """Keep the prompt's last hidden state."""
        self._h = self._row(target.last_outputs, -1)

    def after_verify(self, v: Verification) -> None:
        """Keep the hidden state of the accepted path's last node (its next token is ``seq[-1]``)."""
        self._h = self._row(v.outputs, v.path[-1])

    def candidates(self) -> tuple[np.ndarray, np.ndarray]:
        """The heads' ``(ids, logp)``, each ``[K, topk]``, for the tokens after the round's root."""
        if self._h is None:
            raise RuntimeError("medusa drafter: no hidden state yet (after_prefill was not called)")
        t0 = time.perf_counter()
        logp, ids = self.session.run([LOGP_OUTPUT, IDS_OUTPUT], {FEATURES_INPUT: self._h[None]})
        self.timer.add("drafter", time.perf_counter() - t0)
        return np.asarray(ids)[:, 0], np.asarray(logp)[:, 0]

    def propose(self, seq, n, *, sample, temperature, rng, vocab_size):
        """The chain of each head's best token (deterministic candidates, also when sampling).

        With ``stop_below`` > 0 the chain ends after the first head whose best token has a probability below it
        (the heads' own softmax over the draft vocabulary): rounds where the heads are sure draft all ``n``, the
        others stop early and verify fewer tokens. The stop reads only the heads' outputs, so exactness is kept.
        """
        if n <= 0:
            return [], ([] if sample else None)
        ids, logp = self.candidates()
        tokens: list[int] = []
        for k in range(min(n, len(ids))):
            tok = int(ids[k, 0])
            if not 0 <= tok < vocab_size:  # a head's token belongs at depth k + 1: never shift the next one up
                break
            tokens.append(tok)
            if self.stop_below > 0.0 and float(np.exp(logp[k, 0])) < self.stop_below:
                break
        return tokens, None

    def propose_tree(self, seq, budget: TreeBudget, *, sample, temperature, rng, vocab_size) -> DraftTree:
        """Medusa's sparse tree within ``budget`` (module docstring); the same tree when sampling."""
        ids, logp = self.candidates()
        return sparse_tree(seq[-1], ids, logp, budget)
