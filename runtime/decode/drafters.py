"""Drafters for speculative decoding: a model (external or split from the target) or prompt lookup.

A drafter proposes up to ``n`` tokens continuing the current sequence; the target then checks them all
in one call (:mod:`dyncompile.runtime.decode.speculative`). For exact speculative sampling a drafter also returns
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
* :class:`HybridDrafter` puts prompt lookup's candidates (where the context has n-gram matches) and another
  drafter's (a model, EAGLE head or lookahead) into one tree per round.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import numpy as np

from dyncompile.runtime.decode.draft_tree import DraftTree
from dyncompile.runtime.decode.kv_cache import KVDecoder
from dyncompile.runtime.rules.sampling import probs_from_logits, sample_from

logger = logging.getLogger(__name__)

__all__ = ["Drafter", "HybridDrafter", "ModelDrafter", "PromptLookupDrafter", "TreeBudget", "Verification", "merge_tree"]


@dataclasses.dataclass(frozen=True)
class TreeBudget:
    """How large a draft tree may be.

    ``max_nodes`` drafted nodes (root excluded), paths of at most ``max_depth`` drafts, at most ``branching``
    children per node. A chain of ``g`` is ``(g, g, 1)``.
    """

    max_nodes: int
    max_depth: int
    branching: int = 1


@dataclasses.dataclass
class Verification:
    """What one verification round decided, handed to :meth:`Drafter.after_verify`.

    Attributes:
        seq: the sequence after the round (prompt, everything generated, the accepted drafts and the target's
            next token).
        valid_length: tokens of ``seq`` now held in the target's cache (all but the last one).
        tree: the tree the target verified (node 0 = the root, the last token before the round).
        path: accepted node indices, root first (``path[0] == 0``); ``tree.tokens[path[1:]]`` are the accepted
            drafts, and ``seq[-1]`` is the target's own next token.
        outputs: every output of the target call, batch dim dropped, one row per tree node: the logits
            ``[n, vocab]`` under the plan's logits name and any extra output of the graph (e.g. an EAGLE
            ``features`` output ``[n, hidden]``: ``outputs["features"][path]`` are the accepted path's rows).
            The KV ``present`` tensors are not included (the target keeps them).
        target: the target decoder (its cache already holds only the accepted path).
    """

    seq: list[int]
    valid_length: int
    tree: DraftTree
    path: list[int]
    outputs: dict[str, np.ndarray]
    target: KVDecoder


class Drafter:
    """A drafter's interface (the speculative loop calls these, in this order).

    * ``reset(prompt_ids)`` — a new generation.
    * ``after_prefill(target)`` — the target has run the prompt (``target.last_outputs`` holds its outputs).
    * each round: ``propose_tree(seq, budget, ...) -> DraftTree`` (the default: the chain of ``propose``;
      ``propose(seq, n, ...) -> (tokens, qs)`` is the chain form), the target verifies the tree in one call,
      then ``after_verify(Verification)`` with the accepted path and every output of that call.

    ``qs`` / ``DraftTree.qs``: the full-vocabulary distribution a drafted token was *sampled* from, or ``None``
    for a deterministic choice (a point mass), which is what exact speculative sampling needs.
    """

    name = "drafter"
    #: a model drafter ends a chain after a token it gives less than this probability (0: drafts the whole length);
    #: set per call by the speculative step from the plan's ``draft.stop_below`` or the ``stop_below`` option
    stop_below = 0.0

    def reset(self, prompt_ids: Sequence[int]) -> None:
        """Start a new prompt (``prompt_ids``); drop any state of the previous one."""
        pass

    def after_prefill(self, target: KVDecoder) -> None:
        """Called once the target has prefilled the prompt (e.g. to share its cache)."""
        pass

    def propose(self, seq: list[int], n: int, *, sample: bool, temperature: float, rng: np.random.Generator,
                vocab_size: int) -> tuple[list[int], list[np.ndarray] | None]:
        """Draft up to ``n`` tokens after ``seq``; returns the tokens and, when sampling, their distributions."""
        raise NotImplementedError

    def propose_tree(self, seq: list[int], budget: TreeBudget, *, sample: bool, temperature: float,
                     rng: np.random.Generator, vocab_size: int) -> DraftTree:
        """A draft tree rooted at ``seq[-1]`` within ``budget``; by default the chain of :meth:`propose`."""
        n = min(budget.max_nodes, budget.max_depth)
        tokens, qs = self.propose(seq, n, sample=sample, temperature=temperature, rng=rng, vocab_size=vocab_size)
        return DraftTree.chain(seq[-1], tokens, qs if sample else None)

    def after_verify(self, v: Verification) -> None:
        """The target verified a tree: ``v`` says what was accepted and carries the target call's outputs."""



