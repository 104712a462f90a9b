"""``speculative_generate`` step: a drafter proposes, the target verifies several tokens per call.

One round, with the target's cache holding every token of the sequence but the last::

    drafts = drafter.propose(seq, gamma)                 # gamma tokens (fewer if the drafter has none)
    logits = target.forward([seq[-1], *drafts])           # gamma + 1 positions in ONE call
    greedy:   accept drafts while draft_i == argmax(logits_i); then append argmax at the first mismatch
              (or after the last draft): exactly the tokens the target alone would pick.
    sampling: accept draft_i with probability min(1, p_i(d)/q_i(d)); at the first rejection draw from
              norm(max(0, p_i - q_i)); if all pass draw from p_gamma (Leviathan et al. 2023, Chen et al. 2023):
              the output distribution is the target's.
    target.truncate(len(seq) - 1); drafter.after_verify(...)   # KV of rejected tokens dropped

Draft length is adapted to the running acceptance rate ``alpha`` (decayed counts of accepted tokens and
rejections) and to the costs: ``gamma = argmax E(gamma) / (gamma * c_draft + v(gamma+1))`` with
``E = (1 - alpha^(gamma+1)) / (1 - alpha)`` expected tokens per round, ``c_draft`` the drafter's cost per
token relative to a target step and ``v(s)`` the target's cost for ``s`` tokens relative to one, both
measured at compile time and recorded in the plan (the one cost model, shared with the passes'
projections: :mod:`dyncompile.runtime.rules.cost_model`). The schedule then depends only on what was accepted,
so a seed reproduces a sampled output; ``adapt_to_timing=True`` uses this machine's timings measured online
instead. Stops at an eos token, at ``max_new_tokens`` and at the model's maximum length (drafts are capped
so no round overshoots).

Draft trees (plan ``draft.tree`` = ``{max_nodes, max_depth, branching, adaptive}``, or the ``tree=`` option of
``generate``; the target needs the 4-D ``attention_bias`` input of the ``explicit-attention`` pass): each round
the drafter proposes a tree (:meth:`~dyncompile.runtime.decode.drafters.Drafter.propose_tree`: prompt lookup merges
several n-gram matches into a trie, a model drafter adds its top-k alternatives beside its chain), the target
verifies every node in ONE call (node ``i`` at position ``past + depth(i)``, attending to the past and its
ancestors: :mod:`dyncompile.runtime.decode.draft_tree`), and the longest path the target agrees with is accepted
(greedy: token-identical; sampling: multi-candidate rejection sampling, exact). The KV cache then keeps only the
accepted path (:meth:`~dyncompile.runtime.decode.kv_cache.KVDecoder.keep_path`) and the drafter gets the path and every
output of the call (:class:`~dyncompile.runtime.decode.drafters.Verification`). :class:`TreeController` sizes the tree
from the measured verification cost curve and what branch nodes have bought so far.

Plan step params: ``target`` (decoder spec, see :mod:`dyncompile.runtime.decode.generate`), ``drafter``
(``{"kind": "model", "name": "external"|"split", "decoder": spec, "share_kv": [i...]|null,
"vocab": file key|null}``, ``{"kind": "prompt-lookup", "max_ngram": 3, "min_ngram": 1}``, ``{"kind": "eagle", ...}`` or
``{"kind": "lookahead", "window": 5, "ngram": 4, "guesses": 5}`` or ``{"kind": "medusa", "heads_model": file key, ...}``; ``"prompt_lookup": true`` on a model, eagle,
lookahead or medusa drafter makes it a hybrid with prompt lookup: :class:`~dyncompile.runtime.decode.drafters.HybridDrafter`,
prompt lookup's candidates only on matches of ``lookup_min_match`` tokens, and in chain rounds one draft-length
controller per part (prompt lookup's drafts cost nothing and run long; the other's are priced by ``draft_cost``);
the ``hybrid`` generation option runs one of its parts alone, ``False`` the other drafter, ``"prompt-lookup"`` prompt
lookup), ``draft``
(``initial``, ``min``, ``max``, ``adaptive``, ``alpha0``, ``verify_slope``, ``draft_cost``, ``stop_below``),
``generation``.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from dyncompile.errors import PlanError
from dyncompile.plan import TreePolicy
from dyncompile.runtime.decode.draft_tree import DraftTree, accept_greedy, accept_sampling
from dyncompile.runtime.decode.drafters import (
    Drafter,
    HybridDrafter,
    ModelDrafter,
    PromptLookupDrafter,
    TreeBudget,
    Verification,
)
from dyncompile.runtime.decode.generate import (
    GenerateStep,
    GenerationStats,
    PromptError,
    refuse_sampling_on_screened_logits,
)
from dyncompile.runtime.decode.kv_cache import KVDecoder
from dyncompile.runtime.registry import register_step
from dyncompile.runtime.rules.cost_model import (
    DEFAULT_VERIFY_SLOPE,
    best_draft_length,
    best_tree_extra,
    verify_cost,
)
from dyncompile.runtime.rules.sampling import probs_from_logits, sample_from

logger = logging.getLogger(__name__)

__all__ = ["DraftController", "SpeculativeGenerateStep", "TreeController", "verify_greedy", "verify_sampling"]


def verify_greedy(logits: np.ndarray, drafts: Sequence[int]) -> tuple[int, int]:
    """``(accepted, next_token)``: leading drafts equal to the target's argmax, then the target's own pick."""
    picks = np.argmax(logits, axis=-1)
    n = 0
    while n < len(drafts) and int(picks[n]) == drafts[n]:
        n += 1
    return n, int(picks[n])


def verify_sampling(
    p: np.ndarray, drafts: Sequence[int], qs: Sequence[np.ndarray] | None, rng: np.random.Generator
) -> tuple[int, int]:
    """Rejection sampling over the drafts: ``(accepted, next_token)`` distributed exactly as the target.

    Args:
        p: target probabilities ``[len(drafts) + 1, vocab]`` (float64, rows sum to 1).
        drafts: proposed tokens.
        qs: the drafter's distribution for each draft (full vocabulary), or ``None`` for point masses
            (deterministic proposals such as prompt lookup).
        rng: the generator.
    """
    for i, d in enumerate(drafts):
        pd = p[i, d]
        qd = 1.0 if qs is None else qs[i][d]
        if qd > 0 and rng.random() * qd < pd:  # accept with probability min(1, p/q)
            continue
        if qs is None:
            residual = p[i].copy()
            residual[d] = 0.0
        else:
            residual = np.maximum(p[i] - qs[i], 0.0)
        if not residual.sum() > 0:  # p == q up to rounding: acceptance was certain in exact arithmetic
            residual = p[i]
        return i, sample_from(residual, rng)
    return len(drafts), sample_from(p[len(drafts)], rng)


class DraftController:
    """Chooses the draft length of each round from the running acceptance rate and measured call costs."""

    def __init__(
        self,
        *,
        initial: int = 4,
        min_len: int = 1,
        max_len: int = 8,
        adaptive: bool = True,
        alpha0: float = 0.6,
        verify_slope: float = DEFAULT_VERIFY_SLOPE,
        draft_cost: float | None = None,
        decay: float = 0.9,
        probe_every: int = 8,
        verify_cost: dict[int, float] | None = None,
        timing: bool = False,
    ) -> None:
        """Set the draft length bounds and the adaptation rule."""
        if not 0 <= min_len <= max_len:
            raise PromptError(f"draft lengths need 0 <= min <= max, got min={min_len}, max={max_len}")
        self.initial = int(initial)
        self.min_len, self.max_len = int(min_len), int(max_len)
        self.adaptive = bool(adaptive)
        self.verify_slope = float(verify_slope)
        self.draft_cost = draft_cost
        self.decay = float(decay)
        self.probe_every = int(probe_every)
        self.verify_cost = {int(k): float(v) for k, v in (verify_cost or {}).items()}
        self.timing = bool(timing)
        a0 = min(max(float(alpha0), 0.01), 0.99)
        self.acc, self.rej = 2.0 * a0, 2.0 * (1.0 - a0)
        self.t_verify: dict[int, float] = {}
        self.t_draft: float | None = None
        self.rounds = 0
        self.since_probe = 0

    @property
    def alpha(self) -> float:
        """Estimated per-token acceptance probability."""
        return self.acc / (self.acc + self.rej)

    def _model_verify(self, s: int) -> float:
        """Cost of verifying ``s`` tokens relative to one, from the plan (measured at compile time) or the slope."""
        return verify_cost(s, self.verify_cost, self.verify_slope)

    def _t_verify(self, s: int) -> float | None:
        """Measured seconds to verify ``s`` tokens (timing mode), interpolated from what was seen."""
        if s in self.t_verify:
            return self.t_verify[s]
        if not self.t_verify:
            return None
        pts = sorted(self.t_verify.items())
        if len(pts) >= 2:
            xs = np.array([x for x, _ in pts], float)
            ys = np.array([y for _, y in pts], float)
            b, a = np.polyfit(xs, ys, 1)
            if b > 0:
                return float(a + b * s)
        x0, y0 = pts[0]
        return y0 / self._model_verify(x0) * self._model_verify(s)

    def next_length(self, limit: int) -> int:
        """Draft length for the next round, at most ``limit``."""
        limit = min(limit, self.max_len)
        if limit <= 0:
            return 0
        if not self.adaptive:
            return max(0, min(self.initial, limit))
        self.rounds += 1
        if self.rounds <= 1:
            return max(min(self.initial, limit), min(self.min_len, limit))
        alpha = min(self.alpha, 0.999)
        t1 = self._t_verify(1) if self.timing else None
        if t1 is not None:  # measured costs (opt-in: the schedule then depends on the machine's timings)
            td = self.t_draft if self.t_draft is not None else (self.draft_cost or 0.0) * t1

            def tv(s):
                return self._t_verify(s)
        else:  # the plan's cost model: deterministic given the seed
            t1, td = 1.0, float(self.draft_cost or 0.0)

            def tv(s):
                return self._model_verify(s)
        rate, best = best_draft_length(alpha, td, tv, range(max(1, self.min_len), limit + 1))
        if not rate > 1.0 / t1:  # no draft length beats the target alone (one token per verification)
            best = 0
        if best < self.min_len:
            best = min(self.min_len, limit)
        if best == 0:  # drafting does not pay now: probe once in a while so alpha can recover
            self.since_probe += 1
            if self.since_probe >= self.probe_every:
                self.since_probe = 0
                return 1
        return best

    def update(self, drafted: int, accepted: int, verify_tokens: int, verify_s: float, draft_s: float) -> None:
        """Record one round: tokens drafted and accepted, verified tokens and the seconds verify and draft took."""
        d = self.decay
        if drafted:
            self.acc = d * self.acc + accepted
            self.rej = d * self.rej + (1.0 if accepted < drafted else 0.0)
            per = draft_s / drafted
            self.t_draft = per if self.t_draft is None else 0.8 * self.t_draft + 0.2 * per
        old = self.t_verify.get(verify_tokens)
        self.t_verify[verify_tokens] = verify_s if old is None else 0.7 * old + 0.3 * verify_s


class TreeController:
    """Sizes each round's draft tree.

    The main chain's depth from :class:`DraftController` (acceptance along the
    first-child path), the branch nodes beside it from the measured verification cost curve ``v(s)`` and the
    tokens branch nodes have bought so far (:func:`~dyncompile.runtime.rules.cost_model.best_tree_extra`).

    Non-adaptive: every round asks for ``max_nodes`` nodes, depth ``max_depth``, ``branching`` children.
    """

    def __init__(self, chain: DraftController, *, max_nodes: int = 16, max_depth: int = 8, branching: int = 3,
                 adaptive: bool = True, gain0: float = 0.1, probe_every: int = 8) -> None:
        """Size draft trees within ``max_nodes`` / ``max_depth`` / ``branching``, on top of the chain controller."""
        self.chain = chain
        self.max_nodes, self.max_depth, self.branching = int(max_nodes), int(max_depth), int(branching)
        self.adaptive = bool(adaptive)
        # decayed tokens bought by branch nodes / branch nodes verified (prior: gain0 per node, weight 4 nodes)
        self.gain, self.extra = 4.0 * float(gain0), 4.0
        self.probe_every = int(probe_every)
        self.since_probe = 0
        self.last_extra = 0

    @property
    def gain_per_node(self) -> float:
        """Accepted tokens gained per extra tree node so far."""
        return self.gain / self.extra if self.extra > 0 else 0.0

    def next_budget(self, limit: int) -> TreeBudget:
        """The tree for the next round: depth at most ``limit`` (the tokens still wanted, minus one)."""
        limit = min(limit, self.max_depth)
        if limit <= 0:
            return TreeBudget(0, 0, 1)
        if not self.adaptive:
            return TreeBudget(self.max_nodes, limit, self.branching)
        gamma = self.chain.next_length(limit)
        room = self.max_nodes - gamma
        if gamma <= 0 or room <= 0 or self.branching <= 1:
            self.last_extra = 0
            return TreeBudget(gamma, gamma, 1)
        ctl = self.chain
        extras = sorted({0, 1, 2, 4, 8, 16, 32, 64, room} & set(range(room + 1)))
        _, b = best_tree_extra(min(ctl.alpha, 0.999), gamma, float(ctl.draft_cost or 0.0), 0.0,
                               self.gain_per_node, ctl._model_verify, extras)
        if b == 0 and self._probe():  # branches do not pay now: try them once in a while so the gain can recover
            b = room
        self.last_extra = b
        return TreeBudget(gamma + b, gamma, self.branching if b else 1)

    def _probe(self) -> bool:
        self.since_probe += 1
        if self.since_probe >= self.probe_every:
            self.since_probe = 0
            return True
        return False

    def update(self, tree: DraftTree, path: list[int], verify_s: float, draft_s: float) -> None:
        """Record one tree round: the accepted ``path`` and the seconds verify and draft took."""
        main = tree.main_chain_length()
        on_main, node = 0, 0
        for p in path[1:]:
            if tree.children[node] and tree.children[node][0] == p:
                on_main += 1
                node = p
            else:
                break
        accepted = len(path) - 1
        self.chain.update(main, on_main, main + 1, verify_s, draft_s)
        extra = tree.drafted - main
        if extra > 0:
            d = self.chain.decay
            self.gain = d * self.gain + (accepted - on_main)
            self.extra = d * self.extra + extra


def read_drafter_vocab(data: bytes, key: str, *, target_vocab: int | None) -> np.ndarray:
    """The drafter's vocabulary map (``.npy`` bytes of plan file ``key``): a 1-D int64 array of target token ids.

    Raises:
        PlanError: not a ``.npy`` file (pickled objects are never loaded), not 1-D integers, or ids outside
            ``[0, target_vocab)``.
    """
    try:
        vocab = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise PlanError(f"plan file {key!r} (the drafter vocab) is not a numpy .npy array of token ids ({e})") from None
    if not isinstance(vocab, np.ndarray) or vocab.ndim != 1 or not vocab.size:
        raise PlanError(f"plan file {key!r}: the drafter vocab must be a non-empty 1-D array of token ids, got shape "
                        f"{getattr(vocab, 'shape', None)}")
    if not np.issubdtype(vocab.dtype, np.integer):
        raise PlanError(f"plan file {key!r}: the drafter vocab must hold integer token ids, not {vocab.dtype}")
    if vocab.min() < 0:
        raise PlanError(f"plan file {key!r}: the drafter vocab holds negative token ids")
    if target_vocab is not None and vocab.max() >= target_vocab:
        raise PlanError(f"plan file {key!r}: the drafter vocab names token {int(vocab.max())}, outside the target's "
                        f"vocabulary of {target_vocab}")
    return vocab.astype(np.int64)


@register_step("speculative_generate")
class SpeculativeGenerateStep(GenerateStep):
    """Speculative decoding: the plan's drafter proposes, the target verifies (see the module docstring)."""

    def __init__(self, step, ctx) -> None:
        """Open the target and drafter sessions and set up the draft controllers from the plan."""
        super().__init__(step, ctx)  # self.params: SpeculativeParams, validated at load
        d = self.params.drafter
        self.draft_policy = self.params.draft
        self._said_graph = False  # the one INFO line on a CUDA-graph target (generate_ids)
        self.drafter: Drafter
        if d.kind == "prompt-lookup":
            self.drafter = PromptLookupDrafter(d.max_ngram, d.min_ngram)
        elif d.kind == "lookahead":  # Jacobi window + n-gram pool (runtime/decode/lookahead.py)
            from dyncompile.runtime.decode.lookahead import LookaheadDrafter

            self.drafter = LookaheadDrafter(d.window, d.ngram, d.guesses)
        elif d.kind == "medusa":  # Medusa heads on the target's last hidden state (runtime/decode/medusa.py)
            from dyncompile.runtime.decode.medusa import MedusaDrafter

            self.drafter = MedusaDrafter(ctx.session(d.heads_model), features=d.features, heads=d.heads, topk=d.topk,
                                         timer=self.timer)
        elif d.kind == "eagle":  # EAGLE head on the target's features (runtime/decode/eagle.py)
            from dyncompile.runtime.decode.eagle import EagleDecoder, EagleDrafter

            vocab = read_drafter_vocab(ctx.plan.content_of(d.vocab), d.vocab, target_vocab=self._target_vocab()) if d.vocab else None
            dec = EagleDecoder(ctx.session(d.decoder.model), d.decoder, feature_input=d.feature_input,
                               hidden_output=d.hidden_output, timer=self.timer, rollback=self.params.rollback)
            self.drafter = EagleDrafter(dec, features=d.features, vocab=vocab)
        else:  # "model" (the schema admits no other kind, and checks decoder and share_kv)
            vocab = None
            if d.vocab:  # the bytes load_plan read and hash-checked
                vocab = read_drafter_vocab(ctx.plan.content_of(d.vocab), d.vocab, target_vocab=self._target_vocab())
            dec = KVDecoder(ctx.session(d.decoder.model), d.decoder, role="drafter", timer=self.timer,
                            io_binding=self.params.io_binding, rollback=self.params.rollback,
                            rows_session=ctx.session(d.rows_model) if d.rows_model else None, rows_from=d.rows_from)
            self.drafter = ModelDrafter(dec, name=d.name, share_kv=d.share_kv, vocab=vocab)
        if d.prompt_lookup:  # hybrid: the context's n-gram matches share each round's tree
            self.drafter = HybridDrafter(PromptLookupDrafter(d.max_ngram, d.min_ngram), self.drafter,
                                         min_match=d.lookup_min_match)

    def _target_vocab(self) -> int | None:
        """The static width of the target's logits output, or None when the graph leaves it symbolic."""
        try:
            out = next(o for o in self.target.session.get_outputs() if o.name == self.target_spec.logits)
        except (AttributeError, StopIteration):
            return None
        dim = out.shape[-1] if getattr(out, "shape", None) else None
        return dim if isinstance(dim, int) and dim > 0 else None

    def _controller(self, options: dict[str, Any]) -> DraftController:
        """The plan's draft policy, overridden by ``draft_length``/``min_draft``/``max_draft``/``adaptive``."""
        dp = dataclasses.asdict(self.draft_policy)
        given = set()
        for opt, key in (("draft_length", "initial"), ("min_draft", "min"), ("max_draft", "max"),
                         ("adaptive", "adaptive"), ("adapt_to_timing", "timing")):
            if opt in options:
                dp[key] = options.pop(opt)
                given.add(opt)
        initial, max_len = int(dp["initial"]), int(dp["max"])
        if initial > max_len:
            if {"draft_length", "max_draft"} <= given:
                raise PromptError(f"draft_length={initial} is longer than max_draft={max_len}: the first draft length "
                                  "must be at most the longest")
            if "max_draft" in given:  # the caller's cap holds: the plan's first length is cut down to it
                initial = max_len
            else:  # a caller's (or the plan's) first length above the longest lifts the longest
                max_len = initial
        return DraftController(
            initial=initial,
            min_len=int(dp["min"]),
            max_len=max_len,
            adaptive=bool(dp["adaptive"]),
            alpha0=float(dp["alpha0"]),
            verify_slope=float(dp["verify_slope"]),
            draft_cost=dp["draft_cost"],
            verify_cost=dp["verify_cost"],
            timing=bool(dp["timing"]),
        )

    def _tree_controller(self, ctl: DraftController, options: dict[str, Any]) -> TreeController | None:
        """The plan's tree policy (``None``: chains), overridden by the call's ``tree`` option.

        ``tree``: ``False``, ``True`` or a dict of ``max_nodes``, ``max_depth``, ``branching``, ``adaptive``.
        """
        tp = self.draft_policy.tree
        opt = options.pop("tree", None)
        if opt is None and tp is None or opt is False:
            return None
        if tp is not None:
            d = dataclasses.asdict(tp)
        else:  # a plan compiled without a tree policy: the schema's defaults, no deeper than the chain policy's
            # longest draft (a prompt-lookup chain drafts up to 16: 16 nodes 16 deep would be a chain)
            d = dataclasses.asdict(TreePolicy())
            d["max_depth"] = min(ctl.max_len, d["max_depth"])
        if isinstance(opt, dict):
            unknown = set(opt) - set(d)
            if unknown:
                raise PromptError(f"unknown tree options {sorted(unknown)}; known: {sorted(d)}")
            d.update(opt)
        elif opt not in (None, True):
            raise PromptError(f"tree must be true, false or a dict of {sorted(d)}, not {opt!r}")
        for k in ("max_nodes", "max_depth", "branching"):
            if isinstance(d[k], bool) or not isinstance(d[k], int) or d[k] < 1:
                raise PromptError(f"tree {k} must be an integer >= 1, got {d[k]!r}")
        if not self.target.supports_trees and (d["max_nodes"] > d["max_depth"] and d["branching"] > 1):
            raise PromptError(
                "this plan's target has no 4-D attention bias input, so it cannot verify draft trees; compile with "
                "--passes explicit-attention,speculative{tree=true} (or run without tree)"
            )
        ctl.max_len = max(ctl.max_len, int(d["max_depth"]))
        return TreeController(ctl, max_nodes=d["max_nodes"], max_depth=d["max_depth"], branching=d["branching"],
                              adaptive=bool(d["adaptive"]))

    def _drafter_for(self, hybrid) -> Drafter:
        """The drafter of one call: the plan's, or one part of a hybrid plan's drafter alone.

        ``hybrid=True``: the plan's drafter; ``False``: a hybrid's model, EAGLE, lookahead or Medusa drafter;
        ``"prompt-lookup"``: its prompt lookup.
        """
        if hybrid is True:
            return self.drafter
        if hybrid is False or hybrid == "prompt-lookup":
            if not isinstance(self.drafter, HybridDrafter):
                raise PromptError(f"hybrid={hybrid!r} runs one part of a hybrid drafter, but this plan's drafter "
                                  f"({self.drafter.name}) is not one; leave the option out")
            return self.drafter.other if hybrid is False else self.drafter.lookup
        raise PromptError(f"hybrid must be True (the plan's drafter), False (a hybrid's other drafter alone) or "
                          f"'prompt-lookup' (its prompt lookup alone), got {hybrid!r}")

    def generate_ids(self, prompt_ids, max_new_tokens, *, sample, temperature, rng, speculative=True, **options):
        """Speculative decoding of up to ``max_new_tokens`` after ``prompt_ids``; returns the ids and statistics."""
        refuse_sampling_on_screened_logits(self.target_spec, sample)
        # per-call runtime options (the plan's defaults otherwise)
        inner = self.drafter.other if isinstance(self.drafter, HybridDrafter) else self.drafter
        decoders = [self.target] + ([inner.decoder] if isinstance(inner, ModelDrafter) else [])
        io_binding = options.pop("io_binding", None)
        io_binding = bool(self.params.io_binding if io_binding is None else io_binding)
        rollback = options.pop("rollback", None) or self.params.rollback
        if rollback not in ("mask", "copy"):
            raise PromptError(f"rollback must be 'mask' or 'copy', not {rollback!r}")
        kv_buffer = options.pop("kv_buffer", None)
        drafter_rows = options.pop("drafter_rows", True)
        if not isinstance(drafter_rows, bool):
            raise PromptError(f"drafter_rows must be True (the plan's int8 twin runs the drafter's calls of many rows, "
                              f"when it has one) or False (the drafter alone), got {drafter_rows!r}")
        for d in decoders:
            d.io_binding = io_binding
            d.use_rows = drafter_rows and d.rows_session is not None
            d.set_rollback(rollback)
            d.set_kv_buffer(kv_buffer)
        if not speculative:
            if options:
                options = {k: v for k, v in options.items() if k not in ("draft_length", "max_draft", "min_draft",
                                                                          "adaptive", "adapt_to_timing", "rollback",
                                                                          "tree", "stop_below", "hybrid",
                                                                          "drafter_rows")}
            return super().generate_ids(prompt_ids, max_new_tokens, sample=sample, temperature=temperature, rng=rng,
                                        kv_buffer=kv_buffer, **options)
        if self.target.cuda_graph and not self._said_graph:
            self._said_graph = True
            logger.info("the target replays one-token steps as a CUDA graph, but verification calls and the drafter run "
                        "without one: generate(..., speculative=False) may be faster (Qwen2.5-Coder-0.5B on an H200: "
                        "about 2x EAGLE-3's rate; bench-results/speculative-cuda/)")
        stop_when = options.pop("stop_when", None)
        drafter = self._drafter_for(options.pop("hybrid", True))
        stop_below = options.pop("stop_below", None)
        stop_below = self.draft_policy.stop_below if stop_below is None else stop_below
        if isinstance(stop_below, bool) or not isinstance(stop_below, (int, float)) or not 0.0 <= stop_below <= 1.0:
            raise PromptError(f"stop_below must be a probability in [0, 1] (1: one draft per round), got {stop_below!r}")
        inner.stop_below = float(stop_below)
        ctl = self._controller(options)
        tree_ctl = self._tree_controller(ctl, options)
        lookup_ctl = None
        if tree_ctl is None and isinstance(drafter, HybridDrafter):  # a hybrid's chains: one controller per part
            lookup_ctl = copy.deepcopy(ctl)
            lookup_ctl.draft_cost = 0.0  # prompt lookup drafts for free
        if options:
            raise PromptError(
                f"unknown generation options {sorted(options)}; known: draft_length, min_draft, max_draft, adaptive, "
                "adapt_to_timing, io_binding, kv_buffer, rollback, tree, stop_below, hybrid, drafter_rows"
            )
        stats = GenerationStats(prompt_tokens=len(prompt_ids), mode="sample" if sample else "greedy",
                                drafter=drafter.name)
        self.timer.reset()
        t_start = time.perf_counter()
        out = self._loop(prompt_ids, max_new_tokens, sample, temperature, rng, ctl, stats, tree_ctl, stop_when,
                         drafter, lookup_ctl)
        stats.seconds = time.perf_counter() - t_start
        stats.new_tokens = len(out)
        stats.target_seconds = self.timer.seconds.get("target", 0.0)
        stats.drafter_seconds = self.timer.seconds.get("drafter", 0.0)
        stats.drafter_calls = self.timer.calls.get("drafter", 0)
        return out, stats

    def _loop(self, prompt_ids, max_new_tokens, sample, temperature, rng, ctl: DraftController,
              stats: GenerationStats, tree_ctl: TreeController | None, stop_when, drafter: Drafter,
              lookup_ctl: DraftController | None = None) -> list[int]:
        target = self.target
        eos = set(self.gen.eos_token_ids)
        max_len = self.gen.max_length
        budget = max_new_tokens if max_len is None else min(max_new_tokens, max_len - len(prompt_ids))
        #: (drafted nodes, accepted drafts) of each round of the last call (the bench's tokens/call by tree size)
        self.last_rounds: list[tuple[int, int]] = []
        target.reset()
        drafter.reset(prompt_ids)
        t0 = time.perf_counter()
        logits = target.forward(prompt_ids, last=1)[-1]
        stats.prefill_seconds = time.perf_counter() - t0
        stats.target_calls = 1
        vocab_size = int(logits.shape[-1])
        tok = sample_from(probs_from_logits(logits, temperature), rng) if sample else int(np.argmax(logits))
        seq = [*prompt_ids, tok]
        out = [tok]
        if tok in eos:
            stats.stop_reason = "eos"
            return out
        if len(out) >= budget:
            stats.stop_reason = "max_new_tokens" if budget >= max_new_tokens else "max_length"
            return out
        if stop_when is not None and stop_when(out):
            stats.stop_reason = "stop_sequence"
            return out
        drafter.after_prefill(target)
        while True:
            remaining = budget - len(out)
            t_d = time.perf_counter()
            if tree_ctl is None:  # one chain per round
                part_ctl = ctl if lookup_ctl is None or drafter.part(seq) is not drafter.lookup else lookup_ctl
                gamma = part_ctl.next_length(remaining - 1)
                drafts, qs = drafter.propose(seq, gamma, sample=sample, temperature=temperature, rng=rng,
                                             vocab_size=vocab_size)
                tree = DraftTree.chain(seq[-1], drafts, qs if sample else None)
            else:
                tree = drafter.propose_tree(seq, tree_ctl.next_budget(remaining - 1), sample=sample,
                                            temperature=temperature, rng=rng, vocab_size=vocab_size)
                if tree.max_depth > remaining - 1:  # never overshoot the budget (a drafter ignoring max_depth)
                    keep = [i for i in range(len(tree)) if tree.depth[i] <= remaining - 1]
                    tree = DraftTree([tree.tokens[i] for i in keep], [keep.index(tree.parents[i]) if i else -1
                                                                      for i in keep], [tree.qs[i] for i in keep])
            t_d = time.perf_counter() - t_d
            tv_before = self.timer.seconds.get("target", 0.0)
            logits = target.forward(tree.tokens, tree=tree)
            outputs = dict(target.last_outputs)
            t_v = self.timer.seconds.get("target", 0.0) - tv_before
            path, nxt = _accept(tree, logits, sample, temperature, rng)
            n = len(path) - 1
            stats.rounds += 1
            stats.target_calls += 1
            stats.drafted += tree.drafted
            stats.accepted += n
            stats.draft_lengths[tree.drafted] = stats.draft_lengths.get(tree.drafted, 0) + 1
            self.last_rounds.append((tree.drafted, n))
            if tree_ctl is None:
                part_ctl.update(tree.drafted, n, len(tree), t_v, t_d)
            else:
                tree_ctl.update(tree, path, t_v, t_d)
            new, stop = _clip([*(tree.tokens[i] for i in path[1:]), nxt], len(out), eos, budget, max_new_tokens)
            seq.extend(new)
            out.extend(new)
            if not stop and stop_when is not None and stop_when(out):
                stop = "stop_sequence"
            if stop:
                stats.stop_reason = stop
                return out
            target.keep_path(len(tree), path)
            drafter.after_verify(Verification(seq, len(seq) - 1, tree, path, outputs, target))


