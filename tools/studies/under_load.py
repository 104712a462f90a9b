"""Under load: one loaded plan called from many threads and processes, and a long soak (figures for bench-results).

What it measures (the tests ``tests/test_concurrency.py`` and ``tests/test_soak.py`` check the same at a small
scale; this runs it large, on a quiet machine):

* **threads**: one loaded classifier plan, ``--threads`` threads calling it at once, each with its own batches,
  ``--rounds`` times over; every answer is compared with the serial run's (bitwise probabilities, exit layer);
  a mismatch or an exception is an error;
* **processes**: ``--processes`` processes (spawned, each loading the plan) answering every worker's batches
  at the same time; compared the same way;
* **soak**: ``--calls`` one-text calls on the classifier and ``--decoder-calls`` greedy generations on the tiny
  decoder (prompt lookup), RSS (``/proc/self/statm``) and open file descriptors (``/proc/self/fd``) sampled after
  a warm-up and every tenth of the way; reported as growth after warm-up, in total and per call.

The classifier is the real MiniLM-L6 sentiment model (a plain plan compiled from the model cache, texts from
``movie-test``) when ``dyncompile models build minilm-l6-sentiment`` has run, else the tiny generated encoder
with word texts (the report says which).

    python -m dyncompile.tools.studies.under_load --out bench-results/under-load   # ~5-10 min on MiniLM
    python -m dyncompile.tools.studies.under_load --render bench-results/under-load/report.json
    python -m dyncompile.tools.studies.under_load --threads 2 --processes 2 --calls 200 --decoder-calls 20 \\
        --rounds 1 --out $TMPDIR/under-load-smoke          # a check that it runs (minutes -> seconds)
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """Resident set size of this process (``/proc/self/statm``)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * PAGE


def open_fds() -> int:
    """Open file descriptors of this process."""
    return len(os.listdir("/proc/self/fd"))


# ------------------------------------------------------------------------------------------- plans and inputs


def build_plans(root: Path) -> dict[str, Any]:
    """The classifier plan (real MiniLM if cached, else tiny), its texts, and the tiny decoder plan."""
    import dyncompile
    from dyncompile.io import shared_dir
    from dyncompile.models import model_dir
    from dyncompile.models.synthetic import tiny_encoder_classifier
    from dyncompile.models.synthetic_decoder import tiny_decoder, write_decoder_dir, write_word_tokenizer

    minilm = model_dir("minilm-l6-sentiment")
    data = shared_dir() / "data" / "sentiment" / "movie-test.jsonl"
    if (minilm / "model.onnx").is_file() and data.is_file():
        src, name = minilm / "model.onnx", "minilm-l6-sentiment (plain plan)"
        texts = [json.loads(line)["text"] for line in data.read_text().splitlines() if line.strip()]
    else:
        import onnx_ir as ir

        d = root / "tiny-encoder"
        d.mkdir(parents=True)
        ir.save(tiny_encoder_classifier(num_layers=4), d / "model.onnx")
        write_word_tokenizer(d, 512)
        (d / "dyncompile-model.json").write_text(json.dumps({
            "format": "dyncompile.model/v1", "name": "tiny-encoder", "task": "text-classification",
            "labels": ["negative", "positive"], "max_length": 64}))
        src, name = d / "model.onnx", "tiny generated encoder (4 layers, word tokenizer)"
        rng = np.random.default_rng(0)
        texts = [" ".join(f"w{int(i)}" for i in rng.integers(1, 500, size=int(rng.integers(2, 30)))) for _ in range(512)]
    cls = dyncompile.compile(src, "verify,cleanup", root / "classifier", progress=False).plan_dir
    dec_dir = root / "tiny-decoder"
    model = write_decoder_dir(dec_dir, tiny_decoder(vocab=16), eos=0)
    write_word_tokenizer(dec_dir, 16, eos=0)
    dec = dyncompile.compile(model, "speculative{measure=false}", root / "decoder", drafter="prompt-lookup",
                             progress=False).plan_dir
    return {"classifier": str(cls), "classifier_name": name, "texts": texts, "decoder": str(dec)}


def worker_batches(texts: list[str], worker: int, batches: int = 6) -> list[list[str]]:
    """Worker ``worker``'s batches (sizes 1, 2, 4, 8, ...): its own texts, deterministic."""
    rng = np.random.default_rng(1000 + worker)
    sizes = [(1, 2, 4, 8)[i % 4] for i in range(batches)]
    return [[texts[int(i)] for i in rng.integers(0, len(texts), size=s)] for s in sizes]


