"""``dyncompile.load(memory=...)``: how a plan's ORT sessions allocate tensors (arena, memory pattern).

The ``auto`` rule changes ONNX Runtime's defaults only for a CPU classifier plan whose exits are ``If`` nodes (the
batch-1 form: no arena, no memory pattern); the answers must not depend on the mode.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import DATA

import dyncompile
from dyncompile.errors import DataError, ProviderError
from dyncompile.runtime.providers import MEMORY_MODES, session_memory_options
from dyncompile.tools.cli import main


@pytest.fixture(scope="module")
def plans(minilm, module_tmp):
    """MiniLM-L6 early-exit plans in both lowerings, thresholds that exit some rows early (uncertified, 300 rows)."""
    calib = module_tmp("calib") / "calib.jsonl"
    calib.write_text("\n".join((DATA / "movie-calib.jsonl").read_text().splitlines()[:300]) + "\n")
    d = module_tmp("plans")
    return {low: dyncompile.compile(minilm.onnx_path, "early-exit", d / low, calib=str(calib), progress=False,
                                    confidence="none", budget=2.0, lowering=low, exits="2,4").plan_dir
            for low in ("if", "staged")}


@pytest.fixture(scope="module")
def texts():
    return [json.loads(x)["text"] for x in (DATA / "movie-test.jsonl").read_text().splitlines()[:40]]


def _allocation(model) -> tuple[bool, bool]:
    so = model.ctx.session_options()
    return so.enable_mem_pattern, so.enable_cpu_mem_arena


def test_auto_drops_the_arena_only_for_the_batch1_if_plan(plans):
    assert json.loads((plans["if"] / "plan.json").read_text())["policy"]["early_exit"]["lowering"] == "if"
    assert _allocation(dyncompile.load(plans["if"])) == (False, False)
    assert _allocation(dyncompile.load(plans["staged"])) == (True, True)  # staged: batches keep ORT's defaults
    for plan in plans.values():
        assert _allocation(dyncompile.load(plan, memory="arena")) == (True, True)  # ORT's defaults, untouched
        assert _allocation(dyncompile.load(plan, memory="malloc")) == (False, False)


def test_the_answers_do_not_depend_on_the_memory_mode(plans, texts):
    for lowering, plan in plans.items():
        got = {}
        for mode in MEMORY_MODES:
            m = dyncompile.load(plan, memory=mode)
            probs, exits = [], []
            for t in texts:  # batch 1, the If plan's form
                probs.append(m.predict_proba([t]))
                exits.append(int(np.asarray(m.last_info["exit_layer"]).reshape(-1)[0]))
            got[mode] = (np.concatenate(probs), exits)
        ref_p, ref_e = got["arena"]
        assert min(ref_e) < max(ref_e), (lowering, ref_e)  # rows exit at different layers: every branch runs
        for mode, (p, e) in got.items():
            np.testing.assert_array_equal(p, ref_p, err_msg=f"{lowering} {mode}")
            assert e == ref_e, (lowering, mode)


def test_auto_runs_several_rows_in_a_session_with_the_arena(plans, texts):
    auto = dyncompile.load(plans["if"])
    arena = dyncompile.load(plans["if"], memory="arena")
    p1 = auto.predict_proba(texts[:1])
    assert set(auto.ctx._sessions) == {"model"}  # batch 1 only: one session, no arena
    assert not auto.ctx.session("model").get_session_options().enable_cpu_mem_arena
    p7 = auto.predict_proba(texts[:7], batch_size=7)
    batched = auto.ctx.session("model", rows=7)
    assert set(auto.ctx._sessions) == {"model", "model#batched"}
    assert batched.get_session_options().enable_cpu_mem_arena and batched.get_session_options().enable_mem_pattern
    np.testing.assert_array_equal(p7, arena.predict_proba(texts[:7], batch_size=7))
    np.testing.assert_array_equal(p1, arena.predict_proba(texts[:1]))
    # a plan that keeps ORT's defaults needs no extra session
    staged = dyncompile.load(plans["staged"])
    staged.predict_proba(texts[:7], batch_size=7)
    staged.predict_proba(texts[:1])
    assert staged.ctx._sessions and not any(k.endswith("#batched") for k in staged.ctx._sessions)


def test_other_plans_and_providers_keep_ort_defaults():
    assert session_memory_options("auto", "text-generation", "CPUExecutionProvider", None) == {}
    assert session_memory_options("auto", "text-classification", "OpenVINOExecutionProvider", "if") == {}
    assert session_memory_options("auto", "text-classification", "CPUExecutionProvider", None) == {}  # no exits
    assert session_memory_options("auto", "text-to-image", "CPUExecutionProvider", None) == {}
    assert session_memory_options("malloc", "text-generation", "CPUExecutionProvider", None) == {
        "enable_mem_pattern": False, "enable_cpu_mem_arena": False}
    with pytest.raises(ProviderError, match="memory must be one of auto, arena, malloc"):
        session_memory_options("pool", "text-classification", "CPUExecutionProvider", "if")


def test_a_bad_memory_mode_is_one_clear_error(plans, capsys):
    with pytest.raises(DataError, match="memory must be one of auto, arena, malloc, got 'pool'"):
        dyncompile.load(plans["if"], memory="pool")
    with pytest.raises(SystemExit) as e:
        main(["run", str(plans["if"]), "--memory", "pool", "--text", "fine"])
    assert e.value.code == 2 and "invalid choice: 'pool'" in capsys.readouterr().err


def test_run_takes_the_memory_mode(plans, capsys):
    text = "A gorgeous, witty, seductive movie."
    outs = []
    for mode in ("auto", "arena"):
        assert main(["run", str(plans["if"]), "--memory", mode, "--text", text, "--json"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and "positive" in outs[0]


def test_the_study_reads_a_memory_mode_per_plan(tmp_path):
    from pathlib import Path

    from dyncompile.tools.studies.quantized_certified import main as study
    from dyncompile.tools.studies.quantized_certified import parse_plan

    assert parse_plan("int8=some/dir") == ("int8", Path("some/dir"), "auto")
    assert parse_plan("int8, arena=some/dir,memory=arena") == ("int8, arena", Path("some/dir"), "arena")
    with pytest.raises(DataError, match="memory must be one of"):
        parse_plan("x=d,memory=pool")
    with pytest.raises(SystemExit) as e:
        study(["--name", "x", "--plans", "x=d,memory=pool", "--out", str(tmp_path / "o")])
    assert e.value.code == 2 and not (tmp_path / "o").exists()
