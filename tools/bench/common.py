"""Shared pieces of the benchmarks (``dyncompile bench ...`` and the studies in ``tools/studies/``).

Runners that map texts to probabilities, the interleaved measurement (:func:`bench_runners`: batch-1
latency with rotating order, batched throughput, quality from the very same runs), machine facts, the
markdown table and the report writer.

One session config for every bench: plans are loaded with ``dyncompile.load``'s defaults (no ``session_config``
of their own), and the sessions a bench builds itself (:func:`graph_session`) get the same entries,
``runtime.providers.DEFAULT_SESSION_CONFIG``: what a user gets is what is measured.
"""

from __future__ import annotations

import dataclasses
import logging
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dyncompile.io import shared_dir

logger = logging.getLogger(__name__)

__all__ = [
    "DATA",
    "Runner",
    "bench_runners",
    "bootstrap_diff",
    "interleaved_batch1",
    "compile_early_exit",
    "graph_decoder_spec",
    "graph_session",
    "load_avg",
    "machine_info",
    "markdown_table",
    "paired_ratio",
    "plan_runner",
    "read_report",
    "reference_runner",
    "render_requested",
    "write_report",
]

#: the sentiment splits (movie-calib for calibration, movie-test for reporting)
DATA = shared_dir() / "data" / "sentiment"


@dataclasses.dataclass
class Runner:
    """Something that maps texts to ``(probabilities [N, C], exit layers [N] | None)``."""

    name: str
    fn: Callable[[Sequence[str]], tuple[np.ndarray, np.ndarray | None]]
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


def plan_runner(name: str, compiled, **info) -> Runner:
    def fn(texts):
        p = compiled.predict_proba(texts, batch_size=len(texts))
        return p, compiled.last_info.get("exit_layer")

    return Runner(name, fn, info)


def reference_runner(name: str, onnx_path, compiled, **info) -> Runner:
    from dyncompile.tools.evaluate import ReferenceModel

    ref = ReferenceModel(onnx_path, compiled)

    def fn(texts):
        return ref.predict_proba(texts, batch_size=len(texts)), None

    return Runner(name, fn, info)


def bootstrap_diff(a: np.ndarray, b: np.ndarray, mask: np.ndarray | None = None, n: int = 4000, seed: int = 0):
    """Paired bootstrap of mean(a - b) over prompts (optionally over the rows in mask); (mean, lo, hi)."""
    rng = np.random.default_rng(seed)
    d = (a.astype(np.float64) - b.astype(np.float64))
    if mask is not None:
        d = d[mask]
    idx = rng.integers(0, len(d), size=(n, len(d)))
    boots = d[idx].mean(1)
    return float(d.mean()), float(np.quantile(boots, 0.025)), float(np.quantile(boots, 0.975))


def paired_ratio(a: Sequence[float], b: Sequence[float], *, n: int = 4000, seed: int = 0) -> dict[str, float]:
    """The geometric mean of ``a[i] / b[i]`` (rates of two runners on the same prompt ``i``) with a 95 %
    percentile-bootstrap interval over prompts: ``{"ratio", "lo", "hi", "n"}`` (:func:`bootstrap_diff` of the logs).

    Pairing by prompt removes the prompts' own spread (long prompts are slow for everyone); the interval says
    whether the machine's drift over the run leaves the ranking open (it contains 1) or not."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.ndim != 1 or a.shape != b.shape or not len(a) or not (np.all(a > 0) and np.all(b > 0)):
        raise ValueError(f"paired_ratio needs two equal-length lists of positive rates, got {len(a)} and {len(b)}")
    mean, lo, hi = bootstrap_diff(np.log(a), np.log(b), n=n, seed=seed)
    return {"ratio": round(float(np.exp(mean)), 4), "lo": round(float(np.exp(lo)), 4),
            "hi": round(float(np.exp(hi)), 4), "n": len(a)}


def total_time_ratio(plan_s: Sequence[float], base_s: Sequence[float], *, n: int = 4000, seed: int = 0) -> dict[str, float]:
    """``sum(base_s) / sum(plan_s)``: how much faster the plan gets through the same rows (throughput), with a 95 %
    percentile-bootstrap interval over rows (pairs resampled together): ``{"ratio", "lo", "hi", "n"}``.

    Beside :func:`paired_ratio`: when per-row costs are bimodal (a cascade answers some rows with a small model, an
    early exit stops some rows at layer 1), the geometric mean of per-row ratios weighs a row's 20x like another's
    2x, while the total time weighs each row by what it costs the plan — the figure a server's throughput follows."""
    a, b = np.asarray(plan_s, np.float64), np.asarray(base_s, np.float64)
    if a.ndim != 1 or a.shape != b.shape or not len(a) or not (np.all(a > 0) and np.all(b > 0)):
        raise ValueError(f"total_time_ratio needs two equal-length lists of positive times, got {len(a)} and {len(b)}")
    idx = np.random.default_rng(seed).integers(0, len(a), size=(n, len(a)))
    boots = b[idx].sum(1) / a[idx].sum(1)
    return {"ratio": round(float(b.sum() / a.sum()), 4), "lo": round(float(np.quantile(boots, 0.025)), 4),
            "hi": round(float(np.quantile(boots, 0.975)), 4), "n": len(a)}


