"""Graph analysis of exported transformers: layers, cut tensors, the head, family and task.

``layers`` finds the repeated blocks and the cut tensors between them; ``head`` describes what follows the
last layer; ``family`` guesses family and task from signature tables; ``report`` formats it all for
``dyncompile inspect``; ``structure`` holds the result types; ``hf_metadata`` reads what the Hugging Face files
beside a model (``config.json``, ``tokenizer_config.json``, ``generation_config.json``) say about it.
"""

from dyncompile.passes.analysis.layers import WEIGHT_MIN_ELEMENTS, analyze_model
from dyncompile.passes.analysis.report import format_report
from dyncompile.passes.analysis.structure import (
    CutTensor,
    HeadInfo,
    LayerInfo,
    ModelStructure,
    NoLayerStructureError,
)

__all__ = [
    "WEIGHT_MIN_ELEMENTS",
    "CutTensor",
    "HeadInfo",
    "LayerInfo",
    "ModelStructure",
    "NoLayerStructureError",
    "analyze_model",
    "format_report",
]
