"""Speculative decoding on tiny generated decoders: greedy fidelity for every drafter kind, exact sampling
(chi-square against the target's own distribution), stop conditions, draft-length control, and bad input
(each a clear DyncompileError; through the CLI one `error:` line, exit 2)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from helpers import assert_clean_error, run_cli

import dyncompile
import dyncompile.runtime.decode.speculative as runtime_speculative
from dyncompile.errors import DyncompileError, PassConfigError
from dyncompile.models.synthetic_decoder import tiny_decoder, write_decoder_dir, write_word_tokenizer
from dyncompile.passes.compiler import compile_model
from dyncompile.passes.speculative import DrafterError, SpeculativePass
from dyncompile.passes.speculative.probe import weight_reads
from dyncompile.plan import GenerationConfig, TreePolicy, from_json
from dyncompile.plan.decode import MAX_DRAFT_NODES
from dyncompile.runtime.decode.generate import PromptError
from dyncompile.runtime.decode.speculative import DraftController
from dyncompile.runtime.rules.chi2 import chi2_sf
from dyncompile.runtime.rules.sampling import probs_from_logits, sample_from

VOCAB = 16
EOS_UNUSED = 99  # not a token: generation runs to max_new_tokens unless a test sets one
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 7, 8, 9, 10, 11, 7, 7, 8], [3]]


@pytest.fixture(scope="module")
def tiny(module_tmp):
    """Tiny target (3 layers) + external drafter (1 layer) dirs, each with a word tokenizer and model config."""
    root = module_tmp("spec")
    target = write_decoder_dir(root / "target", tiny_decoder(num_layers=3, vocab=VOCAB, seed=0), eos=EOS_UNUSED)
    write_word_tokenizer(root / "target", VOCAB)
    draft = write_decoder_dir(root / "draft", tiny_decoder(num_layers=1, vocab=VOCAB, seed=1), eos=EOS_UNUSED)
    write_word_tokenizer(root / "draft", VOCAB)
    calib = root / "calib.txt"
    rng = np.random.default_rng(0)
    calib.write_text(" ".join(f"w{i}" for i in rng.integers(0, VOCAB, 600)))
    return {"root": root, "target": target, "draft": draft, "calib": calib}


@pytest.fixture(scope="module")
def plans(tiny):
    root = tiny["root"]
    out = {
        "plain": compile_model(tiny["target"], "verify", root / "plain", verify=True),
        "external": compile_model(tiny["target"], "speculative", root / "external", drafter=str(tiny["draft"]),
                                  verify=True),
        "prompt-lookup": compile_model(tiny["target"], "speculative", root / "pl", drafter="prompt-lookup",
                                       verify=True),
        # the draft policy from the default cost model: verification costs timed on a loaded machine (two test
        # workers on two cores) can make this tiny target's policy draft almost nothing
        "prompt-lookup-unmeasured": compile_model(tiny["target"], "speculative{measure=false}", root / "pl0",
                                                  drafter="prompt-lookup", verify=True),
        # -O0: the drafter shares the weights of the target as named; the -O2 lowering packs the target's q/k/v
        "split": compile_model(tiny["target"], "split-drafter{layers=1,min_speedup=0},speculative", root / "split",
                               calib=str(tiny["calib"]), verify=True, opt_level=0),
    }
    return {k: r.plan_dir for k, r in out.items()}


@pytest.fixture(scope="module")
def loaded(plans, provider):
    return {k: dyncompile.load(p, provider=provider) for k, p in plans.items()}


# ------------------------------------------------------------------------------------------- plans


def test_plan_steps_and_files(plans):
    kinds = {k: json.loads((p / "plan.json").read_text()) for k, p in plans.items()}
    assert kinds["plain"]["task"] == "text-generation"
    assert [s["kind"] for s in kinds["plain"]["steps"]] == ["generate"]
    for k in ("external", "prompt-lookup", "split"):
        plan = kinds[k]
        assert plan["task"] == "text-generation"
        (step,) = plan["steps"]
        assert step["kind"] == "speculative_generate"
        assert len(step["target"]["kv"]) == 6 and step["target"]["kv"][0]["shape"] == [4, 64]
        for f in plan["files"].values():
            assert len(f["sha256"]) == 64
    assert kinds["prompt-lookup"]["steps"][0]["drafter"] == {"kind": "prompt-lookup", "max_ngram": 3, "min_ngram": 1}
    ext = kinds["external"]["steps"][0]["drafter"]
    assert ext["kind"] == "model" and ext["name"] == "external" and ext["share_kv"] is None
    assert "drafter" in kinds["external"]["files"]
    split = kinds["split"]
    d = split["steps"][0]["drafter"]
    assert d["name"] == "split" and d["share_kv"] == [0, 1]  # layer 1's key/value are the target's
    assert split["files"]["drafter"]["external_data"] == ["model.onnx.data"]  # weights shared on disk
    assert split["policy"]["split_drafter"]["layers"] == 1


def test_longest_draft_by_drafter_kind_with_verification_timed_that_far(plans, tiny, tmp_path):
    """Prompt lookup drafts up to 16 tokens by default (free drafts), model drafters up to 8; the plan's verification
    costs are timed up to the longest chain + its bonus token, not extrapolated past 9."""
    draft = {k: json.loads((plans[k] / "plan.json").read_text())["steps"][0]["draft"]
             for k in ("external", "prompt-lookup", "split")}
    assert draft["prompt-lookup"]["max"] == 16 and {"9", "16", "17"} <= set(draft["prompt-lookup"]["verify_cost"])
    for k in ("external", "split"):
        assert draft[k]["max"] == 8 and sorted(draft[k]["verify_cost"], key=int) == ["1", "2", "4", "9"]
    # an explicit max_draft wins over the default
    short = compile_model(tiny["target"], "speculative{max_draft=6}", tmp_path / "pl6", drafter="prompt-lookup").plan_dir
    d6 = json.loads((short / "plan.json").read_text())["steps"][0]["draft"]
    assert d6["max"] == 6 and sorted(d6["verify_cost"], key=int) == ["1", "2", "4", "9"]


def test_split_drafter_shares_target_weights(plans):
    d = plans["split"]
    drafter = ir.load(str(d / "drafter.onnx"))
    external = {n for n, v in drafter.graph.initializers.items() if isinstance(v.const_value, ir.ExternalTensor)}
    assert "embed_tokens.weight" in external and "layers.0.q" in external
    assert {"split_drafter.bridge.weight", "split_drafter.bridge.bias"} <= set(drafter.graph.initializers)
    assert not any(n.startswith("layers.1.") for n in drafter.graph.initializers)


# ------------------------------------------------------------------------------------------- greedy fidelity


@pytest.mark.parametrize("kind", ["external", "prompt-lookup", "split"])
def test_greedy_token_identical_to_target(loaded, kind):
    ref_model, m = loaded["plain"], loaded[kind]
    for prompt in PROMPTS:
        ref = ref_model.generate(prompt, max_new_tokens=40)
        for opts in ({}, {"draft_length": 1, "adaptive": False}, {"draft_length": 6, "adaptive": False}):
            res = m.generate(prompt, max_new_tokens=40, **opts)
            assert res.token_ids == ref.token_ids, (kind, prompt, opts)
            st = res.stats
            assert st.new_tokens == 40 and st.stop_reason == "max_new_tokens"
            assert st.drafter == m.handlers[0].drafter.name
            assert st.target_calls == st.rounds + 1 and st.accepted <= st.drafted
            assert st.new_tokens == st.rounds + st.accepted + 1  # each round: accepted drafts + one target token
        same = m.generate(prompt, max_new_tokens=40, speculative=False)
        assert same.token_ids == ref.token_ids and same.stats.drafter is None


def test_max_draft_below_the_plans_first_length_caps_it(loaded):
    """A caller's ``max_draft`` under the plan's first draft length is a cap, not lifted back to that length; a
    ``draft_length`` above an explicit ``max_draft`` is refused."""
    from dyncompile.runtime.decode.generate import PromptError

    m = loaded["prompt-lookup-unmeasured"]
    policy = m.handlers[0].draft_policy
    assert policy.initial > 2  # else this test would not test the cap
    prompt = PROMPTS[0]
    ref = m.generate(prompt, max_new_tokens=40, speculative=False)
    capped = m.generate(prompt, max_new_tokens=40, max_draft=2)
    assert capped.token_ids == ref.token_ids
    assert capped.stats.drafted > 0 and max(capped.stats.draft_lengths) <= 2
    free = m.generate(prompt, max_new_tokens=40)
    assert max(free.stats.draft_lengths) > 2  # the plan's own policy drafts longer on this prompt
    with pytest.raises(PromptError, match="draft_length=5 is longer than max_draft=2"):
        m.generate(prompt, max_new_tokens=8, max_draft=2, draft_length=5)


@pytest.mark.parametrize("kind", ["external", "split"])
def test_rollback_by_mask_copy_and_iobinding_agree(loaded, kind):
    """Masked rollback (default), copy rollback and IOBinding give the target's tokens; long runs compact."""
    m = loaded[kind]
    ref = loaded["plain"].generate(PROMPTS[1], max_new_tokens=120).token_ids
    for opts in ({"rollback": "copy"}, {"io_binding": True}, {"rollback": "copy", "io_binding": True}, {}):
        res = m.generate(PROMPTS[1], max_new_tokens=120, draft_length=4, adaptive=False, **opts)
        assert res.token_ids == ref, opts
    target = m.handlers[0].target
    assert target.rollback == "mask" and not target.io_binding
    assert target.compactions > 0 and target.slots >= target.length


