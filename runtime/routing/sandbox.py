"""Run an untrusted Python program (model-generated code) in a sandboxed subprocess.

What a run gets (Linux; the strongest set the process is allowed to build, reported in
:attr:`SandboxResult.isolation`):

* always: a separate process in its own session, ``python -I -S`` (no site-packages, no user site, no
  ``PYTHON*`` variables) with a minimal environment, a fresh temporary working directory removed afterwards,
  a wall-clock timeout (the whole process tree is killed) and resource limits: ``RLIMIT_CPU`` (CPU seconds),
  ``RLIMIT_AS`` (address space), ``RLIMIT_FSIZE`` (largest file written, stdout/stderr included),
  ``RLIMIT_NOFILE``, ``RLIMIT_CORE`` 0 and ``RLIMIT_NPROC``;
* when the parent may create namespaces (root in a container, or ``CAP_SYS_ADMIN``): new network, mount
  and PID namespaces (``unshare(2)``): no network interface but a down loopback, so every ``connect`` fails;
  private tmpfs mounts over ``/tmp``, ``/var/tmp`` and ``/dev/shm`` (the working directory lives in the
  private ``/tmp`` and vanishes with the namespace); the program is PID 1 of its namespace, so when it ends
  or is killed every process it started is killed by the kernel; it runs as a fresh unprivileged user id
  (a random one in ``[2**20, 2**21)``, no entry in ``/etc/passwd``): it cannot write to files of other
  users, and ``RLIMIT_NPROC`` (not enforced for root) caps its processes and threads, which stops a fork bomb.

Without namespace rights (an unprivileged CI runner) only the "always" part applies; ``isolation`` says so.
Reading world-readable files is not prevented.

Sketch: the parent starts a small launcher (``python -I -S -c _LAUNCHER``) in a new session, with the program
on stdin. The launcher builds the namespaces and mounts, forks; the child (PID 1 of the new PID namespace)
drops to the sandbox uid, sets its parent-death signal and the limits, and ``execv``-s ``python -I -S
main.py`` in the private working directory. stdout/stderr go to temporary files (bounded by ``RLIMIT_FSIZE``)
that the parent reads back. On a wall-clock timeout the parent asks the launcher (SIGTERM) to kill the program and wait
until its PID namespace is empty, then kills the launcher's process group; the program's parent-death
signal covers a launcher that died first.

This module never imports anything outside the standard library.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["SandboxLimits", "SandboxResult", "run_python", "isolation_available"]


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run."""

    timeout_s: float = 10.0          # wall clock for the whole run
    cpu_s: int = 10                  # RLIMIT_CPU of the program
    memory_mb: int = 1024            # RLIMIT_AS of the program
    max_processes: int = 32          # RLIMIT_NPROC of the sandbox uid (processes + threads)
    max_file_mb: int = 16            # RLIMIT_FSIZE: largest file (and stdout/stderr) written
    max_open_files: int = 64         # RLIMIT_NOFILE
    tmpfs_mb: int = 64               # size of each private tmpfs (/tmp, /var/tmp, /dev/shm)
    max_output_chars: int = 20000    # stdout/stderr kept in the result (the tail)


