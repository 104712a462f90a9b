"""The peers bench's paired statistics: per-prompt rate ratios with bootstrap intervals, which runner pairs are
compared, and the prefill ceiling."""

import numpy as np
import pytest

from dyncompile.tools.bench.common import paired_ratio
from dyncompile.tools.bench.peers import Runner, markdown_report, paired_comparisons, summarize


def test_paired_ratio_recovers_a_known_ratio_and_its_uncertainty():
    rng = np.random.default_rng(1)
    b = rng.uniform(5, 50, 40)  # prompts of very different speeds: pairing must remove that spread
    exact = paired_ratio(2 * b, b)
    assert exact["ratio"] == pytest.approx(2.0) and exact["lo"] == pytest.approx(2.0) and exact["hi"] == pytest.approx(2.0)
    # a 10 % lead under 3 % per-prompt noise: the interval holds 1.10 and excludes 1
    lead = paired_ratio(1.10 * b * np.exp(rng.normal(0, 0.03, 40)), b)
    assert 1.07 < lead["ratio"] < 1.13 and lead["lo"] > 1.0 and lead["lo"] < 1.10 < lead["hi"]
    # negative control: no effect, same noise -> the interval contains 1
    none = paired_ratio(b * np.exp(rng.normal(0, 0.03, 40)), b)
    assert none["lo"] < 1.0 < none["hi"] and none["n"] == 40
    # unpaired (a shuffled) the prompts' spread swamps the same 10 % lead: the interval is far wider
    wide = paired_ratio(rng.permutation(1.10 * b), b)
    assert (wide["hi"] - wide["lo"]) > 5 * (lead["hi"] - lead["lo"])
    with pytest.raises(ValueError):
        paired_ratio([1.0, 0.0], [1.0, 1.0])


def _run(new, total, prefill):
    return {"ids": list(range(new)), "total_s": total, "prefill_s": prefill, "stats": {}}


def test_comparisons_pair_modes_and_report_ceiling():
    runners = [Runner("dyn greedy", "d", "greedy", "dyncompile"), Runner("dyn spec", "d", "spec", "dyncompile"),
               Runner("peer greedy", "p", "greedy", "peer"), Runner("peer ngram", "p", "ngram", "peer"),
               Runner("peer draft", "q", "draft", "peer")]
    # prompt i: every runner makes 11 tokens; dyncompile's greedy decodes exactly 1.25x the peer's greedy
    runs = {
        "dyn greedy": [_run(11, 1.0 + 8.0 / (i + 1), 1.0) for i in range(4)],
        "peer greedy": [_run(11, 1.0 + 10.0 / (i + 1), 1.0) for i in range(4)],
        "dyn spec": [_run(11, 3.0, 2.0) for _ in range(4)],
        "peer ngram": [_run(11, 3.0, 2.0) for _ in range(4)],
        "peer draft": [_run(11, 5.0, 2.5) for _ in range(4)],
    }
    pairs = paired_comparisons(runners, runs)
    assert [(c["dyncompile"], c["peer"]) for c in pairs] == [("dyn greedy", "peer greedy"), ("dyn spec", "peer ngram"),
                                                             ("dyn spec", "peer draft")]
    g = pairs[0]["decode_tokens_per_s"]
    assert g["ratio"] == pytest.approx(1.25) and g["lo"] == pytest.approx(1.25) and g["n"] == 4
    assert pairs[1]["decode_tokens_per_s"]["ratio"] == pytest.approx(1.0)
    assert pairs[2]["tokens_per_s"]["ratio"] == pytest.approx(5.0 / 3.0, abs=1e-3)
    assert pairs[2]["prefill_seconds"]["ratio"] == pytest.approx(2.0 / 2.5, abs=1e-3)  # time: below 1 is faster
    rep = summarize(runners, runs, [[1, 2, 3]] * 4, eos=set(), loads={})
    rows = {r["name"]: r for r in rep["results"]}
    # no decoder speed-up passes new tokens / prefill: 44 tokens over 4 x 2.5 s of prefill
    assert rows["peer draft"]["ceiling_tokens_per_s"] == pytest.approx(44 / 10.0)
    assert rows["peer draft"]["tokens_per_s"] < rows["peer draft"]["ceiling_tokens_per_s"]
    rep.update(plan_name="p", prompts=4, prompts_file="f", max_new_tokens=11, threads=2, workers={})
    md = markdown_report(rep)
    assert "1.250x (1.250–1.250)" in md and "ceiling tok/s" in md