def test_text_prompt_and_decode(loaded):
    res = loaded["split"].generate("w1 w2 w3 w4", max_new_tokens=5)
    assert res.prompt_ids == [1, 2, 3, 4]
    assert res.text.split() == [f"w{t}" for t in res.token_ids]
    assert loaded["plain"].generate("w1 w2 w3 w4", max_new_tokens=5).token_ids == res.token_ids


def test_prompt_lookup_drafts_from_the_prompt(loaded):
    # a target that loops: the continuation repeats, prompt lookup proposes it
    ref = loaded["plain"].generate(PROMPTS[0], max_new_tokens=60)
    timed = loaded["prompt-lookup"].generate(PROMPTS[0], max_new_tokens=60)
    # drafts are asserted on the plan with the default cost model: the timed plan's policy follows this machine's
    # load (two test workers on two cores) and may rightly draft little
    res = loaded["prompt-lookup-unmeasured"].generate(PROMPTS[0], max_new_tokens=60)
    assert res.token_ids == timed.token_ids == ref.token_ids
    assert res.stats.drafted > 0 and res.stats.accepted > 0


def _with_generation(m, **kw):
    h = m.handlers[0]
    old = h.gen
    h.gen = GenerationConfig(**{**old.__dict__, **kw})
    return old


@pytest.mark.parametrize("kind", ["external", "prompt-lookup", "split"])
def test_stops_at_eos_and_max_length(loaded, kind):
    ref = loaded["plain"].generate(PROMPTS[1], max_new_tokens=30).token_ids
    eos = ref[6]
    first = ref.index(eos)
    olds = [_with_generation(loaded[k], eos_token_ids=(eos,)) for k in ("plain", kind)]
    try:
        a = loaded["plain"].generate(PROMPTS[1], max_new_tokens=30)
        b = loaded[kind].generate(PROMPTS[1], max_new_tokens=30)
        assert a.token_ids == b.token_ids == ref[: first + 1]
        assert b.stats.stop_reason == "eos"
    finally:
        for k, old in zip(("plain", kind), olds):
            loaded[k].handlers[0].gen = old
    old = _with_generation(loaded[kind], max_length=len(PROMPTS[1]) + 7)
    try:
        c = loaded[kind].generate(PROMPTS[1], max_new_tokens=30)
        assert c.token_ids == ref[:7] and c.stats.stop_reason == "max_length"
    finally:
        loaded[kind].handlers[0].gen = old
    d = loaded[kind].generate(PROMPTS[1], max_new_tokens=1)
    assert d.token_ids == ref[:1] and d.stats.target_calls == 1


# ------------------------------------------------------------------------------------------- exact sampling


def chi_square_p(observed: np.ndarray, expected_probs: np.ndarray) -> float:
    """p-value of Pearson's chi-square test; cells expecting fewer than 5 counts are pooled."""
    n = observed.sum()
    e = expected_probs.reshape(-1) * n
    o = observed.reshape(-1).astype(float)
    small = e < 5
    e = np.append(e[~small], e[small].sum())
    o = np.append(o[~small], o[small].sum())
    if e[-1] == 0:
        e, o = e[:-1], o[:-1]
    stat = float(((o - e) ** 2 / e).sum())
    return chi2_sf(stat, len(e) - 1)


@pytest.fixture(scope="module")
def sampling_plans(module_tmp, provider):
    """Vocabulary 8 with spread-out distributions; a drafter that disagrees with the target."""
    root = module_tmp("sampling")
    t = write_decoder_dir(root / "t", tiny_decoder(num_layers=2, vocab=8, seed=0, logit_scale=1.5), eos=EOS_UNUSED)
    d = write_decoder_dir(root / "d", tiny_decoder(num_layers=1, vocab=8, seed=1, logit_scale=1.5), eos=EOS_UNUSED)
    ext = compile_model(t, "speculative{draft_length=2,adaptive=false}", root / "ext", drafter=str(d)).plan_dir
    pl = compile_model(t, "speculative{draft_length=2,adaptive=false}", root / "pl", drafter="prompt-lookup").plan_dir
    return dyncompile.load(ext, provider=provider), dyncompile.load(pl, provider=provider)


