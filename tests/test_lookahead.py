"""Lookahead decoding and the hybrid drafter: the lookahead tree (Jacobi window as chains + pool n-grams), one Jacobi
step and the n-gram harvest from the target's logits, tree merging (sampled nodes never merged), the pass and plan
schema, greedy output token-identical to the target alone (tiny decoders, and SmolLM2), and exact sampling
(chi-square against the exact joint distribution, with a negative control)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from test_draft_tree import BRANCHY, _accept_without_residual, _exact_joint, _sample_joint
from test_speculative import EOS_UNUSED, PROMPTS, VOCAB, chi_square_p

import dyncompile
import dyncompile.runtime.decode.speculative as runtime_speculative
from dyncompile.errors import PlanError
from dyncompile.models.synthetic_decoder import tiny_decoder, write_decoder_dir, write_word_tokenizer
from dyncompile.passes.compiler import compile_model
from dyncompile.passes.speculative import DrafterError
from dyncompile.plan import DrafterParams
from dyncompile.plan._typed import from_json
from dyncompile.runtime.decode.draft_tree import DraftTree
from dyncompile.runtime.decode.drafters import (
    Drafter,
    HybridDrafter,
    PromptLookupDrafter,
    TreeBudget,
    Verification,
    merge_tree,
)
from dyncompile.runtime.decode.lookahead import LookaheadDrafter

LA = "explicit-attention,speculative{measure=false}"


# ------------------------------------------------------------------------------------------- the drafter alone


def _verify(d: LookaheadDrafter, tree: DraftTree, logits: np.ndarray) -> None:
    target = SimpleNamespace(spec=SimpleNamespace(logits="logits"))
    d.after_verify(Verification([0], 0, tree, [0], {"logits": logits}, target))


def test_lookahead_tree_is_the_staggered_window_plus_pool_ngrams():
    d = LookaheadDrafter(window=3, ngram=3, guesses=2)
    d.reset([5])
    d.levels = [[1, 2, 3], [4, 5, 6]]
    d.pool = {9: {(7, 8): None, (1, 7): None}}  # most recent last: (1, 7) is tried first
    tree = d.propose_tree([0, 9], TreeBudget(64, 8, 3), sample=False, temperature=1.0, rng=None, vocab_size=16)
    # pool: 9 -> 1 -> 7 and 9 -> 7 -> 8; window level 0 reuses the pool's "1" (same path, same context)
    assert tree.tokens[:5] == [9, 1, 7, 7, 8]
    cols = d._cells
    assert [[tree.tokens[i] for i in c] for c in cols] == [[1, 4], [2, 5], [3, 6]]
    assert cols[0][0] == 1  # merged with the pool's node
    assert [[tree.depth[i] for i in c] for c in cols] == [[1, 2], [2, 3], [3, 4]]  # cell (l, j) at depth j + l + 1
    assert tree.parents[cols[1][0]] == cols[0][0] and tree.parents[cols[2][1]] == cols[2][0]
    # the budget: no column whose top cell would sit deeper than max_depth, no more nodes than max_nodes
    d.pool = {}
    small = d.propose_tree([0, 9], TreeBudget(64, 3, 3), sample=False, temperature=1.0, rng=None, vocab_size=16)
    assert len(d._cells) == 2 and small.max_depth == 3
    d.propose_tree([0, 9], TreeBudget(3, 8, 3), sample=False, temperature=1.0, rng=None, vocab_size=16)
    assert len(d._cells) == 1


def test_jacobi_step_and_ngram_harvest_from_the_targets_logits():
    d = LookaheadDrafter(window=2, ngram=3, guesses=1)
    d.reset([5])
    d.levels = [[1, 2]]
    tree = d.propose_tree([0, 9], TreeBudget(64, 8, 3), sample=False, temperature=1.0, rng=None, vocab_size=16)
    logits = np.zeros((len(tree), 16))
    for col, g in zip(d._cells, (11, 12)):
        logits[col[-1], g] = 1.0
    _verify(d, tree, logits)
    assert d.levels == [[1, 2], [11, 12]] and d.pool == {}  # a level added, nothing harvested yet
    tree = d.propose_tree([0, 9], TreeBudget(64, 8, 3), sample=False, temperature=1.0, rng=None, vocab_size=16)
    logits = np.zeros((len(tree), 16))
    for col, g in zip(d._cells, (13, 14)):
        logits[col[-1], g] = 1.0
    _verify(d, tree, logits)
    assert d.pool == {1: {(11, 13): None}, 2: {(12, 14): None}}  # each column's diagonal + its new guess
    assert d.levels == [[11, 12], [13, 14]]  # the oldest level dropped
    d.propose_tree([0, 1], TreeBudget(64, 8, 3), sample=False, temperature=1.0, rng=None, vocab_size=16)
    # another tree (e.g. rebuilt by the runtime) teaches the window nothing
    _verify(d, DraftTree.chain(1, [2]), np.zeros((2, 16)))
    assert d.levels == [[11, 12], [13, 14]]


def test_merge_reuses_point_masses_and_keeps_sampled_nodes_apart():
    dst = DraftTree.chain(0, [1, 2])
    q = np.full(4, 0.25)
    src = DraftTree([0, 1, 3, 1], [-1, 0, 1, 0], [None, None, None, q])
    assert merge_tree(dst, src, 8) == 2
    assert dst.tokens == [0, 1, 2, 3, 1] and dst.parents == [-1, 0, 1, 1, 0] and dst.qs[4] is q
    small = DraftTree.chain(0, [])
    assert merge_tree(small, src, 1) == 1 and small.tokens == [0, 1]  # no room for the rest


def test_hybrid_tree_holds_the_context_matches_and_the_other_drafters_candidates():
    la = LookaheadDrafter(window=3, ngram=2, guesses=1)
    h = HybridDrafter(PromptLookupDrafter(3, 1), la)
    seq = [1, 2, 3, 1, 2, 4, 1, 2]
    h.reset(seq[:-1])
    tree = h.propose_tree(seq, TreeBudget(12, 6, 3), sample=False, temperature=1.0, rng=None, vocab_size=16)
    assert tree.drafted <= 12 and {tree.tokens[c] for c in tree.children[0]} >= {3, 4}  # both matches
    assert len(la._cells) == 3 and la._tree is tree  # the window's cells, indices valid in the merged tree
    chain = h.propose_tree(seq, TreeBudget(4, 4, 1), sample=False, temperature=1.0, rng=None, vocab_size=16)
    assert chain.is_chain and chain.tokens[1:3] == [4, 1]  # a chain budget: prompt lookup's match alone


class _FixedChain(Drafter):
    """A stand-in for a model drafter: always the same chain."""

    name = "fixed"

    def __init__(self, chain):
        self.chain = chain

    def propose(self, seq, n, *, sample, temperature, rng, vocab_size):
        return self.chain[:n], None


def test_hybrid_takes_prompt_lookup_only_on_matches_of_min_match_tokens():
    """A match shorter than ``min_match`` leaves the round to the other drafter; a long enough one to prompt lookup."""
    kw = dict(sample=False, temperature=1.0, rng=None, vocab_size=16)
    seq = [1, 2, 3, 1, 2, 4, 1, 2]  # suffix (1, 2) seen before (followed by 4), (4, 1, 2) never
    for min_match, part, chain in ((1, "lookup", [4, 1, 2]), (2, "lookup", [4, 1, 2]), (3, "other", [9, 9, 9])):
        h = HybridDrafter(PromptLookupDrafter(3, 1), _FixedChain([9, 9, 9]), min_match=min_match)
        h.reset(seq[:-1])
        assert h.part(seq) is getattr(h, part), min_match
        assert h.propose(seq, 3, **kw)[0] == chain, min_match
        tree = h.propose_tree(seq, TreeBudget(3, 3, 1), **kw)  # a chain budget: the same choice
        assert tree.is_chain and tree.tokens[1:] == chain, min_match
    h = HybridDrafter(PromptLookupDrafter(3, 1), _FixedChain([9, 9, 9]), min_match=3)
    longer = [*seq, 4, 1, 2]  # now (4, 1, 2) has occurred before: a three-token match
    h.reset(longer[:-1])
    assert h.part(longer) is h.lookup and h.lookup.match_size(longer) == 3
    assert h.propose(longer, 3, **kw)[0] == [4, 1, 2]
    # prompt lookup alone keeps its own min_ngram: a one-token match still drafts
    assert PromptLookupDrafter(3, 1).propose([5, 7, 5], 2, **kw)[0] == [7, 5]


def test_hybrid_chain_keeps_one_draft_length_controller_per_part(la_tiny, monkeypatch):
    """Rounds prompt lookup drafts and rounds the model drafts adapt their lengths apart (two controllers), and the
    output stays the target's."""
    seen = []
    real = runtime_speculative.DraftController.next_length

    def spy(self, limit):
        seen.append(id(self))
        return real(self, limit)

    monkeypatch.setattr(runtime_speculative.DraftController, "next_length", spy)
    m = dyncompile.load(la_tiny["plans"]["hybrid-model"])
    prompt = [*PROMPTS[0], *PROMPTS[0]]  # a repeat: prompt lookup has three-token matches
    ref = m.generate(prompt, max_new_tokens=30, speculative=False)
    res = m.generate(prompt, max_new_tokens=30, tree=False)
    assert res.token_ids == ref.token_ids
    assert len(set(seen)) == 2  # both parts drafted, each through its own controller
    seen.clear()
    m.generate(prompt, max_new_tokens=30, tree=False, hybrid=False)  # a single drafter: one controller
    assert len(set(seen)) == 1


