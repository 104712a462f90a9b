"""``sparsify-activations``: training-free contextual sparsity (TEAL-style) on a decoder's gated MLPs.

A decoder MLP is ``down(SiLU(gate(x)) * up(x))``. Many entries of its inputs (the post-norm ``x`` read by gate and
up, and the product ``h`` read by down) are near zero on a given token; dropping the entries ``|v| <= t`` drops
the matching *rows* of the weight (``v W = sum_i v_i W[i, :]``). A batch-1 CPU decode step is memory-bound, so it
gets faster only if the dropped rows are never read: each projection becomes ``dyncompile.SparseRowsMatMul``
(:mod:`dyncompile.runtime.kernels`, an ONNX Runtime custom operator built at first use) with a threshold ``t``.

Thresholds (TEAL, Liu et al. 2024): per layer and per input (``x`` shared by gate and up, ``h`` for down), the
``sparsity``-quantile of ``|v|`` over calibration text run through the dense model: each site drops that share of
its rows on text like the calibration text. ``allocation=greedy`` (TEAL's block-wise greedy) instead gives each MLP
its own pair of levels: from (0, 0), step whichever input's next level adds the least error to the MLP's output per
weight byte skipped (errors measured in numpy on the dense inputs of the first calibration tokens), until the MLP
skips ``sparsity`` of its weight bytes. Calibration text: CPython standard-library ``.py`` files, minus the
benchmarks' prompt files and held-out quality files (:data:`EXCLUDED_FILES`); the held-out perplexity runs on other
files of the same library, disjoint from the calibration ones.

``budget=P`` (percent held-out perplexity increase) with ``confidence=c`` (0.9): a quality promise must hold on text
the choice never saw, so the held-out files are cut in two (:func:`split_halves`). On the *search* half the 0.05
grid is walked upward in fixed sequence (:func:`fixed_sequence_walk`): a level is kept while the one-sided upper
bound at ``c`` of its perplexity increase (:func:`perplexity_increase`, a Student-t bound over files, paired by
window) is within ``P``; the first level that fails ends the walk, so with probability about ``c`` the level chosen
raises the perplexity of text like the held-out text by at most ``P``. The *check* half, never used to choose,
reports the increase with its interval at ``c`` and whether it is within ``P`` (``check.holds``; a warning when
not). No level within the budget: sparsity 0.0 (only exact zeros are skipped), with a warning. Without a budget
the quality is measured on every held-out window, with its interval.

Scope: main graph of a KV-cache decoder; each ``MatMul(h, W_down)`` with ``h = Mul(SiLU(MatMul(x, W_gate)),
MatMul(x, W_up))`` (SiLU as ``Mul(g, Sigmoid(g))``, either operand order), constant 2-D float32 weights. With
``sites=all`` (TEAL's choice), every other constant-weight float32 ``MatMul`` too (attention's q/k/v, which share one
input and one threshold, and o), the LM head excepted; the pass still needs a gated MLP to fire.
Invariants: graph inputs/outputs, names and every other node unchanged; the weights are the same initializers
(the op reads them in place); with threshold 0 the outputs equal the dense graph's within float round-off.
Calls of more than one row (a prompt's prefill) run ONNX Runtime's MatMul on the thresholded input (the op's
``dense_rows``, :data:`PREFILL_ROWS`): the same product up to round-off, at GEMM speed. A speculative plan's target
verifies several rows per call and needs them bit-identical to one-row calls: the speculative pass raises
``dense_rows`` to :data:`DENSE_ROWS` (:func:`keep_verification_rows`; this pass sets it so itself on a graph the
speculative pass has already seen), so only prefills longer than any verification call run the MatMul there.
Records ``dyncompile.sparsity`` (op, thresholds, achieved sparsity, held-out quality with its interval, the budget
search and its check, the library's sha256);
the compiler ships the library with the plan. Idempotent: a graph holding the op already is left alone.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import onnx_ir as ir

from dyncompile.passes import _keys
from dyncompile.passes._graph import replace_node_output
from dyncompile.passes._infra import not_fired, register_pass
from dyncompile.plan.decode import MAX_DRAFT_NODES

logger = logging.getLogger(__name__)

__all__ = [
    "ALLOCATIONS",
    "DEFAULT_CONFIDENCE",
    "DENSE_ROWS",
    "PREFILL_ROWS",
    "EXCLUDED_FILES",
    "LEVELS",
    "SITES",
    "SPARSITY",
    "GreedyPath",
    "Increase",
    "LayerError",
    "MlpLayer",
    "Site",
    "SparsifyActivationsPass",
    "abs_samples",
    "corpus_windows",
    "describe_sparsity",
    "fixed_sequence_walk",
    "heldout_stats",
    "linear_sites",
    "greedy_paths",
    "keep_verification_rows",
    "prefill_only_rows",
    "mlp_layers",
    "perplexity_increase",
    "residual_after",
    "split_halves",
    "t_quantile",
    "uses_sparse_rows",
    "window_nll",
]

SPARSITY = _keys.SPARSITY  # JSON record of this pass (metadata key)
#: standard-library files never read here: the benchmark prompts' files (tools/bench/prompt_sets.py CODE_FILES +
#: GROUNDED_DOC_FILES, as tools/train_drafter.py HELD_OUT) and `bench quality`'s held-out files (HELDOUT_FILES).
#: A test keeps this list equal to theirs (passes may not import tools).
EXCLUDED_FILES = (
    "argparse.py", "base64.py", "bisect.py", "calendar.py", "colorsys.py", "csv.py", "difflib.py", "fnmatch.py",
    "fractions.py", "heapq.py", "ipaddress.py", "json/__init__.py", "shlex.py", "statistics.py", "string.py",
    "textwrap.py",
    "functools.py", "enum.py", "dataclasses.py", "pathlib.py", "tokenize.py", "pprint.py", "gettext.py", "ftplib.py",
    "sched.py", "queue.py", "random.py", "glob.py",
)
SITES = ("mlp", "all")  # which linear-layer inputs the pass thresholds (``sites=`` option)
ALLOCATIONS = ("uniform", "greedy")  # one quantile for every site, or TEAL's block-wise greedy (``allocation=``)
_GRID = tuple(round(0.05 * k, 2) for k in range(1, 20))  # budget search: 0.05 .. 0.95
LEVELS = (0.0, *_GRID)  # the levels a greedy allocation gives each MLP input
_ERROR_TOKENS = 512  # calibration tokens whose MLP inputs the greedy allocation's local errors use
_SAMPLES_PER_WINDOW = 16384
#: a plan that decodes one token per call: every call of more rows (a prompt's prefill) runs ORT's MatMul on the
#: thresholded input instead of the row-skipping kernel (the op's ``dense_rows``)
PREFILL_ROWS = 1
#: a speculative plan's target: calls of up to this many rows keep the kernel's rows, bit-identical to one-row calls,
#: since a round verifies at most MAX_DRAFT_NODES drafts + the root; only a longer prompt's prefill runs ORT's MatMul
DENSE_ROWS = MAX_DRAFT_NODES + 1
HELDOUT_TOKENS = 4096  # held-out text for the quality figure of a fixed sparsity
HELDOUT_TOKENS_BUDGET = 8192  # and for budget=: about 9 files a half at window 256, where 4096 tokens gave 4-5
DEFAULT_CONFIDENCE = 0.9  # ``confidence=``: of the budget search's upper bounds and of the reported intervals


@dataclasses.dataclass
class MlpLayer:
    """One gated MLP: its three projections, the input gate and up share, and down's input."""

    gate: ir.Node
    up: ir.Node
    down: ir.Node
    x: ir.Value
    h: ir.Value