def _accept(tree: DraftTree, logits: np.ndarray, sample: bool, temperature: float,
            rng: np.random.Generator) -> tuple[list[int], int]:
    """The accepted root-to-node path of ``tree`` and the target's next token after it."""
    if tree.is_chain:  # the chain verifiers (the tree ones reduce to them on a chain)
        drafts = tree.tokens[1:]
        if sample:
            n, nxt = verify_sampling(probs_from_logits(logits, temperature), drafts,
                                     None if not drafts or tree.qs[1] is None else tree.qs[1:], rng)
        else:
            n, nxt = verify_greedy(logits, drafts)
        return list(range(n + 1)), nxt
    if sample:
        return accept_sampling(tree, probs_from_logits(logits, temperature), rng)
    return accept_greedy(tree, logits)


def _clip(new: list[int], done: int, eos: set[int], budget: int, max_new_tokens: int) -> tuple[list[int], str]:
    """The round's new tokens cut at the first eos and at the budget (``done`` tokens already out), and why."""
    stop = ""
    for j, t in enumerate(new):
        if t in eos:
            new = new[: j + 1]
            stop = "eos"
            break
    if done + len(new) >= budget:
        new = new[: budget - done]
        stop = stop or ("max_new_tokens" if budget >= max_new_tokens else "max_length")
    return new, stop