# ------------------------------------------------------------------------------------------- pass and schema


def test_plan_schema_checks_lookahead_and_hybrid_fields():
    ok = from_json(DrafterParams, {"kind": "lookahead", "window": 7, "ngram": 3, "guesses": 2}, "d")
    assert (ok.window, ok.ngram, ok.guesses, ok.prompt_lookup) == (7, 3, 2, False)
    with pytest.raises(PlanError, match="prompt_lookup"):
        from_json(DrafterParams, {"kind": "prompt-lookup", "prompt_lookup": True}, "d")
    with pytest.raises(PlanError, match="ngram"):
        from_json(DrafterParams, {"kind": "lookahead", "ngram": 1}, "d")
    with pytest.raises(PlanError, match="lookup_min_match"):
        from_json(DrafterParams, {"kind": "lookahead", "prompt_lookup": True, "lookup_min_match": 4}, "d")
    assert from_json(DrafterParams, {"kind": "lookahead", "prompt_lookup": True}, "d").lookup_min_match == 1
    with pytest.raises(PlanError, match="no model"):
        from_json(DrafterParams, {"kind": "lookahead", "decoder": {"model": "m", "kv": [{"past": "a", "present": "b"}]}},
                  "d")


@pytest.fixture(scope="module")
def la_tiny(module_tmp):
    root = module_tmp("lookahead")
    target = write_decoder_dir(root / "target", tiny_decoder(num_layers=3, vocab=VOCAB, seed=0), eos=EOS_UNUSED)
    write_word_tokenizer(root / "target", VOCAB)
    draft = write_decoder_dir(root / "draft", tiny_decoder(num_layers=1, vocab=VOCAB, seed=1), eos=EOS_UNUSED)
    write_word_tokenizer(root / "draft", VOCAB)
    hybrid = "explicit-attention,speculative{measure=false,hybrid=true,tree=true,tree_adaptive=false,tree_nodes=12}"
    plans = {
        "lookahead": compile_model(target, LA, root / "la", drafter="lookahead", verify=True).plan_dir,
        "hybrid-lookahead": compile_model(target, LA.replace("}", ",hybrid=true}"), root / "hla", drafter="lookahead",
                                          verify=True).plan_dir,
        "hybrid-model": compile_model(target, hybrid, root / "hm", drafter=str(draft), verify=True).plan_dir,
    }
    return {"root": root, "target": target, "plans": plans}


