"""``fuse-decoder``: fuse a KV-cache decoder's attention, rotary embeddings and RMS norms into ORT contrib ops.

The torch dynamo export of a Llama/Qwen-style decoder keeps attention unfused (Transpose, MatMul, Softmax,
repeat-kv Expand per layer), applies rotary embeddings with Slice/Neg/Concat arithmetic, and spells each RMS
norm out as Pow/ReduceMean/Sqrt/Reciprocal/Mul. This pass rewrites each layer into

* ``com.microsoft.GroupQueryAttention`` (GQA, KV heads are not repeated) fed the layer's past key/value and
  returning its present key/value (so the decoder keeps dyncompile's IO: ``past_key_values.N.*`` in,
  ``present.N.*`` out, concatenated on axis 2 as before), with the graph's own additive 4-D mask as GQA's
  ``attention_bias`` and ``causal=0``: whatever mask the unfused graph applied (the 2-D ``attention_mask``
  with rolled-back holes, a multi-token verification chunk, a draft tree's 4-D mask) the fused graph applies
  too;
* ``com.microsoft.RotaryEmbedding`` on q and k with constant cos/sin caches computed from the graph's
  ``inv_freq`` constant and indexed by the ``position_ids`` input;
* ``com.microsoft.SkipSimplifiedLayerNormalization`` for residual-add + RMS norm (onnxscript's rules).

Scope: the main graph of a KV decoder accepted by :func:`~dyncompile.passes.speculative.decoder_spec.decoder_spec`
with a ``position_ids`` input. Anything else (an encoder, a decoder without the patterns) is left alone
(``modified=False``); a layer whose attention does not match is left unfused (logged).
Invariants: graph inputs/outputs and their names are unchanged; logits equal the unfused graph's within fp32
round-off (GQA sums in another order; measured on SmolLM2 below 2e-4 absolute); greedy tokens identical.
A graph holding ``GroupQueryAttention`` already is left alone (a second run reports ``modified=False``).
Sketch: onnxscript pre-optimisation (its default rewrite rules behind a root-op guard, the same rewrites ~4x faster:
:mod:`dyncompile._rule_guard`), its RMS / skip-RMS / rotary / SDPA recognisers, then
``_FuseGQA``: ``SDPA(rope(q), expand(concat(past_k, rope(k))), expand(concat(past_v, v)), mask)`` ->
``GQA(rope'(q), rope'(k), v, past_k, past_v, seqlens_k, total_len, attention_bias=mask)``, with one
``seqlens_k`` / ``total_len`` for all layers (from the mask's length and ``input_ids``' batch; ``pack-matmuls``
later folds a packed q/k/v and both rotaries into GQA itself);
plain RMS norms the skip rule did not absorb go back to standard ops (the checker knows no
``SimplifiedLayerNormalization`` in the default domain); leftover recogniser functions are inlined.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from dyncompile._rule_guard import guarded_default_rules
from dyncompile.errors import PassConfigError
from dyncompile.passes._graph import const_array
from dyncompile.passes._infra import not_fired, register_pass

logger = logging.getLogger(__name__)

__all__ = ["FuseDecoderPass"]

_FUSION_DOMAIN = "ai.onnxruntime._fusion"
_MS = "com.microsoft"


def _rotary_source(cos4: ir.Value, model: ir.Model) -> tuple[np.ndarray, ir.Value] | str:
    """(inv_freq, position_ids input) behind ``Unsqueeze(Cos(Concat(f, f)))`` with ``f = Cast(pos) * inv_freq``.

    Returns a string saying what did not match instead.
    """
    p = cos4.producer()
    if p is None or p.op_type != "Unsqueeze":
        return "cos is not Unsqueeze(Cos(...))"
    c = p.inputs[0].producer() if p.inputs[0] is not None else None
    if c is None or c.op_type != "Cos":
        return "cos is not Unsqueeze(Cos(...))"
    cat = c.inputs[0].producer()
    if cat is None or cat.op_type != "Concat" or len(cat.inputs) != 2 or cat.inputs[0] is not cat.inputs[1]:
        return "rotary angles are not Concat(f, f)"
    mul = cat.inputs[0].producer()
    if mul is None or mul.op_type != "Mul":
        return "rotary angles are not position * inv_freq"
    a, b = mul.inputs
    inv = const_array(b)
    pos = a
    if inv is None:
        inv, pos = const_array(a), b
    if inv is None or inv.ndim != 1 or inv.dtype != np.float32:
        return "inv_freq is not a float32 constant vector"
    # pos: Cast(Unsqueeze(... position_ids ...)) — walk back through shape-only ops to the graph input
    seen = 0
    while pos is not None and pos.producer() is not None and seen < 6:
        node = pos.producer()
        if node.op_type not in ("Cast", "Unsqueeze", "Reshape", "Expand", "Identity"):
            return f"rotary positions come from {node.op_type}, not from the position_ids input"
        pos = node.inputs[0]
        seen += 1
    if pos is None or pos.name != "position_ids" or pos not in model.graph.inputs:
        return "rotary positions do not come from the position_ids input"
    return inv, pos


def _gqa_layout(model: ir.Model, q_bshd: ir.Value, k_bshd: ir.Value, pasts: tuple[ir.Value, ir.Value],
                cos4: ir.Value, mask: ir.Value, ropes: tuple[ir.Value, ir.Value]) -> tuple:
    """``(heads, kv heads, head size, (inv_freq, position_ids))`` of a matched attention, or ``(reason, value)``."""
    for name, v in (("query", q_bshd), ("key", k_bshd)):
        if v.shape is None or len(v.shape) != 4 or not all(isinstance(d, int) for d in v.shape[2:]):
            return f"{name} heads/head size are not static", v
    h, dh = q_bshd.shape[2], q_bshd.shape[3]
    hkv = k_bshd.shape[2]
    if k_bshd.shape[3] != dh or h % hkv:
        return "query/key head layout is not grouped-query attention", k_bshd
    for pv in pasts:
        if pv not in model.graph.inputs:
            return "past key/value is not a graph input", pv
    src = _rotary_source(cos4, model)
    if isinstance(src, str):
        return src, cos4
    if src[0].shape[0] * 2 != dh:
        return "rotary covers part of the head (partial rotary is not fused)", cos4
    if mask.shape is None or len(mask.shape) != 4 or mask.dtype != ir.DataType.FLOAT:
        return "attention mask is not a float 4-D additive mask", mask
    for rope in ropes:
        if rope.producer().attributes.get_int("interleaved", 0) != 0:
            return "interleaved rotary is not fused", rope
    return h, hkv, dh, src


def _gqa_rule(max_positions: int, input_ids: ir.Value):
    from onnxscript.rewriter import pattern

    class _FuseGQA(pattern.RewriteRuleClassBase):
        """SDPA over rotary q/k and a concatenated, head-repeated KV cache -> GroupQueryAttention."""

        def __init__(self) -> None:
            super().__init__("FuseGQA", remove_nodes=True)
            self._caches: dict[int, tuple[ir.Value, ir.Value]] = {}

        def pattern(self, op, q_bsd, k_bsd, v_bsd, q_shape, k_shape, v_shape, past_k, past_v, cos4, sin4, mask,
                    ek_shape, rk_shape, ev_shape, rv_shape, out_shape):
            q = op.Transpose(op.Reshape(q_bsd, q_shape, _outputs=["q_bshd"]), perm=[0, 2, 1, 3])
            q_rot = op.RotaryEmbedding(q, cos4, sin4, _domain=_FUSION_DOMAIN, _outputs=["q_rot"])
            k = op.Transpose(op.Reshape(k_bsd, k_shape, _outputs=["k_bshd"]), perm=[0, 2, 1, 3])
            k_rot = op.RotaryEmbedding(k, cos4, sin4, _domain=_FUSION_DOMAIN, _outputs=["k_rot"])
            present_k = op.Concat(past_k, k_rot, axis=-2)
            k_all = op.Reshape(op.Expand(op.Unsqueeze(present_k, [2]), ek_shape), rk_shape)
            v = op.Transpose(op.Reshape(v_bsd, v_shape), perm=[0, 2, 1, 3])
            present_v = op.Concat(past_v, v, axis=-2)
            v_all = op.Reshape(op.Expand(op.Unsqueeze(present_v, [2]), ev_shape), rv_shape)
            attn = op.SDPA(q_rot, k_all, v_all, mask, key_format="BHSd", _domain=_FUSION_DOMAIN,
                           _outputs=["attn"])
            out = op.Reshape(op.Transpose(attn, perm=[0, 2, 1, 3]), out_shape)
            return out, present_k, present_v

        def check(self, context, q_bshd, k_bshd, past_k, past_v, cos4, mask, attn, q_rot, k_rot, **_):
            r = pattern.MatchResult()
            found = _gqa_layout(context.model, q_bshd, k_bshd, (past_k, past_v), cos4, mask, (q_rot, k_rot))
            if isinstance(found[0], str):
                return r.fail(*found)
            self._h, self._hkv, self._dh, (self._inv, self._pos) = found
            scale = attn.producer().attributes.get_float("scale", None)
            self._scale = scale
            return r

        def _cache(self, op, inv: np.ndarray) -> tuple[ir.Value, ir.Value]:
            key = hash(inv.tobytes())
            if key not in self._caches:
                ang = np.arange(max_positions, dtype=np.float32)[:, None] * inv[None, :].astype(np.float32)
                cos = op.initializer(ir.tensor(np.cos(ang).astype(np.float32)), name=f"fuse_decoder.cos_cache.{len(self._caches)}")
                sin = op.initializer(ir.tensor(np.sin(ang).astype(np.float32)), name=f"fuse_decoder.sin_cache.{len(self._caches)}")
                self._caches[key] = (cos, sin)
            return self._caches[key]

        def rewrite(self, op, q_bsd, k_bsd, v_bsd, past_k, past_v, mask, **_):
            cos, sin = self._cache(op, self._inv)
            pos = self._pos
            q_rot = op.RotaryEmbedding(q_bsd, pos, cos, sin, num_heads=self._h, interleaved=0, _domain=_MS)
            k_rot = op.RotaryEmbedding(k_bsd, pos, cos, sin, num_heads=self._hkv, interleaved=0, _domain=_MS)
            total = op.Shape(mask, start=3, end=4)  # past slots + new tokens, [1]
            total32 = op.Cast(total, to=ir.DataType.INT32)
            batch = op.Shape(input_ids, start=0, end=1)  # one seqlens_k for every layer (not per layer's q)
            one = op.Constant(value=ir.tensor(np.array([1], np.int32)))
            seqlens_k = op.Expand(op.Sub(total32, one), batch)  # [batch] int32: last key slot index
            total_len = op.Squeeze(total32)
            attrs = {"num_heads": self._h, "kv_num_heads": self._hkv, "causal": 0}
            if self._scale is not None:
                attrs["scale"] = float(self._scale)
            out, pk, pv = op.GroupQueryAttention(
                q_rot, k_rot, v_bsd, past_k, past_v, seqlens_k, total_len, None, None, None, mask,
                _domain=_MS, _outputs=3, **attrs,
            )
            return out, pk, pv

    return _FuseGQA.rule()


def _unfuse_rms_rule():
    """Plain ``SimplifiedLayerNormalization`` (default domain, unknown to the ONNX checker) -> standard ops."""
    from onnxscript.rewriter import pattern

    class _UnfuseRms(pattern.RewriteRuleClassBase):
        def __init__(self) -> None:
            super().__init__("UnfuseRms", remove_nodes=True)

        def pattern(self, op, x, gamma):
            return op.SimplifiedLayerNormalization(x, gamma, _allow_other_attributes=True, _outputs=["y"])

        def check(self, context, x, y, **_):
            r = pattern.MatchResult()
            a = y.producer().attributes
            if a.get_int("axis", -1) != -1 or x.dtype != ir.DataType.FLOAT:
                return r.fail("only last-axis float32 RMS norms are decomposed", y)
            self._eps = a.get_float("epsilon", 1e-5)
            return r

        def rewrite(self, op, x, gamma, **_):
            two = op.Constant(value=ir.tensor(np.array(2.0, np.float32)))
            eps = op.Constant(value=ir.tensor(np.array(self._eps, np.float32)))
            ms = op.ReduceMean(op.Pow(x, two), op.Constant(value_ints=[-1]), keepdims=1)
            inv = op.Reciprocal(op.Sqrt(op.Add(ms, eps)))
            return op.Mul(gamma, op.Mul(x, inv))

    return _UnfuseRms.rule()


_FIX = ("leave fuse-decoder out for this model (it fuses Llama/Qwen-style rotary attention only; explicit-attention, "
        "pack-matmuls, trim-logits and the quantize passes do not need it)")


def _learned_positions(model: ir.Model, position_ids: str) -> ir.Node | None:
    """The Gather that reads a learned position-embedding table at ``position_ids`` (GPT-2's ``wpe``), if any."""
    for node in model.graph:
        if node.op_type == "Gather" and len(node.inputs) == 2 and node.inputs[1] is not None:
            table, idx = node.inputs
            if idx.name == position_ids and table is not None and table.const_value is not None:
                return node
    return None


def _fused_qkv(model: ir.Model) -> tuple[ir.Node, ir.Node] | None:
    """(projection, Split) of a fused q/k/v projection (GPT-2's Conv1D ``c_attn``: one Gemm or MatMul + Split)."""
    for node in model.graph:
        if node.op_type != "Split" or len(node.outputs) != 3 or not node.inputs or node.inputs[0] is None:
            continue
        prod = node.inputs[0].producer()
        for _ in range(3):  # through the Reshape / Add of a bias
            if prod is None or prod.op_type in ("Gemm", "MatMul"):
                break
            prod = next((i.producer() for i in prod.inputs if i is not None and i.producer() is not None), None)
        if prod is not None and prod.op_type in ("Gemm", "MatMul"):
            return prod, node
    return None


def _missing_rotary(model: ir.Model, position_ids: str) -> str:
    """Why a decoder with position_ids has no rotary attention to fuse, naming the GPT-2-style nodes found."""
    why = "no unfused rotary attention (Softmax fed by Cos/Sin rotary embeddings) to fuse"
    gather = _learned_positions(model, position_ids)
    if gather is not None:
        why += (f": the model uses learned position embeddings (Gather {gather.name!r} reads {position_ids!r} from "
                f"the table {gather.inputs[0].name!r}) instead of rotary ones")
    qkv = _fused_qkv(model)
    if qkv is not None:
        why += (f"{' and' if gather is not None else ':'} a fused q/k/v projection ({qkv[0].op_type} {qkv[0].name!r} "
                f"+ Split {qkv[1].name!r}, GPT-2's Conv1D)")
    return why


class FuseDecoderPass(ir.passes.InPlacePass):
    """Fuse attention (GroupQueryAttention), rotary embeddings and skip-RMS norms of an exported KV decoder.

    See the module docstring for scope, invariants and sketch. ``max_positions`` is the length of the
    rotary cos/sin caches (positions beyond it are rejected by ORT at run time): the model's
    ``max_position_embeddings``.
    """

    def __init__(self, max_positions: int = 8192) -> None:
        super().__init__()
        if max_positions < 1:
            raise ValueError(f"max_positions must be >= 1, not {max_positions}")
        self.max_positions = int(max_positions)

    def __repr__(self) -> str:
        return f"FuseDecoderPass(max_positions={self.max_positions})"

    @staticmethod
    def _inspect(model: ir.Model) -> tuple[str | None, dict | None, bool]:
        """(why the pass leaves ``model`` alone or None, its decoder spec when a KV decoder, whether it cannot fire).

        The flag is False when there is nothing left to do (already fused), True when the model lacks a pattern.
        """
        from dyncompile.passes.speculative.decoder_spec import decoder_spec

        ops = {n.op_type for n in model.graph}
        if "GroupQueryAttention" in ops:
            return "already fused (GroupQueryAttention present)", None, False
        try:
            spec = decoder_spec(model, "model")
        except Exception as e:  # noqa: BLE001 - not a KV decoder
            return f"not a KV-cache decoder ({str(e)[:80]})", None, True
        if spec["position_ids"] is None:
            return "no position_ids input (rotary positions cannot be fed to the fused ops)", spec, True
        if "Softmax" not in ops or "Cos" not in ops:
            return _missing_rotary(model, spec["position_ids"]), spec, True
        head = spec["kv"][0]["shape"][-1] if spec["kv"] else None
        if isinstance(head, int) and head % 16:  # ORT fails at run time: "head_size shall be a multiple of 16"
            return f"head size {head} is not a multiple of 16 (ONNX Runtime's GroupQueryAttention needs one)", spec, True
        return None, spec, False

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Run the rewrite on ``model`` (scope and invariants: the class docstring)."""
        why, spec, cannot = self._inspect(model)
        if why is not None and cannot:
            return not_fired(model, "fuse-decoder", why, _FIX)
        if why is not None:
            logger.info("fuse-decoder: nothing to do: %s", why)
            return ir.passes.PassResult(model, modified=False)
        import onnx_ir.passes.common as common_passes
        from onnxscript.optimizer import optimize
        from onnxscript.rewriter.ort_fusions import _core
        from onnxscript.rewriter.ort_fusions.rms_normalization import fuse_rms_normalization
        from onnxscript.rewriter.ort_fusions.rotary_embedding import fuse_rotary_embedding
        from onnxscript.rewriter.ort_fusions.sdpa import fuse_sdpa
        from onnxscript.rewriter.ort_fusions.skip_normalization import fuse_skip_rms_normalization

        input_ids = next(v for v in model.graph.inputs if v.name == spec["input_ids"])
        names_in = [v.name for v in model.graph.inputs]
        names_out = [v.name for v in model.graph.outputs]
        with guarded_default_rules():  # the same rewrites, ~4x faster on a decoder (_rule_guard.py)
            _core._pre_optimize(model)
            counts = {
                "rms_norm": fuse_rms_normalization(model),
                "skip_rms_norm": fuse_skip_rms_normalization(model),
                "rotary": fuse_rotary_embedding(model),
            }
            common_passes.CommonSubexpressionEliminationPass()(model)
            counts["sdpa"] = fuse_sdpa(model, apply_shape_inference=True)
            common_passes.RemoveUnusedNodesPass()(model)  # Shape nodes left on the repeated keys block the match
            counts["gqa"] = _gqa_rule(self.max_positions, input_ids).apply_to_model(model)
            counts["rms_unfused"] = _unfuse_rms_rule().apply_to_model(model)
            optimize(model)  # inlines recogniser functions left unconsumed, folds constants, drops dead nodes
        common_passes.CommonSubexpressionEliminationPass()(model)  # one seqlens_k / total length for all layers
        common_passes.RemoveUnusedNodesPass()(model)
        common_passes.RemoveUnusedFunctionsPass()(model)
        common_passes.RemoveUnusedOpsetsPass()(model)
        if _MS not in model.opset_imports:
            model.opset_imports[_MS] = 1
        got_in = [v.name for v in model.graph.inputs]
        got_out = [v.name for v in model.graph.outputs]
        if got_in != names_in or got_out != names_out:  # pragma: no cover - a rewriter regression
            raise RuntimeError(f"fuse-decoder changed the graph IO: {got_in[:4]} / {got_out[:4]}")
        layers = counts["sdpa"]
        if counts["gqa"] < layers:
            logger.warning("fuse-decoder: %d of %d attention layers fused", counts["gqa"], layers)
        logger.info("fuse-decoder: %s", counts)
        return ir.passes.PassResult(model, modified=True)


@register_pass(
    "fuse-decoder",
    help="fuse a KV decoder's attention (GroupQueryAttention, any additive mask), rotary and skip-RMS norms "
    "into ORT contrib ops; IO unchanged",
)
def _make_fuse_decoder(context, max_positions: int = 0) -> FuseDecoderPass:
    if max_positions < 0:
        raise PassConfigError(
            f"fuse-decoder: max_positions must be >= 0 (0: the model's max_position_embeddings), not {max_positions}"
        )
    if not max_positions:
        max_positions = int((context.model_config or {}).get("max_position_embeddings") or 8192)
    return FuseDecoderPass(max_positions=max_positions)
