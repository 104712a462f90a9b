"""dyncompile against the runtimes a user would otherwise pick: onnxruntime-genai and OpenVINO GenAI.

``dyncompile bench peers PLAN --prompts FILE --peers ortgenai,openvino --peer-model ortgenai=DIR --peer-model
openvino=DIR`` (or ``dyncompile bench PLAN --prompts FILE --peers ...`` for a text-generation plan) runs every prompt, greedy, through:

* dyncompile's target alone and its speculative step, loaded the way ``dyncompile.load`` loads them by default
  (intra-op threads spin while a call runs; ``--spinning-on`` adds the same plan with ORT's own default, spinning that
  goes on after the call, ``--session-variant`` any other session settings, and ``--plan-variant`` another plan of
  the same model, e.g. compiled with other passes, each in a worker of its own and paired with the main plan);
* each peer's greedy decoding on its own export of the same model (``--peer-model``), and its speculative modes
  when asked: a draft model (``--peer-draft``: an onnxruntime-genai folder whose genai_config.json has a
  ``model.draft`` section, or an OpenVINO draft IR folder) and n-gram / prompt-lookup decoding (``--peer-ngram``).

Every runner is a worker process (:mod:`dyncompile.tools.bench.peer_worker`): the peers run with their own Python
(``--peer-python NAME=PATH``; default ``$DYNCOMPILE_PEER_VENVS/{ortgenai,ovgenai}/bin/python``), because their
ONNX Runtime builds clash with dyncompile's. All workers are loaded first; then each prompt runs through every
runner in rotating order, one at a time (an idle worker blocks on its stdin: no spinning neighbours). Each worker
times its own generation; prompts are tokenized once by the plan's tokenizer and passed as token ids, and every
runner's new token ids are compared with dyncompile's target alone (greedy fp32 reference; a trailing EOS is
ignored in the comparison). Reported per runner: tokens/s including prefill, prefill seconds, decode tokens/s
(``(new - 1) / (total - prefill)`` per prompt summed, as in ``dyncompile bench``), time to first token and time per
output token (TTFT = the prefill call, TPOT = the time after it per further token; means over generations, and TPOT
paired with the peers like the rates), token identity. Peers keep their
own default session settings (both spin their intra-op threads by default).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from dyncompile.errors import DataError
from dyncompile.tools.bench.common import RENDER_HELP, render_requested

logger = logging.getLogger(__name__)

__all__ = ["DRIVER", "PEERS", "Worker", "main", "markdown_report", "peer_pairs", "peer_python", "run_peers"]

DRIVER = Path(__file__).with_name("peer_worker.py")
#: peer name -> (venv folder name under $DYNCOMPILE_PEER_VENVS, human name, what its speculative modes are)
PEERS = {
    "ortgenai": ("ortgenai", "onnxruntime-genai", "draft model / n-gram"),
    "openvino": ("ovgenai", "OpenVINO GenAI", "draft model / prompt lookup"),
}
#: ORT's own default: spinning on, and the threads keep spinning for a while after a call returns
SPIN_ON = ["session.intra_op.allow_spinning=1", "session.force_spinning_stop=0"]


class Worker:
    """One driver process; ``request`` sends a JSON line and reads the reply."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str] | None = None, timeout: float = 1800):
        self.name = name
        self.cmd = cmd
        logger.info("starting %s: %s", name, " ".join(cmd))
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, text=True,
                                     bufsize=1, env=env)
        self.info = self._read()
        if not self.info.get("ready"):
            self.close()
            raise DataError(f"peer worker {name} failed to load: {self.info.get('error')}; command: {' '.join(cmd)}")

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait()
            return {"ready": False, "error": f"worker exited (status {rc}) before answering; see its stderr above"}
        return json.loads(line)

    def request(self, **req) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        rep = self._read()
        if "error" in rep:
            raise DataError(f"{self.name}: {rep['error']}")
        return rep

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


@dataclasses.dataclass
class Runner:
    name: str
    worker: str
    mode: str
    kind: str  # dyncompile | peer