def test_lookahead_plan_records_the_window_and_a_fixed_tree(la_tiny):
    step = json.loads((la_tiny["plans"]["lookahead"] / "plan.json").read_text())["steps"][0]
    assert step["drafter"] == {"kind": "lookahead", "window": 5, "ngram": 4, "guesses": 5}
    assert step["draft"]["tree"] == {"adaptive": False, "branching": 6, "max_depth": 7, "max_nodes": 30}
    hy = json.loads((la_tiny["plans"]["hybrid-lookahead"] / "plan.json").read_text())
    assert hy["steps"][0]["drafter"]["prompt_lookup"] is True and hy["steps"][0]["draft"]["tree"]["max_nodes"] == 60
    assert hy["policy"]["speculative"]["drafter"] == "prompt-lookup+lookahead"
    hm_step = json.loads((la_tiny["plans"]["hybrid-model"] / "plan.json").read_text())["steps"][0]
    hm = hm_step["drafter"]
    assert hm["kind"] == "model" and hm["prompt_lookup"] is True
    assert hm["lookup_min_match"] == hm["max_ngram"] == 3  # the hybrid's default: full n-gram matches only
    assert hm_step["draft"]["max"] == 16  # prompt lookup's longest chain (a model drafter alone: 8)
    assert hy["steps"][0]["drafter"]["lookup_min_match"] == 1  # beside lookahead every match counts


