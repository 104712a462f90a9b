"""The shared KV buffer (``kv_buffer="shared"``) on the real SmolLM2-135M: which graphs get it, logits and cache
contents against the concatenating cache through prefill, chunks, rollbacks, a verified draft tree and buffer
growth, adoption across the two kinds, greedy and speculative token identity, and the fallbacks."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from helpers import OnCuda, ort_session, plan_decoder_spec, plan_kv_decoder  # tests/ is on pythonpath

import dyncompile
from dyncompile.errors import PlanError
from dyncompile.models._export import decoder_tolerance
from dyncompile.passes.fuse_decoder import FuseDecoderPass
from dyncompile.passes.speculative.decoder_spec import decoder_spec
from dyncompile.passes.speculative.explicit_attention import ExposeAttentionMaskPass
from dyncompile.passes.speculative.probe import session_for
from dyncompile.plan import DecoderSpec
from dyncompile.runtime.decode.draft_tree import DraftTree
from dyncompile.runtime.decode.kv_cache import KVDecoder

STDLIB = Path(sysconfig.get_paths()["stdlib"])
_CODE = (STDLIB / "bisect.py").read_text()
PROMPT = _CODE[: _CODE.index("def bisect_right")] + "def bisect_right(a, x, lo=0, hi=None, *, key=None):\n"
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def shared_plan(smollm2_fast_plan):
    """explicit-attention + fuse-decoder (+ pack-matmuls, trim-logits, prompt-lookup trees): the recipe that gets the shared buffer."""
    return smollm2_fast_plan


_spec, _decoder = plan_decoder_spec, plan_kv_decoder


@pytest.fixture(scope="module")
def bias_model(smollm2) -> ir.Model:
    """explicit-attention alone, in memory: a 4-D bias input, but the graph still concatenates its cache."""
    model = ir.load(str(smollm2.onnx_path))
    assert ExposeAttentionMaskPass()(model).modified
    return model


def test_only_fused_graphs_with_an_explicit_bias_get_the_shared_buffer(smollm2, shared_plan, bias_model):
    step = json.loads((shared_plan / "plan.json").read_text())["steps"][0]
    assert step["target"]["kv_buffer"] == "shared"
    fused_only = ir.load(str(smollm2.onnx_path))
    assert FuseDecoderPass()(fused_only).modified
    for model in (fused_only, bias_model):  # the mask is sized from the past tensors / the graph concatenates
        spec = decoder_spec(model, "m")
        assert "kv_buffer" not in spec
        spec.pop("vocab_size")
        assert DecoderSpec.from_params(spec).kv_buffer == "concat"
    assert "kv_buffer" not in decoder_spec(ir.load(str(smollm2.onnx_path)), "m")


def _tree() -> DraftTree:
    tree = DraftTree.chain(11, [])
    a = tree.add(0, 501)
    tree.add(0, 502)
    b = tree.add(a, 503)
    tree.add(b, 504)
    return tree


def test_logits_and_cache_match_the_concat_cache(shared_plan):
    """Prefill, chunks, tail rollbacks, a draft tree whose kept path is not a prefix, and growth past the first
    capacity (256 slots): logits within fp32 tolerance of the concatenating cache on the same graph, the same
    greedy tokens, and the shared buffer's first ``slots`` rows equal to the concat cache once that is compacted."""
    path = shared_plan / "model.onnx"
    a, b = _decoder(path, kv_buffer="concat"), _decoder(path)
    assert b.shared and not a.shared
    rng = np.random.default_rng(0)
    buffers = [id(v) for v in b.past]
    plan = [("f", 120), ("f", 4), ("t", 2), ("tree", None), ("f", 3), ("t", 1), ("f", 150), ("f", 1), ("t", 5),
            ("f", 2)]
    for op, n in plan:
        if op == "t":
            a.truncate(a.length - n)
            b.truncate(b.length - n)
            continue
        if op == "tree":
            tree = _tree()
            la, lb = a.forward(tree.tokens, tree=tree), b.forward(tree.tokens, tree=tree)
            a.keep_path(len(tree), [0, 1, 3])  # root, first child, its child: not a prefix of the node order
            b.keep_path(len(tree), [0, 1, 3])
        else:
            ids = rng.integers(100, 40000, size=n)
            la, lb = a.forward(ids), b.forward(ids)
        tol = decoder_tolerance(np.abs(la).max())
        assert np.abs(la - lb).max() <= tol, (op, n, np.abs(la - lb).max(), tol)
        assert (la.argmax(-1) == lb.argmax(-1)).all()
        assert a.length == b.length
        if op == "f" and n == 4:
            assert [id(v) for v in b.past] == buffers  # no new cache tensors per call: written in place
    assert b._cap > 256 and [id(v) for v in b.past] != buffers  # it grew (and copied what it held)
    assert a.slots > a.length  # the concat cache attended over masked holes; the shared one compacted them
    assert b.slots == b.length
    a.compact()
    for x, y in zip(a._arrays(), b._arrays()):
        assert x.shape == y.shape
        assert np.abs(x - y).max() <= 1e-4