def _exact_joint(m, prompt, temperature):
    """The target's own distribution of new tokens 2 and 3 (marginalising token 1), by enumeration."""
    tgt = m.handlers[0].target
    tgt.reset()
    p1 = probs_from_logits(tgt.forward(prompt)[-1], temperature)
    joint = np.zeros((8, 8))
    for a in range(8):
        for b in range(8):
            tgt.reset()
            lg = tgt.forward([*prompt, a, b])
            p2 = probs_from_logits(lg[-2], temperature)[b]
            joint[b] += p1[a] * p2 * probs_from_logits(lg[-1], temperature)
    return joint


def _sample_joint(m, prompt, temperature, n):
    counts = np.zeros((8, 8))
    accepted = drafted = 0
    for seed in range(n):
        r = m.generate(prompt, max_new_tokens=4, sample=True, temperature=temperature, seed=seed)
        counts[r.token_ids[1], r.token_ids[2]] += 1
        accepted += r.stats.accepted
        drafted += r.stats.drafted
    return counts, accepted, drafted


@pytest.mark.parametrize("which,prompt,temperature", [(0, [1, 2, 3, 4], 1.0), (0, [5, 6], 0.7), (1, [1, 2, 1, 2, 1], 1.0)])
def test_speculative_sampling_reproduces_target_distribution(sampling_plans, which, prompt, temperature):
    """Tokens 2-3 come from one verification round of 2 drafts (model drafter or prompt lookup); their joint
    distribution over 3000 seeds matches the target's (chi-square), and the drafts were really used."""
    m = sampling_plans[which]
    expected = _exact_joint(m, prompt, temperature)
    counts, accepted, drafted = _sample_joint(m, prompt, temperature, 3000)
    assert accepted > 80 and drafted - accepted > 300  # drafts were both accepted and rejected
    assert chi_square_p(counts, expected) > 1e-3


def test_chi_square_detects_a_wrong_sampler(sampling_plans, monkeypatch):
    """Negative control: always accepting the drafts gives the drafter's distribution, which the test rejects."""

    def accept_all(p, drafts, qs, rng):
        return len(drafts), sample_from(p[len(drafts)], rng)

    m = sampling_plans[0]
    expected = _exact_joint(m, [1, 2, 3, 4], 1.0)
    monkeypatch.setattr(runtime_speculative, "verify_sampling", accept_all)
    counts, _, _ = _sample_joint(m, [1, 2, 3, 4], 1.0, 1500)
    assert chi_square_p(counts, expected) < 1e-6


def test_sampling_is_seeded(loaded):
    a = loaded["external"].generate(PROMPTS[0], max_new_tokens=20, sample=True, temperature=0.8, seed=3)
    b = loaded["external"].generate(PROMPTS[0], max_new_tokens=20, sample=True, temperature=0.8, seed=3)
    assert a.token_ids == b.token_ids and a.stats.mode == "sample"


# ------------------------------------------------------------------------------------------- draft length


def test_draft_controller_follows_acceptance():
    def run(alpha, rounds=40):
        ctl = DraftController(initial=4, min_len=1, max_len=8)
        rng = np.random.default_rng(0)
        lengths = []
        for _ in range(rounds):
            g = ctl.next_length(100)
            lengths.append(g)
            acc = 0
            while acc < g and rng.random() < alpha:
                acc += 1
            ctl.update(g, acc, g + 1, 0.010 * (1 + 0.1 * g), 0.0005 * g)
        return lengths, ctl.alpha

    high, a_high = run(0.95)
    low, a_low = run(0.05)
    assert a_high > 0.8 and a_low < 0.2
    assert np.mean(high[-10:]) >= 6 and np.mean(low[-10:]) <= 1.5
    fixed = DraftController(initial=3, adaptive=False)
    assert [fixed.next_length(100), fixed.next_length(2), fixed.next_length(0)] == [3, 2, 0]


# ------------------------------------------------------------------------------------------- bad input


