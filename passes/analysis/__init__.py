"""Graph analysis of exported transformers: layers, cut tensors, the head, family and task."""

from dyncompile.passes.analysis.layers import (
    WEIGHT_MIN_ELEMENTS,
    CutTensor,
    HeadInfo,
    LayerInfo,
    ModelStructure,
    NoLayerStructureError,
    analyze_model,
    format_report,
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
