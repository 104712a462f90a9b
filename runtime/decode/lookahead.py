"""The ``lookahead`` drafter: lookahead decoding, training-free, verified as one draft tree per round.

Fu et al. 2024, "Break the Sequential Dependency of LLM Inference Using Lookahead Decoding".

State: a *Jacobi window* of ``W`` columns and up to ``N - 1`` levels (``levels[l][j]``: the guess of level ``l``
at column ``j``; level 0 is the oldest) and an *n-gram pool* (first token -> the most recent ``G`` tails of
``N - 1`` tokens harvested from the window).

Each round's tree (one target call both verifies and advances the Jacobi iteration):

* verification branch — the pool's n-grams that start with the sequence's last token (most recent first),
  merged as a trie under the root;
* lookahead branch — the staggered 2-D window as chains under tree attention: level 0 is the chain
  ``root -> levels[0][0] -> levels[0][1] -> ...`` and column ``j``'s higher levels hang under ``levels[0][j]``
  as the diagonal ``levels[1][j] -> levels[2][j] -> ...``. Cell ``(l, j)`` sits at depth ``j + l + 1`` (position
  ``past + j + l + 1``) and sees the past, the root, level 0 up to column ``j`` and its own column's lower levels:
  exactly the context the paper's lookahead mask gives it. Cells reuse a trie node with the same token on the
  same path (same context, so the same logits).

:meth:`LookaheadDrafter.after_verify` reads the target's logits at each column's top cell: its argmax is the next
level's guess for that column (one Jacobi step). Once the window holds ``N - 1`` levels, each column's diagonal
plus that guess is an ``N``-gram for the pool, and the oldest level is dropped. Level 0 starts as tokens picked
from the prompt (a fixed seed: the drafter never draws from the generation's random stream).

Every node is a deterministic candidate (a point mass), so greedy output is the target's and sampling is exact
under the tree's multi-candidate rejection sampling (:mod:`dyncompile.runtime.decode.draft_tree`). The window
does not move with accepted tokens (as in the paper's implementation): a stale guess costs acceptance, never
correctness. Compose with prompt lookup through the hybrid drafter (``prompt_lookup: true``): its trie of
context matches then shares the tree.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from dyncompile.runtime.decode.draft_tree import DraftTree
from dyncompile.runtime.decode.drafters import Drafter, TreeBudget, Verification

logger = logging.getLogger(__name__)

__all__ = ["LookaheadDrafter"]


class LookaheadDrafter(Drafter):
    """Jacobi window + n-gram pool (module docstring)."""

    name = "lookahead"

    def __init__(self, window: int = 5, ngram: int = 4, guesses: int = 5) -> None:
        """``window`` columns, n-grams of ``ngram`` tokens (``ngram - 1`` levels), ``guesses`` pool n-grams a round."""
        if window < 1 or ngram < 2 or guesses < 0:
            raise ValueError(f"lookahead needs window >= 1, ngram >= 2, guesses >= 0; got {window}, {ngram}, {guesses}")
        self.window, self.ngram, self.guesses = int(window), int(ngram), int(guesses)
        self.levels: list[list[int]] = []
        self.pool: dict[int, dict[tuple[int, ...], None]] = {}
        self._tree: DraftTree | None = None
        self._cells: list[list[int]] = []
        #: n-grams harvested into the pool this generation
        self.harvested = 0

    def reset(self, prompt_ids: Sequence[int]) -> None:
        """A new prompt: level 0 from the prompt's tokens, an empty pool."""
        ids = [int(t) for t in prompt_ids] or [0]
        rng = np.random.default_rng(len(ids))
        self.levels = [[ids[int(i)] for i in rng.integers(0, len(ids), self.window)]]
        self.pool = {}
        self._tree, self._cells = None, []
        self.harvested = 0

    def propose(self, seq, n, *, sample, temperature, rng, vocab_size):
        """The chain form: the most recent pool n-gram after the last token (the window needs a tree)."""
        tails = self.pool.get(int(seq[-1]))
        if not tails or n <= 0:
            return [], None
        return list(next(reversed(tails)))[:n], None

    def propose_tree(self, seq, budget: TreeBudget, *, sample, temperature, rng, vocab_size) -> DraftTree:
        """Pool n-grams after the last token, then the Jacobi window's cells, within ``budget``'s nodes and depth."""
        del sample, temperature, rng, vocab_size
        tree = DraftTree.chain(seq[-1], [])
        self._tree, self._cells = tree, []
        room, depth = budget.max_nodes, budget.max_depth
        if room <= 0 or depth <= 0:
            return tree
        for tail in list(reversed(self.pool.get(int(seq[-1]), {})))[: self.guesses]:
            node = 0
            for t in tail[:depth]:
                c = tree.child_with(node, t)
                if c is None:
                    if room <= 0:
                        break
                    c = tree.add(node, t)
                    room -= 1
                node = c
        levels = len(self.levels)
        node = 0
        for j in range(self.window):
            if j + levels > depth or room < levels:  # column j's top cell at depth j + levels
                break
            col = []
            parent = node
            for lv in range(levels):
                t = self.levels[lv][j]
                c = tree.child_with(parent, t)
                if c is None:
                    c = tree.add(parent, t)
                    room -= 1
                col.append(c)
                parent = c
            node = col[0]
            self._cells.append(col)
        return tree

    def after_verify(self, v: Verification) -> None:
        """One Jacobi step from the logits at each column's top cell; harvest the finished diagonals."""
        if v.tree is not self._tree or not self._cells:
            return
        logits = v.outputs[v.target.spec.logits]
        guess = [int(np.argmax(logits[col[-1]])) for col in self._cells]
        full = len(self.levels) == self.ngram - 1
        if full:
            for j, g in enumerate(guess):
                gram = tuple(self.levels[lv][j] for lv in range(len(self.levels))) + (g,)
                tails = self.pool.setdefault(gram[0], {})
                tails.pop(gram[1:], None)
                tails[gram[1:]] = None  # most recent last
                while len(tails) > max(1, self.guesses):
                    del tails[next(iter(tails))]
                self.harvested += 1
        new = guess + self.levels[-1][len(guess):]
        self.levels = (self.levels[1:] if full else self.levels) + [new]
        self._tree, self._cells = None, []