def machine_info() -> dict[str, Any]:
    import os

    import onnxruntime as ort

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = None
    try:
        import subprocess

        gpu = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
        ).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "cpu": cpu,
        "gpu": gpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "onnxruntime": ort.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_avg": load_avg(),
    }


def load_avg() -> list[float] | None:
    """The 1/5/15-minute load averages (``uptime``): on a shared machine, read timings next to them."""
    import os

    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _quality(probs: np.ndarray, labels, ref_pred: np.ndarray | None) -> dict[str, Any]:
    pred = probs.argmax(-1)
    q: dict[str, Any] = {}
    if labels is not None:
        q["accuracy"] = round(float((pred == np.asarray(labels)).mean() * 100), 2)
    if ref_pred is not None:
        q["agreement"] = round(float((pred == ref_pred).mean() * 100), 2)
    return q


def _exit_stats(exits) -> dict[str, Any]:
    if exits is None:
        return {}
    exits = np.asarray(exits)
    vals, counts = np.unique(exits, return_counts=True)
    return {"mean_exit_layer": round(float(exits.mean()), 3), "exit_histogram": {int(v): int(c) for v, c in zip(vals, counts)}}


def interleaved_batch1(
    runners: Sequence[Runner], texts: Sequence[str], n: int, *, warmup: int = 5, progress: bool = True,
    block: int = 1,
) -> tuple[dict[str, np.ndarray], dict[str, list], dict[str, list]]:
    """The batch-1 pass: after ``warmup`` rows per runner, each of the first ``n`` rows runs through every
    runner (order rotated per row). Returns per runner: latencies ``[n]`` (s), the row's probabilities and its
    exit layer (None for a runner without exits).

    ``block`` > 1 interleaves blocks of rows instead: each runner runs ``block`` consecutive rows, then the next
    runner the same rows (order rotated per block). Row by row, every runner starts with the caches the
    previous runner left (a large fp32 model evicts a small plan's weights each time: a cold-cache protocol);
    by blocks, a runner runs warm as it would serving alone, and drift still cancels at the block's scale.
    Latencies stay per row and paired either way.
    """
    from tqdm.auto import tqdm

    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive number of rows, got {block!r}")
    for r in runners:  # warm-up (session creation, allocator)
        for t in texts[:warmup]:
            r.fn([t])
    lat = {r.name: np.zeros(n) for r in runners}
    probs = {r.name: [None] * n for r in runners}
    exits = {r.name: [None] * n for r in runners}
    order = list(range(len(runners)))
    bar = tqdm(total=n, desc="batch 1", disable=not progress, leave=False)
    for start in range(0, n, block):
        rows = range(start, min(start + block, n))
        order = order[1:] + order[:1]
        for j in order:
            r = runners[j]
            for i in rows:
                t0 = time.perf_counter()
                p, e = r.fn([texts[i]])
                lat[r.name][i] = time.perf_counter() - t0
                probs[r.name][i] = p[0]
                exits[r.name][i] = None if e is None else int(np.asarray(e).reshape(-1)[0])
        bar.update(len(rows))
    bar.close()
    return lat, probs, exits