def _const_weight(node: ir.Node | None) -> bool:
    if node is None or node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return False
    w = node.inputs[1]
    return (w is not None and w.const_value is not None and w.const_value.dtype == ir.DataType.FLOAT
            and len(w.const_value.shape) == 2)


def _silu_input(v: ir.Value) -> ir.Value | None:
    """``g`` if ``v = Mul(g, Sigmoid(g))`` (either order), else None."""
    p = v.producer()
    if p is None or p.op_type != "Mul" or len(p.inputs) != 2:
        return None
    for a, b in (p.inputs, p.inputs[::-1]):
        s = b.producer() if b is not None else None
        if s is not None and s.op_type == "Sigmoid" and s.inputs[0] is a:
            return a
    return None


def mlp_layers(model: ir.Model) -> tuple[list[MlpLayer], str]:
    """The gated MLPs of the main graph in graph order, and why none when the list is empty."""
    layers, gated_shape = [], 0
    for down in model.graph:
        if not _const_weight(down):
            continue
        h = down.inputs[0]
        p = h.producer()
        if p is None or p.op_type != "Mul" or len(p.inputs) != 2:
            continue
        for a, b in (p.inputs, p.inputs[::-1]):
            g = _silu_input(a) if a is not None else None
            gate, up = (g.producer() if g is not None else None), (b.producer() if b is not None else None)
            if g is None:
                continue
            gated_shape += 1
            if not (_const_weight(gate) and _const_weight(up)) or gate.inputs[0] is not up.inputs[0]:
                continue
            k = gate.inputs[1].const_value.shape[0]
            if up.inputs[1].const_value.shape[0] != k or down.inputs[1].const_value.shape[0] != \
                    gate.inputs[1].const_value.shape[1]:
                continue
            layers.append(MlpLayer(gate, up, down, gate.inputs[0], h))
            break
    if layers:
        return layers, ""
    if gated_shape:
        return [], (f"{gated_shape} SiLU-gated products feed a MatMul, but none has gate and up as constant-weight "
                    "float32 MatMuls reading the same input")
    return [], ("the graph has no gated MLP (MatMul reading Mul(SiLU(MatMul(x, W_gate)), MatMul(x, W_up)) with "
                "constant float32 weights): nothing to sparsify")


@dataclasses.dataclass
class Site:
    """One linear-layer input the op thresholds: its value, its kind and the constant-weight MatMuls reading it.

    ``kind``: ``gate_up`` (a gated MLP's post-norm input), ``down`` (the gated product), ``attention`` (any other
    input of a constant-weight MatMul but the LM head: q/k/v's shared post-norm input, o's attention output).
    """

    value: ir.Value
    kind: str
    consumers: list[ir.Node]

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights its MatMuls read in full when dense."""
        return sum(int(n.inputs[1].const_value.nbytes) for n in self.consumers)


def linear_sites(model: ir.Model, vocab_size: int | None, which: str = "all") -> list[Site]:
    """The sites of the main graph, in graph order.

    ``which="mlp"``: the gated MLPs' two inputs per layer (gate/up's ``x``, down's ``h``). ``"all"``: every input of
    a constant-weight float MatMul (grouped by input value) except the LM head's (its weight's output dimension is
    ``vocab_size``), as TEAL thresholds every linear layer.
    """
    layers, _ = mlp_layers(model)
    if which == "mlp":
        return [site for layer in layers for site in (Site(layer.x, "gate_up", [layer.gate, layer.up]),
                                                        Site(layer.h, "down", [layer.down]))]
    kind = {id(layer.x): "gate_up" for layer in layers} | {id(layer.h): "down" for layer in layers}
    sites: dict[int, Site] = {}
    for node in model.graph:
        if not _const_weight(node):
            continue
        if vocab_size is not None and int(node.inputs[1].const_value.shape[1]) == int(vocab_size):
            continue  # the LM head
        v = node.inputs[0]
        if id(v) not in sites:
            sites[id(v)] = Site(v, kind.get(id(v), "attention"), [])
        sites[id(v)].consumers.append(node)
    return list(sites.values())


def uses_sparse_rows(model: ir.Model) -> bool:
    """Whether ``model``'s main graph holds ``dyncompile.SparseRowsMatMul`` (not merely another op of the library)."""
    return bool(_sparse_rows_nodes(model))


def _sparse_rows_nodes(model: ir.Model) -> list[ir.Node]:
    from dyncompile.runtime.kernels import DOMAIN, OP_TYPE

    return [n for n in model.graph if n.domain == DOMAIN and n.op_type == OP_TYPE]


def keep_verification_rows(model: ir.Model) -> bool:
    """Raise every ``SparseRowsMatMul``'s ``dense_rows`` to :data:`DENSE_ROWS`; whether a node changed.

    The speculative pass calls this on its target: every verification call then runs the kernel's rows,
    bit-identical to one-row calls, so speculative decoding stays token-identical to the sparse target alone.
    """
    short = prefill_only_rows(model)
    for n in short:
        n.attributes["dense_rows"] = ir.AttrInt64("dense_rows", DENSE_ROWS)
    return bool(short)


def prefill_only_rows(model: ir.Model) -> list[ir.Node]:
    """The ``SparseRowsMatMul`` nodes that would run some verification call through ORT's MatMul.

    That is, ``dense_rows`` in ``1 ..`` :data:`DENSE_ROWS` ``- 1`` (0, the op's default, never runs it).
    """
    return [n for n in _sparse_rows_nodes(model) if 0 < n.attributes.get_int("dense_rows", 0) < DENSE_ROWS]


# ----------------------------------------------------------------------------------------------- text