@pytest.fixture()
def other_tokenizer_drafter(tiny, tmp_path):
    """The external drafter, with a tokenizer that differs in one token and a config with another eos."""
    d = tmp_path / "other"
    shutil.copytree(tiny["draft"].parent, d)
    tok = json.loads((d / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["x5"] = vocab.pop("w5")
    (d / "tokenizer.json").write_text(json.dumps(tok))
    return d / "model.onnx"


def test_drafter_with_another_tokenizer(tiny, other_tokenizer_drafter, tmp_path, capsys):
    with pytest.raises(DrafterError, match=r"tokenizer mismatch: token 5 is 'w5' in the target's tokenizer .* 'x5'"):
        compile_model(tiny["target"], "speculative", tmp_path / "o", drafter=str(other_tokenizer_drafter))
    rc, _, err = run_cli(capsys, tiny["target"], "--passes", "speculative", "--drafter", other_tokenizer_drafter,
                         "-o", tmp_path / "o")
    assert_clean_error(rc, err, "tokenizer mismatch", "same model family", "prompt-lookup")
    assert not (tmp_path / "o").exists()
    # special tokens: same vocabulary, another eos
    cfg_path = other_tokenizer_drafter.parent / "dyncompile-model.json"
    shutil.copy(tiny["draft"].parent / "tokenizer.json", other_tokenizer_drafter.parent / "tokenizer.json")
    cfg = json.loads(cfg_path.read_text())
    cfg["eos_token_id"] = 3
    cfg_path.write_text(json.dumps(cfg))
    rc, _, err = run_cli(capsys, tiny["target"], "--passes", "speculative", "--drafter", other_tokenizer_drafter,
                         "-o", tmp_path / "o")
    assert_clean_error(rc, err, "eos_token_id is 99 for the target", "but 3 for the drafter")


def test_drafter_vocabulary_size_mismatch(tiny, tmp_path):
    d = write_decoder_dir(tmp_path / "small", tiny_decoder(num_layers=1, vocab=12, seed=2), eos=EOS_UNUSED)
    with pytest.raises(DyncompileError, match="vocab"):
        compile_model(tiny["target"], "speculative", tmp_path / "o", drafter=str(d))


def test_drafter_without_kv_cache(tiny, tmp_path, capsys):
    d = write_decoder_dir(tmp_path / "nokv", tiny_decoder(num_layers=1, vocab=VOCAB, with_kv=False), eos=EOS_UNUSED)
    write_word_tokenizer(tmp_path / "nokv", VOCAB)
    rc, _, err = run_cli(capsys, tiny["target"], "--passes", "speculative", "--drafter", d, "-o", tmp_path / "o")
    assert_clean_error(rc, err, "drafter", "has no KV cache", "re-export")
    # and a target without one
    rc, _, err = run_cli(capsys, d, "--passes", "speculative", "--drafter", "prompt-lookup", "-o", tmp_path / "o")
    assert_clean_error(rc, err, "target model", "has no KV cache")


def test_split_layers_larger_than_model(tiny, tmp_path, capsys):
    with pytest.raises(PassConfigError, match=r"layers=7 but the target has 3 layers.* 1\.\.2"):
        compile_model(tiny["target"], "split-drafter{layers=7},speculative", tmp_path / "o", calib=str(tiny["calib"]))
    rc, _, err = run_cli(capsys, tiny["target"], "--passes", "split-drafter{layers=3},speculative", "--calib",
                         tiny["calib"], "-o", tmp_path / "o")
    assert_clean_error(rc, err, "layers=3 but the target has 3 layers")
    rc, _, err = run_cli(capsys, tiny["target"], "--passes", "split-drafter,speculative", "-o", tmp_path / "o")
    assert_clean_error(rc, err, "needs --calib")


def test_speculative_needs_a_drafter(tiny, tmp_path, capsys):
    rc, _, err = run_cli(capsys, tiny["target"], "--passes", "speculative", "-o", tmp_path / "o")
    assert_clean_error(rc, err, "speculative needs a drafter", "--drafter", "split-drafter")
    rc, _, err = run_cli(capsys, tiny["target"], "--passes", "split-drafter{layers=1,min_speedup=0},speculative",
                         "--calib", tiny["calib"], "--drafter", "prompt-lookup", "-q", "-o", tmp_path / "o")
    assert_clean_error(rc, err, "two drafters")
    rc, _, err = run_cli(capsys, tiny["target"], "--passes", "speculative", "--drafter", tmp_path / "nope.onnx",
                         "-o", tmp_path / "o")
    assert_clean_error(rc, err, "drafter not found", "nope.onnx")


@pytest.mark.parametrize("prompt", ["", "   ", []])
def test_empty_prompt(loaded, prompt):
    with pytest.raises(PromptError, match="empty prompt"):
        loaded["external"].generate(prompt, max_new_tokens=4)


@pytest.mark.parametrize("n", [0, -3])
def test_max_new_tokens_not_positive(loaded, n):
    with pytest.raises(PromptError, match="max_new_tokens must be >= 1"):
        loaded["prompt-lookup"].generate([1, 2], max_new_tokens=n)


def test_bad_generation_input_through_cli(plans, capsys):
    rc, _, err = run_cli(capsys, "run", plans["split"], "--prompt", "")
    assert_clean_error(rc, err, "empty prompt")
    rc, _, err = run_cli(capsys, "run", plans["split"], "--prompt", "w1 w2", "--max-new-tokens", "0")
    assert_clean_error(rc, err, "max_new_tokens must be >= 1", "--max-new-tokens")
    rc, _, err = run_cli(capsys, "run", plans["split"], "--prompt", "w1 w2", "--sample", "--temperature", "0")
    assert_clean_error(rc, err, "temperature must be > 0")


def test_cli_run_prompt(plans, capsys):
    rc, out, err = run_cli(capsys, "run", plans["prompt-lookup"], "--prompt", "w1 w2 w3 w1 w2", "--max-new-tokens", "6")
    assert rc == 0, err
    assert "6 tokens in" in out and "drafter prompt-lookup" in out
    rc, out, err = run_cli(capsys, "run", plans["plain"], "--prompt", "w1 w2", "--max-new-tokens", "3", "--json")
    assert rc == 0, err
    assert len(json.loads(out)["token_ids"]) == 3


# ------------------------------------------------------------------------------------------- chat templates

#: a chat template that runs a shell command when rendered by an unsandboxed Jinja2 environment
ATTACK = '{{{{ cycler.__init__.__globals__.os.system("touch {}") }}}}'
#: a normal template: the user's text, then the assistant prefix (here the word w9)
CHAT = "{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %} w9{% endif %}"


def _chat_plan(root, template):
    d = write_decoder_dir(root, tiny_decoder(num_layers=1, vocab=VOCAB, seed=0), eos=EOS_UNUSED, chat_template=template)
    write_word_tokenizer(root, VOCAB)
    return compile_model(d, "speculative", root / "plan", drafter="prompt-lookup").plan_dir


def test_chat_template_renders_in_a_sandbox(tmp_path, capsys):
    """The plan's chat template is data: one that reaches Python internals is refused (the command never runs)
    through the API and the CLI, one that is not Jinja2 is a clean error, and a normal one still renders."""
    import jinja2

    control = tmp_path / "control"
    jinja2.Environment().from_string(ATTACK.format(control)).render()
    assert control.exists()  # the payload is a real attack on an unsandboxed environment

    marker = tmp_path / "pwned"
    m = dyncompile.load(_chat_plan(tmp_path / "evil", ATTACK.format(marker)))
    with pytest.raises(PromptError, match="chat template tried an unsafe operation"):
        m.generate("w1 w2", max_new_tokens=2, chat=True)
    rc, _, err = run_cli(capsys, "run", tmp_path / "evil" / "plan", "--prompt", "x", "--chat")
    assert_clean_error(rc, err, "chat template", "unsafe", "trusted chat_template")
    assert not marker.exists()
    assert m.generate("w1 w2", max_new_tokens=2).prompt_ids == [1, 2]  # without chat the plan works

    broken = dyncompile.load(_chat_plan(tmp_path / "broken", "{% for m in messages %}{{ m.content }}"))
    with pytest.raises(PromptError, match="not valid Jinja2"):
        broken.generate("w1", max_new_tokens=2, chat=True)

    good = dyncompile.load(_chat_plan(tmp_path / "good", CHAT))
    res = good.generate("w1 w2", max_new_tokens=3, chat=True)
    assert res.prompt_ids == [1, 2, 9]
    assert res.token_ids == good.generate([1, 2, 9], max_new_tokens=3).token_ids


# ------------------------------------------------------------------------------------------- pass contract


def test_speculative_pass_is_idempotent_and_leaves_the_graph(tiny, monkeypatch):
    """With its defaults (costs timed on this machine) a second run on its own output changes nothing and times
    nothing; another policy is a change, another graph is timed afresh."""
    import dyncompile.passes.speculative.speculative as spec_pass

    timed = []
    real = spec_pass.target_verify_costs
    monkeypatch.setattr(spec_pass, "target_verify_costs", lambda m, s, *a: timed.append(m) or real(m, s, *a))
    model = ir.load(str(tiny["target"]))

    def body(m):
        return [(n.op_type, [v.name if v is not None else "" for v in n.inputs], [v.name for v in n.outputs])
                for n in m.graph] + [v.name for v in m.graph.outputs]

    before = body(model)
    p = SpeculativePass("prompt-lookup", generation={"eos_token_ids": [EOS_UNUSED]})
    assert p.measure
    assert p(model).modified
    record = model.metadata_props["dyncompile.speculative"]
    assert "verify_cost" in json.loads(record)["draft"]
    assert not p(model).modified
    assert model.metadata_props["dyncompile.speculative"] == record and len(timed) == 1
    assert body(model) == before  # only metadata changed
    assert model.metadata_props["dyncompile.emitter"] == "speculative"
    assert "SpeculativePass(drafter='prompt-lookup'" in repr(p)
    # a different draft policy is a different record (the graph's timings are kept: they do not depend on it)
    assert SpeculativePass("prompt-lookup", draft_length=2, generation={"eos_token_ids": [EOS_UNUSED]})(model).modified
    assert len(timed) == 1
    # the same target loaded again has no timings in memory: timed afresh
    fresh = ir.load(str(tiny["target"]))
    assert p(fresh).modified and len(timed) == 2


def test_tree_options_are_checked_by_the_plan_schema():
    """The pass checks its tree through ``TreePolicy`` itself: what it accepts, a plan loads (a branching the
    pass once let through up to MAX_DRAFT_NODES compiled, then was refused when the plan loaded)."""
    hi = next(f.metadata["hi"] for f in dataclasses.fields(TreePolicy) if f.name == "branching")
    assert hi < MAX_DRAFT_NODES  # the case the schema check exists for
    ok = SpeculativePass("prompt-lookup", tree={"branching": hi})
    assert ok.tree["branching"] == hi and from_json(TreePolicy, ok.tree, "tree").branching == hi
    with pytest.raises(DrafterError, match=rf"tree\.branching .*{hi}.*tree_nodes, tree_depth, branching"):
        SpeculativePass("prompt-lookup", tree={"branching": hi + 1})
    with pytest.raises(DrafterError, match=r"tree\.max_nodes"):
        SpeculativePass("prompt-lookup", tree={"max_nodes": 0})
    with pytest.raises(DrafterError, match=r"unknown field 'width'"):
        SpeculativePass("prompt-lookup", tree={"width": 2})


def test_int4_drafter_from_an_external_data_model_is_costed_in_bytes(tmp_path, monkeypatch):
    """quantize-int4 reads a decoder saved with external data from any working directory, the result is a
    valid drafter, and the plan's drafter-cost prior counts the packed int4 bytes (an fp32 element count
    would call the int4 drafter almost free)."""
    src = tmp_path / "big"
    src.mkdir()
    model = tiny_decoder(num_layers=2, vocab=VOCAB, hidden=64, seed=3)
    ir.save(model, src / "model.onnx", external_data="model.onnx.data", size_threshold_bytes=1024)
    (src / "dyncompile-model.json").write_text(json.dumps(
        {"format": "dyncompile.model/v1", "task": "text-generation", "vocab_size": VOCAB, "eos_token_id": EOS_UNUSED}))
    write_word_tokenizer(src, VOCAB)
    monkeypatch.chdir(tmp_path)  # not the model's folder: external data must still be found
    q = compile_model(src / "model.onnx", "quantize-int4{block_size=32}", tmp_path / "q4", verify=True).plan_dir
    fp32, int4 = ir.load(src / "model.onnx"), ir.load(q / "model.onnx")
    assert any(n.op_type == "MatMulNBits" for n in int4.graph)
    ratio = weight_reads(int4) / weight_reads(fp32)
    assert 4 / 32 <= ratio <= 5.25 / 32, ratio  # 4 bits + a float32 scale per 32 weights (+ zero points) vs 32 bits
    target = write_decoder_dir(tmp_path / "t", tiny_decoder(num_layers=3, vocab=VOCAB, hidden=64, seed=0), eos=EOS_UNUSED)
    write_word_tokenizer(tmp_path / "t", VOCAB)
    unmeasured = compile_model(target, "speculative{measure=false}", tmp_path / "spec0", drafter=str(q / "model.onnx"))
    draft = json.loads((unmeasured.plan_dir / "plan.json").read_text())["policy"]["speculative"]["draft"]
    assert draft["draft_cost_source"] == "weight bytes", draft
    # the matrices a step reads: 6 hidden x hidden per layer + the LM head (hidden x vocab); the int4 drafter
    # (2 layers) stores 4 bits per weight + a float32 scale per 32-weight block (+ at most a 4-bit zero point
    # per block): 4 to 5.25 bits, against 32 bits per weight of the 3-layer fp32 target
    drafter_weights, target_weights = 2 * 6 * 64 * 64 + 64 * VOCAB, 3 * 6 * 64 * 64 + 64 * VOCAB
    lo, hi = (bits * drafter_weights / (32 * target_weights) for bits in (4.0, 5.25))
    assert lo - 1e-4 <= draft["draft_cost"] <= hi + 1e-4, (draft, lo, hi)
    plan = compile_model(target, "speculative", tmp_path / "spec", drafter=str(q / "model.onnx")).plan_dir
    draft = json.loads((plan / "plan.json").read_text())["policy"]["speculative"]["draft"]
    assert draft["draft_cost_source"].startswith("measured") and draft["draft_cost"] > 0, draft
    costs = [draft["verify_cost"][k] for k in sorted(draft["verify_cost"], key=int)]
    assert costs[0] == 1.0 and costs == sorted(costs), costs  # relative to one token, monotone
    m = dyncompile.load(plan)
    for p in PROMPTS[:2]:
        assert m.generate(p, max_new_tokens=12).token_ids == m.generate(p, max_new_tokens=12, speculative=False).token_ids


def test_quantized_target_composes_when_its_numerics_do_not_depend_on_the_call(tiny, tmp_path):
    """quantize-int4 with fp32 compute composes with prompt-lookup and split-drafter speculative plans, and the
    output is token-identical to the int4 target alone; int8-activation targets are refused (their logits
    change with the number of tokens per call) unless the user accepts it explicitly."""
    plans = {
        "pl": compile_model(tiny["target"], "quantize-int4{accuracy_level=0},speculative", tmp_path / "pl",
                            drafter="prompt-lookup", verify=True),
        # split-drafter reads the fp32 layer structure, so it runs before quantization
        "split": compile_model(tiny["target"],
                               "split-drafter{layers=1,min_speedup=0},quantize-int4{accuracy_level=0},speculative",
                               tmp_path / "split", calib=str(tiny["calib"]), verify=True),
    }
    for name, res in plans.items():
        assert any(n.op_type == "MatMulNBits" for n in ir.load(res.plan_dir / "model.onnx").graph), name
        m = dyncompile.load(res.plan_dir)
        for p in PROMPTS:
            ref = m.generate(p, max_new_tokens=16, speculative=False)
            assert m.generate(p, max_new_tokens=16).token_ids == ref.token_ids, (name, p)
    for k, spec in enumerate(("quantize-int4,speculative", "quantize-int8,speculative")):
        _refused_or_identical(tiny["target"], spec, tmp_path / f"bad{k}", "depend on how many tokens")
    ok = compile_model(tiny["target"], "quantize-int8,speculative{allow_inexact_target=true}", tmp_path / "inexact",
                       drafter="prompt-lookup")
    assert (ok.plan_dir / "plan.json").is_file()


def _refused_or_identical(target, spec: str, out, needle: str) -> None:
    """An int8-compute target: refused with ``needle`` where this CPU's int8 kernels make a row's logits depend on
    the rows in its call (the pass measures it), else compiled — padded to ``min_rows`` where that makes the rows
    bitwise equal — and then speculative output is the target alone's, token for token."""
    try:
        res = compile_model(target, spec, out, drafter="prompt-lookup")
    except DrafterError as e:
        assert needle in str(e)
        assert not out.exists()
        return
    m = dyncompile.load(res.plan_dir)
    for p in PROMPTS:
        assert m.generate(p, max_new_tokens=16).token_ids == m.generate(p, max_new_tokens=16, speculative=False).token_ids


def test_int8_compute_target_refused_through_cli(tiny, tmp_path, capsys):
    rc, _, err = run_cli(capsys, tiny["target"], "--passes", "quantize-int4,speculative", "--drafter",
                         "prompt-lookup", "-o", tmp_path / "o")
    if rc == 0:  # this CPU's int8 kernels give row-invariant logits (measured by the pass): a plan, token-identical
        _refused_or_identical(tiny["target"], "quantize-int4,speculative", tmp_path / "again", "accuracy_level=0")
        return
    assert_clean_error(rc, err, "accuracy_level=0")


def test_split_drafter_after_quantization_says_to_reorder(tiny, tmp_path):
    # the registry's order constraint (split-drafter before=quantize-*) fires before the model loads
    with pytest.raises(PassConfigError, match="'split-drafter' must come before 'quantize-int4'"):
        compile_model(tiny["target"], "quantize-int4{accuracy_level=0},split-drafter{layers=1,min_speedup=0},speculative",
                      tmp_path / "o", calib=str(tiny["calib"]))


def test_draft_controller_stops_drafting_when_verification_is_too_expensive():
    """An int4 target with fp32-compute MatMulNBits measured 2.9x for a 2-token call: drafting cannot pay, so the
    controller (plan default min_draft=0) drafts nothing but an occasional 1-token probe."""
    ctl = DraftController(initial=4, min_len=0, max_len=8, draft_cost=0.28, alpha0=0.77,
                          verify_cost={1: 1.0, 2: 2.86, 4: 2.86, 9: 3.6})
    lengths = [ctl.next_length(8) for _ in range(40)]
    assert lengths[0] == 4  # the first round tries the plan's initial length
    assert sum(1 for g in lengths[1:] if g > 0) <= 6 and max(lengths[1:]) <= 1
    cheap = DraftController(initial=4, min_len=0, max_len=8, draft_cost=0.13, alpha0=0.77,
                            verify_cost={1: 1.0, 2: 1.09, 4: 1.36, 9: 1.51})
    assert all(cheap.next_length(8) >= 4 for _ in range(10))


def test_cost_probe_past_the_in_memory_limit_goes_through_a_temporary_file(tiny, tmp_path, capsys, monkeypatch):
    """A pass that rewrites the weights (pack-matmuls) leaves them in memory; past protobuf's 2 GB an in-memory
    session cannot be made, so the speculative pass's cost probe opens the model through a temporary external-data
    file (the limit is lowered here so a tiny decoder reaches it) and still measures, and the pipeline's ONNX
    checker checks it with its large weights as typed inputs; when that file cannot be
    written, one clean error names the way out (speculative{measure=false}) and nothing is left behind."""
    import json
    import tempfile

    import dyncompile.passes._infra as infra
    import dyncompile.passes.speculative.probe as probe

    monkeypatch.setattr(infra, "PROTO_LIMIT", 1000)  # the pipeline's checker takes the big-model path too
    seen = []
    real_save = probe.ir.save

    def save(model, path, **kw):
        seen.append(str(path))
        return real_save(model, path, **kw)

    monkeypatch.setattr(probe.ir, "save", save)
    ok = compile_model(tiny["target"], "pack-matmuls,speculative", tmp_path / "ok", drafter="prompt-lookup")
    step = json.loads((ok.plan_dir / "plan.json").read_text())["steps"][-1]
    assert set(step["draft"]["verify_cost"]) >= {"1", "9"}  # timed (measure=false leaves no verify costs)
    assert seen and all(not Path(p).exists() for p in seen)  # the temporary model went once the session was made

    def full(model, path, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(probe.ir, "save", full)
    rc, _, err = run_cli(capsys, tiny["target"], "--passes", "pack-matmuls,speculative", "--drafter",
                         "prompt-lookup", "-o", tmp_path / "o")
    assert_clean_error(rc, err, "measure=false")
    assert "No space left" in err and tempfile.gettempdir() in err
    assert not (tmp_path / "o").exists()


def test_bench_max_drafts_runs_the_step_with_each_longest_draft(plans, tmp_path):
    """``dyncompile bench --max-drafts 1,16``: one extra runner per longest draft, token-identical to the target,
    and the max-1 runner never drafts more than one token per round (the option reaches the draft policy)."""
    from dyncompile.tools.bench import generate as bench_generate

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(f"w{i % 5}" for i in range(k, k + 40))}) + "\n"
                               for k in range(3)))
    rc = bench_generate.main([str(plans["prompt-lookup-unmeasured"]), "--prompts", str(prompts), "--max-new-tokens", "24",
                                 "--max-drafts", "1,16", "--report-dir", str(tmp_path), "--name", "md", "-q"])
    assert rc == 0
    (report,) = tmp_path.glob("md*.json")
    rows = {r["name"]: r for r in json.loads(report.read_text())["results"]}
    assert {"speculative, max draft 1 (ORT)", "speculative, max draft 16 (ORT)"} <= set(rows)
    assert all(r["identical"] == r["of"] == 3 for r in rows.values())
    # drafted tokens per round: capped at 1, while the plan's own policy drafts more on these prompts
    assert rows["speculative, max draft 1 (ORT)"]["mean_tree_nodes"] <= 1.0 < rows["speculative (ORT)"]["mean_tree_nodes"]
    with pytest.raises(DyncompileError, match="max-drafts"):
        bench_generate.main([str(plans["prompt-lookup"]), "--prompts", str(prompts), "--max-drafts", "0"])


