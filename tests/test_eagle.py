"""EAGLE drafter on the real SmolLM2-135M: the features output (golden), the drafter graph built from a head
trained on CPU in seconds (weights shared with the target, refused for a foreign head), and greedy speculative
decoding with chains and trees token-identical to the target alone (short generations: CI, 2 cores)."""

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
from dyncompile.passes.compiler import compile_model
from dyncompile.passes.speculative.decoder_spec import DrafterError
from dyncompile.passes.speculative.eagle_drafter import EagleDrafterPass, build_eagle_drafter, load_head
from dyncompile.passes.speculative.expose_features import ExposeFeaturesPass
from dyncompile.runtime.decode.draft_tree import DraftTree
from dyncompile.runtime.decode.drafters import TreeBudget

STDLIB = Path(sysconfig.get_paths()["stdlib"])
NEW_TOKENS = 24


def _session(path: Path) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 2
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _feeds(sess, ids: np.ndarray) -> dict[str, np.ndarray]:
    n = ids.shape[1]
    feeds = {"input_ids": ids, "attention_mask": np.ones((1, n), np.int64), "position_ids": np.arange(n)[None]}
    for i in sess.get_inputs():
        if i.name.startswith("past_key_values"):
            feeds[i.name] = np.zeros((1, 3, 0, 64), np.float32)
    return feeds


@pytest.fixture(scope="module")
def exposed(smollm2, module_tmp):
    root = module_tmp("eagle_features")
    m = ir.load(str(smollm2.onnx_path))
    nodes_before = len(list(m.graph))
    outs_before = [v.name for v in m.graph.outputs]
    first = ExposeFeaturesPass()(m)
    second = ExposeFeaturesPass()(m)
    ir.save(m, root / "model.onnx", external_data="model.onnx.data")
    return {"path": root / "model.onnx", "first": first.modified, "second": second.modified, "model": m,
            "nodes_before": nodes_before, "outs_before": outs_before}


def test_expose_features_adds_one_output_and_no_compute(exposed):
    m = exposed["model"]
    assert exposed["first"] is True and exposed["second"] is False
    assert len(list(m.graph)) == exposed["nodes_before"]
    assert [v.name for v in m.graph.outputs] == [*exposed["outs_before"], "features"]
    f = m.graph.outputs[-1]
    # the final norm's input: read by the RMSNorm (Pow + the Mul by the reciprocal root) and nothing else
    assert sorted(u.node.op_type for u in f.uses()) == ["Mul", "Pow"]
    onnx.checker.check_model(str(exposed["path"]), full_check=True)


def test_expose_features_golden_in_ort(exposed, smollm2):
    ids = np.asarray([[1, 504, 3458, 282, 4649, 314, 260, 1345, 28, 19, 355, 253]], np.int64)
    orig, new = _session(smollm2.onnx_path), _session(exposed["path"])
    names = [o.name for o in orig.get_outputs()]
    a = orig.run(names, _feeds(orig, ids))
    b = new.run([*names, "features"], _feeds(new, ids))
    for x, y in zip(a, b[:-1]):
        np.testing.assert_allclose(y, x, rtol=0, atol=1e-5)
    # features is what enters the final norm: RMSNorm(features) @ lm_head^T reproduces the logits
    f = b[-1][0].astype(np.float64)
    m = exposed["model"]
    w_norm = m.graph.initializers["model.norm.weight"].const_value.numpy().astype(np.float64)
    lm = m.graph.initializers["lm_head.weight"].const_value.numpy().astype(np.float64)
    eps = 1e-5
    normed = f / np.sqrt((f * f).mean(-1, keepdims=True) + eps) * w_norm
    np.testing.assert_allclose(normed @ lm.T, b[0][0], rtol=0, atol=2e-3)


def _train_tiny_head(smollm2, module_tmp, name: str, **options) -> Path:
    pytest.importorskip("torch")
    from dyncompile.tools.train_drafter import train_drafter

    out = module_tmp(name)
    train_drafter(smollm2.onnx_path.parent, out, batch=2, seq_len=48, max_tokens=6000, draft_vocab=1024,
                  progress=False, **options)
    return out


def _tree_plan(smollm2, head: Path, module_tmp, name: str) -> Path:
    res = compile_model(smollm2.onnx_path,
                        f"eagle-drafter{{head={head}}},explicit-attention,speculative{{tree=true,measure=false}}",
                        module_tmp(name) / "plan", progress=False, opt_level=0)
    return res.plan_dir


@pytest.fixture(scope="module")
def hf_target(smollm2):
    """The frozen float32 PyTorch SmolLM2, as train_drafter loads it: read once for the module's PyTorch references
    and the continued training runs (all of them only read it; the heads train on copies of its last layer)."""
    pytest.importorskip("torch")
    from dyncompile.tools.train_drafter import load_target

    return load_target(smollm2.onnx_path.parent)


@pytest.fixture(scope="module")
def tiny_head(smollm2, module_tmp):
    """A head trained on CPU for a few steps (token identity does not depend on its quality)."""
    return _train_tiny_head(smollm2, module_tmp, "eagle_head", steps=3)


@pytest.fixture(scope="module")
def eagle_plan(smollm2, tiny_head, module_tmp):
    return _tree_plan(smollm2, tiny_head, module_tmp, "eagle_plan")


def test_head_record_and_held_out_files(tiny_head):
    info = json.loads((tiny_head / "eagle_head.json").read_text())
    held = set(info["corpus"]["held_out"])
    # every file a benchmark prompt is cut from is held out of the training corpus
    from dyncompile.tools.bench.prompt_sets import CODE_FILES, GROUNDED_DOC_FILES

    assert set(CODE_FILES) | set(GROUNDED_DOC_FILES) <= held
    from dyncompile.tools.train_drafter import corpus_files

    names = {p.relative_to(STDLIB).as_posix() for p in corpus_files(STDLIB)}
    assert not names & held and "os.py" in names