def corpus_windows(tokenizer_json: Path, *, tokens: int, window: int, part: str, root: Path | None = None,
                   seed: int = 0, files: list[int] | None = None) -> list[list[int]]:
    """Token windows of ``window`` tokens (about ``tokens`` in all) from the stdlib's ``.py`` files.

    The files (sorted, minus :data:`EXCLUDED_FILES` and third-party folders) are shuffled with ``seed`` and cut in
    two: ``part="calib"`` reads the even positions, ``part="heldout"`` the odd ones, so the two never share a file.
    Each file gives at most two windows (the set spans many modules), adjacent in the list. ``files``: a list
    that gets each window's file (its index in the sorted list), for bounds and splits by file.
    """
    from tokenizers import Tokenizer

    from dyncompile.errors import DataError

    root = Path(root or sysconfig.get_paths()["stdlib"])
    excluded = {root / f for f in EXCLUDED_FILES}
    paths = [p for p in sorted(root.rglob("*.py")) if p not in excluded
             and not any(x in ("site-packages", "dist-packages", "test", "tests", "idlelib") for x in
                         p.relative_to(root).parts)]
    if not paths:
        raise DataError(f"no standard-library .py files under {root} for the sparsity calibration")
    order = np.random.default_rng(seed).permutation(len(paths))
    pick = order[0::2] if part == "calib" else order[1::2]
    tok = Tokenizer.from_file(str(tokenizer_json))
    out: list[list[int]] = []
    src: list[int] = []
    for i in pick:
        try:
            text = paths[i].read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        ids = tok.encode(text, add_special_tokens=False).ids
        for s in range(0, min(len(ids) - window + 1, 2 * window), window):
            out.append(list(ids[s : s + window]))
            src.append(int(i))
        if len(out) * window >= tokens:
            break
    out = out[: max(1, math.ceil(tokens / window))]
    if files is not None:
        files.extend(src[: len(out)])
    return out


# ----------------------------------------------------------------------------------------------- runs


def _session(model: ir.Model, extra_outputs: Sequence[str] = ()):
    """A CPU session on ``model`` (custom-op library registered if needed) with ``extra_outputs`` exposed."""
    from dyncompile.passes.speculative.probe import session_for

    added = []
    have = {v.name for v in model.graph.outputs}
    values = {v.name: v for n in model.graph for v in n.outputs}
    for name in extra_outputs:
        if name not in have:
            model.graph.outputs.append(values[name])
            added.append(values[name])
    try:
        return session_for(model)
    finally:
        for v in added:
            model.graph.outputs.remove(v)


def _run(sess, spec, window: Sequence[int], names: Sequence[str]):
    from dyncompile.passes.speculative.probe import prefill_feeds

    feeds = prefill_feeds(spec, list(window))
    inputs = {i.name for i in sess.get_inputs()}
    return sess.run(list(names), {k: v for k, v in feeds.items() if k in inputs})