def peer_python(name: str, given: dict[str, str]) -> str:
    if name in given:
        py = given[name]
    else:
        root = os.environ.get("DYNCOMPILE_PEER_VENVS")
        if not root:
            raise DataError(
                f"no Python for peer {name!r}: pass --peer-python {name}=/path/to/venv/bin/python or set "
                f"DYNCOMPILE_PEER_VENVS to a folder holding {PEERS[name][0]}/ (README, section Peers, says how to make it)")
        py = str(Path(root) / PEERS[name][0] / "bin" / "python")
    if not Path(py).exists():
        raise DataError(f"peer {name!r}: Python {py} does not exist; create the peer's environment (README, section "
                        f"Peers) or pass --peer-python {name}=PATH")
    return py


def peer_pairs(items: list[str], what: str) -> dict[str, str]:
    out = {}
    for it in items:
        k, sep, v = it.partition("=")
        if not sep or k not in PEERS or not v:
            raise DataError(f"{what} {it!r}: expected NAME=VALUE with NAME one of {', '.join(PEERS)}")
        out[k] = v
    return out


def _session_variant(text: str) -> tuple[str, list[str]]:
    """``LABEL:KEY=VALUE[,KEY=VALUE]`` -> (label, ["KEY=VALUE", ...])."""
    label, sep, rest = text.partition(":")
    entries = [e.strip() for e in rest.split(",") if e.strip()]
    if not sep or not label.strip() or not entries or any("=" not in e or e.startswith("=") for e in entries):
        raise DataError(f"--session-variant {text!r}: expected LABEL:KEY=VALUE[,KEY=VALUE], e.g. "
                        "'spin:session.intra_op.allow_spinning=1,session.force_spinning_stop=1'")
    return label.strip(), entries


def _text_generation_plan(path, what: str = ""):
    """The plan in ``path`` (hashes not checked: the worker's ``dyncompile.load`` checks them), which must be a
    text-generation plan; ``what`` prefixes the error (which argument named it)."""
    from dyncompile.plan import load_plan

    plan = load_plan(path, verify_hashes=False)
    if plan.task != "text-generation":
        raise DataError(f"{what}{path} is a {plan.task!r} plan; --peers is for text-generation plans")
    return plan


def _plan_variant(text: str):
    """``LABEL:PLAN_DIR`` -> (label, plan folder, its plan), checked to be a text-generation plan."""
    label, sep, folder = text.partition(":")
    if not sep or not label.strip() or not folder.strip():
        raise DataError(f"--plan-variant {text!r}: expected LABEL:PLAN_DIR, e.g. 'conv:q05-pl-conv/'")
    path = Path(folder.strip())
    if not (path / "plan.json").is_file():
        raise DataError(f"--plan-variant {text!r}: {path} has no plan.json; compile it with dyncompile first")
    return label.strip(), path, _text_generation_plan(path, f"--plan-variant {text!r}: ")


def _strip_eos(ids: list[int], eos: set[int]) -> list[int]:
    return ids[:-1] if ids and ids[-1] in eos else ids


def measure(workers: dict[str, Worker], runners: list[Runner], encoded: list[list[int]], budgets: list[int],
            *, progress: bool = True, desc: str = "prompts") -> tuple[dict[str, list[dict]], list[float]]:
    """Every prompt through every runner, rotating order per prompt (after one warm-up call each)."""
    from tqdm.auto import tqdm

    for r in runners:  # warm-up: allocators, kernels, first-call compilation
        workers[r.worker].request(ids=encoded[0][:64], max_new_tokens=8, mode=r.mode)
    runs: dict[str, list[dict]] = {r.name: [] for r in runners}
    loads = []
    order = list(range(len(runners)))
    for i in tqdm(range(len(encoded)), desc=desc, disable=not progress, leave=False):
        order = order[1:] + order[:1]
        loads.append(round(os.getloadavg()[0], 2))
        for j in order:
            r = runners[j]
            runs[r.name].append(workers[r.worker].request(ids=encoded[i], max_new_tokens=budgets[i], mode=r.mode))
    return runs, loads


