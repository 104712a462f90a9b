"""Draft trees for speculative decoding: several candidate continuations verified in ONE target call.

A :class:`DraftTree` holds ``n`` nodes in topological order (every parent before its children). Node 0 is
the *root*: the last token of the sequence, which the target's cache does not hold yet (exactly the first
token of a chain verification). Every other node is a drafted token whose ``parent`` is the token it
continues. Node ``i`` sits at ``depth[i]`` (root 0) and is fed to the target at position
``past_len + depth[i]``; it attends to the whole (valid) past and to its ancestors among the new tokens
only (:meth:`DraftTree.attention`), so the target's logits at node ``i`` are what it would compute after
the root-to-``i`` path alone. A chain of ``g`` drafts is the tree ``parents = [-1, 0, 1, ..., g-1]``.

The first child of a node is its drafter's preferred continuation (the *main chain* follows first
children); :meth:`main_chain_length` lets the tree controller tell what the extra branches bought.

Verification (:mod:`dyncompile.runtime.decode.speculative`):

* greedy — :func:`accept_greedy`: from the root, step to the child whose token equals the target's argmax
  at the current node, while there is one; the next token is the argmax at the last accepted node. The
  accepted tokens are exactly those the target alone would pick.
* sampling — :func:`accept_sampling`: at each node its children are tried one after another, multi-round
  speculative sampling (SpecInfer, Miao et al. 2023; EAGLE, Li et al. 2024): child ``c`` proposed from
  ``r`` (the drafter's distribution ``q`` for a sampled child, a point mass for a deterministic one) is
  accepted with probability ``min(1, p(c) / r(c))``; on rejection ``p <- norm(max(0, p - r))`` and the next
  sibling is tried; when all are rejected the next token is drawn from the residual ``p``. Each round
  outputs ``y`` with probability ``min(r(y), p(y))`` plus (rejection) the residual's, which sums to
  ``p(y)``: the output is distributed exactly as the target's, whatever (and however adaptively) the
  candidates were chosen, so long as ``r`` is the distribution the candidate was drawn from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from dyncompile.runtime.rules.sampling import sample_from

__all__ = ["DraftTree", "accept_greedy", "accept_sampling"]


@dataclasses.dataclass
class DraftTree:
    """Tokens, parents (``-1`` for the root) and per-node proposal distributions of a draft tree.

    ``qs[i]`` is the full-vocabulary distribution node ``i``'s token was *sampled* from, or ``None`` when the
    drafter chose it deterministically (prompt lookup, top-k branches, greedy drafts): a point mass.
    """

    tokens: list[int]
    parents: list[int]
    qs: list[np.ndarray | None] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        """Check that the parent list describes a tree rooted at node 0."""
        if len(self.tokens) != len(self.parents) or not self.tokens:
            raise ValueError(f"a draft tree needs one parent per token and a root, got {self.tokens}, {self.parents}")
        if self.parents[0] != -1:
            raise ValueError("node 0 of a draft tree is the root (parent -1)")
        for i, p in enumerate(self.parents[1:], 1):
            if not 0 <= p < i:
                raise ValueError(f"draft tree nodes must follow their parents: node {i} has parent {p}")
        if not self.qs:
            self.qs = [None] * len(self.tokens)
        elif len(self.qs) != len(self.tokens):
            raise ValueError("a draft tree needs one q (or None) per node")
        self.depth = [0] * len(self.tokens)
        self.children: list[list[int]] = [[] for _ in self.tokens]
        for i, p in enumerate(self.parents[1:], 1):
            self.depth[i] = self.depth[p] + 1
            self.children[p].append(i)

    # --- building --------------------------------------------------------------------------------
    @classmethod
    def chain(cls, root: int, drafts: Sequence[int], qs: Sequence[np.ndarray] | None = None) -> DraftTree:
        """The chain ``root -> drafts[0] -> drafts[1] ...`` (what one-chain speculative decoding verifies)."""
        n = len(drafts)
        return cls([int(root), *(int(t) for t in drafts)], list(range(-1, n)),
                   [None, *(qs if qs is not None else [None] * n)])

    def add(self, parent: int, token: int, q: np.ndarray | None = None) -> int:
        """Append a child of ``parent``; returns its index."""
        if not 0 <= parent < len(self.tokens):
            raise ValueError(f"no node {parent} in a tree of {len(self.tokens)}")
        i = len(self.tokens)
        self.tokens.append(int(token))
        self.parents.append(int(parent))
        self.qs.append(q)
        self.depth.append(self.depth[parent] + 1)
        self.children.append([])
        self.children[parent].append(i)
        return i

    def child_with(self, node: int, token: int) -> int | None:
        """The child of ``node`` that holds ``token``, or None."""
        for c in self.children[node]:
            if self.tokens[c] == token:
                return c
        return None

    # --- shape -----------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Number of nodes."""
        return len(self.tokens)

    @property
    def drafted(self) -> int:
        """Drafted nodes (all but the root)."""
        return len(self.tokens) - 1

    @property
    def max_depth(self) -> int:
        """Depth of the deepest node."""
        return max(self.depth)

    @property
    def is_chain(self) -> bool:
        """True when every node's parent is the node before it (a plain draft chain)."""
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def main_chain_length(self) -> int:
        """Drafted nodes on the first-child path from the root."""
        n, i = 0, 0
        while self.children[i]:
            i = self.children[i][0]
            n += 1
        return n

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to ``node`` (root first)."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def ancestor_matrix(self) -> np.ndarray:
        """``[n, n]`` bool: ``A[i, j]`` when node ``j`` is node ``i`` or one of its ancestors."""
        n = len(self.tokens)
        a = np.zeros((n, n), dtype=bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                a[i] = a[p]
            a[i, i] = True
        return a

    def attention(self, past_valid: np.ndarray, neg: float) -> np.ndarray:
        """Additive attention bias ``[1, 1, n, past + n]`` (float32).

        0 where node ``i`` may attend, ``neg`` elsewhere; ``past_valid`` (bool ``[past]``) marks the cache slots
        that hold the sequence.
        """
        n = len(self.tokens)
        past = past_valid.shape[0]
        bias = np.full((1, 1, n, past + n), neg, dtype=np.float32)
        bias[0, 0, :, :past][:, past_valid] = 0.0
        bias[0, 0, :, past:][self.ancestor_matrix()] = 0.0
        return bias

    def positions(self, past_len: int) -> np.ndarray:
        """``[1, n]`` int64 position ids: ``past_len + depth``."""
        return (past_len + np.asarray(self.depth, dtype=np.int64))[None]


def accept_greedy(tree: DraftTree, logits: np.ndarray) -> tuple[list[int], int]:
    """Greedy acceptance of a tree: ``(path, next_token)``.

    The longest root-to-node path whose tokens are the target's argmax at their parent (``logits``
    ``[n, vocab]``, one row per node), and the argmax at the path's last node.
    """
    picks = np.argmax(logits, axis=-1)
    path = [0]
    while True:
        c = tree.child_with(path[-1], int(picks[path[-1]]))
        if c is None:
            return path, int(picks[path[-1]])
        path.append(c)


def accept_sampling(tree: DraftTree, p: np.ndarray, rng: np.random.Generator) -> tuple[list[int], int]:
    """Sampled acceptance of a tree: ``(path, next_token)``.

    Multi-round speculative sampling over each node's children (module docstring); ``p`` ``[n, vocab]`` the
    target's probabilities at each node (float64, rows sum to 1).
    """
    path = [0]
    while True:
        node = path[-1]
        residual = p[node]
        nxt = None
        for c in tree.children[node]:
            t = tree.tokens[c]
            q = tree.qs[c]
            pt = residual[t]
            rt = 1.0 if q is None else float(q[t])
            if rt > 0 and rng.random() * rt < pt:  # accept with probability min(1, p/r)
                nxt = c
                break
            if q is None:
                residual = residual.copy()
                residual[t] = 0.0
            else:
                residual = np.maximum(residual - q, 0.0)
            s = residual.sum()
            # s == 0: p <= r everywhere, so in exact arithmetic the candidate was accepted surely (rounding)
            residual = residual / s if s > 0 else p[node]
        if nxt is None:
            return path, sample_from(residual, rng)
        path.append(nxt)
