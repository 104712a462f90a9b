"""The sandbox that runs model-generated code: each limit is exercised by a program that breaks it."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from dyncompile.runtime.routing.sandbox import SandboxLimits, isolation_available, run_python

FAST = SandboxLimits(timeout_s=8.0, cpu_s=4, memory_mb=512, max_processes=16)
ISO = isolation_available()
needs_ns = pytest.mark.skipif(not (ISO.get("netns") and ISO.get("pidns") and ISO.get("uid")),
                              reason=f"no namespaces / uid drop here (unprivileged runner): {ISO.get('errors')}")


def _pids_of_uid(uid: int) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                for line in (d / "status").read_text().splitlines():
                    if line.startswith("Uid:") and int(line.split()[1]) == uid:
                        pids.append(int(d.name))
            except (OSError, ValueError):
                pass
    return pids


def test_correct_program_passes_and_output_comes_back():
    r = run_python("import math\nprint(math.factorial(10))\n", FAST)
    assert r.ok and r.returncode == 0 and not r.timed_out
    assert r.stdout.strip() == "3628800"


def test_failing_program_reports_its_exit_code_and_traceback():
    r = run_python("raise ValueError('boom')\n", FAST)
    assert not r.ok and r.returncode == 1
    assert "ValueError: boom" in r.stderr


def test_infinite_loop_is_killed():
    r = run_python("while True:\n    pass\n", SandboxLimits(timeout_s=3.0, cpu_s=1))
    assert not r.ok
    # either the CPU limit (SIGXCPU/SIGKILL) or the wall clock ended it
    assert r.timed_out or r.returncode in (-9, -24)


def test_memory_bomb_is_stopped():
    r = run_python("x = bytearray(4 << 30)\nprint('allocated')\n", FAST)
    assert not r.ok and "allocated" not in r.stdout
    assert "MemoryError" in r.stderr or r.returncode == -9


def test_runs_in_a_fresh_private_working_directory():
    r = run_python("import os\nprint(os.getcwd())\nprint(sorted(os.listdir('.')))\nopen('f.txt', 'w').write('x')\n", FAST)
    assert r.ok
    cwd, listing = r.stdout.splitlines()
    assert listing == "['main.py']"
    assert not Path(cwd, "f.txt").exists()  # removed (or never visible) afterwards


def test_environment_is_isolated(monkeypatch):
    monkeypatch.setenv("DYNCOMPILE_SECRET_CANARY", "leak")
    r = run_python("import os, sys\nprint(os.environ.get('DYNCOMPILE_SECRET_CANARY'))\nprint(sys.flags.isolated)\n", FAST)
    assert r.ok and r.stdout.split() == ["None", "1"]


def test_big_file_write_is_limited():
    r = run_python("f = open('big', 'wb')\nfor _ in range(64):\n    f.write(b'x' * (1 << 20))\nf.close()\nprint('wrote')\n",
                   SandboxLimits(timeout_s=8.0, max_file_mb=4))
    assert not r.ok and "wrote" not in r.stdout


@needs_ns
def test_network_is_unreachable():
    r = run_python(
        "import socket\ns = socket.socket(); s.settimeout(2)\n"
        "try:\n    s.connect(('1.1.1.1', 80)); print('connected')\n"
        "except OSError as e:\n    print('refused', e.errno)\n"
        "print(sorted(n for _, n in socket.if_nameindex()))\n", FAST)
    assert r.ok, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("refused")
    assert lines[1] == "['lo']"  # a new network namespace: only a (down) loopback


@needs_ns
def test_writes_outside_are_refused_or_confined():
    outside = Path("/tmp") / f"dyncompile-sandbox-escape-{uuid.uuid4().hex}"
    own = Path.home() / f"dyncompile-sandbox-escape-{uuid.uuid4().hex}"  # the test user's, not the sandbox uid's
    prog = (
        f"open({str(outside)!r}, 'w').write('x')\nprint('tmp write ok')\n"
        f"try:\n    open({str(own)!r}, 'w').write('x'); print('escaped')\n"
        f"except OSError as e:\n    print('denied', type(e).__name__)\n"
    )
    r = run_python(prog, FAST)
    assert r.ok, r.stderr
    assert r.stdout.split("\n")[:2] == ["tmp write ok", "denied PermissionError"]
    assert not outside.exists()  # /tmp inside was a private tmpfs
    assert not own.exists()


@needs_ns
def test_fork_bomb_is_contained_and_no_process_survives():
    prog = (
        "import os, time\nn = 0\n"
        "try:\n    while True:\n        if os.fork() == 0:\n            time.sleep(60); os._exit(0)\n        n += 1\n"
        "except OSError as e:\n    print('stopped', n, e.errno)\n"
        "print(os.getuid())\n"
    )
    r = run_python(prog, FAST)
    assert r.ok, r.stderr
    first, uid = r.stdout.splitlines()
    stopped, n, errno = first.split()
    assert stopped == "stopped" and int(n) < FAST.max_processes and int(errno) == 11  # EAGAIN from RLIMIT_NPROC
    assert int(uid) == r.isolation["uid"] != os.geteuid()
    assert _pids_of_uid(int(uid)) == []  # the sleeping children died with the PID namespace


@needs_ns
def test_daemon_that_outlives_a_timeout_is_killed():
    prog = "import os, time\nif os.fork() == 0:\n    os.setsid(); time.sleep(60)\nelse:\n    time.sleep(60)\n"
    r = run_python(prog, SandboxLimits(timeout_s=2.0))
    assert r.timed_out
    assert _pids_of_uid(r.isolation["uid"]) == []