def _device_resident(path: Path) -> KVDecoder:
    """A shared-buffer decoder that keeps its buffers as the CUDA EP does (ORT values edited through host copies),
    here in CPU memory, so the bookkeeping runs without a GPU."""
    dec = _decoder(path, kv_buffer="concat")
    dec._on_host = False
    dec.set_kv_buffer()
    assert dec.shared and dec._bufs == [] and dec._cap == 1024
    return dec


def test_device_resident_buffers_match_host_buffers_and_copy_only_to_edit_rows(shared_plan, monkeypatch):
    """The CUDA EP's layout: chain steps and tail rollbacks move no rows (no host copy); a tree's kept path off
    the prefix, adoption and growth each cost exactly one host round trip, and give the host buffer's logits."""
    path = shared_plan / "model.onnx"
    host, dev = _decoder(path), _device_resident(path)
    rng = np.random.default_rng(2)

    def both(ids=None, tree=None):
        la = host.forward(ids if tree is None else tree.tokens, tree=tree)
        lb = dev.forward(ids if tree is None else tree.tokens, tree=tree)
        np.testing.assert_allclose(lb, la, atol=decoder_tolerance(np.abs(la).max()))
        assert (la.argmax(-1) == lb.argmax(-1)).all()

    both(rng.integers(100, 40000, size=60))
    buffers = [id(v) for v in dev.past]
    for _ in range(3):  # speculative chain rounds: verify 4, reject 2
        both(rng.integers(100, 40000, size=4))
        host.truncate(host.length - 2)
        dev.truncate(dev.length - 2)
    assert dev.host_copies == 0 and [id(v) for v in dev.past] == buffers
    tree = _tree()
    both(tree=tree)
    host.keep_path(len(tree), [0, 1, 3])
    dev.keep_path(len(tree), [0, 1, 3])
    assert dev.host_copies == 1
    both(rng.integers(100, 40000, size=2))
    other = _device_resident(path)
    other.adopt(dev, range(len(dev.spec.kv)))
    assert dev.host_copies == 2 and other.host_copies == 1  # read from one, written into the other
    step = rng.integers(100, 40000, size=1)
    np.testing.assert_allclose(other.forward(step), host.forward(step), atol=1e-4)
    big = rng.integers(100, 40000, size=1100 - other.length)  # past the first 1,024 slots: one copy to grow
    other.forward(big)
    assert other._cap > 1024 and other.host_copies == 2 and other.length == 1100

    # negative control: without writing the edited rows back, the tree's kept path is wrong on the device
    fresh, ref = _device_resident(path), _decoder(path)
    monkeypatch.setattr(fresh, "_commit", lambda arrays: None)
    prompt = rng.integers(100, 40000, size=40)
    fresh.forward(prompt)
    ref.forward(prompt)
    for d in (fresh, ref):
        d.forward(tree.tokens, tree=tree)
        d.keep_path(len(tree), [0, 1, 3])
    nxt = rng.integers(100, 40000, size=1)
    assert np.abs(fresh.forward(nxt) - ref.forward(nxt)).max() > 1e-2