# ------------------------------------------------------------------------------------------- confidence stop


def _drafter_confidences(drafter, seq, chain):
    """The drafter's top probability at each drafted token of ``chain`` (greedy), from one fresh forward."""
    drafter.reset(seq)
    logits = drafter.decoder.forward([*seq, *chain[:-1]], last=len(chain))
    p = probs_from_logits(logits, 1.0)
    return p.max(axis=-1)


def test_confidence_stop_ends_the_chain_after_the_first_unsure_token(loaded):
    """``stop_below``: the chain is the full-length chain cut right after its first token the drafter gives less than
    that probability (computed here from the drafter's own logits), and greedy output stays the target's."""
    m = loaded["external"]
    drafter = m.handlers[0].drafter
    kw = dict(sample=False, temperature=1.0, rng=np.random.default_rng(0), vocab_size=VOCAB)
    fired = 0
    for prompt in PROMPTS:
        drafter.reset(prompt)
        drafter.stop_below = 0.0
        full, _ = drafter.propose(list(prompt), 6, **kw)
        conf = _drafter_confidences(drafter, list(prompt), full)
        assert len(full) == 6
        for stop in sorted({*np.round(conf, 6), 0.999999}):
            drafter.reset(prompt)
            drafter.stop_below = float(stop)
            cut, _ = drafter.propose(list(prompt), 6, **kw)
            below = [i for i, c in enumerate(conf) if c < stop]
            assert cut == full[: below[0] + 1 if below else 6], (prompt, stop, conf)
            fired += bool(below) and below[0] < 5
    drafter.stop_below = 0.0
    assert fired >= 3  # the stop really cut chains short (not only at the end)
    ref = loaded["plain"]
    for prompt in PROMPTS:
        want = ref.generate(prompt, max_new_tokens=40).token_ids
        full = m.generate(prompt, max_new_tokens=40, draft_length=6, adaptive=False)
        cut = m.generate(prompt, max_new_tokens=40, draft_length=6, adaptive=False, stop_below=0.9)
        assert full.token_ids == cut.token_ids == want
        assert cut.stats.drafted < full.stats.drafted and max(full.stats.draft_lengths) == 6


