"""Stop strings in generation (``generate(..., stop=[...])``), which routed code cascades use to end a completion
at the function's end: the target-only loop stops right after the token that completes a stop string, the
speculative loop after the round that does; both are prefixes of the unstopped greedy output (token identity)."""

from __future__ import annotations

import pytest

import dyncompile
from dyncompile.errors import DyncompileError
from dyncompile.passes.compiler import compile_model

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


@pytest.fixture(scope="module")
def pl_model(smollm2, module_tmp):
    plan = compile_model(smollm2.onnx_path, "speculative", module_tmp("stop") / "pl",
                         drafter="prompt-lookup", progress=False)
    return dyncompile.load(plan.plan_dir, session_config={"session.intra_op.allow_spinning": "0"})


def test_stop_strings_end_generation_at_the_first_occurrence(pl_model):
    full = pl_model.generate(PROMPT, max_new_tokens=64, speculative=False)
    assert full.stats.stop_reason in ("max_new_tokens", "eos")
    # a stop string that first appears strictly inside the unstopped output: the newline after the first code line
    first_line_end = full.text.index("\n", 1)
    stop = full.text[first_line_end: first_line_end + 5]
    assert len(stop) == 5 and stop in full.text
    for speculative in (False, True):
        res = pl_model.generate(PROMPT, max_new_tokens=64, speculative=speculative, stop=[stop])
        assert res.stats.stop_reason == "stop_sequence", speculative
        assert res.token_ids == full.token_ids[: len(res.token_ids)], speculative  # token-identical prefix
        assert stop in res.text and len(res.token_ids) < len(full.token_ids), speculative
        if not speculative:  # the target alone stops at the first token that completes the stop string
            shorter = pl_model.generate(PROMPT, max_new_tokens=len(res.token_ids) - 1, speculative=False)
            assert stop not in shorter.text
    # a stop string that never appears changes nothing
    never = pl_model.generate(PROMPT, max_new_tokens=64, speculative=True, stop=["\u2603never\u2603"])
    assert never.token_ids == full.token_ids


@pytest.mark.parametrize("bad", ["abc", [""], [3]])
def test_bad_stop_strings_are_one_clear_error(pl_model, bad):
    with pytest.raises(DyncompileError, match="stop must be a list of non-empty strings"):
        pl_model.generate(PROMPT, max_new_tokens=4, stop=bad)