def test_eagle_plan_shares_the_target_weights(eagle_plan):
    plan = json.loads((eagle_plan / "plan.json").read_text())
    d = plan["steps"][0]["drafter"]
    assert d["kind"] == "eagle" and d["features"] == "features"
    assert plan["files"]["drafter"]["external_data"] == ["model.onnx.data"]
    drafter = ir.load(str(eagle_plan / "drafter.onnx"))
    ext = {v.name for v in drafter.graph.initializers.values() if isinstance(v.const_value, ir.ExternalTensor)}
    assert "lm_head.weight" in ext and "model.norm.weight" in ext  # embedding/head and final norm: the target's
    own = {v.name for v in drafter.graph.initializers.values() if not isinstance(v.const_value, ir.ExternalTensor)}
    assert {"eagle.fc.weight", "eagle.self_attn.q_proj.weight", "eagle.mlp.down_proj.weight"} <= own
    assert [v.name for v in drafter.graph.inputs if v.name.startswith("past")] == [
        "past_key_values.29.key", "past_key_values.29.value"]
    assert np.load(eagle_plan / "drafter_vocab.npy").shape == (1024,)


def test_eagle_greedy_token_identical(eagle_plan):
    m = dyncompile.load(eagle_plan, session_config={"session.intra_op.allow_spinning": "0"})
    code = (STDLIB / "bisect.py").read_text()
    prompts = [(code[: code.index("def bisect_right")] + "def bisect_right(a, x, lo=0, hi=None, *, key=None):\n", False),
               ("Repeat the following text exactly.\n\nThe quick brown fox jumps over the lazy dog.", True)]
    for prompt, chat in prompts:
        ref = m.generate(prompt, max_new_tokens=NEW_TOKENS, chat=chat, speculative=False)
        runs = {f"chain {n}": dict(tree=False, draft_length=n, adaptive=False) for n in (1, 4)}
        runs["tree 8 nodes"] = dict(tree={"adaptive": False, "max_nodes": 8, "max_depth": 4, "branching": 3})
        runs["tree 16 nodes"] = dict(tree={"adaptive": False, "max_nodes": 16, "max_depth": 6, "branching": 4})
        runs["tree adaptive"] = dict(tree=True)
        for what, opts in runs.items():
            res = m.generate(prompt, max_new_tokens=NEW_TOKENS, chat=chat, **opts)
            assert res.token_ids == ref.token_ids, (what, prompt[:40], res.text, ref.text)
            st = res.stats
            assert st.drafter == "eagle" and st.target_calls == st.rounds + 1
            if what != "tree adaptive":  # the adaptive controller may decide a tiny head's drafts do not pay
                assert st.drafted > 0, what


def test_drafter_graph_matches_the_torch_head(smollm2, tiny_head, exposed, hf_target):
    """The ONNX drafter computes what the trained PyTorch head computes (one call, true features)."""
    torch = pytest.importorskip("torch")
    import copy

    arrays, info, _ = load_head(tiny_head)
    drafter = build_eagle_drafter(ir.load(str(smollm2.onnx_path)), arrays, info)
    path = Path(exposed["path"]).parent / "drafter.onnx"
    ir.save(drafter, path, external_data="drafter.onnx.data")
    ids = np.asarray([[1, 504, 3458, 282, 4649, 314, 260, 1345, 28, 19]], np.int64)
    tgt = _session(exposed["path"])
    f = tgt.run(["features"], _feeds(tgt, ids))[0]
    ds = _session(path)
    feeds = _feeds(ds, ids[:, 1:])
    feeds["eagle_features"] = f[:, :-1]
    logits, hid = ds.run(["logits", "eagle_hidden"], feeds)
    hf = hf_target
    layer = copy.deepcopy(hf.model.layers[-1])
    layer.load_state_dict({k[6:]: torch.as_tensor(v) for k, v in arrays.items() if k.startswith("layer.")})
    with torch.no_grad():
        x = torch.cat([hf.model.embed_tokens(torch.as_tensor(ids[:, 1:])), torch.as_tensor(f[:, :-1])], -1)
        h = x @ torch.as_tensor(arrays["fc.weight"]).T + torch.as_tensor(arrays["fc.bias"])
        pos = torch.arange(h.shape[1])[None]
        out = layer(h, attention_mask=None, position_ids=pos, position_embeddings=hf.model.rotary_emb(h, pos))
        out = out[0] if isinstance(out, tuple) else out
        ref_logits = hf.lm_head(hf.model.norm(out))[0].numpy()[:, arrays["vocab"]]
    # float32 rounding only: the head's hidden state reaches ~2e3 after a few training steps (18 ulps there = 2e-3)
    np.testing.assert_allclose(hid[0], out[0].numpy(), rtol=1e-5, atol=2e-3)
    np.testing.assert_allclose(logits[0], ref_logits, rtol=1e-5, atol=2e-3)


def test_a_foreign_head_is_refused(smollm2, tiny_head, tmp_path):
    arrays, info, _ = load_head(tiny_head)
    info["layer_params"]["self_attn.q_proj.weight"]["replaces"] = [1.0, 2.0, 3.0]
    with pytest.raises(DrafterError, match="match no weight"):
        build_eagle_drafter(ir.load(str(smollm2.onnx_path)), arrays, info)
    with pytest.raises(DrafterError, match="holds no EAGLE head"):
        EagleDrafterPass(tmp_path).requires(ir.load(str(smollm2.onnx_path)))


def test_eagle_pass_is_idempotent(smollm2, tiny_head):
    m = ir.load(str(smollm2.onnx_path))
    p = EagleDrafterPass(tiny_head)
    assert p(m).modified is True
    assert p(m).modified is False
    assert [v.name for v in m.graph.outputs][-1] == "features"


def test_train_drafter_cli_refuses_bad_input_cleanly(tmp_path, capsys):
    from dyncompile.tools.cli import main as cli_main

    rc = cli_main(["train-drafter", str(tmp_path), "--out", str(tmp_path / "head"), "--steps", "0"])
    err = capsys.readouterr().err
    assert rc != 0 and "--steps must be positive" in err and "Traceback" not in err
    rc = cli_main(["train-drafter", str(tmp_path), "--out", str(tmp_path / "head")])
    err = capsys.readouterr().err
    assert rc != 0 and "hf/config.json" in err and "Traceback" not in err
    rc = cli_main(["train-drafter", str(tmp_path), "--out", str(tmp_path / "head"), "--ttt-steps", "3"])
    err = capsys.readouterr().err  # training-time test unrolls the fused (EAGLE-3) head only
    assert rc != 0 and "ttt_steps" in err and "features='top'" in err and "Traceback" not in err


