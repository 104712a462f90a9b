"""One loaded plan called from many threads and from several processes gives the serial run's results.

Every plan kind the runtime runs is built from the tiny generated models (milliseconds per call): a plain
classifier (``run_model``), an If-graph early exit, a staged early exit, speculative decoding with prompt lookup
and with an external drafter, a text-to-image plan (a tiny text encoder and U-Net in real ONNX files, the
StepSaver step predictor and online stop rule) and two routed plans (a confidence cascade and a learned router).

Each plan is loaded once; 8 threads call it at the same time, each with its own inputs, several times over, and
every answer must equal the serial run's at the same batch composition: bitwise for classifier probabilities
(with the exit layer and the answering candidate), token-identical for greedy decoding, byte-equal images
(with the steps each prompt took and the U-Net calls). Then 3 processes (each loading the plans itself) run
the same workloads at the same time and must give the same answers too.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import dyncompile

THREADS = 8
ROUNDS = 4  # each thread repeats its workload; answers must be the same every time
PROCESSES = 3
HERE = Path(__file__).resolve().parent

# ------------------------------------------------------------------------------------------- plans


def _early_exit_plan(out: Path, lowering: str) -> Path:
    """The tiny 4-layer encoder with seeded random exit heads after layers 1..3, lowered ``if`` or ``staged``."""
    from helpers import lower_if, with_heads
    from hostile_plans import LABELS, staged_plan

    from dyncompile.models.synthetic_decoder import write_word_tokenizer
    from dyncompile.passes.emit import EmitRequest, emit_plan
    from dyncompile.plan import save_plan

    if lowering == "staged":
        return staged_plan(out)
    m = lower_if(with_heads({1: 0.05, 2: 0.3, 3: 0.6}))
    out.mkdir(parents=True, exist_ok=True)
    tok = write_word_tokenizer(out.parent / (out.name + "-tok"), 512)
    req = EmitRequest(out_dir=out, task="text-classification", tokenizer_file=tok,
                      tokenizer_spec={"max_length": 64, "padding": "longest"}, labels=LABELS)
    save_plan(emit_plan(m, req), out)
    return out


def _diffusion_plan(out: Path) -> Path:
    """A text-to-image plan over a tiny text encoder (an embedding table) and a tiny U-Net (real ONNX files).

    The U-Net's prediction depends on the sample, the timestep and the prompt's states, so that prompts take
    different step counts under the online stop rule and the predicted policy.
    """
    import onnx_ir as ir

    from dyncompile.models.synthetic_decoder import write_word_tokenizer
    from dyncompile.plan import Plan, Step, file_ref, save_plan

    out.mkdir(parents=True)
    vocab, dim, length = 32, 2, 8
    F = ir.DataType.FLOAT

    def const(arr, name, inits):
        v = ir.val(name, const_value=ir.tensor(np.asarray(arr), name=name))
        inits.append(v)
        return v

    def save(file, tape, inputs, output, name, shape, inits):
        output.name, output.dtype, output.shape = name, F, ir.Shape(shape)
        graph = ir.Graph(inputs, [output], nodes=tape.nodes, initializers=inits, opset_imports={"": 18})
        ir.save(ir.Model(graph, ir_version=10), out / file)

    tape, inits = ir.tape.Tape(), []
    ids = ir.val("input_ids", ir.DataType.INT64, ir.Shape(["b", length]))
    emb = const(np.random.default_rng(5).standard_normal((vocab, dim)).astype(np.float32), "emb", inits)
    save("te.onnx", tape, [ids], tape.op("Gather", [emb, ids]), "last_hidden_state", ["b", length, dim], inits)
    tape, inits = ir.tape.Tape(), []
    sample = ir.val("sample", F, ir.Shape(["n", 1, 8, 8]))
    timestep = ir.val("timestep", ir.DataType.INT64, ir.Shape(["n"]))
    states = ir.val("states", F, ir.Shape(["n", length, dim]))
    pooled = tape.op("Reshape", [tape.op("ReduceMean", [states, const(np.array([1, 2], np.int64), "axes", inits)]),
                                 const(np.array([-1, 1, 1, 1], np.int64), "shape4", inits)])
    tt = tape.op("Reshape", [tape.op("Cast", [timestep], {"to": F}), const(np.array([-1, 1, 1, 1], np.int64), "shape4t", inits)])
    eps = tape.op("Add", [tape.op("Mul", [tape.op("Mul", [sample, pooled]), const(np.float32(0.8), "sscale", inits)]),
                          tape.op("Mul", [tt, const(np.float32(2e-4), "tscale", inits)])])
    save("unet.onnx", tape, [sample, timestep, states], eps, "unet_out", ["n", 1, 8, 8], inits)
    write_word_tokenizer(out, vocab)
    files = {key: file_ref(out, rel, key) for key, rel in
             (("text_encoder", "te.onnx"), ("unet", "unet.onnx"), ("tokenizer", "tokenizer.json"))}
    steps = [
        Step("diffusion_encode", {"text_encoder": "text_encoder", "output": "last_hidden_state", "null_prompt": ""}),
        Step("predict_steps", {"weights": [0.9, -0.7], "bias": 2.0, "mean": [0.0, 0.0], "scale": [1.0, 1.0],
                               "grid": [2, 3, 4, 6, 8], "offset": 0.0, "features": "mean_pool"}),
        Step("diffusion_denoise", {
            "unet": "unet", "input_names": ["sample", "timestep", "states"],
            "scheduler": {"_class_name": "DDIMScheduler", "num_train_timesteps": 1000, "beta_schedule": "linear",
                          "timestep_spacing": "trailing", "set_alpha_to_one": True},
            "guidance_scale": 2.0, "num_inference_steps": 6, "sample_shape": [1, 8, 8], "eta": 0.0,
            "noise": "numpy", "default_policy": "online",
            "stop_rule": {"kind": "x0_change", "threshold": 0.05, "max_steps": 10, "min_steps": 2},
        }),
    ]
    save_plan(Plan(task="text-to-image", files=files, steps=steps,
                   tokenizer={"file": "tokenizer", "max_length": length, "padding": "max_length"}), out)
    return out


def build_plans(root: Path) -> dict[str, Path]:
    """Every plan kind of this module under ``root`` (tiny models; a few seconds in all)."""
    from hostile_plans import classifier_dir, decoder_dir, routed_plan, run_model_plan, word_calib

    from dyncompile.models.synthetic_decoder import tiny_decoder, write_decoder_dir, write_word_tokenizer
    from dyncompile.passes.compiler import compile_model

    plans = {"classifier": run_model_plan(classifier_dir(root / "cls-model"), root / "classifier"),
             "early-exit-if": _early_exit_plan(root / "ee-if", "if"),
             "early-exit-staged": _early_exit_plan(root / "ee-staged", "staged")}
    target = decoder_dir(root / "dec-model")
    draft = write_decoder_dir(root / "draft-model", tiny_decoder(num_layers=1, vocab=16, seed=1), eos=0)
    write_word_tokenizer(root / "draft-model", 16, eos=0)
    plans["prompt-lookup"] = compile_model(target, "speculative{measure=false}", root / "pl",
                                           drafter="prompt-lookup", progress=False).plan_dir
    plans["external-drafter"] = compile_model(target, "speculative{measure=false}", root / "ext",
                                              drafter=str(draft), progress=False).plan_dir
    plans["diffusion"] = _diffusion_plan(root / "diffusion")
    calib = word_calib(root / "calib.jsonl", n=60)
    cands = [plans["classifier"], plans["early-exit-staged"]]
    plans["cascade"] = routed_plan(cands, root / "cascade", calib)
    plans["route"] = routed_plan(cands, root / "route", calib, rule="learned")
    # thresholds at the median of this module's texts, so that both candidates answer some of them
    texts = [t for w in range(THREADS) for batch in _texts(w) for t in batch]
    probs = dyncompile.load(plans["classifier"]).predict_proba(texts)
    _set_threshold(plans["cascade"], float(np.median(-(probs * np.log(probs)).sum(1))))
    _set_threshold(plans["route"], float(np.median(dyncompile.load(plans["route"]).handlers[0].scores(texts))))
    return plans


def _set_threshold(plan_dir: Path, value: float) -> None:
    """The routed plan's first threshold set to ``value`` (plan.json only; the files it names are unchanged)."""
    raw = json.loads((plan_dir / "plan.json").read_text())
    raw["steps"][0]["rule"]["thresholds"][0] = value
    (plan_dir / "plan.json").write_text(json.dumps(raw, indent=1))