def frontier_visibility(exp, par, slot, past_valid: np.ndarray, slots: int) -> np.ndarray:
    """Visibility ``[len(exp), slots + len(exp)]`` of a tree frontier fed to a drafter in one call.

    Row ``r`` (node ``exp[r]``) sees the valid committed cache (``past_valid``, one flag per committed slot), the cache slots of its
    ancestors (``par``: parent index, -1 for the root's children; ``slot``: each drafted node's cache slot) and
    itself (slot ``slots + r``).
    """
    n = len(exp)
    visible = np.zeros((n, slots + n), bool)
    visible[:, : len(past_valid)] = past_valid
    for r, i in enumerate(exp):
        a = par[i]
        while a >= 0:
            visible[r, slot[a]] = True
            a = par[a]
        visible[r, slots + r] = True
    return visible


def grow_tree(dec, root: int, logits: np.ndarray, budget: TreeBudget, vocab: np.ndarray | None, vocab_size: int,
              call, hidden: np.ndarray | None = None) -> DraftTree:
    """A greedy draft tree grown best-first by draft confidence (EAGLE-2).

    For any drafter whose graph takes a 4-D attention bias (:attr:`KVDecoder.supports_trees`).

    ``dec`` holds the sequence in its cache (its ``length`` / ``slots`` now are the committed positions);
    ``logits`` (and ``hidden``, an EAGLE drafter's predicted feature) are its last row. The root's top-k children
    (``k = branching``) are scored by their draft log-probability; then, once per depth, the ``k`` best frontier
    nodes by cumulative score are fed together in ONE ``call(tokens, extras, positions, visible) -> (logits rows,
    extra rows | None)`` (``extras``: each node's parent's extra row; ``visible``: :func:`frontier_visibility`, the
    committed cache and the node's ancestors), each offering its top-k children (score = parent's + log p). The
    ``max_nodes`` best of all generated nodes form the tree (ties: created first = shallower first, so the set is
    ancestor-closed: a node never outscores its parent), each node's children in score order (the first-child path
    is the drafter's greedy chain). Expansion stops once no frontier node can still enter that set (its
    descendants score no higher and are created later: the same tree). ``dec`` is truncated back afterwards.
    """
    committed, committed_slots = dec.length, dec.slots
    past_valid = dec._mask[0, :committed_slots].astype(bool)
    k = max(1, budget.branching)
    # generated nodes: token, parent (-1 = the root), depth, score, extra input (the parent's extra row)
    toks: list[int] = []
    par: list[int] = []
    dep: list[int] = []
    score: list[float] = []
    extra: list[np.ndarray | None] = []
    slot: dict[int, int] = {}  # drafter cache slot of an expanded node

    def children(lg: np.ndarray, h: np.ndarray | None, parent: int, base: float, d: int) -> list[int]:
        lg = np.asarray(lg, np.float64)
        m = lg.max()
        lp = lg - m - np.log(np.exp(lg - m).sum())
        top = np.argpartition(-lp, min(k, lp.shape[-1] - 1))[:k]
        made = []
        for j in top[np.argsort(-lp[top], kind="stable")]:
            t = int(vocab[j]) if vocab is not None else int(j)
            if t < vocab_size:
                made.append(len(toks))
                toks.append(t)
                par.append(parent)
                dep.append(d)
                score.append(base + float(lp[j]))
                extra.append(h)
        return made

    def rank(i: int) -> tuple[float, int]:
        return (-score[i], i)

    frontier = children(logits, hidden, -1, 0.0, 1)
    for d in range(2, budget.max_depth + 1):
        if len(toks) >= budget.max_nodes:
            cutoff = score[sorted(range(len(toks)), key=rank)[budget.max_nodes - 1]]
            frontier = [i for i in frontier if score[i] > cutoff]
        if not frontier:
            break
        exp = sorted(frontier, key=rank)[:k]
        visible = frontier_visibility(exp, par, slot, past_valid, dec.slots)
        base_slot = dec.slots
        rows, extra_rows = call([toks[i] for i in exp], [extra[i] for i in exp],
                                [committed - 1 + dep[i] for i in exp], visible)
        frontier = []
        for r, i in enumerate(exp):
            slot[i] = base_slot + r
            frontier += children(rows[r], None if extra_rows is None else extra_rows[r], i, score[i], d)
    dec.truncate(committed)
    chosen = sorted(range(len(toks)), key=rank)[: budget.max_nodes]
    tree = DraftTree.chain(root, [])
    index = {-1: 0}
    for i in sorted(chosen, key=lambda i: (dep[i], *rank(i))):  # parents first; children best first
        index[i] = tree.add(index[par[i]], toks[i])
    return tree