def test_lookahead_needs_explicit_attention_and_hybrid_needs_another_drafter(la_tiny, tmp_path):
    with pytest.raises(DrafterError, match="explicit-attention"):
        compile_model(la_tiny["target"], "speculative{measure=false}", tmp_path / "x", drafter="lookahead", opt_level=0)
    with pytest.raises(DrafterError, match="hybrid=true"):
        compile_model(la_tiny["target"], "speculative{measure=false,hybrid=true}", tmp_path / "y",
                      drafter="prompt-lookup")
    with pytest.raises(DrafterError, match="lookup_min_match"):
        compile_model(la_tiny["target"], "explicit-attention,speculative{measure=false,hybrid=true,lookup_min_match=4}",
                      tmp_path / "z", drafter="lookahead")


def test_lookahead_pass_second_run_reports_unmodified(la_tiny):
    import onnx_ir as ir

    from dyncompile.passes.speculative import ExposeAttentionMaskPass, SpeculativePass

    model = ir.load(str(la_tiny["target"]))
    ExposeAttentionMaskPass()(model)
    p = SpeculativePass("lookahead", measure=False, window=3, ngram=3, guesses=2, hybrid=True,
                        generation={"eos_token_ids": [EOS_UNUSED]})
    assert p(model).modified
    assert not p(model).modified


# ------------------------------------------------------------------------------------------- runtime, end to end


@pytest.mark.parametrize("kind", ["lookahead", "hybrid-lookahead", "hybrid-model"])
def test_lookahead_and_hybrid_token_identical(la_tiny, kind):
    m = dyncompile.load(la_tiny["plans"][kind])
    accepted = 0
    for prompt in [*PROMPTS, BRANCHY]:
        ref = m.generate(prompt, max_new_tokens=40, speculative=False)
        res = m.generate(prompt, max_new_tokens=40)
        assert res.token_ids == ref.token_ids, (kind, prompt)
        assert res.stats.target_calls == res.stats.rounds + 1
        accepted += res.stats.accepted
        if kind != "hybrid-model":  # the window really was verified: trees larger than its first level
            assert max(s for s, _ in m.handlers[-1].last_rounds) > 5
    assert accepted > 20  # drafts were accepted (the tiny target repeats itself: the pool and matches pay)


@pytest.fixture(scope="module")
def sampling_la_plans(module_tmp):
    root = module_tmp("la_sampling")
    t = write_decoder_dir(root / "t", tiny_decoder(num_layers=2, vocab=8, seed=0, logit_scale=1.5), eos=EOS_UNUSED)
    d = write_decoder_dir(root / "d", tiny_decoder(num_layers=1, vocab=8, seed=1, logit_scale=1.5), eos=EOS_UNUSED)
    hy = compile_model(t, "explicit-attention,speculative{tree=true,tree_nodes=8,tree_depth=2,tree_adaptive=false,"
                       "measure=false,hybrid=true}", root / "hy", drafter=str(d)).plan_dir
    hla = compile_model(t, "explicit-attention,speculative{measure=false,window=3,ngram=2,guesses=3,hybrid=true}",
                        root / "hla", drafter="lookahead").plan_dir
    return {"hybrid-model": dyncompile.load(hy), "hybrid-lookahead": dyncompile.load(hla)}


