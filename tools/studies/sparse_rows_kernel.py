"""The shipped sparse kernel's step cost against sparsity: ``dyncompile.SparseRowsMatMul`` vs ORT's dense kernels.

One decode-step projection (one row) of Qwen2.5-Coder-1.5B's MLP — down (8960 -> 1536) and up/gate (1536 -> 8960) —
at several sparsity levels, timed against the two dense forms a plan can hold: ``MatMul`` (the graph without the
Conv lowering) and the 1x1 ``Conv`` of ``matmul-to-conv`` (the default CPU plan's). Each call multiplies the same
row by ``--weights`` distinct random weights, so that the weights stream from memory as in a real step (four
55 MB weights do not fit a 32 MB L3). The kernels run interleaved in one process, the order reversed every
repetition; the ratios are paired per repetition (geometric mean, 95 % bootstrap interval). The threshold at level
``s`` is the ``s``-quantile of the row's ``|x|``, as the pass sets it.

    python -m dyncompile.tools.studies.sparse_rows_kernel --out bench-results/contextual-sparsity --name kernels-sparse-rows
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from dyncompile.tools.bench.common import paired_ratio, write_report

SHAPES = {"down_proj (8960 -> 1536)": (8960, 1536), "up/gate_proj (1536 -> 8960)": (1536, 8960)}
KINDS = ("matmul", "conv", "sparse")


def _model(kind: str, ws: list[np.ndarray], threshold: float = 0.0) -> bytes:
    """``y_j = x @ W_j`` for each weight, as ``MatMul``, as the lowering's 1x1 ``Conv`` or as ``SparseRowsMatMul``."""
    from dyncompile.runtime.kernels import DOMAIN, OP_TYPE

    k, n = ws[0].shape
    x = ir.val("x", ir.DataType.FLOAT, ir.Shape([1, 1, k]))
    tape = ir.tape.Tape()
    inits, outs = [], []
    if kind == "conv":  # matmul-to-conv's form: NHWC [1, 1, 1, K] -> NCHW, Conv with W^T [N, K, 1, 1], back
        axes = ir.val("axes", const_value=ir.tensor(np.array([1], np.int64), name="axes"))
        inits.append(axes)
        xt = tape.op("Transpose", [tape.op("Unsqueeze", [x, axes])], {"perm": [0, 3, 1, 2]})
    for j, w in enumerate(ws):
        arr = np.ascontiguousarray(w.T.reshape(n, k, 1, 1)) if kind == "conv" else w
        wv = ir.val(f"W{j}", const_value=ir.tensor(arr, name=f"W{j}"))
        inits.append(wv)
        if kind == "matmul":
            y = tape.op("MatMul", [x, wv])
        elif kind == "conv":
            y = tape.op("Squeeze", [tape.op("Transpose", [tape.op("Conv", [xt, wv])], {"perm": [0, 2, 3, 1]}), axes])
        else:
            y = tape.op(OP_TYPE, [x, wv], {"threshold": ir.AttrFloat32("threshold", threshold)}, domain=DOMAIN)
        y.name, y.dtype, y.shape = f"y{j}", ir.DataType.FLOAT, ir.Shape([1, 1, n])
        outs.append(y)
    opsets = {"": 17, **({DOMAIN: 1} if kind == "sparse" else {})}
    g = ir.Graph([x], outs, nodes=tape.nodes, initializers=inits, opset_imports=opsets, name=kind)
    return ir.to_proto(ir.Model(g, ir_version=9)).SerializeToString()


