"""File and data I/O shared by the compiler and the runtime (the neutral layer).

Model loading with clear errors, the ``dyncompile-model.json`` beside a model, JSONL data files, sha256,
atomic writes of files and output directories, external-data folders, and the ``shared/`` folder of a
checkout. Imports nothing from ``dyncompile`` but :mod:`dyncompile.errors`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import onnx_ir as ir

from dyncompile.errors import DataError, ModelLoadError, OutputExistsError

logger = logging.getLogger(__name__)

__all__ = [
    "MODEL_CONFIG_NAME",
    "STAGING_MARK",
    "atomic_output_dir",
    "check_output_dir",
    "clone_or_copy",
    "clean_stale_staging",
    "external_data_dirs",
    "load_input_model",
    "read_jsonl",
    "read_model_config",
    "sha256_file",
    "rename_noreplace",
    "shared_dir",
    "temp_files_inside",
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
    if p.is_dir():
        raise DataError(f"{p} is a directory; expected a JSONL file with a {text_field!r} field per line")
    if not p.is_file():
        raise DataError(f"data file not found: {p}")
    rows = []
    with p.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{p}:{lineno}: not UTF-8 text (byte {e.start}: {e.reason}); save the file as UTF-8 JSONL"
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except RecursionError:
                raise DataError(f"{p}:{lineno}: JSON nested too deeply; expected one flat object per line") from None
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
        elif isinstance(lab, str) and lab.strip().lstrip("-").isdigit():
            lab = int(lab)
        if isinstance(lab, bool) or not isinstance(lab, int):
            raise DataError(f"label {str(lab)[:40]!r} is neither a class index nor one of {labels}") from None
        out.append(lab)
    return texts, out


def load_input_model(path: str | Path) -> ir.Model:
    """Load an ONNX model for compilation, turning every way it can be bad into one clear error."""
    import onnx

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
    except Exception as e:  # noqa: BLE001 - protobuf / JSON / text-format parsers raise their own types
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
        cfg = json.loads(cfg_path.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise DataError(f"{cfg_path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise DataError(f"{cfg_path} must hold a JSON object (the model's config), got {type(cfg).__name__}")
    for key, (ok, what) in _MODEL_CONFIG_FIELDS.items():
        if key in cfg and not ok(cfg[key]):
            raise DataError(
                f"{cfg_path}: {key} must be {what}, got {str(cfg[key])[:60]!r}; fix the model config (or rebuild it "
                "with `dyncompile models build`)"
            )
    return cfg


def _is_int(v: Any, lo: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v < 2**31


_MODEL_CONFIG_FIELDS: dict[str, tuple[Any, str]] = {
    # the fields dyncompile reads from a dyncompile-model.json (it may come with a model from a stranger)
    "task": (lambda v: isinstance(v, str), "a string"),
    "name": (lambda v: isinstance(v, str), "a string"),
    "family": (lambda v: isinstance(v, str), "a string"),
    "labels": (lambda v: isinstance(v, list) and bool(v) and all(isinstance(x, str) for x in v), "a list of strings"),
    "max_length": (lambda v: _is_int(v, 1), "a positive integer"),
    "num_layers": (lambda v: _is_int(v, 1), "a positive integer"),
    "hidden_size": (lambda v: _is_int(v, 1), "a positive integer"),
    "vocab_size": (lambda v: _is_int(v, 1), "a positive integer"),
    "max_position_embeddings": (lambda v: v is None or _is_int(v, 2), "an integer >= 2"),
    "eos_token_id": (lambda v: v is None or _is_int(v) or (isinstance(v, list) and all(_is_int(x) for x in v)),
                     "a token id or a list of token ids"),
    "bos_token_id": (lambda v: v is None or _is_int(v), "a token id"),
    "pad_token_id": (lambda v: v is None or _is_int(v), "a token id"),
    "chat_template": (lambda v: v is None or isinstance(v, str), "a string"),
    "padding_side": (lambda v: v in ("left", "right"), "'left' or 'right'"),
    "hf_dir": (lambda v: isinstance(v, str) and bool(v) and "\x00" not in v, "a folder name"),
}


STAGING_MARK = ".dyncompile-staging"
"""File inside every staging / old-plan folder dyncompile creates beside an output (``.OUT.tmp-*``,
``.OUT.old-*``): ``pid host``; stale ones (their process is gone) are removed by the next compile."""

_PLAN_FORMAT_PREFIX = "dyncompile.plan/"
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


def json_cost_problem(data: bytes, *, max_items: int = 200_000, max_string: int = 1 << 20) -> str | None:
    """What makes JSON ``data`` costly to parse (too many values and keys, a too-long string), or None.

    Counted on the raw bytes before parsing (strings stripped, then separators and openers counted): linear,
    one copy at most, so a file under a size cap cannot cost seconds and a gigabyte to parse.
    """
    longest = 0
    pieces = []
    pos = 0
    for m in _JSON_STRING.finditer(data):
        longest = max(longest, m.end() - m.start() - 2)
        pieces.append(data[pos:m.start()])
        pos = m.end()
        if len(pieces) > max_items:
            break
    pieces.append(data[pos:])
    bare = b"".join(pieces)
    items = len(pieces) + bare.count(b",") + bare.count(b"[") + bare.count(b"{")
    if items > max_items:
        return f"more than {max_items} JSON items (values and keys; a real plan has a few thousand)"
    if longest > max_string:
        return f"a JSON string of {longest} characters (at most {max_string})"
    return None


def _plan_parts(path: Path) -> tuple[set[str], list[str]] | None:
    """(files plan.json names, sub-plan folders of a routed plan) of the plan directory ``path``, or None if no plan."""
    pj = path / "plan.json"
    try:
        if pj.is_symlink() or not pj.is_file() or pj.stat().st_size > 16 * 2**20:
            return None
        data = pj.read_bytes()
        if json_cost_problem(data):
            return None
        raw = json.loads(data.decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(raw, dict) or not str(raw.get("format", "")).startswith(_PLAN_FORMAT_PREFIX):
        return None
    names = {"plan.json"}
    files = raw.get("files") if isinstance(raw.get("files"), dict) else {}
    for fr in files.values():
        if isinstance(fr, dict):
            extra = fr.get("external_data")
            for rel in [fr.get("path"), *(extra if isinstance(extra, list) else [])]:
                if isinstance(rel, str) and rel:
                    names.add(rel)
    subs = []
    steps = raw.get("steps") if isinstance(raw.get("steps"), list) else []
    for st in steps:  # a routed plan's sub-plan folders (cascade / route steps)
        cands = st.get("candidates") if isinstance(st, dict) and st.get("kind") in ("cascade", "route") else None
        for c in cands if isinstance(cands, list) else []:
            rel = c.get("plan") if isinstance(c, dict) else None
            if isinstance(rel, str) and rel:
                subs.append(rel)
    return names, subs


def _norm(rel: str) -> str | None:
    """``rel`` as a clean relative POSIX path, or None if it leaves its folder."""
    parts = [p for p in rel.replace("\\", "/").split("/") if p not in ("", ".")]
    return None if not parts or ".." in parts or rel.startswith("/") else "/".join(parts)


def _stray_entries(path: Path, depth: int = 0) -> list[str] | None:
    """What in plan directory ``path`` its plan.json does not name (recursing into sub-plans); None if no plan."""
    parts = _plan_parts(path)
    if parts is None:
        return None
    named = {n for n in map(_norm, parts[0]) if n}
    subs = [n for n in map(_norm, parts[1]) if n]
    stray: list[str] = []
    for sub in subs:
        inner = _stray_entries(path / sub, depth + 1) if depth < 4 and (path / sub).is_dir() else None
        if inner is None and os.path.lexists(path / sub):
            stray.append(sub)
        stray.extend(f"{sub}/{x}" for x in inner or [])
    keep_dirs = {"/".join(n.split("/")[:i]) for n in [*named, *subs] for i in range(1, n.count("/") + 1)}
    seen = 0
    for root, dirs, files in os.walk(path):
        rel_root = os.path.relpath(root, path).replace(os.sep, "/")
        rel_root = "" if rel_root == "." else rel_root + "/"
        for d in list(dirs):
            rel = rel_root + d
            if rel in subs or os.path.islink(os.path.join(root, d)):
                dirs.remove(d)  # checked above / a link is never walked into
                if rel not in subs:
                    stray.append(rel)
            elif rel not in keep_dirs:
                dirs.remove(d)
                stray.append(rel)
        for f in files:
            seen += 1
            if rel_root + f not in named:
                stray.append(rel_root + f)
        if seen > 100_000 or len(stray) > 100:
            break
    return stray


def check_output_dir(out_dir: str | Path, *, force: bool = False, protect: tuple[str | Path, ...] = ()) -> Path:
    """Check that compiling into ``out_dir`` may go ahead; returns its absolute path.

    Without ``force`` the directory must not exist. With ``force`` it may exist only as an empty directory
    or a dyncompile plan directory (a ``plan.json`` of this format and nothing but the files it names);
    never the working directory or one of its ancestors, never a folder holding a ``protect``ed path (the
    input model and its data), never a symlink, and never a directory with anything its plan.json does not name
    (sub-plans checked the same way). An output inside a ``protect``ed directory is refused even without
    ``force``: an input is never written into.

    Raises:
        OutputExistsError: any of the above.
    """
    out = Path(os.path.abspath(Path(out_dir).expanduser()))
    real_out = out.resolve()
    for p in protect:
        pr = Path(p).expanduser().resolve()
        if pr.is_dir() and pr in real_out.parents:
            raise OutputExistsError(
                f"output directory {out} is inside {pr} (an input of this command); an input is never written "
                "into — choose an -o outside it"
            )
    if not os.path.lexists(out):
        return out
    if not force:
        raise OutputExistsError(f"output directory {out} already exists; pass --force to replace it")
    if out.is_symlink():
        raise OutputExistsError(f"output path {out} is a symlink; --force replaces only a real plan directory")
    if not out.is_dir():
        raise OutputExistsError(
            f"output path {out} exists and is not a directory; --force replaces only a plan directory — choose another -o"
        )
    real = out.resolve()
    cwd = Path.cwd().resolve()
    if real == cwd or real in cwd.parents:
        raise OutputExistsError(
            f"output directory {out} is the working directory or one of its ancestors; --force will not replace "
            "it — choose a new directory for -o"
        )
    for p in protect:
        pr = Path(p).expanduser().resolve()
        if pr == real or real in pr.parents:
            raise OutputExistsError(
                f"output directory {out} holds {pr} (an input of this compile); --force will not replace it — "
                "choose another -o"
            )
    entries = sorted(e.name for e in out.iterdir())
    if not entries:
        return out
    stray = _stray_entries(out)
    if stray is None:
        raise OutputExistsError(
            f"output directory {out} exists and is not a dyncompile plan (no plan.json of this format; it holds "
            f"{', '.join(entries[:3])}{'…' if len(entries) > 3 else ''}); --force replaces only a plan directory or "
            "an empty one — choose another -o"
        )
    if stray:
        raise OutputExistsError(
            f"output directory {out} is a plan but also holds {', '.join(stray[:3])}, which the plan does not name; "
            "--force replaces only a plan directory — move those files away or choose another -o"
        )
    return out


def _mark(folder: Path) -> None:
    # written aside and renamed into place: a kill -9 mid-write must not leave an empty mark, which
    # clean_stale_staging cannot read (no pid) and would then never remove
    part = folder / (STAGING_MARK + ".part")
    part.write_text(f"{os.getpid()} {os.uname().nodename if hasattr(os, 'uname') else ''}\n")
    os.replace(part, folder / STAGING_MARK)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def clean_stale_staging(out: Path) -> list[Path]:
    """Remove the ``.OUT.tmp-*`` / ``.OUT.old-*`` folders beside ``out`` that an interrupted dyncompile left.

    Only folders carrying :data:`STAGING_MARK` whose process is gone on this host are removed; anything
    else with a similar name is left alone. Returns the removed folders.
    """
    removed = []
    host = os.uname().nodename if hasattr(os, "uname") else ""
    try:
        cands = [p for p in out.parent.iterdir() if p.name.startswith((f".{out.name}.tmp-", f".{out.name}.old-"))]
    except OSError:
        return removed
    for c in cands:
        mark = c / STAGING_MARK
        if c.is_symlink() or not c.is_dir() or not mark.is_file():
            continue
        try:
            pid_text, _, mark_host = mark.read_text().strip().partition(" ")
            pid = int(pid_text)
        except (OSError, ValueError):
            continue
        if mark_host == host and pid != os.getpid() and not _alive(pid):
            shutil.rmtree(c, ignore_errors=True)
            removed.append(c)
            logger.info("removed %s left by an interrupted dyncompile (pid %d)", c, pid)
    return removed


_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


def rename_noreplace(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst`` in one step that fails with ``FileExistsError`` if ``dst`` exists.

    Linux ``renameat2(RENAME_NOREPLACE)``; elsewhere (or where the file system lacks it) a hard link of a
    file / ``os.rename`` after an existence check (a small race window remains there).
    """
    import ctypes
    import errno

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        fn = None
    if fn is not None:
        rc = fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE)
        if rc == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST or err == errno.ENOTEMPTY:
            raise FileExistsError(err, os.strerror(err), str(dst))
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(err, os.strerror(err), str(dst))
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)


