"""The split-seed study of certified exits: it re-runs the compile's certificate, and measures what the plan runs."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import DATA

import dyncompile
from dyncompile.passes.early_exit.certify import certified_calibration
from dyncompile.tools.studies import certificate_splits as cs


def _arrays(n: int = 1200, nt: int = 900, seed: int = 0, exits: int = 3) -> dict:
    """Synthetic per-row arrays: a reference that is right ~85 % of the time, exits that agree more the later."""
    rng = np.random.default_rng(seed)

    def rows(m):
        y = rng.integers(0, 2, m)
        ref_pred = np.where(rng.random(m) < 0.85, y, 1 - y)
        ref = np.eye(2)[ref_pred] * 0.8 + 0.1
        ex = []
        for e in range(exits):
            conf = rng.random(m)  # confident rows agree with the reference more often
            agree = rng.random(m) < 0.55 + 0.1 * e + 0.4 * conf
            pred = np.where(agree, ref_pred, 1 - ref_pred)
            p1 = 0.5 + 0.5 * conf
            ex.append(np.where(pred[:, None] == 1, np.c_[1 - p1, p1], np.c_[p1, 1 - p1]))
        return y, ref.astype(np.float32), np.stack(ex).astype(np.float32)

    y, ref, ex = rows(n)
    yt, reft, ext = rows(nt)
    return {"oof": ex, "teacher": ref, "labels": y, "reference": ref, "test_exits": ext, "test_teacher": reft,
            "test_labels": yt, "test_reference": reft, "exits": np.arange(1, exits + 1), "num_layers": np.int64(exits + 1)}


@pytest.mark.parametrize("criterion", ["learned", "entropy"])
def test_seed_zero_is_the_compiles_certificate(criterion):
    a = _arrays()
    r = cs.analyse(a, [4.0], seeds=4, criterion=criterion)
    certified, _ = certified_calibration(a["oof"], a["teacher"], a["labels"], [1, 2, 3], 4, budget=4.0, confidence=0.9,
                                         criterion=criterion, reference_probs=a["reference"])
    s0 = r["budgets"][0]["seed0"]
    assert s0["certified"] and s0["bound"] == certified.certificate.bound
    assert s0["expected_speedup"] == certified.certificate.expected_speedup
    # other seeds split differently, so they certify other settings
    assert len({row["expected_speedup"] for row in r["budgets"][0]["rows"] if row["certified"]}) > 1


def test_test_rows_equal_to_the_calibration_rows_give_the_calibration_loss():
    a = _arrays()
    same = a | {"test_exits": a["oof"], "test_teacher": a["teacher"], "test_labels": a["labels"],
                "test_reference": a["reference"]}
    s0 = cs.analyse(same, [4.0], seeds=1, criterion="learned")["budgets"][0]["seed0"]
    assert s0["test_drop"] == s0["losses_at_setting"]["all_rows"]
    # the path and certifying parts average (by their sizes) to the whole
    los = s0["losses_at_setting"]
    n = len(a["labels"])
    k = round(0.3 * (a["labels"] == 0).sum()) + round(0.3 * (a["labels"] == 1).sum())
    assert abs((los["path_rows"] * k + los["certifying_rows"] * (n - k)) / n - los["all_rows"]) < 0.01


def test_test_rows_where_every_exit_is_wrong_break_every_budget():
    a = _arrays()
    wrong = 1 - a["test_reference"].argmax(-1)  # every exit's answer flipped: each early stop costs the row
    ext = np.stack([np.eye(2, dtype=np.float32)[wrong] * 0.98 + 0.01] * a["test_exits"].shape[0])
    bad = a | {"test_exits": ext, "test_labels": a["test_reference"].argmax(-1)}
    b = cs.analyse(bad, [4.0], seeds=3, criterion="learned")["budgets"][0]
    assert b["certified"] == 3 and b["test_drop_over_budget"] == 1.0
    good = cs.analyse(a | {"test_exits": np.stack([a["test_teacher"]] * a["test_exits"].shape[0])}, [4.0], seeds=3,
                      criterion="learned")["budgets"][0]
    assert good["test_drop_mean"] == 0.0  # exits that always agree with the model cost nothing (the model is the reference)


def test_markdown_rerenders_from_the_json():
    r = cs.analyse(_arrays(), [4.0, 0.01], seeds=2, criterion="learned")
    text = cs.render_markdown(json.loads(json.dumps(r)))
    assert text == cs.markdown(r)
    assert "| 0.01 | 0 / 2 |" in text  # a budget no split certifies is reported as refused, not dropped
    speeds = [row["expected_speedup"] for row in r["budgets"][0]["rows"]]
    assert r["budgets"][0]["seed0_rank"] == 1 + sum(v > speeds[0] for v in speeds)


def test_merged_certificates_ship_one_of_k_settings_each_certified_at_the_union_bound():
    """``--merge K``: each seed of a group certifies at 1 - delta / K (here 0.95), and the group ships its fastest or
    (lower) median setting; with a stricter confidence no group is faster than the same seed at 90 %."""
    a = _arrays()
    r = cs.merged(a, [4.0], seeds=4, k=2, criterion="learned")
    assert r["confidence_each"] == 0.95 and r["groups"] == 2
    b = r["budgets"][0]
    each = []
    for seed in range(4):
        c, _ = certified_calibration(a["oof"], a["teacher"], a["labels"], [1, 2, 3], 4, budget=4.0, confidence=0.95,
                                     criterion="learned", reference_probs=a["reference"], seed=seed, split_check=0)
        loose, _ = certified_calibration(a["oof"], a["teacher"], a["labels"], [1, 2, 3], 4, budget=4.0, confidence=0.9,
                                         criterion="learned", reference_probs=a["reference"], seed=seed, split_check=0)
        # the same path walked at a stricter level stops no later
        assert c.certificate.expected_speedup <= loose.certificate.expected_speedup
        each.append(round(c.certificate.expected_speedup, 3))
    assert b["fastest"]["expected_speedup"] == [max(each[:2]), max(each[2:])]
    assert b["median"]["expected_speedup"] == [min(each[:2]), min(each[2:])]  # the lower median of two
    text = cs.render_markdown(json.loads(json.dumps(r)))
    assert text == cs.markdown(r) and "merged over 2 calibration splits" in text


def test_minilm_seed_zero_reproduces_the_compiled_plan(minilm, module_tmp):
    """On the real MiniLM-L6: the study's seed 0 is the plan ``--passes early-exit`` ships, on the test rows too."""
    d = module_tmp("splits")
    calib, test = d / "calib.jsonl", d / "test.jsonl"
    calib.write_text("\n".join((DATA / "movie-calib.jsonl").read_text().splitlines()[:400]) + "\n")
    test.write_text("\n".join((DATA / "movie-test.jsonl").read_text().splitlines()[:200]) + "\n")
    base = dyncompile.compile(minilm.onnx_path, "cleanup", d / "base", progress=False)
    plan = dyncompile.compile(minilm.onnx_path, "early-exit", d / "exits", calib=str(calib), budget=6.0,
                              confidence=0.9, criterion="learned", lowering="if", progress=False)
    a = cs.collect(base.plan_dir, calib, test, None, "fitted", progress=False)
    s0 = cs.analyse(a, [6.0], seeds=1, criterion="learned")["budgets"][0]["seed0"]
    cert = json.loads((plan.plan_dir / "plan.json").read_text())["policy"]["early_exit"]["certificate"]
    assert (s0["bound"], s0["expected_speedup"]) == (cert["bound"], cert["expected_speedup"])
    compiled = dyncompile.load(plan.plan_dir)
    rows = [json.loads(x) for x in test.read_text().splitlines()]
    y = np.array([compiled.plan.labels.index(r["label"]) if isinstance(r["label"], str) else int(r["label"]) for r in rows])
    pred = np.array([compiled.predict_proba([r["text"]], batch_size=1)[0].argmax() for r in rows])
    ref = a["test_reference"].argmax(-1)
    plan_drop = 100.0 * float((ref == y).mean() - (pred == y).mean())
    assert abs(plan_drop - s0["test_drop"]) <= 100.0 / len(rows) + 1e-9  # one row at most (float ties at a threshold)