def bench_runners(
    runners: Sequence[Runner],
    texts: Sequence[str],
    labels=None,
    *,
    batch_size: int = 32,
    batch1_rows: int | None = None,
    warmup: int = 5,
    progress: bool = True,
) -> dict[str, Any]:
    """Measure ``runners`` interleaved on ``texts``; the first runner is the baseline (``warmup`` untimed rows first).

    Batch 1: every row runs through every runner (order rotated per row); latencies and predictions of
    that pass give the batch-1 quality and speed. Batch ``batch_size``: every batch runs through every
    runner (rotated); throughput and the batched quality come from that pass.
    """
    from tqdm.auto import tqdm

    n1 = len(texts) if batch1_rows is None else min(batch1_rows, len(texts))
    lat, probs1, exits1 = interleaved_batch1(runners, texts, n1, warmup=warmup, progress=progress)
    k = n1 % len(runners)  # the batched pass continues the batch-1 pass's rotation
    order = list(range(len(runners)))[k:] + list(range(len(runners)))[:k]
    batch_t = {r.name: 0.0 for r in runners}
    probsb = {r.name: [] for r in runners}
    exitsb = {r.name: [] for r in runners}
    if warmup > 0:  # one untimed batch each: a plan may make a session for several-row calls on the first one
        for r in runners:
            r.fn(list(texts[:batch_size]))
    for s in tqdm(range(0, len(texts), batch_size), desc=f"batch {batch_size}", disable=not progress, leave=False):
        chunk = list(texts[s : s + batch_size])
        order = order[1:] + order[:1]
        for j in order:
            r = runners[j]
            t0 = time.perf_counter()
            p, e = r.fn(chunk)
            batch_t[r.name] += time.perf_counter() - t0
            probsb[r.name].append(p)
            exitsb[r.name].append(e)
    base = runners[0].name
    ref1 = np.stack(probs1[base]).argmax(-1)
    refb = np.concatenate(probsb[base]).argmax(-1)
    lab1 = None if labels is None else np.asarray(labels[:n1])
    results = []
    for r in runners:
        p1 = np.stack(probs1[r.name])
        pb = np.concatenate(probsb[r.name])
        e1 = None if exits1[r.name][0] is None else np.array(exits1[r.name])
        eb = None if exitsb[r.name][0] is None else np.concatenate([np.asarray(e).reshape(-1) for e in exitsb[r.name]])
        row = {
            "name": r.name,
            **r.info,
            "batch1": {
                "rows": n1,
                **_quality(p1, lab1, ref1),
                "latency_ms_median": round(float(np.median(lat[r.name]) * 1e3), 3),
                "latency_ms_p90": round(float(np.percentile(lat[r.name], 90) * 1e3), 3),
                "latency_ms_mean": round(float(np.mean(lat[r.name]) * 1e3), 3),
                **_exit_stats(e1),
            },
            f"batch{batch_size}": {
                "rows": len(texts),
                **_quality(pb, labels, refb),
                "throughput_rows_per_s": round(len(texts) / batch_t[r.name], 2),
                **_exit_stats(eb),
            },
        }
        results.append(row)
    b0 = results[0]
    for row in results:
        row["speedup_batch1_median"] = round(b0["batch1"]["latency_ms_median"] / row["batch1"]["latency_ms_median"], 3)
        row["speedup_batch1_mean"] = round(b0["batch1"]["latency_ms_mean"] / row["batch1"]["latency_ms_mean"], 3)
        tb = f"batch{batch_size}"
        row[f"speedup_{tb}_throughput"] = round(row[tb]["throughput_rows_per_s"] / b0[tb]["throughput_rows_per_s"], 3)
    return {"baseline": base, "batch_size": batch_size, "results": results}


