"""Medusa heads: the heads graph (golden against numpy), the pass (idempotent, refuses foreign heads), the plan schema,
Medusa's sparse tree, greedy token identity with the target alone and exact sampling (chi-square, with a negative
control) on tiny generated decoders with random heads, and one real-model check on SmolLM2-135M."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

import dyncompile
import dyncompile.runtime.decode.speculative as runtime_speculative
from dyncompile.errors import PlanError
from dyncompile.models.synthetic_decoder import tiny_decoder, write_decoder_dir
from dyncompile.passes.compiler import compile_model
from dyncompile.passes.speculative.decoder_spec import DrafterError
from dyncompile.passes.speculative.medusa_heads import FEATURES, MedusaHeadsPass, lm_head_of
from dyncompile.plan._typed import from_json
from dyncompile.plan.decode import DrafterParams, SpeculativeParams
from dyncompile.runtime.decode.drafters import TreeBudget
from dyncompile.runtime.decode.medusa import IDS_OUTPUT, LOGP_OUTPUT, MedusaDrafter, sparse_tree
from dyncompile.tools.train_drafter import fingerprint

EOS_UNUSED = 99


def write_random_heads(out: Path, target_onnx: Path, *, heads: int = 3, scale: float = 0.5, seed: int = 0,
                       vocab: np.ndarray | None = None, lm_heads: bool = False) -> Path:
    """Random Medusa heads for ``target_onnx`` (token identity and exact sampling hold for any heads); with
    ``lm_heads``, each head also gets its own random LM head over ``vocab`` (Medusa-1's per-head LM heads)."""
    _, _, w_lm, _ = lm_head_of(ir.load(str(target_onnx)))
    H, V = w_lm.shape
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    vocab = np.arange(V) if vocab is None else np.asarray(vocab, np.int64)
    extra = {"lm": rng.standard_normal((heads, H, len(vocab))).astype(np.float32)} if lm_heads else {}
    np.savez(out / "medusa_heads.npz", w=(rng.standard_normal((heads, H, H)) * scale / np.sqrt(H)).astype(np.float32),
             b=(rng.standard_normal((heads, H)) * 0.1).astype(np.float32), vocab=vocab, **extra)
    (out / "medusa_heads.json").write_text(json.dumps({
        "format": "dyncompile.medusa_heads/v1", "target": "tiny", "heads": heads,
        "lm_head": {"fingerprint": fingerprint(w_lm)}, "eval": {"head_top1_agreement": [0.5] * heads}}))
    return out


@pytest.fixture(scope="module")
def tiny(module_tmp):
    root = module_tmp("medusa_tiny")
    t = write_decoder_dir(root / "t", tiny_decoder(num_layers=2, vocab=8, seed=0, logit_scale=1.5), eos=EOS_UNUSED)
    heads = write_random_heads(root / "heads", t)
    spec = f"medusa-heads{{head={heads},topk=3}},explicit-attention,speculative{{tree=true,tree_nodes=6,measure=false}}"
    plan = compile_model(t, spec, root / "plan", opt_level=0).plan_dir
    hybrid = compile_model(t, spec.replace("measure=false", "measure=false,hybrid=true"), root / "hybrid",
                           opt_level=0).plan_dir
    return {"root": root, "target": t, "heads": heads, "plan": plan, "hybrid": hybrid}


def test_heads_graph_matches_numpy(tiny):
    plan = json.loads((tiny["plan"] / "plan.json").read_text())
    d = plan["steps"][0]["drafter"]
    assert d == {"kind": "medusa", "name": "medusa", "heads_model": "drafter", "features": FEATURES, "heads": 3,
                 "topk": 3}
    onnx.checker.check_model(str(tiny["plan"] / "drafter.onnx"), full_check=True)
    # the full-vocabulary heads share the target's LM head tensor (external data of the target)
    assert plan["files"]["drafter"]["external_data"] == ["model.onnx.data"]
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    s = ort.InferenceSession(str(tiny["plan"] / "drafter.onnx"), so, providers=["CPUExecutionProvider"])
    z = np.load(tiny["heads"] / "medusa_heads.npz")
    _, _, w_lm, _ = lm_head_of(ir.load(str(tiny["target"])))
    h = np.random.default_rng(1).standard_normal((2, w_lm.shape[0])).astype(np.float32)
    logp, ids = s.run(["medusa_logp", "medusa_ids"], {FEATURES: h})
    for k in range(3):
        a = h @ z["w"][k] + z["b"][k]
        lg = (h + a / (1 + np.exp(-a))) @ w_lm
        ref = lg - np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1, keepdims=True)) - lg.max(-1, keepdims=True)
        top = np.argsort(-ref, -1)[:, :3]
        np.testing.assert_array_equal(ids[k], top)
        np.testing.assert_allclose(logp[k], np.take_along_axis(ref, top, -1), atol=1e-4)


