"""The ``eagle`` drafter: draft at the feature level of the target (Li et al. 2024, EAGLE).

The drafter graph (built by the ``eagle-drafter`` pass) maps ``(token_{t+1}, feature_t)`` to the predicted
``feature_{t+1}`` and draft logits for token ``t+2``; it keeps its own one-layer KV cache, indexed by target
position. The target's plan exposes its ``features`` output (the final norm's input), which the target's
:class:`~dyncompile.runtime.decode.kv_cache.KVDecoder` fetches on every call (``extra_outputs``).

Bookkeeping (``F`` = the target's true features by position, ``T = len(seq) - 1`` positions known):

* ``propose``: catch up — feed positions ``L..T-1`` (``L`` = drafter cache length) as
  ``(seq[t+1], F[t])`` in one call; its last row gives draft 1 and ``f_hat``; then one call per further draft
  on ``(draft_i, f_hat_i)``.
* ``after_verify``: keep the verified rows of the target's features (the accepted path of the verified tree:
  the token before the round and the accepted drafts), and roll the drafter cache back to the positions
  computed from true features — the draft positions were computed from predictions and are recomputed in
  the next catch-up.
* ``propose_tree`` (greedy) — EAGLE-2 (Li et al. 2024, "EAGLE-2: Faster Inference of Language Models with
  Dynamic Draft Trees"), on a drafter graph with a 4-D attention bias input (``speculative{tree=true}`` gives
  the drafter one: :meth:`EagleDecoder.step` ``tree=`` / ``visible=``): after the catch-up call, the root's
  top-k children are scored by their draft log-probability; then, once per depth, the ``k`` best frontier
  nodes by cumulative score (sum of the drafter's log-probabilities along the path) are fed together in ONE
  drafter call, each as ``(its token, its parent's predicted feature)`` at position ``T - 1 + depth``
  attending to the true-feature cache and its own ancestors' rows only; each offers its top-k children
  (score = parent's + log p); the next frontier is the global top-k of those. Reranking keeps the
  ``max_nodes`` best nodes of all generated ones (ties: shallower first; a node never outscores its parent,
  so the set is ancestor-closed), each node's children in score order (the first-child path is the best
  path). Expansion stops early when no frontier node can still enter that set. The drafter cache is then
  truncated to the true-feature positions. Drafter graphs without the bias input (plans compiled before)
  keep the old tree: the chain plus the drafter's next-best tokens at each depth as sibling leaves.
  Sampling always uses the chain (``propose``). The target verifies the tree in one call (it needs
  ``explicit-attention`` + ``speculative{tree=true}``).

Greedy output is the target's (the target verifies every draft); sampling returns the drafter's
distribution over the full vocabulary for exact rejection sampling.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dyncompile.errors import PlanError
from dyncompile.plan import DecoderSpec
from dyncompile.runtime.decode.draft_tree import DraftTree
from dyncompile.runtime.decode.drafters import (
    Drafter,
    TreeBudget,
    Verification,
    grow_tree,
    pick_draft_token,
    top_alternatives,
    unsure,
)
from dyncompile.runtime.decode.kv_cache import KVDecoder, SessionTimer

__all__ = ["EagleDecoder", "EagleDrafter"]


class EagleDecoder(KVDecoder):
    """The drafter graph with its KV cache: ``step(ids, features) -> (logits, predicted features)``."""

    def __init__(self, session, spec: DecoderSpec, *, feature_input: str, hidden_output: str,
                 timer: SessionTimer | None = None, rollback: str = "mask") -> None:
        """Wrap the EAGLE head's session: ``feature_input`` reads target features, ``hidden_output`` gives its own."""
        super().__init__(session, spec, role="drafter", timer=timer, io_binding=False, rollback=rollback)
        self.feature_input = feature_input
        self.hidden_output = hidden_output
        if hidden_output not in self.extra_names:
            raise PlanError(f"the EAGLE drafter graph has no {hidden_output!r} output named in the plan; recompile")

    def step(self, ids: Sequence[int], features: np.ndarray, tree: DraftTree | None = None, *,
             visible: np.ndarray | None = None, positions: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Logits ``[n, draft vocab]`` and predicted features ``[n, hidden]``; the cache grows by ``n``.

        Rows attend causally (a chain) by default. With ``tree`` (``n`` nodes, node 0 first), row ``i`` sits at
        position ``length + depth[i]`` and attends to the valid cache and its ancestors among the ``n`` only;
        with ``visible`` (bool ``[n, slots + n]``) and ``positions``, row ``i`` attends exactly to the slots where
        ``visible[i]`` is true (a tree grown one depth per call). Both need :attr:`supports_trees` (the drafter
        graph's 4-D attention bias input); every new slot stays valid: roll back with :meth:`truncate`.
        """
        ids_arr = np.asarray(ids, dtype=np.int64).reshape(1, -1)
        n = ids_arr.shape[1]
        if (tree is not None or visible is not None) and not self.supports_trees:
            raise PlanError("the EAGLE drafter graph has no 4-D attention bias input (compiled without "
                            "speculative{tree=true}); recompile to draft EAGLE-2 trees")
        if tree is not None and len(tree) != n:
            raise ValueError(f"a tree of {len(tree)} nodes for {n} tokens")
        if visible is not None:
            aux = self._aux(n, None, np.asarray(visible, bool), np.asarray(positions, np.int64))
        else:
            aux = self._aux(n, tree)
        self._run(ids_arr, aux, {self.feature_input: np.asarray(features, np.float32).reshape(1, n, -1)})
        return self.last_outputs[self.output_names[0]], self.last_outputs[self.hidden_output]


class EagleDrafter(Drafter):
    """EAGLE drafting: the head extends the target's features to propose tokens (chains or trees)."""

    name = "eagle"

    def __init__(self, decoder: EagleDecoder, *, features: str, vocab: np.ndarray | None = None) -> None:
        """Draft with ``decoder`` from the target output ``features`` (``vocab`` maps a reduced draft vocabulary)."""
        self.decoder = decoder
        self.features = features
        self.vocab = None if vocab is None else np.asarray(vocab, dtype=np.int64)
        self._F = np.zeros((0, 0), np.float32)
        self.known = 0  # positions whose true target feature is in _F
        self.true_len = 0  # drafter cache positions computed from true features

    def reset(self, prompt_ids: Sequence[int]) -> None:
        """Start a new prompt: clear the head's cache."""
        self.decoder.reset()
        self.known = self.true_len = 0

    def _store(self, rows: np.ndarray) -> None:
        rows = np.asarray(rows, np.float32)
        need = self.known + len(rows)
        if self._F.shape[0] < need or self._F.shape[1] != rows.shape[1]:
            grown = np.zeros((max(2 * need, 1024), rows.shape[1]), np.float32)
            if self._F.shape[1] == rows.shape[1]:
                grown[: self.known] = self._F[: self.known]
            self._F = grown
        self._F[self.known : need] = rows
        self.known = need

    def _features_of(self, outputs: dict[str, np.ndarray]) -> np.ndarray:
        f = outputs.get(self.features)
        if f is None:
            raise PlanError(f"the target returned no {self.features!r} output; recompile with the eagle-drafter pass")
        return f

    def after_prefill(self, target: KVDecoder) -> None:
        """Store the target's prefill features for the head's next step."""
        self._store(self._features_of(target.last_outputs))

    def after_verify(self, v: Verification) -> None:
        """Keep the accepted path's true features (root first); drop the drafter's predicted-feature positions."""
        rows = self._features_of(v.outputs)[np.asarray(v.path, dtype=np.int64)]
        keep = v.valid_length - self.known
        if keep > 0:
            self._store(rows[:keep])
        self.decoder.truncate(min(self.decoder.length, self.true_len))

    def propose_tree(self, seq, budget: TreeBudget, *, sample, temperature, rng, vocab_size) -> DraftTree:
        """A draft tree within ``budget``.

        Greedy, on a drafter graph with the bias input: the EAGLE-2 tree (:meth:`_expand`, module docstring).
        Greedy on an older drafter graph: the drafter's chain plus, at each depth, its next-best tokens as sibling
        leaves (shallow depths first, up to ``max_nodes``). Sampling: the chain of :meth:`propose`. The target
        verifies the tree in one call.
        """
        if sample or budget.branching <= 1:
            return super().propose_tree(seq, budget, sample=sample, temperature=temperature, rng=rng,
                                        vocab_size=vocab_size)
        if self.decoder.supports_trees and budget.max_nodes > budget.max_depth > 0:
            return self._expand(seq, budget, vocab_size)
        depth = min(budget.max_depth, max(1, budget.max_nodes - (budget.branching - 1)))  # room for depth-1 siblings
        tokens, _, alts = self._chain(seq, depth, False, temperature, rng, vocab_size, alt=budget.branching - 1)
        tree = DraftTree.chain(seq[-1], tokens)
        room = budget.max_nodes - len(tokens)
        for d, cands in enumerate(alts[: len(tokens)]):
            for t in cands:
                if room <= 0:
                    return tree
                tree.add(d, t)  # a sibling of chain node d + 1: child of node d (0 = the root)
                room -= 1
        return tree

    def _catch_up(self, seq) -> tuple[np.ndarray, np.ndarray]:
        """Feed the positions with true features the drafter cache lacks; its rows' (logits, predicted features)."""
        dec = self.decoder
        T = len(seq) - 1  # positions 0..T-1 have true features
        if self.known < T:
            raise RuntimeError(f"eagle drafter: features known for {self.known} positions, sequence needs {T}")
        start = min(dec.length, T - 1)
        dec.truncate(start)
        logits, hid = dec.step(seq[start + 1 : T + 1], self._F[start:T])
        self.true_len = dec.length
        return logits, hid

    def _expand(self, seq, budget: TreeBudget, vocab_size: int) -> DraftTree:
        """The EAGLE-2 tree (module docstring).

        Best-first expansion by cumulative draft log-probability, one drafter call per depth on the
        ``branching`` best frontier nodes, then the ``max_nodes`` best nodes.
        """
        dec = self.decoder
        logits, hid = self._catch_up(seq)

        def call(toks, feats, positions, visible):
            return dec.step(toks, np.stack(feats), visible=visible, positions=positions)

        return grow_tree(dec, seq[-1], logits[-1], budget, self.vocab, vocab_size, call, hidden=hid[-1])

    def propose(self, seq, n, *, sample, temperature, rng, vocab_size):
        """Draft up to ``n`` tokens after ``seq`` with the head."""
        if n <= 0:
            return [], ([] if sample else None)
        tokens, qs, _ = self._chain(seq, n, sample, temperature, rng, vocab_size)
        return tokens, qs

    def _chain(self, seq, n, sample, temperature, rng, vocab_size, alt: int = 0):
        dec = self.decoder
        logits, hid = self._catch_up(seq)
        tokens: list[int] = []
        qs: list[np.ndarray] = []
        alts: list[list[int]] = []
        tok, q = pick_draft_token(logits[-1], self.vocab, sample, temperature, rng, vocab_size)
        h = hid[-1]
        for i in range(n):
            if tok >= vocab_size:
                break
            tokens.append(tok)
            if sample:
                qs.append(q)
            if alt:
                alts.append(top_alternatives(np.asarray(logits[-1], np.float64), self.vocab, alt, tok, vocab_size))
            if i == n - 1 or unsure(logits[-1], q, tok, self.stop_below):
                break
            logits, hid = dec.step([tok], h[None])
            tok, q = pick_draft_token(logits[-1], self.vocab, sample, temperature, rng, vocab_size)
            h = hid[-1]
        return tokens, (qs if sample else None), alts
