"""Soak: thousands of calls on one loaded plan leave the process's memory (RSS) and open files flat.

Plans: the tiny classifier (``run_model``, 10,000 calls), the tiny staged early exit (3,000 calls: it keeps
a log of every row's exit layer for the drift guard) and the tiny decoder with prompt lookup (2,000
generations). Each leg warms up first (every input shape once, several times over: ORT's per-shape buffers,
the allocator's arenas and Python's caches settle), then samples RSS (``/proc/self/statm``, after a garbage
collection and glibc's ``malloc_trim(0)``, so freed memory the allocator still caches does not count) and the open
file descriptors (``/proc/self/fd``) and samples them again after the soak.

Bounds (no timing anywhere):

* File descriptors: none may be left open per call, so the count after equals the count before (a slack of 2
  for descriptors the interpreter or a library opens lazily, once).
* RSS: a leak of one small object per call (a 1-element array: ~100 bytes with its header; a dict: ~200) over
  N calls grows RSS by ~100 * N bytes: ~1 MB over 10,000 calls, more for anything bigger (a batch's logits, a
  KV cache). Allocator noise after warm-up measured ~0.1-0.5 MiB on these legs (glibc arenas, CPython's 1 MiB
  object arenas). The bound is ``1 MiB + 48 bytes per call`` (1.5 MiB for 10,000 calls): above the noise, and
  below the growth of any per-call leak of a Python object, which costs at least ~56 bytes.
* Negative controls: a 4 KiB object kept per decoder call fails the RSS bound; a 64-byte one fails the decoder
  leg's Python-heap bound (``64 KiB + 16 bytes per call``; a smaller RSS leak can hide in memory earlier test
  modules freed but left resident, so small leaks are the heap check's job).
* Python heap (``tracemalloc``, exact, no allocator noise; staged leg only, measured after its RSS soak, since
  tracing slows calls and its bookkeeping shows in RSS): the staged plan's exit log is meant to grow, by one exit layer per row; it may take 16 bytes per row (a compact array), not a
  Python object per call (a 1-row array: ~120 bytes). Bound ``64 KiB + 16 bytes per row``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import dyncompile

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """Resident set size of this process, from /proc/self/statm (pages)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * PAGE


def settled_rss() -> int:
    """RSS once freed memory is handed back: after a full garbage collection and glibc's ``malloc_trim(0)``.

    Memory that was freed but is still cached by the allocator (glibc keeps freed chunks of its heaps and arenas
    mapped, and how much depends on every allocation before, such as the sessions of earlier test modules) is not
    a leak; a live object kept per call survives both and still counts (negative control below).
    """
    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc:
        trim = getattr(ctypes.CDLL(libc), "malloc_trim", None)
        if trim is not None:
            trim(0)
    return rss_bytes()


def open_fds() -> int:
    """Open file descriptors of this process."""
    return len(os.listdir("/proc/self/fd"))


def bound(calls: int) -> int:
    """Largest RSS growth accepted over ``calls`` calls (see the module docstring)."""
    return 2**20 + 48 * calls


def soak(call, inputs: list, warmup: int, calls: int) -> dict:
    """``call(x)`` for ``warmup`` then ``calls`` inputs cycled from ``inputs``; RSS / FD before and after the soak."""
    for i in range(warmup):
        call(inputs[i % len(inputs)])
    rss0, fd0 = settled_rss(), open_fds()
    for i in range(calls):
        call(inputs[i % len(inputs)])
    return {"calls": calls, "rss_growth": settled_rss() - rss0, "fd_growth": open_fds() - fd0}


@pytest.fixture(scope="module")
def plans(module_tmp):
    from hostile_plans import classifier_dir, decoder_dir, generate_plan, run_model_plan, staged_plan

    root = module_tmp("soak")
    return {"classifier": run_model_plan(classifier_dir(root / "cls-model"), root / "cls"),
            "staged": staged_plan(root / "staged"),
            "decoder": generate_plan(decoder_dir(root / "dec-model"), root / "dec", speculative=True)}


def _texts(n: int = 48) -> list[str]:
    rng = np.random.default_rng(0)
    return [" ".join(f"w{int(i)}" for i in rng.integers(1, 500, size=int(rng.integers(1, 17)))) for _ in range(n)]