def test_a_variant_is_paired_with_the_main_plan_of_its_mode():
    """A second dyncompile worker (a plan or session variant) gets the main plan's runner of the same mode as a
    partner, besides the peers; the main plan's runners are not paired with the variant twice."""
    runners = [Runner("dyn greedy", "dyncompile", "greedy", "dyncompile"),
               Runner("dyn spec", "dyncompile", "spec", "dyncompile"),
               Runner("conv greedy", "dyncompile-plan-0", "greedy", "dyncompile"),
               Runner("conv spec", "dyncompile-plan-0", "spec", "dyncompile"),
               Runner("peer greedy", "p", "greedy", "peer")]
    runs = {
        "dyn greedy": [_run(11, 1.0 + 10.0 / (i + 1), 1.0) for i in range(4)],
        "conv greedy": [_run(11, 1.0 + 9.0 / (i + 1), 1.0) for i in range(4)],  # decodes 10/9 as fast
        "dyn spec": [_run(11, 3.0, 2.0) for _ in range(4)],
        "conv spec": [_run(11, 3.0, 2.0) for _ in range(4)],
        "peer greedy": [_run(11, 1.0 + 10.0 / (i + 1), 1.0) for i in range(4)],
    }
    pairs = paired_comparisons(runners, runs)
    assert [(c["dyncompile"], c["peer"]) for c in pairs] == [
        ("dyn greedy", "peer greedy"), ("conv greedy", "dyn greedy"), ("conv greedy", "peer greedy"),
        ("conv spec", "dyn spec")]
    assert pairs[1]["decode_tokens_per_s"]["ratio"] == pytest.approx(10.0 / 9.0, abs=1e-3)
    assert pairs[3]["decode_tokens_per_s"]["ratio"] == pytest.approx(1.0)



def test_ttft_and_tpot_in_both_decoder_benches():
    """TTFT is the prefill call, TPOT the time after it per further token (means over prompts), paired per prompt as
    time ratios; both benches show the columns (reports written before them re-render as they were: test_bench_rerender)."""
    from dyncompile.tools.bench import generate as gen

    runners = [Runner("dyn greedy", "d", "greedy", "dyncompile"), Runner("peer greedy", "p", "greedy", "peer")]
    # dyncompile: prefill 1 s, then 10 tokens in 2 s (TPOT 0.2 s); the peer: prefill 0.5 s, 10 tokens in 5 s
    runs = {"dyn greedy": [_run(11, 3.0, 1.0) for _ in range(3)], "peer greedy": [_run(11, 5.5, 0.5) for _ in range(3)]}
    rep = summarize(runners, runs, [[1, 2, 3]] * 3, eos=set(), loads={})
    rows = {r["name"]: r for r in rep["results"]}
    assert (rows["dyn greedy"]["ttft_ms"], rows["dyn greedy"]["tpot_ms"]) == (1000.0, 200.0)
    assert (rows["peer greedy"]["ttft_ms"], rows["peer greedy"]["tpot_ms"]) == (500.0, 500.0)
    assert rep["paired"][0]["tpot"]["ratio"] == pytest.approx(0.4)
    rep.update(plan_name="p", prompts=3, prompts_file="f", max_new_tokens=11, threads=2, workers={})
    md = markdown_report(rep)
    assert "| TTFT ms | TPOT ms |" in md and "| 1000.0 | 200.00 |" in md and "0.400x (0.400–0.400)" in md

    def run(seconds, pre, n=11):
        return gen.Run(list(range(n)), seconds, {"prefill_seconds": pre, "drafted": 0, "accepted": 0, "target_calls": n,
                                                 "rounds": 0, "overhead_seconds": 0.0})

    base, fast = [run(3.0, 1.0), run(3.0, 1.0)], [run(1.5, 1.0), run(2.0, 1.0)]  # TPOT 0.2 s vs 0.05 / 0.1 s
    s = gen._summary(fast, base, None, None)
    assert (s["ttft_ms"], s["tpot_ms"]) == (1000.0, 75.0)
    p = gen._paired(fast, base)
    assert p["tpot"]["ratio"] == pytest.approx(np.sqrt(0.25 * 0.5), abs=1e-3) and p["ttft"]["ratio"] == 1.0
    rows = [{"name": "target", **gen._summary(base, base, None, None), "paired": gen._paired(base, base)},
            {"name": "spec", **s, "paired": p}]
    md = gen.markdown_report({"results": rows, "prompts": 2, "max_new_tokens": 11})
    assert "TTFT ms | TPOT ms" in md and "| spec | 1.000x" not in md and "TPOT time ratio" in md


