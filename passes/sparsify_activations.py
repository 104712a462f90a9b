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
skips ``sparsity`` of its weight bytes. ``budget=P`` searches the largest sparsity (0.05 grid) whose held-out
perplexity increase stays within ``P`` percent. Calibration text: CPython standard-library ``.py`` files,
minus the benchmarks' prompt files and held-out quality files (:data:`EXCLUDED_FILES`); the held-out perplexity
check runs on other files of the same library, disjoint from the calibration ones.

Scope: main graph of a KV-cache decoder; each ``MatMul(h, W_down)`` with ``h = Mul(SiLU(MatMul(x, W_gate)),
MatMul(x, W_up))`` (SiLU as ``Mul(g, Sigmoid(g))``, either operand order), constant 2-D float32 weights. With
``sites=all`` (TEAL's choice), every other constant-weight float32 ``MatMul`` too (attention's q/k/v, which share one
input and one threshold, and o), the LM head excepted; the pass still needs a gated MLP to fire.
Invariants: graph inputs/outputs, names and every other node unchanged; the weights are the same initializers
(the op reads them in place); with threshold 0 the outputs equal the dense graph's within float round-off.
Records ``dyncompile.sparsity`` (op, thresholds, achieved sparsity, held-out quality, the library's sha256);
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

logger = logging.getLogger(__name__)

__all__ = [
    "ALLOCATIONS",
    "EXCLUDED_FILES",
    "LEVELS",
    "SITES",
    "SPARSITY",
    "GreedyPath",
    "LayerError",
    "MlpLayer",
    "Site",
    "SparsifyActivationsPass",
    "abs_samples",
    "corpus_windows",
    "heldout_stats",
    "linear_sites",
    "greedy_paths",
    "mlp_layers",
    "residual_after",
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
    from dyncompile.runtime.kernels import DOMAIN, OP_TYPE

    return any(n.domain == DOMAIN and n.op_type == OP_TYPE for n in model.graph)


# ----------------------------------------------------------------------------------------------- text


def corpus_windows(tokenizer_json: Path, *, tokens: int, window: int, part: str, root: Path | None = None,
                   seed: int = 0) -> list[list[int]]:
    """Token windows of ``window`` tokens (about ``tokens`` in all) from the stdlib's ``.py`` files.

    The files (sorted, minus :data:`EXCLUDED_FILES` and third-party folders) are shuffled with ``seed`` and cut in
    two: ``part="calib"`` reads the even positions, ``part="heldout"`` the odd ones, so the two never share a file.
    Each file gives at most two windows (the set spans many modules).
    """
    from tokenizers import Tokenizer

    from dyncompile.errors import DataError

    root = Path(root or sysconfig.get_paths()["stdlib"])
    excluded = {root / f for f in EXCLUDED_FILES}
    files = [p for p in sorted(root.rglob("*.py")) if p not in excluded
             and not any(x in ("site-packages", "dist-packages", "test", "tests", "idlelib") for x in
                         p.relative_to(root).parts)]
    if not files:
        raise DataError(f"no standard-library .py files under {root} for the sparsity calibration")
    order = np.random.default_rng(seed).permutation(len(files))
    pick = order[0::2] if part == "calib" else order[1::2]
    tok = Tokenizer.from_file(str(tokenizer_json))
    out: list[list[int]] = []
    for i in pick:
        try:
            text = files[i].read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        ids = tok.encode(text, add_special_tokens=False).ids
        for s in range(0, min(len(ids) - window + 1, 2 * window), window):
            out.append(list(ids[s : s + window]))
        if len(out) * window >= tokens:
            break
    return out[: max(1, math.ceil(tokens / window))]


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


def _ppl(model: ir.Model, spec, windows, sites: Sequence[str] = (), thresholds: Sequence[float] = ()):
    """Perplexity of ``windows`` under ``model`` and, per site, the share of ``|v| <= threshold`` entries."""
    sess = _session(model, sites)
    names = [spec["logits"], *sites]
    ppl, below, _, _ = heldout_stats(((w, _run(sess, spec, w, names)) for w in windows), thresholds)
    return ppl, below.tolist()



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
    float round-off). ``budget`` (percent, > 0): search the largest sparsity on the 0.05 grid whose held-out
    perplexity increase is within it (``sparsity`` is then ignored). ``calib`` / ``heldout``: token windows
    (:func:`corpus_windows`); ``heldout`` may be empty when no budget is asked (then no quality is recorded).
    ``sites``: ``"mlp"`` (the gated MLPs' three projections) or ``"all"`` (TEAL: every constant-weight projection
    but the LM head, attention's q/k/v and o included; :func:`linear_sites`), one threshold per input value.
    ``allocation``: ``"uniform"`` (every site at the ``sparsity`` quantile) or ``"greedy"`` (each gated MLP skips
    ``sparsity`` of its weight bytes, split between ``x`` and ``h`` by :class:`GreedyPath`; attention sites stay
    uniform; needs each MLP's output added to a residual stream).
    """

    def __init__(self, calib: Sequence[Sequence[int]], heldout: Sequence[Sequence[int]] = (), *,
                 sparsity: float = 0.5, budget: float | None = None, sites: str = "mlp",
                 allocation: str = "uniform") -> None:
        super().__init__()
        self.calib = [list(w) for w in calib]
        self.heldout = [list(w) for w in heldout]
        self.sparsity = float(sparsity)
        self.budget = None if budget is None else float(budget)
        self.sites = sites
        self.allocation = allocation

    def __repr__(self) -> str:
        what = f"budget={self.budget}%" if self.budget is not None else f"sparsity={self.sparsity}"
        return (f"SparsifyActivationsPass({what}, sites={self.sites}, allocation={self.allocation}, "
                f"calib={len(self.calib)} windows, heldout={len(self.heldout)})")

    def requires(self, model: ir.Model) -> None:
        """Refuse a sparsity outside [0, 1), a non-positive budget, or no text, before anything changes."""
        if not 0.0 <= self.sparsity < 1.0:
            raise ir.passes.PreconditionError(f"sparsify-activations sparsity must be in [0, 1), got {self.sparsity}")
        if self.budget is not None and not self.budget > 0:
            raise ir.passes.PreconditionError(f"sparsify-activations budget must be > 0 (percent), got {self.budget}")
        if not self.calib or any(len(w) < 2 for w in self.calib):
            raise ir.passes.PreconditionError("sparsify-activations needs calibration windows of >= 2 tokens")
        if self.budget is not None and not self.heldout:
            raise ir.passes.PreconditionError("sparsify-activations budget= needs held-out windows")
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
        dense_ppl = _ppl(model, spec, self.heldout)[0] if self.heldout else None
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

        searched = []
        if self.budget is not None:
            lo, hi, best = 0, len(_GRID) - 1, 0.0
            while lo <= hi:  # perplexity grows with sparsity: bisect the grid
                mid = (lo + hi) // 2
                s = _GRID[mid]
                apply(s)
                p = _ppl(model, spec, self.heldout)[0]
                inc = 100.0 * (p / dense_ppl - 1.0)
                searched.append({"sparsity": s, "perplexity": round(p, 4), "increase_pct": round(inc, 3)})
                logger.info("sparsify-activations: sparsity %.2f -> held-out perplexity %.3f (+%.2f %%)", s, p, inc)
                if inc <= self.budget:
                    best, lo = s, mid + 1
                else:
                    hi = mid - 1
            sparsity = best
        else:
            sparsity = self.sparsity
        ts = apply(sparsity)
        by_kind = {kind: [j for j, site in enumerate(sites) if site.kind == kind] for kind in ("gate_up", "down",
                                                                                                  "attention")}
        quality, achieved = None, None
        if self.heldout:
            p, below = _ppl(model, spec, self.heldout, names, ts)
            quality = {"heldout_windows": len(self.heldout), "heldout_tokens": sum(len(w) for w in self.heldout),
                       "perplexity_dense": round(dense_ppl, 4), "perplexity": round(p, 4),
                       "increase_pct": round(100.0 * (p / dense_ppl - 1.0), 3)}
            achieved = {kind: round(float(np.mean([b for b, site in zip(below, sites, strict=True)
                                                     if site.kind == kind])), 4)
                        for kind in ("gate_up", "down", "attention") if any(site.kind == kind for site in sites)}
        record = {
            "op": f"{kernels.DOMAIN}.{kernels.OP_TYPE}",
            "sparsity": sparsity,
            "mode": "budget" if self.budget is not None else "sparsity",
            **({"budget_pct": self.budget, "searched": searched} if self.budget is not None else {}),
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
                    f", held-out perplexity +{quality['increase_pct']:.2f} %" if quality else "")
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
        new_nodes = []
        for site in sites:
            per_site = []
            for mm in site.consumers:
                node = ir.node(OP_TYPE, list(mm.inputs), {"threshold": 0.0}, domain=DOMAIN,
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
    "sparsity=0.5 (share dropped on calibration text) or budget=P (largest sparsity within P %% held-out perplexity "
    "increase), sites=mlp|all (all: attention's projections too, TEAL), allocation=uniform|greedy (greedy: each MLP "
    "splits its share between its two inputs by TEAL's block-wise greedy search), calib_tokens=4096, "
    "heldout_tokens=4096, window=256",
    before=("explicit-attention", "fuse-decoder", "pack-matmuls", "trim-logits", "matmul-to-conv", "speculative",
            "split-drafter", "eagle-drafter", "quantize-int8", "quantize-int4"),
)
def _make_sparsify(context, sparsity: float = 0.5, budget: float | None = None, calib_tokens: int = 4096,
                   heldout_tokens: int = 4096, window: int = 256, sites: str = "mlp", allocation: str = "uniform"):
    from dyncompile.errors import PassConfigError

    if not 0.0 <= sparsity < 1.0:
        raise PassConfigError(f"sparsify-activations sparsity must be in [0, 1), got {sparsity}")
    if budget is not None and not budget > 0:
        raise PassConfigError(f"sparsify-activations budget must be > 0 (percent perplexity increase), got {budget}")
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
    held = corpus_windows(tok, tokens=heldout_tokens, window=window, part="heldout")
    return SparsifyActivationsPass(calib, held, sparsity=sparsity, budget=budget, sites=sites, allocation=allocation)