def pick_draft_token(logits: np.ndarray, vocab: np.ndarray | None, sample: bool, temperature: float, rng,
                     vocab_size: int) -> tuple[int, np.ndarray | None]:
    """A drafter's next token in target ids, and (sampling) its distribution over the target's vocabulary.

    ``vocab`` maps a reduced draft vocabulary back to target ids (``None``: the drafter's ids are the target's;
    a larger or smaller head is padded/cut to ``vocab_size``).
    """
    if not sample:
        j = int(np.argmax(logits))
        return (int(vocab[j]) if vocab is not None else j), None
    q = probs_from_logits(logits, temperature)
    j = sample_from(q, rng)
    if vocab is not None:
        full = np.zeros(vocab_size, np.float64)
        full[vocab] = q
        return int(vocab[j]), full
    if q.shape[-1] != vocab_size:
        full = np.zeros(vocab_size, np.float64)
        m = min(vocab_size, q.shape[-1])
        full[:m] = q[:m]
        return j, full
    return j, q


def unsure(logits: np.ndarray, q: np.ndarray | None, tok: int, stop_below: float) -> bool:
    """Whether a drafter's chain should end after ``tok``: its probability under the drafter is below ``stop_below``.

    Greedy (``q is None``): the drafted token is the argmax, so its probability is ``1 / sum(exp(l - max l))`` of the
    drafter's logits; sampling: ``q[tok]``, the distribution it was drawn from. ``stop_below`` 0 never stops. The
    stop reads only the drafter's own distribution, never the target's, so greedy output stays the target's and
    sampling stays exact (the draft length may depend on anything but the target's answer).
    """
    if stop_below <= 0.0:
        return False
    if q is not None:
        return float(q[tok]) < stop_below
    lg = np.asarray(logits, np.float32)
    return 1.0 / float(np.exp(lg - lg.max()).sum()) < stop_below


def top_alternatives(logits: np.ndarray, vocab: np.ndarray | None, k: int, exclude: int, vocab_size: int) -> list[int]:
    """The drafter's ``k`` next-best tokens (target ids) after ``exclude`` (deterministic: top-k of its logits)."""
    if k <= 0:
        return []
    top = np.argpartition(-logits, min(k + 1, logits.shape[-1] - 1))[: k + 1]
    top = top[np.argsort(-logits[top], kind="stable")]
    toks = [int(vocab[j]) if vocab is not None else int(j) for j in top]
    return [t for t in toks if t != exclude and t < vocab_size][:k]

