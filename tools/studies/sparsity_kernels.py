"""What contextual sparsity can buy with stock ONNX Runtime kernels: one decode-step MLP projection, dense vs gathered.

Contextual / activation sparsity (Deja Vu, TEAL) skips the weight rows whose input activation is (near) zero. On a
memory-bound CPU decode step that pays only if the skipped rows are never read. Stock ONNX Runtime has no sparse GEMV,
so the only graph-level way to skip rows is to ``Gather`` the active rows of the weight (and of the activation) and
run a smaller ``MatMul`` — which copies the active rows once more before the product reads them. This study times
exactly that against the dense ``MatMul`` at several sparsity levels, for the projections of Qwen2.5-Coder-1.5B's MLP
(hidden 1536, intermediate 8960) at batch 1, interleaved in one process, and reports the paired time ratio.

    python -m dyncompile.tools.studies.sparsity_kernels --out bench-results/contextual-sparsity
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from dyncompile.tools.bench.common import paired_ratio


def _model(w: np.ndarray, gathered: bool) -> bytes:
    """``y = x @ W`` (dense) or ``y = Gather(x, idx, 1) @ Gather(W, idx, 0)`` (only the active rows are read)."""
    x = ir.val("x", ir.DataType.FLOAT, ir.Shape([1, w.shape[0]]))
    wv = ir.val("W", const_value=ir.tensor(w, name="W"))
    tape = ir.tape.Tape()
    inputs = [x]
    if gathered:
        idx = ir.val("idx", ir.DataType.INT64, ir.Shape(["k"]))
        inputs.append(idx)
        y = tape.op("MatMul", [tape.op("Gather", [x, idx], {"axis": 1}), tape.op("Gather", [wv, idx], {"axis": 0})])
    else:
        y = tape.op("MatMul", [x, wv])
    y.name, y.dtype, y.shape = "y", ir.DataType.FLOAT, ir.Shape([1, w.shape[1]])
    g = ir.Graph(inputs, [y], nodes=tape.nodes, initializers=[wv], opset_imports={"": 17}, name="proj")
    return ir.serde.serialize_model(ir.Model(g, ir_version=9)).SerializeToString()


def _session(model: bytes, threads: int) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--sparsity", default="0,0.25,0.5,0.7,0.9")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    levels = [float(s) for s in args.sparsity.split(",")]
    shapes = {"down_proj (8960 -> 1536)": (8960, 1536), "up/gate_proj (1536 -> 8960)": (1536, 8960)}
    rows = []
    for name, (din, dout) in shapes.items():
        w = rng.standard_normal((din, dout), dtype=np.float32) * 0.02
        x = rng.standard_normal((1, din), dtype=np.float32)
        dense, gath = _session(_model(w, False), args.threads), _session(_model(w, True), args.threads)
        for s in levels:
            k = max(1, round(din * (1 - s)))
            idx = np.sort(rng.choice(din, size=k, replace=False)).astype(np.int64)
            xz = np.zeros_like(x)
            xz[0, idx] = x[0, idx]
            ref = dense.run(None, {"x": xz})[0]
            got = gath.run(None, {"x": x, "idx": idx})[0]
            err = float(np.max(np.abs(ref - got)))
            td, tg = [], []
            for _ in range(5):
                dense.run(None, {"x": x}), gath.run(None, {"x": x, "idx": idx})
            for r in range(args.reps):
                order = (0, 1) if r % 2 == 0 else (1, 0)
                for o in order:
                    t0 = time.perf_counter()
                    if o == 0:
                        dense.run(None, {"x": x})
                        td.append(time.perf_counter() - t0)
                    else:
                        gath.run(None, {"x": x, "idx": idx})
                        tg.append(time.perf_counter() - t0)
            ratio = paired_ratio(td, tg)
            rows.append({"projection": name, "sparsity": s, "active_rows": k, "dense_ms": 1e3 * float(np.median(td)),
                         "gathered_ms": 1e3 * float(np.median(tg)), "speedup": ratio,
                         "max_abs_err_vs_dense_on_sparse_input": err})
    report = {"study": "contextual-sparsity kernels", "threads": args.threads, "reps": args.reps,
              "onnxruntime": ort.__version__, "onnx": onnx.__version__, "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "load": os.getloadavg()[0], "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernels.json").write_text(json.dumps(report, indent=2))
    md = render_markdown(report)
    (args.out / "kernels.md").write_text(md)
    print(md)


def render_markdown(report: dict) -> str:
    """The study's table (the markdown beside ``kernels.json``)."""
    lines = ["| projection | sparsity | active rows | dense ms | gathered ms | dense/gathered time (95 % CI) |",
             "|---|---|---|---|---|---|"]
    for r in report["rows"]:
        sp = r["speedup"]
        lines.append(f"| {r['projection']} | {r['sparsity']:.2f} | {r['active_rows']} | {r['dense_ms']:.3f} | "
                     f"{r['gathered_ms']:.3f} | {sp['ratio']:.2f} ({sp['lo']:.2f}–{sp['hi']:.2f}) |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