def test_per_head_lm_heads_graph_matches_numpy_and_decodes_token_identical(tiny, tmp_path):
    """Medusa-1's own LM head per head (``lm`` [K, H, Vd] in the head file): the heads graph multiplies each head's
    block output by its own matrix (not the target's), over the draft vocabulary; greedy decoding stays the target's."""
    vocab = np.asarray([0, 2, 3, 5, 7])
    heads = write_random_heads(tmp_path / "heads", tiny["target"], vocab=vocab, lm_heads=True, seed=3)
    plan = compile_model(tiny["target"], f"medusa-heads{{head={heads},topk=3}},explicit-attention,"
                         "speculative{tree=true,tree_nodes=6,measure=false}", tmp_path / "plan", opt_level=0).plan_dir
    onnx.checker.check_model(str(plan / "drafter.onnx"), full_check=True)
    g = ir.load(str(plan / "drafter.onnx")).graph
    assert "medusa.lm_heads" in g.initializers and "medusa.lm_head" not in g.initializers
    m0 = ir.load(str(tiny["target"]))
    MedusaHeadsPass(heads, topk=3)(m0)
    assert json.loads(m0.metadata_props["dyncompile.medusa"])["lm_heads"] == "per head"
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    s = ort.InferenceSession(str(plan / "drafter.onnx"), so, providers=["CPUExecutionProvider"])
    z = np.load(heads / "medusa_heads.npz")
    h = np.random.default_rng(4).standard_normal((3, z["w"].shape[1])).astype(np.float32)
    logp, ids = s.run(["medusa_logp", "medusa_ids"], {FEATURES: h})
    for k in range(3):
        a = h @ z["w"][k] + z["b"][k]
        lg = (h + a / (1 + np.exp(-a))) @ z["lm"][k]  # head k's own LM head
        ref = lg - lg.max(-1, keepdims=True)
        ref -= np.log(np.exp(ref).sum(-1, keepdims=True))
        top = np.argsort(-ref, -1)[:, :3]
        np.testing.assert_array_equal(ids[k], vocab[top])
        np.testing.assert_allclose(logp[k], np.take_along_axis(ref, top, -1), atol=1e-4)
    m = dyncompile.load(plan)
    ref_ids = m.generate([1, 2, 3, 4], max_new_tokens=16, speculative=False).token_ids
    r = m.generate([1, 2, 3, 4], max_new_tokens=16, tree=False, draft_length=3, adaptive=False)
    assert r.token_ids == ref_ids and r.stats.drafted > 0
    # a head file whose LM heads do not fit its vocabulary is refused with what to do
    bad = tmp_path / "bad"
    write_random_heads(bad, tiny["target"], vocab=vocab[:4], lm_heads=True)
    zz = dict(np.load(bad / "medusa_heads.npz"))
    zz["lm"] = zz["lm"][:, :, :3]
    np.savez(bad / "medusa_heads.npz", **zz)
    with pytest.raises(DrafterError, match="per-head LM heads are .* retrain"):
        MedusaHeadsPass(bad)(ir.load(str(tiny["target"])))


def test_target_features_are_the_lm_head_input(tiny):
    m = ir.load(str(tiny["plan"] / "model.onnx"))
    f = next(v for v in m.graph.outputs if v.name == FEATURES)
    node, h, _, _ = lm_head_of(m)
    assert h is f and [o.name for o in m.graph.outputs][0] == "logits"