def markdown_table(report: dict[str, Any]) -> str:
    bs = report["batch_size"]
    tb = f"batch{bs}"
    head = (
        f"| model | acc b1 (%) | agree b1 (%) | mean exit | p50 b1 (ms) | p90 b1 (ms) | speedup b1 (median) | "
        f"speedup b1 (total time) | acc b{bs} (%) | rows/s b{bs} | speedup b{bs} |\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in report["results"]:
        b1, bb = r["batch1"], r[tb]
        lines.append(
            f"| {r['name']} | {b1.get('accuracy', '–')} | {b1.get('agreement', '–')} | {b1.get('mean_exit_layer', '–')} | "
            f"{b1['latency_ms_median']} | {b1['latency_ms_p90']} | {r['speedup_batch1_median']}x | {r['speedup_batch1_mean']}x | "
            f"{bb.get('accuracy', '–')} | {bb['throughput_rows_per_s']} | {r[f'speedup_{tb}_throughput']}x |"
        )
    return "\n".join(lines)


def write_report(report: dict[str, Any], out_dir: Path, stem: str) -> tuple[Path, Path]:
    from dyncompile.io import write_json_atomic

    out_dir.mkdir(parents=True, exist_ok=True)
    jp, mp = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    write_json_atomic(jp, report)
    mp.write_text(report.get("markdown") or markdown_table(report))
    return jp, mp


def read_report(path: str | Path) -> dict[str, Any]:
    """A stored JSON report (what a harness wrote next to its markdown)."""
    import json

    from dyncompile.errors import DataError

    try:
        report = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"--render {path}: no such file; give the JSON report a bench wrote") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"--render {path}: not a JSON report ({e})") from None
    if not isinstance(report, dict):
        raise DataError(f"--render {path}: not a JSON report (a JSON object is expected)")
    return report


RENDER_HELP = "print the markdown of a stored JSON report this harness wrote (re-rendered from the JSON alone; no run)"


def render_requested(argv: Sequence[str] | None, render: Callable[[dict[str, Any]], str]) -> int | None:
    """``--render JSON`` (every harness that writes JSON + markdown has it): print ``render(report)`` exactly as
    the harness writes its ``.md`` and return 0; ``None`` when ``--render`` is not given (then run the bench).

    Checked before the harness's own parser, whose required arguments a re-render does not need."""
    import argparse
    import sys

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--render")
    path = pre.parse_known_args(argv)[0].render
    if path is None:
        return None
    sys.stdout.write(render(read_report(path)))
    return 0


def compile_early_exit(src, plan_dir: Path, calib: Path, *, prefix: str = "", **options: Any) -> tuple[Any, float]:
    """``dyncompile SRC --passes [PREFIX,]early-exit --calib CALIB {options}``: ``(CompileResult, seconds)``."""
    import dyncompile

    t0 = time.perf_counter()
    res = dyncompile.compile(src, f"{prefix}early-exit", plan_dir, force=True, progress=False, calib=str(calib), **options)
    return res, time.perf_counter() - t0


def graph_session(path: Path, threads: int):
    """A CPU ORT session of a bare ONNX graph with the session config ``dyncompile.load`` gives every plan
    (spinning stops when a call returns: with several sessions stepped in turn, idle sessions' spinning threads
    would otherwise take the cores)."""
    import onnxruntime as ort

    from dyncompile.runtime.providers import DEFAULT_SESSION_CONFIG

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    for k, v in DEFAULT_SESSION_CONFIG.items():
        so.add_session_config_entry(k, v)
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def graph_decoder_spec(path: Path):
    """The :class:`~dyncompile.plan.DecoderSpec` of a bare decoder graph: dyncompile's reading of the graph, or,
    for an onnxruntime-genai model-builder folder, its ``genai_config.json``."""
    import json

    from dyncompile.plan import DecoderSpec

    cfg_path = path.parent / "genai_config.json"
    if cfg_path.is_file():
        d = json.loads(cfg_path.read_text())["model"]["decoder"]
        names_in, names_out = d["inputs"], d["outputs"]
        kv = []
        for i in range(int(d["num_hidden_layers"])):
            for pk, ok in (("past_key_names", "present_key_names"), ("past_value_names", "present_value_names")):
                kv.append({"past": names_in[pk] % i, "present": names_out[ok] % i, "axis": 2,
                           "shape": [int(d["num_key_value_heads"]), int(d["head_size"])]})
        return DecoderSpec.from_params({"model": path.name, "input_ids": names_in["input_ids"],
                                        "attention_mask": names_in.get("attention_mask"), "position_ids": None,
                                        "logits": names_out["logits"], "kv": kv})
    import onnx_ir as ir

    from dyncompile.passes.speculative.decoder_spec import decoder_spec

    d = decoder_spec(ir.load(str(path)), path.name)
    d.pop("vocab_size", None)
    return DecoderSpec.from_params(d)
