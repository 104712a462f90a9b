"""int8 x early exit benchmark: fp32 original, int8, early exit and int8 + early exit, one provider.

For each model and budget, every plan is compiled by the pipeline a user runs, on movie-calib: early exit is
``--passes early-exit``, int8 + early exit is ``--passes quantize-int8{...},early-exit`` (exit heads fitted on
the int8 model's own features). int8 is the format ``quantize-int8{format=auto}`` picks for the provider (CPU EP: dynamic int8,
MatMulInteger; OpenVINO EP: weight-only int8 in QDQ form), with the options of ``DEFAULT_INT8``; one more
int8-only row (``ALT_INT8``) shows the alternative.

The budget is the accuracy drop promised on movie-calib **against the fp32 original** for both: early exit
spends all of it; int8 + early exit first pays the int8 model's own drop on movie-calib and calibrates its
exits with what is left (what the ``early-exit`` pass does after a quantize pass: ``budget_reference=original``). Every plan uses the lowering ``--lowering auto`` picks for the provider (If graph on the
CPU EP, staged on OpenVINO).

All plans and the original are then measured interleaved in one process on movie-test (never used to
choose anything): accuracy, its change and the agreement with the fp32 original's predictions, from the very
same runs as the batch-1 latency (median/p90) and the batch-32 throughput; plus the ratio that decides whether
int8 + early exit pays off: int8 + early exit against early exit at the same budget. ``--op-profile N`` adds ORT's per-operator
profile of the fp32 and int8 models at batch 1 (share of the time in MatMul vs the rest). Writes JSON + markdown.

    python -m dyncompile.tools.studies.quantized_early_exit --provider cpu --out bench-results/quantized-early-exit-cpu
    python -m dyncompile.tools.studies.quantized_early_exit --provider openvino --out bench-results/quantized-early-exit-openvino
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from dyncompile.tools.bench.common import DATA, RENDER_HELP, compile_early_exit, render_requested

logger = logging.getLogger(__name__)

#: int8 settings per provider (``quantize-int8`` options). CPU EP: dynamic int8, chosen on movie-calib (MPNet-base:
#: per-tensor 2.25 points below fp32, per-channel 1.05, per-channel with the FFN output projections in fp32 +0.10);
#: OpenVINO EP: weight-only int8 in QDQ form (what OpenVINO runs as int8; dynamic int8 is slower than fp32 there).
DEFAULT_INT8 = {
    "cpu": "format=dynamic,per_channel=true,keep_fp32=ffn-out",
    "openvino": "format=qdq-weights,per_channel=true",
}
#: one more int8-only row per provider, for contrast: (label, options)
ALT_INT8 = {
    "cpu": ("int8, pass defaults (per-tensor, every MatMul)", "format=dynamic"),
    "openvino": ("int8 dynamic as on the CPU EP (per-channel, FFN out fp32)", "format=dynamic,per_channel=true,keep_fp32=ffn-out"),
}
INT8_OPS = {"MatMulInteger", "DequantizeLinear", "DynamicQuantizeLinear"}


def _parse_opts(text: str) -> dict[str, Any]:
    from dyncompile.passes import parse_pass_spec

    return parse_pass_spec(f"quantize-int8{{{text}}}")[0][1]


def _ops(plan_dir: Path) -> set[str]:
    import onnx_ir as ir

    from dyncompile.plan import load_plan

    plan = load_plan(plan_dir)
    ops: set[str] = set()
    for f in plan.files.values():
        if f.path.endswith(".onnx"):
            ops |= {n.op_type for n in ir.load(plan.directory / f.path).graph.all_nodes()}  # subgraphs too
    return ops


def _plan_model(plan_dir: Path) -> Path:
    from dyncompile.plan import load_plan

    return load_plan(plan_dir).path_of("model")


FP32_MATMULS = ("MatMul", "Gemm", "FusedMatMul")
#: after ORT's fusions: DynamicQuantizeLinear + MatMulInteger (+ scale) -> DynamicQuantizeMatMul / MatMulIntegerToFloat
INT8_MATMULS = ("MatMulInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul")


def op_profile(onnx_paths: dict[str, Path], compiled, texts, rows: int) -> dict[str, Any]:
    """Per-operator share of batch-1 time (ORT profiler) for each model, run with the plan's provider."""
    import os
    import tempfile

    out = {}
    for name, path in onnx_paths.items():
        ctx = compiled.ctx
        so = ctx.session_options()
        so.enable_profiling = True
        with tempfile.TemporaryDirectory() as tmp:
            so.profile_file_prefix = os.path.join(tmp, "prof")
            sess = ctx.ort.InferenceSession(str(path), so, providers=ctx.providers,
                                            disabled_optimizers=ctx.disabled_optimizers or None)
            names = [i.name for i in sess.get_inputs()]
            for t in texts[:rows]:
                f = compiled.encode([t])
                sess.run(None, {k: f[k] for k in names})
            prof = sess.end_profiling()
            events = json.loads(Path(prof).read_text())
        by_op: dict[str, float] = {}
        for e in events:
            if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
                op = e.get("args", {}).get("op_name", "?")
                by_op[op] = by_op.get(op, 0.0) + e["dur"]
        total = sum(by_op.values()) or 1.0
        mm32 = sum(v for k, v in by_op.items() if k in FP32_MATMULS)
        mm8 = sum(v for k, v in by_op.items() if k in INT8_MATMULS)
        matmul = mm32 + mm8
        quant = sum(v for k, v in by_op.items() if k in ("DynamicQuantizeLinear", "QuantizeLinear", "DequantizeLinear"))
        out[name] = {
            "rows": rows,
            "kernel_ms_per_row": round(total / rows / 1e3, 3),
            "matmul_ms_per_row": round(matmul / rows / 1e3, 3),
            "matmul_share": round(matmul / total, 3),
            "fp32_matmul_ms_per_row": round(mm32 / rows / 1e3, 3),
            "int8_matmul_ms_per_row": round(mm8 / rows / 1e3, 3),
            "activation_quantization_share": round(quant / total, 3),
            "top_ops_ms_per_row": {k: round(v / rows / 1e3, 3) for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:8]},
        }
    return out


