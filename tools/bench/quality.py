"""Teacher-forced quality of decoder plans against a reference plan, on held-out text.

``dyncompile bench quality --reference fp32=PLAN --plan int4=PLAN [--plan ...] [--graph
NAME=MODEL.onnx ...]`` cuts
``--windows`` windows of ``--window-tokens`` tokens from Python standard-library files that no prompt set uses
(:data:`HELDOUT_FILES`: disjoint from :mod:`~dyncompile.tools.bench.prompt_sets`' code and grounded files, so nothing here
was calibrated or reported on), runs every window through each plan's target decoder in one call (every row's
logits, the runtime's own :class:`~dyncompile.runtime.decode.kv_cache.KVDecoder`; ``--graph`` takes a bare decoder graph,
e.g. onnxruntime-genai's model builder's, read as in :mod:`~dyncompile.tools.studies.decoder_graphs`) and reports
per plan:

- **perplexity** of the text (next-token NLL, rows 0..n-2 predicting tokens 1..n-1);
- **top-1 agreement** with the reference: the share of positions where both pick the same next token (the per-step
  chance that greedy decoding stays on the reference's path);
- **mean KL(reference || plan)** in nats per position;
- 95 % bootstrap intervals over windows for the perplexity ratio and the agreement.

This is the quality column for weight-format choices (int4 block size, compute type): a speed figure for a
quantized plan is printed next to these numbers. No timing here.
"""

from __future__ import annotations

import argparse
import logging
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np

from dyncompile.errors import DataError
from dyncompile.tools.bench.common import RENDER_HELP, render_requested

logger = logging.getLogger(__name__)

__all__ = ["HELDOUT_FILES", "heldout_windows", "main", "score_decoders", "score_plans"]

STDLIB = Path(sysconfig.get_paths()["stdlib"])
#: standard-library files for held-out text; none is a prompt-set file (checked in ``heldout_windows``)
HELDOUT_FILES = ("functools.py", "enum.py", "dataclasses.py", "pathlib.py", "tokenize.py", "pprint.py",
                 "gettext.py", "ftplib.py", "sched.py", "queue.py", "random.py", "glob.py")


def heldout_windows(codec, n_windows: int, window_tokens: int, files=HELDOUT_FILES) -> list[list[int]]:
    """``n_windows`` token windows of ``window_tokens``, taken in turn from each file (the k-th window of every file
    before any file's k+1-th), so the set spans the files rather than the first one."""
    from dyncompile.tools.bench.prompt_sets import CODE_FILES, GROUNDED_DOC_FILES

    used = set(files) & (set(CODE_FILES) | set(GROUNDED_DOC_FILES))
    if used:
        raise DataError(f"held-out files {sorted(used)} are prompt-set files; pick others")
    per_file = []
    for f in files:
        p = STDLIB / f
        if not p.is_file():
            logger.info("held-out file %s missing; skipped", p)
            continue
        ids = codec.encode(p.read_text(encoding="utf-8"))
        per_file.append([ids[i : i + window_tokens] for i in range(0, len(ids) - window_tokens + 1, window_tokens)])
    out: list[list[int]] = []
    k = 0
    while len(out) < n_windows and any(k < len(w) for w in per_file):
        out += [w[k] for w in per_file if k < len(w)]
        k += 1
    if len(out) < n_windows:
        raise DataError(f"only {len(out)} windows of {window_tokens} tokens in the held-out files; ask for fewer")
    return out[:n_windows]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _decoder(compiled):
    h = compiled.handlers[-1]
    if not hasattr(h, "target") or getattr(h, "codec", None) is None:
        raise DataError("bench quality needs text-generation plans with a tokenizer")
    if h.target_spec.logits_exact != "all":
        raise DataError("bench quality scores every logit, and this plan's LM head is screened (screen-lm-head: exact "
                        "at each row's argmax only); score the plan compiled without screen-lm-head")
    return h.target, h.codec


def score_plans(reference, plans: dict[str, Any], windows: list[list[int]], **kw) -> dict[str, Any]:
    """Score loaded plans (``dyncompile.load`` results) against ``reference`` on ``windows``; returns the report
    rows (the reference first)."""
    return score_decoders(_decoder(reference)[0], {name: _decoder(c)[0] for name, c in plans.items()}, windows, **kw)