def test_total_time_ratio_weighs_rows_by_their_cost_unlike_the_geometric_mean():
    """A cascade-like plan: 40 % of rows 20x faster (answered by a small model), the rest 2x faster. Throughput
    follows the total time (1 / (0.4/20 + 0.6/2) = 3.125x); the geometric mean of per-row ratios (20^0.4 * 2^0.6 =
    5.02x) does not. Same effect as a negative control: a uniform 2x is 2x by both."""
    from dyncompile.tools.bench.common import total_time_ratio

    base = np.full(1000, 0.036)
    plan = np.where(np.arange(1000) % 5 < 2, base / 20, base / 2)
    t = total_time_ratio(plan, base)
    g = paired_ratio(1 / plan, 1 / base)
    assert t["ratio"] == pytest.approx(1 / (0.4 / 20 + 0.6 / 2), rel=1e-4)
    assert g["ratio"] == pytest.approx(20**0.4 * 2**0.6, rel=1e-4)
    assert t["lo"] < t["ratio"] < t["hi"] and t["n"] == 1000  # the resampled share of fast rows moves it
    uniform = total_time_ratio(base / 2, base)
    assert uniform["ratio"] == uniform["lo"] == uniform["hi"] == pytest.approx(2.0)
    with pytest.raises(ValueError):
        total_time_ratio([1.0, 0.0], [1.0, 1.0])


def test_classifier_bench_table_shows_the_total_time_speedup_beside_the_median():
    """`dyncompile bench`'s table: an exit plan whose median row is 3x faster but whose mean latency is only 2x
    faster shows both, from the report's own fields."""
    from dyncompile.tools.bench.common import markdown_table

    def row(name, med, mean):
        return {"name": name, "batch1": {"latency_ms_median": med, "latency_ms_p90": 9.0, "latency_ms_mean": mean},
                "batch32": {"throughput_rows_per_s": 100.0}}

    rows = [row("original", 9.0, 9.0), row("if, budget 1.0", 3.0, 4.5)]
    for r in rows:
        r["speedup_batch1_median"] = round(9.0 / r["batch1"]["latency_ms_median"], 3)
        r["speedup_batch1_mean"] = round(9.0 / r["batch1"]["latency_ms_mean"], 3)
        r["speedup_batch32_throughput"] = 1.0
    head, _, _, plan = markdown_table({"batch_size": 32, "results": rows}).splitlines()
    cols = [c.strip() for c in head.strip("|").split("|")]
    vals = dict(zip(cols, [c.strip() for c in plan.strip("|").split("|")], strict=True))
    assert vals["speedup b1 (median)"] == "3.0x" and vals["speedup b1 (total time)"] == "2.0x"


