"""What the analysis finds: the result types of :func:`dyncompile.passes.analysis.analyze_model`."""

from __future__ import annotations

import dataclasses

__all__ = ["CutTensor", "HeadInfo", "LayerInfo", "ModelStructure", "NoLayerStructureError"]


class NoLayerStructureError(ValueError):
    """Raised by :meth:`ModelStructure.require_layers` when no repeated layer structure was found."""


@dataclasses.dataclass(frozen=True)
class CutTensor:
    """A tensor that, together with the graph inputs, separates the graph before it from the graph after it.

    Attributes:
        name: the value's name in the main graph.
        dtype: element type, e.g. ``"float32"`` (``"unknown"`` if no type is known).
        shape: dims; ``int`` for static dims, ``str`` for symbolic ones (``"?"`` when unknown).
        after_layer: 0 = after the embeddings (input of layer 1), k = output of layer k.
        producer: name of the node producing the value.
    """

    name: str
    dtype: str
    shape: list[int | str]
    after_layer: int
    producer: str = ""


@dataclasses.dataclass(frozen=True)
class LayerInfo:
    """One repeated block.

    Attributes:
        index: 1-based layer number.
        first_node / last_node: first and last compute (non-recomputable) node of the layer, in order.
        num_nodes: number of compute nodes in the layer (recomputable mask/shape nodes are shared and not
            counted).
        input_cut / output_cut: names of the cut tensors entering and leaving the layer.
        inner_cuts: cut tensors inside the layer (e.g. after attention+LayerNorm in post-LN BERT, after the
            attention residual add in pre-LN Llama).
        param_count: elements of the float initializers the layer reads (scalars excluded).
        node_names: all compute nodes of the layer, in order.
    """

    index: int
    first_node: str
    last_node: str
    num_nodes: int
    input_cut: str
    output_cut: str
    inner_cuts: tuple[str, ...] = ()
    param_count: int = 0
    node_names: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class HeadInfo:
    """What happens after the last layer's output.

    Attributes:
        pooling: ``"cls"`` (first position), ``"mean"``, ``"last"`` (last position), or ``"none"``
            (token-wise, e.g. an LM head or raw hidden states).
        nodes: names of the compute nodes after the last layer output, in order.
        description: one line, e.g. ``"Gather index 0 on axis 1 -> Gemm -> Tanh -> Gemm -> logits"``.
    """

    pooling: str = "none"
    nodes: list[str] = dataclasses.field(default_factory=list)
    description: str = ""


@dataclasses.dataclass
class ModelStructure:
    """Result of :func:`analyze_model`."""

    inputs: list[tuple[str, str, list[int | str]]]
    outputs: list[tuple[str, str, list[int | str]]]
    op_histogram: dict[str, int]
    param_count: int
    num_nodes: int
    family: str = "unknown"
    family_reason: str = ""
    task: str = "unknown"
    layers: list[LayerInfo] = dataclasses.field(default_factory=list)
    cuts: list[CutTensor] = dataclasses.field(default_factory=list)
    head: HeadInfo = dataclasses.field(default_factory=HeadInfo)
    message: str = ""
    #: every cut candidate found by the sweep (embedding stage, inside layers, head), in order
    candidate_cuts: list[str] = dataclasses.field(default_factory=list)
    #: compute nodes before layer 1 (the embedding stage)
    embedding_nodes: list[str] = dataclasses.field(default_factory=list)
    #: segments (between consecutive cut candidates) per layer
    segments_per_layer: int = 0
    analysis_seconds: float = 0.0

    @property
    def has_layers(self) -> bool:
        """Whether a repeated block (layers) was found."""
        return bool(self.layers)

    @property
    def num_layers(self) -> int:
        """Number of layers found (0 when none)."""
        return len(self.layers)

    @property
    def hidden_size(self) -> int | None:
        """Last dim of the layer-output cut tensors when static, else None."""
        if self.cuts and self.cuts[-1].shape and isinstance(self.cuts[-1].shape[-1], int):
            return self.cuts[-1].shape[-1]
        return None

    def require_layers(self) -> ModelStructure:
        """Return self, or raise :class:`NoLayerStructureError` explaining why no layers were found."""
        if not self.layers:
            raise NoLayerStructureError(
                (self.message or "no repeated layer structure found in the model.")
                + " Layer-based passes (early exit, split drafter) need a transformer-like stack of"
                " identical blocks; run `dyncompile inspect MODEL` to see what the analysis found."
            )
        return self

    def cut_for_layer(self, k: int) -> CutTensor:
        """The cut tensor after layer ``k`` (0 = after the embeddings, ``num_layers`` = last layer output)."""
        self.require_layers()
        for cut in self.cuts:
            if cut.after_layer == k:
                return cut
        raise IndexError(
            f"no cut after layer {k}: the model has layers 1..{len(self.layers)} (cuts 0..{len(self.layers)})"
        )
