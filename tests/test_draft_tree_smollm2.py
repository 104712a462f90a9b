"""Draft trees on the real SmolLM2-135M: prompt lookup (CI) and the split model drafter (slow), chain and tree,
greedy output token-identical to the target alone on real prompts (short generations, 2 cores)."""

from __future__ import annotations

import json

import pytest
from test_speculative_smollm2 import STDLIB, _prompts

import dyncompile
from dyncompile.passes.compiler import compile_model

NEW_TOKENS = 32
TREE = "explicit-attention,speculative{tree=true,tree_nodes=16,measure=false}"
SESSION = {"session.intra_op.allow_spinning": "0"}


@pytest.fixture(scope="module")
def smol_pl_tree(smollm2, module_tmp):
    root = module_tmp("smol_trees")
    return compile_model(smollm2.onnx_path, TREE, root / "pl", drafter="prompt-lookup", progress=False,
                         opt_level=0).plan_dir


def _identical_chain_and_tree(m, kind):
    sizes = []
    for prompt, chat in _prompts():
        ref = m.generate(prompt, max_new_tokens=NEW_TOKENS, chat=chat, speculative=False)
        for tree in (False, {"adaptive": False, "branching": 3}):
            res = m.generate(prompt, max_new_tokens=NEW_TOKENS, chat=chat, tree=tree)
            assert res.token_ids == ref.token_ids, (kind, tree, prompt[:40], res.text, ref.text)
            if tree:
                sizes += [s for s, _ in m.handlers[-1].last_rounds]
    return sizes


def test_prompt_lookup_chain_and_tree_token_identical(smol_pl_tree):
    step = json.loads((smol_pl_tree / "plan.json").read_text())["steps"][0]
    assert step["target"]["attention_bias"] == "attention_bias" and step["draft"]["tree"]["max_nodes"] == 16
    sizes = _identical_chain_and_tree(dyncompile.load(smol_pl_tree, session_config=SESSION), "prompt-lookup")
    assert max(sizes) > 4  # trees with several matches were verified


@pytest.mark.slow
def test_split_drafter_chain_and_tree_token_identical(smollm2, tmp_path):
    calib = tmp_path / "calib.py"
    calib.write_text("\n\n".join((STDLIB / f).read_text() for f in ("heapq.py", "string.py")))
    plan = compile_model(smollm2.onnx_path, "split-drafter{layers=20,min_speedup=0,max_tokens=1024}," + TREE,
                         tmp_path / "split", calib=str(calib), progress=False, opt_level=0).plan_dir
    sizes = _identical_chain_and_tree(dyncompile.load(plan, session_config=SESSION), "split")
    assert max(sizes) > 8  # the chain plus top-k sibling leaves
