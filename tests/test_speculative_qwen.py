"""Opt-in (``-m slow``): the real draft/target pair Qwen2.5-Coder-0.5B -> 1.5B (same tokenizer).

Greedy output of the external-drafter plan is token-identical to the 1.5B alone on code prompts; the
tokenizer check passes for the pair. Too heavy for CI on 2 cores (the 1.5B runs ~1-2 tokens/s in fp32).
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

import dyncompile
from dyncompile.errors import DyncompileError
from dyncompile.models import build_model
from dyncompile.passes.compiler import compile_model

pytestmark = pytest.mark.slow

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _build(name):
    return build_model(name, progress=False)


@pytest.fixture(scope="module")
def qwen_plan(module_tmp):
    target, draft = _build(TARGET), _build(DRAFT)
    out = module_tmp("qwen") / "spec"
    res = compile_model(target.onnx_path, "speculative", out, drafter=str(draft.onnx_path), progress=False,
                        opt_level=0)
    return res.plan_dir


def test_pair_tokenizers_checked(qwen_plan):
    plan = json.loads((qwen_plan / "plan.json").read_text())
    assert "identical" in plan["policy"]["speculative"]["tokenizer_check"]
    assert plan["steps"][0]["drafter"]["name"] == "external"


def test_qwen_pair_greedy_token_identical(qwen_plan):
    m = dyncompile.load(qwen_plan, session_config={"session.intra_op.allow_spinning": "0"})
    code = (STDLIB / "heapq.py").read_text()
    prompts = ["def quicksort(arr):\n", code[: code.index("def heapify")] + "def heapify(x):\n"]
    for prompt in prompts:
        ref = m.generate(prompt, max_new_tokens=24, speculative=False)
        res = m.generate(prompt, max_new_tokens=24)
        assert res.token_ids == ref.token_ids, (prompt[:40], res.text, ref.text)
        assert res.stats.acceptance_rate is not None and res.stats.acceptance_rate > 0.3


def test_drafter_with_another_tokenizer_is_refused(tmp_path):
    """A real mismatched pair: Qwen2.5-Coder-0.5B (151,936 tokens) as drafter for SmolLM2-135M (49,152)."""
    smol, draft = _build("smollm2-135m"), _build(DRAFT)
    with pytest.raises(DyncompileError, match="tokenizer mismatch.*49152 tokens.*151936"):
        compile_model(smol.onnx_path, "speculative", tmp_path / "bad", drafter=str(draft.onnx_path), progress=False)
    assert not (tmp_path / "bad").exists()
