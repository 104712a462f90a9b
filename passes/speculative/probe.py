"""Measure decoders in ONNX Runtime on this machine: the costs the speculative passes put into a plan.

* :func:`session_for` — a CPU session on an in-memory ``ir.Model`` (external weights found where they are);
* :func:`prefill_feeds` — batch-1 feeds for some tokens on an empty or given cache;
* :func:`measure_step_rounds` / :func:`fastest_times` / :func:`measure_step_times` / :func:`relative_verify_costs` /
  :func:`measure_verify_costs` — seconds of a call with ``s`` new tokens on a cache (each round, or the fastest),
  and the cost of verifying ``s`` tokens relative to one (the median of paired ratios within rounds);
* :func:`target_verify_costs` / :func:`drafter_step_seconds` — the same probe for a target and a drafter;
* :func:`weight_reads` — bytes of weights a decode step reads (the drafter cost when nothing is timed);
* :func:`row_invariance` / :func:`target_min_rows` — whether a row's logits depend on the number of rows in a
  call once every call is padded to ``min_rows`` rows (the ``min_rows`` of an int8-compute int4 target).

The cost model these numbers feed is :mod:`dyncompile.runtime.rules.cost_model`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from dyncompile.errors import PassConfigError
from dyncompile.io import external_data_dirs
from dyncompile.passes import _infra
from dyncompile.passes.speculative.decoder_spec import decoder_spec

logger = logging.getLogger(__name__)

__all__ = [
    "drafter_step_seconds",
    "fastest_times",
    "measure_step_rounds",
    "measure_step_times",
    "measure_verify_costs",
    "prefill_feeds",
    "probe_chunk",
    "relative_verify_costs",
    "row_invariance",
    "session_for",
    "target_min_rows",
    "target_verify_costs",
    "weight_reads",
]

EXTERNAL_DIR_KEY = "session.model_external_initializers_file_folder_path"
#: integer dtypes of packed quantized weights (MatMulNBits, MatMulInteger) counted by :func:`weight_reads`
_PACKED_WEIGHT_DTYPES = (ir.DataType.UINT8, ir.DataType.INT8, ir.DataType.UINT4, ir.DataType.INT4)


def session_for(model: ir.Model, threads: int | None = None):
    """An ORT CPU session on ``model`` as it is in memory (``threads``: intra-op threads; ORT's default: every core).

    Weights stored as external data are read from the folder they were loaded from. A model holding more rewritten weights than one protobuf message can carry
    (past 2 GB, e.g. ``pack-matmuls`` on a 1.5B decoder) is written to a temporary folder (external data) and
    opened from there; the folder goes once the session holds the weights.
    """
    import tempfile

    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = int(threads)
    import dyncompile.runtime.kernels as kernels

    if any(n.domain == kernels.DOMAIN for n in model.graph):  # sparsify-activations: dyncompile's own custom op
        kernels.register(so, *kernels.library())
    in_memory = _infra.in_memory_weight_bytes(model)
    if in_memory > _infra.PROTO_LIMIT:
        logger.info("cost probe: %.1f GB of rewritten weights in memory: opening the model through a temporary "
                    "external-data file", in_memory / 1e9)
        with tempfile.TemporaryDirectory(prefix="dyncompile-probe-", ignore_cleanup_errors=True) as tmp:
            path = f"{tmp}/probe.onnx"
            try:
                ir.save(model, path, external_data="probe.onnx.data")
            except OSError as e:
                raise PassConfigError(
                    f"the model holds {in_memory / 1e9:.1f} GB of weights in memory (rewritten by an earlier pass "
                    "such as pack-matmuls), past protobuf's 2 GB limit, and writing them to a temporary folder for "
                    f"the speculative pass's cost probe failed ({e.strerror or e}); free space under "
                    f"{tempfile.gettempdir()} (or set TMPDIR), or compile with speculative{{measure=false}}"
                ) from None
            return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    dirs = external_data_dirs(model)
    if dirs:
        so.add_session_config_entry(EXTERNAL_DIR_KEY, min(dirs))
    data = ir.to_proto(model).SerializeToString()
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])


def prefill_feeds(spec: dict[str, Any], ids: Sequence[int], past=None, past_len: int = 0) -> dict[str, np.ndarray]:
    """Feeds of a decoder (``spec`` from :func:`decoder_spec`) for the tokens ``ids``.

    On top of ``past`` (the present tensors of an earlier call holding ``past_len`` tokens) or on an empty cache.
    """
    n = len(ids)
    feeds = {spec["input_ids"]: np.asarray([ids], np.int64)}
    if spec.get("logits_to_keep"):  # trim-logits: every row
        feeds[spec["logits_to_keep"]] = np.zeros(1, np.int64)
    if spec.get("attention_mask"):
        feeds[spec["attention_mask"]] = np.ones((1, past_len + n), np.int64)
    if spec.get("attention_bias"):  # causal over past + new (explicit-attention)
        bias = np.zeros((1, 1, n, past_len + n), np.float32)
        bias[0, 0, :, past_len:][np.triu_indices(n, 1)] = np.finfo(np.float32).min
        feeds[spec["attention_bias"]] = bias
    if spec.get("position_ids"):
        feeds[spec["position_ids"]] = np.arange(past_len, past_len + n, dtype=np.int64)[None]
    dt = np.float16 if spec.get("kv_dtype") == "float16" else np.float32
    for i, e in enumerate(spec["kv"]):
        if past is not None:
            feeds[e["past"]] = past[i]
        else:
            dims = list(e["shape"])
            dims.insert(e["axis"] - 1, 0)
            feeds[e["past"]] = np.zeros([1, *dims], dt)
    return feeds


def measure_step_rounds(sess, spec, chunk: Sequence[int], sizes: Sequence[int], repeats: int = 5
                        ) -> list[dict[int, float]]:
    """Seconds for ``s`` new tokens on a cache of ``len(chunk)`` tokens, per round, for each s in ``sizes``.

    Each of ``repeats`` rounds times every size once, smallest first (round-robin).
    """
    names = [spec["logits"], *(e["present"] for e in spec["kv"])]
    outs = sess.run(names, prefill_feeds(spec, list(chunk)))
    past = outs[1:]
    feeds = {
        size: prefill_feeds(spec, [int(chunk[0])] * size, past=past, past_len=len(chunk)) for size in sorted(set(sizes))
    }
    sess.run(names[:1], feeds[min(feeds)])  # warm-up
    rounds = []
    for _ in range(repeats):
        r = {}
        for size, f in feeds.items():
            t0 = time.perf_counter()
            sess.run(names[:1], f)
            r[size] = time.perf_counter() - t0
        rounds.append(r)
    return rounds


def measure_step_times(sess, spec, chunk: Sequence[int], sizes: Sequence[int], repeats: int = 5) -> dict[int, float]:
    """Seconds for ``s`` new tokens on a cache of ``len(chunk)`` tokens, for each s in ``sizes``.

    Sizes are measured round-robin and the minimum over ``repeats`` is kept, so that a burst of load from
    other processes does not make one size look expensive (medians taken size by size did: on a loaded
    2-core machine a 4-token verification once measured 3.4x a single token instead of 1.2x).
    """
    return fastest_times(measure_step_rounds(sess, spec, chunk, sizes, repeats))


def fastest_times(rounds: Sequence[dict[int, float]]) -> dict[int, float]:
    """Each size's fastest call over the rounds of :func:`measure_step_rounds`."""
    return {size: min(r[size] for r in rounds) for size in rounds[0]}


def relative_verify_costs(rounds: Sequence[dict[int, float]]) -> dict[int, float]:
    """The rounds of :func:`measure_step_rounds` -> the cost of verifying ``s`` tokens relative to one.

    The cost of ``s`` is the median over rounds of ``t(s) / t(1)`` within a round: calls of one round run back to
    back, so a machine whose speed drifts (a shared VM's memory bandwidth moved a 1.5B decoder's single-token call
    between 163 and 207 ms within a minute) cancels out of each ratio. Ratios of minimums taken size by size did not
    cancel it: the fastest single-token call and the fastest two-token call may come from different moments, and a
    1.5B probe during a compile read v(2) = 1.27 where paired calls on the same machine gave 1.01-1.06.
    Kept monotone: verifying more tokens never costs less.
    """
    ratio = {s_: float(np.median([r[s_] / r[1] for r in rounds])) for s_ in rounds[0]}
    costs, run = {}, 1.0
    for s_ in sorted(ratio):
        run = costs[s_] = round(max(run, ratio[s_]), 4)
    return costs


def measure_verify_costs(sess, spec, chunk: Sequence[int], max_draft: int = 8, repeats: int = 5) -> dict[int, float]:
    """Target time for ``s`` new tokens on a cache of ``len(chunk)``, relative to one token (s = 1, 2, 4, ...)."""
    return relative_verify_costs(measure_step_rounds(sess, spec, chunk, sorted({1, 2, 4, max_draft + 1}), repeats))


def probe_chunk(spec: dict[str, Any]) -> list[int]:
    """The 128 token ids every cost probe runs as its cache (any ids below the vocabulary size)."""
    return [int(i) % max(2, spec.get("vocab_size") or 2) for i in range(1, 129)]


def target_verify_costs(model: ir.Model, spec: dict[str, Any], sizes: Sequence[int] = (1, 2, 4, 9)
                        ) -> tuple[dict[str, float], float]:
    """Verification cost of s tokens relative to one on this machine, and the seconds of one decode step.

    The costs are the runtime's draft-length model, keyed by ``str(s)`` as the plan stores them. Draft trees measure the
    curve further (``sizes`` up to the largest tree).
    """
    rounds = measure_step_rounds(session_for(model), spec, probe_chunk(spec), sorted({1, *sizes}))
    times, costs = fastest_times(rounds), relative_verify_costs(rounds)
    logger.info("speculative: target step %.1f ms; verification cost by tokens %s", times[1] * 1e3, costs)
    return {str(k): v for k, v in costs.items()}, times[1]


def drafter_step_seconds(drafter: ir.Model, target_spec: dict[str, Any]) -> float:
    """Seconds of one drafter decode step on the same probe as the target's."""
    dspec = decoder_spec(drafter, "drafter", what="drafter")
    t = measure_step_times(session_for(drafter), dspec, probe_chunk(target_spec), [1])[1]
    logger.info("speculative: drafter step %.1f ms", t * 1e3)
    return t


def weight_reads(model: ir.Model) -> int:
    """Bytes of the weight matrices a decode step reads in full.

    Float matrices and the packed integer weights of quantized ops (MatMulNBits, MatMulInteger), so that an int4 drafter is costed at its real
    size; embedding tables read by Gather only are left out.
    """
    total = 0
    for v in model.graph.initializers.values():
        t = v.const_value
        if t is None or len(t.shape) < 2:
            continue
        if not (t.dtype.is_floating_point() or t.dtype in _PACKED_WEIGHT_DTYPES):
            continue
        if v.uses() and all(u.node.op_type == "Gather" and u.idx == 0 for u in v.uses()):
            continue
        total += int(t.nbytes)
    return total


#: the largest |logit difference| between a row computed in a verification call and in its own (padded) call that
#: counts as row-invariant: none (bitwise equal). int8 compute turns any last-bit difference into a possible whole
#: int8 step, so "small" is no guarantee: a tiny int4 decoder with block 128 differs by 7e-7 at its logits, Qwen2.5-
#: Coder-0.5B by 0.97; with block 32 both are bitwise equal in calls of two rows or more
ROW_TOLERANCE = 0.0


def _cut(spec: dict[str, Any], presents: Sequence[np.ndarray], length: int) -> list[np.ndarray]:
    """The present tensors cut to their first ``length`` positions (a padded call's extra rows dropped)."""
    out = []
    for e, a in zip(spec["kv"], presents):
        idx: list[Any] = [slice(None)] * a.ndim
        idx[e["axis"]] = slice(0, length)
        out.append(np.ascontiguousarray(a[tuple(idx)]))
    return out


def row_invariance(sess, spec: dict[str, Any], windows: Sequence[Sequence[int]], prefix: int,
                   min_rows: Sequence[int] = (1, 2), sizes: Sequence[int] = (2, 3, 8)) -> dict[int, float]:
    """Per ``m`` in ``min_rows``: the largest |logit difference| of a row between a verification call and its own call.

    For each window: prefill ``window[:prefix]``, then the next tokens (``max(sizes)``) one call each, every call
    padded to ``m`` rows (the token repeated, the copies' logits and cache slots dropped, as the runtime does), and
    the same tokens in one call of each of ``sizes`` rows on the prefilled cache (the sizes of at least ``m`` rows:
    the runtime pads smaller calls too). 0.0 means bitwise equal.
    """
    names = [spec["logits"], *(e["present"] for e in spec["kv"])]
    worst: dict[int, float] = {m: 0.0 for m in min_rows}
    for w in windows:
        w = [int(t) for t in w]
        past = sess.run(names, prefill_feeds(spec, w[:prefix]))[1:]
        toks = w[prefix : prefix + max(sizes)]
        verify = {s: sess.run(names[:1], prefill_feeds(spec, toks[:s], past=past, past_len=prefix))[0][0]
                  for s in sizes}
        for m in min_rows:
            p, length = past, prefix
            for i, t in enumerate(toks):
                outs = sess.run(names, prefill_feeds(spec, [t] * m, past=p, past_len=length))
                row = outs[0][0][0]
                p, length = _cut(spec, outs[1:], length + 1), length + 1
                for s, v in verify.items():
                    if i < s and s >= m:  # (a call of fewer than m rows is padded too, like the steps)
                        worst[m] = max(worst[m], float(np.abs(np.asarray(v[i], np.float64) - row).max()))
    return worst


def target_min_rows(model: ir.Model, spec: dict[str, Any], candidates: Sequence[int] = (1, 2), windows: int = 2,
                    prefix: int = 16) -> tuple[int | None, dict[int, float]]:
    """The fewest rows per call that make ``model``'s rows row-invariant on this machine, and what was measured.

    ``(None, diffs)`` when no candidate does. A handful of ORT calls on generated token windows (a seeded draw
    from the vocabulary): ``windows`` x (prefill + 3 verification calls + 8 one-token calls per candidate).
    """
    vocab = max(2, int(spec.get("vocab_size") or 1000))
    rng = np.random.default_rng(0)
    wins = [rng.integers(0, min(vocab, 32000), prefix + 8).tolist() for _ in range(windows)]
    sess = session_for(model)
    diffs: dict[int, float] = {}
    for m in sorted(candidates):  # the fewest rows first: stop at the first that is row-invariant
        diffs.update(row_invariance(sess, spec, wins, prefix, (m,)))
        if diffs[m] <= ROW_TOLERANCE:
            return m, diffs
    return None, diffs
