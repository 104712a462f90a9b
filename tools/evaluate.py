"""Accuracy of a compiled classifier plan on a JSONL file, optionally against the original model."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from dyncompile.errors import DataError
from dyncompile.io import read_jsonl, texts_and_labels
from dyncompile.runtime.rules.exit_rule import softmax

__all__ = ["ReferenceModel", "check_labels_in_range", "evaluate_plan"]


def check_labels_in_range(labels: list[int] | None, names: list[str] | None, data) -> None:
    """Every gold label must be one of the plan's classes (a label outside them would be scored as wrong)."""
    if labels is None or names is None:
        return
    bad = [lab for lab in labels if not 0 <= lab < len(names)]
    if bad:
        raise DataError(
            f"{data}: label {bad[0]!r} is outside this plan's {len(names)} classes ({', '.join(names)}); use a class "
            f"index 0..{len(names) - 1} or a label name"
        )


class ReferenceModel:
    """The original ONNX classifier, run with the plan's tokenizer and provider (for comparisons)."""

    def __init__(self, onnx_path: str | Path, compiled, *, optimization: str | None = None) -> None:
        ctx = compiled.ctx
        so = ctx.session_options()
        if optimization == "disable":
            so.graph_optimization_level = ctx.ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        self.session = ctx.ort.InferenceSession(str(onnx_path), so, providers=ctx.providers)
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.compiled = compiled

    def logits(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        return self.session.run(None, {k: feeds[k] for k in self.input_names})[0]

    def predict_proba(self, texts, batch_size: int = 32) -> np.ndarray:
        out = []
        for i in range(0, len(texts), batch_size):
            out.append(softmax(np.asarray(self.logits(self.compiled.encode(texts[i : i + batch_size])), dtype=np.float64)))
        return np.concatenate(out)


def _drift_lines(compiled, exits, batch_size: int, report: dict[str, Any]) -> list[str]:
    """The observed exit histogram beside the calibration's, and the drift guard's verdict."""
    from dyncompile.runtime.drift import calibration_distribution, check, format_histograms

    if calibration_distribution(compiled.plan.policy) is None:
        return []
    if (compiled.plan.policy.get("early_exit") or {}).get("lowering") == "if" and batch_size > 1:
        return ["drift check: this If-graph plan decides one exit per batch; run with --batch-size 1 to compare "
                "per-row exits with the calibration's"]
    verdict = check(exits, compiled.plan.policy)
    report["drift"] = {k: v for k, v in verdict.to_dict().items() if k != "message"} | {"message": verdict.message}
    return ["exit layers vs calibration:", format_histograms(verdict)]


def evaluate_plan(compiled, data: str | Path, *, limit=None, batch_size: int = 32, compare: bool = False) -> dict[str, Any]:
    """Accuracy (if labelled), exit statistics, and with ``compare`` the max |p - p_original|."""
    if compiled.plan.task != "text-classification":
        raise DataError(f"--data evaluation is for classifiers; this plan's task is {compiled.plan.task!r}")
    rows = read_jsonl(data, limit=limit)
    texts, labels = texts_and_labels(rows, compiled.plan.labels)
    check_labels_in_range(labels, compiled.plan.labels, data)
    t0 = time.perf_counter()
    probs = compiled.predict_proba(texts, batch_size=batch_size)
    secs = time.perf_counter() - t0
    report: dict[str, Any] = {"rows": len(texts), "seconds": round(secs, 3), "provider": compiled.provider}
    lines = [f"{len(texts)} rows from {data} on {compiled.provider}: {secs:.2f} s"]
    pred = probs.argmax(-1)
    if labels is not None:
        acc = float((pred == np.asarray(labels)).mean() * 100)
        report["accuracy"] = round(acc, 2)
        lines.append(f"accuracy: {acc:.2f} %")
    exits = compiled.last_info.get("exit_layer")
    if exits is not None:
        report["mean_exit_layer"] = round(float(np.mean(exits)), 3)
        hist = {int(k): int(v) for k, v in zip(*np.unique(exits, return_counts=True))}
        report["exit_histogram"] = hist
        lines.append(f"mean exit layer: {np.mean(exits):.2f}  histogram: {hist}")
        lines.extend(_drift_lines(compiled, exits, batch_size, report))
    if compare:
        src = compiled.plan.original_model("--compare")  # sha256-checked: figures vs the true original only
        ref = ReferenceModel(src, compiled).predict_proba(texts, batch_size=batch_size)
        diff = float(np.abs(ref - probs).max())
        agree = float((ref.argmax(-1) == pred).mean() * 100)
        report.update(max_abs_prob_diff=diff, agreement=round(agree, 2))
        line = f"vs original {Path(src).name}: max |Δp| = {diff:.2e}, agreement {agree:.2f} %"
        if labels is not None:
            ref_acc = float((ref.argmax(-1) == np.asarray(labels)).mean() * 100)
            report["original_accuracy"] = round(ref_acc, 2)
            line += f", original accuracy {ref_acc:.2f} %"
        lines.append(line)
    report["text"] = "\n".join(lines)
    return report
