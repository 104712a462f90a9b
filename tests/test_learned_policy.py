"""Golden tests of the learned exit policy's lowering (criterion ``learned``): ONNX score vs numpy, every
If branch, staged per-row exits against the numpy rule, checker after each pass."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest
from helpers import ort_session, random_token_feeds, tolerance

import dyncompile
from dyncompile.models.synthetic import tiny_encoder_classifier
from dyncompile.passes import InsertEarlyExitPass, _keys, run_pipeline
from dyncompile.passes.early_exit.attach_exit_heads import attach_exit_heads
from dyncompile.passes.early_exit.graph import GraphBuilder
from dyncompile.passes.early_exit.heads import ExitHead
from dyncompile.passes.emit import EmitRequest, emit_plan
from dyncompile.plan import save_plan
from dyncompile.runtime.rules.exit_policy import POLICY_FEATURES, ExitPolicy, policy_scores

LAYERS = 4
EXITS = (1, 2, 3)
FEEDS = random_token_feeds(batch=8, seq=9)
RNG = np.random.default_rng(3)
# per exit: weights on [maxprob, margin, entropy, agree_prev, moved, prev_maxprob], bias
POLICY = {k: (RNG.normal(0, 2.0, len(POLICY_FEATURES)).tolist(), float(RNG.normal())) for k in EXITS}
SCORE_ATOL = 1e-4  # float32 softmax/log/products vs float64, scores of magnitude <= ~10


def _softmax(z):
    z = z - z.max(-1, keepdims=True)
    return np.exp(z) / np.exp(z).sum(-1, keepdims=True)


def with_learned(thresholds: dict[int, float | None]) -> ir.Model:
    m = tiny_encoder_classifier(num_layers=LAYERS)
    lns = [n for n in m.graph if n.op_type == "LayerNormalization"]
    cuts = {k: lns[k].outputs[0].name for k in EXITS}
    rng = np.random.default_rng(1)
    heads = {
        k: ExitHead("cls+mean", [(rng.standard_normal((512, 2)).astype(np.float32) * 0.3, np.zeros(2, np.float32), "none")])
        for k in EXITS
    }
    policies = {
        k: {"weights": POLICY[k][0], "bias": POLICY[k][1], "prev_head": f"exit_logits_{EXITS[i - 1]}" if i else None}
        for i, k in enumerate(EXITS)
    }
    attach_exit_heads(m, heads=heads, cuts=cuts, thresholds={k: thresholds.get(k) for k in EXITS}, num_layers=LAYERS,
                      criterion="learned", policies=policies)
    meta = json.loads(m.metadata_props[_keys.EARLY_EXIT])
    assert [e["policy"]["prev_head"] for e in meta["exits"]] == [None, "exit_logits_1", "exit_logits_2"]
    return m


def head_outputs(m):
    sess = ort_session(m)
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, FEEDS)))


def numpy_scores(heads) -> np.ndarray:
    """[E, B] scores by the runtime's numpy reference."""
    out = []
    for i, k in enumerate(EXITS):
        prev = heads[f"exit_logits_{EXITS[i - 1]}"] if i else None
        out.append(policy_scores(heads[f"exit_logits_{k}"], prev, *POLICY[k]))
    return np.stack(out)


def test_learned_criterion_needs_a_policy_per_exit():
    m = tiny_encoder_classifier(num_layers=LAYERS)
    lns = [n for n in m.graph if n.op_type == "LayerNormalization"]
    head = ExitHead("cls", [(np.zeros((256, 2), np.float32), np.zeros(2, np.float32), "none")])
    with pytest.raises(ir.passes.PreconditionError, match="needs a policy for every exit head"):
        attach_exit_heads(m, heads={1: head}, cuts={1: lns[1].outputs[0].name}, thresholds={1: 0.0}, num_layers=LAYERS,
                          criterion="learned")


