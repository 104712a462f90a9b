"""The peers a user would pick for a faster encoder classifier on the CPU, prepared from the same original and rows.

dyncompile's quantized early-exit plans are measured against the fp32 original; a user who only wants a faster
classifier would more likely reach for one of these instead:

* **OpenVINO + NNCF** (``nncf`` subcommand): NNCF's post-training int8 quantization of the original ONNX for the
  OpenVINO runtime (``nncf.quantize``, ``ModelType.TRANSFORMER``: its SmoothQuant and bias correction), calibrated
  on the first ``--rows`` calibration rows; with ``--max-drop P``, NNCF's accuracy-aware variant
  (``nncf.quantize_with_accuracy_control``: it reverts the layers that cost the most accuracy to floating point
  until the drop in accuracy on the validation rows is at most ``P`` points), validated on the calibration rows
  after those. The saved ``model.xml`` runs on OpenVINO's CPU plugin.
* **Optimum + ONNX Runtime**: ``optimum-cli onnxruntime quantize --avx512_vnni`` (dynamic int8, run from the
  ``optimum`` extra's environment; the study's README has the command) writes ``model_quantized.onnx``, which
  runs on ONNX Runtime's CPU EP like the fp32 original.

Both kinds become runners of the quantized-certified study (``--peer LABEL=openvino:DIR`` /
``--peer LABEL=onnxruntime:FILE``), interleaved with the fp32 original and the plans, tokenized by the plan's
own tokenizer, so every row's accuracy and time sit beside dyncompile's on the same rows. A peer promises
nothing (no certificate): its accuracy on the report rows is all it has.

    python -m dyncompile.tools.studies.encoder_peers nncf --plan PLAN_DIR --calib movie-calib.jsonl --out ov-int8
    python -m dyncompile.tools.studies.encoder_peers nncf --plan PLAN_DIR --calib movie-calib.jsonl --out ov-ac \\
        --max-drop 1.0

``openvino`` and ``nncf`` are not dependencies of dyncompile (``pip install openvino nncf`` for this study).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from dyncompile.errors import DataError
from dyncompile.runtime.rules.exit_rule import softmax
from dyncompile.tools.bench.common import Runner

__all__ = ["PEER_KINDS", "nncf_int8", "openvino_runner", "parse_peer", "peer_runner"]

#: peer kinds the study can run, and what each reads
PEER_KINDS = {
    "openvino": "an OpenVINO model (model.xml or a folder holding one; an .onnx file is read as is) on the CPU plugin",
    "onnxruntime": "an ONNX file (or a folder holding one) on ONNX Runtime's CPU EP, default session options",
}
#: OpenVINO CPU plugin settings every peer runs with (batch 1, the study's two threads)
OV_LATENCY = {"PERFORMANCE_HINT": "LATENCY"}


def _openvino():
    try:
        import openvino as ov
    except ImportError:
        raise DataError("this peer runs on OpenVINO, which is not installed here; pip install openvino "
                        "(and nncf to prepare its int8 models)") from None
    return ov


def parse_peer(text: str) -> tuple[str, str, Path, dict[str, str]]:
    """``LABEL=KIND:PATH[,key=value...]`` -> (label, kind, path, options), checked.

    Options of an ``openvino`` peer: ``precision`` (``INFERENCE_PRECISION_HINT``: f32, bf16) and ``pad`` (a static
    input shape ``[1, pad]``, every row padded to it: OpenVINO's CPU plugin runs a static shape faster than a
    dynamic one).
    """
    label, sep, rest = text.partition("=")
    kind, sep2, spec = rest.partition(":")
    if not sep or not sep2 or not label or kind not in PEER_KINDS:
        raise DataError(f"--peer {text!r}: expected LABEL=KIND:PATH with KIND one of {', '.join(PEER_KINDS)} "
                        "(e.g. 'NNCF int8=openvino:ov-int8' or 'Optimum int8=onnxruntime:opt/model_quantized.onnx')")
    path, *opts = spec.split(",")
    options = {}
    for o in opts:
        k, eq, v = o.partition("=")
        if not eq or k not in ("precision", "pad") or kind != "openvino":
            raise DataError(f"--peer {text!r}: unknown option {o!r} (an openvino peer takes precision=f32|bf16 and "
                            "pad=LENGTH)")
        if k == "pad" and not (v.isdigit() and int(v) > 0):
            raise DataError(f"--peer {text!r}: pad must be a positive number of tokens, got {v!r}")
        options[k] = v
    p = Path(path)
    if p.is_dir():
        found = sorted(p.glob("*.xml")) if kind == "openvino" else []
        found = found or sorted(p.glob("*.onnx"))
        if len(found) != 1:
            raise DataError(f"--peer {text!r}: {p} holds {len(found)} model files; name the one to run")
        p = found[0]
    if not p.is_file():
        raise DataError(f"--peer {text!r}: no file {p}; prepare it first (see this module's help)")
    return label, kind, p, options


def openvino_runner(name: str, model_path: Path, compiled, *, threads: int = 2, precision: str | None = None,
                    pad: int | None = None) -> Runner:
    """A runner of an OpenVINO model on the CPU plugin, fed by ``compiled``'s tokenizer; batch 1 (latency hint).

    ``precision`` sets ``INFERENCE_PRECISION_HINT`` (``f32``, ``bf16``); ``None`` keeps the plugin's default (bf16
    on CPUs with bf16 instructions), as a user who does not set it gets. ``pad`` compiles the static shape
    ``[1, pad]`` and pads every row to it (masked: the answers do not change); it must hold the plan's longest row.
    """
    ov = _openvino()
    core = ov.Core()
    cfg = {**OV_LATENCY, "INFERENCE_NUM_THREADS": str(threads)}
    if precision:
        cfg["INFERENCE_PRECISION_HINT"] = precision
    source = core.read_model(str(model_path))
    names = [i.get_any_name() for i in source.inputs]
    pad_id = 0
    if pad:
        encoder = getattr(compiled.task_api, "encoder", None)  # the classifier task's TextEncoder
        if encoder is None:
            raise DataError(f"peer {name!r}: pad needs a plan with a tokenizer")
        if pad < encoder.max_length:
            raise DataError(f"peer {name!r}: pad={pad} is shorter than the plan's rows (up to {encoder.max_length} tokens)")
        pad_id = encoder.pad_id
        source.reshape({k: [1, pad] for k in names})
    model = core.compile_model(source, "CPU", cfg)
    request = model.create_infer_request()

    def fn(texts):
        feeds = compiled.encode(texts)
        feeds = {k: feeds[k] for k in names}
        if pad:
            feeds = {k: np.pad(v, ((0, 0), (0, pad - v.shape[1])), constant_values=pad_id if k == "input_ids" else 0)
                     for k, v in feeds.items()}
        return softmax(np.asarray(request.infer(feeds)[0], dtype=np.float64)), None

    hint = model.get_property("INFERENCE_PRECISION_HINT")
    info = {"peer": "openvino", "openvino": ov.get_version(),
            "inference_precision": getattr(hint, "get_type_name", lambda: str(hint))(), "threads": threads,
            "input_shape": f"[1, {pad}] (padded)" if pad else "dynamic"}
    return Runner(name, fn, info)


def peer_runner(text: str, compiled, *, threads: int = 2) -> Runner:
    """The runner of one ``--peer LABEL=KIND:PATH`` (see :data:`PEER_KINDS`)."""
    label, kind, path, options = parse_peer(text)
    if kind == "openvino":
        return openvino_runner(label, path, compiled, threads=threads, precision=options.get("precision"),
                               pad=int(options["pad"]) if "pad" in options else None)
    from dyncompile.tools.bench.common import reference_runner

    return reference_runner(label, str(path), compiled, peer="onnxruntime")


def nncf_int8(plan_dir: Path, calib: Path, out: Path, *, rows: int = 300, max_drop: float | None = None,
              validation_rows: int = 1000) -> dict[str, Any]:
    """NNCF int8 of the plan's original model for OpenVINO, calibrated (and validated) on ``calib``; saved in ``out``.

    Calibration: the first ``rows`` rows, one row per sample (the plan's tokenizer, no padding). With ``max_drop``
    (accuracy points), the accuracy-aware variant is validated on the next ``validation_rows`` rows against the
    fp32 model's accuracy there. Returns (and writes as ``peer.json``) what was done.
    """
    import dyncompile
    from dyncompile.io import read_jsonl, texts_and_labels

    ov = _openvino()
    try:
        import nncf
    except ImportError:
        raise DataError("preparing an NNCF peer needs nncf; pip install nncf") from None
    compiled = dyncompile.load(plan_dir, provider="cpu")
    original = Path(compiled.plan.original_model("bench"))
    texts, labels = texts_and_labels(read_jsonl(calib), compiled.plan.labels)
    need = rows + (validation_rows if max_drop is not None else 0)
    if len(texts) < need:
        raise DataError(f"{calib}: {len(texts)} rows, this preparation needs {need} ({rows} to calibrate"
                        + (f", {validation_rows} to validate)" if max_drop is not None else ")"))
    core = ov.Core()
    model = core.read_model(str(original))
    names = [i.get_any_name() for i in model.inputs]

    def feeds(i):
        f = compiled.encode([texts[i]])
        return {k: f[k] for k in names}

    calibration = nncf.Dataset([feeds(i) for i in range(rows)])
    t0 = time.perf_counter()
    record: dict[str, Any] = {"original": original.name, "calibration_rows": [0, rows], "nncf": nncf.__version__,
                              "openvino": ov.get_version(), "model_type": "transformer"}
    if max_drop is None:
        quantized = nncf.quantize(model, calibration, model_type=nncf.ModelType.TRANSFORMER, subset_size=rows)
        record["method"] = "nncf.quantize (post-training int8)"
    else:
        val = [(feeds(i), labels[i]) for i in range(rows, rows + validation_rows)]

        def accuracy(compiled_model, data) -> float:
            request = compiled_model.create_infer_request()
            hits = [int(np.asarray(request.infer(x)[0]).argmax(-1)[0] == y) for x, y in data]
            return float(np.mean(hits))

        quantized = nncf.quantize_with_accuracy_control(
            model, calibration, nncf.Dataset(val, lambda item: item[0]), validation_fn=accuracy, max_drop=max_drop / 100.0,
            drop_type=nncf.DropType.ABSOLUTE, model_type=nncf.ModelType.TRANSFORMER, subset_size=rows)
        record.update(method="nncf.quantize_with_accuracy_control", max_drop_points=max_drop,
                      validation_rows=[rows, rows + validation_rows])
    record["seconds"] = round(time.perf_counter() - t0, 1)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".model.tmp.xml"
    ov.save_model(quantized, str(tmp), compress_to_fp16=False)
    tmp.with_suffix(".bin").replace(out / "model.bin")
    tmp.replace(out / "model.xml")
    (out / "peer.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    from dyncompile.tools.bench.common import DATA

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog="\n".join(__doc__.splitlines()[1:]))
    sub = p.add_subparsers(dest="cmd", required=True)
    n = sub.add_parser("nncf", help="NNCF int8 (or, with --max-drop, accuracy-aware int8) for OpenVINO")
    n.add_argument("--plan", required=True, type=Path, help="a compiled plan of the model (its original is quantized)")
    n.add_argument("--calib", type=Path, default=DATA / "movie-calib.jsonl", help="labelled calibration rows")
    n.add_argument("--rows", type=int, default=300, help="calibration rows (the first ones)")
    n.add_argument("--max-drop", type=float, help="accuracy-aware: largest drop in accuracy points on the validation rows")
    n.add_argument("--validation-rows", type=int, default=1000, help="validation rows (after the calibration rows)")
    n.add_argument("--out", required=True, type=Path)
    a = p.parse_args(argv)
    try:
        rec = nncf_int8(a.plan, a.calib, a.out, rows=a.rows, max_drop=a.max_drop, validation_rows=a.validation_rows)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(rec, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