def test_pass_is_idempotent_and_refuses_foreign_heads(tiny, tmp_path):
    m = ir.load(str(tiny["target"]))
    n_nodes = len(list(m.graph))
    p = MedusaHeadsPass(tiny["heads"], topk=3)
    assert p(m).modified is True
    assert p(m).modified is False
    assert len(list(m.graph)) == n_nodes  # one more output, no compute
    other = write_decoder_dir(tmp_path / "o", tiny_decoder(num_layers=2, vocab=8, seed=5), eos=EOS_UNUSED)
    with pytest.raises(DrafterError, match="another LM head"):
        MedusaHeadsPass(tiny["heads"])(ir.load(str(other)))
    with pytest.raises(DrafterError, match="holds no Medusa heads"):
        MedusaHeadsPass(tmp_path)(ir.load(str(other)))


def _drafter(**kw):
    d = {"kind": "medusa", "heads_model": "drafter", "features": FEATURES, "heads": 3, "topk": 4, **kw}
    return from_json(DrafterParams, d, "plan step: drafter")


@pytest.mark.parametrize("kw,msg", [
    ({"heads": 0}, "heads"), ({"heads": 17}, "heads"), ({"topk": 0}, "topk"), ({"topk": 65}, "topk"),
    ({"heads_model": None}, "heads_model"), ({"features": None}, "features"),
    ({"share_kv": [0]}, "share_kv"), ({"vocab": "v"}, "vocab"),
])
def test_schema_refuses_bad_medusa_params(kw, msg):
    assert _drafter().heads == 3
    with pytest.raises(PlanError, match=msg):
        _drafter(**kw)


def test_schema_names_the_heads_file():
    step = {"target": {"model": "model", "kv": [{"past": "p", "present": "q"}]},
            "drafter": {"kind": "medusa", "heads_model": "drafter", "features": FEATURES}}
    sp = from_json(SpeculativeParams, step, "plan step")
    assert ("drafter.heads_model", "drafter") in sp.file_keys()


def test_sparse_tree_takes_the_most_probable_paths():
    ids = np.asarray([[10, 11, 12], [20, 21, 22]])
    logp = np.log(np.asarray([[0.6, 0.3, 0.1], [0.5, 0.4, 0.1]]))
    t = sparse_tree(7, ids, logp, TreeBudget(max_nodes=4, max_depth=2, branching=3))
    # path scores: 10 .6, 10-20 .30, 10-21 .24, 11 .3 (tie with 10-20: shallower and earlier first), 11-20 .15 ...
    got = {tuple(t.tokens[i] for i in t.path_to(n)[1:]) for n in range(1, len(t))}
    assert got == {(10,), (10, 20), (11,), (10, 21)} and t.tokens[0] == 7
    assert t.children[0][0] == 1 and t.tokens[1] == 10  # the first child is the best one
    chain = sparse_tree(7, ids, logp, TreeBudget(max_nodes=8, max_depth=1, branching=2))
    assert sorted(chain.tokens[1:]) == [10, 11] and chain.max_depth == 1


def test_greedy_token_identical_on_the_tiny_decoder(tiny):
    m = dyncompile.load(tiny["plan"])
    for prompt in ([1, 2, 3, 4], [5, 6, 5, 6, 5]):
        ref = m.generate(prompt, max_new_tokens=20, speculative=False)
        for opts in (dict(tree=False, draft_length=3, adaptive=False),
                     dict(tree={"adaptive": False, "max_nodes": 6, "max_depth": 3, "branching": 3})):
            r = m.generate(prompt, max_new_tokens=20, **opts)
            assert r.token_ids == ref.token_ids, opts
            assert r.stats.drafter == "medusa" and r.stats.drafted > 0 and r.stats.target_calls == r.stats.rounds + 1


class _FixedHeads:
    """A heads session that always answers the same ``[K, 1, topk]`` candidates."""

    def __init__(self, ids, probs):
        self.ids = np.asarray(ids, np.int64)[:, None, :]
        self.logp = np.log(np.asarray(probs, np.float32))[:, None, :]

    def get_inputs(self):
        return [type("I", (), {"name": "medusa_features"})()]

    def get_outputs(self):
        return [type("O", (), {"name": n})() for n in (LOGP_OUTPUT, IDS_OUTPUT)]

    def run(self, names, feeds):
        return [self.logp if n == LOGP_OUTPUT else self.ids for n in names]