def answers(model, batches: list[list[str]]) -> list:
    """Exact answers of ``model`` on ``batches``: label, probabilities as float hex, exit layer."""
    out = []
    for batch in batches:
        for p in model.classify(batch, batch_size=len(batch)):
            out.append([p.label, [float(v).hex() for v in p.probabilities.values()], p.exit_layer])
    return out


# ------------------------------------------------------------------------------------------- measurements


def run_threads(plan: str, texts: list[str], threads: int, rounds: int) -> dict[str, Any]:
    """``threads`` threads on one loaded plan vs the serial answers: calls, mismatches, exceptions."""
    import dyncompile

    model = dyncompile.load(plan)
    work = [worker_batches(texts, w) for w in range(threads)]
    reference = [answers(model, b) for b in work]
    start = threading.Barrier(threads)
    counts = {"mismatches": 0, "exceptions": 0}
    lock = threading.Lock()

    def run(w: int) -> None:
        start.wait()
        for _ in range(rounds):
            try:
                ok = answers(model, work[w]) == reference[w]
            except Exception as e:  # noqa: BLE001 - counted and reported
                logger.warning("thread %d: %s", w, e)
                with lock:
                    counts["exceptions"] += 1
                continue
            if not ok:
                with lock:
                    counts["mismatches"] += 1

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(run, range(threads)))
    calls = threads * rounds * len(work[0])
    return {"threads": threads, "rounds": rounds, "calls": calls, "rows": threads * rounds * sum(map(len, work[0])),
            "errors": counts["mismatches"] + counts["exceptions"], **counts,
            "seconds": round(time.perf_counter() - t0, 2)}


def _process_worker(args: tuple[str, list[str], int]) -> list:
    import dyncompile

    plan, texts, workers = args
    model = dyncompile.load(plan)
    return [answers(model, worker_batches(texts, w)) for w in range(workers)]


def run_processes(plan: str, texts: list[str], processes: int, workers: int) -> dict[str, Any]:
    """``processes`` spawned processes, each loading the plan and answering every worker's batches, vs serial."""
    import dyncompile

    reference = [answers(dyncompile.load(plan), worker_batches(texts, w)) for w in range(workers)]
    ctx = multiprocessing.get_context("spawn")
    t0 = time.perf_counter()
    with ctx.Pool(processes) as pool:
        got = pool.map(_process_worker, [(plan, texts, workers)] * processes)
    errors = sum(g[w] != reference[w] for g in got for w in range(workers))
    return {"processes": processes, "calls": processes * workers * 6, "errors": int(errors),
            "seconds": round(time.perf_counter() - t0, 2)}


