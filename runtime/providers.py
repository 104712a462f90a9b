"""Execution providers by short name, and detection of clashing ONNX Runtime flavours.

``cpu``, ``openvino``, ``cuda``, ``directml`` map to ONNX Runtime providers and default options. The four
ORT flavours (``onnxruntime``, ``onnxruntime-openvino``, ``onnxruntime-gpu``, ``onnxruntime-directml``)
ship the same ``onnxruntime`` module and silently break each other when two are installed; we detect
that and say how to fix it.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata as md
import logging
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
