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


def tree_plan(model_path: Path, out: Path) -> Path:
    """A draft-tree ``speculative_generate`` plan (prompt lookup) of a tiny decoder."""
    import dyncompile

    spec = "explicit-attention,speculative{tree=true,tree_nodes=6,measure=false}"
    dyncompile.compile(model_path, spec, out, drafter="prompt-lookup", progress=False)
    return out


def diffusion_plan(out: Path, *, external_data: bool = True) -> Path:
    """A runnable text-to-image plan of tiny hand-made graphs (text encoder, U-Net, VAE decoder; word tokenizer).

    With ``external_data`` the U-Net keeps its weight in ``unet/model.onnx.data`` (a hashed file of the plan).
    """
    import numpy as np

    from dyncompile.plan import Plan, Step, file_ref, save_plan

    rng = np.random.default_rng(5)
    d, side = 8, 8
    f32, i64 = ir.DataType.FLOAT, ir.DataType.INT64

    def const(name, arr):
        return ir.val(name, const_value=ir.tensor(arr, name=name))

    def model(inputs, build, out_name, out_type, out_shape, inits):
        tape = ir.tape.Tape()
        y = build(tape)
        y.name, y.dtype, y.shape = out_name, out_type, ir.Shape(out_shape)
        g = ir.Graph(inputs, [y], nodes=tape.nodes, initializers=inits, opset_imports={"": 17}, name=out_name)
        return ir.Model(g, ir_version=9)

    ids, mask = ir.val("input_ids", i64, ir.Shape(["b", "l"])), ir.val("attention_mask", i64, ir.Shape(["b", "l"]))
    emb = const("E", rng.standard_normal((64, d)).astype(np.float32))
    te = model([ids, mask], lambda t: t.op("Gather", [emb, ids]), "last_hidden_state", f32, ["b", "l", d], [emb])
    sample = ir.val("sample", f32, ir.Shape(["b", 1, side, side]))
    timestep = ir.val("timestep", i64, ir.Shape(["b"]))
    ehs = ir.val("encoder_hidden_states", f32, ir.Shape(["b", "l", d]))
    w = const("W", (0.3 * rng.standard_normal((1, 1, side, side))).astype(np.float32))
    k = const("k", np.array(1e-4, np.float32))
    shape4 = const("shape4", np.array([-1, 1, 1, 1], np.int64))

    def unet_body(t):
        m4 = t.op("Reshape", [t.op("ReduceMean", [ehs], {"axes": [1, 2], "keepdims": 1}), shape4])
        tk4 = t.op("Reshape", [t.op("Mul", [t.op("Cast", [timestep], {"to": f32}), k]), shape4])
        return t.op("Add", [t.op("Mul", [sample, w]), t.op("Add", [m4, tk4])])

    unet = model([sample, timestep, ehs], unet_body, "out_sample", f32, ["b", 1, side, side], [w, k, shape4])
    latent = ir.val("latent", f32, ir.Shape(["b", 1, side, side]))
    vae = model([latent], lambda t: t.op("Tanh", [latent]), "image", f32, ["b", 1, side, side], [])
    for sub in ("text_encoder", "unet", "vae_decoder"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    ir.save(te, out / "text_encoder" / "model.onnx")
    ir.save(vae, out / "vae_decoder" / "model.onnx")
    files = {"text_encoder": file_ref(out, "text_encoder/model.onnx", "text_encoder"),
             "vae_decoder": file_ref(out, "vae_decoder/model.onnx", "vae_decoder")}
    if external_data:
        ir.save(unet, out / "unet" / "model.onnx", external_data="model.onnx.data", size_threshold_bytes=200)
        files["unet"] = file_ref(out, "unet/model.onnx", "unet", ["unet/model.onnx.data"])
        files["unet.data"] = file_ref(out, "unet/model.onnx.data", "external_data")
    else:
        ir.save(unet, out / "unet" / "model.onnx")
        files["unet"] = file_ref(out, "unet/model.onnx", "unet")
    write_word_tokenizer(out, 64)
    files["tokenizer"] = file_ref(out, "tokenizer.json", "tokenizer")
    steps = [
        Step("diffusion_encode", {"text_encoder": "text_encoder", "output": "last_hidden_state", "null_prompt": ""}),
        Step("predict_steps", {"weights": [0.5] * d, "bias": 2.0, "mean": [0.0] * d, "scale": [1.0] * d,
                               "grid": [2, 4, 6], "offset": 0.0, "features": "mean_pool"}),
        Step("diffusion_denoise", {
            "unet": "unet", "input_names": ["sample", "timestep", "encoder_hidden_states"],
            "scheduler": {"_class_name": "DDIMScheduler", "num_train_timesteps": 100}, "guidance_scale": 2.0,
            "num_inference_steps": 4, "sample_shape": [1, side, side], "output_crop": [0, side, 0, side],
            "eta": 0.0, "noise": "numpy", "default_policy": "predicted",
            "stop_rule": {"kind": "x0_change", "threshold": 0.01, "max_steps": 6, "min_steps": 2},
            "vae_decoder": {"file": "vae_decoder", "scaling_factor": 1.0},
        }),
    ]
    tokenizer = {"file": "tokenizer", "max_length": 16, "padding": "max_length"}
    save_plan(Plan(task="text-to-image", files=files, steps=steps, tokenizer=tokenizer), out)
    return out