def soak(call, inputs: list, warmup: int, calls: int) -> dict[str, Any]:
    """``call(x)`` ``warmup`` then ``calls`` times; RSS / FD after warm-up, every tenth of the way and at the end."""
    for i in range(warmup):
        call(inputs[i % len(inputs)])
    rss0, fd0 = rss_bytes(), open_fds()
    samples = [{"calls": 0, "rss_mib": round(rss0 / 2**20, 2), "fds": fd0}]
    errors = 0
    t0 = time.perf_counter()
    step = max(1, calls // 10)
    for i in range(calls):
        try:
            call(inputs[i % len(inputs)])
        except Exception as e:  # noqa: BLE001 - counted and reported
            errors += 1
            logger.warning("call %d: %s", i, e)
        if (i + 1) % step == 0 or i + 1 == calls:
            samples.append({"calls": i + 1, "rss_mib": round(rss_bytes() / 2**20, 2), "fds": open_fds()})
    growth = rss_bytes() - rss0
    return {"calls": calls, "warmup": warmup, "errors": errors, "seconds": round(time.perf_counter() - t0, 2),
            "rss_start_mib": round(rss0 / 2**20, 2), "rss_growth_mib": round(growth / 2**20, 3),
            "rss_growth_bytes_per_call": round(growth / max(calls, 1), 2), "fd_growth": open_fds() - fd0,
            "samples": samples}


# ------------------------------------------------------------------------------------------- report


def render_markdown(report: dict[str, Any]) -> str:
    """The markdown of a report."""
    t, p, sc, sd = report["threads"], report["processes"], report["soak_classifier"], report["soak_decoder"]
    m = report["machine"]
    return "\n".join([
        "# Under load",
        "",
        f"Classifier: {report['classifier']}. Decoder: tiny generated decoder, prompt lookup. "
        f"Machine: {m['cpu']}, {m['cores']} cores, onnxruntime {m['onnxruntime']}, load {m.get('load_avg')}, {m['date']}.",
        "",
        "| measurement | scale | calls | errors | RSS growth after warm-up | FD growth |",
        "|---|---|---|---|---|---|",
        f"| threads vs serial | {t['threads']} threads x {t['rounds']} rounds | {t['calls']} | {t['errors']} | – | – |",
        f"| processes vs serial | {p['processes']} processes | {p['calls']} | {p['errors']} | – | – |",
        f"| soak, classifier (1 text a call) | {sc['warmup']} warm-up | {sc['calls']} | {sc['errors']} | "
        f"{sc['rss_growth_mib']} MiB ({sc['rss_growth_bytes_per_call']} B/call) | {sc['fd_growth']} |",
        f"| soak, decoder (greedy, {report['decoder_new_tokens']} new tokens) | {sd['warmup']} warm-up | {sd['calls']} | "
        f"{sd['errors']} | {sd['rss_growth_mib']} MiB ({sd['rss_growth_bytes_per_call']} B/call) | {sd['fd_growth']} |",
        "",
        "Errors: answers that differ from the serial run's (bitwise probabilities, exit layer) plus exceptions.",
        "",
    ])


def readme(report: dict[str, Any]) -> str:
    """README.md of the study folder: the command, the machine and the figures."""
    return "\n".join([
        "# Under load: threads, processes, soak",
        "",
        "One loaded plan called from many threads and from several processes, every answer compared with the serial "
        "run's; then a long soak with RSS and open file descriptors sampled. The tests `tests/test_concurrency.py`, "
        "`tests/test_soak.py` and `tests/test_kill.py` check the same (and kill -9 during compile, route and "
        "export-genai) at a small scale on every run of the suite.",
        "",
        "```bash",
        report["command"],
        "```",
        "",
        render_markdown(report).split("\n", 2)[2],
        "Full samples (RSS and FDs every tenth of the soak): `report.json`.",
        "",
    ])


def main(argv: list[str] | None = None) -> int:
    """Run the measurements and write ``report.json``, ``report.md`` and ``README.md`` into ``--out``."""
    from dyncompile.tools.bench.common import RENDER_HELP, render_requested

    rendered = render_requested(argv, render_markdown)
    if rendered is not None:
        return rendered
    ap = argparse.ArgumentParser(prog="python -m dyncompile.tools.studies.under_load", description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=20, help="times each thread repeats its batches")
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--calls", type=int, default=20_000, help="soak calls on the classifier")
    ap.add_argument("--decoder-calls", type=int, default=5_000, help="soak generations on the tiny decoder")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--out", required=True, help="folder for report.json, report.md and README.md")
    ap.add_argument("--render", help=RENDER_HELP)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import dyncompile
    from dyncompile.io import write_json_atomic
    from dyncompile.tools.bench.common import machine_info

    with tempfile.TemporaryDirectory(prefix="under-load-") as tmp:
        plans = build_plans(Path(tmp))
        texts = plans["texts"]
        logger.info("threads ...")
        threads = run_threads(plans["classifier"], texts, args.threads, args.rounds)
        logger.info("processes ...")
        procs = run_processes(plans["classifier"], texts, args.processes, args.threads)
        logger.info("soak: classifier ...")
        m = dyncompile.load(plans["classifier"])
        singles = [[t] for t in texts[:256]]
        soak_c = soak(lambda t: m.classify(t), singles, warmup=min(2000, max(args.calls // 10, 1)), calls=args.calls)
        logger.info("soak: decoder ...")
        d = dyncompile.load(plans["decoder"])
        rng = np.random.default_rng(1)
        prompts = [[int(t) for t in rng.integers(1, 16, size=int(rng.integers(2, 9)))] * 2 for _ in range(32)]
        soak_d = soak(lambda p: d.generate(p, max_new_tokens=args.new_tokens), prompts,
                      warmup=min(500, max(args.decoder_calls // 10, 1)), calls=args.decoder_calls)
    report = {
        "command": "python -m dyncompile.tools.studies.under_load " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine_info(), "classifier": plans["classifier_name"], "decoder_new_tokens": args.new_tokens,
        "threads": threads, "processes": procs, "soak_classifier": soak_c, "soak_decoder": soak_d,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "report.json", report)
    (out / "report.md").write_text(render_markdown(report))
    (out / "README.md").write_text(readme(report))
    print(render_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
