"""tabulate-length-values: MPNet's relative-position bias (computed from the sequence length alone) becomes a slice
of a table behind an If whose else branch keeps the original kernels; outputs bit-identical at lengths inside and
beyond the table, batch 1 and 3, ORT optimizations off and on; the batch-dependent Expand after it stays; MiniLM
has nothing to tabulate; a second run leaves the graph alone."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from helpers import ort_session  # tests/ is on pythonpath

from dyncompile.passes import TabulateLengthValuesPass

MAX = 16


@pytest.fixture(scope="module")
def tabulated(mpnet):
    model = ir.load(mpnet.onnx_path)
    result = TabulateLengthValuesPass(max_length=MAX)(model)
    return result, ir.to_proto(result.model)


def test_mpnet_bias_becomes_a_table_slice(mpnet, tabulated):
    result, proto = tabulated
    before = ir.load(mpnet.onnx_path)
    assert result.modified
    onnx.checker.check_model(proto, full_check=True)
    ifs = [n for n in proto.graph.node if n.op_type == "If"]
    assert len(ifs) == 1 and not any(n.op_type == "If" for n in before.graph)
    branches = {a.name: a.g for a in ifs[0].attribute}
    assert [n.op_type for n in branches["then_branch"].node] == ["Slice"]
    moved = [n.op_type for n in branches["else_branch"].node]
    assert len(moved) >= 20 and {"Sub", "Log", "Where", "Gather", "Transpose"} <= set(moved)
    assert len(proto.graph.node) == len(list(before.graph)) - len(moved) + 4  # Shape, LessOrEqual, Concat, If
    table = next(i for i in proto.graph.initializer if i.name.endswith(".table"))
    assert list(table.dims) == [1, 12, MAX, MAX]
    users = [n.op_type for n in proto.graph.node if ifs[0].output[0] in n.input]
    assert users == ["Expand"]  # the batch-dependent broadcast is not tabulated
    assert not TabulateLengthValuesPass(max_length=MAX)(result.model).modified


@pytest.mark.parametrize("optimized", [False, True])
def test_outputs_are_bit_identical_inside_and_beyond_the_table(mpnet, tabulated, movie_test_rows, optimized):
    from dyncompile.runtime.text import TextEncoder

    _, proto = tabulated
    ref = ort_session(mpnet.onnx_path, disable_all=not optimized)
    got = ort_session(proto.SerializeToString(), disable_all=not optimized)
    enc = TextEncoder(mpnet.tokenizer_path, max_length=64)
    texts = [r["text"] for r in movie_test_rows[:3]]
    seen = set()
    for batch in (["Great."], ["A gorgeous, witty, moving film."], texts[:1], texts):
        feeds = {k: v for k, v in enc(batch).items() if k in ("input_ids", "attention_mask")}
        length = feeds["input_ids"].shape[1]
        seen.add(length <= MAX)
        assert np.array_equal(got.run(None, feeds)[0], ref.run(None, feeds)[0]), (len(batch), length)
    assert seen == {True, False}  # both branches ran


def test_minilm_has_nothing_to_tabulate(minilm):
    model = ir.load(minilm.onnx_path)
    n = len(list(model.graph))
    result = TabulateLengthValuesPass(max_length=MAX)(model)
    assert not result.modified and len(list(model.graph)) == n
    assert "nothing to tabulate" in result.message()


def test_a_short_max_length_checks_at_shorter_lengths_or_does_not_fire(mpnet, movie_test_rows):
    """A model whose tokenizer truncates at 8 tokens (a sidecar may say so): the rule is checked at 2 and 7
    tokens and the table is 8 x 8; below 4 tokens there is nothing to check against and the pass says so."""
    from dyncompile.runtime.text import TextEncoder

    with pytest.raises(ValueError, match="max_length"):
        TabulateLengthValuesPass(max_length=0)
    model = ir.load(mpnet.onnx_path)
    assert not TabulateLengthValuesPass(max_length=3)(model).modified
    result = TabulateLengthValuesPass(max_length=8)(model)
    assert result.modified
    proto = ir.to_proto(result.model)
    table = next(i for i in proto.graph.initializer if i.name.endswith(".table"))
    assert list(table.dims) == [1, 12, 8, 8]
    ref, got = ort_session(mpnet.onnx_path), ort_session(proto.SerializeToString())
    enc = TextEncoder(mpnet.tokenizer_path, max_length=64)
    for text in ("Great.", movie_test_rows[0]["text"]):  # 4 tokens (the table) and beyond it
        feeds = {k: v for k, v in enc([text]).items() if k in ("input_ids", "attention_mask")}
        assert np.array_equal(got.run(None, feeds)[0], ref.run(None, feeds)[0])