def test_shift_of_a_file_against_itself_finds_nothing():
    a = _arrays()
    same = a | {"test_exits": a["oof"], "test_teacher": a["teacher"], "test_labels": a["labels"],
                "test_reference": a["reference"]}
    r = cs.shift(same, [4.0], seeds=2, criterion="learned", permutations=500, bootstraps=200)
    assert all(e["drop_difference"] == 0.0 and e["calibration"] == e["test"] for e in r["per_exit"])
    for test in r["exchangeability"].values():  # every re-draw differs at least as much as no difference at all
        assert test["observed"] == 0.0 and test["p_two_sided"] == 1.0
    b = r["budgets"][0]
    assert b["calibration_drop"] == b["test_drop"] and b["calibration_disagreement"] == b["test_disagreement"]
    assert all(row["difference"] == 0.0 and row["p_two_sided"] == 1.0 for row in r["borderline"]["rows"])


def test_borderline_rows_tell_labels_that_favour_the_original_on_one_file():
    """The original's least-sure rows: right on every test row and wrong on every calibration row -> a difference of
    1 and a small p; the same labels on both files -> no difference; each accuracy is the direct count."""
    a = _arrays()
    rng = np.random.default_rng(1)
    for part, lab in (("reference", "labels"), ("test_reference", "test_labels")):
        conf = rng.uniform(0.5, 1.0, len(a[lab]))  # the original's probability of its own answer
        pred = a[part].argmax(-1)
        a[part] = np.where(pred[:, None] == 1, np.c_[1 - conf, conf], np.c_[conf, 1 - conf]).astype(np.float32)
    k = 100

    def least_sure(part):
        p = a[part]
        return np.argsort(np.abs(p[:, 1] - p[:, 0]), kind="stable")[:k]

    fav = dict(a)
    c_rows, t_rows = least_sure("reference"), least_sure("test_reference")
    fav["labels"] = a["labels"].copy()
    fav["labels"][c_rows] = 1 - a["reference"][c_rows].argmax(-1)  # the original wrong on calibration's least sure
    fav["test_labels"] = a["test_labels"].copy()
    fav["test_labels"][t_rows] = a["test_reference"][t_rows].argmax(-1)  # and right on the test file's
    r = cs._borderline(fav, (50, 100, 5000), permutations=2000, seed=0)
    assert [row["k"] for row in r["rows"]] == [50, 100]  # k beyond the smaller file is left out
    row = r["rows"][1]
    assert (row["calibration"], row["test"], row["difference"]) == (0.0, 1.0, 1.0) and row["p_two_sided"] < 0.001
    same = cs._borderline(fav | {"test_reference": fav["reference"], "test_labels": fav["labels"]}, (100,),
                          permutations=200, seed=0)["rows"][0]
    assert same["difference"] == 0.0 and same["p_two_sided"] == 1.0
    plain = cs._borderline(a, (100,), permutations=2000, seed=0)["rows"][0]
    right = a["test_reference"].argmax(-1)[t_rows] == a["test_labels"][t_rows]
    assert plain["test"] == round(float(right.mean()), 3) and plain["p_two_sided"] > 0.01


