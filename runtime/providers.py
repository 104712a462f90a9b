"""Execution providers by short name, and detection of clashing ONNX Runtime flavours.

``cpu``, ``openvino``, ``cuda``, ``directml`` map to ONNX Runtime providers and default options. The four
ORT flavours (``onnxruntime``, ``onnxruntime-openvino``, ``onnxruntime-gpu``, ``onnxruntime-directml``)
ship the same ``onnxruntime`` module and silently break each other when two are installed; we detect
that and say how to fix it.

:func:`slow_cpu_fusions` measures, once per process, whether one of ONNX Runtime's own CPU graph fusions makes
this ONNX Runtime slower (``SkipLayerNormalization``: ~3-7x slower than the ``Add`` + ``LayerNormalization`` it
replaces in onnxruntime 1.32, faster in 1.24); a compiled classifier plan records the answer in
``policy.ort_session`` and the runtime's CPU sessions switch those fusions off.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata as md
import logging
import time
from collections.abc import Sequence
from typing import Any

from dyncompile.errors import ProviderError

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_SESSION_CONFIG",
    "NO_SPINNING_SESSION_CONFIG",
    "PROVIDERS",
    "ProviderInfo",
    "installed_ort_flavours",
    "check_ort_flavours",
    "resolve_provider",
    "session_config_entries",
    "MEMORY_MODES",
    "ENCODER_TASKS",
    "session_memory_options",
    "slow_cpu_fusions",
    "calibration_disabled_optimizers",
    "calibration_session",
    "fusion_is_slow",
    "OPTIONAL_CPU_FUSIONS",
]

#: ORT session config entries every session of ``dyncompile.load`` gets unless the caller overrides them:
#: intra-op threads spin while a ``Run`` is in progress and stop when it returns (``force_spinning_stop``), so the
#: idle sessions of a plan (target and drafter alternate in one process) take no core. Decoding measured about
#: 1.05-1.1x faster than with spinning off when the process has its cores to itself, and about 0.85x under two
#: competing busy processes (bench-results/peers/): ``dyncompile.load(..., spinning=False)``
#: (:data:`NO_SPINNING_SESSION_CONFIG`) is for a machine whose cores are oversubscribed. ORT's plain spinning
#: (without the stop) is much slower for plans of several sessions: the idle ones spin against the running one.
DEFAULT_SESSION_CONFIG: dict[str, str] = {"session.intra_op.allow_spinning": "1", "session.force_spinning_stop": "1"}

#: ``dyncompile.load(..., spinning=False)`` / ``dyncompile run --no-spinning``: threads wait without spinning
NO_SPINNING_SESSION_CONFIG: dict[str, str] = {"session.intra_op.allow_spinning": "0"}


def session_config_entries(spinning: bool = True, overrides: dict[str, str] | None = None) -> dict[str, str]:
    """The ORT session config entries of the sessions ``dyncompile.load`` creates.

    Benches and cost measurements use the same ones.

    Args:
        spinning: ``False`` adds :data:`NO_SPINNING_SESSION_CONFIG` (threads wait without spinning).
        overrides: entries over the defaults (``dyncompile.load(..., session_config=...)``).
    """
    return {**DEFAULT_SESSION_CONFIG, **({} if spinning else NO_SPINNING_SESSION_CONFIG), **(overrides or {})}


#: how a session allocates its tensors (``dyncompile.load(..., memory=...)``, ``dyncompile run --memory``)
MEMORY_MODES: dict[str, str] = {
    "auto": "no arena and no memory pattern for a CPU classifier plan with If exits (batch 1); else ORT's defaults",
    "arena": "ONNX Runtime's defaults: the CPU memory arena and a memory pattern per input shape",
    "malloc": "no arena and no memory pattern: every tensor from the system allocator",
}

#: plan tasks whose CPU sessions :func:`session_memory_options` tunes (encoders: one call per text, lengths vary)
ENCODER_TASKS = ("text-classification", "sentence-embedding", "feature-extraction")


def session_memory_options(mode: str, task: str, ort_provider: str, lowering: str | None) -> dict[str, bool]:
    """``SessionOptions`` attributes for a plan's sessions: ``enable_mem_pattern`` / ``enable_cpu_mem_arena``.

    ``auto`` changes ONNX Runtime's defaults for one kind of plan only: an encoder plan (:data:`ENCODER_TASKS`) on
    the CPU EP whose early exits are lowered to ``If`` nodes, the batch-1 latency form the compile picks when no
    larger batch is declared. Its sessions run without the CPU memory arena and without a memory pattern (ORT plans
    one per input shape; text lengths make nearly every call a new shape). Measured with onnxruntime 1.32, 2
    threads, all 1,500 movie-test rows (``bench-results/quantized-certified``, round 15): row by row after the fp32
    model (cold caches) MPNet-base int8 x exits 1.01-1.03x by total time in three runs, MiniLM-L6 1.05x; warm
    (blocks of 25 rows) 0.99x and 1.01x. The answers are the same either way (tested). Everything else keeps
    ORT's defaults: at batch 4 and 32 the arena is faster (0.92x and 0.81-0.83x without it), and without exits the
    memory pattern alone measured 0.97-0.99x (MPNet-base int8). The runtime runs an ``If`` plan's calls of several
    rows in an extra session with ORT's defaults (``RuntimeContext.session``); ``memory="arena"`` keeps one session.

    ``arena`` is ORT's defaults (nothing set), ``malloc`` both off, for any plan.
    """
    if mode not in MEMORY_MODES:
        raise ProviderError(f"memory must be one of {', '.join(MEMORY_MODES)}, got {mode!r}")
    if mode == "malloc" or (mode == "auto" and task in ENCODER_TASKS and ort_provider == "CPUExecutionProvider"
                            and lowering == "if"):
        return {"enable_mem_pattern": False, "enable_cpu_mem_arena": False}
    return {}


@dataclasses.dataclass(frozen=True)
class ProviderInfo:
    """One execution provider: names, how to install it, default options and what the lowering may assume."""

    short: str
    ort_name: str
    extra: str  # pip extra of dyncompile that installs it
    distribution: str
    default_options: dict[str, Any]
    # capabilities the EP-aware lowering reads
    runs_if_on_device: bool
    dynamic_shapes_safe: bool
    platforms: str


PROVIDERS: dict[str, ProviderInfo] = {
    "cpu": ProviderInfo("cpu", "CPUExecutionProvider", "cpu", "onnxruntime", {}, True, True, "any"),
    "openvino": ProviderInfo(
        "openvino",
        "OpenVINOExecutionProvider",
        "openvino",
        "onnxruntime-openvino",
        {"device_type": "CPU", "precision": "FP32"},
        True,
        False,  # If with symbolic dims can return the wrong branch in OpenVINO < 2026.2
        "linux/windows x86_64",
    ),
    # use_tf32=0: TF32 matmuls (ORT's default on Ampere+) shift batched hidden states by ~1e-1 on BERT-class
    # models, enough to flip fitted exit heads (seen on the H200: staged batch-32 accuracy 85 -> 73 %). Fidelity first.
    "cuda": ProviderInfo(
        "cuda", "CUDAExecutionProvider", "cuda", "onnxruntime-gpu", {"use_tf32": "0"}, False, True, "linux/windows x86_64"
    ),
    "directml": ProviderInfo(
        "directml", "DmlExecutionProvider", "directml", "onnxruntime-directml", {}, False, True, "windows x86_64"
    ),
}
ORT_DISTRIBUTIONS = ("onnxruntime", "onnxruntime-openvino", "onnxruntime-gpu", "onnxruntime-directml")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags Linux reports (``/proc/cpuinfo``); empty where it reports none."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def int8_pairs_saturate() -> bool:
    """Whether ONNX Runtime's u8 x s8 int8 kernels saturate on this CPU.

    An x86-64 CPU without VNNI (AVX2, or AVX-512 without VNNI) adds each pair of u8 x s8 products in int16 with saturation (``vpmaddubsw``), so a pair
    past 32,767 (an outlier activation times large 8-bit weights) is clipped; with VNNI (``vpdpbusd``) it is not.
    7-bit weights (``quantize-int8{reduce_range=true}``) keep every pair in range. False where the flags are unknown.
    """
    import platform

    flags = cpu_flags()
    return bool(flags) and platform.machine() in ("x86_64", "AMD64") and not (
        {"avx512_vnni", "avx_vnni", "amx_int8"} & flags)


#: the passes (as ``provenance.passes`` records them) whose int8 MatMuls run u8 activations x s8 weights in ORT
_U8S8_PASSES = ("QuantizeDynamicInt8Pass(", "QuantizeDynamicInt8PerTokenPass(", "QuantizeDynamicInt8MixedPass(",
                "QuantizeStaticInt8Pass(", "QuantizeMixedInt4Pass(", "SearchInt8FallbackPass(")


def warn_if_int8_saturates(plan_passes: Sequence[str], ort_provider: str) -> bool:
    """Log one warning where a plan with full-range int8 weights runs on a CPU whose int8 kernels saturate.

    ``plan_passes``: the plan's ``provenance.passes`` (the passes' reprs). True when it warned.
    """
    if ort_provider != "CPUExecutionProvider" or not int8_pairs_saturate():
        return False
    full = [p for p in plan_passes if p.startswith(_U8S8_PASSES) and "reduce_range=True" not in p]
    if not full:
        return False
    logger.warning(
        "this plan's int8 MatMuls (%s) use 8-bit weights, and this CPU has no VNNI: ONNX Runtime's int8 kernels here "
        "add pairs of u8 x s8 products in int16 with saturation, so outputs can differ from those of a CPU with VNNI "
        "(a quality promise certified on another machine was not measured with these kernels). Recompile on this "
        "machine (quantize-int8's default reduce_range=auto picks 7-bit weights here), or anywhere with "
        "quantize-int8{reduce_range=true} (7-bit weights, no saturation)", full[0].split("(")[0])
    return True


def installed_ort_flavours() -> list[str]:
    """ONNX Runtime distributions installed side by side in one site-packages (should be at most one).

    Flavours in different directories (e.g. a GPU build put first on ``PYTHONPATH`` over a system CPU
    build) do not clobber each other's files, so only same-directory installs count as a clash.
    """
    by_dir: dict[str, list[str]] = {}
    for dist in ORT_DISTRIBUTIONS:
        try:
            d = md.distribution(dist)
        except md.PackageNotFoundError:
            continue
        by_dir.setdefault(str(d.locate_file("")), []).append(dist)
    if not by_dir:
        return []
    return max(by_dir.values(), key=len)


def check_ort_flavours(flavours: Sequence[str] | None = None) -> None:
    """Raise :class:`ProviderError` if two ORT flavours are installed in this environment."""
    flavours = installed_ort_flavours() if flavours is None else list(flavours)
    if len(flavours) > 1:
        raise ProviderError(
            f"two ONNX Runtime flavours are installed at once ({', '.join(flavours)}); they ship the same "
            "`onnxruntime` module and break each other. Keep one per environment: e.g. "
            f"`pip uninstall -y {' '.join(flavours)} && pip install 'dyncompile[cpu]'` (or [openvino], [cuda], [directml])"
        )
    if not flavours:
        raise ProviderError(
            "ONNX Runtime is not installed; install one flavour: pip install 'dyncompile[cpu]' "
            "(or [openvino], [cuda], [directml])"
        )


def resolve_provider(
    name: str,
    *,
    available: Sequence[str] | None = None,
    fallback: str | None = None,
    options: dict[str, Any] | None = None,
) -> list[tuple[str, dict[str, Any]]]:
    """Map a short provider name to ORT's ``providers=`` list (with the CPU EP as the final fallback).

    Args:
        name: ``cpu``, ``openvino``, ``cuda`` or ``directml`` (or a full ORT provider name).
        available: the providers ORT offers (``onnxruntime.get_available_providers()`` by default);
            tests pass a simulated list.
        fallback: short name to use instead, with a warning, when ``name`` is not available.
        options: provider options overriding the defaults.

    Raises:
        ProviderError: unknown name, or not available and no fallback.
    """
    by_ort = {p.ort_name: p for p in PROVIDERS.values()}
    info = PROVIDERS.get(name.lower()) or by_ort.get(name)
    if info is None:
        raise ProviderError(f"unknown provider {name!r}; choose one of: {', '.join(PROVIDERS)}")
    if available is None:
        import onnxruntime as ort

        available = ort.get_available_providers()
    if info.ort_name not in available:
        have = [p.short for p in PROVIDERS.values() if p.ort_name in available]
        msg = (
            f"execution provider {info.short!r} ({info.ort_name}) is not available in this environment; "
            f"available: {', '.join(have) or 'none'} ({', '.join(available)}). Install it in a separate "
            f"environment with `pip install 'dyncompile[{info.extra}]'` (platforms: {info.platforms}), "
            "or pass --fallback cpu to run on the CPU instead"
        )
        if fallback is None:
            raise ProviderError(msg)
        logger.warning("%s — falling back to %r", msg.split(";")[0], fallback)
        return resolve_provider(fallback, available=available, fallback=None, options=None)
    opts = {**info.default_options, **(options or {})}
    providers: list[tuple[str, dict[str, Any]]] = [(info.ort_name, opts)]
    if info.ort_name != "CPUExecutionProvider":
        providers.append(("CPUExecutionProvider", {}))
    return providers


#: ORT graph fusions a plan may switch off in its CPU EP sessions (``policy.ort_session.disabled_optimizers``), each
#: with the pattern it fuses: ``(fused op, its inputs)`` vs the unfused nodes ``(op, inputs)`` it replaces.
OPTIONAL_CPU_FUSIONS: dict[str, str] = {
    "SkipLayerNormFusion": "Add + LayerNormalization -> com.microsoft.SkipLayerNormalization",
}

#: a fusion is switched off when its fused kernel takes at least this many times the unfused nodes' time
SLOW_FUSION_RATIO = 1.5


def fusion_is_slow(fused_us: float, unfused_us: float, ratio: float = SLOW_FUSION_RATIO) -> bool:
    """Whether a fused kernel timed at ``fused_us`` is slow enough against ``unfused_us`` to switch off."""
    return fused_us >= ratio * unfused_us


def _skip_layer_norm_models(hidden: int) -> tuple[bytes, bytes]:
    """Two models over ``x, skip: [1, tokens, hidden]``: fused SkipLayerNormalization, and the Add + LN it replaces."""
    import numpy as np
    import onnx_ir as ir

    out = []
    for fused in (True, False):
        rng = np.random.default_rng(0)
        x, skip = (ir.Value(name=n, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, "tokens", hidden]))
                   for n in ("x", "skip"))
        gamma, beta = (ir.Value(name=n, const_value=ir.tensor(rng.standard_normal(hidden).astype(np.float32)))
                       for n in ("gamma", "beta"))
        if fused:
            node = ir.node("SkipLayerNormalization", [x, skip, gamma, beta], domain="com.microsoft",
                           attributes={"epsilon": 1e-5})
            nodes = [node]
        else:
            add = ir.node("Add", [x, skip])
            node = ir.node("LayerNormalization", [add.outputs[0], gamma, beta], attributes={"axis": -1, "epsilon": 1e-5})
            nodes = [add, node]
        node.outputs[0].name = "y"
        graph = ir.Graph([x, skip], [node.outputs[0]], nodes=nodes, initializers=[gamma, beta],
                         opset_imports={"": 17, "com.microsoft": 1}, name="probe")
        out.append(ir.to_proto(ir.Model(graph, ir_version=8)).SerializeToString())
    return out[0], out[1]


@functools.lru_cache(maxsize=1)
def slow_cpu_fusions(hidden: int = 768, tokens: int = 64, rounds: int = 7, runs: int = 20) -> dict[str, Any]:
    """Which of :data:`OPTIONAL_CPU_FUSIONS` make this ONNX Runtime's CPU EP slower; measured once per process.

    Times each fused kernel against the nodes it replaces on one thread (ORT's optimizations off, so each model
    runs as built), ``rounds`` interleaved rounds of ``runs`` calls, the best round's mean per call. A fusion whose
    kernel takes >= :data:`SLOW_FUSION_RATIO` times the unfused nodes is listed (the margin keeps a close call, which
    load could flip, on ORT's default). The compile's calibration sessions and the plan's recorded
    ``policy.ort_session`` both come from this answer, so the certificate is made on the numerics the plan runs with.

    Returns:
        ``{"disabled_optimizers": [...], "measured_us": {fusion: [fused, unfused]}, "onnxruntime": version}``.
    """
    import numpy as np
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal((1, tokens, hidden)).astype(np.float32) for n in ("x", "skip")}
    measured: dict[str, list[float]] = {}
    for fusion, models in (("SkipLayerNormFusion", _skip_layer_norm_models(hidden)),):
        sessions = [ort.InferenceSession(m, so, providers=["CPUExecutionProvider"]) for m in models]
        best = [float("inf")] * len(sessions)
        for s in sessions:
            s.run(None, feeds)
        for _ in range(rounds):
            for i, s in enumerate(sessions):
                t0 = time.perf_counter()
                for _ in range(runs):
                    s.run(None, feeds)
                best[i] = min(best[i], (time.perf_counter() - t0) / runs * 1e6)
        measured[fusion] = [round(b, 1) for b in best]
    slow = [f for f, (fused, unfused) in measured.items() if fusion_is_slow(fused, unfused)]
    for f, (fused, unfused) in measured.items():
        logger.info("ORT %s CPU fusion %s: fused %.1f us vs unfused %.1f us (%s)", ort.__version__, f, fused,
                    unfused, "switched off in dyncompile's sessions" if f in slow else "kept")
    return {"disabled_optimizers": slow, "measured_us": measured, "onnxruntime": ort.__version__}


def calibration_disabled_optimizers() -> list[str]:
    """The ORT optimizers the compile's CPU calibration sessions switch off (those :func:`slow_cpu_fusions` lists)."""
    return list(slow_cpu_fusions()["disabled_optimizers"])


def calibration_session(model: bytes | str, session_options: Any, custom_ops: bool = False) -> Any:
    """A CPU EP session for the compile's calibration runs, with the measured-slow fusions off.

    ``model`` is ONNX bytes or a path; the fusions are :func:`calibration_disabled_optimizers`', as the plan's CPU
    sessions will run it. ``custom_ops``: the model uses dyncompile's own operators (``fuse-int8-epilogues``,
    ``sparsify-activations``): ``session_options`` gets the kernel library the plan's sessions will register.
    """
    import onnxruntime as ort

    if custom_ops:
        import dyncompile.runtime.kernels as kernels

        kernels.register(session_options, *kernels.library())
    return ort.InferenceSession(model, session_options, providers=["CPUExecutionProvider"],
                                disabled_optimizers=calibration_disabled_optimizers() or None)