def test_the_cuda_ep_concatenates_and_says_why(shared_plan, caplog):
    """ORT's CUDA GQA takes no attention_bias (nor float32): the plan's GQA runs on the CPU EP there, where a shared
    buffer would cross PCIe whole twice per call, so a CUDA session concatenates, with the same logits."""
    path = shared_plan / "model.onnx"
    spec = _spec(path)
    session = ort_session(path, disable_all=True)
    assert spec.kv_buffer == "shared"
    on_cpu = KVDecoder(session, spec)
    assert on_cpu.shared  # control: the same plan on the CPU EP shares its buffer
    with caplog.at_level("INFO", logger="dyncompile.runtime.decode.kv_cache"):
        on_cuda = KVDecoder(OnCuda(session), spec)
    assert on_cuda.kv_device == "cuda" and not on_cuda.shared
    assert "takes no attention_bias" in caplog.text
    np.testing.assert_array_equal(on_cuda.forward([1, 2, 3]), on_cpu.forward([1, 2, 3]))


def test_adoption_between_shared_and_concat_caches(shared_plan):
    path = shared_plan / "model.onnx"
    shared, concat = _decoder(path), _decoder(path, kv_buffer="concat")
    rng = np.random.default_rng(1)
    prompt, nxt = rng.integers(100, 40000, size=30), rng.integers(100, 40000, size=3)
    shared.forward(prompt)
    concat.adopt(shared, range(len(shared.spec.kv)))  # a concat cache takes a copy of the shared buffers
    expect = shared.forward(nxt)
    np.testing.assert_allclose(concat.forward(nxt), expect, atol=decoder_tolerance(np.abs(expect).max()))
    other = _decoder(path)
    other.adopt(concat, range(len(concat.spec.kv)))  # and a shared one copies into its own buffers
    assert all(x is not y for x, y in zip(other._bufs, shared._bufs))
    step = rng.integers(100, 40000, size=1)
    np.testing.assert_allclose(other.forward(step), shared.forward(step), atol=1e-4)


def test_greedy_and_speculative_are_token_identical_to_the_unfused_original(smollm2, shared_plan):
    m = dyncompile.load(shared_plan, session_config={"session.intra_op.allow_spinning": "0"})
    alone = m.generate(PROMPT, max_new_tokens=NEW_TOKENS, speculative=False)
    ref = _decoder(smollm2.onnx_path, rollback="copy")
    out = [int(ref.forward(list(alone.prompt_ids))[-1].argmax())]
    while len(out) < NEW_TOKENS:
        out.append(int(ref.forward(out[-1:])[-1].argmax()))
    assert alone.token_ids == out
    for opts in ({}, {"tree": False}, {"kv_buffer": "concat"}):
        res = m.generate(PROMPT, max_new_tokens=NEW_TOKENS, **opts)
        assert res.token_ids == out, opts
        assert res.stats.target_calls < NEW_TOKENS


def test_fallbacks_and_bad_modes(smollm2, bias_model):
    plain = _decoder(smollm2.onnx_path)  # the unfused export: its plan says concat
    plain.set_kv_buffer("shared")
    assert not plain.shared  # refused (logged), still works
    assert plain.forward([1, 2, 3]).shape == (3, 49152)
    with pytest.raises(PlanError, match="kv_buffer"):
        plain.set_kv_buffer("mmap")
    # a plan that claims a shared buffer for a graph that concatenates: one clear error, not an ORT crash
    spec = decoder_spec(bias_model, "m")
    spec.pop("vocab_size")
    spec = DecoderSpec.from_params({**spec, "kv_buffer": "shared"})
    dec = KVDecoder(session_for(bias_model), spec)
    assert dec.shared
    with pytest.raises(PlanError, match="does not write its KV cache in place"):
        dec.forward([1, 2, 3])
