"""Test helpers importable as `from helpers import ...` (tests/ is on pytest's pythonpath)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir

from dyncompile.io import shared_dir

SHARED = shared_dir()
DATA = SHARED / "data" / "sentiment"


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


def random_token_feeds(
    batch: int = 3, seq: int = 9, vocab: int = 512, seed: int = 0
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, seq), np.int64)
    for b in range(1, batch):
        mask[b, seq - b % seq :] = 0  # row b pads its last b % seq positions: every row keeps a token
    return {"input_ids": rng.integers(0, vocab, (batch, seq)).astype(np.int64), "attention_mask": mask}


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