def ov_native_profile(onnx_paths: dict[str, Path], compiled, texts, rows: int) -> dict[str, Any]:
    """Per-layer profile of native OpenVINO (CPU, f32 inference precision) at batch 1: what the OpenVINO EP's
    ORT profile cannot show (one fused node per subgraph). Kernels by (layer type, exec type): an int8 GEMM
    shows as ``*_i8``/``*_u8``, a decompressed one as ``*_f32``."""
    import openvino as ov

    core = ov.Core()
    out = {"openvino": ov.__version__}
    for name, path in onnx_paths.items():
        m = core.read_model(str(path))
        names = [i.get_any_name() for i in m.inputs]
        req = core.compile_model(m, "CPU", {"INFERENCE_PRECISION_HINT": "f32", "PERF_COUNT": "YES"}).create_infer_request()
        agg: dict[str, float] = {}
        lat = []
        for t in texts[:rows]:
            f = compiled.encode([t])
            t0 = time.perf_counter()
            req.infer({k: f[k] for k in names})
            lat.append(time.perf_counter() - t0)
            for pi in req.profiling_info:
                key = f"{pi.node_type}/{pi.exec_type}"
                agg[key] = agg.get(key, 0.0) + pi.real_time.total_seconds() * 1e3
        total = sum(agg.values()) or 1.0
        fc = sum(v for k, v in agg.items() if k.startswith(("FullyConnected", "MatMul/")))  # + FullyConnectedCompressed
        out[name] = {
            "rows": rows,
            "latency_ms_median": round(float(np.median(lat)) * 1e3, 3),
            "kernel_ms_per_row": round(total / rows, 3),
            "matmul_ms_per_row": round(fc / rows, 3),
            "matmul_share": round(fc / total, 3),
            "int8_kernels": sorted({k for k in agg if k.endswith(("_i8", "_u8"))}),
            "top_ops_ms_per_row": {k: round(v / rows, 3) for k, v in sorted(agg.items(), key=lambda kv: -kv[1])[:8]},
        }
    return out