def test_confidence_stop_from_the_plan_and_bad_values(tiny, loaded, tmp_path, capsys):
    """``speculative{stop_below=P}`` records P in the plan's draft policy and the runtime drafts with it by default
    (a call's option overrides it); values outside [0, 1] are one clean error at compile time and at run time."""
    plan = compile_model(tiny["target"], "speculative{stop_below=0.999,draft_length=6,adaptive=false}",
                         tmp_path / "cs", drafter=str(tiny["draft"])).plan_dir
    assert json.loads((plan / "plan.json").read_text())["steps"][0]["draft"]["stop_below"] == 0.999
    m = dyncompile.load(plan)
    r = m.generate(PROMPTS[0], max_new_tokens=30)
    assert set(r.stats.draft_lengths) <= {0, 1} and r.stats.draft_lengths[1] >= r.stats.rounds - 1  # never 99.9 % sure
    # (the last round has no room left to draft)
    off = m.generate(PROMPTS[0], max_new_tokens=30, stop_below=0.0)
    assert max(off.stats.draft_lengths) == 6 and off.token_ids == r.token_ids
    for bad in (1.5, -0.1, "0.5", True):
        with pytest.raises(PromptError, match="stop_below"):
            loaded["external"].generate(PROMPTS[0], max_new_tokens=4, stop_below=bad)
    rc, _, err = run_cli(capsys, tiny["target"], "--passes", "speculative{stop_below=1.5}", "--drafter",
                         str(tiny["draft"]), "-o", tmp_path / "bad")
    assert_clean_error(rc, err, "stop_below")
    assert not (tmp_path / "bad").exists()


