"""Trained exit heads (attention pooling + MLP, ``early-exit{heads=trained}``): numpy vs ONNX, If and staged
lowerings with every branch taken, the PyTorch training on a small synthetic cache, and one lean real-model
compile (the full path stays the original's)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from helpers import EE_FEEDS, EE_LAYERS, lower_if, ort_session, tolerance

import dyncompile
from dyncompile.models.synthetic import tiny_encoder_classifier
from dyncompile.passes import InsertEarlyExitPass, _keys
from dyncompile.passes.early_exit import FitExitHeadsPass
from dyncompile.passes.early_exit.attach_exit_heads import attach_exit_heads
from dyncompile.passes.early_exit.checks import CalibrationError
from dyncompile.passes.early_exit.heads import ExitHead, attention_pool
from dyncompile.passes.emit import EmitRequest, emit_plan
from dyncompile.plan import save_plan

FEEDS, LAYERS, EXITS = EE_FEEDS, EE_LAYERS, (1, 2, 3)


def _attn_head(seed: int, hidden: int = 256, width: int = 8) -> ExitHead:
    rng = np.random.default_rng(seed)
    return ExitHead(
        "cls+mean+attn",
        [(rng.standard_normal((3 * hidden, width)).astype(np.float32) * 0.1, rng.standard_normal(width).astype(np.float32), "gelu"),
         (rng.standard_normal((width, 2)).astype(np.float32), rng.standard_normal(2).astype(np.float32), "none")],
        attn_query=rng.standard_normal(hidden).astype(np.float32) * 0.3,
    )


def _cuts(m):
    lns = [n for n in m.graph if n.op_type == "LayerNormalization"]  # [embeddings, layer1..layer4]
    return {k: lns[k].outputs[0].name for k in EXITS}


def with_attn_heads(thresholds):
    m = tiny_encoder_classifier(num_layers=LAYERS)
    cuts = _cuts(m)
    attach_exit_heads(m, heads={k: _attn_head(k) for k in EXITS}, cuts=cuts,
                      thresholds={k: thresholds.get(k) for k in EXITS}, num_layers=LAYERS)
    return m


@pytest.fixture(scope="module")
def reference():
    """Original logits and the hidden states at the cuts (untouched model)."""
    probe = tiny_encoder_classifier(num_layers=LAYERS)
    cuts = _cuts(probe)
    values = ir.convenience.create_value_mapping(probe.graph)
    probe.graph.outputs.extend(values[cuts[k]] for k in EXITS)
    logits, *hs = ort_session(probe).run(None, FEEDS)
    return logits, dict(zip(EXITS, hs))


def _head_outputs(m):
    sess = ort_session(m)
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, FEEDS)))


def test_attention_pool_ignores_padding_and_zero_query_is_the_mean():
    rng = np.random.default_rng(0)
    h = rng.standard_normal((2, 5, 4)).astype(np.float32)
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    q = rng.standard_normal(4).astype(np.float32)
    h2 = h.copy()
    h2[0, 3:] = 1e3  # padding content must not matter
    np.testing.assert_allclose(attention_pool(h2, mask, q), attention_pool(h, mask, q), rtol=0, atol=1e-6)
    mean0 = h[0, :3].mean(0)
    np.testing.assert_allclose(attention_pool(h, mask, np.zeros(4))[0], mean0, rtol=0, atol=1e-6)
    s = h[1] @ q
    a = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
    np.testing.assert_allclose(attention_pool(h, mask, q)[1], a @ h[1], rtol=0, atol=1e-5)


def test_attn_head_json_roundtrip_and_refusals():
    head = _attn_head(3, hidden=16)
    back = ExitHead.from_dict(json.loads(json.dumps(head.to_dict())))
    np.testing.assert_array_equal(back.attn_query, head.attn_query)
    assert back.pooling == "cls+mean+attn"
    with pytest.raises(CalibrationError, match="attention query"):
        ExitHead("cls+mean+attn", head.layers)
    with pytest.raises(CalibrationError, match="expects 48"):
        ExitHead("cls+mean+attn", head.layers, attn_query=np.zeros(10, np.float32))


def test_onnx_attn_heads_equal_numpy_and_leave_the_original_alone(reference):
    logits, hs = reference
    m = with_attn_heads({})
    out = _head_outputs(m)
    np.testing.assert_allclose(out["logits"], logits, rtol=0, atol=1e-6)
    for k in EXITS:
        head = _attn_head(k)
        want = head.logits(head.features(hs[k], FEEDS["attention_mask"]))
        np.testing.assert_allclose(out[f"exit_logits_{k}"], want, rtol=0, atol=1e-4)
    # the attention pooling is in the graph: MatMul with the query, a Softmax over the tokens of a [B, 1, S]
    # row; mean and attention pooling are one MatMul of the two weight rows with the states per head; the
    # mask rows are built once for all heads (one Cast of the mask, not one per head)
    nodes, cuts = list(m.graph), set(_cuts(m).values())
    assert sum(n.op_type == "Softmax" and n.attributes["axis"].as_int() == -1 for n in nodes) == len(EXITS)
    def mask_casts(g):
        return sum(n.op_type == "Cast" and n.inputs[0].name == "attention_mask" for n in g)

    assert mask_casts(nodes) == mask_casts(tiny_encoder_classifier(num_layers=LAYERS).graph) + 1
    pools = [n for n in nodes if n.op_type == "MatMul" and n.inputs[1].name in cuts]  # [B, 2, S] x [B, S, H]
    assert len(pools) == len(EXITS) and all(p.inputs[0].producer().op_type == "Concat" for p in pools)
    def count(g, op):
        return sum(n.op_type == op for n in g)

    # no ReduceSum over the token axis per head: the one the heads add counts the mask's tokens
    assert count(nodes, "ReduceSum") == count(tiny_encoder_classifier(num_layers=LAYERS).graph, "ReduceSum") + 1
    assert {"exit1.attn_query", "exit2.attn_query", "exit3.attn_query"} <= set(m.graph.initializers)


def test_if_lowering_never_exit_is_the_original(reference):
    m = lower_if(with_attn_heads({}))
    onnx.checker.check_model(ir.to_proto(m), full_check=True)
    got, layer = ort_session(m).run(None, FEEDS)
    assert int(layer) == LAYERS
    np.testing.assert_allclose(got, reference[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("exit_at", EXITS)
def test_if_lowering_every_branch(exit_at):
    m = with_attn_heads({exit_at: 10.0})  # entropy < 10 always fires
    heads = _head_outputs(m)
    lower_if(m)
    onnx.checker.check_model(ir.to_proto(m), full_check=True)
    got, layer = ort_session(m).run(None, FEEDS)
    assert int(layer) == exit_at
    np.testing.assert_allclose(got, heads[f"exit_logits_{exit_at}"], rtol=0, atol=1e-5)


def test_staged_lowering_per_row_exits(tmp_path, reference, provider):
    m = with_attn_heads({})
    heads = _head_outputs(m)
    probs = {k: np.exp(heads[f"exit_logits_{k}"]) / np.exp(heads[f"exit_logits_{k}"]).sum(-1, keepdims=True) for k in EXITS}
    ent = {k: -(p * np.log(p)).sum(-1) for k, p in probs.items()}
    thr = {k: float(np.median(ent[k])) for k in EXITS}
    m = with_attn_heads(thr)
    InsertEarlyExitPass("staged")(m)
    plan = emit_plan(m, EmitRequest(out_dir=tmp_path, task="text-classification"))
    save_plan(plan, tmp_path)
    for f in plan.files.values():
        onnx.checker.check_model(str(tmp_path / f.path), full_check=True)
    st = dyncompile.load(tmp_path, provider=provider, optimization="disable").run_feeds(dict(FEEDS))
    want = np.full(len(FEEDS["input_ids"]), LAYERS)
    for k in reversed(EXITS):
        want = np.where(ent[k] < thr[k], k, want)
    np.testing.assert_array_equal(st["exit_layer"], want)
    assert len(set(want.tolist())) > 2  # the batch really splits over several exits
    for k in (*EXITS, LAYERS):
        sel = want == k
        ref = reference[0] if k == LAYERS else heads[f"exit_logits_{k}"]
        np.testing.assert_allclose(st["logits"][sel], ref[sel], rtol=0, atol=tolerance(provider))


def _synthetic_cache(n=300, s=8, h=12, seed=0):
    """Rows whose class is carried by one token at a random position (mean pooling dilutes it); padded tails."""
    from dyncompile.passes.early_exit.train_heads import HiddenCache

    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    cache = HiddenCache()
    for i in range(0, n, 32):
        rows = np.arange(i, min(n, i + 32))
        b = len(rows)
        hid = rng.standard_normal((b, s, h)).astype(np.float32)
        lengths = rng.integers(3, s + 1, b)
        mask = (np.arange(s)[None] < lengths[:, None]).astype(np.int64)
        pos = rng.integers(1, lengths)
        hid[np.arange(b), pos, 0] = 6.0  # the marker token: large on dim 0 ...
        hid[np.arange(b), pos, 1] = np.where(y[rows] == 1, 3.0, -3.0)  # ... carries the class on dim 1
        hid[mask == 0] = 50.0  # padding garbage
        cache.add(rows, mask, [hid])
    teacher = np.where(y[:, None] == np.arange(2)[None], 0.9, 0.1)
    return cache, teacher, y


def test_training_learns_attention_and_ships_an_exact_folded_head():
    pytest.importorskip("torch")
    from dyncompile.passes.early_exit.train_heads import train_exit_heads

    cache, teacher, y = _synthetic_cache()
    fit = train_exit_heads(cache, teacher, y, width=16, epochs=30, lr=1e-2, folds=3, seed=0)
    assert fit.oof_probs.shape == (1, 300, 2)
    assert fit.oof_agreement[0] > 90.0  # out-of-fold: the attention found the marker token
    head = fit.heads[0]
    assert head.pooling == "cls+mean+attn" and head.attn_query.shape == (12,)
    # the shipped head (standardisation folded in) reads raw states and predicts the classes
    pred = np.concatenate([head.logits(head.features(hs[0].astype(np.float32), m)).argmax(1) for _, m, hs in cache.batches])
    rows = np.concatenate([r for r, _, _ in cache.batches])
    assert (pred == y[rows]).mean() > 0.95
    assert fit.config["heads"] == "trained"


def _subset(cache, n):
    """The cache's rows ``< n`` (same batches, same order)."""
    from dyncompile.passes.early_exit.train_heads import HiddenCache

    sub = HiddenCache()
    for rows, m, hs in cache.batches:
        keep = rows < n
        if keep.any():
            sub.batches.append((rows[keep], m[keep], [h[keep] for h in hs]))
    return sub