def _check(leg: str, r: dict) -> None:
    assert r["fd_growth"] <= 2, f"{leg}: {r['fd_growth']} file descriptors left open over {r['calls']} calls"
    assert r["rss_growth"] <= bound(r["calls"]), (
        f"{leg}: RSS grew {r['rss_growth'] / 2**20:.2f} MiB over {r['calls']} calls "
        f"(bound {bound(r['calls']) / 2**20:.2f} MiB): something is kept per call")


def test_classifier_10000_calls(plans):
    m = dyncompile.load(plans["classifier"])
    _check("classifier", soak(lambda t: m.classify(t), _texts(), warmup=1000, calls=10_000))


def test_staged_early_exit_3000_calls(plans):
    m = dyncompile.load(plans["staged"])
    texts = _texts()
    # RSS and descriptors untraced (tracemalloc's own bookkeeping would show up in RSS), after the same warm-up as
    # the classifier leg
    r = soak(lambda t: m.classify(t), texts, warmup=1000, calls=3_000)
    _check("staged early exit", r)
    # then the exact Python heap over as many calls again, every shape already seen
    heap = heap_growth(lambda t: m.classify(t), texts, r["calls"])
    assert m.task_api.exit_layers_seen().size == 1000 + 2 * r["calls"]  # the drift guard still sees every row
    assert heap <= heap_bound(r["calls"]), f"Python heap grew {heap} bytes over {r['calls']} one-row calls"


def test_decoder_2000_generations(plans):
    m = dyncompile.load(plans["decoder"])
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(1, 16, size=int(rng.integers(2, 9)))] * 2 for _ in range(16)]
    # warm-up long enough for CPython's tuple free lists to fill: each generation's statistics (dataclasses.asdict)
    # leave one ~160-byte tuple there, up to 2,000; after 200 warm-up calls that filling alone showed as ~0.5 MiB of
    # heap over the soak (tracemalloc), after 2,500 as 13 KiB
    gen = lambda p: m.generate(p, max_new_tokens=6)  # noqa: E731
    _check("decoder", soak(gen, prompts, warmup=2_500, calls=2_000))
    heap = heap_growth(gen, prompts, 2_000)
    assert heap <= heap_bound(2_000), f"Python heap grew {heap} bytes over 2000 generations"


def heap_growth(call, inputs: list, calls: int) -> int:
    """Exact Python-heap growth (``tracemalloc``) over ``calls`` calls, every input already seen; cyclic garbage the
    collector has not reached yet is collected before each reading (it is not kept, only not yet freed)."""
    tracemalloc.start()
    try:
        gc.collect()
        heap0 = tracemalloc.get_traced_memory()[0]
        for i in range(calls):
            call(inputs[i % len(inputs)])
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - heap0
    finally:
        tracemalloc.stop()


def heap_bound(calls: int) -> int:
    """Largest Python-heap growth accepted over ``calls`` calls: free lists and caches settling (13 KiB measured on
    the decoder leg) and 16 bytes per call (the staged plan's exit log: one compact entry per row), below one kept
    Python object per call (>= 56 bytes each)."""
    return 64 * 2**10 + 16 * calls


def test_soak_catches_a_per_call_leak(plans):
    """Negative controls on the decoder leg: a 4 KiB object kept per call fails the RSS bound (smaller ones can land
    in memory that earlier test modules freed but left resident, which no RSS bound can tell from reuse); a 64-byte
    object kept per call fails the exact Python-heap bound."""
    m = dyncompile.load(plans["decoder"])
    kept: list[bytes] = []

    def leaky(size):
        def call(p):
            kept.append(os.urandom(size))
            return m.generate(p, max_new_tokens=6)
        return call

    r = soak(leaky(4096), [[1, 2, 3, 1, 2, 3]], warmup=200, calls=2_000)
    assert len(kept) == 2_200
    with pytest.raises(AssertionError, match="something is kept per call"):
        _check("leaky decoder", r)
    assert heap_growth(leaky(64), [[1, 2, 3, 1, 2, 3]], 2_000) > heap_bound(2_000)