def test_shift_separates_labels_that_favour_the_original_from_exits_that_disagree_more():
    a = _arrays()
    base = cs.shift(a, [4.0], seeds=3, criterion="learned", permutations=2000, bootstraps=200)
    # relabel the test rows: wherever the first exit disagrees with the original, the original is right
    ref_t, ex0 = a["test_reference"].argmax(-1), a["test_exits"][0].argmax(-1)
    lucky = a | {"test_labels": np.where(ex0 != ref_t, ref_t, a["test_labels"])}
    r = cs.shift(lucky, [4.0], seeds=3, criterion="learned", permutations=2000, bootstraps=200)
    assert r["per_exit"][0]["test"]["original_right"] == 1.0
    assert r["per_exit"][0]["test"]["drop"] > base["per_exit"][0]["test"]["drop"]
    assert r["exchangeability"]["drop"]["p_two_sided"] < 0.01 < base["exchangeability"]["drop"]["p_two_sided"]
    # the label-free test does not read labels: same statistic as before
    assert r["exchangeability"]["disagreement"]["observed"] == base["exchangeability"]["disagreement"]["observed"]
    # the share over budget is the split study's own number for the same certified settings
    assert r["budgets"][0]["test_drop_over_budget"] == cs.analyse(lucky, [4.0], seeds=3, criterion="learned")[
        "budgets"][0]["test_drop_over_budget"]
    lo, hi = r["budgets"][0]["test_drop_over_budget_interval"]
    assert lo <= r["budgets"][0]["test_drop_over_budget"] <= hi
    text = cs.render_markdown(json.loads(json.dumps(r)))
    assert text == cs.markdown(r) and "Exchangeability of the two files" in text and "least sure of" in text


def test_agreement_metric_certifies_without_labels_and_bounds_the_drop():
    a = _arrays()
    r = cs.analyse(a, [8.0], seeds=3, criterion="learned", metric="agreement")
    certified, _ = certified_calibration(a["oof"], a["teacher"], None, [1, 2, 3], 4, budget=8.0, confidence=0.9,
                                         criterion="learned", reference_probs=a["reference"])
    b = r["budgets"][0]
    assert r["metric"] == "agreement" and b["seed0"]["bound"] == certified.certificate.bound
    ok = [row for row in b["rows"] if row["certified"]]
    assert ok and all(abs(row["test_drop"]) <= row["test_disagreement"] for row in ok)
    assert any(row["test_disagreement"] > abs(row["test_drop"]) for row in ok)  # disagreements cancel in the drop
    accuracy = cs.analyse(a, [8.0], seeds=3, criterion="learned")
    assert "metric" not in accuracy and accuracy["budgets"][0]["seed0"]["bound"] != b["seed0"]["bound"]
    assert cs.render_markdown(json.loads(json.dumps(r))) == cs.markdown(r)
