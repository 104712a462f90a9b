"""Draft trees: the tree structure and its attention mask, greedy and sampling acceptance (chi-square against the
exact distribution, with a negative control), the explicit-attention pass (golden: structure, ORT_DISABLE_ALL
logits of chains equal the original graph's, tree logits equal per-branch chain logits, does-not-fire, second
run, full_check), the KV cache keeping only the accepted path, and every drafter x {chain, tree} token-identical
to the target alone on tiny decoders."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from test_speculative import EOS_UNUSED, PROMPTS, VOCAB, chi_square_p

import dyncompile
import dyncompile.runtime.decode.speculative as runtime_speculative
from dyncompile.models.synthetic import tiny_encoder_classifier
from dyncompile.models.synthetic_decoder import tiny_decoder, write_decoder_dir, write_word_tokenizer
from dyncompile.passes.compiler import compile_model
from dyncompile.passes.speculative import DrafterError, ExposeAttentionMaskPass
from dyncompile.runtime.decode.draft_tree import DraftTree, accept_greedy, accept_sampling
from dyncompile.runtime.decode.generate import PromptError
from dyncompile.runtime.decode.kv_cache import BIAS_NEG
from dyncompile.runtime.rules.sampling import probs_from_logits, sample_from

NEG = BIAS_NEG


# ------------------------------------------------------------------------------------------- the tree


def test_tree_depths_mask_positions_and_paths():
    # root 5 -> 1 -> 2 ; root -> 3 -> 4
    t = DraftTree([5, 1, 2, 3, 4], [-1, 0, 1, 0, 3])
    assert t.depth == [0, 1, 2, 1, 2] and t.children == [[1, 3], [2], [], [4], []]
    assert t.path_to(4) == [0, 3, 4] and t.main_chain_length() == 2 and not t.is_chain and t.drafted == 4
    bias = t.attention(np.array([True, False, True]), NEG)[0, 0]
    assert bias.shape == (5, 8)
    assert (bias[:, [0, 2]] == 0).all() and (bias[:, 1] == NEG).all()  # the masked past slot is hidden from all
    visible = bias[:, 3:] == 0
    assert visible.tolist() == [
        [True, False, False, False, False],
        [True, True, False, False, False],
        [True, True, True, False, False],
        [True, False, False, True, False],  # node 3 does not see its sibling branch
        [True, False, False, True, True],
    ]
    assert t.positions(7).tolist() == [[7, 8, 9, 8, 9]]
    c = DraftTree.chain(5, [1, 2])
    assert c.is_chain and c.parents == [-1, 0, 1] and c.positions(3).tolist() == [[3, 4, 5]]
    for tokens, parents in (([1, 2], [-1, 1]), ([1, 2], [0, 0]), ([1], [-1, 0])):
        with pytest.raises(ValueError):
            DraftTree(tokens, parents)


def test_greedy_acceptance_follows_the_targets_argmax_through_branches():
    t = DraftTree([5, 1, 2, 3, 4], [-1, 0, 1, 0, 3])
    logits = np.zeros((5, 10))
    logits[0, 3] = logits[3, 4] = logits[4, 9] = 1  # root picks 3 (the second branch), then 4, then 9
    assert accept_greedy(t, logits) == ([0, 3, 4], 9)
    logits[0, 3], logits[0, 7] = 0, 1  # no child is the argmax: nothing accepted, the target's 7
    assert accept_greedy(t, logits) == ([0], 7)


# ------------------------------------------------------------------------------------------- exact sampling


def _synthetic_target(vocab: int, seed: int):
    rng = np.random.default_rng(seed)
    p1 = rng.dirichlet(np.full(vocab, 0.7))
    p2 = rng.dirichlet(np.full(vocab, 0.7), size=vocab)  # p2[a] = P(x2 | x1 = a)
    q1 = rng.dirichlet(np.full(vocab, 0.7))  # the drafter's (wrong) distributions
    q2 = rng.dirichlet(np.full(vocab, 0.7), size=vocab)
    return p1, p2, q1, q2


def _two_tokens(accept, p1, p2, q1, q2, rng) -> tuple[int, int]:
    """Tokens 1 and 2 of a generation whose first round verifies a 2-level tree: at each level one child sampled
    from the drafter's q, then the drafter's two next-best tokens as point masses (what ModelDrafter builds)."""
    tree = DraftTree([0], [-1])
    a = sample_from(q1, rng)
    firsts = [tree.add(0, a, q1)]
    for t in [int(x) for x in np.argsort(-q1) if x != a][:2]:
        firsts.append(tree.add(0, t))
    for f in firsts:
        x1 = tree.tokens[f]
        b = sample_from(q2[x1], rng)
        tree.add(f, b, q2[x1])
        tree.add(f, int(np.argsort(-q2[x1])[0] if np.argsort(-q2[x1])[0] != b else np.argsort(-q2[x1])[1]))
    p = np.zeros((len(tree), len(p1)))
    p[0] = p1
    for i in range(1, len(tree)):
        p[i] = p2[tree.tokens[i]] if tree.depth[i] == 1 else p1  # depth-2 rows are not used for tokens 1-2
    path, nxt = accept(tree, p, rng)
    toks = [tree.tokens[i] for i in path[1:]] + [nxt]
    if len(toks) == 1:  # the round gave one token: the next round's first token comes from p2
        toks.append(sample_from(p2[toks[0]], rng))
    return toks[0], toks[1]


def _joint_counts(accept, n, seed=0, vocab=5):
    p1, p2, q1, q2 = _synthetic_target(vocab, seed)
    rng = np.random.default_rng(seed + 100)
    counts = np.zeros((vocab, vocab))
    for _ in range(n):
        a, b = _two_tokens(accept, p1, p2, q1, q2, rng)
        counts[a, b] += 1
    return counts, p1[:, None] * p2


def _accept_without_residual(tree, p, rng):
    """A deliberately wrong multi-candidate sampler: siblings are tried against the full p (no residual update),
    which over-weights the candidates."""
    path = [0]
    while True:
        node = path[-1]
        nxt = None
        for c in tree.children[node]:
            t, q = tree.tokens[c], tree.qs[c]
            r = 1.0 if q is None else float(q[t])
            if r > 0 and rng.random() * r < p[node][t]:
                nxt = c
                break
        if nxt is None:
            return path, sample_from(p[node], rng)
        path.append(nxt)


@pytest.mark.parametrize("seed", [0, 1])
def test_multi_candidate_rejection_sampling_keeps_the_target_distribution(seed):
    counts, exact = _joint_counts(accept_sampling, 20000, seed)
    assert chi_square_p(counts, exact) > 1e-3


def test_chi_square_detects_a_sampler_without_residuals():
    counts, exact = _joint_counts(_accept_without_residual, 20000, 0)
    assert chi_square_p(counts, exact) < 1e-6


# ------------------------------------------------------------------------------------------- the pass


def _session(model: ir.Model, tmp_path, name: str):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    path = tmp_path / f"{name}.onnx"
    ir.save(model, path, external_data=f"{name}.onnx.data")  # SmolLM2's weights stay external
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _past_names(sess):
    return [i.name for i in sess.get_inputs() if i.name.startswith("past_key_values")]


def _run(sess, ids, past, past_len, *, mask=None, bias=None, pos=None):
    """Logits and presents of ``ids`` on ``past`` (list of arrays, or None for empty)."""
    names = _past_names(sess)
    shape = {i.name: i.shape for i in sess.get_inputs()}
    n = len(ids)
    feeds = {"input_ids": np.asarray([ids], np.int64),
             "position_ids": np.arange(past_len, past_len + n)[None] if pos is None else pos}
    if "attention_mask" in shape:
        feeds["attention_mask"] = np.ones((1, past_len + n), np.int64) if mask is None else mask
    if "attention_bias" in shape:
        if bias is None:
            bias = DraftTree.chain(ids[0], ids[1:]).attention(np.ones(past_len, bool), NEG)
        feeds["attention_bias"] = bias
    for k, name in enumerate(names):
        if past is None:
            h, d = shape[name][1], shape[name][3]
            feeds[name] = np.zeros((1, h, 0, d), np.float32)
        else:
            feeds[name] = past[k]
    outs = sess.run(None, feeds)
    return outs[0][0], outs[1:]


def _check_explicit_attention(model: ir.Model, prompt, chain, tree: DraftTree, atol: float, tree_atol: float,
                              tmp_path):
    before = _session(model, tmp_path, "before")
    explicit = ir.load(tmp_path / "before.onnx")
    result = ExposeAttentionMaskPass()(explicit)
    assert result.modified
    inputs = [v.name for v in explicit.graph.inputs]
    assert "attention_bias" in inputs and "attention_mask" not in inputs and "position_ids" in inputs
    rec = json.loads(explicit.metadata_props["dyncompile.explicit_attention"])
    assert rec["input"] == "attention_bias" and rec["removed_inputs"] == ["attention_mask"]
    assert not ExposeAttentionMaskPass()(explicit).modified  # second run
    after = _session(explicit, tmp_path, "after")
    onnx.checker.check_model(str(tmp_path / "after.onnx"), full_check=True)
    # prefill + a chain on top of the cache: the same logits as the original graph
    la, pa = _run(before, prompt, None, 0)
    lb, pb = _run(after, prompt, None, 0)
    np.testing.assert_allclose(lb, la, atol=atol, rtol=0)
    ca, _ = _run(before, chain, pa, len(prompt))
    cb, _ = _run(after, chain, pb, len(prompt))
    np.testing.assert_allclose(cb, ca, atol=atol, rtol=0)
    # a tree in one call: each node's logits are those of its root-to-node path run as a chain
    lt, _ = _run(after, tree.tokens, pb, len(prompt), bias=tree.attention(np.ones(len(prompt), bool), NEG),
                 pos=tree.positions(len(prompt)))
    for leaf in range(len(tree)):
        path = tree.path_to(leaf)
        lc, _ = _run(before, [tree.tokens[i] for i in path], pa, len(prompt))
        np.testing.assert_allclose(lt[leaf], lc[-1], atol=tree_atol, rtol=0)
    return explicit


def test_explicit_attention_on_a_tiny_decoder(tmp_path):
    m = tiny_decoder(num_layers=2, vocab=VOCAB, seed=0)
    tree = DraftTree([3, 4, 5, 6, 7, 8], [-1, 0, 1, 0, 3, 0])
    out = _check_explicit_attention(m, [1, 2, 3, 4, 5], [3, 9, 10], tree, atol=1e-5, tree_atol=1e-5, tmp_path=tmp_path)
    ops = {n.op_type for n in out.graph}
    assert "Range" not in ops and "LessOrEqual" not in ops  # the mask construction is gone


def test_explicit_attention_on_smollm2(smollm2, tmp_path):
    m = ir.load(str(smollm2.onnx_path))
    tree = DraftTree([504, 28, 253, 30, 28, 2], [-1, 0, 1, 0, 3, 0])
    _check_explicit_attention(m, [504, 5248, 28, 253, 30, 28, 17, 2], [504, 28, 253], tree, atol=1e-5, tree_atol=1e-4, tmp_path=tmp_path)


def test_explicit_attention_does_not_fire_on_an_encoder():
    m = tiny_encoder_classifier()
    before = ir.to_proto(m).SerializeToString()
    assert not ExposeAttentionMaskPass()(m).modified
    assert ir.to_proto(m).SerializeToString() == before


def test_explicit_attention_needs_position_ids():
    m = tiny_decoder(num_layers=1, vocab=VOCAB, seed=0)
    pos = next(v for v in m.graph.inputs if v.name == "position_ids")
    m.graph.inputs.remove(pos)
    with pytest.raises(ir.passes.PreconditionError, match="position_ids"):
        ExposeAttentionMaskPass()(m)


# ------------------------------------------------------------------------------------------- plans and runtime


@pytest.fixture(scope="module")
def tree_tiny(module_tmp):
    root = module_tmp("trees")
    target = write_decoder_dir(root / "target", tiny_decoder(num_layers=3, vocab=VOCAB, seed=0), eos=EOS_UNUSED)
    write_word_tokenizer(root / "target", VOCAB)
    draft = write_decoder_dir(root / "draft", tiny_decoder(num_layers=1, vocab=VOCAB, seed=1), eos=EOS_UNUSED)
    write_word_tokenizer(root / "draft", VOCAB)
    calib = root / "calib.txt"
    rng = np.random.default_rng(0)
    calib.write_text(" ".join(f"w{i}" for i in rng.integers(0, VOCAB, 600)))
    spec = "explicit-attention,speculative{tree=true,tree_nodes=10,measure=false}"
    plans = {
        "external": compile_model(target, spec, root / "ext", drafter=str(draft), verify=True).plan_dir,
        "prompt-lookup": compile_model(target, spec, root / "pl", drafter="prompt-lookup", verify=True).plan_dir,
        "split": compile_model(target, "split-drafter{layers=1,min_speedup=0}," + spec, root / "split",
                               calib=str(calib), verify=True).plan_dir,
    }
    return {"root": root, "target": target, "draft": draft, "plans": plans}


@pytest.fixture(scope="module")
def tree_models(tree_tiny):
    return {k: dyncompile.load(p) for k, p in tree_tiny["plans"].items()}


def test_tree_plan_records_the_policy_and_the_bias_input(tree_tiny):
    plan = json.loads((tree_tiny["plans"]["external"] / "plan.json").read_text())
    step = plan["steps"][0]
    assert step["draft"]["tree"] == {"adaptive": True, "branching": 3, "max_depth": 8, "max_nodes": 10}
    assert step["target"]["attention_bias"] == "attention_bias" and step["target"]["attention_mask"] is None
    assert step["drafter"]["decoder"]["attention_bias"] == "attention_bias"  # it expands its tree by depths
    split = json.loads((tree_tiny["plans"]["split"] / "plan.json").read_text())["steps"][0]
    assert "attention_bias" not in split["drafter"]["decoder"]  # cut from the target before explicit-attention


BRANCHY = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2]  # "1 2" continues three ways: a prompt-lookup tree with 3 branches


@pytest.mark.parametrize("kind", ["external", "prompt-lookup", "split"])
@pytest.mark.parametrize("tree", [False, True, {"adaptive": False, "max_nodes": 12, "branching": 4}])
def test_every_drafter_chain_and_tree_token_identical(tree_models, kind, tree):
    m = tree_models[kind]
    drafted_branches = 0
    for prompt in [*PROMPTS, BRANCHY]:
        ref = m.generate(prompt, max_new_tokens=24, speculative=False)
        res = m.generate(prompt, max_new_tokens=24, tree=tree)
        assert res.token_ids == ref.token_ids, (kind, tree, prompt)
        assert res.stats.target_calls == res.stats.rounds + 1
        h = m.handlers[-1]
        drafted_branches += sum(size for size, _ in h.last_rounds) - res.stats.accepted
    if tree and not isinstance(tree, bool):  # fixed-size trees really had several candidates per call
        assert max(s for s, _ in m.handlers[-1].last_rounds) > 8


def test_prompt_lookup_tree_holds_every_match():
    from dyncompile.runtime.decode.drafters import PromptLookupDrafter, TreeBudget

    d = PromptLookupDrafter(3, 1)
    t = d.propose_tree(list(BRANCHY), TreeBudget(10, 3, 4), sample=False, temperature=1.0,
                       rng=np.random.default_rng(0), vocab_size=VOCAB)
    firsts = [t.tokens[c] for c in t.children[0]]
    assert firsts == [5, 4, 3]  # most recent match first (the chain's pick), then the older ones
    assert t.tokens[t.children[t.children[0][0]][0]] == 1  # ... 1 2 5 -> 1
    main, node = [], 0
    while t.children[node]:
        node = t.children[node][0]
        main.append(t.tokens[node])
    chain, _ = d.propose(list(BRANCHY), 3, sample=False, temperature=1.0, rng=None, vocab_size=VOCAB)
    assert chain == main  # the tree's first-child path is the chain prompt lookup proposes


@pytest.mark.parametrize("rollback", ["mask", "copy"])
def test_kv_cache_keeps_only_the_accepted_path(tree_models, rollback):
    m = tree_models["prompt-lookup"]
    h = m.handlers[-1]
    tgt = h.target
    tgt.rollback = rollback
    prompt = [1, 2, 3, 4, 5]
    tree = DraftTree([6, 7, 8, 9, 10, 11], [-1, 0, 1, 0, 3, 3])
    tgt.reset()
    tgt.forward(prompt)
    tgt.forward(tree.tokens, tree=tree)
    path = [0, 3, 5]
    tgt.keep_path(len(tree), path)
    assert tgt.length == len(prompt) + 3
    after = tgt.forward([12])[-1]
    tgt.reset()
    tgt.forward([*prompt, 6, 9, 11])
    ref = tgt.forward([12])[-1]
    np.testing.assert_allclose(after, ref, atol=1e-5, rtol=0)
    tgt.rollback = "mask"


def test_tree_on_a_plan_without_explicit_attention_is_refused(tmp_path):
    t = write_decoder_dir(tmp_path / "t", tiny_decoder(num_layers=1, vocab=VOCAB, seed=0), eos=EOS_UNUSED)
    # -O0: exactly the passes named (-O2 would insert explicit-attention itself)
    pl = compile_model(t, "speculative{measure=false}", tmp_path / "pl", drafter="prompt-lookup", opt_level=0).plan_dir
    m = dyncompile.load(pl)
    with pytest.raises(PromptError, match="explicit-attention"):
        m.generate(PROMPTS[0], max_new_tokens=4, tree=True)
    with pytest.raises(DrafterError, match="explicit-attention"):
        compile_model(t, "speculative{tree=true,measure=false}", tmp_path / "pl2", drafter="prompt-lookup",
                      opt_level=0)
    m2 = dyncompile.load(compile_model(t, "explicit-attention,speculative{tree=true,measure=false}", tmp_path / "pl3",
                                       drafter="prompt-lookup").plan_dir)
    with pytest.raises(PromptError, match="tree"):
        m2.generate(PROMPTS[0], max_new_tokens=4, tree={"max_nodes": 0})
    with pytest.raises(PromptError, match="unknown tree options"):
        m2.generate(PROMPTS[0], max_new_tokens=4, tree={"width": 3})


def test_drafter_sees_every_target_output(tree_models, monkeypatch):
    """after_verify gets the accepted path and every output of the verification call (rows = tree nodes)."""
    m = tree_models["external"]
    drafter = m.handlers[-1].drafter
    seen = []
    orig = type(drafter).after_verify

    def spy(self, v):
        seen.append((len(v.tree), list(v.path), {k: a.shape for k, a in v.outputs.items()}, v.valid_length,
                     len(v.seq)))
        return orig(self, v)

    monkeypatch.setattr(type(drafter), "after_verify", spy)
    m.generate(PROMPTS[0], max_new_tokens=12, tree={"adaptive": False})
    assert seen
    for n, path, shapes, valid, total in seen:
        assert shapes["logits"] == (n, VOCAB) and path[0] == 0 and valid == total - 1


# ------------------------------------------------------------------------------------------- sampling end to end


@pytest.fixture(scope="module")
def sampling_tree_plans(module_tmp):
    root = module_tmp("tree_sampling")
    t = write_decoder_dir(root / "t", tiny_decoder(num_layers=2, vocab=8, seed=0, logit_scale=1.5), eos=EOS_UNUSED)
    d = write_decoder_dir(root / "d", tiny_decoder(num_layers=1, vocab=8, seed=1, logit_scale=1.5), eos=EOS_UNUSED)
    spec = "explicit-attention,speculative{tree=true,tree_nodes=6,tree_depth=2,tree_adaptive=false,measure=false}"
    ext = compile_model(t, spec, root / "ext", drafter=str(d)).plan_dir
    pl = compile_model(t, spec, root / "pl", drafter="prompt-lookup").plan_dir
    return dyncompile.load(ext), dyncompile.load(pl)


def _exact_joint(m, prompt, temperature):
    tgt = m.handlers[-1].target
    tgt.reset()
    p1 = probs_from_logits(tgt.forward(prompt)[-1], temperature)
    joint = np.zeros((8, 8))
    for a in range(8):
        for b in range(8):
            tgt.reset()
            lg = tgt.forward([*prompt, a, b])
            joint[b] += p1[a] * probs_from_logits(lg[-2], temperature)[b] * probs_from_logits(lg[-1], temperature)
    return joint


def _sample_joint(m, prompt, n):
    counts = np.zeros((8, 8))
    branched = 0
    for seed in range(n):
        r = m.generate(prompt, max_new_tokens=4, sample=True, seed=seed)
        counts[r.token_ids[1], r.token_ids[2]] += 1
        branched += any(size > 2 for size, _ in m.handlers[-1].last_rounds)
    return counts, branched


#: every token 0..7 is followed by two different tokens somewhere: whatever the first sampled token, prompt
#: lookup's tree branches
BRANCHY8 = [t for x in range(8) for t in (x, (x + 1) % 8, x, (x + 3) % 8)]


@pytest.mark.parametrize("which,prompt", [(0, [1, 2, 3, 4]), (1, BRANCHY8)])
def test_tree_sampling_reproduces_target_distribution(sampling_tree_plans, which, prompt):
    """Tokens 2-3 come from one round verifying a tree (model drafter: a sampled chain + top-k siblings; prompt
    lookup: several matches); their joint distribution over 1500 seeds matches the target's (the 20,000-draw
    test above is the sharper one; this one runs the whole runtime)."""
    m = sampling_tree_plans[which]
    expected = _exact_joint(m, prompt, 1.0)
    counts, branched = _sample_joint(m, prompt, 1500)
    assert branched > 1000  # the rounds really verified trees
    assert chi_square_p(counts, expected) > 1e-3


def test_tree_chi_square_detects_a_wrong_sampler(sampling_tree_plans, monkeypatch):
    """Negative control: the runtime with the residual-free sampler gives another distribution, which the test
    rejects."""
    m = sampling_tree_plans[0]
    expected = _exact_joint(m, [1, 2, 3, 4], 1.0)
    monkeypatch.setattr(runtime_speculative, "accept_sampling", _accept_without_residual)
    counts, _ = _sample_joint(m, [1, 2, 3, 4], 800)
    assert chi_square_p(counts, expected) < 1e-6


def test_explicit_attention_must_come_before_speculative(tmp_path, capsys):
    from helpers import assert_clean_error, run_cli

    rc, _, err = run_cli(capsys, tmp_path / "missing.onnx", "--passes", "speculative,explicit-attention",
                         "--drafter", "prompt-lookup", "-o", tmp_path / "out")
    assert_clean_error(rc, err, "explicit-attention", "speculative")


def test_model_drafter_expands_its_top_k_best_first(tree_models):
    """An external drafter with the bias input expands its tree one depth per call: its first-child path is its
    greedy chain, and every node's children are the drafter's top tokens after that node's path."""
    from dyncompile.runtime.decode.drafters import TreeBudget

    m = tree_models["external"]
    drafter = m.handlers[-1].drafter
    assert drafter.decoder.supports_trees
    seq = [1, 2, 3, 4, 5, 1, 2]
    drafter.reset(seq)
    tree = drafter.propose_tree(seq, TreeBudget(12, 4, 3), sample=False, temperature=1.0,
                                rng=np.random.default_rng(0), vocab_size=VOCAB)
    assert len(tree) == 13 and tree.max_depth >= 2 and not tree.is_chain
    drafter.reset(seq)
    chain, _ = drafter.propose(seq, tree.main_chain_length(), sample=False, temperature=1.0, rng=None,
                               vocab_size=VOCAB)
    main, node = [], 0
    while tree.children[node]:
        node = tree.children[node][0]
        main.append(tree.tokens[node])
    assert main == chain
    dec = drafter.decoder
    for i in range(len(tree)):
        if not tree.children[i]:
            continue
        dec.reset()
        logits = dec.forward([*seq[:-1], *(tree.tokens[j] for j in tree.path_to(i))])[-1]
        top = [int(t) for t in np.argsort(-logits, kind="stable")[: len(tree.children[i])]]
        assert [tree.tokens[c] for c in tree.children[i]] == top