@dataclasses.dataclass
class SandboxResult:
    """What happened: ``returncode`` (negative: killed by that signal), output tails, timing, isolation."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    wall_s: float
    isolation: dict[str, Any]

    @property
    def ok(self) -> bool:
        """The program exited 0 within its time limit."""
        return self.returncode == 0 and not self.timed_out

    def to_dict(self) -> dict[str, Any]:
        """The result as a JSON-ready dict."""
        return dataclasses.asdict(self)


# The launcher runs in a fresh interpreter (no threads: safe to fork). argv[1] is a JSON config.
# It reports what it managed to isolate as one JSON line on cfg['report_fd'] before running the program.
_LAUNCHER = r'''
import ctypes, json, os, resource, signal, sys
cfg = json.loads(sys.argv[1])
program = sys.stdin.buffer.read()
iso = {"netns": False, "mountns": False, "pidns": False, "tmpfs": False, "uid": None, "errors": []}
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWPID = 0x00020000, 0x40000000, 0x20000000
MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 2, 4, 16384, 1 << 18
def err(what):
    e = ctypes.get_errno(); iso["errors"].append(f"{what}: {os.strerror(e)}")
want = cfg["isolate"]
if want and libc.unshare(CLONE_NEWNET) == 0: iso["netns"] = True
elif want: err("unshare(CLONE_NEWNET)")
if want and libc.unshare(CLONE_NEWNS) == 0:
    iso["mountns"] = True
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0: err("mount --make-rprivate /")
    ok = True
    for d in (b"/tmp", b"/var/tmp", b"/dev/shm"):
        if os.path.isdir(d) and libc.mount(b"tmpfs", d, b"tmpfs", MS_NOSUID | MS_NODEV,
                                           f"size={cfg['tmpfs_mb']}m,mode=1777".encode()) != 0:
            ok = False; err(f"mount tmpfs {d.decode()}")
    iso["tmpfs"] = ok
elif want: err("unshare(CLONE_NEWNS)")
if want and libc.unshare(CLONE_NEWPID) == 0: iso["pidns"] = True
elif want: err("unshare(CLONE_NEWPID)")
uid = cfg["uid"] if (want and os.geteuid() == 0) else None
workdir = "/tmp/work" if iso["tmpfs"] else cfg["workdir"]
os.makedirs(workdir, exist_ok=True)
with open(os.path.join(workdir, "main.py"), "wb") as f:
    f.write(program)
if uid is not None:
    os.chown(workdir, uid, uid); os.chmod(workdir, 0o700)
    iso["uid"] = uid
iso["python"] = cfg["python"]
os.write(cfg["report_fd"], (json.dumps(iso) + "\n").encode()); os.close(cfg["report_fd"])
pid = os.fork()
if pid == 0:
    try:
        if uid is not None:
            os.setgroups([]); os.setgid(uid); os.setuid(uid)
        libc.prctl(1, signal.SIGKILL)           # PR_SET_PDEATHSIG (after setuid, which clears it)
        lim = cfg["limits"]
        for name, v in (("RLIMIT_CPU", lim["cpu_s"]), ("RLIMIT_AS", lim["memory_mb"] << 20),
                        ("RLIMIT_FSIZE", lim["max_file_mb"] << 20), ("RLIMIT_NOFILE", lim["max_open_files"]),
                        ("RLIMIT_CORE", 0), ("RLIMIT_NPROC", lim["max_processes"])):
            resource.setrlimit(getattr(resource, name), (v, v))
        os.chdir(workdir)
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
               "PYTHONDONTWRITEBYTECODE": "1"}
        os.execve(cfg["python"], [cfg["python"], "-I", "-S", "-B", "main.py"], env)
    except BaseException as e:
        os.write(2, f"sandbox launcher: {e!r}\n".encode())
        os._exit(126)
def _stop(signum, frame):  # the parent's timeout: kill the program (PID 1 of its namespace: all of it)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
signal.signal(signal.SIGTERM, _stop)
_, status = os.waitpid(pid, 0)  # returns once the namespace's last process is gone
if os.WIFSIGNALED(status):
    os._exit(128 + os.WTERMSIG(status))
os._exit(os.WEXITSTATUS(status))
'''


def _tail(path: str, n: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 4 * n))
            return f.read().decode("utf-8", "replace")[-n:]
    except OSError:
        return ""


def run_python(program: str, limits: SandboxLimits | None = None, *, isolate: bool = True) -> SandboxResult:
    """Run ``program`` (Python source) in the sandbox; see the module docstring for what it may do.

    Args:
        program: the source text, run as ``main.py`` in a fresh working directory.
        limits: time, memory, process and file limits (:class:`SandboxLimits`).
        isolate: build namespaces and drop to a fresh uid where allowed (``False``: limits only).

    Returns:
        a :class:`SandboxResult`. ``returncode`` 128+N means the program was killed by signal N (e.g. 137:
        SIGKILL, 152: SIGXCPU); ``timed_out`` is set when the wall clock ran out.
    """
    lim = limits or SandboxLimits()
    workdir = tempfile.mkdtemp(prefix="dyncompile-sandbox-")
    out_fd, out_path = tempfile.mkstemp(prefix="dyncompile-sandbox-out-")
    err_fd, err_path = tempfile.mkstemp(prefix="dyncompile-sandbox-err-")
    r_fd, w_fd = os.pipe()
    cfg = {
        "isolate": bool(isolate),
        "report_fd": w_fd,
        "uid": (1 << 20) + secrets.randbelow(1 << 20),
        "workdir": workdir,
        "python": sandbox_python(),
        "tmpfs_mb": int(lim.tmpfs_mb),
        "limits": {k: int(getattr(lim, k)) for k in ("cpu_s", "memory_mb", "max_processes", "max_file_mb",
                                                    "max_open_files")},
    }
    t0 = time.perf_counter()
    timed_out = False
    iso: dict[str, Any] = {}
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _LAUNCHER, json.dumps(cfg)],
            stdin=subprocess.PIPE, stdout=out_fd, stderr=err_fd, pass_fds=(w_fd,),
            start_new_session=True, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, cwd=workdir,
        )
        os.close(w_fd)
        w_fd = -1
        try:
            proc.stdin.write(program.encode("utf-8"))
            proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            proc.wait(timeout=lim.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.terminate()  # the launcher kills the program and waits until its namespace is empty
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, 9)  # whatever is left in the group (and the launcher, if it hung)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        with os.fdopen(r_fd, "rb") as f:
            r_fd = -1
            line = f.readline()
        if line:
            iso = json.loads(line)
        rc = proc.returncode
        if rc is not None and rc > 128 and not timed_out:
            rc = -(rc - 128)  # the launcher exits 128+N when the program died of signal N
        return SandboxResult(
            returncode=rc,
            stdout=_tail(out_path, lim.max_output_chars),
            stderr=_tail(err_path, lim.max_output_chars),
            timed_out=timed_out,
            wall_s=time.perf_counter() - t0,
            isolation=iso,
        )
    finally:
        for fd in (out_fd, err_fd, r_fd, w_fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        for p in (out_path, err_path):
            try:
                os.unlink(p)
            except OSError:
                pass
        shutil.rmtree(workdir, ignore_errors=True)


def _world_executable(path: str) -> bool:
    """Whether a user with no rights but "others" can run ``path`` (every directory above it searchable)."""
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
        if not (st.st_mode & stat.S_IXOTH and st.st_mode & stat.S_IROTH):
            return False
        d = os.path.dirname(real)
        while True:
            if not os.stat(d).st_mode & stat.S_IXOTH:
                return False
            if d == os.path.dirname(d):
                return True
            d = os.path.dirname(d)
    except OSError:
        return False


def sandbox_python() -> str:
    """The interpreter the program runs on.

    This one, unless the sandbox uid could not execute it (a
    Python under root's home when running as root), then the first world-executable ``python3`` on
    ``/usr/bin:/bin:/usr/local/bin`` of the same major.minor version, else this one (and the run fails
    with code 126, saying why).
    """
    if os.geteuid() != 0 or _world_executable(sys.executable):
        return sys.executable
    want = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for d in ("/usr/bin", "/bin", "/usr/local/bin"):
        for name in (want, "python3"):
            cand = os.path.join(d, name)
            if os.path.exists(cand) and _world_executable(cand):
                return os.path.realpath(cand)
    return sys.executable


_ISOLATION_CACHE: dict[str, Any] | None = None


def isolation_available() -> dict[str, Any]:
    """What the sandbox can isolate on this machine (runs one trivial program once; cached)."""
    global _ISOLATION_CACHE
    if _ISOLATION_CACHE is None:
        _ISOLATION_CACHE = dict(run_python("pass", SandboxLimits(timeout_s=30)).isolation)
    return dict(_ISOLATION_CACHE)