def run_peers(workers: dict[str, Worker], runners: list[Runner], encoded: list[list[int]], budgets: list[int],
              *, eos: set[int], progress: bool = True) -> dict[str, Any]:
    """Every prompt through every runner, rotating; the first runner is the reference."""
    runs, loads = measure(workers, runners, encoded, budgets, progress=progress)
    return summarize(runners, runs, encoded, eos=eos, loads={"all": loads})


#: which peer modes a dyncompile runner is compared with, prompt by prompt (exact greedy vs exact greedy, exact
#: speculative vs the peers' exact speculative modes)
COMPARABLE = {"greedy": ("greedy",), "spec": ("ngram", "draft")}


def _rates(x: dict) -> tuple[float, float]:
    """One generation's tokens/s including prefill and its decode tokens/s."""
    new = len(x["ids"])
    return new / x["total_s"], max(new - 1, 1) / max(x["total_s"] - x["prefill_s"], 1e-9)


def paired_comparisons(runners: list[Runner], runs: dict[str, list[dict]]) -> list[dict[str, Any]]:
    """Each dyncompile runner against each peer runner of a comparable mode (and each variant's runner against the
    main plan's of its mode): the geometric mean over prompts (every pass's prompt counts once) of the per-prompt
    rate ratios, with 95 % bootstrap intervals."""
    from dyncompile.tools.bench.common import paired_ratio

    out = []
    for d in (r for r in runners if r.kind == "dyncompile"):
        # the peers of a comparable mode; for another worker of dyncompile's (a session or plan variant), also the
        # main plan's runner of the same mode, so a variant's gain is paired in the same run
        main = [r for r in runners if r.kind == "dyncompile" and r.worker == "dyncompile" and r.mode == d.mode
                and d.worker != "dyncompile"]
        for p in main + [r for r in runners if r.kind == "peer" and r.mode in COMPARABLE.get(d.mode, ())]:
            a = [_rates(x) for x in runs[d.name]]
            b = [_rates(x) for x in runs[p.name]]
            out.append({"dyncompile": d.name, "peer": p.name,
                        "tokens_per_s": paired_ratio([x[0] for x in a], [x[0] for x in b]),
                        "decode_tokens_per_s": paired_ratio([x[1] for x in a], [x[1] for x in b]),
                        # time, not rate: below 1 is faster
                        "prefill_seconds": paired_ratio([max(x["prefill_s"], 1e-9) for x in runs[d.name]],
                                                        [max(x["prefill_s"], 1e-9) for x in runs[p.name]]),
                        # time per output token after the first (< 1: faster); TTFT is the prefill ratio above
                        "tpot": paired_ratio([_tpot(x) for x in runs[d.name]], [_tpot(x) for x in runs[p.name]])})
    return out


def _tpot(x: dict) -> float:
    """One generation's time per output token after the first (seconds)."""
    return max(x["total_s"] - x["prefill_s"], 1e-9) / max(len(x["ids"]) - 1, 1)


def _decode_rate(rr: list[dict]) -> float:
    new = sum(len(x["ids"]) for x in rr)
    return (new - len(rr)) / max(sum(x["total_s"] - x["prefill_s"] for x in rr), 1e-9)