def bench_model(name: str, args, out: Path) -> dict:

    import dyncompile
    from dyncompile.io import read_jsonl, texts_and_labels
    from dyncompile.models import build_model
    from dyncompile.passes import CompileContext, build_passes
    from dyncompile.passes.early_exit.insert_early_exit import choose_lowering
    from dyncompile.tools.bench.common import (
        bench_runners,
        load_avg,
        plan_runner,
        reference_runner,
    )

    art = build_model(name)
    cfg = art.config
    calib = Path(args.data_dir) / "movie-calib.jsonl"
    test_t, test_y = texts_and_labels(read_jsonl(Path(args.data_dir) / "movie-test.jsonl"), cfg["labels"])
    test_y = np.asarray(test_y)
    calib_rows = len(read_jsonl(calib))
    plans_dir = out / "plans"
    lowering, reason = choose_lowering(args.provider)
    int8_spec = args.int8 or DEFAULT_INT8.get(args.provider, DEFAULT_INT8["cpu"])
    q_opts = _parse_opts(int8_spec)

    def quantize(spec=int8_spec):
        (q,) = build_passes(f"quantize-int8{{{spec}}}", CompileContext(options={"provider": args.provider}))
        return q

    # 1. int8 plan (the deployed int8 graph)
    t0 = time.perf_counter()
    int8_dir = dyncompile.compile(art.onnx_path, [quantize()], plans_dir / f"{name}-int8", force=True, progress=False).plan_dir
    t_quant = time.perf_counter() - t0
    alt_label, alt_spec = ALT_INT8.get(args.provider, ALT_INT8["cpu"])
    int8_default_dir = None
    if args.int8_alt_row and alt_spec != int8_spec:
        int8_default_dir = dyncompile.compile(
            art.onnx_path, [quantize(alt_spec)], plans_dir / f"{name}-int8-alt", force=True, progress=False
        ).plan_dir

    # 2. per budget: the early-exit and the int8 + early-exit pipelines (heads fitted, thresholds calibrated)
    cals: dict[str, dict] = {}
    seconds: dict[str, float] = {"int8_quantize": round(t_quant, 1)}
    ee_dirs, qee_dirs = {}, {}
    num_layers = None
    for b in args.budgets:
        opts = dict(budget=b, lowering=lowering, criterion=args.criterion, provider=args.provider,
                    confidence="none")  # the README table's calibration (uncertified); see studies.certified
        ee, seconds[f"early_exit_b{b}"] = compile_early_exit(art.onnx_path, plans_dir / f"{name}-ee-b{b}", calib, **opts)
        qee, seconds[f"int8_early_exit_b{b}"] = compile_early_exit(
            art.onnx_path, plans_dir / f"{name}-int8-ee-b{b}", calib, prefix=f"quantize-int8{{{int8_spec}}},", **opts
        )
        pol_ee, pol_q = ee.plan.policy["early_exit"], qee.plan.policy["early_exit"]
        for w in pol_q["calibration"]["warnings"]:
            logger.warning("int8+EE budget %s: %s", b, w)
        cals[str(b)] = {"early_exit": pol_ee["calibration"], "int8_early_exit": pol_q["calibration"]}
        ee_dirs[b], qee_dirs[b] = ee.plan_dir, qee.plan_dir
        num_layers = pol_ee["num_layers"]
        if not INT8_OPS & _ops(qee_dirs[b]):
            raise RuntimeError(f"{qee_dirs[b]} holds no int8 MatMul: the int8 + early-exit plan is not quantized")
    first = cals[str(args.budgets[0])]
    ref = first["int8_early_exit"]["reference"]
    calib_fidelity = {
        "fp32_accuracy": round(first["early_exit"]["baseline_accuracy"], 2),
        "int8_accuracy": round(ref["model_accuracy"], 2),
        "int8_agreement_with_fp32": round(ref["agreement_with_reference"], 2),
    }

    # 4. measure, interleaved
    load_kw = dict(provider=args.provider)
    int8 = dyncompile.load(int8_dir, **load_kw)
    runners = [reference_runner("fp32 original", art.onnx_path, int8, kind="fp32", budget=None),
               plan_runner("int8", int8, kind="int8", budget=None)]
    if int8_default_dir is not None:
        runners.append(plan_runner(alt_label, dyncompile.load(int8_default_dir, **load_kw), kind="int8-alt", budget=None,
                                   int8_options=_parse_opts(alt_spec)))
    for b in args.budgets:
        runners.append(plan_runner(f"early exit, budget {b}", dyncompile.load(ee_dirs[b], **load_kw), kind="ee", budget=b))
    for b in args.budgets:
        runners.append(plan_runner(f"int8 + early exit, budget {b}", dyncompile.load(qee_dirs[b], **load_kw),
                                   kind="int8+ee", budget=b))
    load_before = load_avg()
    t0 = time.perf_counter()
    report = bench_runners(runners, test_t, test_y, batch_size=args.batch_size, batch1_rows=args.batch1_rows)
    bench_s = time.perf_counter() - t0
    load_after = load_avg()
    _add_ratios(report, num_layers)
    prof = ov_prof = None
    if args.op_profile:
        models = {"fp32": art.onnx_path, "int8": _plan_model(int8_dir)}
        if int8_default_dir is not None:
            models[alt_label.split(" (")[0]] = _plan_model(int8_default_dir)
        if args.provider != "openvino":  # the OpenVINO EP's profile has one node per fused subgraph: native profile instead
            prof = op_profile(models, int8, test_t, args.op_profile)
        else:
            try:
                ov_prof = ov_native_profile(models, int8, test_t, args.op_profile)
            except ImportError:
                logger.warning("native openvino is not installed: no per-layer OpenVINO profile")
    report.update(
        model=name,
        provider=int8.provider,
        lowering=lowering,
        lowering_reason=reason,
        int8_options=q_opts,
        num_layers=num_layers,
        calib_rows=calib_rows,
        calib_fidelity=calib_fidelity,
        seconds=seconds | {"measurement": round(bench_s, 1)},
        load_avg_measurement={"before": load_before, "after": load_after},
        calibrations=cals,
        op_profile=prof,
        openvino_native_profile=ov_prof,
    )
    return report


