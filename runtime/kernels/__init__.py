"""dyncompile's own ONNX Runtime custom operators, compiled at first use with the system C compiler.

One library (domain ``dyncompile``, :data:`DOMAIN`) built from the C sources beside this file (:data:`SOURCES`),
holding :data:`OPS`:

* ``SparseRowsMatMul``: ``Y = X' W`` where ``X'`` is ``X`` with every entry ``|x| <= threshold`` dropped, reading
  only the weight rows of the entries kept (``sparse_rows.c`` says how and why it is deterministic). ONNX Runtime
  has no such kernel; the stock ``Gather`` + ``MatMul`` route copies the active rows before reading them again and
  cannot pay below ~70 % sparsity (``bench-results/contextual-sparsity``). Used by ``sparsify-activations``.
* ``QuantizeRows`` and ``ScaledResidualAdd`` (``int8_epilogues.c``): the per-row int8 quantization before an int8
  MatMul, and the row scale + bias + residual after one, each one kernel instead of five or three, bit-identical
  to the kernels they replace. Used by ``fuse-int8-epilogues``.

How the library is made (:func:`build_library`):

* the C source ships in the package; ``onnxruntime_c_api.h`` does not (ONNX Runtime's PyPI wheels carry no
  headers). It is looked up in ``$DYNCOMPILE_ORT_INCLUDE`` (a folder holding ``onnxruntime_c_api.h``, e.g. the
  ``include/`` of an ONNX Runtime release archive or NuGet package), then in the cache
  (``$DYNCOMPILE_HOME/kernels/include``), and else fetched once from the npm registry with ``npm pack`` of
  :data:`HEADER_PACKAGE` (which ships ONNX Runtime's C API header, API version 29), whose archive must have the
  pinned :data:`HEADER_PACKAGE_SHA256`;
* ``cc -O3 -shared`` (``$CC`` if set), with ``-mavx2 -mfma`` where the CPU has them (the library refuses to
  register on a CPU without the ISA it was built for), into ``$DYNCOMPILE_HOME/kernels/`` named after the sha256 of
  the source, header and flags; a JSON sidecar records the library's sha256, and :func:`library` checks it before
  anything loads the file. Written atomically (a half-built library is never seen).

:func:`register` gives an ``onnxruntime.SessionOptions`` the library after checking its sha256 against the one
its build recorded. A plan never carries the library (it would be native code from whoever wrote the plan): it
names the ops and the sha256 of the C source it was compiled against (``policy.custom_ops``), and the runtime
registers the library built here from this package's source (:func:`register_for_plan`). No C compiler (or no
header): :class:`KernelUnavailable`, one message saying what is missing and how to fix it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

from dyncompile.errors import DyncompileError

logger = logging.getLogger(__name__)

__all__ = [
    "DOMAIN",
    "HEADER_PACKAGE",
    "HEADER_PACKAGE_SHA256",
    "OPS",
    "OP_TYPE",
    "KernelUnavailable",
    "build_library",
    "compiler",
    "kernels_home",
    "library",
    "register",
    "register_for_plan",
    "sha256_of",
    "source_sha256",
]

DOMAIN = "dyncompile"
#: the sparse-rows MatMul (``sparsify-activations``)
OP_TYPE = "SparseRowsMatMul"
#: every operator the library registers, as ``domain.op`` (what a plan's ``policy.custom_ops`` may name)
OPS = tuple(f"{DOMAIN}.{op}" for op in (OP_TYPE, "QuantizeRows", "ScaledResidualAdd"))
#: the library's C sources, in build order (``register.c`` holds the entry point ORT calls)
SOURCES = tuple(Path(__file__).with_name(n) for n in ("register.c", "sparse_rows.c", "int8_epilogues.c"))
#: an npm package that ships ONNX Runtime's C API header (inside its iOS framework; the header is the same on
#: every platform): fetched by ``npm pack`` when no header is found, its archive checked against the pinned sha256
HEADER_PACKAGE = "com.github.asus4.onnxruntime@0.4.9"
HEADER_PACKAGE_SHA256 = "e59788788818fdde1b2e522e766a21ba0f7d8391de55737abf81e32cc801785d"
_HEADERS_IN_PACKAGE = "package/Plugins/iOS~/onnxruntime.xcframework/ios-arm64/onnxruntime.framework/Headers/"
HEADER = "onnxruntime_c_api.h"
#: the headers ``onnxruntime_c_api.h`` includes (itself first)
HEADERS = (HEADER, "onnxruntime_error_code.h", "onnxruntime_ep_c_api.h")
ENV_INCLUDE = "DYNCOMPILE_ORT_INCLUDE"


class KernelUnavailable(DyncompileError):  # noqa: N818 - reads as a state, like the other errors
    """The custom-op library cannot be built or loaded here (no C compiler, no ORT header, a changed file)."""


def sha256_of(path: Path) -> str:
    """sha256 (hex) of the file ``path``."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def kernels_home() -> Path:
    """``$DYNCOMPILE_HOME/kernels`` (default ``~/.cache/dyncompile/kernels``)."""
    env = os.environ.get("DYNCOMPILE_HOME")
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "dyncompile") / "kernels"