# ------------------------------------------------------------------------------------ EAGLE-2 dynamic draft trees


def _eagle_parts(eagle_plan):
    m = dyncompile.load(eagle_plan, session_config={"session.intra_op.allow_spinning": "0"})
    step = m.handlers[-1]
    return m, step.target, step.drafter


def _prompt_ids(m) -> list[int]:
    code = (STDLIB / "bisect.py").read_text()
    return m.handlers[-1].codec.encode(code[: code.index("def insort_left")])[-40:]


def test_eagle_tree_plan_gives_the_drafter_a_bias_input(eagle_plan):
    plan = json.loads((eagle_plan / "plan.json").read_text())
    spec = plan["steps"][0]["drafter"]["decoder"]
    assert spec["attention_bias"] == "attention_bias" and spec["attention_mask"] is None
    drafter = onnx.load(str(eagle_plan / "drafter.onnx"), load_external_data=False)
    assert {"attention_bias", "position_ids", "eagle_features"} <= {i.name for i in drafter.graph.input}
    assert "attention_mask" not in {i.name for i in drafter.graph.input}


def test_drafter_tree_rows_equal_each_branch_run_as_a_chain(eagle_plan):
    """Golden: one drafter call on a tree (4-D bias, per-node positions) gives every node the logits and predicted
    feature of that node's root-to-node branch fed as a chain on the same cache."""
    from dyncompile.plan import DecoderSpec
    from dyncompile.runtime.decode.eagle import EagleDecoder

    m, tgt, drafter = _eagle_parts(eagle_plan)
    d = json.loads((eagle_plan / "plan.json").read_text())["steps"][0]["drafter"]
    dec = EagleDecoder(_session(eagle_plan / "drafter.onnx"), DecoderSpec.from_params(d["decoder"]),
                       feature_input=d["feature_input"], hidden_output=d["hidden_output"])
    assert dec.supports_trees
    ids = _prompt_ids(m)
    tgt.reset()
    tgt.forward(ids)
    F = tgt.last_outputs["features"]
    P = 24  # the drafter cache holds pairs (ids[t+1], F[t]) for t < P; the tree continues from there
    tree = DraftTree([ids[P + 1], ids[P + 2], ids[P + 5], ids[P + 3], ids[P + 9], ids[P + 4], ids[P + 7]],
                     [-1, 0, 0, 1, 1, 2, 3])
    feats = F[[P, P + 1, P + 3, P + 2, P + 8, P + 6, P + 4]]  # any feature per node (true rows, shuffled)
    dec.reset()
    dec.step(ids[1 : P + 1], F[:P])
    lg, hd = dec.step(tree.tokens, feats, tree=tree)
    assert dec.length == P + len(tree)
    for i in range(len(tree)):
        path = tree.path_to(i)
        dec.truncate(P)
        clg, chd = dec.step([tree.tokens[j] for j in path], feats[path])
        # float32 rounding of a 7-row call vs a 1..3-row one, which scales with the row (logits ~25, the residual
        # stream |f| ~ 500): measured <= 7e-7 of the row's largest entry; a wrong mask moves rows by >1e-2 of it
        for what, a, b in (("logits", lg[i], clg[-1]), ("feature", hd[i], chd[-1])):
            assert np.abs(a - b).max() <= 2e-6 * np.abs(b).max(), (i, what, np.abs(a - b).max())
        assert int(np.argmax(lg[i])) == int(np.argmax(clg[-1]))
    # negative control: the same rows fed as a causal chain (each node sees its earlier siblings too) are far off
    dec.truncate(P)
    wrong, _ = dec.step(tree.tokens, feats)
    assert max(np.abs(wrong[i] - lg[i]).max() / np.abs(lg[i]).max() for i in range(2, len(tree))) > 1e-2


def _chain_after(drafter, seq, path_tokens):
    """The drafter's logits after ``seq`` and then ``path_tokens`` drafted as a chain (predicted features fed back)."""
    dec = drafter.decoder
    dec.reset()
    logits, hid = dec.step(seq[1:], drafter._F[: len(seq) - 1])
    lg, h = logits[-1], hid[-1]
    for t in path_tokens:
        lg, hd = dec.step([t], h[None])
        lg, h = lg[-1], hd[-1]
    return lg


def test_eagle2_tree_is_grown_by_draft_confidence(eagle_plan):
    """The EAGLE-2 tree has the requested size and depth, expands branches off the main chain (the old builder's
    siblings were leaves), its first-child path is the drafter's greedy chain, every node's children are the
    drafter's top tokens after that node's branch (as a chain), and the kept nodes are the best-scored ones."""
    m, tgt, drafter = _eagle_parts(eagle_plan)
    ids = _prompt_ids(m)
    budget = TreeBudget(max_nodes=12, max_depth=4, branching=3)
    expanded_off_chain = 0
    for cut in (30, 38):
        seq = ids[:cut]
        drafter.reset(seq)
        tgt.reset()
        vocab_size = tgt.forward(seq[:-1]).shape[-1]
        drafter.after_prefill(tgt)
        tree = drafter.propose_tree(seq, budget, sample=False, temperature=1.0, rng=None, vocab_size=vocab_size)
        assert len(tree) == budget.max_nodes + 1 and tree.max_depth <= budget.max_depth
        assert all(len(c) <= budget.branching for c in tree.children)
        assert drafter.decoder.length == drafter.true_len == len(seq) - 1  # rolled back to true features
        main, node = [], 0
        while tree.children[node]:
            node = tree.children[node][0]
            main.append(node)
        expanded_off_chain += sum(1 for i in range(1, len(tree)) if i not in main and tree.children[i])
        chain, _ = drafter.propose(seq, len(main), sample=False, temperature=1.0, rng=None, vocab_size=vocab_size)
        assert [tree.tokens[i] for i in main] == chain
        scores = np.zeros(len(tree))
        for i in range(len(tree)):
            lg = np.asarray(_chain_after(drafter, seq, [tree.tokens[j] for j in tree.path_to(i)[1:]]), np.float64)
            lp = lg - lg.max() - np.log(np.exp(lg - lg.max()).sum())
            order = drafter.vocab[np.argsort(-lp, kind="stable")]
            kids = [tree.tokens[c] for c in tree.children[i]]
            assert kids == [int(t) for t in order[: len(kids)]], f"children of node {i}"
            for c in tree.children[i]:
                scores[c] = scores[i] + lp[int(np.flatnonzero(drafter.vocab == tree.tokens[c])[0])]
        # reranking: no child the drafter offered an expanded-depth node scores above the worst kept node
        worst = scores[1:].min()
        for i in range(len(tree)):
            if tree.children[i] and len(tree.children[i]) < budget.branching and tree.depth[i] < budget.max_depth:
                lg = np.asarray(_chain_after(drafter, seq, [tree.tokens[j] for j in tree.path_to(i)[1:]]), np.float64)
                lp = np.sort(lg - lg.max() - np.log(np.exp(lg - lg.max()).sum()))[::-1]
                assert scores[i] + lp[len(tree.children[i])] <= worst + 1e-6
    assert expanded_off_chain >= 1