def test_extra_training_rows_train_every_member_and_keep_oof_out_of_fold():
    """n_calibration: rows after the calibration rows are extra distillation text. 60 calibration rows (20 per
    fold head) are too few to find the marker token; 540 extra rows teach every member, so the calibration rows'
    out-of-fold agreement rises. The OOF probabilities cover the calibration rows only, and a calibration row's
    OOF probability does not depend on its own target (its fold's member never trains on it) — the extra rows'
    targets, which every member sees, do move it."""
    pytest.importorskip("torch")
    from dyncompile.passes.early_exit.train_heads import train_exit_heads

    cache, teacher, y = _synthetic_cache(n=600)
    n = 60
    kw = dict(width=16, epochs=30, lr=1e-2, folds=3, seed=0)
    alone = train_exit_heads(_subset(cache, n), teacher[:n], y[:n], **kw)
    extra = train_exit_heads(cache, teacher, y[:n], n_calibration=n, **kw)
    assert alone.oof_probs.shape == extra.oof_probs.shape == (1, n, 2)
    assert "extra_training_rows" not in alone.config and extra.config["extra_training_rows"] == 600 - n
    assert alone.oof_agreement[0] < 80.0 < 95.0 < extra.oof_agreement[0], (alone.oof_agreement, extra.oof_agreement)
    # flip one calibration row's target: its own OOF probability is unchanged, the shipped head is not
    flipped = teacher.copy()
    flipped[7] = flipped[7][::-1]
    moved = train_exit_heads(cache, flipped, y[:n], n_calibration=n, **kw)
    np.testing.assert_array_equal(moved.oof_probs[0, 7], extra.oof_probs[0, 7])
    assert not np.array_equal(moved.heads[0].layers[0][0], extra.heads[0].layers[0][0])
    # flip the extra rows' targets: every member learns them, so the calibration rows' OOF probabilities move
    wrong = teacher.copy()
    wrong[n:] = wrong[n:, ::-1]
    misled = train_exit_heads(cache, wrong, y[:n], n_calibration=n, **kw)
    assert misled.oof_agreement[0] < 50.0
    with pytest.raises(CalibrationError, match="n_calibration"):
        train_exit_heads(cache, teacher, y[:n], n_calibration=601, **kw)
    with pytest.raises(CalibrationError, match="labels for"):
        train_exit_heads(cache, teacher, y, n_calibration=n, **kw)