def summarize(runners: list[Runner], runs: dict[str, list[dict]], encoded: list[list[int]], *, eos: set[int],
              loads: dict[str, list[float]], passes: int = 1) -> dict[str, Any]:
    """Per-runner tokens/s, prefill, decode tokens/s and token identity with the first runner (the reference);
    with ``passes`` > 1 (``encoded`` is the prompt list that many times over) also each pass's decode tokens/s."""
    ref = runs[runners[0].name]
    rows = []
    n = len(encoded) // passes
    for r in runners:
        rr = runs[r.name]
        new = sum(len(x["ids"]) for x in rr)
        total = sum(x["total_s"] for x in rr)
        pre = sum(x["prefill_s"] for x in rr)
        ident = [_strip_eos(x["ids"], eos) == _strip_eos(b["ids"], eos) for x, b in zip(rr, ref)]
        row = {"name": r.name, "kind": r.kind, "mode": r.mode, "new_tokens": new, "seconds": round(total, 3),
               "tokens_per_s": round(new / total, 3), "prefill_seconds": round(pre / passes, 3),
               "decode_tokens_per_s": round(_decode_rate(rr), 3),
               # what the runner would reach if decoding took no time at all (prefill is its floor)
               "ceiling_tokens_per_s": round(new / max(pre, 1e-9), 3),
               "identical": sum(ident), "of": len(rr), "per_prompt_identical": ident,
               # means over generations, as serving benchmarks report them: time to first token (the prefill call)
               # and time per output token after it
               "ttft_ms": round(1e3 * sum(x["prefill_s"] for x in rr) / len(rr), 2),
               "tpot_ms": round(1e3 * sum(_tpot(x) for x in rr) / len(rr), 2)}
        if passes > 1:
            row["decode_tokens_per_s_per_pass"] = [round(_decode_rate(rr[k * n:(k + 1) * n]), 3) for k in range(passes)]
        accs = [x["stats"].get("acceptance_rate") for x in rr if x.get("stats", {}).get("acceptance_rate") is not None]
        if accs:
            row["acceptance_rate_mean"] = round(sum(accs) / len(accs), 4)
        rows.append(row)
    base = rows[0]
    for row in rows:
        row["speedup_vs_dyncompile_target"] = round(row["tokens_per_s"] / base["tokens_per_s"], 3)
        row["speedup_decode_vs_dyncompile_target"] = round(row["decode_tokens_per_s"] / base["decode_tokens_per_s"], 3)
    per_prompt = [{"prompt_tokens": len(encoded[i]), **{r.name: {"new_tokens": len(runs[r.name][i]["ids"]),
                   "total_s": round(runs[r.name][i]["total_s"], 4), "prefill_s": round(runs[r.name][i]["prefill_s"], 4)}
                   for r in runners}} for i in range(len(encoded))]
    return {"reference": base["name"], "results": rows, "per_prompt": per_prompt, "load_1min_per_prompt": loads,
            "repeat": passes, "paired": paired_comparisons(runners, runs)}


