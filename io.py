"""File and data I/O shared by the compiler and the runtime (the neutral layer).

Model loading with clear errors, the ``dyncompile-model.json`` beside a model, JSONL data files, sha256,
atomic writes of files and output directories, external-data folders, and the ``shared/`` folder of a
checkout. Imports nothing from ``dyncompile`` but :mod:`dyncompile.errors`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import onnx_ir as ir

from dyncompile.errors import DataError, ModelLoadError, OutputExistsError

__all__ = [
    "MODEL_CONFIG_NAME",
    "atomic_output_dir",
    "external_data_dirs",
    "load_input_model",
    "read_jsonl",
    "read_model_config",
    "sha256_file",
    "shared_dir",
    "texts_and_labels",
    "working_directory",
    "write_json_atomic",
]

MODEL_CONFIG_NAME = "dyncompile-model.json"


def shared_dir() -> Path:
    """The project's ``shared/`` folder (assets, data): ``$DYNCOMPILE_SHARED``, else ``../shared`` beside
    the checkout this package is imported from."""
    env = os.environ.get("DYNCOMPILE_SHARED")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent / "shared"


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, streamed."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write JSON to ``path`` through a temp file in the same directory and ``os.replace``."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=False)
            f.write("\n")
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a plan is an ordinary readable file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise




def read_jsonl(path: str | Path, *, limit: int | None = None, text_field: str = "text") -> list[dict]:
    """Rows of a JSONL file; each must be an object with a string ``text_field``."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"data file not found: {p}")
    rows = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{p}:{lineno}: not valid JSON ({e.msg}); expected one JSON object per line") from None
            if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
                raise DataError(f"{p}:{lineno}: each line needs a string field {text_field!r}; got {str(row)[:80]}")
            rows.append(row)
            if limit is not None and len(rows) >= limit:
                break
    if not rows:
        raise DataError(f"{p} holds no rows; expected JSONL with a {text_field!r} field per line")
    return rows


def texts_and_labels(rows: list[dict], labels: list[str] | None = None):
    """``(texts, labels or None)``; labels may be ints or label names (mapped through ``labels``)."""
    texts = [r["text"] for r in rows]
    if not all("label" in r for r in rows):
        return texts, None
    out = []
    for r in rows:
        lab = r["label"]
        if isinstance(lab, str) and labels and lab in labels:
            lab = labels.index(lab)
        try:
            out.append(int(lab))
        except (TypeError, ValueError):
            raise DataError(f"label {lab!r} is neither a class index nor one of {labels}") from None
    return texts, out


def load_input_model(path: str | Path) -> ir.Model:
    """Load an ONNX model for compilation, turning every way it can be bad into one clear error."""
    import onnx
    from google.protobuf.message import DecodeError

    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"model file not found: {p} (build one with `dyncompile models build minilm-l6-sentiment`)")
    if p.is_dir():
        hint = [c.name for c in p.glob("*.onnx")]
        raise ModelLoadError(
            f"{p} is a directory, not an ONNX file" + (f"; did you mean {p / hint[0]}?" if hint else "")
        )
    size = p.stat().st_size
    if size == 0:
        raise ModelLoadError(f"{p} is empty (0 bytes); re-export the model")
    try:
        proto = onnx.load(str(p), load_external_data=False)
    except (DecodeError, RuntimeError, ValueError, OSError) as e:
        raise ModelLoadError(
            f"{p} is not a valid ONNX model: the protobuf does not parse ({type(e).__name__}: {e}). If it is an "
            "ONNX file, it is probably truncated or corrupted (an interrupted copy/download): re-export it"
        ) from None
    if not proto.graph.node or not proto.opset_import:
        raise ModelLoadError(
            f"{p} parses as protobuf but is not a usable ONNX model (graph has {len(proto.graph.node)} nodes, "
            f"{len(proto.opset_import)} opset imports): it is either not ONNX or truncated; re-export it"
        )
    for init in proto.graph.initializer:
        for entry in init.external_data:
            if entry.key == "location" and not (p.parent / entry.value).is_file():
                raise ModelLoadError(
                    f"{p} stores weights in external data file {entry.value!r}, which is missing next to it "
                    f"({p.parent / entry.value}); copy it beside the model"
                )
    try:
        model = ir.load(str(p))
    except Exception as e:  # onnx-ir deserialisation errors
        raise ModelLoadError(f"{p}: onnx-ir could not read the model ({type(e).__name__}: {e})") from None
    return model


def read_model_config(model_path: Path, explicit: str | Path | None = None) -> dict[str, Any]:
    """The ``dyncompile-model.json`` written by ``dyncompile models build`` (beside the model), if any."""
    cfg_path = Path(explicit) if explicit else model_path.parent / MODEL_CONFIG_NAME
    if not cfg_path.is_file():
        if explicit:
            raise DataError(f"model config {cfg_path} not found")
        return {}
    try:
        return json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{cfg_path} is not valid JSON: {e}") from None


@contextlib.contextmanager
def atomic_output_dir(out_dir: str | Path, *, force: bool = False):
    """Yield a temp dir beside ``out_dir``; on success it replaces ``out_dir`` in one rename.

    Refuses an existing ``out_dir`` unless ``force``; on any error the temp dir is removed and
    ``out_dir`` is left exactly as it was.
    """
    out = Path(out_dir).resolve()
    if out.exists() and not force:
        raise OutputExistsError(f"output directory {out} already exists; pass --force to replace it")
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"output path {out} exists and is not a directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes 0700; a plan directory gets the permissions mkdir would give
    try:
        yield tmp
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def external_data_dirs(model: ir.Model) -> set[str]:
    """The folders the model's external-data initializers (large weights kept on disk) are read from."""
    return {
        str(v.const_value.base_dir)
        for g in model.graphs()
        for v in g.initializers.values()
        if isinstance(v.const_value, ir.ExternalTensor)
    }


@contextlib.contextmanager
def working_directory(path: str | None) -> Iterator[None]:
    """Run the body in ``path`` (no change when None): tools that resolve external-data locations against
    the working directory (the ONNX checker, ORT's quantizers) then find the weights."""
    if not path:
        yield
        return
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


