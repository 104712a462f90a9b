"""Load a plan and run it on ONNX Runtime.

The runtime never re-derives decisions the passes made: it creates one ORT session per ONNX file
the plan names (once, reused across calls) and hands the batch through the plan's ``steps`` in
order; each step's ``kind`` selects the handler registered for it (:mod:`dyncompile.runtime.registry`,
filled by the step index :mod:`dyncompile.runtime.steps`). Unknown kinds raise :class:`PlanError`. The
loaded model's task methods are answered by the task API its plan's technique registers.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dyncompile.errors import DataError, PlanError, ProviderError
from dyncompile.plan import Plan, load_plan, load_subplan
from dyncompile.plan.model_bytes import read_model
from dyncompile.runtime import steps as _steps  # noqa: F401  (registers the built-in step handlers)
from dyncompile.runtime.providers import (
    check_ort_flavours,
    resolve_provider,
    session_config_entries,
    session_memory_options,
    warn_if_int8_saturates,
)
from dyncompile.runtime.registry import (
    STEP_HANDLERS,
    StepHandler,
    first_line,
    is_ort_error,
    register_step,
    task_api_for,
)

logger = logging.getLogger(__name__)

__all__ = ["STEP_HANDLERS", "register_step", "StepHandler", "LoadOptions", "RuntimeContext", "CompiledModel", "load"]


def known_step_kinds() -> set[str]:
    """The step kinds this runtime runs (every handler the step index registers)."""
    return set(STEP_HANDLERS)


@dataclasses.dataclass(frozen=True)
class LoadOptions:
    """How :func:`load` runs a plan (see its arguments); the runtime context reads them from here."""

    provider: str = "cpu"
    fallback: str | None = None
    threads: int | None = None
    optimization: str = "all"
    provider_options: dict[str, Any] | None = None
    session_config: dict[str, str] | None = None
    spinning: bool = True
    cuda_graph: bool = False
    memory: str = "auto"


class RuntimeContext:
    """Sessions for the plan's ONNX files, created lazily once and reused.

    Args:
        plan: the loaded plan.
        options: provider, threads, optimisation level and session options.
    """

    def __init__(self, plan: Plan, options: LoadOptions | None = None) -> None:
        """Resolve the provider and the session options; no session is created yet."""
        import onnxruntime as ort

        o = options or LoadOptions()
        self.options = o
        self.ort = ort
        # EP chatter (e.g. OpenVINO's unused-input notes) stays out of stderr; ORT's own error lines too (the
        # runtime turns ORT failures into one clear error), unless debugging
        self.log_severity = 3 if logger.isEnabledFor(logging.DEBUG) else 4
        ort.set_default_logger_severity(self.log_severity)
        self.plan = plan
        self.providers = resolve_provider(o.provider, fallback=o.fallback, options=o.provider_options)
        self.provider = self.providers[0][0]
        if self.provider == "CUDAExecutionProvider" and hasattr(ort, "preload_dlls"):
            ort.preload_dlls()  # CUDA/cuDNN from the nvidia-* wheels (or a matching PyTorch), if present
        self.threads = o.threads
        if not isinstance(o.spinning, bool):
            raise DataError(f"spinning must be True or False, got {o.spinning!r}")
        self.session_config = session_config_entries(o.spinning, o.session_config)
        levels = {
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        }
        if o.optimization not in levels:
            raise DataError(f"optimization must be one of {', '.join(levels)}, got {o.optimization!r}")
        self.optimization = levels[o.optimization]
        try:
            self._set_memory_options()
        except ProviderError as e:
            raise DataError(str(e)) from None
        self._sessions: dict[str, Any] = {}
        self._session_lock = threading.Lock()

    def _set_memory_options(self) -> None:
        """Derive, once per plan, its sessions' memory attributes and whether several-row calls get their own session.

        :attr:`memory_options`: ``SessionOptions`` memory attributes (``LoadOptions.memory``; the providers' rule).
        Under ``memory="auto"`` they are for batch-1 calls; where they change ORT's defaults
        (:attr:`batched_session`), a call of several rows runs in a session with ORT's defaults instead
        (:meth:`session`'s ``rows``), made when the first such call comes.
        """
        lowering = (self.plan.policy.get("early_exit") or {}).get("lowering")
        self.memory_options = session_memory_options(self.options.memory, self.plan.task, self.provider, lowering)
        self.batched_session = self.options.memory == "auto" and bool(self.memory_options)

    @property
    def disabled_optimizers(self) -> list[str]:
        """ORT fusions the plan's ``policy.ort_session`` switches off; CPU EP sessions only (others keep ORT's)."""
        rec = self.plan.policy.get("ort_session")
        if not rec or self.provider != "CPUExecutionProvider":
            return []
        return list(rec["disabled_optimizers"])

    def load_candidate(self, candidate) -> CompiledModel:
        """A routed plan's candidate as a loaded model.

        Its sub-plan is checked like a top-level plan and runs with this context's provider, threads,
        optimisation level and session options (in sessions of its own).
        """
        sub = load_subplan(self.plan, candidate, known_step_kinds=known_step_kinds())
        ctx = copy.copy(self)
        ctx.plan = sub
        ctx._set_memory_options()
        ctx._sessions = {}
        ctx._session_lock = threading.Lock()
        return CompiledModel(sub, ctx)

    def session_options(self, batched: bool = False):
        """ORT session options for one of the plan's files (optimisation level, threads, memory, config entries).

        ``batched``: for the session of several-row calls (:attr:`batched_session`), which keeps ORT's memory
        defaults.
        """
        so = self.ort.SessionOptions()
        so.graph_optimization_level = self.optimization
        if self.threads:
            so.intra_op_num_threads = int(self.threads)
        so.log_severity_level = self.log_severity
        for k, v in ({} if batched else self.memory_options).items():
            setattr(so, k, v)
        for k, v in self.session_config.items():
            so.add_session_config_entry(k, str(v))
        ops = self.plan.policy.get("custom_ops")
        if ops:  # dyncompile's own ORT custom ops (sparsify-activations): built here from the package's source
            import dyncompile.runtime.kernels as kernels

            try:
                kernels.register_for_plan(so, ops["ops"], ops["source_sha256"])
            except kernels.KernelUnavailable as e:
                raise PlanError(f"{self.plan.directory}: {e}") from None
        return so

    def _new_session(self, file_key: str, providers=None, batched: bool = False):
        """An ORT session made from the bytes of ``file_key`` that were hashed, never from a path.

        :func:`~dyncompile.plan.model_bytes.read_model` reads the ONNX file, maps its external data and checks
        their sha256; ORT gets the model bytes and the mapped external data (it copies what it needs while the
        session is made; the maps are closed then, after a check that no mapped file was written meanwhile).
        """
        mb = read_model(self.plan, file_key, check_hashes=self.plan.hashes_checked)
        so = self.session_options(batched)
        if mb.external:
            names = list(mb.external)
            bufs = [mb.external[n] for n in names]
            so.add_external_initializers_from_files_in_memory(names, bufs, [len(b) for b in bufs])
        try:
            s = self.ort.InferenceSession(mb.model, so, providers=providers or self.providers,
                                          disabled_optimizers=self.disabled_optimizers or None)
            mb.check_unchanged()  # ORT copied the weights out of the mapped files: were they the hashed bytes?
        finally:
            mb.release()
        if getattr(s, "_model_bytes", None) is not None:
            # ORT's Python wrapper keeps the model bytes for the session's life, only to re-create the session when
            # its own EP fallback kicks in; dyncompile picks fallbacks itself (--fallback), so let them go (a model
            # with inline weights: its size in memory)
            s.disable_fallback()
            s._model_bytes = None
        return s

    def graph_session(self, file_key: str):
        """A CUDA EP session of ``file_key`` with ``enable_cuda_graph`` (its own session; see :class:`KVDecoder`).

        ``None`` when the provider is not CUDA or ONNX Runtime refuses graph capture for this model (logged with
        its reason, e.g. nodes outside the CUDA EP); the caller then uses :meth:`session`.
        """
        if self.provider != "CUDAExecutionProvider":
            logger.info("CUDA graphs need the CUDA EP; %s runs without them", file_key)
            return None
        key = f"{file_key}#cuda-graph"
        s = self._sessions.get(key)
        if s is None:
            (name, opts), *rest = self.providers
            try:
                s = self._new_session(file_key, [(name, {**opts, "enable_cuda_graph": "1"}), *rest])
            except Exception as e:  # ORT raises its own Fail types
                if not is_ort_error(e):
                    raise
                logger.warning("CUDA graphs are not available for %s (%s); running without them", file_key,
                               first_line(e))
                return None
            self._sessions[key] = s
        return s

    def session(self, file_key: str, rows: int | None = None):
        """The ORT session of plan file ``file_key`` (created on first use, from the bytes that were hashed).

        ``rows``: the call's batch size. Where ``memory="auto"`` runs batch-1 calls without ORT's memory arena
        (:attr:`batched_session`), a call of several rows gets an extra session of the same file with ORT's defaults
        (the arena is faster from 4 rows a call), made on the first such call.
        """
        batched = self.batched_session and rows is not None and rows > 1
        key = f"{file_key}#batched" if batched else file_key
        s = self._sessions.get(key)
        if s is None and batched:  # made during a call: threads calling at once make it once
            with self._session_lock:
                return self._sessions.get(key) or self._make_session(file_key, key, batched)
        if s is None:
            s = self._make_session(file_key, key, batched)
        return s

    def _make_session(self, file_key: str, key: str, batched: bool):
        """Create, check and keep the session ``key`` of plan file ``file_key`` (:meth:`session`)."""
        path = self.plan.path_of(file_key)
        try:
            s = self._new_session(file_key, batched=batched)
        except Exception as e:  # ORT raises its own Fail/InvalidGraph types
            if not is_ort_error(e):
                raise
            if self.provider == "CPUExecutionProvider":
                raise PlanError(
                    f"ONNX Runtime cannot load {path.name} of plan {self.plan.directory}: {first_line(e)}. The file is "
                    "not a model this ONNX Runtime can run (an op or domain it lacks, or a damaged graph); "
                    "recompile the plan with this dyncompile"
                ) from None
            lowering = (self.plan.policy.get("early_exit") or {}).get("lowering")
            hint = (
                " This plan is an If-graph early exit; recompile it for this provider with --lowering staged "
                "(or --lowering auto --provider NAME), which needs no If nodes."
                if lowering == "if"
                else " Try --fallback cpu, or recompile the plan for this provider."
            )
            raise ProviderError(
                f"{self.provider} could not load {path.name} of plan {self.plan.directory}: {first_line(e)}.{hint}"
            ) from None
        if self.provider not in s.get_providers():
            raise ProviderError(
                f"{self.provider} was asked for, but ONNX Runtime created the session for {path.name} on "
                f"{s.get_providers()} (the provider failed to initialise: missing CUDA/cuDNN libraries?); "
                "pass --fallback cpu to accept that"
            )
        logger.debug("session for %s (%s) on %s", key, path.name, s.get_providers())
        self._sessions[key] = s
        return s


class CompiledModel:
    """A loaded plan: its task's methods, or arrays in and out with :meth:`run_feeds`.

    The task methods (:meth:`classify` / calling the model, :meth:`predict_proba`, :meth:`generate`,
    :meth:`generate_stream`, :meth:`generate_images`, :meth:`drift_report`) are answered by the task API the plan's technique
    registers (:func:`~dyncompile.runtime.registry.register_task`, held in :attr:`task_api`); a method the
    plan's task does not have raises one :class:`DataError` naming the task.

    Threads: one loaded model may be called from several threads at once. :attr:`last_info` is per thread
    (what the calling thread's last call reported); generation on one plan runs one call at a time (its
    KV caches and drafter state belong to the step; other threads wait), everything else runs concurrently.

    Args:
        plan: the loaded plan.
        ctx: sessions and options for the plan's files.
    """

    def __init__(self, plan: Plan, ctx: RuntimeContext) -> None:
        """Build every step's handler and the task API of the plan's task."""
        self.plan = plan
        self.ctx = ctx
        self.handlers = []
        for step in plan.steps:
            cls = STEP_HANDLERS.get(step.kind)
            if cls is None:
                raise PlanError(f"unknown step kind {step.kind!r}; this runtime knows: {', '.join(sorted(STEP_HANDLERS))}")
            self.handlers.append(cls(step, ctx))
        self._local = threading.local()
        self.task_api = task_api_for(plan.task)(self)

    @property
    def last_info(self) -> dict[str, Any]:
        """What the calling thread's last task call reported (exit layers, candidate, generation statistics)."""
        return getattr(self._local, "info", {})

    @last_info.setter
    def last_info(self, info: dict[str, Any]) -> None:
        self._local.info = info

    @property
    def provider(self) -> str:
        """The ORT name of the execution provider the sessions run on."""
        return self.ctx.provider

    @property
    def input_names(self) -> list[str]:
        """The plan's input names."""
        return [i["name"] for i in self.plan.inputs]

    def run_feeds(self, feeds: dict[str, Any]) -> dict[str, Any]:
        """Run the steps on prepared input arrays; returns the final state (``logits``, extras)."""
        state: dict[str, Any] = dict(feeds)
        for i, h in enumerate(self.handlers):
            try:
                state = h.run(state)
            except KeyError as e:
                raise PlanError(
                    f"step {i} ({h.kind}) of plan {self.plan.directory} needs {e} , which neither the inputs nor an "
                    f"earlier step provide (inputs given: {sorted(state)[:6]}); the plan and its ONNX files disagree — "
                    "recompile"
                ) from None
            except Exception as e:
                if not is_ort_error(e):
                    raise
                raise PlanError(
                    f"ONNX Runtime failed in step {i} ({h.kind}) of plan {self.plan.directory}: {first_line(e)}; the "
                    "plan and its ONNX files disagree, or the input does not fit the model"
                ) from None
        return state

    def encode(self, texts: Sequence[str], **kwargs: Any) -> Any:
        """Classifier plans: the token arrays of ``texts`` for the plan's inputs (the plan's tokenizer).

        Sentence-embedding plans: the embeddings ``[N, dimension]`` of ``texts`` (``batch_size=32``).
        """
        return self.task_api.encode(texts, **kwargs)

    def classify(self, texts: Sequence[str] | str, batch_size: int = 32) -> Any:
        """Classifier plans: one ``Prediction`` per text (label, score, probabilities, exit layer, candidate)."""
        return self.task_api.classify(texts, batch_size=batch_size)

    def __call__(self, texts: Sequence[str] | str, batch_size: int = 32) -> Any:
        """Same as :meth:`classify`."""
        return self.classify(texts, batch_size=batch_size)

    def predict_proba(self, texts: Sequence[str] | str, batch_size: int = 32) -> np.ndarray:
        """Class probabilities ``[N, C]``; ``self.last_info['exit_layer']`` holds per-row exits if any."""
        return self.task_api.predict_proba(texts, batch_size=batch_size)

    def generate(self, prompt: Any, **kwargs: Any) -> Any:
        """Text generation plans: continue ``prompt`` (see :func:`dyncompile.runtime.decode.generate.generate`)."""
        return self.task_api.generate(prompt, **kwargs)

    def generate_stream(self, prompt: Any, **kwargs: Any) -> Any:
        """Text generation plans: :meth:`generate` as a stream of new token ids (the same tokens).

        Returns a :class:`~dyncompile.runtime.decode.generate.GenerationStream`; its ``result`` once iterated.
        """
        return self.task_api.generate_stream(prompt, **kwargs)

    def generate_images(self, prompts: Any, **kwargs: Any) -> Any:
        """Text-to-image plans: images for ``prompts`` (``seed``, ``steps``, ``guidance``, ``policy``, ``noise``...)."""
        return self.task_api.generate_images(prompts, **kwargs)

    def drift_report(self, exit_layers: Any = None, **kwargs: Any) -> Any:
        """Early-exit plans: do the rows seen so far exit like the calibration rows did? (see the task API)."""
        return self.task_api.drift_report(exit_layers, **kwargs)


def load(
    plan_dir: str | Path,
    provider: str = "cpu",
    *,
    fallback: str | None = None,
    threads: int | None = None,
    optimization: str = "all",
    provider_options: dict[str, Any] | None = None,
    session_config: dict[str, str] | None = None,
    spinning: bool = True,
    verify_hashes: bool = True,
    cuda_graph: bool = False,
    memory: str = "auto",
) -> CompiledModel:
    """Load a compiled plan directory for execution on ``provider`` (``cpu``, ``openvino``, ``cuda``, ``directml``).

    Args:
        plan_dir: directory holding ``plan.json`` and the files it names (hashes are verified).
        provider: execution provider short name.
        fallback: provider to use (with a warning) when ``provider`` is not installed.
        threads: ORT intra-op threads (default: ORT's choice, all cores).
        optimization: ORT graph optimisation level: ``all``, ``extended``, ``basic`` or ``disable``.
        provider_options: options for the provider, over dyncompile's defaults.
        session_config: ORT session config entries over dyncompile's defaults
            (:data:`~dyncompile.runtime.providers.DEFAULT_SESSION_CONFIG`).
        spinning: intra-op threads spin while a call runs and stop when it returns (default): ~5-10 % faster
            decoding when the process has its cores to itself. ``False`` lets them wait without spinning
            (:data:`~dyncompile.runtime.providers.NO_SPINNING_SESSION_CONFIG`), 10-15 % faster when other busy
            processes compete for the cores.
        verify_hashes: check every file's sha256 against the plan (default on).
        cuda_graph: on the CUDA EP, replay a decoder's one-token steps as a CUDA graph (needs a float16
            ``causal-attention`` plan without ``trim-logits``; otherwise it runs without and says why at INFO).
        memory: how sessions allocate tensors: ``auto`` (default: no CPU memory arena and no memory pattern for a
            classifier plan whose exits are ``If`` nodes, the batch-1 form, 1.01-1.05x a row with cold caches;
            its calls of several rows run in an extra session with ORT's defaults, made on the first such call;
            every other plan: ORT's defaults), ``arena`` (ORT's defaults, one session) or ``malloc`` (both off);
            :func:`~dyncompile.runtime.providers.session_memory_options` has the measurements.
    """
    check_ort_flavours()
    plan = load_plan(plan_dir, verify_hashes=verify_hashes, known_step_kinds=known_step_kinds())
    options = LoadOptions(provider=provider, fallback=fallback, threads=threads, optimization=optimization,
                          provider_options=provider_options, session_config=session_config, spinning=spinning,
                          cuda_graph=bool(cuda_graph), memory=memory)
    ctx = RuntimeContext(plan, options)
    warn_if_int8_saturates(plan.provenance.get("passes") or [], ctx.provider)
    return CompiledModel(plan, ctx)