def test_tree_size_follows_the_cost_curve_and_what_branches_bought():
    from dyncompile.runtime.decode.speculative import DraftController, TreeController
    from dyncompile.runtime.rules.cost_model import best_tree_extra, verify_cost

    flat = {1: 1.0, 2: 1.05, 9: 1.2, 33: 1.6}  # cheap wide calls
    steep = {1: 1.0, 2: 1.5, 9: 4.0, 33: 16.0}  # every token costs half a call
    extras = [0, 2, 4, 8, 16]
    assert best_tree_extra(0.6, 4, 0.0, 0.0, 0.3, lambda s: verify_cost(s, flat), extras)[1] == 16
    assert best_tree_extra(0.6, 4, 0.0, 0.0, 0.3, lambda s: verify_cost(s, steep), extras)[1] == 0
    assert best_tree_extra(0.6, 4, 0.0, 0.0, 0.0, lambda s: verify_cost(s, flat), extras)[1] == 0

    def controller(table, gain):
        tc = TreeController(DraftController(initial=4, max_len=8, verify_cost=table), max_nodes=20, max_depth=8,
                            branching=3, gain0=gain)
        tc.next_budget(100)  # the first round uses the initial length
        return tc.next_budget(100)

    wide, narrow = controller(flat, 0.3), controller(steep, 0.3)
    assert wide.max_nodes > wide.max_depth and wide.branching == 3
    assert narrow.max_nodes == narrow.max_depth and narrow.branching == 1
    fixed = TreeController(DraftController(), max_nodes=12, max_depth=5, branching=2, adaptive=False)
    assert (fixed.next_budget(100).max_nodes, fixed.next_budget(3).max_depth) == (12, 3)
