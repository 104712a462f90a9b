"""Repository hygiene: no file names a build machine's absolute path, and the user-facing text and the code
carry no run-by-run history (issue numbers, session ordinals, "superseded" notes).

Both checks scan the files git tracks (plus new files not ignored). The benchmark studies under
bench-results/ may keep dated narrative, so the history check leaves them out; the path check does not.
Each check has a negative control on planted files, so a scanner that stopped matching would fail here.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: absolute paths of a build machine: home folders, scratch and mount points, a named temp folder.
#: Not matched: `/tmp` alone, `/usr/bin/env`, `/proc/...`, `~/...`, `$TMPDIR/...`, relative paths, URLs.
MACHINE_PATH = re.compile(
    r"(?<![\w.~$/-])(?:/root/|/home/[A-Za-z_][\w.-]*|/Users/[A-Za-z_]|/work/|/opt/|/mnt/|/srv/|/scratch/"
    r"|/private/var/|/tmp/[\w.][\w.-]*|/var/tmp/[\w.]|[A-Z]:\\Users\\)"
)

#: (file, exact text) pairs that are not a build machine's path: reviewed one by one.
PATH_ALLOWED: set[tuple[str, str]] = {
    # the sandbox's own working folder on the private tmpfs it mounts (inside the namespace, not the host)
    ("runtime/routing/sandbox.py", "/tmp/work"),
}

HISTORY = re.compile(
    r"\bissues? #\d+"
    r"|\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|\d+(?:st|nd|rd|th))"
    r"[- ]sessions?\b"
    r"|\bsupersed(?:ed|es|ing)\b",
    re.IGNORECASE,
)

#: where history must not appear: the README, the docs, code, docstrings and tests (not bench-results/).
HISTORY_SUFFIXES = {".py", ".md", ".sh", ".toml", ".yml", ".yaml", ".cfg", ".txt"}
HISTORY_EXCLUDED_DIRS = ("bench-results/",)
HISTORY_ALLOWED: set[tuple[str, str]] = set()

#: this file spells the patterns and plants them in its negative controls
SELF = "tests/test_repo_hygiene.py"


def _tracked_files(root: Path) -> list[str]:
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout: the hygiene checks scan what git tracks")
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=root, capture_output=True, check=True,
    ).stdout.decode()
    return sorted({f for f in out.split("\0") if f and (root / f).is_file()})


def _text(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None  # binary (png, onnx, npz)
    return data.decode("utf-8", errors="replace")


def machine_paths(root: Path, files: list[str]) -> list[str]:
    """`file:line: text` for each build-machine path in ``files`` that is not allow-listed."""
    hits = []
    for f in files:
        text = _text(root / f)
        if text is None:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            for m in MACHINE_PATH.finditer(line):
                if (f, m.group(0)) not in PATH_ALLOWED:
                    hits.append(f"{f}:{n}: {m.group(0)}")
    return hits


def history_markers(root: Path, files: list[str]) -> list[str]:
    """`file:line: text` for each run-by-run history marker in the README, docs, code and tests."""
    hits = []
    for f in files:
        if f.startswith(HISTORY_EXCLUDED_DIRS) or Path(f).suffix not in HISTORY_SUFFIXES:
            continue
        text = _text(root / f)
        if text is None:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            for m in HISTORY.finditer(line):
                if (f, m.group(0).lower()) not in HISTORY_ALLOWED:
                    hits.append(f"{f}:{n}: {m.group(0)}")
    return hits


def test_no_build_machine_paths():
    hits = machine_paths(ROOT, [f for f in _tracked_files(ROOT) if f != SELF])
    assert not hits, (
        "absolute paths of a build machine (spell them ~/.cache/dyncompile/..., $DYNCOMPILE_HOME/..., "
        "$TMPDIR/... or relative):\n" + "\n".join(hits[:200])
    )


def test_no_run_by_run_history():
    hits = history_markers(ROOT, [f for f in _tracked_files(ROOT) if f != SELF])
    assert not hits, (
        "run-by-run history in the README, docs, code or tests (say what is true now; dated narrative "
        "belongs in bench-results/<study>/README.md):\n" + "\n".join(hits[:200])
    )


def test_scanners_catch_planted_files(tmp_path):
    """Negative controls: planted paths and history markers are caught, their look-alikes are not."""
    (tmp_path / "bad.py").write_text(
        'CACHE = "/root/.cache/x"\n'
        'HOME = "/home/builder/models"\n'
        'OUT = "/tmp/scratch-run/plan"\n'
        "# fixed in issue #7, see the third session; superseded below\n"
    )
    (tmp_path / "fine.py").write_text(
        "#!/usr/bin/env python3\n"
        '"""Writes under /tmp (or $TMPDIR/plans), reads /proc/self/status, caches in ~/.cache/dyncompile."""\n'
        'URL = "https://github.com/onnx/ir-py/work/tree"\n'
        'REL = "../shared/data/sentiment"\n'
        "# one ORT session per plan; the session is superb\n"
    )
    (tmp_path / "bench-results").mkdir()
    (tmp_path / "bench-results" / "README.md").write_text("Measured in the ninth session (2026-11-27).\n")
    files = ["bad.py", "fine.py", "bench-results/README.md"]

    paths = machine_paths(tmp_path, files)
    assert [h.split(":")[0] for h in paths] == ["bad.py"] * 3, paths
    history = history_markers(tmp_path, files)
    assert sorted(h.split(": ", 1)[1].lower() for h in history) == ["issue #7", "superseded", "third session"], history