def _chain(ids, probs, n, stop_below, vocab_size=100):
    d = MedusaDrafter(_FixedHeads(ids, probs), features="f", heads=len(ids), topk=len(ids[0]))
    d._h = np.zeros(4, np.float32)
    d.stop_below = stop_below
    return d.propose([1], n, sample=False, temperature=1.0, rng=None, vocab_size=vocab_size)[0]


def test_medusa_chain_stops_after_the_first_unsure_head():
    ids, probs = [[10, 11], [20, 21], [30, 31]], [[0.9, 0.1], [0.4, 0.3], [0.8, 0.1]]
    assert _chain(ids, probs, 3, 0.0) == [10, 20, 30]
    assert _chain(ids, probs, 3, 0.5) == [10, 20]          # head 2 is unsure: drafted, then the chain ends
    assert _chain(ids, probs, 3, 0.95) == [10]             # every head unsure: one draft (1.0: one per round)
    assert _chain(ids, probs, 2, 0.3) == [10, 20]          # the round's length still caps it
    # a head whose token the target cannot take ends the chain; the next head's token never moves up a depth
    assert _chain([[10], [200], [30]], [[0.9], [0.9], [0.9]], 3, 0.0, vocab_size=100) == [10]


def test_medusa_stop_below_keeps_greedy_output_and_drafts_less(tiny):
    m = dyncompile.load(tiny["plan"])
    prompt = [1, 2, 3, 4]
    ref = m.generate(prompt, max_new_tokens=20, speculative=False)
    full = m.generate(prompt, max_new_tokens=20, tree=False, draft_length=3, adaptive=False)
    one = m.generate(prompt, max_new_tokens=20, tree=False, draft_length=3, adaptive=False, stop_below=1.0)
    assert full.token_ids == one.token_ids == ref.token_ids
    # stop 1.0: one head's token a round (none in a last round with one token left); without it, all three
    assert set(one.stats.draft_lengths) <= {0, 1} and max(full.stats.draft_lengths) == 3
    assert one.stats.drafted < full.stats.drafted


def test_hybrid_prompt_lookup_and_medusa_is_token_identical(tiny):
    plan = json.loads((tiny["hybrid"] / "plan.json").read_text())
    assert plan["steps"][0]["drafter"]["prompt_lookup"] is True
    m = dyncompile.load(tiny["hybrid"])
    prompt = [5, 6, 5, 6, 5, 6, 5]
    ref = m.generate(prompt, max_new_tokens=20, speculative=False)
    r = m.generate(prompt, max_new_tokens=20, tree={"adaptive": False, "max_nodes": 6, "max_depth": 3, "branching": 3})
    assert r.token_ids == ref.token_ids and r.stats.drafted > 0


def test_hybrid_option_runs_each_part_alone(tiny):
    """``hybrid=False`` / ``"prompt-lookup"`` draft with one part of the hybrid only; greedy stays the target's."""
    from dyncompile.runtime.decode.drafters import HybridDrafter
    from dyncompile.runtime.decode.generate import PromptError

    m = dyncompile.load(tiny["hybrid"])
    hybrid = m.handlers[0].drafter
    assert isinstance(hybrid, HybridDrafter)
    prompt = [5, 6, 5, 6, 5, 6, 5]
    ref = m.generate(prompt, max_new_tokens=20, speculative=False)
    both = m.generate(prompt, max_new_tokens=20, tree=False)
    heads = m.generate(prompt, max_new_tokens=20, tree=False, hybrid=False)
    lookup = m.generate(prompt, max_new_tokens=20, tree=False, hybrid="prompt-lookup")
    assert both.token_ids == heads.token_ids == lookup.token_ids == ref.token_ids
    assert (both.stats.drafter, heads.stats.drafter, lookup.stats.drafter) == (
        hybrid.name, hybrid.other.name, hybrid.lookup.name)
    assert len({both.stats.drafter, heads.stats.drafter, lookup.stats.drafter}) == 3
    # the repeating prompt: prompt lookup drafts every round; the heads alone draft what the heads say
    assert lookup.stats.drafted > 0 and heads.stats.drafted > 0
    with pytest.raises(PromptError, match="hybrid must be"):
        m.generate(prompt, max_new_tokens=4, hybrid="medusa")
    with pytest.raises(PromptError, match="is not one"):
        dyncompile.load(tiny["plan"]).generate(prompt, max_new_tokens=4, hybrid=False)