def test_speculative_sampling_with_a_confidence_stop_is_exact(sampling_plans):
    """The stop reads only the drafter's distribution, so sampling stays exact (chi-square as above), while it
    really shortened rounds."""
    m = sampling_plans[0]
    expected = _exact_joint(m, [1, 2, 3, 4], 1.0)
    counts = np.zeros((8, 8))
    lengths: dict[int, int] = {}
    for seed in range(3000):
        r = m.generate([1, 2, 3, 4], max_new_tokens=4, sample=True, temperature=1.0, seed=seed, stop_below=0.5)
        counts[r.token_ids[1], r.token_ids[2]] += 1
        for k, v in r.stats.draft_lengths.items():
            lengths[k] = lengths.get(k, 0) + v
    assert lengths.get(1, 0) > 300 and lengths.get(2, 0) > 300  # both cut and full-length rounds
    assert chi_square_p(counts, expected) > 1e-3


def test_bench_stop_below_runs_the_step_with_each_threshold(tiny, tmp_path):
    """``dyncompile bench --stop-below 0.999``: one extra runner, token-identical, drafting one token per round
    where the plan's own policy drafts six."""
    from dyncompile.tools.bench import generate as bench_generate

    plan = compile_model(tiny["target"], "speculative{draft_length=6,adaptive=false}", tmp_path / "six",
                         drafter=str(tiny["draft"])).plan_dir

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(f"w{i % 7}" for i in range(k, k + 12))}) + "\n"
                               for k in range(3)))
    rc = bench_generate.main([str(plan), "--prompts", str(prompts), "--max-new-tokens", "24",
                              "--stop-below", "0.999", "--report-dir", str(tmp_path), "--name", "sb", "-q"])
    assert rc == 0
    (report,) = tmp_path.glob("sb*.json")
    rows = {r["name"]: r for r in json.loads(report.read_text())["results"]}
    assert all(r["identical"] == r["of"] == 3 for r in rows.values())
    assert rows["speculative, stop below 0.999 (ORT)"]["mean_tree_nodes"] <= 1.0
    assert rows["speculative (ORT)"]["mean_tree_nodes"] >= 4.0  # six a round but the last rounds, cut by the budget
    with pytest.raises(DyncompileError, match="stop-below"):
        bench_generate.main([str(plan), "--prompts", str(prompts), "--stop-below", "1.5"])


def test_verify_costs_pair_the_calls_of_a_round(monkeypatch):
    """The verification cost curve is the median of ``t(s) / t(1)`` within round-robin rounds: a burst of machine
    speed during one single-token call (here 25 % faster, ending before that round's next call) leaves it exact,
    where the ratio of each size's fastest call reads the burst as verification cost. A fake clock, no timing."""
    from dyncompile.passes.speculative import probe

    cost = {1: 1.0, 2: 1.03, 4: 1.1, 9: 1.5}
    clock = [0.0]
    calls = []

    class Session:
        def run(self, names, feeds):
            size = feeds["ids"].shape[1]
            calls.append(size)
            burst = len(calls) == 3  # prefill, warm-up, then round 0's single-token call
            clock[0] += cost.get(size, 10.0) * (0.8 if burst else 1.0)
            return [np.zeros((1, size, 4), np.float32)]

    monkeypatch.setattr(probe.time, "perf_counter", lambda: clock[0])
    spec = {"input_ids": "ids", "logits": "logits", "kv": []}
    rounds = probe.measure_step_rounds(Session(), spec, list(range(16)), [1, 2, 4, 9], repeats=5)
    assert calls == [16, 1] + [1, 2, 4, 9] * 5 and len(rounds) == 5
    assert probe.relative_verify_costs(rounds) == {s_: round(c, 4) for s_, c in cost.items()}
    # the fastest call of each size: the burst's single-token call becomes the unit, every cost 25 % too high
    fastest = probe.fastest_times(rounds)
    assert round(fastest[1], 4) == 0.8
    assert round(fastest[2] / fastest[1], 4) == round(1.03 / 0.8, 4) and round(fastest[9] / fastest[1], 4) == round(1.5 / 0.8, 4)