def compiler() -> str | None:
    """The C compiler to use: ``$CC``, else ``cc`` / ``gcc`` / ``clang`` on PATH; None if there is none."""
    for c in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if c and shutil.which(c):
            return shutil.which(c)
    return None


def _cpu_flags() -> list[str]:
    """The compiler's vector flags for this CPU (AVX2 + FMA where /proc/cpuinfo reports both on x86-64)."""
    from dyncompile.runtime.providers import cpu_flags

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    return ["-mavx2", "-mfma"] if {"avx2", "fma"} <= cpu_flags() else []


def _fetch_header(dest: Path) -> Path:
    """``npm pack`` :data:`HEADER_PACKAGE` into a temp folder, check its sha256, extract the header to ``dest``."""
    npm = shutil.which("npm")
    if npm is None:
        raise KernelUnavailable(
            f"building dyncompile's kernel library needs ONNX Runtime's C API header {HEADER}, which the onnxruntime "
            f"wheel does not ship, and npm (to fetch it from {HEADER_PACKAGE}) is not installed. Install npm, or set "
            f"{ENV_INCLUDE} to a folder holding {HEADER} (the include/ of an ONNX Runtime release), then compile again"
        )
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run([npm, "pack", HEADER_PACKAGE, "--silent"], cwd=tmp, capture_output=True, text=True,
                           timeout=300, check=False)
        tgz = sorted(Path(tmp).glob("*.tgz"))
        if r.returncode != 0 or not tgz:
            raise KernelUnavailable(
                f"npm pack {HEADER_PACKAGE} failed ({(r.stderr or r.stdout).strip()[:200]}): dyncompile's kernel library needs "
                f"ONNX Runtime's C API header; set {ENV_INCLUDE} to a folder holding {HEADER}, then compile again"
            )
        got = sha256_of(tgz[0])
        if got != HEADER_PACKAGE_SHA256:
            raise KernelUnavailable(f"{HEADER_PACKAGE} from npm has sha256 {got[:12]}…, not the pinned "
                                    f"{HEADER_PACKAGE_SHA256[:12]}…; refusing its header (set {ENV_INCLUDE} instead)")
        with tarfile.open(tgz[0]) as tf:
            data = {h: tf.extractfile(tf.getmember(_HEADERS_IN_PACKAGE + h)).read() for h in HEADERS}
    dest.mkdir(parents=True, exist_ok=True)
    for h in reversed(HEADERS):  # the main header last: its presence means the set is complete
        tmp_file = dest / f".{h}.{os.getpid()}"
        tmp_file.write_bytes(data[h])
        tmp_file.replace(dest / h)
    return dest / HEADER


def ort_header() -> Path:
    """``onnxruntime_c_api.h``: from ``$DYNCOMPILE_ORT_INCLUDE``, the cache, or fetched once (module docstring)."""
    env = os.environ.get(ENV_INCLUDE)
    if env:
        h = Path(env).expanduser() / HEADER
        if not h.is_file():
            raise KernelUnavailable(f"{ENV_INCLUDE}={env} holds no {HEADER}; point it at ONNX Runtime's include/ folder")
        return h
    cached = kernels_home() / "include" / HEADER
    if cached.is_file():
        return cached
    logger.info("fetching ONNX Runtime's C API header from the npm package %s (once)", HEADER_PACKAGE)
    return _fetch_header(cached.parent)