def test_bench_runs_a_hybrid_plans_parts_alone(tiny):
    from dyncompile.tools.bench.generate import plan_runners

    names = [r.name for r in plan_runners(dyncompile.load(tiny["hybrid"]))]
    assert names == ["target alone (ORT)", "speculative (ORT)", "speculative, drafter alone (ORT)",
                     "speculative, prompt lookup alone (ORT)"]
    tree_names = [r.name for r in plan_runners(dyncompile.load(tiny["hybrid"]), tree=True)]
    assert "speculative tree, adaptive, drafter alone (ORT)" in tree_names
    assert "speculative chain, prompt lookup alone (ORT)" in tree_names and len(tree_names) == 7
    # negative control: a plan without prompt lookup gets no part runners
    assert [r.name for r in plan_runners(dyncompile.load(tiny["plan"]))] == ["target alone (ORT)", "speculative (ORT)"]
    runner = dict((r.name, r) for r in plan_runners(dyncompile.load(tiny["hybrid"])))
    run = runner["speculative, prompt lookup alone (ORT)"].fn([5, 6, 5, 6, 5, 6, 5], 8)
    assert run.stats["drafter"] == "prompt-lookup" and run.ids == runner["target alone (ORT)"].fn([5, 6, 5, 6, 5, 6, 5], 8).ids


# ------------------------------------------------------------------------------------------- exact sampling

def _chi_square_p(observed: np.ndarray, expected_probs: np.ndarray) -> float:
    from dyncompile.runtime.rules.chi2 import chi2_sf

    n = observed.sum()
    e = expected_probs.reshape(-1) * n
    o = observed.reshape(-1).astype(float)
    small = e < 5
    e, o = np.append(e[~small], e[small].sum()), np.append(o[~small], o[small].sum())
    if e[-1] == 0:
        e, o = e[:-1], o[:-1]
    return chi2_sf(float(((o - e) ** 2 / e).sum()), len(e) - 1)


def _exact_joint(m, prompt):
    """The target's own distribution of new tokens 2 and 3 (token 1 marginalised), by enumeration."""
    from dyncompile.runtime.rules.sampling import probs_from_logits

    tgt = m.handlers[0].target
    tgt.reset()
    p1 = probs_from_logits(tgt.forward(prompt)[-1], 1.0)
    joint = np.zeros((8, 8))
    for a in range(8):
        for b in range(8):
            tgt.reset()
            lg = tgt.forward([*prompt, a, b])
            joint[b] += p1[a] * probs_from_logits(lg[-2], 1.0)[b] * probs_from_logits(lg[-1], 1.0)
    return joint


def _sample_joint(m, prompt, n):
    counts = np.zeros((8, 8))
    acc = drafted = 0
    tree = {"adaptive": False, "max_nodes": 6, "max_depth": 2, "branching": 3}
    for seed in range(n):
        r = m.generate(prompt, max_new_tokens=4, sample=True, temperature=1.0, seed=seed, tree=tree)
        counts[r.token_ids[1], r.token_ids[2]] += 1
        acc += r.stats.accepted
        drafted += r.stats.drafted
    return counts, acc, drafted


def test_medusa_tree_sampling_reproduces_the_target_distribution(tiny):
    m = dyncompile.load(tiny["plan"])
    expected = _exact_joint(m, [1, 2, 3, 4])
    counts, acc, drafted = _sample_joint(m, [1, 2, 3, 4], 2000)
    assert acc > 300 and drafted - acc > 300  # drafts were both accepted and rejected
    assert _chi_square_p(counts, expected) > 1e-3


