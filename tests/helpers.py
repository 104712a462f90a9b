"""Test helpers importable as `from helpers import ...` (tests/ is on pytest's pythonpath)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from dyncompile.io import shared_dir
from dyncompile.runtime.providers import int8_pairs_saturate

SHARED = shared_dir()
DATA = SHARED / "data" / "sentiment"


#: ONNX Runtime's u8 x s8 int8 kernels saturate on this CPU (no VNNI): :func:`dyncompile.runtime.providers.int8_pairs_saturate`
INT8_PAIRS_SATURATE = int8_pairs_saturate()
skip_if_int8_pairs_saturate = pytest.mark.skipif(
    INT8_PAIRS_SATURATE,
    reason="this CPU has no VNNI: ONNX Runtime's u8s8 int8 kernels saturate int16 pair sums (vpmaddubsw), so the "
    "exact int8 emulation this test compares against does not describe them",
)
#: ``reduce_range`` for an int8 test against an exact emulation: 8-bit weights where the CPU's kernels are exact,
#: 7-bit weights (ORT's reduced range, [-64, 64]) on every CPU
REDUCE_RANGE = [pytest.param(False, id="8-bit", marks=skip_if_int8_pairs_saturate), pytest.param(True, id="7-bit")]


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory, request):
    """``mktemp(name)`` for module-scoped fixtures; the folders go when the module's last test is done.

    pytest keeps every ``tmp_path_factory`` folder until the session ends, and this suite builds a dozen real-model
    plans of 0.5-0.9 GB each: kept together they reached 6.5 GB and filled CI's disk. A module with a failed test
    keeps its folders, for the post-mortem."""
    made: list[Path] = []
    failed_before = request.session.testsfailed

    def mktemp(name: str) -> Path:
        made.append(tmp_path_factory.mktemp(name))
        return made[-1]

    yield mktemp
    if request.session.testsfailed == failed_before:
        for d in made:
            shutil.rmtree(d, ignore_errors=True)


def ort_session(path_or_model, *, disable_all: bool = True):
    """An ORT CPU session with ORT_DISABLE_ALL (so ORT's fusions cannot mask a broken rewrite)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    if disable_all:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    src = path_or_model
    if isinstance(path_or_model, ir.Model):
        src = ir.to_proto(path_or_model).SerializeToString()
    elif isinstance(path_or_model, Path):
        src = str(path_or_model)
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])


def plan_decoder_spec(path: Path):
    """The runtime's DecoderSpec of a decoder graph file, as the speculative pass would record it."""
    import onnx_ir as ir

    from dyncompile.passes.speculative.decoder_spec import decoder_spec
    from dyncompile.plan import DecoderSpec

    spec = decoder_spec(ir.load(str(path)), path.name)
    spec.pop("vocab_size")
    return DecoderSpec.from_params(spec)


def plan_kv_decoder(path: Path, **kw):
    """A KVDecoder over a decoder graph file (ORT_DISABLE_ALL session on the CPU EP)."""
    from dyncompile.runtime.decode.kv_cache import KVDecoder

    return KVDecoder(ort_session(path, disable_all=True), plan_decoder_spec(path), **kw)


class OnCuda:
    """A CPU session that reports the CUDA EP first (what KVDecoder reads to place its cache)."""

    def __init__(self, session):
        self._s = session

    def get_providers(self):
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]

    def __getattr__(self, name):
        return getattr(self._s, name)


def random_token_feeds(
    batch: int = 3, seq: int = 9, vocab: int = 512, seed: int = 0
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, seq), np.int64)
    for b in range(1, batch):
        mask[b, seq - b % seq :] = 0  # row b pads its last b % seq positions: every row keeps a token
    return {"input_ids": rng.integers(0, vocab, (batch, seq)).astype(np.int64), "attention_mask": mask}


