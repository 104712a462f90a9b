"""Opt-in (``-m slow``): Qwen2.5-Coder-0.5B int4 (block 32, int8 compute) as a prompt-lookup speculative target.

The speculative pass measures that padding every call to two rows makes the target row-invariant and writes
``min_rows=2``; greedy output is then token-identical to the same plan's target alone. The negative control: the
target's verification-call logits differ from one-row calls without the padding and are bitwise equal with it.
"""

from __future__ import annotations

import dataclasses
import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest

import dyncompile
from dyncompile.models import model_home
from dyncompile.passes.compiler import compile_model
from dyncompile.runtime.decode.kv_cache import KVDecoder

pytestmark = pytest.mark.slow

STDLIB = Path(sysconfig.get_paths()["stdlib"])
NEW_TOKENS = 40


def _prompts() -> list[str]:
    heapq = (STDLIB / "heapq.py").read_text()
    bisect = (STDLIB / "bisect.py").read_text()
    start = heapq.index("def heappush")
    return [heapq[start : heapq.index("def heappop")] + "def heappop(heap):\n",
            bisect[: bisect.index("def bisect_right")][-600:] + "def bisect_right(a, x, lo=0, hi=None, *, key=None):\n",
            "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"]


@pytest.fixture(scope="module")
def qwen_int4(module_tmp):
    src = model_home() / "models" / "qwen2.5-coder-0.5b"
    if not (src / "model.onnx").is_file():
        pytest.skip(f"Qwen2.5-Coder-0.5B is not built at {src} (dyncompile models build qwen2.5-coder-0.5b)")
    out = module_tmp("qwen-int4") / "plan"
    res = compile_model(src, "quantize-int4{block_size=32,accuracy_level=4},speculative{measure=false}", out,
                        drafter="prompt-lookup")
    return dyncompile.load(res.plan_dir, session_config={"session.intra_op.allow_spinning": "0"})


def test_int4_target_padded_to_two_rows_is_token_identical(qwen_int4):
    step = json.loads((qwen_int4.plan.directory / "plan.json").read_text())["steps"][0]
    assert step["target"]["min_rows"] == 2, step["target"]
    accepted = 0
    for prompt in _prompts():
        ref = qwen_int4.generate(prompt, max_new_tokens=NEW_TOKENS, speculative=False)
        res = qwen_int4.generate(prompt, max_new_tokens=NEW_TOKENS)
        assert len(ref.token_ids) == NEW_TOKENS, ref.stats.stop_reason
        assert res.token_ids == ref.token_ids, (prompt[-40:], res.text, ref.text)
        accepted += res.stats.accepted
    assert accepted > 0  # verification calls of several rows really ran


def test_verification_rows_equal_one_token_steps_only_with_the_padding(qwen_int4):
    handler = qwen_int4.handlers[-1]
    codec = handler.codec
    prompt = codec.encode(_prompts()[2])
    toks = qwen_int4.generate(prompt, max_new_tokens=9, speculative=False).token_ids[:8]
    diffs = {}
    for rows in (1, 2):
        dec = KVDecoder(handler.target.session, dataclasses.replace(handler.target.spec, min_rows=rows))
        dec.forward(prompt, last=1)
        steps = np.stack([dec.forward([t])[0] for t in toks])
        dec.reset()
        dec.forward(prompt, last=1)
        verify = dec.forward(toks)  # one verification call of 8 rows
        diffs[rows] = float(np.abs(verify - steps).max())
    assert diffs[2] == 0.0, diffs  # bitwise: the target alone computes what verification computes
    assert diffs[1] > 1e-3, diffs  # without the padding the one-row kernels round differently (0.1-0.5 measured)