# ------------------------------------------------------------------------------------------- workloads

CLASSIFIER_KINDS = ("classifier", "early-exit-if", "early-exit-staged", "cascade", "route")
DECODER_KINDS = ("prompt-lookup", "external-drafter")


def _texts(worker: int) -> list[list[str]]:
    """Worker ``worker``'s batches: word texts of different lengths (seeded by the worker)."""
    rng = np.random.default_rng(100 + worker)
    return [[" ".join(f"w{int(i)}" for i in rng.integers(1, 500, size=int(rng.integers(2, 12)))) for _ in range(bs)]
            for bs in (1, 3, 4)]


def _prompts(worker: int) -> list[list[int]]:
    rng = np.random.default_rng(200 + worker)
    base = [int(t) for t in rng.integers(1, 16, size=4)]
    return [base * 3, [int(t) for t in rng.integers(1, 16, size=5)]]


def workload(kind: str, model, worker: int) -> list:
    """Worker ``worker``'s calls on a loaded plan of ``kind``, as exact JSON-ready answers."""
    out = []
    if kind in CLASSIFIER_KINDS:
        for batch in _texts(worker):
            for p in model.classify(batch, batch_size=len(batch)):
                out.append([p.label, [float(v).hex() for v in p.probabilities.values()], p.exit_layer, p.candidate])
    elif kind in DECODER_KINDS:
        for prompt in _prompts(worker):
            r = model.generate(prompt, max_new_tokens=12)
            out.append(list(r.token_ids))
    elif kind == "diffusion":
        prompts = [" ".join(f"w{(worker * 7 + j) % 31 + 1}" for j in range(k)) for k in (2, 5)]
        for policy in ("online", "predicted", "fixed"):
            r = model.generate_images(prompts, seed=worker, policy=policy)
            out.append([hashlib.sha256(np.ascontiguousarray(r.images).tobytes()).hexdigest(),
                        r.steps.tolist(), r.unet_calls])
    else:  # pragma: no cover - a kind this module does not build
        raise ValueError(kind)
    return out