def test_a_drafter_without_the_bias_input_keeps_the_old_tree(eagle_plan, monkeypatch):
    """Plans compiled before EAGLE-2 (a drafter graph without attention_bias) build the chain + sibling-leaf tree
    and stay token-identical."""
    from dyncompile.runtime.decode.eagle import EagleDecoder

    m = dyncompile.load(eagle_plan, session_config={"session.intra_op.allow_spinning": "0"})
    prompt = "Repeat the following text exactly.\n\nThe quick brown fox jumps over the lazy dog."
    ref = m.generate(prompt, max_new_tokens=NEW_TOKENS, chat=True, speculative=False)
    monkeypatch.setattr(EagleDecoder, "supports_trees", property(lambda self: False))
    trees = []
    drafter = m.handlers[-1].drafter
    real = type(drafter).propose_tree

    def spy(self, *a, **k):
        trees.append(real(self, *a, **k))
        return trees[-1]

    monkeypatch.setattr(type(drafter), "propose_tree", spy)
    res = m.generate(prompt, max_new_tokens=NEW_TOKENS, chat=True,
                     tree={"adaptive": False, "max_nodes": 8, "max_depth": 4, "branching": 3})
    assert res.token_ids == ref.token_ids
    assert trees and max(len(t) for t in trees) > 1
    for t in trees:  # off the first-child path, every node is a leaf
        main = {0}
        node = 0
        while t.children[node]:
            node = t.children[node][0]
            main.add(node)
        assert all(not t.children[i] for i in range(len(t)) if i not in main)


def test_speculative_tree_pass_gives_the_eagle_drafter_the_bias_once(smollm2, tiny_head):
    from dyncompile.passes import _keys
    from dyncompile.passes.speculative import ExposeAttentionMaskPass
    from dyncompile.passes.speculative.speculative import SpeculativePass

    m = ir.load(str(smollm2.onnx_path))
    EagleDrafterPass(tiny_head)(m)
    ExposeAttentionMaskPass()(m)
    drafter = m.meta[_keys.EAGLE_MODEL][0]
    assert "attention_mask" in {v.name for v in drafter.graph.inputs}
    chain = SpeculativePass(None, measure=False)
    assert chain(m).modified is True
    assert "attention_bias" not in {v.name for v in drafter.graph.inputs}  # chains: the drafter is left as it was
    p = SpeculativePass(None, measure=False, tree={"max_nodes": 8})
    assert p(m).modified is True
    names = {v.name for v in drafter.graph.inputs}
    assert "attention_bias" in names and "attention_mask" not in names
    assert json.loads(m.metadata_props[_keys.SPECULATIVE])["drafter"]["decoder"]["attention_bias"] == "attention_bias"
    assert p(m).modified is False


# ------------------------------------------------------------------------ EAGLE-3: fused features, training-time test


@pytest.fixture(scope="module")
def fused_head(smollm2, module_tmp):
    """An EAGLE-3 head (fused low/middle/high features, 2 unrolled draft steps) trained on CPU for a few steps."""
    return _train_tiny_head(smollm2, module_tmp, "eagle3_head", steps=4, features="fused", layout="fc", ttt_steps=2,
                            eval_every=2, eval_windows=2)


@pytest.fixture(scope="module")
def fused_plan(smollm2, fused_head, module_tmp):
    return _tree_plan(smollm2, fused_head, module_tmp, "eagle3_plan")


@pytest.fixture(scope="module")
def reference_head(smollm2, module_tmp):
    """An EAGLE-3 head in the reference layout (2H-wide attention over [norm(embedding), norm(feature)]): the default
    layout of ``features="fused"``."""
    return _train_tiny_head(smollm2, module_tmp, "eagle3_ref_head", steps=4, features="fused", ttt_steps=2)


@pytest.fixture(scope="module")
def reference_plan(smollm2, reference_head, module_tmp):
    return _tree_plan(smollm2, reference_head, module_tmp, "eagle3_ref_plan")


def _torch_head(hf, arrays):
    """The trained head as PyTorch modules (fuse, and fc + the target's last layer with the head's weights, or the
    reference layer) + the HF target."""
    import copy

    import torch

    fuse = torch.nn.Linear(arrays["fuse.weight"].shape[1], arrays["fuse.weight"].shape[0], bias=False)
    fuse.load_state_dict({"weight": torch.as_tensor(arrays["fuse.weight"])})
    if "mid.self_attn.q_proj.weight" in arrays:
        from dyncompile.tools.train_drafter import reference_mid_layer

        mid = reference_mid_layer(hf.model.layers[-1], arrays["fuse.weight"].shape[0])
        mid.load_state_dict({k[4:]: torch.as_tensor(v) for k, v in arrays.items() if k.startswith("mid.")})
        return hf, torch.nn.ModuleDict({"mid": mid, "fuse": fuse}).eval()
    layer = copy.deepcopy(hf.model.layers[-1])
    layer.load_state_dict({k[6:]: torch.as_tensor(v) for k, v in arrays.items() if k.startswith("layer.")})
    h = arrays["fc.weight"].shape[0]
    fc = torch.nn.Linear(2 * h, h)
    fc.load_state_dict({"weight": torch.as_tensor(arrays["fc.weight"]), "bias": torch.as_tensor(arrays["fc.bias"])})
    return hf, torch.nn.ModuleDict({"fc": fc, "layer": layer, "fuse": fuse}).eval()