def test_bench_chain_options_run_chains_on_a_tree_plan():
    """``--stop-below`` and ``--max-drafts`` are chain options: their runners ask for chains (``tree=False``), so on a
    plan whose default is a draft tree (Medusa, EAGLE) they measure the option instead of the plan's tree."""
    from types import SimpleNamespace

    from dyncompile.tools.bench.generate import plan_runners

    calls = []

    class Model:
        plan = SimpleNamespace(steps=[SimpleNamespace(kind="speculative_generate", params={})])
        handlers = [SimpleNamespace(last_rounds=[])]

        def generate(self, ids, max_new_tokens, **opts):
            calls.append(opts)
            return SimpleNamespace(token_ids=list(ids), stats=SimpleNamespace(seconds=0.0, to_dict=dict))

    runners = {r.name: r for r in plan_runners(Model(), stop_below=(0.5,), max_drafts=(3,))}
    runners["speculative, stop below 0.5 (ORT)"].fn([1], 4)
    runners["speculative, max draft 3 (ORT)"].fn([1], 4)
    runners["speculative (ORT)"].fn([1], 4)
    assert calls == [{"stop_below": 0.5, "tree": False}, {"max_draft": 3, "tree": False}, {}]


# ------------------------------------------------------------------------------------------- drafter vocabulary


@pytest.fixture(scope="module")
def vocab_plans(tiny, module_tmp):
    """An int4 drafter (MatMulNBits head) and plans with its LM head trimmed to the calibration text's 8 commonest
    tokens: one from the int4 drafter, one from the float drafter."""
    root = module_tmp("draft-vocab")
    q = compile_model(tiny["draft"], "quantize-int4{block_size=16,lm_head_bits=4}", root / "d-int4", opt_level=0)
    shutil.copy(tiny["draft"].parent / "tokenizer.json", q.plan_dir / "tokenizer.json")
    shutil.copy(tiny["draft"].parent / "dyncompile-model.json", q.plan_dir / "dyncompile-model.json")
    out = {"int4-drafter": q.plan_dir / "model.onnx"}
    for name, drafter in (("int4", out["int4-drafter"]), ("float", tiny["draft"])):
        out[name] = compile_model(tiny["target"], "speculative{draft_vocab=8,draft_length=4,adaptive=false}",
                                  root / name, drafter=str(drafter), calib=str(tiny["calib"]), verify=True).plan_dir
    return out


def _calib_top8(tiny):
    from tokenizers import Tokenizer

    from dyncompile.passes.speculative.split_drafter import frequent_subset

    ids = np.asarray(Tokenizer.from_file(str(tiny["target"].parent / "tokenizer.json"))
                     .encode(tiny["calib"].read_text()).ids)
    return frequent_subset(np.bincount(ids, minlength=VOCAB).astype(float), 8)


@pytest.mark.parametrize("which", ["int4", "float"])
def test_draft_vocab_trims_the_drafters_head_to_the_calibration_texts_commonest_tokens(tiny, vocab_plans, loaded,
                                                                                         which):
    """``speculative{draft_vocab=8}``: the plan's drafter computes 8 logits, those of the calibration text's 8
    commonest tokens (``drafter_vocab`` maps them back), equal to the untrimmed drafter's logits there (MatMulNBits
    and MatMul heads, ORT_DISABLE_ALL); the head's full weights are gone from the drafter; it drafts only those
    tokens; greedy output is the target's."""
    from helpers import plan_kv_decoder

    plan = vocab_plans[which]
    step = json.loads((plan / "plan.json").read_text())["steps"][0]
    assert step["drafter"]["vocab"] == "drafter_vocab"
    subset = np.load(plan / "drafter_vocab.npy")
    want = _calib_top8(tiny)
    np.testing.assert_array_equal(subset, want)
    assert len(set(want)) == 8 and want.max() < VOCAB  # and not simply the 8 lowest ids:
    assert want.tolist() != list(range(8))
    full_src = vocab_plans["int4-drafter"] if which == "int4" else tiny["draft"]
    ids = [3, 9, 1, 14, 7, 2]
    trimmed = plan_kv_decoder(plan / "drafter.onnx").forward(ids)
    full = plan_kv_decoder(Path(full_src)).forward(ids)
    assert trimmed.shape == (len(ids), 8)
    np.testing.assert_array_equal(trimmed, full[:, subset])
    d = ir.load(str(plan / "drafter.onnx"))
    head = next(v for v in d.graph.outputs if v.name == step["drafter"]["decoder"]["logits"]).producer()
    assert head.op_type == ("MatMulNBits" if which == "int4" else "MatMul")
    if which == "int4":
        assert head.attributes.get_int("N") == 8
    assert not [n for n, v in d.graph.initializers.items() if not v.uses()]  # the full head's weights are gone
    m = dyncompile.load(plan)
    drafter = m.handlers[0].drafter
    drafted = set()
    for prompt in PROMPTS:
        res = m.generate(prompt, max_new_tokens=30)
        assert res.token_ids == loaded["plain"].generate(prompt, max_new_tokens=30).token_ids
        drafter.reset(prompt)
        toks, _ = drafter.propose(list(prompt), 6, sample=False, temperature=1.0, rng=np.random.default_rng(0),
                                  vocab_size=VOCAB)
        drafted.update(toks)
    assert drafted and drafted <= set(subset.tolist())


def test_draft_vocab_needs_calibration_text_and_a_drafter_model(tiny, tmp_path, capsys):
    """Without --calib, or with prompt lookup, ``draft_vocab`` is one clean error and nothing is written."""
    rc, _, err = run_cli(capsys, tiny["target"], "--passes", "speculative{draft_vocab=8}", "--drafter",
                         str(tiny["draft"]), "-o", tmp_path / "a")
    assert_clean_error(rc, err, "--calib")
    rc, _, err = run_cli(capsys, tiny["target"], "--passes", "speculative{draft_vocab=8}", "--drafter",
                         "prompt-lookup", "--calib", str(tiny["calib"]), "-o", tmp_path / "b")
    assert_clean_error(rc, err, "--drafter DRAFT.onnx")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_python_api_trimmed_drafter_and_its_ids_must_agree(tiny):
    """``trim_drafter_vocab`` + ``SpeculativePass(drafter, drafter_vocab=ids)``: ids that do not match the trimmed
    head are refused before anything is recorded; matching ids are recorded and the pass is idempotent."""
    from dyncompile.passes.speculative import trim_drafter_vocab

    target = ir.load(str(tiny["target"]))
    drafter = ir.load(str(tiny["draft"]))
    ids = [1, 3, 4, 9, 15]
    trim_drafter_vocab(drafter, ids)
    with pytest.raises(DrafterError, match="drafter_vocab names 4 token ids"):
        SpeculativePass(drafter, drafter_vocab=ids[:4], measure=False)(target)
    assert "dyncompile.speculative" not in target.metadata_props
    p = SpeculativePass(drafter, drafter_vocab=ids, measure=False)
    assert p(target).modified
    rec = json.loads(target.metadata_props["dyncompile.speculative"])
    assert rec["drafter"]["draft_vocab"] == 5
    assert not p(target).modified
    with pytest.raises(DrafterError, match="drafter_vocab"):
        SpeculativePass("prompt-lookup", drafter_vocab=ids)