@contextlib.contextmanager
def atomic_output_dir(out_dir: str | Path, *, force: bool = False, protect: tuple[str | Path, ...] = ()):
    """Yield a staging dir beside ``out_dir`` (``.OUT.tmp-*``); on success it becomes ``out_dir`` in one rename.

    The target is checked by :func:`check_output_dir` before and again right before the rename; the rename
    itself never replaces anything that appeared meanwhile (another compile's plan): without ``force`` that
    is an :class:`OutputExistsError`; with ``force`` only a plan directory (or an empty one) is moved aside
    and replaced. On any error the staging dir is removed and ``out_dir`` is left exactly as it was. Stale
    staging folders of interrupted compiles beside ``out_dir`` are cleaned first.
    """
    out = check_output_dir(out_dir, force=force, protect=protect)
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_staging(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes 0700; a plan directory gets the permissions mkdir would give
    try:
        _mark(tmp)
        yield tmp
        (tmp / STAGING_MARK).unlink(missing_ok=True)
        try:
            rename_noreplace(tmp, out)
            return
        except FileExistsError:
            pass
        # the target exists now (appeared since the first check, or --force over an existing plan)
        check_output_dir(out, force=force, protect=protect)
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        _mark(old)
        os.rename(out, old / out.name)
        try:
            rename_noreplace(tmp, out)
        except FileExistsError:
            os.rename(old / out.name, out)  # yet another writer won the race: put the plan back, give up
            shutil.rmtree(old, ignore_errors=True)
            raise OutputExistsError(f"output directory {out} was created by another process meanwhile; nothing written") from None
        shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def temp_files_inside(folder: Path) -> Iterator[Path]:
    """Point :mod:`tempfile` at ``folder`` (created) for the body: temporary copies that passes or the
    libraries they call make (e.g. ORT's quantizer) land inside the compile's staging folder, so an
    interrupted compile leaves them only there (cleaned by the next compile), never anonymous in /tmp."""
    folder.mkdir(parents=True, exist_ok=True)
    old = tempfile.tempdir
    tempfile.tempdir = str(folder)
    try:
        yield folder
    finally:
        tempfile.tempdir = old
        shutil.rmtree(folder, ignore_errors=True)


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


_FICLONE = 0x40049409  # Linux ioctl: share the data blocks copy-on-write (Btrfs, XFS with reflink, ...)


def clone_or_copy(src: Path, dst: Path) -> None:
    """Copy ``src`` to the new file ``dst``: a reflink where the file system makes one, else a full copy.

    A reflink shares blocks copy-on-write (instant, no extra disk until one side changes); a full copy costs
    the file's size in disk and about 1 s per GB. Either way ``dst`` is a file of its own: an edit of one
    never shows up in the other (plans never share inodes unless the user asks for a hard link).
    """
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        shutil.copyfile(src, dst)
        return
    with open(src, "rb") as fs, open(dst, "xb") as fd:
        try:
            fcntl.ioctl(fd.fileno(), _FICLONE, fs.fileno())
            return
        except OSError:  # no reflinks here (ext4, tmpfs, another file system): copy the bytes
            pass
        shutil.copyfileobj(fs, fd, 2**22)