def window_nll(logits: np.ndarray, window: Sequence[int]) -> tuple[float, int]:
    """Summed next-token NLL of ``window`` under ``logits`` ``[1, n, V]`` and the number of predictions."""
    z = np.asarray(logits[0, :-1], np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    lse = np.log(np.exp(z).sum(axis=-1))
    tgt = np.asarray(window[1:], np.int64)
    return float((lse - z[np.arange(len(tgt)), tgt]).sum()), len(tgt)


def abs_samples(outputs: Iterable[Sequence[np.ndarray]], names: Sequence[str],
                per_window: int = _SAMPLES_PER_WINDOW) -> dict[str, np.ndarray]:
    """A random sample (seed 0) of ``|v|`` per site.

    ``outputs`` gives, per calibration window, the sites' arrays in ``names`` order; a window adds at most
    ``per_window`` entries of each.
    """
    rng = np.random.default_rng(0)
    got: dict[str, list[np.ndarray]] = {s: [] for s in names}
    for outs in outputs:
        for name, v in zip(names, outs, strict=True):
            a = np.abs(np.asarray(v, np.float32)).ravel()
            got[name].append(a if a.size <= per_window else a[rng.integers(0, a.size, per_window)])
    return {k: np.concatenate(v) for k, v in got.items()}


def heldout_stats(runs: Iterable[tuple[Sequence[int], Sequence[np.ndarray]]], thresholds: Sequence[float],
                  reference: Sequence[np.ndarray] | None = None, *, greedy: bool = False,
                  nll: list[tuple[float, int]] | None = None):
    """Quality over held-out windows, from each window and its run's ``[logits, *site values]``.

    Returns the perplexity, per site the share of ``|v| <= threshold`` entries, each window's greedy tokens (with
    ``greedy`` or ``reference``, else an empty list) and, with ``reference`` (such tokens of another model), the
    share of positions where they agree (else None). ``nll``: a list that gets each window's summed NLL and number
    of predictions (for intervals paired by window).
    """
    tot, n = 0.0, 0
    below = np.zeros(len(thresholds))
    count = np.zeros(len(thresholds))
    top1, same = [], 0
    for i, (w, outs) in enumerate(runs):
        s, k = window_nll(outs[0], w)
        tot, n = tot + s, n + k
        if nll is not None:
            nll.append((s, k))
        if greedy or reference is not None:
            top1.append(np.asarray(outs[0][0]).argmax(-1))
        if reference is not None:
            same += int((top1[-1] == reference[i]).sum())
        for j, (v, t) in enumerate(zip(outs[1:], thresholds, strict=True)):
            a = np.abs(np.asarray(v, np.float32))
            below[j] += float((a <= t).sum())
            count[j] += a.size
    agree = None if reference is None else same / max(sum(len(r) for r in reference), 1)
    return math.exp(tot / max(n, 1)), below / np.maximum(count, 1), top1, agree


def _heldout(model: ir.Model, spec, windows, sites: Sequence[str] = (), thresholds: Sequence[float] = ()):
    """Each window's summed NLL and predictions under ``model`` (arrays), and each site's share of small entries.

    The share: of ``|v| <= threshold`` entries, per site in ``sites`` order.
    """
    sess = _session(model, sites)
    names = [spec["logits"], *sites]
    per: list[tuple[float, int]] = []
    _, below, _, _ = heldout_stats(((w, _run(sess, spec, w, names)) for w in windows), thresholds, nll=per)
    nll, n = (np.array(v, np.float64) for v in zip(*per, strict=True))
    return nll, n, below.tolist()


# ----------------------------------------------------------------------------------------------- quality bounds


def t_quantile(p: float, df: int) -> float:
    """The ``p``-quantile (``0.5 <= p < 1``) of Student's t with ``df >= 1`` degrees of freedom.

    Bisection on the CDF ``1 - I_x(df/2, 1/2) / 2`` at ``x = df / (df + t^2)`` (regularized incomplete beta by
    its continued fraction); numpy only, within 1e-10 of the tables.
    """
    if not 0.5 <= p < 1.0 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 <= p < 1 and df >= 1, got p={p}, df={df}")
    if p == 0.5:
        return 0.0

    def cdf(t: float) -> float:
        return 1.0 - 0.5 * _betainc(0.5 * df, 0.5, df / (df + t * t))

    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        lo, hi = hi, 2.0 * hi
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if cdf(mid) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function ``I_x(a, b)`` (Lentz's continued fraction)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def _betacf(a: float, b: float, x: float) -> float:
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        for aa in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                   -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


@dataclasses.dataclass(frozen=True)
class Increase:
    """The perplexity increase of a sparse graph over the dense one on the same held-out windows, with t-bounds.

    ``pct``: ``100 (exp((sum NLL_sparse - sum NLL_dense) / tokens) - 1)`` (the perplexity ratio, minus 1);
    ``upper``: its one-sided upper bound at ``confidence``; ``lo`` / ``hi``: the two-sided interval at
    ``confidence``; ``units``: the independent units the bound counts (files, or windows when files are not
    known); ``predictions``: the tokens predicted (each window's length minus one, summed). Bounds are infinite
    with fewer than two units.
    """

    pct: float
    upper: float
    lo: float
    hi: float
    confidence: float
    units: int
    windows: int
    predictions: int
    perplexity: float
    perplexity_dense: float

    def interval(self) -> list[float] | None:
        """``[lo, hi]`` rounded for a record, or None when it is not finite (fewer than two units)."""
        return [round(self.lo, 3), round(self.hi, 3)] if math.isfinite(self.lo) and math.isfinite(self.hi) else None


def perplexity_increase(nll: Sequence[float], dense_nll: Sequence[float], n: Sequence[int], confidence: float,
                        groups: Sequence[int] | None = None) -> Increase:
    """The perplexity increase (:class:`Increase`) from per-window summed NLLs, paired by window.

    Method: a Student-t bound on the mean per-token log-ratio, paired by window. Per unit ``u`` (a window, or with
    ``groups`` all windows of one source file summed: windows cut from the same file are not independent draws),
    ``D_u = sum NLL_sparse - sum NLL_dense`` over its ``n_u`` tokens. The log perplexity ratio is the ratio
    estimator ``r = sum D_u / sum n_u``; its standard error is the linearised one, ``sqrt(sum (D_u - r n_u)^2 /
    (k (k - 1))) / mean(n_u)`` over ``k`` units (with equal-length units it is the ordinary standard error of the
    per-unit log-ratios ``D_u / n_u``). The upper bound is ``exp(r + t_{c, k-1} se) - 1``, the interval ``exp(r +-
    t_{(1+c)/2, k-1} se) - 1``.

    Why a t-bound rather than the paired bootstrap of the ``sparsity_allocation`` study: the budget is searched on
    half of 16 held-out windows (a few files), and a percentile bootstrap over so few units is too narrow (its
    spread is biased low by ``(k-1)/k``, and its upper quantile never passes the worst unit's ratio), so its 90 %
    bound covers less than 90 %. The t-bound is exact for normal per-unit log-ratios and close otherwise (each is an
    average over hundreds of tokens), has no seed, and costs nothing beside the runs.
    """
    nll, dense, n = (np.asarray(v, np.float64) for v in (nll, dense_nll, n))
    if not (len(nll) == len(dense) == len(n)) or not len(n) or np.any(n <= 0):
        raise ValueError("perplexity_increase needs equal-length, non-empty per-window NLLs and positive counts")
    if not 0.5 <= confidence < 1.0:
        raise ValueError(f"confidence must be in [0.5, 1), got {confidence}")
    if groups is not None:
        _, unit = np.unique(np.asarray(groups), return_inverse=True)
        d_u, n_u = np.bincount(unit, nll - dense), np.bincount(unit, n)
    else:
        d_u, n_u = nll - dense, n
    k = len(n_u)
    r = float(d_u.sum() / n_u.sum())
    pct = 100.0 * math.expm1(r)
    if k < 2:
        upper, lo, hi = math.inf, -math.inf, math.inf
    else:
        se = math.sqrt(float(np.square(d_u - r * n_u).sum()) / (k * (k - 1))) / float(n_u.mean())
        upper = 100.0 * math.expm1(r + t_quantile(confidence, k - 1) * se)
        half = t_quantile(0.5 + 0.5 * confidence, k - 1) * se
        lo, hi = 100.0 * math.expm1(r - half), 100.0 * math.expm1(r + half)
    predictions = int(n.sum())
    return Increase(pct, upper, lo, hi, float(confidence), k, len(n), predictions,
                    math.exp(float(nll.sum()) / predictions), math.exp(float(dense.sum()) / predictions))


def split_halves(groups: Sequence[int]) -> tuple[list[int], list[int]]:
    """The held-out windows' indices, cut into a *search* half and a *check* half by source file.

    ``groups``: each window's file (:func:`corpus_windows` ``files=``; windows of one file are adjacent). The files,
    in the order they first appear, alternate: even ranks search, odd ranks check. No file is in both halves, and
    the cut depends on nothing but the order of the windows.
    """
    rank: dict[int, int] = {}
    for g in groups:
        rank.setdefault(g, len(rank))
    search = [i for i, g in enumerate(groups) if rank[g] % 2 == 0]
    check = [i for i, g in enumerate(groups) if rank[g] % 2 == 1]
    return search, check


def fixed_sequence_walk(levels: Sequence[float], evaluate, budget: float) -> tuple[float, list[dict]]:
    """Walk ``levels`` upward and keep the last level whose upper bound is within ``budget`` (percent).

    ``evaluate(level)`` gives the level's :class:`Increase` on the search half. Fixed-sequence testing: the
    hypotheses ``H_s: increase(s) > budget`` are tested in a fixed order, each at level ``1 - confidence``, and the
    walk stops at the first one not rejected (``upper > budget``; the project's one walk,
    :func:`dyncompile.passes.early_exit.certify.fixed_sequence`); the family-wise error stays at ``1 - confidence``
    with no multiplicity correction. A level past a failure is never tested, even if its bound would pass: bisection,
    which skips levels and goes on after a failure, would need one. Returns the level chosen (0.0 when the first
    fails) and one row per level tested, the failing one included.
    """
    from dyncompile.passes.early_exit.certify import fixed_sequence

    last, incs = fixed_sequence(levels, evaluate, lambda inc: inc.upper <= budget)
    rows = [{"sparsity": s, "perplexity": round(inc.perplexity, 4), "increase_pct": round(inc.pct, 3),
             "upper_pct": _finite(inc.upper), "accepted": j <= last} for j, (s, inc) in enumerate(zip(levels, incs))]
    return (levels[last] if last >= 0 else 0.0), rows


def _finite(x: float, digits: int = 3) -> float | None:
    return round(x, digits) if math.isfinite(x) else None


def describe_sparsity(d: dict) -> str:
    """One line for ``inspect`` from a plan's ``policy.sparsity`` (or ``drafter_sparsity``)."""
    q = d.get("quality") or {}
    conf = f"{100 * d['confidence']:g} %" if d.get("confidence") is not None else None
    if d.get("mode") == "budget":
        text = f"budget +{d.get('budget_pct')} % held-out perplexity"
        text += f" at {conf} confidence" if conf else " (point estimate, no confidence)"
        if d.get("sparsity") == 0.0 and conf:
            text += f" -> sparsity 0.0: no level's upper bound at {conf} is within it; only exact zeros are skipped"
        else:
            text += f" -> sparsity {d.get('sparsity')}"
        c = d.get("check")
        if c:
            iv = c.get("interval")
            text += (f"; check half ({c['windows']} windows, {c['tokens']} tokens never used to choose): "
                     f"{c['increase_pct']:+.2f} %" + (f" [{iv[0]:+.2f}, {iv[1]:+.2f}]" if iv else "")
                     + (" -> holds" if c.get("holds") else " -> does NOT hold"))
        return text
    text = f"sparsity {d.get('sparsity')} (fixed)"
    if q:
        iv = q.get("interval")
        text += (f"; held-out perplexity {q['increase_pct']:+.2f} %"
                 + (f" [{iv[0]:+.2f}, {iv[1]:+.2f}] at {conf}" if iv and conf else
                    " (no interval: fewer than two held-out files)" if conf else "")
                 + f" on {q.get('heldout_windows')} windows")
    return text


# ----------------------------------------------------------------------------------------------- allocation


class LayerError:
    """A gated MLP in numpy on fixed dense inputs ``x``, and its error at a pair of levels.

    ``error(i, j)`` is the squared distance of its output from the dense output with ``x`` thresholded at ``tx[i]``
    and ``h`` at ``th[j]`` (a negative threshold: dense), over ``norm`` (the squared norm of the residual stream the
    output is added to, so that layers compare); memoised.
    """

    def __init__(self, x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray,
                 tx: Sequence[float], th: Sequence[float], norm: float) -> None:
        self.x, self.wg, self.wu, self.wd = x, w_gate, w_up, w_down
        self.tx, self.th, self.norm = list(tx), list(th), float(norm)
        self._h: dict[int, np.ndarray] = {}
        self._e: dict[tuple[int, int], float] = {}
        self.dense = self._out(self._hidden(-1), -1)

    @staticmethod
    def _cut(v: np.ndarray, t: float) -> np.ndarray:
        return v if t < 0 else np.where(np.abs(v) <= t, np.float32(0), v)

    def _hidden(self, i: int) -> np.ndarray:
        if i not in self._h:
            xs = self._cut(self.x, self.tx[i] if i >= 0 else -1.0)
            if len(self._h) > 2:  # a greedy path moves forward: keep a few
                self._h.pop(next(iter(self._h)))
            g = xs @ self.wg
            self._h[i] = g / (1.0 + np.exp(-g)) * (xs @ self.wu)
        return self._h[i]

    def _out(self, h: np.ndarray, j: int) -> np.ndarray:
        return self._cut(h, self.th[j] if j >= 0 else -1.0) @ self.wd

    def __call__(self, i: int, j: int) -> float:
        """The error with ``x`` at level ``i`` and ``h`` at level ``j``."""
        if (i, j) not in self._e:
            d = self._out(self._hidden(i), j) - self.dense
            self._e[(i, j)] = float(np.square(d, dtype=np.float64).sum()) / self.norm
        return self._e[(i, j)]

    def release(self) -> None:
        """Drop the cached hidden activations (the errors already computed stay)."""
        self._h.clear()


class GreedyPath:
    """One layer's greedy path over level indices ``(i, j)`` of its MLP's ``x`` and ``h`` (TEAL's block-wise greedy).

    ``error(i, j)``: the layer's error with ``x`` at level ``i`` and ``h`` at level ``j`` (:class:`LayerError`); a
    step of ``x`` skips ``x_bytes`` more (``h_bytes`` for ``h``). From (0, 0), each step takes the input whose step
    adds the least error per byte skipped (ties: ``x``). ``points``: ``(i, j, error, bytes skipped)`` so far; the
    path grows on demand (:meth:`at`) up to both inputs' last level.
    """

    def __init__(self, error, x_bytes: float, h_bytes: float, *, levels: int) -> None:
        self.error, self.x_bytes, self.h_bytes, self.levels = error, float(x_bytes), float(h_bytes), int(levels)
        self.points = [(0, 0, float(error(0, 0)), 0.0)]

    def _grow(self, skipped: float) -> None:
        """Step until the path skips ``skipped`` bytes or ends, then drop the error's cached activations."""
        while self.points[-1][3] < skipped - 1e-9 and self.step():
            pass
        getattr(self.error, "release", lambda: None)()

    def step(self) -> bool:
        """Take one more step; False at the end."""
        i, j, e, _ = self.points[-1]
        cands = []
        if i < self.levels - 1:
            ex = float(self.error(i + 1, j))
            cands.append(((ex - e) / self.x_bytes, 0, i + 1, j, ex))
        if j < self.levels - 1:
            eh = float(self.error(i, j + 1))
            cands.append(((eh - e) / self.h_bytes, 1, i, j + 1, eh))
        if not cands:
            return False
        _, _, i, j, e = min(cands)
        self.points.append((i, j, e, i * self.x_bytes + j * self.h_bytes))
        return True

    def full(self) -> list[tuple[int, int, float, float]]:
        """The whole path, to both inputs' last level."""
        self._grow(math.inf)
        return self.points

    def at(self, skipped: float) -> tuple[int, int]:
        """The first point of the path that skips at least ``skipped`` bytes (the last one if none does)."""
        self._grow(skipped)
        return next((p[0], p[1]) for p in self.points if p[3] >= skipped - 1e-9 or p is self.points[-1])


def greedy_paths(layers: Sequence[MlpLayer], runs: Iterable[Sequence[np.ndarray]], samples: dict[str, np.ndarray],
                 levels: Sequence[float]) -> list[GreedyPath]:
    """Each MLP's :class:`GreedyPath` over ``levels`` (evenly spaced from 0), measured on the dense model.

    ``runs``: per window, every layer's ``x`` then the residual stream after every layer's MLP (:func:`residual_after`),
    dense; ``samples``: the sites' ``|v|`` samples (:func:`abs_samples`) the thresholds are quantiles of.
    """
    xs: list[list[np.ndarray]] = [[] for _ in layers]
    norms = np.zeros(len(layers))
    for got in runs:
        for k in range(len(layers)):
            xs[k].append(np.asarray(got[k], np.float32).reshape(-1, got[k].shape[-1]))
            norms[k] += float(np.square(np.asarray(got[len(layers) + k], np.float64)).sum())
    step = levels[1]
    paths = []
    for k, layer in enumerate(layers):
        w = [np.asarray(n.inputs[1].const_value.numpy(), np.float32) for n in (layer.gate, layer.up, layer.down)]
        tx = [float(np.quantile(samples[layer.x.name], lv)) if lv > 0 else -1.0 for lv in levels]
        th = [float(np.quantile(samples[layer.h.name], lv)) if lv > 0 else -1.0 for lv in levels]
        err = LayerError(np.concatenate(xs[k]), *w, tx, th, max(norms[k], 1e-30))
        paths.append(GreedyPath(err, step * (w[0].nbytes + w[1].nbytes), step * w[2].nbytes, levels=len(levels)))
    return paths


def residual_after(down: ir.Node) -> ir.Value | None:
    """The output of the ``Add`` that adds ``down``'s output to the residual stream, if there is one."""
    for use in down.outputs[0].uses():
        if use.node.op_type == "Add":
            return use.node.outputs[0]
    return None


class SparsifyActivationsPass(ir.passes.InPlacePass):
    """Replace each gated MLP's three projections by ``dyncompile.SparseRowsMatMul`` with calibrated thresholds.

    Scope and invariants: the module docstring. ``sparsity`` in [0, 1): the share of each site's entries dropped
    on calibration text (0: threshold 0, only exact zeros dropped; the graph then equals the dense one within
    float round-off). ``budget`` (percent, > 0): the largest sparsity on the 0.05 grid whose held-out perplexity
    increase is within it at ``confidence`` (in [0.5, 1); the module docstring: search half, fixed-sequence walk,
    check half; ``sparsity`` is then ignored). ``calib`` / ``heldout``: token windows (:func:`corpus_windows`);
    ``heldout`` may be empty when no budget is asked (then no quality is recorded); a budget needs held-out windows
    from at least 4 files. ``heldout_files``: each held-out window's file (:func:`corpus_windows` ``files=``), so
    that the halves and the bounds go by file; without it each window counts as its own file.
    ``sites``: ``"mlp"`` (the gated MLPs' three projections) or ``"all"`` (TEAL: every constant-weight projection
    but the LM head, attention's q/k/v and o included; :func:`linear_sites`), one threshold per input value.
    ``allocation``: ``"uniform"`` (every site at the ``sparsity`` quantile) or ``"greedy"`` (each gated MLP skips
    ``sparsity`` of its weight bytes, split between ``x`` and ``h`` by :class:`GreedyPath`; attention sites stay
    uniform; needs each MLP's output added to a residual stream).
    """

    def __init__(self, calib: Sequence[Sequence[int]], heldout: Sequence[Sequence[int]] = (), *,
                 sparsity: float = 0.5, budget: float | None = None, confidence: float = DEFAULT_CONFIDENCE,
                 sites: str = "mlp", allocation: str = "uniform", heldout_files: Sequence[int] | None = None) -> None:
        super().__init__()
        self.calib = [list(w) for w in calib]
        self.heldout = [list(w) for w in heldout]
        self.heldout_files = None if heldout_files is None else [int(f) for f in heldout_files]
        self.sparsity = float(sparsity)
        self.budget = None if budget is None else float(budget)
        self.confidence = float(confidence)
        self.sites = sites
        self.allocation = allocation

    def __repr__(self) -> str:
        what = (f"budget={self.budget}% at confidence {self.confidence}" if self.budget is not None
                else f"sparsity={self.sparsity}")
        return (f"SparsifyActivationsPass({what}, sites={self.sites}, allocation={self.allocation}, "
                f"calib={len(self.calib)} windows, heldout={len(self.heldout)})")

    def _groups(self) -> list[int]:
        """Each held-out window's file (its own index when the files are not known)."""
        return self.heldout_files if self.heldout_files is not None else list(range(len(self.heldout)))

    def requires(self, model: ir.Model) -> None:
        """Refuse bad options or too little text before anything changes.

        A sparsity outside [0, 1), a non-positive budget, a confidence outside [0.5, 1), no calibration text, or a
        budget without held-out windows from 4 files.
        """
        if not 0.0 <= self.sparsity < 1.0:
            raise ir.passes.PreconditionError(f"sparsify-activations sparsity must be in [0, 1), got {self.sparsity}")
        if self.budget is not None and not self.budget > 0:
            raise ir.passes.PreconditionError(f"sparsify-activations budget must be > 0 (percent), got {self.budget}")
        if not 0.5 <= self.confidence < 1.0:
            raise ir.passes.PreconditionError(f"sparsify-activations confidence must be in [0.5, 1), got "
                                              f"{self.confidence}")
        if not self.calib or any(len(w) < 2 for w in self.calib):
            raise ir.passes.PreconditionError("sparsify-activations needs calibration windows of >= 2 tokens")
        if self.heldout_files is not None and len(self.heldout_files) != len(self.heldout):
            raise ir.passes.PreconditionError(f"sparsify-activations got {len(self.heldout_files)} held-out files for "
                                              f"{len(self.heldout)} held-out windows")
        if self.budget is not None:
            search, check = split_halves(self._groups())
            units = [len({self._groups()[i] for i in half}) for half in (search, check)]
            if min(units) < 2:
                raise ir.passes.PreconditionError(
                    "sparsify-activations budget= needs held-out windows from at least 4 files (2 to search the "
                    f"level on, 2 to check it on), got {len(self.heldout)} windows from {sum(units)}; raise "
                    "heldout_tokens")
        if self.sites not in SITES:
            raise ir.passes.PreconditionError(f"sparsify-activations sites must be one of {SITES}, got {self.sites!r}")
        if self.allocation not in ALLOCATIONS:
            raise ir.passes.PreconditionError(f"sparsify-activations allocation must be one of {ALLOCATIONS}, got "
                                              f"{self.allocation!r}")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Rewrite ``model`` in place (scope and invariants: the module docstring)."""
        import dyncompile.runtime.kernels as kernels
        from dyncompile.passes.speculative.decoder_spec import decoder_spec

        if uses_sparse_rows(model):
            return ir.passes.PassResult(model, modified=False)
        layers, why = mlp_layers(model)
        if not layers:
            return not_fired(model, "sparsify-activations", why, "leave sparsify-activations out for this model")
        lib, lib_sha = kernels.library()  # no compiler / header: one clear error before anything changes
        _, lib_meta = kernels.build_library()
        spec = decoder_spec(model, "model", what="model to sparsify")
        sites = linear_sites(model, spec.get("vocab_size"), self.sites)
        names = [site.value.name for site in sites]
        samples = self._calibrate(model, spec, names)
        paths = self._greedy_paths(model, spec, layers, samples) if self.allocation == "greedy" else None
        groups = self._groups()
        dense_nll = _heldout(model, spec, self.heldout)[0] if self.heldout else None
        nodes = self._rewrite(model, sites)
        levels: dict[str, float] = {}

        def apply(s: float) -> list[float]:
            levels.clear()
            levels.update({name: s for name in names})
            for layer, path in zip(layers, paths or (), strict=False):
                i, j = path.at(s * (path.x_bytes + path.h_bytes) / LEVELS[1])
                levels[layer.x.name], levels[layer.h.name] = LEVELS[i], LEVELS[j]
            ts = [float(np.quantile(samples[name], levels[name])) if levels[name] > 0 else 0.0 for name in names]
            for site_nodes, t in zip(nodes, ts, strict=True):
                for node in site_nodes:
                    node.attributes["threshold"] = ir.AttrFloat32("threshold", t)
            return ts

        def increase(part: list[int], nll: np.ndarray, n: np.ndarray) -> Increase:
            return perplexity_increase(nll, dense_nll[part], n, self.confidence, [groups[i] for i in part])

        budget_rec: dict = {}
        quality_part = list(range(len(self.heldout)))
        if self.budget is not None:
            search, check = split_halves(groups)
            search_windows = [self.heldout[i] for i in search]

            def evaluate(s: float) -> Increase:
                apply(s)
                inc = increase(search, *_heldout(model, spec, search_windows)[:2])
                logger.info("sparsify-activations: sparsity %.2f -> search-half perplexity %.3f (%+.2f %%, upper bound "
                            "%+.2f %% at %g %%)", s, inc.perplexity, inc.pct, inc.upper, 100 * self.confidence)
                return inc

            sparsity, searched = fixed_sequence_walk(_GRID, evaluate, self.budget)
            none_within = not searched[0]["accepted"]
            if none_within:
                logger.warning(
                    "sparsify-activations: no sparsity level's upper bound at %g %% is within budget %g %% (the "
                    "smallest, %.2f, is bounded at %+.2f %% on %d search windows); the graph skips only exact zeros "
                    "(sparsity 0.0). A larger budget, more held-out text (heldout_tokens) or a lower confidence "
                    "would let a level pass", 100 * self.confidence, self.budget, _GRID[0],
                    searched[0]["upper_pct"] if searched[0]["upper_pct"] is not None else math.inf, len(search))
            budget_rec = {"budget_pct": self.budget,
                          "bound": "one-sided Student t over held-out "
                                   f"{'files' if self.heldout_files is not None else 'windows'} of the per-token NLL "
                                   "log-ratio, paired by window",
                          "search": {"windows": len(search), "tokens": sum(len(self.heldout[i]) for i in search),
                                     "files": len({groups[i] for i in search})},
                          "searched": searched, "none_within_budget": none_within}
            quality_part = check
        else:
            sparsity = self.sparsity
        ts = apply(sparsity)
        by_kind = {kind: [j for j, site in enumerate(sites) if site.kind == kind] for kind in ("gate_up", "down",
                                                                                                  "attention")}
        quality, achieved, inc = None, None, None
        if self.heldout:
            nll, n, below = _heldout(model, spec, [self.heldout[i] for i in quality_part], names, ts)
            inc = increase(quality_part, nll, n)
            tokens = sum(len(self.heldout[i]) for i in quality_part)
            quality = {"part": "check" if self.budget is not None else "all",
                       "heldout_windows": inc.windows, "heldout_tokens": tokens,
                       "perplexity_dense": round(inc.perplexity_dense, 4), "perplexity": round(inc.perplexity, 4),
                       "increase_pct": round(inc.pct, 3), "interval": inc.interval()}
            achieved = {kind: round(float(np.mean([b for b, site in zip(below, sites, strict=True)
                                                     if site.kind == kind])), 4)
                        for kind in ("gate_up", "down", "attention") if any(site.kind == kind for site in sites)}
            if self.budget is not None:
                holds = inc.pct <= self.budget
                budget_rec["check"] = {"windows": inc.windows, "tokens": tokens,
                                       "files": len({groups[i] for i in quality_part}),
                                       "increase_pct": round(inc.pct, 3), "interval": inc.interval(),
                                       "holds": bool(holds)}
                if not holds:
                    logger.warning(
                        "sparsify-activations: the budget did not hold on the check half: sparsity %.2f, chosen on "
                        "the search half within %g %% at %g %% confidence, raises the perplexity of %d held-out windows "
                        "it never saw by %+.2f %% [%+.2f, %+.2f]; the promise failed on unseen text (a lower budget or "
                        "more held-out text buys margin)", sparsity, self.budget, 100 * self.confidence, inc.windows,
                        inc.pct, inc.lo, inc.hi)
        record = {
            "op": f"{kernels.DOMAIN}.{kernels.OP_TYPE}",
            "sparsity": sparsity,
            "mode": "budget" if self.budget is not None else "sparsity",
            **({"confidence": self.confidence} if self.heldout else {}),
            **budget_rec,
            "sites": self.sites,
            "allocation": self.allocation,
            "layers": [{"layer": i, "gate_up": {"threshold": ts[g], "rows": _rows(nodes[g][0]), "level": levels[names[g]]},
                        "down": {"threshold": ts[d], "rows": _rows(nodes[d][0]), "level": levels[names[d]]}}
                       for i, (g, d) in enumerate(zip(by_kind["gate_up"], by_kind["down"], strict=True))],
            **({"attention": [{"threshold": ts[j], "rows": _rows(nodes[j][0]), "matmuls": len(nodes[j])}
                              for j in by_kind["attention"]]} if by_kind["attention"] else {}),
            "achieved_sparsity_heldout": achieved,
            "quality": quality,
            "calibration": {"windows": len(self.calib), "tokens": sum(len(w) for w in self.calib),
                            "method": "per-site quantile of |activation| (TEAL)"},
            "library": {"file": lib.name, "sha256": lib_sha, "flags": lib_meta.get("flags"),
                        "compile_seconds": lib_meta.get("compile_seconds"), "source_sha256": lib_meta.get("source_sha256")},
        }
        model.metadata_props[SPARSITY] = json.dumps(record)  # the compiler copies it to the plan's policy
        logger.info("sparsify-activations: %d MLPs%s, sparsity %.2f (%s)%s", len(layers),
                    f" and {len(by_kind['attention'])} attention inputs" if by_kind["attention"] else "", sparsity,
                    self.allocation,
                    f", {'check-half' if self.budget is not None else 'held-out'} perplexity "
                    f"{inc.pct:+.2f} % [{inc.lo:+.2f}, {inc.hi:+.2f}] at {100 * self.confidence:g} %" if inc else "")
        return ir.passes.PassResult(model, modified=True)

    def _greedy_paths(self, model: ir.Model, spec, layers: list[MlpLayer],
                      samples: dict[str, np.ndarray]) -> list[GreedyPath]:
        """Each MLP's :class:`GreedyPath` from its dense inputs on the first calibration tokens (dense model)."""
        residuals = [residual_after(layer.down) for layer in layers]
        if any(r is None for r in residuals):
            raise ir.passes.PreconditionError(
                "sparsify-activations allocation=greedy compares layers by the residual stream each MLP's output is "
                "added to, but an MLP output here feeds no Add; use allocation=uniform")
        outs = [*(layer.x.name for layer in layers), *(r.name for r in residuals)]
        sess = _session(model, outs)
        windows, seen = [], 0
        for w in self.calib:
            if seen >= _ERROR_TOKENS:
                break
            windows.append(w)
            seen += len(w)
        return greedy_paths(layers, (_run(sess, spec, w, outs) for w in windows), samples, LEVELS)

    def _calibrate(self, model: ir.Model, spec, sites: list[str]) -> dict[str, np.ndarray]:
        """A random sample of ``|v|`` per site over the calibration windows (dense model)."""
        sess = _session(model, sites)
        return abs_samples((_run(sess, spec, w, sites) for w in self.calib), sites)

    @staticmethod
    def _rewrite(model: ir.Model, sites: list[Site]) -> list[list[ir.Node]]:
        """Swap each site's projections for the custom op (threshold 0 for now); the new nodes, per site."""
        from dyncompile.runtime.kernels import DOMAIN, OP_TYPE

        g = model.graph
        model.graph.opset_imports.setdefault(DOMAIN, 1)
        # a target the speculative pass has already seen verifies several rows per call: those keep the kernel's rows
        dense_rows = DENSE_ROWS if _keys.SPECULATIVE in model.metadata_props else PREFILL_ROWS
        new_nodes = []
        for site in sites:
            per_site = []
            for mm in site.consumers:
                node = ir.node(OP_TYPE, list(mm.inputs), {"threshold": 0.0, "dense_rows": dense_rows}, domain=DOMAIN,
                               name=f"{mm.name or mm.outputs[0].name}/sparse_rows")
                g.insert_before(mm, node)
                replace_node_output(g, mm, mm.outputs[0], node.outputs[0])
                per_site.append(node)
            new_nodes.append(per_site)
        return new_nodes


def _rows(node: ir.Node) -> int:
    return int(node.inputs[1].const_value.shape[0])


@register_pass(
    "sparsify-activations",
    help="contextual sparsity (TEAL): each gated MLP projection skips the weight rows whose input activation is "
    "below a per-layer threshold (dyncompile.SparseRowsMatMul, a custom ORT op compiled at first use); options "
    "sparsity=0.5 (share dropped on calibration text) or budget=P (largest sparsity whose held-out perplexity "
    "increase is within P % at the confidence: the 0.05 grid walked upward on half the held-out files, a level kept "
    "while its one-sided t upper bound is within P, the first failure ends the walk; the other half, never used to "
    "choose, reports the increase with its interval and whether the budget held there), confidence=0.9 (of the "
    "bound and the intervals, in [0.5, 1)), sites=mlp|all (all: attention's projections too, TEAL), "
    "allocation=uniform|greedy (greedy: each MLP splits its share between its two inputs by TEAL's block-wise greedy "
    "search), calib_tokens=4096, heldout_tokens=4096 (8192 with budget=: about 9 files a half instead of 4-5, so the "
    "bound is tighter), window=256",
    before=("explicit-attention", "fuse-decoder", "pack-matmuls", "trim-logits", "matmul-to-conv", "speculative",
            "split-drafter", "eagle-drafter", "quantize-int8", "quantize-int4"),
)
def _make_sparsify(context, sparsity: float = 0.5, budget: float | None = None, confidence: float = DEFAULT_CONFIDENCE,
                   calib_tokens: int = 4096, heldout_tokens: int | None = None, window: int = 256, sites: str = "mlp",
                   allocation: str = "uniform"):
    from dyncompile.errors import PassConfigError

    if heldout_tokens is None:  # a budget's bound counts files, and each half gets half of them
        heldout_tokens = HELDOUT_TOKENS_BUDGET if budget is not None else HELDOUT_TOKENS
    if not 0.0 <= sparsity < 1.0:
        raise PassConfigError(f"sparsify-activations sparsity must be in [0, 1), got {sparsity}")
    if budget is not None and not budget > 0:
        raise PassConfigError(f"sparsify-activations budget must be > 0 (percent perplexity increase), got {budget}")
    if not 0.5 <= confidence < 1.0:
        raise PassConfigError(f"sparsify-activations confidence must be in [0.5, 1) (e.g. 0.9), got {confidence}")
    if window < 8 or calib_tokens < window or heldout_tokens < window:
        raise PassConfigError(f"sparsify-activations needs window >= 8 and calib_tokens, heldout_tokens >= window "
                              f"(got window={window}, calib_tokens={calib_tokens}, heldout_tokens={heldout_tokens})")
    if sites not in SITES:
        raise PassConfigError(f"sparsify-activations sites must be one of {', '.join(SITES)}, got {sites!r}")
    if allocation not in ALLOCATIONS:
        raise PassConfigError(f"sparsify-activations allocation must be one of {', '.join(ALLOCATIONS)}, got "
                              f"{allocation!r}")
    tok = context.require_tokenizer("sparsity calibration on standard-library text")
    calib = corpus_windows(tok, tokens=calib_tokens, window=window, part="calib")
    files: list[int] = []
    held = corpus_windows(tok, tokens=heldout_tokens, window=window, part="heldout", files=files)
    return SparsifyActivationsPass(calib, held, sparsity=sparsity, budget=budget, confidence=confidence, sites=sites,
                                   allocation=allocation, heldout_files=files)