class ModelDrafter(Drafter):
    """A decoder drafter (external, or split from the target).

    Its trees: greedy, on a drafter graph with a 4-D attention bias input (``explicit-attention``), best-first
    expansion of its top-k tokens (:meth:`_expand`);
    otherwise (and when sampling) the greedy or sampled chain plus the drafter's next-best tokens at each
    depth as sibling leaves (top-k branches), shallow depths first.
    """

    def __init__(self, decoder: KVDecoder, *, name: str = "model", share_kv: Sequence[int] | None = None,
                 vocab: np.ndarray | None = None) -> None:
        """Draft with ``decoder``.

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
        self._fed: list[int] = []  # the tokens the drafter's cache holds

    def reset(self, prompt_ids: Sequence[int]) -> None:
        """Start a new prompt: clear the drafter's cache."""
        self.decoder.reset()
        self._fed = []
        self._prompt = list(prompt_ids)

    def _adopt(self, target: KVDecoder, seq: Sequence[int]) -> None:
        self.decoder.adopt(target, self.share_kv)
        self._fed = list(seq[: target.length])

    def after_prefill(self, target: KVDecoder) -> None:
        """Share the target's prefilled cache when the drafter reads it."""
        if self.share_kv is not None:
            self._adopt(target, self._prompt)

    def _catch_up(self, seq) -> list[int]:
        """Roll the drafter's cache back to its common prefix with ``seq``; the tokens of ``seq`` still to feed."""
        dec = self.decoder
        keep = _common_prefix(self._fed, seq, len(seq) - 1)
        if keep < dec.length:
            dec.truncate(keep)
            self._fed = self._fed[:keep]
        return list(seq[dec.length :])

    def _chain(self, seq, n, sample, temperature, rng, vocab_size, alt: int = 0):
        """Draft ``n`` tokens; with ``alt`` also the ``alt`` next-best tokens at each step."""
        dec = self.decoder
        feed = self._catch_up(seq)
        tokens: list[int] = []
        qs: list[np.ndarray] = []
        alts: list[list[int]] = []
        for _ in range(n):
            logits = dec.forward(feed, last=1)[-1]
            self._fed.extend(feed)
            tok, q = pick_draft_token(logits, self.vocab, sample, temperature, rng, vocab_size)
            if tok >= vocab_size:  # a drafter with a larger vocabulary proposed a token the target lacks
                break
            tokens.append(tok)
            if sample:
                qs.append(q)
            if alt:
                alts.append(top_alternatives(np.asarray(logits, np.float64), self.vocab, alt, tok, vocab_size))
            if unsure(logits, q, tok, self.stop_below):
                break
            feed = [tok]
        return tokens, (qs if sample else None), alts

    def propose(self, seq, n, *, sample, temperature, rng, vocab_size):
        """Draft up to ``n`` tokens after ``seq`` with the drafter model."""
        if n <= 0:
            return [], ([] if sample else None)
        tokens, qs, _ = self._chain(seq, n, sample, temperature, rng, vocab_size)
        return tokens, qs

    def _expand(self, seq, budget: TreeBudget, vocab_size: int) -> DraftTree:
        """Greedy tree by best-first expansion (EAGLE-2 style) on a drafter with a 4-D attention bias input.

        One drafter call per depth feeds the ``branching`` best frontier nodes together (each attending to the
        sequence and its own ancestors); every node proposes its drafter's top-``branching`` tokens, scored by
        the path's summed log-probability; the ``max_nodes`` best-scored nodes form the tree (a node's score
        never exceeds its parent's, so they are a tree). The first child of each node is its best child, so the
        main chain is the drafter's greedy chain. The drafter's cache is rolled back to the sequence after.
        """
        dec = self.decoder
        feed = self._catch_up(seq)
        logits = dec.forward(feed, last=1)[-1]
        self._fed.extend(feed)
        return grow_tree(dec, seq[-1], logits, budget, self.vocab, vocab_size,
                         lambda toks, _, positions, visible: (dec.forward_visible(toks, positions, visible), None))

    def propose_tree(self, seq, budget, *, sample, temperature, rng, vocab_size):
        """Draft a token tree within ``budget`` (a chain when the model cannot branch)."""
        if (not sample and self.decoder.supports_trees and budget.branching > 1 and budget.max_nodes > budget.max_depth
                and budget.max_depth > 0):
            return self._expand(seq, budget, vocab_size)
        depth = min(budget.max_depth, budget.max_nodes)
        if depth <= 0:
            return DraftTree.chain(seq[-1], [])
        alt = max(0, budget.branching - 1) if budget.max_nodes > depth else 0
        tokens, qs, alts = self._chain(seq, depth, sample, temperature, rng, vocab_size, alt)
        tree = DraftTree.chain(seq[-1], tokens, qs)
        room = budget.max_nodes - len(tokens)
        for d, cands in enumerate(alts):  # siblings of the chain's node d+1: children of node d
            for t in cands:
                if room <= 0:
                    return tree
                tree.add(d, t)  # a deterministic candidate: a point mass (q None), exact when sampling too
                room -= 1
        return tree

    def after_verify(self, v: Verification) -> None:
        """Roll the drafter's cache back to what the target accepted."""
        if self.share_kv is not None:
            self._adopt(v.target, v.seq)
            return
        keep = _common_prefix(self._fed, v.seq, v.valid_length)
        self.decoder.truncate(keep)
        self._fed = self._fed[:keep]


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the common prefix of ``a`` and ``b``, at most ``limit``."""
    n = min(len(a), len(b), limit)
    if n <= 0:
        return 0
    x = np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64)
    i = int(np.argmax(x)) if x.any() else n
    return i


class PromptLookupDrafter(Drafter):
    """Model-free drafts: what followed earlier occurrences of the current suffix n-gram.

    The chain copies the continuation of the most recent occurrence of the longest matching n-gram; the tree
    merges the continuations of several occurrences (longest n-gram first, most recent first) into a trie.
    """

    name = "prompt-lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        """Match n-grams of ``min_ngram`` to ``max_ngram`` tokens against the prompt and the output so far."""
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = int(max_ngram)
        self.min_ngram = int(min_ngram)
        self._index: dict[tuple[int, ...], list[int]] = {}
        self._indexed = 0  # n-grams ending before this position are indexed

    def reset(self, prompt_ids: Sequence[int]) -> None:
        """Start a new prompt: clear the n-gram index (rebuilt as the sequence grows)."""
        self._index = {}
        self._indexed = 0

    def _update(self, seq: list[int]) -> None:
        # index every n-gram that ends at e <= len(seq) - 2 (so a following token exists): key -> [e, ...]
        last = len(seq) - 2
        for e in range(self._indexed, last + 1):
            for n in range(self.min_ngram, self.max_ngram + 1):
                if e - n + 1 < 0:
                    break
                self._index.setdefault(tuple(seq[e - n + 1 : e + 1]), []).append(e)
        self._indexed = max(self._indexed, last + 1)

    def _matches(self, seq, min_size: int = 1):
        """``(size, ends)`` of each suffix n-gram of ``seq`` seen earlier, longest first.

        Sizes run from ``max_ngram`` down to ``min_ngram`` (or to ``min_size`` when that is larger); ``ends`` are the
        earlier occurrences' last positions.
        """
        self._update(seq)
        for size in range(min(self.max_ngram, len(seq) - 1), max(self.min_ngram, min_size) - 1, -1):
            ends = self._index.get(tuple(seq[-size:]))
            if ends:
                yield size, ends

    def match_size(self, seq) -> int:
        """Tokens in the longest suffix n-gram of ``seq`` (``min_ngram`` to ``max_ngram``) seen earlier; 0: none."""
        if len(seq) < 2:
            return 0
        return next((size for size, _ in self._matches(seq)), 0)

    def propose(self, seq, n, *, sample, temperature, rng, vocab_size):
        """Draft the tokens that followed the longest earlier match of the sequence's last n-gram."""
        del temperature, rng, vocab_size
        if n <= 0 or len(seq) < 2:
            return [], ([] if sample else None)
        for _, ends in self._matches(seq):
            e = ends[-1]
            return [int(t) for t in seq[e + 1 : e + 1 + n]], None
        return [], None

    def propose_tree(self, seq, budget, *, sample, temperature, rng, vocab_size, min_size: int = 1):
        """Draft a tree whose branches are the continuations of several earlier matches.

        ``min_size`` raises ``min_ngram`` for this call (a hybrid takes only matches of that many tokens).
        """
        del sample, temperature, rng, vocab_size
        tree = DraftTree.chain(seq[-1], [])
        if budget.max_nodes <= 0 or budget.max_depth <= 0 or len(seq) < 2:
            return tree
        room = budget.max_nodes
        seen: set[int] = set()
        for _, ends in self._matches(seq, min_size):
            for e in reversed(ends):
                if e in seen:
                    continue
                seen.add(e)
                node = 0
                for t in seq[e + 1 : e + 1 + budget.max_depth]:
                    c = tree.child_with(node, int(t))
                    if c is None:
                        if room <= 0 or len(tree.children[node]) >= budget.branching:
                            break
                        c = tree.add(node, int(t))
                        room -= 1
                    node = c
                if room <= 0:
                    return tree
        return tree