def score_decoders(ref_dec, decs: dict[str, Any], windows: list[list[int]], *, seed: int = 0,
                   boot: int = 2000) -> dict[str, Any]:
    """:func:`score_plans` on :class:`~dyncompile.runtime.decode.kv_cache.KVDecoder` objects; a value of ``decs`` may
    also be a callable ``ids -> (nll [n-1], top1 [n-1])`` (a peer scored in its own process: no KL then)."""
    per: dict[str, dict[str, list[float]]] = {n: {"nll": [], "agree": [], "kl": [], "maxdiff": []}
                                               for n in ["reference", *decs]}
    for w in windows:
        ids = np.asarray(w, np.int64)
        ref_dec.reset()
        ref = _log_softmax(np.asarray(ref_dec.forward(ids))[:-1])
        ref_top = ref.argmax(-1)
        rows = np.arange(len(ids) - 1)
        per["reference"]["nll"].append(float(-ref[rows, ids[1:]].mean()))
        for name, dec in decs.items():
            if callable(dec):
                nll, top1 = (np.asarray(a) for a in dec(w))
                per[name]["nll"].append(float(nll.mean()))
                per[name]["agree"].append(float((top1 == ref_top).mean()))
                continue
            dec.reset()
            lp = _log_softmax(np.asarray(dec.forward(ids))[:-1])
            per[name]["nll"].append(float(-lp[rows, ids[1:]].mean()))
            per[name]["agree"].append(float((lp.argmax(-1) == ref_top).mean()))
            per[name]["kl"].append(float((np.exp(ref) * (ref - lp)).sum(-1).mean()))
            per[name]["maxdiff"].append(float(np.abs(lp - ref).max()))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(windows), size=(boot, len(windows)))
    ref_nll = np.asarray(per["reference"]["nll"])
    out = [{"plan": "reference", "perplexity": float(np.exp(ref_nll.mean()))}]
    for name in decs:
        nll, agree = np.asarray(per[name]["nll"]), np.asarray(per[name]["agree"])
        ratio = np.exp(nll[idx].mean(1) - ref_nll[idx].mean(1))
        ag = agree[idx].mean(1)
        kl = per[name]["kl"]
        out.append({
            "plan": name, "perplexity": float(np.exp(nll.mean())),
            "perplexity_ratio": float(np.exp(nll.mean() - ref_nll.mean())),
            "perplexity_ratio_ci95": [float(np.quantile(ratio, 0.025)), float(np.quantile(ratio, 0.975))],
            "top1_agreement": float(agree.mean()),
            "top1_agreement_ci95": [float(np.quantile(ag, 0.025)), float(np.quantile(ag, 0.975))],
            "mean_kl": float(np.mean(kl)) if kl else None,
            "max_logprob_diff": float(np.max(per[name]["maxdiff"])) if kl else None,
        })
    return {"rows": out, "windows": len(windows), "positions": int(sum(len(w) - 1 for w in windows))}


def markdown(report: dict[str, Any]) -> str:
    r = report
    lines = [f"## decoder quality vs {r['reference']}: {r['windows']} held-out windows of {r['window_tokens']} tokens "
             f"({r['positions']} positions), teacher-forced", "",
             f"text: Python {r['python']} standard library, {', '.join(r['files'])} (no prompt set uses them); "
             f"95 % bootstrap intervals over windows", "",
             "| plan | perplexity | ratio to reference (95 % CI) | top-1 agreement with reference (95 % CI) | "
             "mean KL (nats) |", "|---|---|---|---|---|"]
    for row in r["rows"]:
        if row["plan"] == "reference":
            lines.append(f"| {r['reference']} (reference) | {row['perplexity']:.3f} | – | – | – |")
            continue
        lo, hi = row["perplexity_ratio_ci95"]
        alo, ahi = row["top1_agreement_ci95"]
        lines.append(f"| {row['plan']} | {row['perplexity']:.3f} | {row['perplexity_ratio']:.4f} ({lo:.4f}–{hi:.4f}) "
                     f"| {row['top1_agreement']:.4f} ({alo:.4f}–{ahi:.4f}) | "
                     + ("–" if row["mean_kl"] is None else f"{row['mean_kl']:.4f}") + " |")
    plans = "\n".join(f"- {k}: `{v}`" for k, v in r["plans"].items())
    return "\n".join(lines) + f"\n\nplans:\n{plans}\n"


def _pair(s: str, *, graph: bool = False) -> tuple[str, str]:
    """``NAME=PLAN_DIR`` (or ``NAME=MODEL.onnx`` with ``graph``) whose path exists."""
    k, sep, v = s.partition("=")
    if not sep or not v:
        raise DataError(f"expected NAME={'MODEL.onnx' if graph else 'PLAN_DIR'}, got {s!r}")
    if not (Path(v).is_file() if graph else Path(v).is_dir()):
        raise DataError(f"{'model file' if graph else 'plan folder'} {v} does not exist")
    return k, v