#: 8 tokens each followed by two others: prompt lookup's trie branches whatever is sampled first
BRANCHY8 = [t for x in range(8) for t in (x, (x + 1) % 8, x, (x + 3) % 8)]


@pytest.mark.parametrize("kind", ["hybrid-lookahead", "hybrid-model"])
def test_lookahead_and_hybrid_sampling_reproduce_the_target_distribution(sampling_la_plans, kind):
    """Tokens 2-3 of seeded generations come from one round verifying the hybrid-lookahead tree (prompt lookup's trie
    with the lookahead window's cells merged in) or the hybrid-model tree (the trie merged with a sampled model chain
    and its top-k); their joint distribution matches the target's."""
    m = sampling_la_plans[kind]
    expected = _exact_joint(m, BRANCHY8, 1.0)
    counts, branched = _sample_joint(m, BRANCHY8, 1000)
    assert branched > 750  # the rounds really verified trees
    assert chi_square_p(counts, expected) > 1e-3


def test_lookahead_chi_square_detects_a_wrong_sampler(sampling_la_plans, monkeypatch):
    """Negative control: the same runs with the residual-free sampler are rejected."""
    m = sampling_la_plans["hybrid-lookahead"]
    expected = _exact_joint(m, BRANCHY8, 1.0)
    monkeypatch.setattr(runtime_speculative, "accept_sampling", _accept_without_residual)
    counts, _ = _sample_joint(m, BRANCHY8, 800)
    assert chi_square_p(counts, expected) < 1e-6


@pytest.mark.slow
def test_lookahead_and_hybrid_token_identical_on_smollm2(smollm2, module_tmp):
    from test_speculative_smollm2 import _prompts

    root = module_tmp("smol_lookahead")
    session = {"session.intra_op.allow_spinning": "0"}
    la = compile_model(smollm2.onnx_path, LA.replace("}", ",hybrid=true,window=4,ngram=3,guesses=3}"), root / "hla",
                       drafter="lookahead", progress=False, opt_level=0).plan_dir
    m = dyncompile.load(la, session_config=session)
    harvested = 0
    for prompt, chat in _prompts():
        ref = m.generate(prompt, max_new_tokens=24, chat=chat, speculative=False)
        res = m.generate(prompt, max_new_tokens=24, chat=chat)
        assert res.token_ids == ref.token_ids, (prompt[:40], res.text, ref.text)
        harvested += m.handlers[-1].drafter.other.harvested
    assert harvested > 0


# ------------------------------------------------------------------------------------ the verification cost curve


def test_verify_curve_reports_its_thread_count(tmp_path):
    """``bench.generate curve --threads N`` times the graph in a session of N intra-op threads and says so; without
    it the session keeps ONNX Runtime's default (0: one thread per core), the compile-time probe's setting."""
    from dyncompile.passes.speculative.probe import session_for
    from dyncompile.tools.bench.generate import verify_curve_main

    model = tiny_decoder(num_layers=1, vocab=VOCAB, seed=0)
    path = write_decoder_dir(tmp_path / "m", model, eos=EOS_UNUSED)
    assert session_for(model, 1).get_session_options().intra_op_num_threads == 1
    assert session_for(model).get_session_options().intra_op_num_threads == 0
    assert verify_curve_main([str(path), "--sizes", "2,4", "--past", "6", "--repeats", "1", "--threads", "1",
                              "--report-dir", str(tmp_path), "--name", "c"]) == 0
    report = json.loads((tmp_path / "c.json").read_text())
    assert report["threads"] == 1 and report["model"] == "model.onnx" and report["past"] == 6
    assert sorted(report["verify_cost"], key=int) == ["1", "2", "4"] and report["verify_cost"]["1"] == 1.0
    costs = [report["verify_cost"][k] for k in ("1", "2", "4")]
    assert costs == sorted(costs)  # kept monotone