def test_train_text_needs_trained_heads(tmp_path):
    from dyncompile.errors import PassConfigError

    m = tiny_encoder_classifier(num_layers=LAYERS)
    with pytest.raises(ir.passes.PreconditionError, match="heads=trained"):
        FitExitHeadsPass(["x"] * 200, None, tokenizer_file=__file__, train_texts=["y"] * 10).requires(m)
    src = tmp_path / "m.onnx"
    ir.save(m, src)
    with pytest.raises(PassConfigError, match="--heads trained"):
        dyncompile.compile(src, "early-exit", tmp_path / "out", calib=__file__, progress=False,
                           train_text=__file__)
    assert not (tmp_path / "out").exists()


def test_trained_heads_refuse_a_pooling_and_the_linear_fit_refuses_attn():
    m = tiny_encoder_classifier(num_layers=LAYERS)
    fit = FitExitHeadsPass(["x"] * 200, [0, 1] * 100, tokenizer_file=__file__, heads="trained", pooling="cls")
    with pytest.raises(ir.passes.PreconditionError, match="own architecture"):
        fit.requires(m)
    with pytest.raises(ir.passes.PreconditionError, match="unknown heads"):
        FitExitHeadsPass(["x"] * 200, None, tokenizer_file=__file__, heads="deep").requires(m)
    from dyncompile.passes.early_exit.newton import fit_exit_heads_newton

    with pytest.raises(CalibrationError, match="heads='trained'"):
        fit_exit_heads_newton([np.zeros((10, 4), np.float32)], np.full((10, 2), 0.5), None, pooling="cls+mean+attn")