def test_ttt_mask_is_what_a_drafted_token_sees():
    pytest.importorskip("torch")
    from dyncompile.tools.train_drafter import _ttt_mask

    # 3 positions, 3 draft steps: step 0 is causal; step j's row t sees step 0 up to t and its own rows t of steps 1..j
    expected = np.array([
        [1, 0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0, 0],
        [1, 0, 0, 1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 1, 0, 0, 0],
        [1, 0, 0, 1, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 1, 0, 0, 1]], bool)
    np.testing.assert_array_equal(_ttt_mask(3, 3, "cpu").numpy(), expected)


def test_held_out_split_is_disjoint_and_distillation_never_reads_it():
    """The held-out split is disjoint and shuffled, and the self-distillation prompts come from training windows
    only (a held-out window's text would leak). That a run with another --seed keeps the split is checked end to
    end by its fingerprint in ``test_training_continues_from_a_saved_head``."""
    from dyncompile.tools.train_drafter import distill_prompts, split_windows

    ids = np.arange(64 * 300, dtype=np.int64)  # every token unique: a slice names its window
    ev, tr = split_windows(ids, 64)
    assert len(ev) == 6 and len(ev) + len(tr) == 300
    assert not set(ev[:, 0]) & set(tr[:, 0])  # disjoint
    assert set(ev[:, 0]) != set(np.arange(6) * 64)  # shuffled, not the corpus head
    held = set(ev.ravel())
    for seed in (0, 1, 7):
        p = distill_prompts(tr, 500, 16, np.random.default_rng(seed))
        assert p.shape == (500, 16) and not held & set(p.ravel())
        assert (np.diff(p, axis=1) == 1).all()  # contiguous slices of one window each
        assert (p[:, 0] // 64 == p[:, -1] // 64).all()
    # negative control: prompts drawn from the whole corpus, as before, do hit held-out text
    starts = np.random.default_rng(0).integers(0, len(ids) - 16, size=500)
    assert held & set(np.concatenate([ids[s : s + 16] for s in starts]))


def test_fused_head_record(fused_head, smollm2):
    from dyncompile.tools.train_drafter import feature_layers_for

    info = json.loads((fused_head / "eagle_head.json").read_text())
    assert info["format"] == "dyncompile.eagle_head/v2"
    assert info["feature_layers"] == feature_layers_for(30) == [2, 15, 27]
    assert len(info["eval"]["ttt_agreement"]) == 2 and [c["step"] for c in info["curve"]] == [2, 4]
    assert info["curve"][-1]["tokens"] == info["training"]["tokens_seen"] == 4 * 2 * 48


def test_fused_features_golden_in_ort(smollm2, fused_head, module_tmp, hf_target):
    torch = pytest.importorskip("torch")
    arrays, info, _ = load_head(fused_head)
    m = ir.load(str(smollm2.onnx_path))
    outs_before, nodes_before = [v.name for v in m.graph.outputs], len(list(m.graph))
    p = ExposeFeaturesPass(taps=info["feature_layers"], fuse=arrays["fuse.weight"])
    assert p(m).modified is True and p(m).modified is False
    assert [v.name for v in m.graph.outputs] == [*outs_before, "features"]
    assert len(list(m.graph)) == nodes_before + 2  # one Concat, one MatMul
    root = module_tmp("eagle3_features")
    ir.save(m, root / "model.onnx", external_data="model.onnx.data")
    onnx.checker.check_model(str(root / "model.onnx"), full_check=True)
    ids = np.asarray([[1, 504, 3458, 282, 4649, 314, 260, 1345, 28, 19, 355, 253]], np.int64)
    orig, new = _session(smollm2.onnx_path), _session(root / "model.onnx")
    names = [o.name for o in orig.get_outputs()]
    a = orig.run(names, _feeds(orig, ids))
    b = new.run([*names, "features"], _feeds(new, ids))
    for x, y in zip(a, b[:-1]):
        np.testing.assert_array_equal(y, x)  # the original outputs are the same values
    hf, head = _torch_head(hf_target, arrays)
    with torch.no_grad():
        hs = hf(input_ids=torch.as_tensor(ids), output_hidden_states=True).hidden_states
        ref = head["fuse"](torch.cat([hs[k] for k in info["feature_layers"]], -1))[0].numpy()
    np.testing.assert_allclose(b[-1][0], ref, rtol=0, atol=2e-3 * np.abs(ref).max())
    with pytest.raises(DrafterError, match="do not fit"):
        ExposeFeaturesPass(taps=[2, 15, 30], fuse=arrays["fuse.weight"])(ir.load(str(smollm2.onnx_path)))


@pytest.mark.parametrize("layout", ["fc", "reference"])
def test_fused_rollout_is_what_the_drafter_computes_at_run_time(layout, request, hf_target):
    """The trainer's unrolled steps (training-time test) equal the ONNX drafter drafting a chain on the plan's
    fused features: a catch-up call on true features, then each draft step fed the previous prediction; for both
    layouts of the draft layer (``fc`` + the target's layer, and EAGLE-3's reference layer)."""
    torch = pytest.importorskip("torch")
    prefix = "reference" if layout == "reference" else "fused"
    fused_head, fused_plan = request.getfixturevalue(f"{prefix}_head"), request.getfixturevalue(f"{prefix}_plan")
    from dyncompile.plan import DecoderSpec
    from dyncompile.runtime.decode.eagle import EagleDecoder
    from dyncompile.tools.train_drafter import rollout

    arrays, info, _ = load_head(fused_head)
    m, tgt, _ = _eagle_parts(fused_plan)
    d = json.loads((fused_plan / "plan.json").read_text())["steps"][0]["drafter"]
    dec = EagleDecoder(_session(fused_plan / "drafter.onnx"), DecoderSpec.from_params(d["decoder"]),
                       feature_input=d["feature_input"], hidden_output=d["hidden_output"])
    ids = _prompt_ids(m)[:30]
    tgt.reset()
    tgt.forward(ids)
    F = tgt.last_outputs["features"]
    hf, head = _torch_head(hf_target, arrays)
    x = torch.as_tensor(np.asarray(ids, np.int64))[None]
    with torch.no_grad():
        hs = hf(input_ids=x, output_hidden_states=True).hidden_states
        feat = head["fuse"](torch.cat([hs[k] for k in info["feature_layers"]], -1))
        np.testing.assert_allclose(F, feat[0].numpy(), rtol=0, atol=2e-3 * float(feat.abs().max()))
        preds = [p[0].numpy() for p in rollout(head, hf.model, x, feat[:, :-1], 3)]
    P = 20  # catch-up on rows t < P, then two draft steps after row P - 1
    dec.reset()
    _, hid = dec.step(ids[1 : P + 1], F[:P])
    got = [hid[-1]]
    for j in (1, 2):
        _, hid = dec.step([ids[P + j]], hid[-1:])
        got.append(hid[-1])
    for j, g in enumerate(got):
        ref = preds[j][P - 1]
        assert np.abs(g - ref).max() <= 2e-3 * np.abs(ref).max(), (j, np.abs(g - ref).max())
    # negative control: step 1's row P - 1 is not step 0's row P (a different feature went in)
    assert np.abs(preds[1][P - 1] - preds[0][P]).max() > 1e-2 * np.abs(preds[0][P]).max()


def test_reference_layout_head_record_and_drafter_graph(reference_head, reference_plan, smollm2, hf_target):
    """The reference layout's record (q/k/v found by the target tensors they widen, the norm that hidden_norm stands
    in for) and its drafter: q/k/v 2H wide over one Concat of two norm chains, no fc, checker-valid. Every tensor of
    the layer trained, also those copied from the frozen target (o_proj, the MLP, the norms)."""
    arrays, info, _ = load_head(reference_head)
    last = hf_target.model.layers[-1]
    for k, t in (("self_attn.o_proj.weight", last.self_attn.o_proj.weight), ("mlp.down_proj.weight", last.mlp.down_proj.weight),
                 ("post_attention_layernorm.weight", last.post_attention_layernorm.weight),
                 ("hidden_norm.weight", last.input_layernorm.weight)):
        assert np.abs(arrays[f"mid.{k}"] - t.detach().float().numpy()).max() > 1e-6, k  # moved off the target's
    assert info["format"] == "dyncompile.eagle_head/v3" and info["training"]["layout"] == "reference"
    assert not {"fc.weight", "fc.bias"} & set(arrays) and arrays["mid.self_attn.q_proj.weight"].shape == (576, 1152)
    lp = info["layer_params"]
    assert {k for k, p in lp.items() if "widens" in p} == {f"self_attn.{x}_proj.weight" for x in "qkv"}
    from dyncompile.tools.train_drafter import fingerprint

    norm = ir.load(str(smollm2.onnx_path)).graph.initializers["model.layers.29.input_layernorm.weight"]
    assert lp["hidden_norm.weight"]["replaces"] == fingerprint(norm.const_value.numpy())  # the feature's norm
    assert "input_layernorm.weight" not in lp  # the embedding's norm replaces nothing: it is a clone's weight
    onnx.checker.check_model(str(reference_plan / "drafter.onnx"), full_check=True)
    d = onnx.load(str(reference_plan / "drafter.onnx"), load_external_data=False)
    inits = {i.name: tuple(i.dims) for i in d.graph.initializer}
    assert {inits[f"eagle.self_attn.{x}_proj.weight"] for x in "qkv"} == {(1152, 576), (1152, 192)}
    assert "eagle.fc.weight" not in inits and "eagle.input_layernorm.weight" in inits
    concat = [n for n in d.graph.node if n.name == "eagle.concat"]
    assert len(concat) == 1 and concat[0].input[0].startswith("eagle.emb_norm_")
    readers = [n for n in d.graph.node if "eagle.concat_out" in n.input]
    assert sorted(n.op_type for n in readers) == ["MatMul"] * 3


def test_reference_head_for_another_model_is_refused(reference_head, smollm2):
    arrays, info, _ = load_head(reference_head)
    bad = json.loads(json.dumps(info))
    bad["layer_params"]["self_attn.k_proj.weight"]["widens"] = [1.0, 2.0, 3.0]
    with pytest.raises(DrafterError, match="q/k/v projections match no MatMuls"):
        build_eagle_drafter(ir.load(str(smollm2.onnx_path)), arrays, bad)


def _assert_greedy_token_identical(plan: Path) -> None:
    """The plan's EAGLE chains (fixed length 4) and trees give the target alone's greedy tokens, with drafts."""
    m = dyncompile.load(plan, session_config={"session.intra_op.allow_spinning": "0"})
    code = (STDLIB / "heapq.py").read_text()
    prompt = code[: code.index("def heappushpop")] + "def heappushpop(heap, item):\n"
    ref = m.generate(prompt, max_new_tokens=NEW_TOKENS, speculative=False)
    for opts in (dict(tree=False, draft_length=4, adaptive=False), dict(tree=True)):
        res = m.generate(prompt, max_new_tokens=NEW_TOKENS, **opts)
        assert res.token_ids == ref.token_ids, (opts, res.text, ref.text)
        assert res.stats.drafter == "eagle" and res.stats.drafted > 0


def test_reference_layout_greedy_token_identical(reference_plan):
    _assert_greedy_token_identical(reference_plan)


def test_export_eagle3_writes_the_reference_checkpoint(reference_head, fused_head, smollm2, tmp_path, capsys):
    """``export-eagle3``: the reference checkpoint's tensors are the head's and the target's (norm, draft-vocabulary
    rows of the tied LM head), d2t/t2d say the same vocabulary, the config names the layer and the taps in both
    counts; a head in the fc layout and an existing folder are refused with one line each."""
    pytest.importorskip("safetensors")
    from safetensors.numpy import load_file

    from tests.helpers import run_cli

    arrays, info, _ = load_head(reference_head)
    rc, out, _ = run_cli(capsys, "export-eagle3", reference_head, "--target", smollm2.onnx_path.parent, "-o",
                         tmp_path / "e3")
    assert rc == 0 and "reference checkpoint written" in out
    t = load_file(str(tmp_path / "e3" / "model.safetensors"))
    cfg = json.loads((tmp_path / "e3" / "config.json").read_text())
    vocab = arrays["vocab"]
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == len(vocab) == 1024
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert cfg["dyncompile"]["openvino_layers"] == [1, 14, 26]
    np.testing.assert_array_equal(t["d2t"] + np.arange(len(vocab)), vocab)
    assert t["t2d"].dtype == np.bool_ and t["t2d"].sum() == len(vocab) and t["t2d"][vocab].all()
    np.testing.assert_array_equal(t["fc.weight"], arrays["fuse.weight"])
    for k in ("self_attn.q_proj.weight", "hidden_norm.weight", "mlp.down_proj.weight"):
        np.testing.assert_array_equal(t[f"midlayer.{k}"], arrays[f"mid.{k}"])
    tgt = ir.load(str(smollm2.onnx_path)).graph.initializers
    np.testing.assert_array_equal(t["norm.weight"], tgt["model.norm.weight"].const_value.numpy())
    np.testing.assert_array_equal(t["lm_head.weight"], tgt["lm_head.weight"].const_value.numpy()[vocab])  # (tied)
    assert "embed_tokens.weight" not in t  # shared with the target at run time, as in the published heads
    rc, _, err = run_cli(capsys, "export-eagle3", fused_head, "--target", smollm2.onnx_path.parent, "-o", tmp_path / "f")
    assert rc == 2 and "fc layout" in err and "--layout reference" in err and not (tmp_path / "f").exists()
    rc, _, err = run_cli(capsys, "export-eagle3", reference_head, "--target", smollm2.onnx_path.parent, "-o",
                         tmp_path / "e3")
    assert rc == 2 and "exists" in err and err.count("\n") == 1


def test_eagle3_greedy_token_identical(fused_plan):
    m = dyncompile.load(fused_plan, session_config={"session.intra_op.allow_spinning": "0"})
    code = (STDLIB / "bisect.py").read_text()
    prompt = code[: code.index("def bisect_right")] + "def bisect_right(a, x, lo=0, hi=None, *, key=None):\n"
    ref = m.generate(prompt, max_new_tokens=NEW_TOKENS, speculative=False)
    drafted = {}
    for opts in (dict(tree=False, draft_length=4, adaptive=False), dict(tree=True),
                 dict(tree=False, draft_length=4, adaptive=False, stop_below=0.5)):
        res = m.generate(prompt, max_new_tokens=NEW_TOKENS, **opts)
        assert res.token_ids == ref.token_ids, (opts, res.text, ref.text)
        assert res.stats.drafter == "eagle"
        drafted[opts.get("stop_below", 0.0), opts["tree"]] = res.stats.draft_lengths
    # the confidence stop cut some of the head's chains short (rounds of fewer than 4 drafts before the budget's end)
    assert sum(v for k, v in drafted[0.5, False].items() if k < 4) > sum(v for k, v in drafted[0.0, False].items() if k < 4)
    rec = json.loads(ir.load(str(fused_plan / "model.onnx")).metadata_props["dyncompile.eagle"])
    assert rec["feature_layers"] == [2, 15, 27]


def test_training_continues_from_a_saved_head(smollm2, fused_head, tmp_path, caplog, monkeypatch, hf_target):
    """A continuation with another --seed keeps the head's held-out windows (same fingerprint, no warning); one on
    fewer corpus tokens draws other windows, and says so (warning + ``held_out_changed`` in the record)."""
    pytest.importorskip("torch")
    from dyncompile.errors import DataError
    from dyncompile.tools import train_drafter as td
    from dyncompile.tools.train_drafter import train_drafter

    # every run below continues on this SmolLM2 on the CPU: the module's one load of it (load_target's own model;
    # the fixtures' runs load it themselves) instead of reading the checkpoint again per run
    monkeypatch.setattr(td, "load_target", lambda target, device="cpu": hf_target)

    before = json.loads((fused_head / "eagle_head.json").read_text())
    with caplog.at_level("WARNING", logger="dyncompile.tools.train_drafter"):
        info = train_drafter(smollm2.onnx_path.parent, tmp_path / "more", steps=1, batch=2, seq_len=48,
                             max_tokens=6000, features="fused", ttt_steps=2, init=fused_head, seed=1, progress=False)
    assert info["training"]["tokens_seen"] == before["training"]["tokens_seen"] + 2 * 48
    assert info["training"]["layout"] == "fc"  # no --layout: the continued head keeps its own, not the default
    assert info["curve"] == before["curve"] and info["training"]["continued_from"]["steps"] == 4
    digest = before["corpus"]["held_out_windows_sha256"]
    assert len(digest) == 16 and info["corpus"]["held_out_windows_sha256"] == digest
    assert not info["training"]["held_out_changed"] and "held-out windows" not in caplog.text
    with caplog.at_level("WARNING", logger="dyncompile.tools.train_drafter"):
        moved = train_drafter(smollm2.onnx_path.parent, tmp_path / "less", steps=1, batch=2, seq_len=48,
                              max_tokens=5000, features="fused", ttt_steps=2, init=fused_head, progress=False)
    assert moved["corpus"]["held_out_windows_sha256"] != digest and moved["training"]["held_out_changed"]
    assert "was evaluated on other held-out windows" in caplog.text
    # a head written before heads recorded the fingerprint: cannot be checked, and says so (null, not false)
    import shutil

    old = shutil.copytree(fused_head, tmp_path / "old-head")
    rec = json.loads((old / "eagle_head.json").read_text())
    del rec["corpus"]["held_out_windows_sha256"]
    (old / "eagle_head.json").write_text(json.dumps(rec))
    caplog.clear()
    with caplog.at_level("WARNING", logger="dyncompile.tools.train_drafter"):
        unknown = train_drafter(smollm2.onnx_path.parent, tmp_path / "from-old", steps=1, batch=2, seq_len=48,
                                max_tokens=6000, features="fused", ttt_steps=2, init=old, progress=False)
    assert unknown["training"]["held_out_changed"] is None and "records no fingerprint" in caplog.text
    with pytest.raises(DataError, match="same --features"):
        train_drafter(smollm2.onnx_path.parent, tmp_path / "other", steps=1, batch=2, seq_len=48, max_tokens=6000,
                      init=fused_head, progress=False)
    with pytest.raises(DataError, match="has the fc layout; continue it with the same --layout"):
        train_drafter(smollm2.onnx_path.parent, tmp_path / "other", steps=1, batch=2, seq_len=48, max_tokens=6000,
                      features="fused", layout="reference", init=fused_head, progress=False)


@pytest.fixture(scope="module")
def int8_drafter_plan(smollm2, reference_head, module_tmp):
    """The reference head's plan with quantize-drafter named (as -O2 inserts it on the CPU EP)."""
    res = compile_model(smollm2.onnx_path, f"eagle-drafter{{head={reference_head}}},quantize-drafter,explicit-attention,"
                        "speculative{tree=true,measure=false}", module_tmp("eagle3_int8_plan") / "plan", progress=False,
                        opt_level=0)
    return res.plan_dir


def test_quantize_drafter_golden(int8_drafter_plan, reference_plan, smollm2, reference_head):
    """quantize-drafter: every weight MatMul of the drafter becomes an 8-bit MatMulNBits (checker-valid), the
    embedding stays shared with the target's data file, the target is untouched (same outputs as the float plan's),
    the drafter still drafts what the float one drafts (argmax) without being the same numbers, and greedy decoding
    stays token-identical to the target alone, chains and trees."""
    from onnx import checker

    d = int8_drafter_plan / "drafter.onnx"
    checker.check_model(str(d), full_check=True)
    g = onnx.load(str(d), load_external_data=False).graph
    weights = {i.name for i in g.initializer}
    ops = [n.op_type for n in g.node]
    float_ref = onnx.load(str(reference_plan / "drafter.onnx"), load_external_data=False).graph
    const_matmuls = [n for n in float_ref.node if n.op_type == "MatMul" and n.input[1] in
                     {i.name for i in float_ref.initializer}]
    assert ops.count("MatMulNBits") == len(const_matmuls) >= 7  # q/k/v, o, MLP x3, the draft-vocabulary head
    assert not [n for n in g.node if n.op_type == "MatMul" and n.input[1] in weights]
    assert {a.name: a.i for a in next(n for n in g.node if n.op_type == "MatMulNBits").attribute}["bits"] == 8
    plan = json.loads((int8_drafter_plan / "plan.json").read_text())
    assert plan["files"]["drafter"]["external_data"] == ["model.onnx.data"]  # the embedding: the target's bytes
    props = {p.key: p.value for p in onnx.load(str(int8_drafter_plan / "model.onnx"), load_external_data=False)
             .metadata_props}
    assert json.loads(props["dyncompile.eagle"])["drafter_weights"] == "int8"
    assert "QuantizeDrafterPass()" in plan["provenance"]["passes"]  # the plan records the pass by name, not an address
    # the drafter's logits against the float drafter's, on the same true features
    from dyncompile.plan import DecoderSpec
    from dyncompile.runtime.decode.eagle import EagleDecoder

    outs, targets = [], []
    for p in (reference_plan, int8_drafter_plan):
        m, tgt, _ = _eagle_parts(p)
        ids = _prompt_ids(m)[:30]
        tgt.reset()
        targets.append(np.array(tgt.forward(ids)))
        F = tgt.last_outputs["features"]
        spec = json.loads((p / "plan.json").read_text())["steps"][0]["drafter"]
        dec = EagleDecoder(_session(p / "drafter.onnx"), DecoderSpec.from_params(spec["decoder"]),
                           feature_input=spec["feature_input"], hidden_output=spec["hidden_output"])
        dec.reset()
        outs.append(np.array(dec.step(ids[1:21], F[:20])[0]))
    np.testing.assert_array_equal(targets[0], targets[1])  # the target graph is the float plan's
    assert np.abs(outs[0] - outs[1]).max() > 1e-4  # quantized: not the float drafter's numbers
    assert (outs[0].argmax(-1) == outs[1].argmax(-1)).mean() >= 0.9, (outs[0].argmax(-1), outs[1].argmax(-1))
    _assert_greedy_token_identical(int8_drafter_plan)


def test_eagle_plans_time_verification_up_to_their_longest_draft(smollm2, reference_head, monkeypatch):
    """An EAGLE plan times the target's verification calls up to its longest chain + 1 (a hybrid drafts up to 16),
    like prompt lookup's plans, instead of stopping at 9 rows and extrapolating."""
    import dyncompile.passes.speculative.speculative as spec_pass

    asked = []
    monkeypatch.setattr(spec_pass, "target_verify_costs",
                        lambda m, t, sizes=(1, 2, 4, 9): asked.append(list(sizes)) or ({s: float(s) for s in sizes}, 0.01))
    for hybrid, top in ((False, 9), (True, 17)):
        model = ir.load(str(smollm2.onnx_path))
        EagleDrafterPass(reference_head)(model)
        spec_pass.SpeculativePass(None, hybrid=hybrid, generation={"eos_token_ids": [0]})(model)
        assert asked[-1][-1] == top and asked[-1][0] == 1, (hybrid, asked)
        record = json.loads(model.metadata_props["dyncompile.speculative"])
        assert max(map(int, record["draft"]["verify_cost"])) == top


def test_quantize_drafter_runs_once_and_needs_a_drafter(smollm2, reference_head):
    """A second run reports modified=False; a model without an EAGLE drafter is refused with what to put first;
    -O2 inserts the pass for CPU decoders only."""
    from dyncompile.passes.presets import PRESETS
    from dyncompile.passes.speculative.eagle_drafter import QuantizeDrafterPass

    model = ir.load(str(smollm2.onnx_path))
    with pytest.raises(DrafterError, match="put eagle-drafter"):
        QuantizeDrafterPass().requires(model)
    EagleDrafterPass(reference_head)(model)
    assert QuantizeDrafterPass()(model).modified
    assert not QuantizeDrafterPass()(model).modified
    assert ("quantize-drafter", 2) in PRESETS["cpu"]["text-generation"]
    assert "quantize-drafter" not in dict(PRESETS["cuda"]["text-generation"])
