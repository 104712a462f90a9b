"""``dyncompile bench serve``: plans behind ``dyncompile serve`` under a bounded load, on loopback.

A fixed number of requests per concurrency level (1/8/32/128 by default), sent by that many client coroutines
(aiohttp, one connection each) to Ray Serve's HTTP proxy; per level and plan: throughput, p50/p99 latency, the
HTTP status codes, errors (non-200 answers, exceptions) and dropped requests (client timeouts), and — for
classifiers — the accuracy of the answers on the labelled rows, next to the speed. Plans are measured level by
level, interleaved (A at 1, B at 1, A at 8, ...), all served by the same Serve instance.

    dyncompile bench serve --classify mpnet/ mpnet-ee/ --data movie-test.jsonl --requests 2000
    dyncompile bench serve --generate pl/ --prompts prompts.jsonl --requests 16 --concurrency 1,4
    dyncompile bench serve --classify ee/ --data movie-test.jsonl --nodes 3 --replicas 3   (a loopback cluster)

``--generate`` runs each prompt target-alone and speculative (the ``speculative`` request field), and measures
streaming TPOT through the ``openai`` client against ``generate_stream`` in this process. ``--nodes N`` starts a
Ray test cluster of N nodes on this machine (``ray.cluster_utils.Cluster``, one CPU each) and reports which node
answered each request and whether the answers equal the single-replica ones.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from dyncompile.errors import DataError
from dyncompile.tools.bench.common import load_avg, machine_info, write_report

__all__ = ["main", "run_load"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _load(url: str, bodies: list[dict], concurrency: int, timeout: float) -> dict[str, Any]:
    import aiohttp

    results: list[Any] = [None] * len(bodies)
    next_i = 0

    async def worker(session):
        nonlocal next_i
        while next_i < len(bodies):
            i = next_i
            next_i += 1
            t0 = time.perf_counter()
            try:
                async with session.post(url, json=bodies[i]) as r:
                    payload = await r.read()
                    results[i] = (r.status, time.perf_counter() - t0, payload, r.headers.get("x-dyncompile-replica"))
            except TimeoutError:
                results[i] = ("timeout", time.perf_counter() - t0, b"", None)
            except aiohttp.ClientError as e:
                results[i] = (f"error:{type(e).__name__}", time.perf_counter() - t0, b"", None)

    conn = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    return {"wall": wall, "results": results}


def run_load(url: str, bodies: list[dict], concurrency: int, timeout: float = 120.0) -> dict[str, Any]:
    """Send ``bodies`` to ``url`` from ``concurrency`` clients; throughput, latency percentiles, codes, errors."""
    raw = asyncio.run(_load(url, bodies, concurrency, timeout))
    res = raw["results"]
    codes = Counter(str(r[0]) for r in res)
    ok = [r for r in res if r[0] == 200]
    lat = np.array([r[1] for r in ok]) if ok else np.array([np.nan])
    return {
        "concurrency": concurrency, "requests": len(bodies), "ok": len(ok), "codes": dict(codes),
        "errors": len(res) - len(ok) - codes.get("timeout", 0), "dropped": codes.get("timeout", 0),
        "seconds": round(raw["wall"], 3), "throughput_rps": round(len(ok) / raw["wall"], 2),
        "p50_ms": round(float(np.percentile(lat, 50)) * 1e3, 2), "p99_ms": round(float(np.percentile(lat, 99)) * 1e3, 2),
        "replicas": dict(Counter(r[3] for r in ok)),
        "_payloads": [r[2] if r[0] == 200 else None for r in res],
    }


def _rows(path: str, limit: int | None = None) -> list[dict]:
    rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows[:limit] if limit else rows


def _health(base: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(base + "/health", timeout=30) as r:
        return json.loads(r.read())


def _classify_levels(urls: dict[str, str], rows: list[dict], levels: list[int], n: int, timeout: float,
                     reference: dict[str, list] | None = None) -> list[dict]:
    bodies = [{"input": rows[i % len(rows)]["text"]} for i in range(n)]
    labels = [rows[i % len(rows)].get("label") for i in range(n)]
    out = []
    for c in levels:
        for name, base in urls.items():
            r = run_load(base + "/v1/classify", bodies, c, timeout)
            preds = [json.loads(p)["data"][0] if p else None for p in r.pop("_payloads")]
            answered = [(p, lab) for p, lab in zip(preds, labels) if p is not None and lab is not None]
            if answered:
                names = list(answered[0][0]["probabilities"])
                r["accuracy"] = round(100.0 * float(np.mean([names.index(p["label"]) == int(lab)
                                                             for p, lab in answered])), 2)
            exits = [p["exit_layer"] for p in preds if p is not None and p.get("exit_layer") is not None]
            r["mean_exit_layer"] = round(float(np.mean(exits)), 3) if exits else None
            r["plan"] = name
            r["load_avg"] = load_avg()
            r["rss_mib_after"] = _health(base).get("rss_mib")  # the answering replica's RSS after this level
            if reference is not None and name in reference:  # label and exit layer of the in-process batch-1 run
                ref = reference[name]
                same = [p is not None and (p["label"], p["exit_layer"]) == ref[i % len(ref)] for i, p in enumerate(preds)]
                r["same_as_in_process"] = f"{sum(same)}/{len(same)}"
            out.append(r)
            print(f"{name:>12} c={c:<4} {r['throughput_rps']:8.1f} req/s  p50 {r['p50_ms']:8.1f} ms  p99 "
                  f"{r['p99_ms']:8.1f} ms  acc {r.get('accuracy')}  errors {r['errors']} dropped {r['dropped']} "
                  f"codes {r['codes']}", flush=True)
    return out


def _generate_levels(url: str, prompts: list[str], levels: list[int], n: int, max_tokens: int,
                     timeout: float) -> list[dict]:
    out = []
    for c in levels:
        for spec in (False, True):
            bodies = [{"prompt": prompts[i % len(prompts)], "max_tokens": max_tokens, "temperature": 0,
                       "speculative": spec} for i in range(n)]
            r = run_load(url + "/v1/completions", bodies, c, timeout)
            payloads = [json.loads(p) for p in r.pop("_payloads") if p]
            toks = sum(p["usage"]["completion_tokens"] for p in payloads)
            r["tokens_per_s"] = round(toks / r["seconds"], 2)
            r["token_ids"] = [p["dyncompile"]["token_ids"] for p in payloads[: len(prompts)]]
            r["plan"] = "speculative" if spec else "target alone"
            r["load_avg"] = load_avg()
            out.append(r)
            print(f"{r['plan']:>12} c={c:<4} {r['throughput_rps']:8.2f} req/s {r['tokens_per_s']:8.1f} tok/s  p50 "
                  f"{r['p50_ms']:8.1f} ms  p99 {r['p99_ms']:8.1f} ms  errors {r['errors']} dropped {r['dropped']}",
                  flush=True)
    return out


def _tpot(url: str, plan_dir: str, prompts: list[str], max_tokens: int, rounds: int) -> dict[str, Any]:
    """Time per output token at concurrency 1: streamed through the openai client vs ``generate_stream`` here,
    interleaved, greedy speculative; TPOT = (last token time - first token time) / (tokens - 1)."""
    import openai

    import dyncompile

    model = dyncompile.load(plan_dir, spinning=False)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    served, local, same = [], [], True

    def one_served(p):
        t0 = time.perf_counter()
        stamps, text = [], ""
        for ch in client.completions.create(model="x", prompt=p, max_tokens=max_tokens, temperature=0, stream=True):
            if ch.choices and ch.choices[0].text:
                stamps.append(time.perf_counter() - t0)
                text += ch.choices[0].text
        return stamps, text

    def one_local(p):
        t0 = time.perf_counter()
        stamps, ids = [], []
        stream = model.generate_stream(p, max_new_tokens=max_tokens)
        for chunk in stream:
            ids.extend(chunk)
            stamps.append(time.perf_counter() - t0)
        return stamps, stream.result

    for _ in range(rounds):
        for p in prompts:
            s_st, s_text = one_served(p)
            l_st, res = one_local(p)
            n = len(res.token_ids)
            if n > 1 and len(s_st) > 1 and len(l_st) > 1:
                served.append((s_st[-1] - s_st[0]) / (n - 1))
                local.append((l_st[-1] - l_st[0]) / (n - 1))
            same &= s_text == res.text
    from dyncompile.tools.bench.common import paired_ratio

    return {"served_tpot_ms": round(1e3 * statistics.median(served), 3),
            "in_process_tpot_ms": round(1e3 * statistics.median(local), 3),
            "served_over_in_process": paired_ratio(served, local), "same_text": same, "pairs": len(served)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dyncompile bench serve", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--classify", nargs="+", metavar="PLAN", help="classifier plans, measured side by side")
    p.add_argument("--data", help="JSONL rows with 'text' (+ 'label') for --classify")
    p.add_argument("--generate", metavar="PLAN", help="a decoder plan: target alone vs speculative, and TPOT")
    p.add_argument("--prompts", help="JSONL rows with 'prompt' for --generate")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--tpot-rounds", type=int, default=2, help="passes over the prompts for TPOT (0: skip)")
    p.add_argument("--requests", type=int, default=1000, help="requests per level and plan")
    p.add_argument("--concurrency", default="1,8,32,128", help="client concurrency levels")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--batch-wait-ms", type=float, default=5.0)
    p.add_argument("--max-queued", type=int, default=256)
    p.add_argument("--max-ongoing", type=int)
    p.add_argument("--threads", type=int, help="ORT threads per replica")
    p.add_argument("--nodes", type=int, default=0, help="a loopback Ray cluster of N one-CPU nodes (scale-out)")
    p.add_argument("--timeout", type=float, default=120.0, help="client timeout per request (s): counted as dropped")
    p.add_argument("--report-dir", default=".", help="where the JSON + markdown go")
    p.add_argument("--stem", default="serve", help="report file names")
    args = p.parse_args(argv)
    if not args.classify and not args.generate:
        raise DataError("give --classify PLAN... --data FILE or --generate PLAN --prompts FILE")
    if args.classify and not args.data or args.generate and not args.prompts:
        raise DataError("--classify needs --data FILE.jsonl and --generate needs --prompts FILE.jsonl")
    levels = [int(x) for x in args.concurrency.split(",")]
    import ray
    from ray import serve

    from dyncompile.tools.serve import ServeOptions, plan_info, start, stop

    cluster = None
    if args.nodes:
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
        for _ in range(args.nodes - 1):
            cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    port = _free_port()
    opts = ServeOptions(port=port, replicas=args.replicas, replica_cpus=1.0 if args.nodes else 0.0,
                        max_batch_size=args.max_batch_size, batch_wait_ms=args.batch_wait_ms,
                        max_queued_requests=args.max_queued, max_ongoing_requests=args.max_ongoing,
                        threads=args.threads)
    report: dict[str, Any] = {"machine": machine_info(), "options": vars(args), "levels": levels}
    try:
        plans = args.classify or [args.generate]
        names = [plan_info(x).name for x in plans]
        urls = start(plans, opts)
        report["plans"] = dict(zip(names, [str(x) for x in plans]))  # as given: no machine paths
        report["rss_before_mib"] = {k: _health(u).get("rss_mib") for k, u in urls.items()}
        if args.classify:
            rows = _rows(args.data)
            reference = None
            if args.nodes:  # scale-out: every answer must be the single-process one
                import dyncompile

                distinct = [r["text"] for r in rows[: args.requests]]
                reference = {}
                for name, plan in zip(names, plans):
                    preds = dyncompile.load(plan, spinning=False).classify(distinct, batch_size=1)
                    reference[name] = [(q.label, q.exit_layer) for q in preds]
            report["classify"] = _classify_levels(urls, rows, levels, args.requests, args.timeout, reference)
        else:
            url = next(iter(urls.values()))
            prompts = [r["prompt"] for r in _rows(args.prompts)]
            report["generate"] = _generate_levels(url, prompts, levels, args.requests, args.max_tokens, args.timeout)
            tgt, spc = report["generate"][0]["token_ids"], report["generate"][1]["token_ids"]
            report["token_identical"] = tgt == spc
            if args.tpot_rounds:
                report["tpot"] = _tpot(url, args.generate, prompts, args.max_tokens, args.tpot_rounds)
                print("TPOT", report["tpot"], flush=True)
        report["rss_after_mib"] = {k: _health(u).get("rss_mib") for k, u in urls.items()}
        if cluster is not None:
            report["nodes"] = args.nodes
            report["node_ids"] = sorted({n["NodeID"][:12] for n in ray.nodes() if n["Alive"]})
    finally:
        stop()
        serve.shutdown()
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
    report["markdown"] = render_markdown(report)
    jp, mp = write_report(report, Path(args.report_dir), args.stem)
    print(report["markdown"])
    print(f"wrote {jp} and {mp}")
    return 0


def render_markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [f"Machine: {m['cpu']}, {m['cores']} cores, onnxruntime {m['onnxruntime']}, {m['date']}, load at start "
             f"{m['load_avg']}", ""]
    rows = report.get("classify") or report.get("generate") or []
    extra = "accuracy | mean exit" if "classify" in report else "tok/s"
    rss = any("rss_mib_after" in r for r in rows)  # reports written before the column have none
    header = (f"| plan | concurrency | requests | req/s | p50 ms | p99 ms | {extra} | errors | dropped | codes | load |"
              + (" RSS after MiB |" if rss else ""))
    lines += [header, "|" + "---|" * (header.count("|") - 1)]
    for r in rows:
        q = (f"{r.get('accuracy')} | {r.get('mean_exit_layer')}" if "classify" in report else f"{r['tokens_per_s']}")
        lines.append(f"| {r['plan']} | {r['concurrency']} | {r['requests']} | {r['throughput_rps']} | {r['p50_ms']} | "
                     f"{r['p99_ms']} | {q} | {r['errors']} | {r['dropped']} | {r['codes']} | {r['load_avg']} |"
                     + (f" {r.get('rss_mib_after')} |" if rss else ""))
    if "tpot" in report:
        t = report["tpot"]
        lines += ["", f"TPOT (concurrency 1, streamed): openai client {t['served_tpot_ms']} ms vs in-process "
                  f"{t['in_process_tpot_ms']} ms, ratio {t['served_over_in_process']}, same text {t['same_text']}"]
    if "token_identical" in report:
        lines.append(f"Target alone vs speculative token-identical: {report['token_identical']}")
    if "nodes" in report:
        per = Counter()
        for r in rows:
            per.update(r["replicas"])
        lines += ["", f"Nodes: {report['nodes']} ({report['node_ids']}); answers per replica@node: {dict(per)}",
                  "Same label and exit layer as the in-process batch-1 run: "
                  + ", ".join(f"{r['plan']} c={r['concurrency']}: {r.get('same_as_in_process')}" for r in rows)]
    lines += ["", f"Replica RSS (MiB) before {report['rss_before_mib']} after {report['rss_after_mib']}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