def render_markdown(report: dict) -> str:
    """The markdown this harness writes beside its JSON report, from the JSON alone (``--render JSON``)."""
    return markdown(report)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dyncompile bench quality", description=__doc__.split("\n\n")[0],
                                epilog="Example: dyncompile bench quality --reference fp32=q05 "
                                       "--plan int4-b32=q05-int4 --plan int4-b128=q05-int4-b128")
    p.add_argument("--reference", required=True, help="NAME=PLAN_DIR of the reference plan (e.g. the fp32 target)")
    p.add_argument("--plan", action="append", default=[], help="NAME=PLAN_DIR, repeatable")
    p.add_argument("--graph", action="append", default=[],
                   help="NAME=MODEL.onnx, repeatable: a bare decoder graph (an onnxruntime-genai builder folder's "
                        "model.onnx is read through its genai_config.json); same tokenizer as the reference")
    p.add_argument("--peer", action="append", default=[], metavar="openvino=DIR",
                   help="OpenVINO GenAI export folder, scored in the peer's own Python (its IR's logits; no KL)")
    p.add_argument("--peer-python", action="append", default=[], metavar="openvino=PY",
                   help="the peer's Python (or $DYNCOMPILE_PEER_VENVS, as for dyncompile bench peers)")
    p.add_argument("--windows", type=int, default=24, help="held-out windows (default 24)")
    p.add_argument("--window-tokens", type=int, default=256, help="tokens per window (default 256)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--report-dir", default=".", help="where JSON + markdown go (default: the current directory)")
    p.add_argument("--name", default="decoder-quality")
    p.add_argument("--render", metavar="JSON", help=RENDER_HELP)
    rendered = render_requested(argv, render_markdown)
    if rendered is not None:
        return rendered
    args = p.parse_args(argv)
    import platform

    import dyncompile
    from dyncompile.tools.bench.common import write_report

    if args.windows < 1 or args.window_tokens < 2:
        raise DataError("--windows must be >= 1 and --window-tokens >= 2")
    if not args.plan and not args.graph and not args.peer:
        raise DataError("give at least one --plan NAME=PLAN_DIR or --graph NAME=MODEL.onnx to score")
    ref_name, ref_dir = _pair(args.reference)
    plan_dirs = dict(_pair(s) for s in args.plan)
    graphs = dict(_pair(g, graph=True) for g in args.graph)
    ref_dec, codec = _decoder(dyncompile.load(ref_dir, threads=args.threads))
    decs = {k: _decoder(dyncompile.load(v, threads=args.threads))[0] for k, v in plan_dirs.items()}
    if graphs:
        from dyncompile.runtime.decode.kv_cache import KVDecoder
        from dyncompile.tools.bench.common import graph_decoder_spec, graph_session

        decs.update({k: KVDecoder(graph_session(Path(v), args.threads), graph_decoder_spec(Path(v)), role=k)
                     for k, v in graphs.items()})
    windows = heldout_windows(codec, args.windows, args.window_tokens)
    workers = []
    try:
        if args.peer:
            from dyncompile.tools.bench.peers import DRIVER, Worker, peer_pairs, peer_python

            pythons = peer_pairs(args.peer_python, "--peer-python")
            for name, folder in peer_pairs(args.peer, "--peer").items():
                if name != "openvino":
                    raise DataError("--peer scores openvino exports; score an onnxruntime-genai folder with --graph")
                if not Path(folder).is_dir():
                    raise DataError(f"--peer {name}: folder {folder} does not exist")
                w = Worker(name, [peer_python(name, pythons), str(DRIVER), "--backend", name, "--model", folder,
                                  "--threads", str(args.threads)], env=None)
                workers.append(w)
                plan_dirs[f"{name}-peer"] = folder
                decs[f"{name}-peer"] = (lambda ids, w=w: (lambda r: (r["nll"], r["top1"]))(w.request(score=ids)))
        report = score_decoders(ref_dec, decs, windows)
    finally:
        for w in workers:
            w.close()
    report.update(reference=ref_name, window_tokens=args.window_tokens, files=list(HELDOUT_FILES),
                  python=platform.python_version(), plans={ref_name: ref_dir, **plan_dirs, **graphs})
    report["markdown"] = markdown(report)
    jp, mp = write_report(report, Path(args.report_dir), args.name)
    print(report["markdown"])
    print(f"wrote {jp} and {mp}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    import sys

    from dyncompile.errors import DyncompileError

    try:
        raise SystemExit(main())
    except DyncompileError as e:  # a user mistake: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