def test_real_minilm_trained_heads_full_path_is_the_original(minilm, module_tmp):
    """heads=trained, metric=agreement on the real model (300 calib rows + 100 rows of extra training text,
    exits 2 and 4): heads attached as attention + MLP, metadata says so, and with every exit disabled the If
    plan reproduces the original logits."""
    pytest.importorskip("torch")
    from helpers import DATA

    lines = (DATA / "movie-calib.jsonl").read_text().splitlines()[:300]
    calib = module_tmp("trained") / "calib.jsonl"
    calib.write_text("\n".join(lines) + "\n")
    extra = module_tmp("trained") / "train.jsonl"  # extra distillation text (labels dropped: never read)
    extra.write_text("".join(json.dumps({"text": json.loads(x)["text"]}) + "\n"
                             for x in (DATA / "movie-train.jsonl").read_text().splitlines()[:100]))
    out = module_tmp("trained") / "plan"
    dyncompile.compile(minilm.onnx_path, "early-exit", out, calib=str(calib), progress=False, heads="trained",
                       exits="2,4", never_exit=True, lowering="if", confidence="none", metric="agreement",
                       train_text=str(extra))
    model = ir.load(out / "model.onnx")
    meta = json.loads(model.metadata_props[_keys.EARLY_EXIT])
    assert meta["fit"]["heads"] == "trained" and meta["fit"]["pooling"] == "cls+mean+attn"
    assert meta["fit"]["extra_training_rows"] == 100 and "running the extra training text" in meta["fit"]["phases"]
    assert meta["certificate"]["mode"] == "agreement"  # metric=agreement: the labels only trained the heads
    assert any(n.endswith("attn_query") for n in _all_initializers(model))
    rows = [json.loads(x) for x in (DATA / "movie-test.jsonl").read_text().splitlines()[:16]]
    cm = dyncompile.load(out)
    ref = ort_session(minilm.onnx_path)
    from dyncompile.runtime.text import TextEncoder

    enc = TextEncoder(minilm.tokenizer_path, max_length=512)
    for r in rows[:8]:
        feeds = enc([r["text"]])
        inputs = {i.name: feeds[i.name] for i in ref.get_inputs()}
        want = ref.run(None, inputs)[0]
        got = cm.run_feeds(dict(inputs))
        np.testing.assert_allclose(got["logits"], want, rtol=0, atol=1e-5)