def markdown_report(report: dict[str, Any]) -> str:
    m = report.get("machine", {})
    timed = all("tpot_ms" in r for r in report["results"])  # reports written before TTFT/TPOT re-render as they were
    lines = [f"## {report['plan_name']} vs peers: {report['prompts']} prompts ({report['prompts_file']}), greedy, "
             f"{report['max_new_tokens']} new tokens, {report['threads']} threads, dyncompile on "
             f"{report.get('provider', 'cpu')}{' with IOBinding' if report.get('io_binding') else ''}"
             f"{' and CUDA graphs' if report.get('cuda_graph') else ''}", "",
             f"machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores, {m.get('date', '')}; load (1/5/15 min) at start "
             f"{report.get('load_start')}, at end {report.get('load_end')}; {report.get('passes', '')}", "",
             *([f"{report['repeat']} passes over the prompts (rotating order throughout); prefill is the sum of "
                f"one pass's prompts (mean over passes), rates are over all passes", ""] if report.get("repeat", 1) > 1
               else []),
             "| runner | tok/s (incl. prefill) | prefill s (sum) | decode tok/s | "
             + ("TTFT ms | TPOT ms | " if timed else "") + "vs dyncompile target | "
             "identical to dyncompile target greedy (reference) | acceptance (mean) |",
             "|---|---|---|---|---|---|---|" + ("---|---|" if timed else "")]
    for r in report["results"]:
        acc = r.get("acceptance_rate_mean")
        lines.append(f"| {r['name']} | {r['tokens_per_s']:.2f} | {r['prefill_seconds']:.2f} | {r['decode_tokens_per_s']:.2f} "
                     + (f"| {r['ttft_ms']:.1f} | {r['tpot_ms']:.2f} " if timed else "")
                     + f"| {r['speedup_vs_dyncompile_target']:.2f}x | {r['identical']}/{r['of']} | "
                     f"{'–' if acc is None else f'{acc:.3f}'} |")
    if report.get("repeat", 1) > 1:
        lines += ["", "decode tok/s of each pass:", ""]
        lines += [f"- {r['name']}: {' / '.join(f'{v:.2f}' for v in r['decode_tokens_per_s_per_pass'])}"
                  for r in report["results"]]
    if report.get("paired"):
        lines += ["", "paired by prompt (geometric mean over prompts of dyncompile's rate / the peer's, 95 % bootstrap "
                  "interval over prompts; an interval containing 1.00x leaves the ranking open):", "",
                  "| dyncompile | peer | tok/s ratio (95 % CI) | decode tok/s ratio (95 % CI) | "
                  "prefill time ratio (95 % CI; < 1: faster) | "
                  + ("TPOT time ratio (95 % CI; < 1: faster) | " if timed else "") + "prompts |",
                  "|---|---|---|---|---|---|" + ("---|" if timed else "")]
        for c in report["paired"]:
            cells = " | ".join(f"{v['ratio']:.3f}x ({v['lo']:.3f}–{v['hi']:.3f})" for v in
                               (c["tokens_per_s"], c["decode_tokens_per_s"], c["prefill_seconds"],
                                *([c["tpot"]] if timed and "tpot" in c else [])))
            lines.append(f"| {c['dyncompile']} | {c['peer']} | {cells} | {c['tokens_per_s']['n']} |")
    lines += ["", "ceiling tok/s with decoding free (new tokens / prefill seconds: no decoder speed-up can pass it): "
              + ", ".join(f"{r['name']} {r['ceiling_tokens_per_s']:.2f}" for r in report["results"])]
    lines += ["", "workers (versions, settings, load seconds):", ""]
    for name, info in report["workers"].items():
        lines.append(f"- {name}: {info.get('backend')} {info.get('version')}, load {info.get('load_s')} s, "
                     f"settings {json.dumps(info.get('settings'))}")
    return "\n".join(lines) + "\n"