def _session(model: bytes, threads: int, custom: bool) -> ort.InferenceSession:
    from dyncompile.runtime import kernels

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    if custom:
        kernels.register(so, *kernels.library())
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def measure(shapes: dict[str, tuple[int, int]], levels: list[float], *, weights: int, reps: int, threads: int,
            seed: int = 0) -> list[dict]:
    """One row per (projection, level): median ms per weight of each kernel, the sparse kernel's paired ratios."""
    rng = np.random.default_rng(seed)
    rows = []
    for name, (k, n) in shapes.items():
        ws = [rng.standard_normal((k, n), dtype=np.float32) * 0.02 for _ in range(weights)]
        x = rng.standard_normal((1, 1, k), dtype=np.float32)
        runners = {"matmul": _session(_model("matmul", ws), threads, False),
                   "conv": _session(_model("conv", ws), threads, False)}
        thresholds = {s: float(np.quantile(np.abs(x), s)) if s > 0 else 0.0 for s in levels}
        for s, t in thresholds.items():
            runners[s] = _session(_model("sparse", ws, t), threads, True)
        tol = 1e-4 * max(1.0, float(np.abs(x[0] @ ws[0]).max()))
        for key, xm in (("matmul", x), ("conv", x), *((s, np.where(np.abs(x) > t, x, 0)) for s, t in thresholds.items())):
            if np.abs(runners[key].run(None, {"x": x})[0][0] - xm[0] @ ws[0]).max() > tol:
                raise AssertionError(f"{name}: the {key} runner does not compute its (masked) x @ W")
        times: dict = {key: [] for key in runners}
        keys = list(runners)
        for r in range(reps + 3):
            for key in keys if r % 2 == 0 else keys[::-1]:
                t0 = time.perf_counter()
                runners[key].run(None, {"x": x})
                if r >= 3:  # three warm-up rounds
                    times[key].append((time.perf_counter() - t0) / weights)
        for s in levels:
            sp = times[s]
            rows.append({"projection": name, "sparsity": s, "active_rows": int((np.abs(x) > thresholds[s]).sum()),
                         "matmul_ms": 1e3 * float(np.median(times["matmul"])),
                         "conv_ms": 1e3 * float(np.median(times["conv"])),
                         "sparse_ms": 1e3 * float(np.median(sp)),
                         "speedup_vs_conv": paired_ratio(times["conv"], sp),
                         "speedup_vs_matmul": paired_ratio(times["matmul"], sp)})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--name", default="kernels-sparse-rows", help="report file stem")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--weights", type=int, default=4, help="distinct weights per call (more than the L3 holds)")
    ap.add_argument("--sparsity", default="0,0.25,0.4,0.5,0.7")
    ap.add_argument("--shapes", default=None, help="KxN,KxN (default: the 1.5B's down and up projections)")
    args = ap.parse_args(argv)
    shapes = SHAPES if args.shapes is None else {
        f"{k} -> {n}": (int(k), int(n)) for k, n in (s.split("x") for s in args.shapes.split(","))}
    levels = [float(s) for s in args.sparsity.split(",")]
    load = os.getloadavg()
    rows = measure(shapes, levels, weights=args.weights, reps=args.reps, threads=args.threads)
    report = {"study": "SparseRowsMatMul step cost", "threads": args.threads, "reps": args.reps,
              "weights_per_call": args.weights, "onnxruntime": ort.__version__, "onnx": onnx.__version__,
              "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
              "load_before_after": [round(load[0], 2), round(os.getloadavg()[0], 2)], "rows": rows}
    report["markdown"] = render_markdown(report)
    write_report(report, args.out, args.name)  # the JSON atomically, the markdown beside it
    print(report["markdown"])


def render_markdown(report: dict) -> str:
    """The study's table (the markdown beside its JSON)."""
    lines = [f"## {report['study']}: one row, {report['weights_per_call']} distinct weights a call, "
             f"{report['threads']} threads, {report['reps']} repetitions",
             "",
             f"{report['machine']}, {report['cpus']} CPUs, onnxruntime {report['onnxruntime']}, {report['date']}, "
             f"load {report['load_before_after'][0]} -> {report['load_before_after'][1]}",
             "",
             "| projection | sparsity | active rows | MatMul ms | 1x1 Conv ms | SparseRowsMatMul ms | "
             "speedup vs Conv (95 % CI) | speedup vs MatMul (95 % CI) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        c, m = r["speedup_vs_conv"], r["speedup_vs_matmul"]
        lines.append(f"| {r['projection']} | {r['sparsity']:.2f} | {r['active_rows']} | {r['matmul_ms']:.3f} | "
                     f"{r['conv_ms']:.3f} | {r['sparse_ms']:.3f} | {c['ratio']:.2f} ({c['lo']:.2f}–{c['hi']:.2f}) | "
                     f"{m['ratio']:.2f} ({m['lo']:.2f}–{m['hi']:.2f}) |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