def _all_initializers(model):
    names = set(model.graph.initializers)
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.GRAPH:
                names |= set(attr.as_graph().initializers)
    return names


def test_metric_option_is_checked(tmp_path):
    from dyncompile.errors import PassConfigError

    src = tmp_path / "m.onnx"
    ir.save(tiny_encoder_classifier(num_layers=LAYERS), src)
    with pytest.raises(ir.passes.PreconditionError, match="unknown metric"):
        FitExitHeadsPass(["x"] * 200, None, tokenizer_file=__file__, metric="f1").requires(
            tiny_encoder_classifier(num_layers=LAYERS))
    with pytest.raises(PassConfigError, match="metric"):
        dyncompile.compile(src, "early-exit", tmp_path / "out", calib=__file__, progress=False, metric="f1")


def test_agreement_certificate_ignores_labels_and_bounds_the_drop():
    """metric=agreement certifies mean 1[exit != full]; per row that is >= the accuracy loss, so the certified
    disagreement bound also bounds the observed accuracy drop on the certifying rows."""
    from dyncompile.passes.early_exit.certify import certify_exits, exit_losses

    rng = np.random.default_rng(0)
    n = 3000
    y = rng.integers(0, 2, n)
    full = np.where(rng.random(n) < 0.9, y, 1 - y)
    p_full = np.eye(2)[full] * 0.9 + 0.05
    noise = rng.random(n)
    exit_pred = np.where(noise < 0.85, full, 1 - full)
    conf = np.where(exit_pred == full, 0.6 + 0.4 * rng.random(n), 0.5 + 0.3 * rng.random(n))
    p_exit = np.stack([1 - conf, conf], 1)
    p_exit[exit_pred == 0] = p_exit[exit_pred == 0][:, ::-1]
    probs = np.stack([p_exit, p_full]).astype(np.float32)
    res = certify_exits(probs, p_full, None, [0.5, 1.0], budget=2.0, confidence=0.9)
    assert res.certificate.mode == "agreement" and res.certificate.certified
    lab = exit_losses(probs, full, y)  # accuracy loss per row: 1[exit wrong] - 1[full wrong]
    agr = exit_losses(probs, full, None)  # 1[exit != full]
    assert (lab <= agr + 1e-12).all() and (lab < agr).any()
