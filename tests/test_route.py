"""Routing and cascades on tiny generated models and stored arrays (fast): the calibration reuses the early-exit
certifier exactly, the check rule's bound, and a check cascade over two decoder plans."""

from __future__ import annotations

import numpy as np
import pytest
from hostile_plans import decoder_dir, generate_plan, routed_plan, word_calib

import dyncompile
from dyncompile.passes.early_exit.certify import CertificationError, certify_exits
from dyncompile.passes.routing import calibrate_cascade, calibrate_check, cascade_costs, route_costs


def _synthetic(n=1500, seed=0):
    """A cheap model right 85 % of the time (more when confident) and a reference right 92 %."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    conf = rng.uniform(0.5, 1.0, n)
    right_small = rng.uniform(size=n) < 0.55 + 0.45 * conf
    small_pred = np.where(right_small, y, 1 - y)
    ps = np.stack([1 - conf, conf], 1)
    ps = np.where(small_pred[:, None] == 1, ps, ps[:, ::-1])
    right_big = rng.uniform(size=n) < 0.92
    big_pred = np.where(right_big, y, 1 - y)
    pb = np.where(big_pred[:, None] == 1, [[0.1, 0.9]], [[0.9, 0.1]])
    return ps, pb, y


def test_costs():
    assert cascade_costs([2.0, 10.0], 10.0) == [0.2, 1.2]
    assert route_costs([2.0, 10.0], 10.0, 0.5) == [0.25, 1.05]


def test_cascade_calibration_is_the_early_exit_certifier():
    ps, pb, y = _synthetic()
    fit = calibrate_cascade([ps, pb], pb, y, [2.0, 10.0], 10.0, budget=2.0, criterion="maxprob")
    same = certify_exits(np.stack([ps, pb]), pb, y, [0.2, 1.2], budget=2.0, criterion="maxprob", reference_probs=pb)
    assert fit.thresholds == same.thresholds[:-1]
    assert fit.certificate == same.certificate.to_dict()
    assert fit.certificate["certified"] and fit.certificate["bound"] <= 2.0
    assert fit.calibration["candidate_histogram"] == same.exit_histogram
    # agreement mode (no labels) is the early exit's agreement mode
    fa = calibrate_cascade([ps, pb], pb, None, [2.0, 10.0], 10.0, budget=5.0, criterion="maxprob")
    assert fa.certificate["mode"] == "agreement" and fa.calibration["metric"] == "agreement"


def test_cascade_refuses_an_impossible_budget_naming_one_that_works():
    ps, pb, y = _synthetic(n=400)
    with pytest.raises(CertificationError, match=r"use --budget \d") as e:
        calibrate_cascade([ps, pb], pb, y, [2.0, 10.0], 10.0, budget=0.0)
    assert e.value.certifiable_budget is not None and e.value.certifiable_budget > 0


def test_check_rule_bound_and_refusal():
    rng = np.random.default_rng(1)
    n = 600
    ref_ok = rng.uniform(size=n) < 0.7
    small_ok = ref_ok & (rng.uniform(size=n) < 0.8)
    passes = small_ok.copy()  # a perfect check: it passes exactly the right answers
    fit = calibrate_check(passes[None], np.stack([small_ok, ref_ok]), ref_ok, [1.0, 5.0], 5.0, budget=1.0)
    assert fit.certificate["observed"] == 0.0 and fit.certificate["certified"]
    assert fit.calibration["candidate_histogram"] == [int(passes.sum()), int(n - passes.sum())]
    # a check that passes everything keeps every wrong small answer: about 14 points lost, refused at 1
    with pytest.raises(CertificationError, match="--budget"):
        calibrate_check(np.ones((1, n), bool), np.stack([small_ok, ref_ok]), ref_ok, [1.0, 5.0], 5.0, budget=1.0)


@pytest.fixture(scope="module")
def decoders(module_tmp):
    root = module_tmp("dec")
    a = generate_plan(decoder_dir(root / "a"), root / "small")
    b = generate_plan(decoder_dir(root / "b"), root / "big")
    return root, a, b


def test_check_cascade_over_decoder_plans(decoders):
    from dyncompile.runtime.routing.route import register_check

    root, small, big = decoders
    seen = []

    @register_check("test-prompt-has-w3")
    def has_w3(record, output):
        seen.append((record, output))
        return "w3" in record["prompt"]

    @register_check("test-judge-always")
    def judge(record, output):
        return True

    calib = word_calib(root / "prompts.jsonl", labels=False, field="prompt")
    plan = routed_plan([small, big], root / "routed", calib, rule="check", check="test-prompt-has-w3",
                       judge="test-judge-always")
    m = dyncompile.load(plan)
    ref_small = dyncompile.load(small).generate("w3 w4", max_new_tokens=4)
    res = m.generate("w3 w4", max_new_tokens=4)
    assert m.last_info["candidate"] == "small" and m.last_info["checks"] == [True]
    assert res.token_ids == ref_small.token_ids
    ref_big = dyncompile.load(big).generate("w5 w4", max_new_tokens=4)
    res = m.generate("w5 w4", max_new_tokens=4, record={"prompt": "w5 w4", "task_id": 7})
    assert m.last_info["candidate"] == "big" and m.last_info["checks"] == [False]
    assert res.token_ids == ref_big.token_ids
    assert seen[-1][0] == {"prompt": "w5 w4", "task_id": 7} and set(seen[-1][1]) == {"text", "token_ids"}