def _add_ratios(report: dict, num_layers: int) -> None:
    tb = f"batch{report['batch_size']}"
    res = report["results"]
    base = res[0]
    ee = {r["budget"]: r for r in res if r["kind"] == "ee"}
    for r in res:
        for b in ("batch1", tb):
            if "accuracy" in r[b]:
                r[b]["delta_vs_fp32"] = round(r[b]["accuracy"] - base[b]["accuracy"], 2)
            r[b].setdefault("mean_exit_layer", num_layers)
        if r["kind"] == "int8+ee" and r["budget"] in ee:
            e = ee[r["budget"]]
            r["vs_ee_batch1_median"] = round(e["batch1"]["latency_ms_median"] / r["batch1"]["latency_ms_median"], 3)
            r[f"vs_ee_{tb}_throughput"] = round(r[tb]["throughput_rows_per_s"] / e[tb]["throughput_rows_per_s"], 3)


def markdown(report: dict) -> str:
    bs = report["batch_size"]
    tb = f"batch{bs}"
    lines = [
        f"| plan | acc b1 (%) | Δ vs fp32 | agree fp32 (%) | mean exit layer | p50 b1 (ms) | p90 b1 (ms) | speedup b1 | "
        f"int8+EE vs EE b1 | acc b{bs} (%) | rows/s b{bs} | speedup b{bs} | int8+EE vs EE b{bs} |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        b1, bb = r["batch1"], r[tb]
        key = r.get("vs_ee_batch1_median")
        lines.append(
            f"| {r['name']} | {b1.get('accuracy', '–')} | {b1.get('delta_vs_fp32', 0):+.2f} | {b1.get('agreement', '–')} | "
            f"{b1['mean_exit_layer']} | {b1['latency_ms_median']} | {b1['latency_ms_p90']} | {r['speedup_batch1_median']}x | "
            f"{f'**{key}x**' if key else '–'} | {bb.get('accuracy', '–')} | {bb['throughput_rows_per_s']} | "
            f"{r[f'speedup_{tb}_throughput']}x | {str(r[f'vs_ee_{tb}_throughput']) + 'x' if f'vs_ee_{tb}_throughput' in r else '–'} |"
        )
    lines += ["", "Calibration (movie-calib; the budget is the drop against the fp32 original for every plan):", "",
              "| plan | budget | int8's own drop on calib | left for the exits | calib: expected drop vs fp32 | calib: expected layer speedup |",
              "|---|---|---|---|---|---|"]
    fid = report["calib_fidelity"]
    for b, c in report["calibrations"].items():
        ee, q = c["early_exit"], c["int8_early_exit"]
        ref = q["reference"]
        lines.append(f"| early exit | {b} | – | {b} | {ee['baseline_accuracy'] - ee['expected_accuracy']:.2f} | "
                     f"{ee['expected_speedup']:.2f}x |")
        lines.append(f"| int8 + early exit | {b} | {ref['spent_by_model']:.2f} | {ref['budget_left']:.2f} | "
                     f"{ref['expected_drop_vs_reference']:.2f} | {q['expected_speedup']:.2f}x |")
    lines.append(f"\nint8 on movie-calib: {fid['int8_accuracy']} % vs fp32 {fid['fp32_accuracy']} %, agreement "
                 f"{fid['int8_agreement_with_fp32']} %.")
    if report.get("op_profile"):
        lines += ["", f"ORT per-operator profile at batch 1 ({report['provider']}, {report['op_profile']['fp32']['rows']} rows):", "",
                  "| model | kernel time / row (ms) | MatMul (ms) | of which fp32 / int8 (ms) | MatMul share | "
                  "activation quantization share | top ops (ms / row) |",
                  "|---|---|---|---|---|---|---|"]
        for k, p in report["op_profile"].items():
            top = ", ".join(f"{o} {v}" for o, v in list(p["top_ops_ms_per_row"].items())[:5])
            lines.append(f"| {k} | {p['kernel_ms_per_row']} | {p['matmul_ms_per_row']} | {p['fp32_matmul_ms_per_row']} / "
                         f"{p['int8_matmul_ms_per_row']} | {p['matmul_share'] * 100:.0f} % | "
                         f"{p['activation_quantization_share'] * 100:.0f} % | {top} |")
    ovp = report.get("openvino_native_profile")
    if ovp:
        lines += ["", f"Native OpenVINO {ovp['openvino']} per-layer profile at batch 1 (CPU, f32 inference precision, "
                  f"{ovp['fp32']['rows']} rows; the EP's own profile shows one node per fused subgraph):", "",
                  "| model | p50 (ms) | kernel time / row (ms) | FullyConnected/MatMul (ms) | share | int8 kernels | top layers (ms / row) |",
                  "|---|---|---|---|---|---|---|"]
        for k, p in ovp.items():
            if k == "openvino":
                continue
            top = ", ".join(f"{o} {v}" for o, v in list(p["top_ops_ms_per_row"].items())[:5])
            lines.append(f"| {k} | {p['latency_ms_median']} | {p['kernel_ms_per_row']} | {p['matmul_ms_per_row']} | "
                         f"{p['matmul_share'] * 100:.0f} % | {', '.join(p['int8_kernels']) or 'none'} | {top} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dyncompile.tools.studies.quantized_early_exit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--provider", default="cpu", help="execution provider of every session (cpu, openvino, ...)")
    p.add_argument("--models", nargs="+", default=["mpnet-base-sentiment"])
    p.add_argument("--budgets", nargs="+", default=["1.0", "1.5"], help="accuracy drop vs fp32 on movie-calib (points)")
    p.add_argument("--int8", default=None, help=f"quantize-int8 options (default per provider: {DEFAULT_INT8})")
    p.add_argument("--no-int8-alt-row", dest="int8_alt_row", action="store_false",
                   help=f"skip the extra int8-only row for contrast ({ALT_INT8})")
    p.add_argument("--criterion", default="entropy", choices=["entropy", "maxprob", "patience"])
    p.add_argument("--batch1-rows", type=int, default=600, help="rows in the batch-1 pass (default: %(default)s of 1,500)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--op-profile", type=int, default=0, metavar="N", help="ORT op profile of fp32 vs int8 on N rows")
    p.add_argument("--data-dir", default=str(DATA))
    p.add_argument("--out", default=None, help="default: bench-results/quantized-early-exit-PROVIDER")
    p.add_argument("--render", metavar="JSON", help=RENDER_HELP)
    rendered = render_requested(argv, render_markdown)
    if rendered is not None:
        return rendered
    args = p.parse_args(argv)
    args.models = [m for x in args.models for m in x.split(",") if m]
    args.budgets = [float(b) for x in args.budgets for b in x.split(",") if b]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from dyncompile.io import write_json_atomic
    from dyncompile.tools.bench.common import machine_info

    out = Path(args.out or f"bench-results/quantized-early-exit-{args.provider}")
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    reports = []
    command = "python -m dyncompile.tools.studies.quantized_early_exit " + " ".join(sys.argv[1:] if argv is None else argv)
    for name in args.models:
        reports.append(bench_model(name, args, out))
        write_json_atomic(out / "quantized_early_exit.json", {"command": command, "machine": machine, "reports": reports})
    md = render_markdown({"command": command, "machine": machine, "reports": reports})
    (out / "quantized_early_exit.md").write_text(md)
    print(md)
    return 0


def render_markdown(report: dict) -> str:
    """The markdown of a ``quantized_early_exit.json`` report (command, machine, one section per model)."""
    command, machine, reports = report["command"], report["machine"], report["reports"]
    parts = [f"`{command}`\n",
             f"Machine: {machine['cpu']}, {machine['cores']} cores, onnxruntime {machine['onnxruntime']}, provider "
             f"{reports[0]['provider']}, {machine['date']}; load average at start {machine['load_avg']}.\n"]
    for r in reports:
        lo = r["load_avg_measurement"]
        n_b = r["results"][0][f"batch{r['batch_size']}"]["rows"]
        parts.append(
            f"### {r['model']} — {r['provider']}, {r['lowering']} lowering (int8: {r['int8_options'] or 'pass defaults'}; "
            f"batch-1 pass over {r['results'][0]['batch1']['rows']} movie-test rows, batch {r['batch_size']} over "
            f"{n_b}; load {lo['before']} → {lo['after']})\n"
        )
        parts.append(markdown(r))
        parts.append("")
    return "\n".join(parts)


if __name__ == "__main__":
    sys.exit(main())