def test_chi_square_detects_a_wrong_tree_sampler(tiny, monkeypatch):
    """Negative control: accepting a node's first child whenever it exists is not exact; the test rejects it."""
    m = dyncompile.load(tiny["plan"])
    expected = _exact_joint(m, [1, 2, 3, 4])

    def first_child(tree, p, rng):
        from dyncompile.runtime.rules.sampling import sample_from

        path = [0]
        while tree.children[path[-1]]:
            path.append(tree.children[path[-1]][0])
        return path, sample_from(p[path[-1]], rng)

    monkeypatch.setattr(runtime_speculative, "accept_sampling", first_child)
    counts, _, _ = _sample_joint(m, [1, 2, 3, 4], 1000)
    assert _chi_square_p(counts, expected) < 1e-6


# ------------------------------------------------------------------------------------------- SmolLM2

@pytest.mark.slow
def test_smollm2_trained_medusa_heads_greedy_token_identical(smollm2, module_tmp):
    """Heads trained on CPU in seconds (train-drafter --kind medusa: a draft vocabulary, so the heads graph holds the
    LM head's rows for it), compiled and run: greedy output is the target's, drafts are proposed."""
    pytest.importorskip("torch")
    from dyncompile.tools.bench.prompt_sets import CODE_FILES
    from dyncompile.tools.train_medusa import train_medusa

    root = module_tmp("medusa_smol")
    info = train_medusa(smollm2.onnx_path.parent, root / "heads", heads=3, steps=20, batch=64, seq_len=64,
                        max_tokens=2000, draft_vocab=1024, threads=2, distill_sequences=3, distill_prompt=16,
                        distill_new=48, eval_every=5)
    assert info["heads"] == 3 and set(CODE_FILES) <= set(info["corpus"]["held_out"])
    # 2000 tokens = 31 windows of 64: 3 held out, 28 + the 3 continuations (16 + 48 = 64 tokens each) train
    corpus = info["corpus"]
    assert corpus["distilled_sequences"] == 3 and corpus["train_windows"] == 28 + 3 and corpus["eval_windows"] == 3
    assert info["training"]["train_positions"] == corpus["train_windows"] * (64 - 3)
    # the eval curve every 5 steps; the heads kept are those of the highest summed agreement on it (the first such)
    curve = info["curve"]
    assert [c["step"] for c in curve] == [5, 10, 15, 20] and [c["positions"] for c in curve] == [320, 640, 960, 1280]
    best = max(curve, key=lambda c: sum(c["agreement"]))
    if sum(best["agreement"]) > sum(info["eval"]["before_training"]["head_top1_agreement"]):
        assert info["training"]["kept_step"] == best["step"] and info["eval"]["head_top1_agreement"] == best["agreement"]
    else:
        assert info["training"]["kept_step"] == 0
    assert np.load(root / "heads" / "medusa_heads.npz")["vocab"].shape == (1024,)
    plan = compile_model(smollm2.onnx_path, f"medusa-heads{{head={root / 'heads'}}},explicit-attention,"
                         "speculative{tree=true,measure=false}", root / "plan", progress=False, opt_level=0).plan_dir
    drafter = ir.load(str(plan / "drafter.onnx"))
    assert drafter.graph.initializers["medusa.lm_head"].const_value.shape == (576, 1024)
    m = dyncompile.load(plan, session_config={"session.intra_op.allow_spinning": "0"})
    code = (Path(sysconfig.get_paths()["stdlib"]) / "bisect.py").read_text()
    prompt = code[: code.index("def bisect_right")] + "def bisect_right(a, x, lo=0, hi=None, *, key=None):\n"
    ref = m.generate(prompt, max_new_tokens=24, speculative=False)
    for opts in (dict(tree={"adaptive": False, "max_nodes": 16, "max_depth": 3, "branching": 4}),
                 dict(tree=False, draft_length=3, adaptive=False)):
        r = m.generate(prompt, max_new_tokens=24, **opts)
        assert r.token_ids == ref.token_ids and r.stats.drafted > 0 and r.stats.drafter == "medusa"
    assert info["eval"]["selected_by"] == "agreement" and "distilled_eval" not in info  # no distilled eval set asked