def serial(kind: str, model) -> list:
    """Every worker's answers, one worker after the other."""
    return [workload(kind, model, w) for w in range(THREADS)]


# ------------------------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def plans(module_tmp):
    return build_plans(module_tmp("concurrency"))


@pytest.fixture(scope="module")
def reference(plans):
    """The serial answers of every kind, each from a fresh load."""
    return {k: serial(k, dyncompile.load(p)) for k, p in plans.items()}


KINDS = (*CLASSIFIER_KINDS, *DECODER_KINDS, "diffusion")


@pytest.mark.parametrize("kind", KINDS)
def test_threads_give_the_serial_answers(plans, reference, kind):
    model = dyncompile.load(plans[kind])
    start = threading.Barrier(THREADS)

    def run(worker):
        start.wait()  # all threads call at once
        return [workload(kind, model, worker) for _ in range(ROUNDS)]

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads every few bytecodes: races between Python statements show up
    try:
        with ThreadPoolExecutor(THREADS) as pool:
            got = list(pool.map(run, range(THREADS)))
    finally:
        sys.setswitchinterval(interval)
    for worker, rounds in enumerate(got):
        for r in rounds:
            assert r == reference[kind][worker], f"{kind}: thread {worker} got other answers than the serial run"


def test_serial_answers_exercise_what_threads_could_mix_up(reference):
    """The workloads are not trivial: early exits at several layers, both candidates answer, steps vary."""
    for kind in ("early-exit-if", "early-exit-staged"):
        assert len({row[2] for w in reference[kind] for row in w}) > 1, kind
    for kind in ("cascade", "route"):
        assert len({row[3] for w in reference[kind] for row in w}) > 1, kind
    assert len({json.dumps(w) for w in reference["prompt-lookup"]}) == THREADS
    assert len({tuple(s) for w in reference["diffusion"] for _, s, _ in w}) > 1


CHILD = """
import json, sys
sys.path.insert(0, {tests!r})
import dyncompile
import test_concurrency as tc
plans = json.loads(sys.argv[1])
print(json.dumps({{k: tc.serial(k, dyncompile.load(p)) for k, p in plans.items()}}))
"""


def test_processes_give_the_serial_answers(plans, reference):
    arg = json.dumps({k: str(p) for k, p in plans.items()})
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD.format(tests=str(HERE)), arg], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(PROCESSES)]
    for i, p in enumerate(procs):
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        got = json.loads(out)
        for kind in plans:
            assert got[kind] == reference[kind], f"{kind}: process {i} got other answers than the serial run"


def test_last_info_belongs_to_the_calling_thread(plans):
    """``model.last_info`` after a call describes that thread's call, even when another thread called since.

    ``classify`` reads the exit layers of its own batch from there; a model-wide ``last_info`` let a thread
    label its rows with another thread's exits (a race of a few bytecodes, hard to hit by chance: forced here).
    """
    model = dyncompile.load(plans["early-exit-staged"])
    mine, other = _texts(0)[2], _texts(1)[2]
    model.predict_proba(mine, batch_size=len(mine))
    expected = model.last_info["exit_layer"].tolist()
    t = threading.Thread(target=model.predict_proba, args=(other,), kwargs={"batch_size": len(other)})
    t.start()
    t.join()
    assert model.last_info["exit_layer"].tolist() == expected
    assert len(model.task_api.exit_layers_seen()) == len(mine) + len(other)  # the drift log still sees both
