"""The ONNX files of a plan as ONNX Runtime gets them: the bytes that were hashed, external data included.

A plan's sha256 protects only what is run from the bytes that were hashed. So nothing hands ONNX Runtime a
path: :func:`read_model` reads the ONNX file once into memory, hashes those bytes and checks them against
``plan.json``, then reads each external-data file the model names once, hashes and checks it the same way,
and returns the bytes; the runtime passes the model bytes to ``InferenceSession`` and the external data
from memory (``SessionOptions.add_external_initializers_from_files_in_memory``). A file swapped on disk
after the plan was loaded is one :class:`~dyncompile.errors.PlanError`, never another model's answer.

Every external-data location of an ONNX file must be a file entry of the plan (with its sha256), inside
the plan directory: :func:`external_locations` checks it, at load (:func:`~dyncompile.plan.load_plan`) and
again here. Tensors stored externally inside subgraphs (``If`` branches), node attributes or functions are
inlined into the model bytes (ONNX Runtime's checker looks for those on disk); the main graph's
initializers stay external and come from memory, so a decoder with more than 2 GB of weights still loads
(protobuf's 2 GB limit applies to the serialized model only).

External data files are memory-mapped read-only (:class:`ModelBytes` ``external`` holds the maps), hashed
through the map, and ONNX Runtime copies its initializers out of the map while the session is made. The
mapped pages are the file's page cache (clean, reclaimable), not the process's own memory: for Qwen2.5-Coder-1.5B's
7.1 GB `-O2` plan the anonymous peak while the session is made went from 23.2 GB (the file read into memory, then
ONNX Runtime's copy and its weight reordering beside it) to about 16 GB. The hashed pages are what ONNX Runtime
copies unless the file is written in place between the hash and the copy: :meth:`ModelBytes.check_unchanged`,
called once the session exists, compares each mapped file's inode, size, modification and change times with
those taken before the hash (an in-place write moves the change time, which no user can set back) and hashes the
map again, and raises :class:`~dyncompile.errors.PlanError` on any difference. The second hash costs about 5 s (1.5 GB/s) of
the 1.5B plan's 50-60 s session. The ONNX file itself (small) is read into memory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import mmap
import os
import posixpath
from collections.abc import Iterable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from dyncompile.errors import PlanError

__all__ = ["ModelBytes", "external_locations", "external_tensors", "may_have_external_data", "parse_model", "read_model"]


@dataclasses.dataclass(frozen=True)
class ModelBytes:
    """An ONNX file of a plan, ready for ONNX Runtime.

    Attributes:
        model: the serialized model (the hashed file, or the model derived from it with its
            subgraph-level external tensors inlined from the hashed external data).
        external: external-data location (as the model names it) -> the hashed bytes of that file.
    """

    model: bytes
    external: dict[str, Any]
    stats: dict[str, tuple[Path, tuple[int, ...], str | None]] = dataclasses.field(default_factory=dict)

    def check_unchanged(self) -> None:
        """Raise :class:`PlanError` if a mapped external-data file was written since it was hashed.

        Called once ONNX Runtime has copied the initializers (the session exists): the file has the inode, size,
        modification and change time it had before the first hash, and the mapped bytes hash to the plan's sha256
        again (a write within one tick of the file system's clock leaves the times as they were), so the bytes
        ONNX Runtime copied are the bytes that were hashed.
        """
        for loc, (path, before, sha) in self.stats.items():
            try:
                now = _stat_key(os.stat(path))
            except OSError as e:
                raise PlanError(f"external data {loc!r} ({path}) went away while the session was made "
                                f"({e.strerror or e}); restore the plan's files and load it again") from None
            if now != before or (sha is not None and hashlib.sha256(self.external[loc]).hexdigest() != sha):
                raise PlanError(f"external data {loc!r} ({path}) was written while ONNX Runtime read it (it changed "
                                "after the hash); nothing was run from it — restore the file, and load the plan "
                                "again")

    def release(self) -> None:
        """Close the maps (ONNX Runtime keeps its own copy once the session exists)."""
        _close_maps(self.external.values())


def may_have_external_data(data: bytes) -> bool:
    """False when the serialized model ``data`` surely stores no tensor as external data.

    An external tensor names its file in an entry with the key ``location``; bytes without that word hold none
    (a fast scan that spares parsing a large model with inline weights a second time).
    """
    return b"location" in data


def parse_model(data: bytes, where: str) -> Any:
    """Parse ``data`` as an ``onnx.ModelProto``.

    Raises:
        PlanError: the bytes are not an ONNX model.
    """
    import onnx

    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError, RecursionError on hostile nesting
        raise PlanError(f"{where} is not an ONNX model that ONNX Runtime can load (the protobuf does not parse: "
                        f"{type(e).__name__}); recompile the plan") from None
    return proto


def _graph_tensors(graph: Any, stack: list[Any]) -> Iterator[Any]:
    """The tensors held by ``graph``'s nodes' attributes; their subgraphs go onto ``stack``."""
    for node in graph.node:
        yield from _node_tensors(node, stack)


def _node_tensors(node: Any, stack: list[Any]) -> Iterator[Any]:
    """The tensors of ``node``'s attributes (sparse ones as values and indices); subgraphs go onto ``stack``."""
    for a in node.attribute:
        if a.HasField("t"):
            yield a.t
        yield from a.tensors
        for sp in [a.sparse_tensor] * a.HasField("sparse_tensor") + list(a.sparse_tensors):
            yield sp.values
            yield sp.indices
        if a.HasField("g"):
            stack.append(a.g)
        stack.extend(a.graphs)


def external_tensors(proto: Any) -> Iterator[tuple[Any, bool]]:
    """Every tensor of ``proto`` stored as external data, with True for the main graph's initializers.

    Walks the main graph, every subgraph (``If`` / ``Loop`` / ``Scan`` bodies, nested), node attributes,
    sparse tensors and model-local functions.
    """
    import onnx

    ext = onnx.TensorProto.EXTERNAL
    for t in proto.graph.initializer:
        if t.data_location == ext:
            yield t, True
    stack: list[Any] = [proto.graph]
    others: list[Any] = []
    for sp in proto.graph.sparse_initializer:
        others += [sp.values, sp.indices]
    for f in proto.functions:
        for node in f.node:
            others.extend(_node_tensors(node, stack))
    first = True
    while stack:
        g = stack.pop()
        if not first:
            others.extend(g.initializer)
            for sp in g.sparse_initializer:
                others += [sp.values, sp.indices]
        first = False
        others.extend(_graph_tensors(g, stack))
    for t in others:
        if t.data_location == ext:
            yield t, False


def _ext_info(t: Any, where: str) -> tuple[str, int, int | None]:
    """``(location, offset, length or None)`` of external tensor ``t``."""
    info = {e.key: e.value for e in t.external_data}
    loc = info.get("location")
    try:
        offset = int(info.get("offset") or 0)
        length = int(info["length"]) if info.get("length") not in (None, "") else None
    except ValueError:
        raise PlanError(f"{where}: tensor {t.name!r} has a malformed external-data offset or length; recompile "
                        "the plan") from None
    if not loc or offset < 0 or (length is not None and length < 0):
        raise PlanError(f"{where}: tensor {t.name!r} is stored as external data without a valid location, offset "
                        "or length; recompile the plan")
    return loc, offset, length


def _plan_rel(onnx_rel: str, loc: str, where: str) -> str:
    """The plan-relative path of external-data location ``loc`` of the ONNX file ``onnx_rel``."""
    p = PurePosixPath(loc)
    if p.is_absolute() or ".." in p.parts or "\\" in loc or "\x00" in loc or ":" in loc:
        raise PlanError(f"{where}: external data {loc!r} is outside the plan directory; a plan's weights must be "
                        "files of the plan (recompile it)")
    if p.as_posix() != loc or "." in p.parts:
        raise PlanError(f"{where}: external data location {loc!r} is not a plain relative path; recompile the plan")
    return posixpath.join(posixpath.dirname(onnx_rel), loc)


def external_locations(proto: Any, onnx_rel: str, plan_paths: set[str], where: str) -> dict[str, str]:
    """Check every external-data location of ``proto`` (the ONNX file ``onnx_rel`` of a plan).

    Args:
        proto: the parsed model.
        onnx_rel: the ONNX file's path relative to the plan directory.
        plan_paths: the paths of every file entry of the plan (each has a sha256).
        where: what to name in an error.

    Returns:
        location (as the model names it) -> path relative to the plan directory.

    Raises:
        PlanError: a location outside the plan directory, not a plain relative path, or not a file of the plan.
    """
    out: dict[str, str] = {}
    for t, _ in external_tensors(proto):
        loc = _ext_info(t, where)[0]
        if loc in out:
            continue
        rel = _plan_rel(onnx_rel, loc, where)
        if rel not in plan_paths:
            raise PlanError(
                f"{where}: external data {loc!r} (tensor {t.name!r}) is not a file of the plan: plan.json lists no "
                f"sha256 for {rel!r}, so its weights would run unchecked; recompile the plan (dyncompile lists "
                "every external-data file), or add the file to plan.json's files"
            )
        out[loc] = rel
    return out


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise PlanError(f"cannot read {what} ({path}): {e.strerror or e}; restore the plan's files") from None


def _stat_key(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _map(path: Path, what: str) -> tuple[Any, tuple[int, ...]]:
    """``path`` mapped read-only (its page cache, not a copy), with the stat key taken before anything is read."""
    try:
        with open(path, "rb") as f:
            key = _stat_key(os.fstat(f.fileno()))
            if key[2] == 0:
                return b"", key
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), key
    except (OSError, ValueError) as e:
        raise PlanError(f"cannot read {what} ({path}): {getattr(e, 'strerror', None) or e}; restore the plan's "
                        "files") from None


def _close_maps(buffers: Iterable[Any]) -> None:
    for buf in buffers:
        if isinstance(buf, mmap.mmap):  # an empty file is b"", never mapped
            buf.close()


def _check_hash(data: bytes, want: str, path: Path, what: str) -> None:
    actual = hashlib.sha256(data).hexdigest()
    if actual != want:
        raise PlanError(
            f"{what} ({path}) changed on disk after the plan was loaded: sha256 {actual[:12]}… != plan's "
            f"{want[:12]}…; nothing was run from it — restore the file, or load the plan again"
        )


def _inline(t: Any, buf: bytes, where: str) -> None:
    """Move external tensor ``t``'s bytes from ``buf`` (its hashed external file) into the tensor itself."""
    import onnx

    _, offset, length = _ext_info(t, where)
    end = len(buf) if length is None else offset + length
    if end > len(buf) or offset > len(buf):
        raise PlanError(f"{where}: tensor {t.name!r} lies beyond the end of its external data file; recompile the plan")
    t.raw_data = buf[offset:end]
    del t.external_data[:]
    t.data_location = onnx.TensorProto.DEFAULT


def read_model(plan: Any, key: str, *, check_hashes: bool = True) -> ModelBytes:
    """Read ONNX file ``key`` of ``plan`` and its external data once, check their sha256, return the bytes.

    Args:
        plan: a loaded :class:`~dyncompile.plan.Plan` (with its directory).
        key: the file key of the ONNX file.
        check_hashes: compare each file's sha256 with ``plan.json`` (off only for a plan loaded without hash checks).

    Returns:
        What ONNX Runtime gets: nothing of it is read from disk again.

    Raises:
        PlanError: a file changed on disk since load (sha256 mismatch), is missing, is not an ONNX model, or
            names external data that is not a hashed file of the plan.
    """
    ref = plan.files[key]
    path = plan.path_of(key)
    data = _read(path, f"file {key!r}")
    if check_hashes:
        _check_hash(data, ref.sha256, path, f"file {key!r}")
    where = f"file {key!r} ({ref.path})"
    if not may_have_external_data(data):
        return ModelBytes(data, {})
    proto = parse_model(data, where)
    by_path = {f.path: f for f in plan.files.values()}
    locs = external_locations(proto, ref.path, set(by_path), where)
    if not locs:
        return ModelBytes(data, {})
    buffers: dict[str, Any] = {}
    stats: dict[str, tuple[Path, tuple[int, ...], str | None]] = {}
    for loc, rel in locs.items():
        full = plan.directory / rel
        buf, stat_key = _map(full, f"external data {rel!r}")
        stats[loc] = (full, stat_key, by_path[rel].sha256 if check_hashes else None)
        if check_hashes:
            _check_hash(buf, by_path[rel].sha256, full, f"external data {rel!r} of file {key!r}")
        buffers[loc] = buf
    inlined = False
    served: set[str] = set()
    for t, main in external_tensors(proto):
        loc, offset, length = _ext_info(t, where)
        if main:
            if offset + (length or 0) > len(buffers[loc]):
                raise PlanError(f"{where}: tensor {t.name!r} lies beyond the end of its external data file; "
                                "recompile the plan")
            served.add(loc)
        else:
            _inline(t, buffers[loc], where)
            inlined = True
    if inlined:
        try:
            data = proto.SerializeToString()
        except ValueError as e:  # protobuf's 2 GB limit
            raise PlanError(f"{where}: the model with its subgraph weights inlined is too large ({e}); keep "
                            "subgraph weights under 2 GB") from None
    _close_maps(buffers[loc] for loc in set(buffers) - served)  # only inlined from: ORT never reads these maps
    return ModelBytes(data, {loc: buffers[loc] for loc in served}, {loc: stats[loc] for loc in served})