def test_accuracy_change_interval_is_paired_and_shown_beside_the_change():
    """The quantized-certified table's Δ vs fp32 carries a paired bootstrap interval over rows (the same rows'
    correctness, plan minus fp32); a report written before the interval existed renders as it did."""
    from dyncompile.tools.bench.common import bootstrap_diff
    from dyncompile.tools.studies.quantized_certified import markdown

    rng = np.random.default_rng(3)
    ref_ok = rng.random(1500) < 0.85
    flip = rng.random(1500) < 0.05  # 5 % of rows change correctness, each way half the time
    plan_ok = np.where(flip, ~ref_ok, ref_ok)
    mean, lo, hi = bootstrap_diff(plan_ok, ref_ok)
    assert mean == pytest.approx(plan_ok.mean() - ref_ok.mean()) and lo < mean < hi
    # paired: the interval's half-width follows the flips (~sqrt(0.05 / 1500)), not the accuracy's spread
    assert 0.6 * 1.96 * np.sqrt(flip.mean() / 1500) < (hi - lo) / 2 < 1.4 * 1.96 * np.sqrt(flip.mean() / 1500)
    unpaired = bootstrap_diff(rng.permutation(plan_ok), ref_ok)
    assert (unpaired[2] - unpaired[1]) > 2 * (hi - lo)

    def report(ci):
        rows = []
        for name, plan in (("fp32 original", None), ("plan", "p")):
            row = {"name": name, "plan": plan, "accuracy": 84.0, "delta_vs_fp32": -1.2 if plan else 0.0,
                   "agreement_fp32": 94.4, "mean_exit_layer": None, "p50_ms": 1.0, "p90_ms": 2.0,
                   "speedup": {"ratio": 4.0, "lo": 3.9, "hi": 4.1}, "promise": {}}
            if ci:
                row["delta_vs_fp32_ci"] = [-1.87, -0.53] if plan else [0.0, 0.0]
            rows.append(row)
        return {"results": rows}

    new, old = markdown(report(True)), markdown(report(False))
    assert "| Δ vs fp32 [95 % CI] |" in new and "| plan | 84.0 | -1.20 [-1.87, -0.53] |" in new
    assert "| fp32 original | 84.0 | +0.00 |" in new  # the reference itself: no interval
    assert "| Δ vs fp32 |" in old and "| plan | 84.0 | -1.20 |" in old


@pytest.mark.parametrize("block", [1, 4, 7])
def test_block_interleaving_runs_each_row_once_per_runner_in_rotated_blocks(block):
    """Row by row (block 1) the runners alternate on every row; by blocks each runner runs ``block`` consecutive
    rows before the next one runs the same rows, the first runner rotating per block. Either way every runner sees
    every row once and results stay in row order (pairing by row)."""
    from dyncompile.tools.bench.common import Runner, interleaved_batch1

    calls = []

    def runner(name):
        def fn(texts):
            calls.append((name, texts[0]))
            return np.array([[float(len(texts[0]))]]), len(texts[0]) % 3
        return Runner(name, fn, {})

    texts = ["x" * (i + 1) for i in range(10)]
    lat, probs, exits = interleaved_batch1([runner("a"), runner("b")], texts, 10, warmup=0, progress=False,
                                           block=block)
    assert sorted(calls) == sorted((n, t) for n in "ab" for t in texts)
    for name in "ab":
        assert [float(p[0]) for p in probs[name]] == [len(t) for t in texts]
        assert exits[name] == [len(t) % 3 for t in texts] and lat[name].shape == (10,) and (lat[name] > 0).all()
    starts = list(range(0, 10, block))
    want = []
    for k, s in enumerate(starts):
        first, second = ("b", "a") if k % 2 == 0 else ("a", "b")  # the order rotates before each block
        rows = texts[s : s + block]
        want += [(first, t) for t in rows] + [(second, t) for t in rows]
    assert calls == want
    with pytest.raises(ValueError, match="block"):
        interleaved_batch1([runner("a")], texts, 10, warmup=0, progress=False, block=0)