def decoder_feeds(model, n: int, seed: int = 0, vocab: int = 8, past: int = 3) -> dict[str, np.ndarray]:
    """Feeds for a KV decoder graph: ``n`` random tokens after ``past`` cached positions of random keys / values
    (every input but ``logits_to_keep``, which the caller sets)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for v in model.graph.inputs:
        if v.name == "logits_to_keep":
            continue
        if v.name == "input_ids":
            feeds[v.name] = rng.integers(0, vocab, size=(1, n)).astype(np.int64)
        elif v.name == "attention_mask":
            feeds[v.name] = np.ones((1, n + past), np.int64)
        elif v.name == "position_ids":
            feeds[v.name] = np.arange(past, past + n, dtype=np.int64)[None]
        else:  # past key / value
            dims = [d if isinstance(d, int) else 1 for d in v.shape]
            dims[2] = past
            feeds[v.name] = rng.standard_normal(dims).astype(np.float32)
    return feeds


def tolerance(provider: str) -> float:
    """Max |difference| accepted between a provider's outputs and the CPU EP reference (fp32)."""
    return {"cpu": 1e-5}.get(provider, 1e-4)


def run_cli(capsys, *argv):
    """Run the ``dyncompile`` CLI in-process; ``(exit code, stdout, stderr)``."""
    from dyncompile.tools.cli import main

    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_clean_error(rc, err, *needles):
    """A user mistake: exit code 2, one ``error:`` line naming ``needles``, no traceback."""
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for n in needles:
        assert n in err, (n, err)


# --- early exit on the generated 4-layer encoder (shared by the lowering and the native OpenVINO tests) ---

EE_LAYERS = 4
EE_FEEDS = random_token_feeds(batch=6, seq=9)


def with_heads(thresholds: dict[int, float | None], criterion: str = "entropy", patience: int = 2, exits=(1, 2, 3)):
    """The generated ``EE_LAYERS``-layer encoder with random exit heads (seeded) attached after ``exits``."""
    from dyncompile.models.synthetic import tiny_encoder_classifier
    from dyncompile.passes.early_exit.attach_exit_heads import attach_exit_heads
    from dyncompile.passes.early_exit.heads import ExitHead

    m = tiny_encoder_classifier(num_layers=EE_LAYERS)
    lns = [n for n in m.graph if n.op_type == "LayerNormalization"]  # [embeddings, layer1..layer4]
    cuts = {k: lns[k].outputs[0].name for k in exits}
    rng = np.random.default_rng(1)
    heads = {
        k: ExitHead(
            "cls+mean",
            [
                (rng.standard_normal((512, 16)).astype(np.float32) * 0.1, np.zeros(16, np.float32), "tanh"),
                (rng.standard_normal((16, 2)).astype(np.float32), np.zeros(2, np.float32), "none"),
            ],
        )
        for k in exits
    }
    attach_exit_heads(
        m, heads=heads, cuts=cuts, thresholds={k: thresholds.get(k) for k in exits}, num_layers=EE_LAYERS,
        criterion=criterion, patience=patience,
    )
    return m


def lower_if(m):
    """Run the If lowering (checked after the pass) on ``m`` in place; returns ``m``."""
    from dyncompile.passes import InsertEarlyExitPass, run_pipeline

    res = run_pipeline([InsertEarlyExitPass("if")], m, check="each")
    assert res.modified
    return m


def tiny_classifier_dir(tmp_path: Path, minilm) -> tuple[Path, Path]:
    """A 4-layer tiny encoder classifier with MiniLM's tokenizer in ``tmp_path/tiny``, and a 300-row calib file."""
    from dyncompile.models.synthetic import tiny_encoder_classifier

    d = tmp_path / "tiny"
    d.mkdir()
    ir.save(tiny_encoder_classifier(num_layers=4, vocab=30522), d / "model.onnx")
    shutil.copy(minilm.tokenizer_path, d / "tokenizer.json")
    calib = tmp_path / "calib.jsonl"
    calib.write_text("\n".join((DATA / "movie-calib.jsonl").read_text().splitlines()[:300]) + "\n")
    return d, calib


def assert_left_alone_with_reason(model, spec: str, caplog, *needles: str) -> None:
    """Run the pass ``spec`` on ``model`` as a pipeline does: the graph keeps its nodes, and one WARNING names the
    pass, says why (every needle) and how to proceed ("leave <pass> out")."""
    import logging

    from dyncompile.passes import build_passes, run_pipeline

    nodes = [n.op_type for n in model.graph]
    with caplog.at_level(logging.WARNING):
        run_pipeline(build_passes(spec), model, check="none")
    assert [n.op_type for n in model.graph] == nodes
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(spec in m and f"leave {spec} out" in m and all(x in m for x in needles) for m in msgs), msgs