def build_library(force: bool = False) -> tuple[Path, dict]:
    """The built kernel library and its record (sha256, flags, compile seconds), building it if needed.

    Raises:
        KernelUnavailable: no C compiler, no header, or the compile failed (with the compiler's first lines).
    """
    cc = compiler()
    if cc is None:
        raise KernelUnavailable(
            "dyncompile's custom-op kernels are compiled at first use and no C compiler was found (tried $CC, cc, gcc, "
            "clang). Install one (e.g. `apt-get install gcc`) or set CC, then compile again"
        )
    header = ort_header()
    flags = ["-O3", "-std=c11", "-fPIC", "-shared", "-fvisibility=hidden", "-fno-math-errno", *_cpu_flags()]
    headers = "".join(sha256_of(header.parent / h) for h in HEADERS if (header.parent / h).is_file())
    key = hashlib.sha256(source_sha256().encode() + headers.encode() + " ".join(flags).encode()).hexdigest()[:16]
    home = kernels_home()
    lib = home / f"libdyncompile_kernels-{key}.so"
    meta_path = lib.with_suffix(".json")
    if lib.is_file() and meta_path.is_file() and not force:
        return lib, json.loads(meta_path.read_text())
    home.mkdir(parents=True, exist_ok=True)
    tmp = home / f".{lib.name}.{os.getpid()}.tmp"
    cmd = [cc, *flags, "-I", str(header.parent), *map(str, SOURCES), "-o", str(tmp), "-lm"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    secs = time.perf_counter() - t0
    if r.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        first = "\n".join((r.stderr or r.stdout).strip().splitlines()[:5])
        raise KernelUnavailable(f"compiling {', '.join(p.name for p in SOURCES)} with {cc} failed:\n{first}\nfix the compiler setup (or CC) "
                                "and compile again")
    meta = {"ops": list(OPS), "library": lib.name, "sha256": sha256_of(tmp), "source_sha256":
            source_sha256(), "header_sha256": sha256_of(header), "compiler": Path(cc).name, "flags": flags,
            "compile_seconds": round(secs, 3)}
    tmp.replace(lib)
    tmp_meta = meta_path.with_name(f".{meta_path.name}.{os.getpid()}")
    tmp_meta.write_text(json.dumps(meta, indent=2))
    tmp_meta.replace(meta_path)
    logger.info("built %s in %.1f s (%s)", lib.name, secs, " ".join(flags))
    return lib, meta


def library() -> tuple[Path, str]:
    """``(path, sha256)`` of the built library (built if needed), its sha256 checked against its record."""
    lib, meta = build_library()
    got = sha256_of(lib)
    if got != meta["sha256"]:
        raise KernelUnavailable(f"{lib} changed after it was built (sha256 {got[:12]}… != recorded "
                                f"{meta['sha256'][:12]}…); delete it and its .json to rebuild")
    return lib, got


def source_sha256() -> str:
    """sha256 of the library's C sources as installed, in :data:`SOURCES` order (what ``policy.custom_ops`` names)."""
    h = hashlib.sha256()
    for path in SOURCES:
        h.update(f"{path.name}\0{sha256_of(path)}\0".encode())
    return h.hexdigest()


def register_for_plan(session_options, ops: list[str], plan_source_sha256: str) -> None:
    """Register the library a plan's ``policy.custom_ops`` asks for: the one built here from this package's source.

    Raises:
        KernelUnavailable: the plan asks for an op this package does not build, or was compiled against another
            version of the kernel's source, or the library cannot be built here.
    """
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        raise KernelUnavailable(f"the plan needs custom ops {unknown} that this dyncompile does not provide; "
                                "compile the plan with this version")
    mine = source_sha256()
    if plan_source_sha256 != mine:
        raise KernelUnavailable(f"the plan was compiled against other sources of dyncompile's kernels (sha256 "
                                f"{plan_source_sha256[:12]}…, this installation has {mine[:12]}…); compile the plan "
                                "again with this version of dyncompile")
    register(session_options, *library())


def register(session_options, path: Path, sha256: str) -> None:
    """Give ``session_options`` the custom-op library at ``path`` once its sha256 is the one expected."""
    got = sha256_of(path)
    if got != sha256:
        raise KernelUnavailable(f"custom-op library {path} has sha256 {got[:12]}…, not the expected {sha256[:12]}…; "
                                "refusing to load it (recompile the plan)")
    session_options.register_custom_ops_library(str(path))