def render_markdown(report: dict) -> str:
    """The markdown this harness writes beside its JSON report, from the JSON alone (``--render JSON``)."""
    return markdown_report(report)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dyncompile bench peers",
        description="Benchmark a text-generation plan against onnxruntime-genai and OpenVINO GenAI on the same model, "
        "prompts and precision: every runner a worker process, interleaved by prompt, greedy; tokens/s, prefill, "
        "decode, token identity with dyncompile's target alone.",
        epilog="example: dyncompile bench peers spec/ --prompts code.jsonl --peers ortgenai,openvino "
        "--peer-model ortgenai=peers/ortgenai-qwen-fp32 --peer-model openvino=peers/ov-qwen-fp32 "
        "--peer-python ortgenai=/venvs/ortgenai/bin/python --peer-python openvino=/venvs/ovgenai/bin/python",
    )
    p.add_argument("plan", help="plan directory (speculative_generate or generate step)")
    p.add_argument("--prompts", required=True, help="JSONL with 'prompt' (+ 'chat', 'id', 'max_new_tokens')")
    p.add_argument("--peers", default="ortgenai,openvino", help=f"comma list of {', '.join(PEERS)} (default: %(default)s); "
                   "'none' runs dyncompile alone (e.g. with --spinning-on)")
    p.add_argument("--peer-python", action="append", default=[], metavar="NAME=PATH",
                   help="the Python of a peer's environment (default $DYNCOMPILE_PEER_VENVS/{ortgenai,ovgenai}/bin/python)")
    p.add_argument("--peer-model", action="append", default=[], metavar="NAME=DIR",
                   help="the peer's export of the plan's target model (same precision)")
    p.add_argument("--peer-draft", action="append", default=[], metavar="NAME=DIR",
                   help="also run the peer's draft-model speculative decoding: ortgenai = a folder with model.draft in "
                   "genai_config.json, openvino = the draft model's IR folder")
    p.add_argument("--peer-ngram", action="store_true",
                   help="also run the peers' n-gram / prompt-lookup decoding (ortgenai ngram, OpenVINO prompt_lookup)")
    p.add_argument("--no-peer-greedy", action="store_true", help="skip the peers' plain greedy runners")
    p.add_argument("--max-draft-tokens", type=int, default=4, help="peers' draft tokens per round (default 4)")
    p.add_argument("--ngram-draft-tokens", type=int, default=8,
                   help="peers' draft tokens per round in n-gram / prompt lookup (default 8)")
    p.add_argument("--ngram-size", type=int, default=3, help="peers' n-gram size (default 3)")
    p.add_argument("--openvino-precision", default="f32", choices=["f32", "bf16", "f16", "default"],
                   help="OpenVINO GenAI's CPU inference precision (default f32, the precision of the fp32 reference; "
                   "the plugin's own default is bf16 on CPUs with bf16 instructions, which is not an fp32 comparison)")
    p.add_argument("--spinning-on", action="store_true",
                   help="also run the plan with ORT's own default, threads that go on spinning after each call "
                   "(dyncompile.load stops them when the call returns): a second dyncompile worker")
    p.add_argument("--session-variant", action="append", default=[], metavar="LABEL:KEY=VALUE[,KEY=VALUE]",
                   help="also run the plan with these ORT session config entries over dyncompile.load's defaults, in a "
                   "dyncompile worker of its own labelled LABEL (repeatable), e.g. 'no spinning:"
                   "session.intra_op.allow_spinning=0' (what dyncompile.load(spinning=False) gives)")
    p.add_argument("--plan-variant", action="append", default=[], metavar="LABEL:PLAN_DIR",
                   help="also run another plan of the same model (e.g. compiled with other passes) in a dyncompile "
                   "worker of its own labelled LABEL (repeatable); its runners are paired with the main plan's too")
    p.add_argument("--no-speculative", action="store_true", help="skip dyncompile's speculative step")
    p.add_argument("--sequential-peers", action="store_true",
                   help="when the models do not fit in memory together: dyncompile's runners first (interleaved), then "
                   "each peer worker's runners in a pass of their own with only that worker loaded")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, help="use the first N prompts")
    p.add_argument("--repeat", type=int, default=1,
                   help="run the prompts N times over (rotating runner order throughout; this machine's speed drifts "
                   "by ±10 %% over minutes, so N ≥ 2 with each pass's decode rate reported shows the spread)")
    p.add_argument("--provider", default="cpu",
                   help="execution provider of dyncompile's runners (cpu, cuda, openvino) and of onnxruntime-genai's "
                   "(other than cpu it replaces the providers of the export's genai_config.json); OpenVINO GenAI runs "
                   "on its CPU device")
    p.add_argument("--io-binding", action="store_true",
                   help="dyncompile: bind the KV cache with IOBinding (on CUDA it stays in GPU memory between calls)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="dyncompile: load the plan with cuda_graph=True (one-token target steps replayed as CUDA graphs; "
                   "a float16 causal-attention plan without trim-logits on the CUDA EP)")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads for every runner (default 2)")
    p.add_argument("--report-dir", default=".", help="where JSON + markdown go (default: the current directory)")
    p.add_argument("--name", help="report file stem (default: PLANNAME-PROMPTSTEM-peers)")
    p.add_argument("--render", metavar="JSON", help=RENDER_HELP)
    p.add_argument("-q", "--quiet", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    rendered = render_requested(argv, render_markdown)
    if rendered is not None:
        return rendered
    args = build_parser().parse_args(argv)
    from dyncompile.io import write_json_atomic
    from dyncompile.tools.bench.common import load_avg, machine_info
    from dyncompile.tools.bench.prompt_sets import read_prompts

    if args.max_new_tokens < 1 or args.threads < 1 or args.repeat < 1:
        raise DataError("--max-new-tokens, --threads and --repeat must be >= 1")
    peers = [] if args.peers.strip() == "none" else [s.strip() for s in args.peers.split(",") if s.strip()]
    bad = [s for s in peers if s not in PEERS]
    if bad:
        raise DataError(f"--peers: unknown peer(s) {bad}; choose from {', '.join(PEERS)} (or 'none')")
    pythons, models_, drafts = (peer_pairs(args.peer_python, "--peer-python"),
                                peer_pairs(args.peer_model, "--peer-model"),
                                peer_pairs(args.peer_draft, "--peer-draft"))
    for s in peers:
        if s not in models_:
            raise DataError(f"peer {s!r} needs its export of the target: --peer-model {s}=DIR (README, section Peers)")
        for d in (models_[s], drafts.get(s)):
            if d and not Path(d).is_dir():
                raise DataError(f"peer {s!r}: folder {d} does not exist")
    plan = _text_generation_plan(args.plan)
    step = plan.steps[0]
    eos = set((step.params.get("generation") or {}).get("eos_token_ids") or [])
    prompts = read_prompts(args.prompts, args.limit)
    load_start = load_avg()

    env = dict(os.environ)

    def dyncompile_worker(plan_dir) -> list[str]:
        return [sys.executable, "-m", "dyncompile.tools.bench.peer_worker", "--backend", "dyncompile", "--model",
                str(plan_dir), "--threads", str(args.threads), "--provider", args.provider,
                *(["--io-binding"] if args.io_binding else []), *(["--cuda-graph"] if args.cuda_graph else [])]

    dyn_cmd = dyncompile_worker(args.plan)
    specs: dict[str, list[str]] = {"dyncompile": dyn_cmd}
    runners: list[Runner] = []

    def add_dyncompile(key: str, cmd: list[str], spec: str | None, label: str = "") -> None:
        """A dyncompile worker and its runners: the target alone, and the speculative step named ``spec`` (None:
        the plan has none, or --no-speculative)."""
        specs[key] = cmd
        runners.append(Runner(f"dyncompile target alone{label}", key, "greedy", "dyncompile"))
        if spec is not None:
            runners.append(Runner(f"dyncompile speculative{spec}{label}", key, "spec", "dyncompile"))

    def spec_name(st) -> str | None:  # the speculative runner's name for a plan's step
        return f" ({_drafter_name(st)})" if st.kind != "generate" and not args.no_speculative else None

    main_spec = spec_name(step)
    add_dyncompile("dyncompile", dyn_cmd, main_spec)
    variants = [("spinning on", SPIN_ON)] if args.spinning_on else []
    variants += [_session_variant(v) for v in args.session_variant]
    for i, (label, entries) in enumerate(variants):
        key = "dyncompile-spin-on" if args.spinning_on and i == 0 else f"dyncompile-variant-{i}"
        add_dyncompile(key, dyn_cmd + [a for e in entries for a in ("--session-config", e)],
                       None if main_spec is None else "", f", {label}")  # same plan: its drafter not named again
    for i, (label, folder, vplan) in enumerate(_plan_variant(v) for v in args.plan_variant):
        add_dyncompile(f"dyncompile-plan-{i}", dyncompile_worker(folder), spec_name(vplan.steps[0]), f", {label}")
    for s in peers:
        py = peer_python(s, pythons)
        human = PEERS[s][1]
        base = [py, str(DRIVER), "--backend", s, "--threads", str(args.threads), "--ngram-size", str(args.ngram_size),
                "--provider", args.provider]
        if s == "openvino":
            base += ["--ov-precision", args.openvino_precision]
        greedy_cmd = base + ["--model", models_[s], "--max-draft-tokens", str(args.ngram_draft_tokens)]
        if not args.no_peer_greedy:
            specs[s] = greedy_cmd
            runners.append(Runner(f"{human} greedy", s, "greedy", "peer"))
        if args.peer_ngram:
            if s == "openvino":
                specs[f"{s}-lookup"] = greedy_cmd + ["--prompt-lookup"]
                runners.append(Runner(f"{human} prompt lookup ({args.ngram_size}-grams, {args.ngram_draft_tokens} drafts)",
                                      f"{s}-lookup", "ngram", "peer"))
            else:
                specs.setdefault(s, greedy_cmd)
                runners.append(Runner(f"{human} n-gram ({args.ngram_size}-grams, {args.ngram_draft_tokens} drafts)", s,
                                      "ngram", "peer"))
        if s in drafts:
            dbase = base + ["--max-draft-tokens", str(args.max_draft_tokens)]
            if s == "openvino":
                specs[f"{s}-draft"] = dbase + ["--model", models_[s], "--draft", drafts[s]]
            else:
                specs[f"{s}-draft"] = dbase + ["--model", drafts[s]]
            runners.append(Runner(f"{human} draft model ({args.max_draft_tokens} drafts)", f"{s}-draft", "draft", "peer"))
    workers: dict[str, Worker] = {}
    groups = [[r for r in runners if r.kind == "dyncompile"]]
    if args.sequential_peers:
        peer_workers = list(dict.fromkeys(r.worker for r in runners if r.kind == "peer"))
        groups += [[r for r in runners if r.worker == w] for w in peer_workers]  # one loaded model at a time
    else:
        groups[0] = runners
    groups = [g for g in groups if g]
    runs: dict[str, list[dict]] = {}
    loads: dict[str, list[float]] = {}
    try:
        if len(groups) > 1:  # fail now, not after dyncompile's pass, when a peer cannot load its model (one at a time)
            for key in dict.fromkeys(r.worker for g in groups[1:] for r in g):
                Worker(key, specs[key], env=env).close()
        for key in {r.worker for r in groups[0]} | {"dyncompile"}:
            workers[key] = Worker(key, specs[key], env=env)
        enc = workers["dyncompile"]
        encoded = [enc.request(encode=p["prompt"], chat=p["chat"])["ids"] for p in prompts] * args.repeat
        budgets = [int(p.get("max_new_tokens") or args.max_new_tokens) for p in prompts] * args.repeat
        for gi, group in enumerate(groups):
            keys = {r.worker for r in group}
            for key in keys - set(workers):
                workers[key] = Worker(key, specs[key], env=env)
            r, ld = measure(workers, group, encoded, budgets, progress=not args.quiet, desc=f"pass {gi + 1}/{len(groups)}")
            runs.update(r)
            loads[" + ".join(x.name for x in group)] = ld
            if len(groups) > 1:  # sequential passes: free this pass's memory before the next one
                for key in {r.worker for r in group} | ({"dyncompile"} if gi == 0 else set()):
                    workers[key].close()
        report = summarize(runners, runs, encoded, eos=eos, loads=loads, passes=args.repeat)
        report["passes"] = "sequential (dyncompile, then each peer alone)" if len(groups) > 1 else "one interleaved pass"
    finally:
        for w in workers.values():
            w.close()
    name = args.name or f"{Path(args.plan).resolve().name}-{Path(args.prompts).stem}-peers"
    report.update({"plan": str(Path(args.plan).resolve()), "plan_name": Path(args.plan).resolve().name,
                   "prompts_file": str(args.prompts), "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                   "threads": args.threads, "provider": args.provider, "io_binding": args.io_binding,
                   "cuda_graph": args.cuda_graph, "machine": machine_info(), "load_start": load_start, "load_end": load_avg(),
                   "workers": {k: {**w.info, "command": specs[k][1:]} for k, w in workers.items()},
                   "peer_models": models_, "peer_drafts": drafts})
    report["markdown"] = markdown_report(report)
    out = Path(args.report_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / f"{name}.json", report)
    (out / f"{name}.md").write_text(report["markdown"])
    print(report["markdown"])
    print(f"written: {out / (name + '.json')} {out / (name + '.md')}")
    return 0


def _drafter_name(step) -> str:
    d = step.params.get("drafter") or {}
    return str(d.get("kind") or d.get("name") or "drafter")


if __name__ == "__main__":
    from dyncompile.errors import DyncompileError

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        sys.exit(main())
    except DyncompileError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
