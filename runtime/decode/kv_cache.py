"""A decoder's KV cache for batch-1 generation: one ORT session plus its past tensors, with rollback.

:class:`KVDecoder` drives one KV-cache decoder graph as a plan's decoder spec describes it (see
:mod:`dyncompile.runtime.decode.generate` for the JSON form): it keeps the cache as arrays (or ORT values bound by
IOBinding), feeds ``attention_mask`` / ``position_ids`` for batch 1, and rolls back rejected draft tokens by
masking them (default) or slicing the past tensors. :class:`SessionTimer` adds up the seconds spent inside
ORT calls per model role. The ``generate`` and ``speculative_generate`` steps share both.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from dyncompile.errors import PlanError
from dyncompile.plan import DecoderSpec, KVEntry
from dyncompile.runtime.decode.draft_tree import DraftTree

__all__ = ["BIAS_NEG", "KVDecoder", "SessionTimer"]

logger = logging.getLogger(__name__)

#: the additive attention bias of a masked position (the float32 minimum, as Hugging Face's masks use)
BIAS_NEG = float(np.finfo(np.float32).min)

_NP_DTYPES = {"float32": np.float32, "float16": np.float16, "float": np.float32, "FLOAT": np.float32,
              "FLOAT16": np.float16, "bfloat16": np.float32}


class SessionTimer:
    """Accumulates seconds spent inside ORT ``run`` calls, per model role."""

    def __init__(self) -> None:
        """Start with no time recorded."""
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def add(self, role: str, dt: float) -> None:
        """Add ``dt`` seconds to ``role``."""
        self.seconds[role] = self.seconds.get(role, 0.0) + dt
        self.calls[role] = self.calls.get(role, 0) + 1

    def reset(self) -> None:
        """Forget the recorded times."""
        self.seconds.clear()
        self.calls.clear()


class KVDecoder:
    """One decoder session plus its KV cache (batch 1).

    ``forward(ids)`` runs the new tokens on top of the cache and returns their logits ``[n, vocab]``;
    the cache grows by ``n``. ``truncate(length)`` rolls the cache back (rejected draft tokens).
    ``adopt(arrays, length)`` installs past tensors computed elsewhere (a split drafter's first layers are
    the target's first layers, so it takes the target's cache instead of recomputing it).

    Rollback (``rollback=``):

    * ``"mask"`` (default): rejected positions stay in the past tensors but get ``attention_mask = 0`` (their
      attention weight is exactly zero) and later tokens take their positions through ``position_ids``; no
      copy per rejection. The cache is compacted (one copy) once masked slots exceed a quarter of it. Logits
      differ from a gap-free cache only in float rounding, like verifying several tokens per call does
      (measured on SmolLM2: 3e-5 vs 2e-5 max abs logit difference).
    * ``"copy"``: slice the past tensors to the kept length at once (a copy of the whole cache per rejected round).
      Needs a model without ``attention_mask`` input too.

    With ``io_binding=True`` the past tensors stay ORT values bound by ``IOBinding`` between calls instead
    of numpy arrays passed to ``run``; both give the same numbers (``dyncompile bench generate --io-binding``
    measures which is faster). On the CUDA EP the bound past/present tensors live in GPU memory (only the
    logits come back to the host), so the cache is not copied across PCIe on every step.

    KV buffer (``spec.kv_buffer``, overridden by ``kv_buffer=``): ``"concat"`` keeps whatever tensors the graph
    returns (``past + new``, a fresh copy of the whole cache per call). ``"shared"`` (a ``fuse-decoder`` graph
    whose past inputs feed only ``GroupQueryAttention`` and whose mask is the ``attention_bias`` input) holds one
    preallocated buffer per KV tensor, bound by ``IOBinding`` as both the past input and the present output:
    GQA writes the new tokens in place after ``slots`` and attends over the bias's ``slots + n`` columns, so no
    step copies the cache. Rolling back the newest tokens then only moves ``slots`` back (the next call
    overwrites them); a verified tree's kept path is moved down in the buffer (a few rows). The buffer doubles
    when full (one copy). On the CPU EP the buffers are numpy arrays ORT reads and writes in place; on the CUDA EP
    they live in GPU memory (allocated once, 1,024 slots to start), so a step moves only its inputs and the logits
    across PCIe; the rare edits of the rows themselves (growth, a tree's kept path off the prefix, adoption) go
    through one host copy each, counted in :attr:`host_copies`. That needs GQA on the GPU: ONNX Runtime's CUDA
    kernel is float16/bfloat16 only and takes no ``attention_bias``, so on the CUDA EP only a float16 graph with
    causal attention (``causal-attention,float16``) shares a device buffer; any other concatenates (its GQA runs on
    the CPU EP, where a shared buffer would cross PCIe whole twice per call). Other EPs fall back to ``concat``.

    Causal attention (``spec.attention == "causal"``, ``causal-attention``): the ``attention_mask`` input only says
    how many slots are valid, so the cache is kept gap-free: rollback by ``"copy"`` (a shared buffer moves its end
    back, no copy) and chains only (no trees).

    CUDA graphs (``cuda_graph=True``, a session made with ``enable_cuda_graph``, a float16 ``causal-attention`` plan
    with its shared device buffer and no ``trim-logits``): one-token steps run with every input and output bound to
    fixed device buffers (ids, positions, a capacity-wide ``attention_mask``, the logits), updated in place, so ONNX
    Runtime captures the step once and replays it as one CUDA graph; calls of several tokens run normally (run option
    ``gpu_graph_id=-1``). Growing the buffer binds new addresses under a new graph id.

    Minimum rows (``spec.min_rows`` > 1): a call of fewer new tokens is padded to ``min_rows`` rows with copies of
    its last token at the next positions (visible to no real row); only the real rows' outputs (logits and extra
    outputs) come back, and the padded rows' slots are cut from the cache at once (a shared buffer moves its end
    back; a concatenated cache is sliced, one copy), so they leave no trace. Such a decoder also rolls back by
    ``"copy"`` (a gap-free cache, like the one the target alone builds): with ``min_rows`` every call of the target
    alone, prefill and verification computes its rows with the same kernels, and rows keep their logits bitwise.
    """

    def __init__(self, session, spec: DecoderSpec, *, role: str = "target", timer: SessionTimer | None = None,
                 io_binding: bool = False, rollback: str = "mask", kv_buffer: str | None = None,
                 cuda_graph: bool = False, rows_session=None, rows_from: int = 0) -> None:
        """Drive ``session`` as described by ``spec`` (``role`` names it in the timer).

        ``rows_session`` (with ``rows_from`` >= 2): a session on a twin graph with the same inputs, outputs and
        cache layout that runs the calls of ``rows_from`` new tokens or more (a drafter's int8 twin,
        :mod:`dyncompile.passes.speculative.drafter_rows`); :attr:`use_rows` turns it off and on.
        """
        self.session = session
        self.spec = spec
        self.role = role
        self.timer = timer or SessionTimer()
        self.io_binding = bool(io_binding)
        providers = session.get_providers() if hasattr(session, "get_providers") else []
        self.kv_device = "cuda" if providers and providers[0] == "CUDAExecutionProvider" else "cpu"
        #: shared buffers as host arrays wrapped by CPU ORT values (CPU EP), or ORT values in device memory
        self._on_host = self.kv_device == "cpu"
        #: device-resident shared buffers copied to the host and back (growth, tree paths, adoption)
        self.host_copies = 0
        names = {i.name for i in session.get_inputs()}
        outs = {o.name for o in session.get_outputs()}
        missing = [n for n in [spec.input_ids, *(e.past for e in spec.kv)] if n not in names]
        missing += [n for n in [spec.logits, *(e.present for e in spec.kv)] if n not in outs]
        if missing:
            raise PlanError(
                f"the {role} model of the plan lacks {missing[:4]}{'…' if len(missing) > 4 else ''} named in the plan; "
                "the plan and its ONNX files disagree — recompile"
            )
        self.mask_name = spec.attention_mask if spec.attention_mask in names else None
        self.pos_name = spec.position_ids if spec.position_ids in names else None
        self.bias_name = spec.attention_bias if spec.attention_bias and spec.attention_bias in names else None
        if spec.attention_bias and self.bias_name is None:
            raise PlanError(
                f"the {role} model of the plan lacks the attention bias input {spec.attention_bias!r} named in the plan; "
                "the plan and its ONNX files disagree — recompile"
            )
        self.keep_name = spec.logits_to_keep
        if self.keep_name and self.keep_name not in names:
            raise PlanError(
                f"the {role} model of the plan lacks the input {self.keep_name!r} named in the plan; "
                "the plan and its ONNX files disagree — recompile"
            )
        if role == "target":  # the target is fed exactly what the plan names (drafters may take extra inputs)
            fed = {spec.input_ids, self.mask_name, self.pos_name, self.bias_name, self.keep_name,
                   *(e.past for e in spec.kv)}
            unfed = sorted(names - fed)
            if unfed:
                raise PlanError(
                    f"the {role} model of the plan needs inputs {unfed[:4]} the plan does not name (e.g. a null "
                    "position_ids or attention_mask); the plan and its ONNX files disagree — recompile"
                )
        self.output_names = [spec.logits, *(e.present for e in spec.kv)]
        #: further outputs of the graph (e.g. ``features`` for an EAGLE drafter), fetched on every call
        self.extra_names = [o for o in (x.name for x in session.get_outputs()) if o not in self.output_names]
        self.output_names += self.extra_names
        #: every output of the last ``forward`` (batch dim dropped): logits, presents, extras
        self.last_outputs: dict[str, np.ndarray] = {}
        self.dtype = _NP_DTYPES.get(spec.kv_dtype, np.float32)
        #: causal attention (``causal-attention``): the mask sizes the cache, so it stays gap-free
        self.causal = spec.attention == "causal"
        self.set_rollback(rollback)
        self._mask = np.ones((1, 1024), np.int64)  # validity of each physical cache slot, then ones
        self._arange = np.arange(1024, dtype=np.int64)[None]
        self.past: list[Any] = []
        self.length = 0  # tokens of the sequence held in the cache
        self.slots = 0  # physical positions of the past tensors (>= length when some are masked)
        self.compactions = 0
        self._bufs: list[np.ndarray] = []  # kv_buffer="shared": the preallocated buffers (capacity self._cap)
        self._cap = 0
        self._buf_gen = 0  # bumped whenever new buffers (new addresses) replace the old ones
        self.shared = False
        #: one-token steps replayed as a CUDA graph (see the class docstring); steps so replayed
        self.cuda_graph = False
        self.graph_steps = 0
        self._graph: dict[str, Any] | None = None
        self._graph_id = 0
        self._run_options = None  # a graph-enabled session's other calls run with gpu_graph_id=-1 (no capture)
        self.set_kv_buffer(kv_buffer)
        if cuda_graph:
            self.set_cuda_graph(True)
        self.rows_session, self.rows_from = None, 0
        if rows_session is not None:
            self._check_twin(rows_session, rows_from)
        #: whether calls of ``rows_from`` rows or more go to the twin session (when there is one)
        self.use_rows = self.rows_session is not None

    def _check_twin(self, rows_session, rows_from: int) -> None:
        """Keep ``rows_session`` as the twin if its graph has this one's inputs and outputs (else a PlanError)."""
        if rows_from < 2:
            raise PlanError(f"the {self.role} model's twin is for calls of >= 2 rows, not {rows_from}")
        mine = ({i.name for i in self.session.get_inputs()}, {o.name for o in self.session.get_outputs()})
        twin = ({i.name for i in rows_session.get_inputs()}, {o.name for o in rows_session.get_outputs()})
        if mine != twin:
            diff = sorted((mine[0] ^ twin[0]) | (mine[1] ^ twin[1]))
            raise PlanError(f"the {self.role} model's twin for calls of many rows differs from it in inputs or outputs "
                            f"({diff[:4]}); the plan and its ONNX files disagree — recompile")
        self.rows_session, self.rows_from = rows_session, int(rows_from)

    def set_rollback(self, rollback: str) -> None:
        """Roll back by ``"mask"`` or ``"copy"`` (see the class docstring).

        ``"copy"`` for a graph without a mask or bias input and position ids, which cannot express holes.
        """
        if rollback not in ("mask", "copy"):
            raise PlanError(f"rollback must be 'mask' or 'copy', not {rollback!r}")
        if self.causal and rollback == "mask":  # holes would be attended: the mask only counts slots
            rollback = "copy"
        if self.spec.min_rows > 1 and rollback == "mask":  # masked holes would change the rows' float sums
            logger.debug("the %s decoder rolls back by copy: it pads calls to %d rows, whose logits must match "
                         "a gap-free cache's bitwise", self.role, self.spec.min_rows)
            rollback = "copy"
        self.rollback = rollback if (self.mask_name or self.bias_name) and self.pos_name else "copy"

    def set_kv_buffer(self, mode: str | None = None) -> None:
        """Hold the cache as ``mode`` (``"shared"`` / ``"concat"``; ``None``: the plan's); empties the cache."""
        mode = self.spec.kv_buffer if mode is None else mode
        if mode not in ("shared", "concat"):
            raise PlanError(f"kv_buffer must be 'shared' or 'concat', not {mode!r}")
        shared = mode == "shared"
        why = self._why_not_shared() if shared else None
        if why:
            logger.info("the %s decoder holds its KV cache by concatenation: %s", self.role, why)
            shared = False
        self.shared = shared
        if not shared:
            self._bufs, self._cap = [], 0
        self.reset()

    def _why_not_shared(self) -> str | None:
        """Why this decoder cannot hold a shared buffer (``None``: it can)."""
        if self.kv_device == "cuda" and not (self.causal and self.spec.kv_dtype in ("float16", "FLOAT16", "bfloat16")):
            # ORT's CUDA GroupQueryAttention has float16/bfloat16 kernels only and rejects an attention_bias input in
            # any precision, so such a graph runs GQA on the CPU EP: a shared buffer would cross PCIe whole twice per
            # call (measured on an H200: 18 ms per step at 1,024 slots against 6.6 ms concatenating)
            return ("on the CUDA EP the plan's GroupQueryAttention runs on the CPU (ONNX Runtime's CUDA kernel takes no "
                    "attention_bias and no float32; compile with causal-attention,float16 for one it runs), where a "
                    "shared buffer would be copied whole across PCIe twice per call")
        if self.spec.kv_buffer != "shared" or not self.pos_name or not (self.bias_name or (self.causal and self.mask_name)):
            return "a shared buffer needs a plan that says kv_buffer=shared (explicit-attention,fuse-decoder)"
        return None

    def _why_no_graph(self) -> str | None:
        """Why one-token steps cannot be replayed as a CUDA graph (``None``: they can)."""
        opts = self.session.get_provider_options() if hasattr(self.session, "get_provider_options") else {}
        if self.kv_device != "cuda" or (opts.get("CUDAExecutionProvider") or {}).get("enable_cuda_graph") != "1":
            return "the session is not a CUDA EP session with enable_cuda_graph (dyncompile.load(..., cuda_graph=True))"
        if not (self.shared and self.causal):
            return ("a CUDA graph needs fixed buffer addresses: a float16 causal-attention plan whose KV cache is one "
                    "shared device buffer (compile with causal-attention,float16)")
        if self.keep_name:
            return ("trim-logits sends the logits slice's start to the host (a copy node), which CUDA graphs do not "
                    "allow: compile without trim-logits")
        for o in self._step_outputs():
            if len(o.shape or ()) < 2 or any(not isinstance(d, int) for d in o.shape[2:]):
                return f"the output {o.name!r} has no fixed per-token shape ({o.shape})"
        return None

    def _step_outputs(self) -> list:
        """The session's output descriptions of every output but the KV cache (logits, then the extras)."""
        by_name = {o.name: o for o in self.session.get_outputs()}
        return [by_name[n] for n in [self.output_names[0], *self.extra_names]]

    def set_cuda_graph(self, on: bool) -> None:
        """Replay one-token steps as a CUDA graph (``on``), or not; says why at INFO when it cannot."""
        why = self._why_no_graph() if on else None
        if why:
            logger.info("the %s decoder runs without CUDA graphs: %s", self.role, why)
        self.cuda_graph = bool(on) and why is None
        self._graph = None
        if self.cuda_graph and self._run_options is None:
            import onnxruntime as ort

            self._run_options = ort.RunOptions()
            self._run_options.add_run_config_entry("gpu_graph_id", "-1")

    def _bind_graph(self) -> dict[str, Any]:
        """Fixed-address inputs and outputs of a one-token step over the current buffers (a new graph id).

        ``attention_mask`` spans the whole buffer (ones over the valid slots and the new token, zeros after): GQA
        reads the valid length from it (``seqlens_k``) and the buffer's capacity as the total length, so every step
        has the same shapes and addresses, as onnxruntime-genai's graph-captured models do.
        """
        import onnxruntime as ort

        dev = self.kv_device
        self._graph_id += 1
        vals = {
            self.spec.input_ids: np.zeros((1, 1), np.int64),
            **({self.pos_name: np.zeros((1, 1), np.int64)} if self.pos_name else {}),
            self.mask_name: np.zeros((1, self._cap), np.int64),
        }
        ins = {k: ort.OrtValue.ortvalue_from_numpy(v, dev, 0) for k, v in vals.items()}
        outs = {o.name: ort.OrtValue.ortvalue_from_shape_and_type(
            [1, 1, *o.shape[2:]], np.float16 if "float16" in o.type else np.float32, dev, 0) for o in self._step_outputs()}
        io = self.session.io_binding()
        for k, v in ins.items():
            io.bind_ortvalue_input(k, v)
        for e, v in zip(self.spec.kv, self.past):
            io.bind_ortvalue_input(e.past, v)
            io.bind_ortvalue_output(e.present, v)
        for k, v in outs.items():
            io.bind_ortvalue_output(k, v)
        ro = ort.RunOptions()
        ro.add_run_config_entry("gpu_graph_id", str(self._graph_id))
        return {"gen": self._buf_gen, "ins": ins, "outs": outs, "io": io, "run_options": ro,
                "mask": np.zeros((1, self._cap), np.int64)}

    def _run_graph(self, ids_arr: np.ndarray) -> None:
        """One token through the captured graph: update the bound inputs in place, replay, read the outputs."""
        self._reserve(self.slots + 1)
        g = self._graph
        if g is None or g["gen"] != self._buf_gen:  # new buffers (growth, a reset): new addresses, a new graph
            g = self._graph = self._bind_graph()
        g["ins"][self.spec.input_ids].update_inplace(np.ascontiguousarray(ids_arr, np.int64))
        if self.pos_name:
            g["ins"][self.pos_name].update_inplace(np.array([[self.length]], np.int64))
        mask = g["mask"]
        mask[0, : self.slots + 1] = 1
        mask[0, self.slots + 1 :] = 0
        g["ins"][self.mask_name].update_inplace(mask)
        t0 = time.perf_counter()
        self.session.run_with_iobinding(g["io"], g["run_options"])
        self.timer.add(self.role, time.perf_counter() - t0)
        self.last_outputs = {k: v.numpy()[0] for k, v in g["outs"].items()}
        self.length += 1
        self.slots += 1
        self.graph_steps += 1

    # --- cache -----------------------------------------------------------------------------------
    def _empty(self, e: KVEntry, slots: int = 0) -> np.ndarray:
        """A zero past tensor of ``e`` with ``slots`` positions along its sequence axis."""
        dims = list(e.shape)
        dims.insert(e.axis - 1, slots)
        return np.zeros([1, *dims], self.dtype)

    def reset(self) -> None:
        """Empty the cache (a new prompt)."""
        self.length = self.slots = 0
        self._mask[:] = 1
        if self.shared:  # the buffers are kept (the next call overwrites them from slot 0)
            self._reserve(self._first_capacity)
            return
        self.past = [self._empty(e) for e in self.spec.kv]
        if self.io_binding:
            self.past = [self._ortvalue(a) for a in self.past]

    def _seq(self, e: KVEntry, index) -> tuple:
        """An index selecting ``index`` along ``e``'s sequence axis."""
        idx: list[Any] = [slice(None)] * (len(e.shape) + 2)
        idx[e.axis] = index
        return tuple(idx)

    @property
    def _first_capacity(self) -> int:
        """Slots of a new shared buffer: 256 on the host; 1,024 in device memory, where growing costs a host copy."""
        return 256 if self._on_host else 1024

    def _buffers(self) -> list[np.ndarray]:
        """The shared buffers as arrays to edit: the buffers themselves on the host, else host copies.

        After editing copies, :meth:`_commit` writes them back.
        """
        if self._on_host:
            return self._bufs
        self.host_copies += 1
        return [np.array(v.numpy(), copy=True) for v in self.past]

    def _commit(self, arrays: list[np.ndarray]) -> None:
        """Write edited :meth:`_buffers` back into device-resident buffers (same addresses; no-op on the host)."""
        if not self._on_host:
            for v, a in zip(self.past, arrays):
                v.update_inplace(np.ascontiguousarray(a))

    def _reserve(self, total: int) -> None:
        """Shared buffers of at least ``total`` slots (doubling; the ``slots`` in use are copied over)."""
        if total <= self._cap:
            return
        first = self._first_capacity
        cap = max(first, 2 * total) if self._cap else max(first, total)
        old = self._buffers() if self._cap and self.slots else None
        bufs = []
        for i, e in enumerate(self.spec.kv):
            b = self._empty(e, cap)
            if old is not None:
                b[self._seq(e, slice(0, self.slots))] = old[i][self._seq(e, slice(0, self.slots))]
            bufs.append(b)
        self._cap = cap
        self._buf_gen += 1  # new addresses: a bound CUDA graph must be rebound
        # CPU OrtValues over the numpy buffers (no copy): ORT reads and writes them in place; on a device, one upload
        self.past = [self._ortvalue(b) for b in bufs]
        self._bufs = bufs if self._on_host else []

    def _ortvalue(self, a: np.ndarray):
        import onnxruntime as ort

        return ort.OrtValue.ortvalue_from_numpy(a, self.kv_device, 0)

    def _arrays(self) -> list[np.ndarray]:
        """The past tensors as arrays over the ``slots`` in use (views of the buffers when shared)."""
        if self.shared:
            return [b[self._seq(e, slice(0, self.slots))] for b, e in zip(self._buffers(), self.spec.kv)]
        return [v.numpy() for v in self.past] if self.io_binding else list(self.past)

    def _set_arrays(self, arrays: list[np.ndarray]) -> None:
        self.past = [self._ortvalue(a) for a in arrays] if self.io_binding else arrays

    def _keep(self, keep) -> None:
        """Keep the physical slots ``keep`` (a slice or an index array) of every past tensor (one copy)."""
        if self.shared:  # move them to the front of each buffer, in place
            bufs = self._buffers()
            for b, e in zip(bufs, self.spec.kv):
                rows = b[self._seq(e, keep)]
                b[self._seq(e, slice(0, rows.shape[e.axis]))] = rows
            self._commit(bufs)
            return
        self._set_arrays([np.ascontiguousarray(a[self._seq(e, keep)]) for a, e in zip(self._arrays(), self.spec.kv)])

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` tokens of the sequence in the cache (no-op when it holds no more)."""
        drop = self.length - length
        if drop <= 0:
            return
        if self.rollback == "copy" and self.slots == self.length and not self.shared:
            self._keep(slice(0, length))
            self.slots = self.length = length
            return
        # mask the newest ``drop`` valid slots (they are the last ones written)
        valid = np.flatnonzero(self._mask[0, : self.slots])
        self._mask[0, valid[-drop:]] = 0
        self.length = length
        if self.shared:  # the masked tail is overwritten by the next call
            self._trim()
        self._compact_if_due()

    def _compact_if_due(self) -> None:
        """Compact once masked slots exceed a quarter of the cache.

        At once for ``rollback="copy"``, which a shared buffer does not need: its rollback is a move of the end.
        """
        if (self.rollback == "copy" and not self.shared) or self.slots - self.length > max(32, self.slots // 4):
            self.compact()

    def _trim(self) -> None:
        """Drop the masked slots at the end of a shared buffer (no copy)."""
        valid = np.flatnonzero(self._mask[0, : self.slots])
        end = int(valid[-1]) + 1 if len(valid) else 0
        self._mask[0, end : self.slots] = 1
        self.slots = end

    def compact(self) -> None:
        """Drop masked slots from the past tensors (one copy)."""
        if self.slots == self.length:
            return
        keep = np.flatnonzero(self._mask[0, : self.slots])
        self._keep(keep)
        self.slots = self.length = len(keep)
        self._mask[0, : self.slots] = 1
        self._mask[0, self.slots :] = 1
        self.compactions += 1

    def adopt(self, other: KVDecoder, indices: Sequence[int]) -> None:
        """Use ``other``'s past tensors ``indices`` (aligned with this decoder's kv entries) and its slot mask.

        Concat caches share the tensors (neither side writes them); a shared buffer is copied (``other`` writes
        its buffers in place, and so would this decoder).
        """
        if self.shared or other.shared:
            arrays = other._arrays()
            src = [arrays[j] for j in indices]
            if self.shared:
                self.slots = 0
                self._reserve(other.slots + 1)
                bufs = self._buffers()
                for b, e, a in zip(bufs, self.spec.kv, src):
                    b[self._seq(e, slice(0, other.slots))] = a
                self._commit(bufs)
            else:
                self.past = [np.array(a) for a in src]
                if self.io_binding:
                    self.past = [self._ortvalue(a) for a in self.past]
        else:
            self.past = [other.past[j] for j in indices]
        self.length, self.slots = other.length, other.slots
        self._grow(self.slots + 1)
        self._mask[0, : self.slots] = other._mask[0, : self.slots]
        self._mask[0, self.slots :] = 1

    # --- running ---------------------------------------------------------------------------------
    def _grow(self, total: int) -> None:
        if total > self._mask.shape[1]:
            size = max(2 * total, 2048)
            mask = np.ones((1, size), np.int64)
            mask[0, : self.slots] = self._mask[0, : self.slots]
            self._mask = mask
            self._arange = np.arange(size, dtype=np.int64)[None]

    @property
    def supports_trees(self) -> bool:
        """Whether this decoder can verify a draft tree (a 4-D attention bias and position ids as inputs)."""
        return bool(self.bias_name and self.pos_name)

    def _aux(self, n: int, tree: DraftTree | None = None, visible: np.ndarray | None = None,
             positions: np.ndarray | None = None) -> dict[str, np.ndarray]:
        total = self.slots + n
        self._grow(total)
        feeds = {}
        if self.mask_name:
            feeds[self.mask_name] = self._mask[:, :total]
        if visible is not None:  # an explicit visibility matrix over every slot (a drafter expanding a tree)
            bias = np.full((1, 1, n, total), BIAS_NEG, np.float32)
            bias[0, 0][visible] = 0.0
            feeds[self.bias_name] = bias
            feeds[self.pos_name] = np.asarray(positions, np.int64).reshape(1, n)
            return feeds
        if self.bias_name:
            if tree is None:  # a chain: causal over the new tokens
                bias = np.full((1, 1, n, total), BIAS_NEG, np.float32)
                bias[0, 0, :, : self.slots][:, self._mask[0, : self.slots].astype(bool)] = 0.0
                bias[0, 0, :, self.slots :][np.tril_indices(n)] = 0.0
                feeds[self.bias_name] = bias
            else:
                feeds[self.bias_name] = tree.attention(self._mask[0, : self.slots].astype(bool), BIAS_NEG)
        if self.pos_name:
            feeds[self.pos_name] = (self._arange[:, self.length : self.length + n] if tree is None
                                    else tree.positions(self.length))
        return feeds

    def keep_path(self, n: int, keep: Sequence[int]) -> None:
        """After a ``forward`` of ``n`` tree nodes, keep only the nodes ``keep`` in the cache.

        ``keep``: indices among those ``n``, in increasing order (an accepted root-to-node path); the others are
        dropped (masked, or gathered out along the sequence axis with ``rollback="copy"``).
        """
        keep = sorted(int(k) for k in keep)
        if keep == list(range(len(keep))):  # a prefix: the plain rollback
            self.truncate(self.length - n + len(keep))
            return
        if self.rollback == "copy" and not self.mask_name and not self.bias_name:
            raise PlanError(f"the {self.role} model cannot drop tree nodes: it has no attention mask input")
        base = self.slots - n
        if self.shared:  # move the kept nodes down to base..base+len(keep) (a few rows per tensor)
            bufs = self._buffers()
            for b, e in zip(bufs, self.spec.kv):
                b[self._seq(e, slice(base, base + len(keep)))] = b[self._seq(e, np.asarray(keep) + base)]
            self._commit(bufs)
            self.slots = base + len(keep)
            self.length -= n - len(keep)
            return
        drop = np.setdiff1d(np.arange(n), np.asarray(keep, dtype=np.int64)) + base
        self._mask[0, drop] = 0
        self.length -= n - len(keep)
        self._compact_if_due()

    def forward_visible(self, ids: Sequence[int], positions: Sequence[int], visible: np.ndarray) -> np.ndarray:
        """Logits of ``ids`` at ``positions``, token ``i`` attending to the slots where ``visible[i]`` is true.

        ``visible``: bool ``[n, slots + n]``; needs :attr:`supports_trees`. The cache grows by ``n`` (every slot stays
        valid: roll back with :meth:`truncate`).
        """
        if not self.supports_trees:
            raise PlanError(f"the {self.role} model has no 4-D attention bias input")
        return self.forward(ids, _visible=(np.asarray(visible, bool), np.asarray(positions, np.int64)))

    def forward(self, ids: Sequence[int] | np.ndarray, tree: DraftTree | None = None, *, last: int | None = None,
                _visible=None) -> np.ndarray:
        """Logits ``[len(ids), vocab]`` of the new tokens; the cache grows by ``len(ids)``.

        ``last=k``: the logits of the last ``k`` tokens only (``[k, vocab]``; a ``trim-logits`` graph then runs
        its LM head on those rows alone, e.g. ``k=1`` for a prompt).

        With ``tree`` (its tokens are ``ids``), node ``i`` is fed at position ``length + depth[i]`` and attends
        to the valid past and its ancestors only (needs :attr:`supports_trees`); then :meth:`keep_path`.
        Every output of the call is kept in :attr:`last_outputs`.
        """
        ids_arr = np.asarray(ids, dtype=np.int64).reshape(1, -1)
        n = ids_arr.shape[1]
        if tree is not None:
            if len(tree) != n:
                raise ValueError(f"a tree of {len(tree)} nodes for {n} tokens")
            if tree.is_chain:
                tree = None
            elif not self.supports_trees:
                raise PlanError(
                    f"the {self.role} model has no 4-D attention bias input, so it cannot verify a draft tree; "
                    "compile with --passes explicit-attention,speculative{tree=true}"
                )
        if last is not None and not 1 <= last <= n:
            raise ValueError(f"last={last} for {n} new tokens")
        pad = max(0, self.spec.min_rows - n)
        if pad:
            return self._forward_padded(ids_arr, pad, tree, _visible, last)
        aux = self._aux(n, tree, *(_visible or (None, None)))
        if self.keep_name:
            aux[self.keep_name] = np.array([n if last is None else last], np.int64)
        self._run(ids_arr, aux)
        logits = self.last_outputs[self.output_names[0]]
        if last is not None and logits.shape[0] != last:  # a graph without trim-logits: every row came back
            logits = self.last_outputs[self.output_names[0]] = logits[-last:]
        return logits

    def _forward_padded(self, ids_arr: np.ndarray, pad: int, tree: DraftTree | None, visible, last: int | None
                        ) -> np.ndarray:
        """:meth:`forward` of ``n`` tokens as a call of ``n + pad`` rows (``spec.min_rows``; the class docstring).

        The padded rows repeat the last token at the next positions; no real row attends to them. Their outputs
        are dropped and their cache slots cut, so the cache and :attr:`last_outputs` are those of the ``n`` tokens.
        """
        n = ids_arr.shape[1]
        m = n + pad
        padded = np.concatenate([ids_arr, np.repeat(ids_arr[:, -1:], pad, axis=1)], axis=1)
        if tree is None and visible is None:  # a chain: causal over the n + pad rows
            aux = self._aux(m)
        else:  # the real rows' bias and positions, plus pad rows that see the valid past and themselves
            aux = self._aux(n, tree, *(visible or (None, None)))
            self._grow(self.slots + m)
            bias = np.full((1, 1, m, self.slots + m), BIAS_NEG, np.float32)
            bias[0, 0, :n, : self.slots + n] = aux[self.bias_name][0, 0]
            bias[0, 0, n:, : self.slots][:, self._mask[0, : self.slots].astype(bool)] = 0.0
            bias[0, 0, n:, self.slots + n :][np.diag_indices(pad)] = 0.0
            aux[self.bias_name] = bias
            pos = np.asarray(aux[self.pos_name], np.int64).reshape(1, n)
            aux[self.pos_name] = np.concatenate([pos, pos.max() + 1 + np.arange(pad, dtype=np.int64)[None]], axis=1)
            if self.mask_name:
                aux[self.mask_name] = self._mask[:, : self.slots + m]
        keep = n if last is None else last
        if self.keep_name:  # the last rows of the call hold the pad: keep them too, at least min_rows rows
            aux[self.keep_name] = np.array([min(m, max(keep + pad, self.spec.min_rows))], np.int64)
        self._run(padded, aux)
        outs = {}
        for k, a in self.last_outputs.items():
            if k == self.output_names[0]:
                a = a[: a.shape[0] - pad][-keep:]
            elif a.ndim and a.shape[0] == m:  # per-row extra outputs (e.g. features)
                a = a[:n]
            outs[k] = a
        self.last_outputs = outs
        self._drop_tail(pad)
        return outs[self.output_names[0]]

    def _drop_tail(self, k: int) -> None:
        """Cut the last ``k`` physical slots, just written by a call (a padded call's extra rows)."""
        if self.shared:  # the next call overwrites them
            self.slots -= k
        else:
            self._keep(slice(0, self.slots - k))
            self.slots -= k
        self.length -= k

    def _run(self, ids_arr: np.ndarray, aux: dict[str, np.ndarray], extra: dict[str, np.ndarray] | None = None) -> None:
        """One session call on ``ids_arr`` ``[1, n]`` plus ``aux`` / ``extra`` feeds on top of the cache.

        Fills :attr:`last_outputs` (batch dim dropped) and grows the cache by ``n``.
        """
        n = ids_arr.shape[1]
        if self.cuda_graph and n == 1 and not extra and self.shared:
            self._run_graph(ids_arr)
            return
        feeds = {self.spec.input_ids: ids_arr, **aux, **(extra or {})}
        if self.keep_name and self.keep_name not in feeds:
            feeds[self.keep_name] = np.zeros(1, np.int64)  # every row
        nk = len(self.spec.kv)
        session = self.rows_session if self.use_rows and self.rows_session is not None and n >= self.rows_from \
            else self.session
        if self.shared or self.io_binding:
            if self.shared:
                self._reserve(self.slots + n)
            io = session.io_binding()
            for k, v in feeds.items():
                io.bind_cpu_input(k, np.ascontiguousarray(v))
            for e, v in zip(self.spec.kv, self.past):
                io.bind_ortvalue_input(e.past, v)
            io.bind_output(self.output_names[0], "cpu")
            for e, v in zip(self.spec.kv, self.past):
                if self.shared:  # GQA writes the new rows into the past buffer itself
                    io.bind_ortvalue_output(e.present, v)
                else:
                    io.bind_output(e.present, self.kv_device)
            for name in self.extra_names:
                io.bind_output(name, "cpu")
            t0 = time.perf_counter()
            try:
                session.run_with_iobinding(io, self._run_options if self.cuda_graph else None)
            except Exception as e:  # noqa: BLE001 - ORT raises its own types; only a shared buffer is explained here
                if not self.shared:
                    raise
                raise PlanError(
                    f"the {self.role} model does not write its KV cache in place as its plan says "
                    f"(kv_buffer=shared): {str(e).splitlines()[0][:200]}; recompile with "
                    "--passes explicit-attention,fuse-decoder (or run with kv_buffer='concat')"
                ) from None
            self.timer.add(self.role, time.perf_counter() - t0)
            outs = io.get_outputs()
            if not self.shared:
                self.past = list(outs[1 : 1 + nk])
            arrays = [outs[0].numpy(), *(v.numpy() for v in outs[1 + nk :])]
        else:
            for e, a in zip(self.spec.kv, self.past):
                feeds[e.past] = a
            t0 = time.perf_counter()
            outs = session.run(self.output_names, feeds)
            self.timer.add(self.role, time.perf_counter() - t0)
            self.past = outs[1 : 1 + nk]
            arrays = [outs[0], *outs[1 + nk :]]
        self.last_outputs = {k: a[0] for k, a in zip([self.output_names[0], *self.extra_names], arrays)}
        self.length += n
        self.slots += n