@pytest.mark.slow
def test_smollm2_per_head_lm_heads_picked_on_distilled_eval(smollm2, module_tmp):
    """Medusa-1's per-head LM heads, trained with a distilled eval set (the target's continuations of held-out
    prefixes) whose summed agreement picks the checkpoint; evaluate_medusa reads them (tiling the shared rows as
    per-head LM heads gives the shared heads' numbers, up to a rounding tie); compiled, greedy output is the
    target's."""
    pytest.importorskip("torch")
    from dyncompile.tools.train_medusa import evaluate_medusa, train_medusa

    root = module_tmp("medusa_smol_lm")
    info = train_medusa(smollm2.onnx_path.parent, root / "heads", heads=3, steps=10, batch=64, seq_len=64,
                        max_tokens=2000, draft_vocab=1024, threads=2, distill_sequences=2, distill_prompt=16,
                        distill_new=48, distill_eval=2, eval_every=5, lm_heads=True)
    assert info["lm_heads"] == "per head, trained" and info["corpus"]["distilled_eval_sequences"] == 2
    assert info["eval"]["selected_by"] == "distilled_agreement"
    curve = info["curve"]
    assert [c["step"] for c in curve] == [5, 10] and all("distilled_agreement" in c for c in curve)
    best = max(curve, key=lambda c: sum(c["distilled_agreement"]))
    if sum(best["distilled_agreement"]) > sum(info["distilled_eval"]["before_training"]["head_top1_agreement"]):
        assert info["training"]["kept_step"] == best["step"]
        assert info["distilled_eval"]["head_top1_agreement"] == best["distilled_agreement"]
        assert info["eval"]["head_top1_agreement"] == best["agreement"]
    z = dict(np.load(root / "heads" / "medusa_heads.npz"))
    assert z["lm"].shape == (3, 576, 1024)
    # evaluate_medusa: per-head LM heads equal to the target's rows give exactly the shared heads' numbers
    w_lm = lm_head_of(ir.load(str(smollm2.onnx_path)))[2]
    shared, tiled = root / "shared", root / "tiled"
    for d, extra in ((shared, {}), (tiled, {"lm": np.repeat(w_lm[None][:, :, z["vocab"]], 3, 0)})):
        d.mkdir()
        np.savez(d / "medusa_heads.npz", w=z["w"], b=z["b"], vocab=z["vocab"], **extra)
    ev_s = evaluate_medusa(smollm2.onnx_path.parent, shared, max_tokens=400, seq_len=64, threads=2)
    ev_t = evaluate_medusa(smollm2.onnx_path.parent, tiled, max_tokens=400, seq_len=64, threads=2)
    ev_own = evaluate_medusa(smollm2.onnx_path.parent, root / "heads", max_tokens=400, seq_len=64, threads=2)
    assert ev_s["positions"] == 6 * (64 - 3 - 1) == ev_own["positions"]  # 400 tokens: 6 windows of 64
    n = ev_s["positions"]
    for key in ("agreement", "accuracy", "top4_agreement"):  # the same products (batched): a rounding tie at most
        assert all(abs(t - s) * n <= 1.0001 for t, s in zip(ev_t[key], ev_s[key])), key
    assert all(t >= a for t, a in zip(ev_own["top4_agreement"], ev_own["agreement"]))
    if info["training"]["kept_step"]:  # the trained LM heads are read, not the target's
        assert ev_own["agreement"] != ev_s["agreement"]
    plan = compile_model(smollm2.onnx_path, f"medusa-heads{{head={root / 'heads'}}},explicit-attention,"
                         "speculative{tree=true,measure=false}", root / "plan", progress=False, opt_level=0).plan_dir
    assert ir.load(str(plan / "drafter.onnx")).graph.initializers["medusa.lm_heads"].const_value.shape == (3, 576, 1024)
    m = dyncompile.load(plan, session_config={"session.intra_op.allow_spinning": "0"})
    prompt = "def fibonacci(n):\n    "
    ref = m.generate(prompt, max_new_tokens=20, speculative=False)
    r = m.generate(prompt, max_new_tokens=20, tree=False, draft_length=3, adaptive=False)
    assert r.token_ids == ref.token_ids and r.stats.drafted > 0

