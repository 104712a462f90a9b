"""PNG writing for generated images (no imaging library needed)."""

from __future__ import annotations

import os
import struct
import tempfile
import zlib
from pathlib import Path

import numpy as np

from dyncompile.errors import DataError

__all__ = ["png_bytes", "save_png"]


def png_bytes(image: np.ndarray) -> bytes:
    """A uint8 ``[H, W]`` (grey) or ``[H, W, 3]`` image encoded as PNG bytes."""
    img = np.ascontiguousarray(image, np.uint8)
    if img.ndim == 2:
        color, rows = 0, img
    elif img.ndim == 3 and img.shape[2] == 3:
        color, rows = 2, img.reshape(img.shape[0], -1)
    else:
        raise DataError(f"cannot write an image of shape {img.shape} as PNG")
    h, w = img.shape[:2]

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    raw = b"".join(b"\x00" + rows[i].tobytes() for i in range(h))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, color, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def save_png(path: str | Path, image: np.ndarray, *, replace: bool = True) -> Path:
    """Write a uint8 ``[H, W]`` (grey) or ``[H, W, 3]`` image as PNG, atomically (no imaging library needed).

    With ``replace=False`` an existing ``path`` is never replaced (:class:`~dyncompile.errors.OutputExistsError`),
    even one that appears while the file is written.
    """
    path = Path(path)
    png = png_bytes(image)
    if not path.parent.is_dir():
        raise DataError(f"cannot write {path}: folder {path.parent} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(png)
        os.chmod(tmp, 0o644)
        if replace:
            os.replace(tmp, path)
        else:
            _link_noreplace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _link_noreplace(tmp: str, path: Path) -> None:
    """Move ``tmp`` to ``path`` unless ``path`` exists (a hard link fails on an existing name)."""
    from dyncompile.errors import OutputExistsError

    try:
        os.link(tmp, path)
    except FileExistsError:
        raise OutputExistsError(f"{path} already exists; pass --force to replace it") from None
    except OSError:  # a file system without hard links: check, then rename
        if os.path.lexists(path):
            raise OutputExistsError(f"{path} already exists; pass --force to replace it") from None
        os.replace(tmp, path)
        return
    os.unlink(tmp)