@pytest.mark.parametrize("c", [2, 3])
def test_onnx_score_matches_numpy_policy(c):
    logits = ir.val("logits", ir.DataType.FLOAT, ir.Shape(["B", c]))
    prev = ir.val("prev", ir.DataType.FLOAT, ir.Shape(["B", c]))
    outs = []
    for name, p in (("first", None), ("next", prev)):
        b = GraphBuilder(18, f"{name}.")
        s = b.learned_score(logits, p, *POLICY[1])
        s.name = f"score_{name}"
        outs.append((s, b))
    # the folded lowering: one feature row and one MatMul per exit (it was 22 / 31 kernels feature by feature)
    assert [len(b.tape.nodes) for _, b in outs] == [8, 17]
    assert [sum(n.op_type == "MatMul" for n in b.tape.nodes) for _, b in outs] == [1, 1]
    g = ir.Graph([logits, prev], [s for s, _ in outs], nodes=[n for _, b in outs for n in b.tape.nodes], opset_imports={"": 18})
    for _, b in outs:
        for init in b.initializers:
            g.register_initializer(init)
    model = ir.Model(g, ir_version=10)
    rng = np.random.default_rng(0)
    z = (rng.standard_normal((64, c)) * 3).astype(np.float32)
    zp = (rng.standard_normal((64, c)) * 3).astype(np.float32)
    zp[:20] = z[:20] + 0.1  # some rows agree with the previous exit
    first, nxt = ort_session(model).run(None, {"logits": z, "prev": zp})
    np.testing.assert_allclose(first, policy_scores(z, None, *POLICY[1]), rtol=0, atol=SCORE_ATOL)
    np.testing.assert_allclose(nxt, policy_scores(z, zp, *POLICY[1]), rtol=0, atol=SCORE_ATOL)
    pol = ExitPolicy([POLICY[1][0], None], [POLICY[1][1], None])
    np.testing.assert_allclose(pol.score(0, _softmax(z.astype(np.float64)), _softmax(zp.astype(np.float64))),
                               nxt, rtol=0, atol=SCORE_ATOL)


@pytest.mark.parametrize("exit_at", [1, 2, 3, LAYERS])
def test_every_if_branch_taken(exit_at):
    m = with_learned({})
    heads = head_outputs(m)
    scores = numpy_scores(heads)
    # exits before exit_at: a threshold above every row's score; exit_at: below every row's score
    thr = {k: float(scores[i].max() + 1.0) if k < exit_at else float(scores[i].min() - 1.0) for i, k in enumerate(EXITS)}
    if exit_at == LAYERS:
        thr = {k: float(scores[i].max() + 1.0) for i, k in enumerate(EXITS)}
    m = with_learned(thr)
    run_pipeline([InsertEarlyExitPass("if")], m, check="each")  # onnx.checker full_check after the pass
    logits, layer = ort_session(m).run(None, FEEDS)
    assert int(layer) == exit_at
    want = heads[f"exit_logits_{exit_at}"] if exit_at < LAYERS else heads["logits"]
    np.testing.assert_allclose(logits, want, rtol=0, atol=1e-5)


def test_if_learned_exits_only_when_every_row_passes():
    m = with_learned({})
    heads = head_outputs(m)
    s2 = numpy_scores(heads)[1]
    thr = float(np.sort(s2)[1] - SCORE_ATOL * 10)  # every row but the lowest-scoring one passes exit 2
    assert np.sort(s2)[1] - np.sort(s2)[0] > SCORE_ATOL * 20
    m = with_learned({2: thr})
    run_pipeline([InsertEarlyExitPass("if")], m, check="each")
    _, layer = ort_session(m).run(None, FEEDS)
    assert int(layer) == LAYERS
    keep = np.argsort(s2)[1:]
    _, layer = ort_session(m).run(None, {k: v[keep] for k, v in FEEDS.items()})
    assert int(layer) == 2


def test_staged_learned_per_row_exits_match_numpy(tmp_path, provider):
    m = with_learned({})
    heads = head_outputs(m)
    scores = numpy_scores(heads)
    thr = [float(np.median(s)) for s in scores]
    m = with_learned(dict(zip(EXITS, thr)))
    InsertEarlyExitPass("staged")(m)
    plan = emit_plan(m, EmitRequest(out_dir=tmp_path, task="text-classification"))
    save_plan(plan, tmp_path)
    segs = plan.steps[0].params["segments"]
    assert [s.get("score") for s in segs] == ["exit_score_1", "exit_score_2", "exit_score_3", None]
    assert [s.get("prev_head") for s in segs[:3]] == [None, "exit_logits_1", "exit_logits_2"]
    cm = dyncompile.load(tmp_path, provider=provider, optimization="disable")
    st = cm.run_feeds(dict(FEEDS))
    fires = scores > np.array(thr)[:, None]
    near = np.abs(scores - np.array(thr)[:, None]) < SCORE_ATOL
    first = np.where(fires.any(0), fires.argmax(0), len(EXITS))
    want = np.array([*EXITS, LAYERS])[first]
    ok = ~near.any(0)  # a row within float32 rounding of a threshold may go either way
    np.testing.assert_array_equal(st["exit_layer"][ok], want[ok])
    assert len(set(want.tolist())) > 2  # the batch really splits
    for k in EXITS:
        sel = (st["exit_layer"] == k)
        np.testing.assert_allclose(st["logits"][sel], heads[f"exit_logits_{k}"][sel], rtol=0, atol=tolerance(provider))
    sel = st["exit_layer"] == LAYERS
    np.testing.assert_allclose(st["logits"][sel], heads["logits"][sel], rtol=0, atol=tolerance(provider))
