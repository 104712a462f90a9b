"""``screen-lm-head``: an exact greedy LM head that reads an int8 copy of its weight and the fp32 rows of a few tokens.

Greedy decoding needs only each row's argmax, yet a float32 LM head reads its whole ``[hidden, vocab]`` weight on
every call: 933 MB on Qwen2.5-Coder-1.5B (15 % of a decode step's weight bytes), 545 MB on the 0.5B (27 %). This
pass computes the logits from an int8 copy of the weight (``MatMulNBits``, 8 bits, int8 compute: a quarter of the
bytes) together with a rigorous bound on every logit's error, keeps the tokens that can still be the argmax (upper
bound at least the row's largest lower bound), and computes those tokens' logits exactly, in float32, from their
own weight rows:

* Bound. With ``w_hat`` the weight rounded per block of ``block_size`` along ``hidden`` (step ``t``) and ``x_hat``
  the activation as ``MatMulNBits``' int8 compute rounds it (per block, step ``s = max|x_b| / 127``; measured
  against ONNX Runtime to float round-off in ``tests/test_screen_lm_head.py``),
  ``x.w - x_hat.w_hat = x.(w - w_hat) + (x - x_hat).w_hat``, so
  ``|error| <= sum_b ||x_b||_1 t_b / 2 + sum_b s_b / 2 ||w_hat_b||_1``: one small ``MatMul``
  (``[rows, 2 * blocks] x [2 * blocks, vocab]``), times ``slack`` (default 2: it also covers an activation block up
  to twice the weight block and the float round-off of both products).
* Candidates: the ``candidates`` tokens of largest upper bound. Their float32 logits (``Gather`` of their rows,
  one batched ``MatMul``) are scattered into the approximate ones. When some row has more than ``candidates``
  tokens whose upper bound reaches its largest lower bound, the call computes the original float32 head instead
  (an ``If``; its weight is the ``[vocab, hidden]`` embedding when the head is tied to it, read through ``Gemm``
  with ``transB``, so no byte is added to the model).
* Invariant: every row's argmax is the original head's (a token outside the candidates has an upper bound below
  some candidate's lower bound, which is at most that candidate's float32 logit). The other logits are within the
  bound of the original's, not equal to them: the pass writes the ``dyncompile.logits_exact`` key (``argmax``),
  the plan records ``logits_exact: "argmax"`` on the decoder, and the runtime refuses to sample from it (and
  ``bench quality`` to score its perplexity). Greedy decoding, alone or speculative, is token-identical.
* Scope: the main graph's LM head as :func:`~dyncompile.passes.trim_logits.lm_head` finds it, a ``MatMul`` of a
  constant float32 ``[hidden, vocab]`` weight (``trim-logits``' ``Slice`` before it is fine), ``hidden`` a multiple
  of ``block_size``; CPU EP compiles only (the bound is that of the CPU's int8 compute). Anything else is left
  alone with the reason logged. Idempotent: a screened head is an ``If``, which the next run does not match.
* Order: after the passes that rewrite the graph around the head (``fuse-decoder``, ``pack-matmuls``,
  ``trim-logits``, ``explicit-attention``, the drafter passes), before ``matmul-to-conv`` (which would lower the
  head to a ``Conv``) and ``speculative`` (whose probes then time the screened head).
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from dyncompile.errors import PassConfigError
from dyncompile.passes._graph import add_initializer
from dyncompile.passes._infra import not_fired, register_pass
from dyncompile.passes._keys import LOGITS_EXACT
from dyncompile.passes.trim_logits import lm_head

logger = logging.getLogger(__name__)

__all__ = ["ScreenLMHeadPass", "quantize_head", "screen_bound_weights"]

_MS = "com.microsoft"


def quantize_head(w: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``MatMulNBits`` inputs (8 bits, zero point 128) for ``w`` ``[hidden, vocab]``, and the rounded integers.

    Returns packed ``B`` ``[vocab, blocks, block_size]`` uint8, scales ``[vocab * blocks]`` and ``q`` ``[vocab, blocks,
    block_size]`` (the weight is ``q * scale`` per block).
    """
    d, v = w.shape
    wt = w.T.reshape(v, d // block_size, block_size).astype(np.float32)
    t = (np.abs(wt).max(-1) / np.float32(127)).astype(np.float32)
    t[t == 0] = 1.0  # an all-zero block: q = 0 whatever the step
    q = np.clip(np.rint(wt / t[..., None]), -127, 127).astype(np.int16)
    return (q + 128).astype(np.uint8), t.reshape(-1), q


def screen_bound_weights(q: np.ndarray, scales: np.ndarray, slack: float) -> np.ndarray:
    """``[2 * blocks, vocab]``: ``slack * [t / 2 ; ||w_hat_b||_1]`` per block and token (the bound's right factor)."""
    v, nb, _ = q.shape
    t = scales.reshape(v, nb).astype(np.float64)
    l1 = np.abs(q).sum(-1) * t
    return (slack * np.concatenate([t.T / 2, l1.T], axis=0)).astype(np.float32)


def _head_weight(head: ir.Node) -> tuple[np.ndarray | None, ir.Value | None]:
    """The head's float32 ``[hidden, vocab]`` weight and, when it reads ``Transpose(E)``, ``E``'s initializer.

    ``(None, None)`` for anything else.
    """
    w_val = head.inputs[1] if head.op_type == "MatMul" and len(head.inputs) > 1 else None
    if w_val is None:
        return None, None
    if w_val.const_value is not None:
        cv = w_val.const_value
        ok = cv.dtype == ir.DataType.FLOAT and len(cv.shape) == 2
        return (cv.numpy(), None) if ok else (None, None)
    tr = w_val.producer()
    if tr is None or tr.op_type != "Transpose" or tr.inputs[0] is None or not tr.inputs[0].is_initializer():
        return None, None
    perm = tr.attributes.get_ints("perm", None)
    e = tr.inputs[0].const_value
    if e is None or e.dtype != ir.DataType.FLOAT or len(e.shape) != 2 or (perm is not None and list(perm) != [1, 0]):
        return None, None
    return e.numpy().T, tr.inputs[0]


def _tied_rows(g: ir.Graph, w: np.ndarray) -> ir.Value | None:
    """An initializer ``[vocab, hidden]`` equal to ``w.T`` (the tied embedding), if the graph has one."""
    d, v = w.shape
    for init in g.initializers.values():
        cv = init.const_value
        if cv is None or tuple(cv.shape) != (v, d) or cv.dtype != ir.DataType.FLOAT:
            continue
        if np.array_equal(cv.numpy(), w.T):
            return init
    return None


class ScreenLMHeadPass(ir.passes.InPlacePass):
    """Replace a float32 LM head by an int8 screen + float32 logits of the possible argmaxes (exact greedy argmax).

    Options: ``block_size`` (int8 weight and activation block, a divisor of ``hidden``), ``candidates`` (tokens
    whose float32 logits are computed per row; more than that many possible argmaxes falls back to the full head)
    and ``slack`` (factor on the error bound, >= 1). Scope and invariants: the module docstring.
    """

    def __init__(self, block_size: int = 32, candidates: int = 256, slack: float = 2.0, provider: str = "cpu") -> None:
        """Check the options (see the class docstring)."""
        if block_size < 16 or block_size & (block_size - 1):
            raise PassConfigError(f"screen-lm-head block_size must be a power of two >= 16, not {block_size}")
        if candidates < 1:
            raise PassConfigError(f"screen-lm-head candidates must be >= 1, not {candidates}")
        if not (slack >= 1.0 and np.isfinite(slack)):
            raise PassConfigError(f"screen-lm-head slack must be a finite number >= 1, not {slack}")
        self.block_size, self.candidates, self.slack, self.provider = int(block_size), int(candidates), float(slack), provider

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(block_size={self.block_size}, candidates={self.candidates}, "
                f"slack={self.slack})")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Run the rewrite on ``model`` (scope and invariants: the module docstring)."""
        name = "screen-lm-head"
        if self.provider != "cpu":
            return not_fired(model, name, f"its error bound is that of the CPU EP's int8 compute, and this compile "
                             f"targets {self.provider}", "leave screen-lm-head out for this provider")
        g = model.graph
        head = lm_head(g)
        if head is None:
            return not_fired(model, name, "no float LM head found (a MatMul producing the rank-3 output 'logits'; "
                             "an already screened head is an If)", "leave screen-lm-head out for this model")
        w, rows = _head_weight(head)
        if w is None:
            return not_fired(model, name, f"the LM head is a {head.op_type} without a constant float32 [hidden, vocab] "
                             "weight or transposed [vocab, hidden] embedding (quantized or lowered already)",
                             "run screen-lm-head before quantize-int4 / matmul-to-conv, on a float32 head")
        d, vocab = w.shape
        if d % self.block_size:
            return not_fired(model, name, f"hidden size {d} is not a multiple of block_size {self.block_size}",
                             "give block_size=16 or another divisor")
        k = min(self.candidates, vocab - 1)
        if k < 1:
            return not_fired(model, name, f"a vocabulary of {vocab} token leaves nothing to screen")
        self._rewrite(model, head, w, rows, k)
        model.opset_imports.setdefault(_MS, 1)
        model.graph.opset_imports.setdefault(_MS, 1)
        model.metadata_props[LOGITS_EXACT] = "argmax"
        logger.info("screen-lm-head: %s %s [%d x %d] -> int8 screen (block %d) + float32 logits of %d candidates "
                    "per row", head.op_type, head.name, d, vocab, self.block_size, k)
        return ir.passes.PassResult(model, modified=True)

    def _rewrite(self, model: ir.Model, head: ir.Node, w: np.ndarray, rows: ir.Value | None, k: int) -> None:
        g = model.graph
        d, vocab = w.shape
        bs, nb = self.block_size, d // self.block_size
        p = "screen_lm_head"
        b_u8, scales, q = quantize_head(w, bs)
        rows = rows or _tied_rows(g, w)
        if rows is None:
            rows = add_initializer(g, f"{p}.weight_rows", np.ascontiguousarray(w.T))
        x, old = head.inputs[0], head.outputs[0]

        def c(nm, arr):
            return add_initializer(g, f"{p}.{nm}", np.ascontiguousarray(arr))

        nodes: list[ir.Node] = []

        def op(kind, ins, out, domain="", n_out=1, **attrs):
            node = ir.node(kind, ins, attributes=attrs, domain=domain, num_outputs=n_out, name=f"{p}/{out}")
            for i, v in enumerate(node.outputs):
                v.name = f"{p}.{out}" if n_out == 1 else f"{p}.{out}{i}"
            nodes.append(node)
            return node.outputs[0] if n_out == 1 else node.outputs

        approx = op("MatMulNBits", [x, c("B", b_u8), c("scales", scales)], "approx", domain=_MS, K=d, N=vocab,
                    bits=8, block_size=bs, accuracy_level=4)
        approx.producer().metadata_props[LOGITS_EXACT] = "screen"  # not a row-dependence speculative must measure
        ax = op("Reshape", [op("Abs", [x], "abs"), c("blocks", np.array([0, 0, nb, bs], np.int64))], "abs_blocks")
        last = c("last_axis", np.array([-1], np.int64))
        l1 = op("ReduceSum", [ax, last], "l1", keepdims=0)
        half_step = op("Mul", [op("ReduceMax", [ax, last], "amax", keepdims=0), c("inv254", np.float32(1 / 254))],
                       "half_step")
        bound = op("MatMul", [op("Concat", [l1, half_step], "feat", axis=-1),
                              c("bound_weights", screen_bound_weights(q, scales, self.slack))], "bound")
        upper = op("Add", [approx, bound], "upper")
        thr = op("ReduceMax", [op("Sub", [approx, bound], "lower"), last], "threshold", keepdims=1)
        vals, idx = op("TopK", [upper, c("k1", np.array([k + 1], np.int64))], "topk", n_out=2, axis=-1)
        kth = op("Slice", [vals, c("k_start", np.array([k], np.int64)), c("k_end", np.array([k + 1], np.int64)), last],
                 "kth")
        over = op("ReduceMax", [op("Sub", [kth, thr], "margin")], "worst", keepdims=0)
        cond = op("GreaterOrEqual", [over, c("zero", np.float32(0))], "fallback")
        cand = op("Slice", [idx, c("start0", np.array([0], np.int64)), c("k_end0", np.array([k], np.int64)), last],
                  "candidates")

        def branch(kind: str) -> ir.Graph:
            b: list[ir.Node] = []

            def bop(t, ins, out, **attrs):
                node = ir.node(t, ins, attributes=attrs, name=f"{p}/{kind}/{out}")
                node.outputs[0].name = f"{p}.{kind}.{out}"
                b.append(node)
                return node.outputs[0]

            if kind == "full":  # the original head: x [.., D] @ rows[V, D]^T
                flat = bop("Reshape", [x, c("flat", np.array([-1, d], np.int64))], "x2d")
                full = bop("Gemm", [flat, rows], "logits2d", transB=1)
                shape = bop("Shape", [approx], "shape")
                out = bop("Reshape", [full, shape], "logits")
            else:  # float32 logits of the candidates scattered into the screen's
                gathered = bop("Gather", [rows, cand], "rows", axis=0)  # [B, S, k, D]
                col = bop("Unsqueeze", [x, last], "x_col")  # [B, S, D, 1]
                exact = bop("Squeeze", [bop("MatMul", [gathered, col], "exact_col"), last], "exact")
                out = bop("ScatterElements", [approx, cand, exact], "logits", axis=-1)
            out.type, out.shape = old.type, old.shape
            return ir.Graph([], [out], nodes=b, name=f"{p}_{kind}")

        if_node = ir.node("If", [cond], attributes={"then_branch": branch("full"), "else_branch": branch("screen")},
                          name=f"{p}/If")
        nodes.append(if_node)
        new = if_node.outputs[0]
        new.type, new.shape = old.type, old.shape
        for v in (approx, upper, bound):
            v.type, v.shape = old.type, old.shape
        cond.type = ir.TensorType(ir.DataType.BOOL)  # one element (ORT infers [1] for the all-axes ReduceMax)
        g.insert_before(head, nodes)
        name = old.name
        old.replace_all_uses_with(new, replace_graph_outputs=True)
        old.name = f"{p}.replaced"
        new.name = name
        w_val = head.inputs[1]
        g.remove(head, safe=True)
        tr = w_val.producer()
        if tr is not None and not w_val.uses() and w_val not in g.outputs:  # MatMul(x, Transpose(E)): E is the rows
            g.remove(tr, safe=True)
        elif w_val.is_initializer() and not w_val.uses() and w_val not in g.outputs:
            g.initializers.pop(w_val.name)  # the float head now reads the tied embedding (or its own rows' copy)


@register_pass(
    "screen-lm-head",
    help="exact greedy LM head: an int8 copy of the weight with a rigorous error bound picks the possible argmaxes, "
    "their float32 logits are computed from their rows (a quarter of the head's bytes; greedy only: the plan refuses "
    "to sample); CPU EP",
    after=("fuse-decoder", "pack-matmuls", "trim-logits", "explicit-attention", "eagle-drafter", "medusa-heads",
           "split-drafter", "sparsify-activations"),
    before=("speculative", "matmul-to-conv", "quantize-int4", "quantize-int8"),
)
def _make_screen_lm_head(context, block_size: int = 32, candidates: int = 256, slack: float = 2.0) -> ScreenLMHeadPass:
    return ScreenLMHeadPass(block_size=block_size, candidates=candidates, slack=slack,
                            provider=context.options.get("provider") or "cpu")
