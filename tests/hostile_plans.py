"""Real plans made cheaply for the hostile-input and fuzz tests (importable: tests/ is on pythonpath).

Each plan comes out of the real compiler / emitters, from the tiny generated models of
``dyncompile.models.synthetic`` and ``tiny_decoder``, with a word-level tokenizer, so that loading one and
running a prediction takes milliseconds.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import onnx_ir as ir

from dyncompile.models.synthetic_decoder import tiny_decoder, write_decoder_dir, write_word_tokenizer

LABELS = ["negative", "positive"]
TEXT = "w3 w5 w7 w9"


def classifier_dir(directory: Path) -> Path:
    """``directory/model.onnx`` (tiny 4-layer encoder) + tokenizer.json + dyncompile-model.json; the model path."""
    from dyncompile.models.synthetic import tiny_encoder_classifier

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "model.onnx"
    ir.save(tiny_encoder_classifier(num_layers=4), path)
    write_word_tokenizer(directory, 512)
    cfg = {"format": "dyncompile.model/v1", "name": "tiny-encoder", "task": "text-classification",
           "labels": LABELS, "max_length": 64}
    (directory / "dyncompile-model.json").write_text(json.dumps(cfg))
    return path


def run_model_plan(model_path: Path, out: Path) -> Path:
    """A ``run_model`` classifier plan compiled from ``model_path`` (provenance records it)."""
    import dyncompile

    dyncompile.compile(model_path, "verify,cleanup", out, progress=False)
    return out


def staged_plan(out: Path, *, criterion: str = "entropy") -> Path:
    """An ``early_exit_staged`` plan of the tiny encoder with random exit heads after layers 1..3."""
    import numpy as np

    from dyncompile.models.synthetic import tiny_encoder_classifier
    from dyncompile.passes import InsertEarlyExitPass
    from dyncompile.passes.early_exit.attach_exit_heads import attach_exit_heads
    from dyncompile.passes.early_exit.heads import ExitHead
    from dyncompile.passes.emit import EmitRequest, emit_plan
    from dyncompile.plan import save_plan

    m = tiny_encoder_classifier(num_layers=4)
    lns = [n for n in m.graph if n.op_type == "LayerNormalization"]
    exits = (1, 2, 3)
    rng = np.random.default_rng(1)
    heads = {
        k: ExitHead("cls+mean", [
            (rng.standard_normal((512, 16)).astype(np.float32) * 0.1, np.zeros(16, np.float32), "tanh"),
            (rng.standard_normal((16, 2)).astype(np.float32), np.zeros(2, np.float32), "none"),
        ])
        for k in exits
    }
    thresholds = {1: 0.05, 2: 0.3, 3: 0.6} if criterion == "entropy" else {1: 0.95, 2: 0.8, 3: 0.6}
    attach_exit_heads(m, heads=heads, cuts={k: lns[k].outputs[0].name for k in exits}, thresholds=thresholds,
                      num_layers=4, criterion=criterion, patience=2)
    InsertEarlyExitPass("staged")(m)
    out.mkdir(parents=True, exist_ok=True)
    tok = write_word_tokenizer(out.parent / (out.name + "-tok"), 512)
    req = EmitRequest(out_dir=out, task="text-classification", tokenizer_file=tok,
                      tokenizer_spec={"max_length": 64, "padding": "longest"}, labels=LABELS)
    save_plan(emit_plan(m, req), out)
    shutil.rmtree(tok.parent)
    return out


def decoder_dir(directory: Path) -> Path:
    """A tiny KV-cache decoder with a word tokenizer and a model config (text-generation); the model path."""
    path = write_decoder_dir(directory, tiny_decoder(vocab=16), eos=0)
    write_word_tokenizer(directory, 16, eos=0)
    return path


def generate_plan(model_path: Path, out: Path, *, speculative: bool = False) -> Path:
    """A ``generate`` plan (or ``speculative_generate`` with prompt lookup) of a tiny decoder."""
    import dyncompile

    # -O0: the plain export's graph (export-genai refuses the -O2 lowering's extra inputs)
    if speculative:
        dyncompile.compile(model_path, "speculative{measure=false}", out, drafter="prompt-lookup", progress=False,
                           opt_level=0)
    else:
        dyncompile.compile(model_path, "verify,cleanup", out, progress=False, opt_level=0)
    return out


def read_plan(plan_dir: Path) -> dict:
    return json.loads((plan_dir / "plan.json").read_text())


def write_plan(plan_dir: Path, raw: dict) -> None:
    (plan_dir / "plan.json").write_text(json.dumps(raw, indent=1))


def rehash(plan_dir: Path, key: str) -> None:
    """Record the current sha256 of file ``key`` in plan.json (what a malicious publisher would do)."""
    raw = read_plan(plan_dir)
    raw["files"][key]["sha256"] = hashlib.sha256((plan_dir / raw["files"][key]["path"]).read_bytes()).hexdigest()
    write_plan(plan_dir, raw)


def tree_state(root: Path, *, skip: Path | None = None) -> dict[str, str]:
    """path -> sha256 (files) / 'dir' of everything under ``root`` except under ``skip``."""
    out = {}
    for p in sorted(root.rglob("*")):
        if skip is not None and (p == skip or skip in p.parents):
            continue
        out[str(p.relative_to(root))] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def word_calib(path: Path, n: int = 40, *, labels: bool = True, field: str = "text") -> Path:
    """A JSONL calibration file of word texts for the tiny word tokenizer (seeded)."""
    import numpy as np

    rng = np.random.default_rng(3)
    rows = []
    for _ in range(n):
        row = {field: " ".join(f"w{int(i)}" for i in rng.integers(1, 500 if field == "text" else 15, size=int(rng.integers(2, 9))))}
        if labels:
            row["label"] = int(rng.integers(0, 2))
        rows.append(row)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def routed_plan(candidates: list[Path], out: Path, calib: Path, **kwargs) -> Path:
    """A routed plan over ``candidates`` made by ``dyncompile.route`` (uncertified, given costs: milliseconds)."""
    import dyncompile

    costs = {Path(c).name: float(i + 1) for i, c in enumerate(candidates)}
    costs["router"] = 0.01
    opts = {"confidence": "none", "budget": 100.0, "costs": costs, "progress": False, **kwargs}
    return dyncompile.route(candidates, calib, out, **opts).plan_dir
