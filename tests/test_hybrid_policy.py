"""The hybrid-policy study's replay: rounds hop by the accepted drafts, each rule picks its part, costs follow the
plan's verification curve."""

import pytest

from dyncompile.tools.studies import hybrid_policy


def _prompts():
    skipped = {"match": 3, "lookup": 8, "lookup_accepted": 8, "head_accepted": 8}  # never a round's start below
    none = {"match": 0, "lookup": 0, "lookup_accepted": 0, "head_accepted": 0}
    pos = [{"match": 3, "lookup": 8, "lookup_accepted": 5, "head_accepted": 1}, *[skipped] * 5,
           {"match": 1, "lookup": 8, "lookup_accepted": 0, "head_accepted": 2}, none, none]
    return [{"positions": pos}]


def test_replay_follows_each_rule():
    table = {1: 1.0, 9: 2.0}  # v(s) = 1 + (s - 1) / 8
    res = hybrid_policy.analyse(_prompts(), max_ngram=3, draft=8, verify_table=table, head_cost=0.1)
    rules = {r["rule"]: r for r in res["rules"]}
    # min_match 3: lookup at 0 (6 tokens, v(9) = 2), the head at 6 (3 tokens, 2 + 8 x 0.1): 9 tokens for 4.8
    r3 = rules["hybrid, lookup_min_match=3"]
    assert r3["tokens_per_call"] == pytest.approx(9 / 2) and r3["speedup"] == pytest.approx(9 / 4.8)
    # min_match 1: the one-token match at 6 drafts lookup's chain (rejected), then the head twice at 7 and 8
    r1 = rules["hybrid, lookup_min_match=1"]
    assert r1["tokens_per_call"] == pytest.approx(9 / 4) and r1["cost_per_token"] == pytest.approx(9.6 / 9)
    # prompt lookup alone: no draft where there is no match (cost 1, one token)
    alone = rules["prompt lookup alone"]
    assert alone["cost_per_token"] == pytest.approx((2 + 2 + 1 + 1) / 9)
    assert [b["match"] for b in res["by_match"]] == [0, 1, 3]
    assert res["by_match"][2] == {"match": 3, "positions": 6, "lookup_accepted": (5 + 5 * 8) / 6,
                                  "head_accepted": (1 + 5 * 8) / 6}


def test_markdown_renders_from_the_report_alone():
    res = hybrid_policy.analyse(_prompts(), max_ngram=3, draft=8, verify_table={1: 1.0, 9: 2.0}, head_cost=0.1)
    report = {"plan": "p", "prompt_files": ["a.jsonl"], "max_new_tokens": 8, "draft": 8, "verify_cost": {"1": 1.0},
              "head_cost": 0.1, "sets": {"a": {"positions": 9, **res}}}
    md = hybrid_policy.render_markdown(report)
    assert "| hybrid, lookup_min_match=3 | 4.50 |" in md and "| 3 | 6 |" in md