def merge_tree(dst: DraftTree, src: DraftTree, room: int) -> int:
    """Add ``src``'s drafted nodes to ``dst`` (same root) within ``room`` new nodes; returns the nodes added.

    A deterministic node (``q`` None) reuses a deterministic child of the same token on the same path (same
    context, same target logits; a second point mass on an already rejected token would be rejected surely, so
    greedy and sampled acceptance are unchanged). A sampled node is always a sibling of its own: merging it would
    change the residual distribution the next candidate is tested against, and sampling would no longer be exact.
    Nodes whose parent did not fit are left out.
    """
    index = {0: 0}
    added = 0
    for i in range(1, len(src)):
        p = index.get(src.parents[i])
        if p is None:
            continue
        t, q = src.tokens[i], src.qs[i]
        c = None
        if q is None:
            c = next((c for c in dst.children[p] if dst.tokens[c] == t and dst.qs[c] is None), None)
        if c is None:
            if added >= room:
                continue
            c = dst.add(p, t, q)
            added += 1
        index[i] = c
    return added


class HybridDrafter(Drafter):
    """Prompt-lookup candidates where the context has n-gram matches, another drafter's in the rest of the tree.

    Only matches of at least ``min_match`` tokens count: a one-token match copies what followed any earlier
    occurrence of the last token, which the target accepts no more often than the other drafter's proposal
    (Qwen2.5-Coder-0.5B with an EAGLE-3 head, calibration prompts: 1.4-1.6 accepted drafts against 1.6-2.6; after
    a three-token match 5.6-6.7 against 2.3-2.5; ``bench-results/eagle3/``).

    Trees: prompt lookup's trie of context matches takes at most half the round's node budget; the other drafter
    proposes a tree in the nodes left (all of them when the context has no match), and the trie is merged into it
    (:func:`merge_tree`; the other drafter's node indices stay valid, so it reads its own nodes' rows in
    :meth:`after_verify`). Chains (a budget without branches): prompt lookup's chain when the context has a match,
    the other drafter's otherwise; :meth:`part` says which before the round, so the speculative step keeps one
    draft-length controller per part. Which candidates enter depends only on the sequence, never on the target's
    answer to them, so greedy output is the target's and sampling stays exact.
    """

    def __init__(self, lookup: PromptLookupDrafter, other: Drafter, *, min_match: int = 1) -> None:
        """Combine ``lookup`` (matches of ``min_match`` tokens or more) with ``other`` (model, EAGLE, Medusa, lookahead)."""
        self.lookup, self.other = lookup, other
        self.min_match = max(1, int(min_match))
        self.name = f"{lookup.name}+{other.name}"
        self.decoder = getattr(other, "decoder", None)

    def reset(self, prompt_ids: Sequence[int]) -> None:
        """Start a new prompt in both drafters."""
        self.lookup.reset(prompt_ids)
        self.other.reset(prompt_ids)

    def after_prefill(self, target: KVDecoder) -> None:
        """Hand the prefilled target to the other drafter."""
        self.other.after_prefill(target)

    def part(self, seq) -> Drafter:
        """The part that drafts the next chain after ``seq``: prompt lookup on a long enough match, else the other."""
        return self.lookup if self.lookup.match_size(seq) >= self.min_match else self.other

    def propose(self, seq, n, *, sample, temperature, rng, vocab_size):
        """Prompt lookup's chain when the context has a match of ``min_match`` tokens, else the other drafter's."""
        return self.part(seq).propose(seq, n, sample=sample, temperature=temperature, rng=rng, vocab_size=vocab_size)

    def propose_tree(self, seq, budget: TreeBudget, *, sample, temperature, rng, vocab_size) -> DraftTree:
        """One tree: prompt lookup's matches (at most half the nodes) merged into the other drafter's tree."""
        kw = dict(sample=sample, temperature=temperature, rng=rng, vocab_size=vocab_size)
        if budget.branching <= 1 or budget.max_nodes <= budget.max_depth:  # a chain budget: one drafter's chain
            tree = self.lookup.propose_tree(seq, budget, min_size=self.min_match, **kw)
            return tree if tree.drafted else self.other.propose_tree(seq, budget, **kw)
        half = TreeBudget(max(1, budget.max_nodes // 2), budget.max_depth, budget.branching)
        lookup = self.lookup.propose_tree(seq, half, min_size=self.min_match, **kw)
        rest = TreeBudget(budget.max_nodes - lookup.drafted, budget.max_depth, budget.branching)
        tree = self.other.propose_tree(seq, rest, **kw)
        merge_tree(tree, lookup, budget.max_nodes - tree.drafted)
        return tree

    def after_verify(self, v: Verification) -> None:
        """The other drafter rolls back / learns from the round (prompt lookup indexes the sequence lazily)."""
        self.other.after_verify(v)
