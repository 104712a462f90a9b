"""Model-family knowledge: where a family keeps its layer count and width, how its head pools, how layers
are named.

Look a family up by its dyncompile name (``get_family("bert")``) or by a Hugging Face ``model_type``
(``family_for_model_type("qwen2")``). Names are given both for the Hugging Face module tree and for the
ONNX graphs that ``dyncompile.models`` builds: their initializers carry the Hugging Face parameter names
(the export wrapper's prefix is stripped), so ``bert.encoder.layer.3.attention.self.query.weight`` is an
initializer of ``minilm-l6-sentiment/model.onnx``. Node metadata (``pkg.torch.onnx.name_scopes``) still
carries the wrapper's attribute ``model.`` in front of the module path.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class FamilyInfo:
    """What dyncompile needs to know about one architecture family.

    Attributes:
        name: dyncompile family name (``"bert"``, ``"mpnet"``, ``"llama"``, ``"qwen2"``).
        model_types: Hugging Face ``config.model_type`` values of the family.
        kind: ``"encoder"`` or ``"decoder"``.
        num_layers_key / hidden_size_key / num_heads_key: keys of the HF config (dict) holding them.
        num_kv_heads_key: decoders with GQA: key of the KV head count (None for encoders).
        layer_prefix: module path of layer ``i`` in the task model, with ``{i}`` (e.g.
            ``bert.encoder.layer.{i}``); also the initializer-name prefix in the exported ONNX.
        embeddings: module path of the embeddings (token embedding table for decoders).
        final_norm: module path of the norm after the last layer (decoders), None where the layer ends
            with its own LayerNorm (post-LN encoders).
        head_pooling: how the task head reads the last hidden state: ``"cls"`` (token 0, ``[CLS]``/``<s>``),
            ``"last"`` (causal LM: every position), ...
        head_modules: module paths of the task head, in order (classifier or LM head).
        head_kind: short description of the head computation.
        hidden_states_index: ``hidden_states[i]`` of the HF output (with ``output_hidden_states=True``) is the
            output of layer ``i`` (1-based); index 0 is the embeddings.
    """

    name: str
    model_types: tuple[str, ...]
    kind: str
    num_layers_key: str
    hidden_size_key: str
    num_heads_key: str
    num_kv_heads_key: str | None
    layer_prefix: str
    embeddings: str
    final_norm: str | None
    head_pooling: str
    head_modules: tuple[str, ...]
    head_kind: str
    layer_submodules: tuple[str, ...] = ()
    hidden_states_index: str = "hidden_states[i] = output of layer i (1-based); hidden_states[0] = embeddings"

    def num_layers(self, config: Mapping[str, Any]) -> int:
        return int(_cfg_get(config, self.num_layers_key))

    def hidden_size(self, config: Mapping[str, Any]) -> int:
        return int(_cfg_get(config, self.hidden_size_key))

    def num_heads(self, config: Mapping[str, Any]) -> int:
        return int(_cfg_get(config, self.num_heads_key))

    def num_kv_heads(self, config: Mapping[str, Any]) -> int | None:
        if self.num_kv_heads_key is None:
            return None
        v = config.get(self.num_kv_heads_key)
        return int(v) if v is not None else self.num_heads(config)

    def layer_name(self, i: int) -> str:
        """Module path (= ONNX initializer prefix) of layer ``i`` (0-based)."""
        return self.layer_prefix.format(i=i)

    def layer_index(self, name: str) -> int | None:
        """Layer index (0-based) of a parameter/module/initializer name, or None if it is outside the layers.

        Accepts names with a leading wrapper prefix (``model.bert.encoder.layer.2...``).
        """
        m = self._layer_re.search(name)
        return int(m.group(1)) if m else None

    @property
    def _layer_re(self) -> re.Pattern[str]:
        pat = re.escape(self.layer_prefix).replace(re.escape("{i}"), r"(\d+)")
        return re.compile(r"(?:^|\.)" + pat + r"(?:\.|$)")


def _cfg_get(config: Mapping[str, Any], key: str) -> Any:
    if hasattr(config, "to_dict") and not isinstance(config, Mapping):
        config = config.to_dict()  # a transformers PretrainedConfig
    if key not in config:
        raise KeyError(f"config has no {key!r} (keys: {sorted(config)[:20]}...)")
    return config[key]


_FAMILIES: dict[str, FamilyInfo] = {}


def _register(f: FamilyInfo) -> FamilyInfo:
    _FAMILIES[f.name] = f
    return f


BERT = _register(
    FamilyInfo(
        name="bert",
        model_types=("bert",),
        kind="encoder",
        num_layers_key="num_hidden_layers",
        hidden_size_key="hidden_size",
        num_heads_key="num_attention_heads",
        num_kv_heads_key=None,
        layer_prefix="bert.encoder.layer.{i}",
        embeddings="bert.embeddings",
        final_norm=None,
        head_pooling="cls",
        head_modules=("bert.pooler.dense", "classifier"),
        head_kind="BertForSequenceClassification: pooler dense+tanh on token 0, dropout, linear classifier",
        layer_submodules=(
            "attention.self.query",
            "attention.self.key",
            "attention.self.value",
            "attention.output.dense",
            "attention.output.LayerNorm",
            "intermediate.dense",
            "output.dense",
            "output.LayerNorm",
        ),
    )
)

MPNET = _register(
    FamilyInfo(
        name="mpnet",
        model_types=("mpnet",),
        kind="encoder",
        num_layers_key="num_hidden_layers",
        hidden_size_key="hidden_size",
        num_heads_key="num_attention_heads",
        num_kv_heads_key=None,
        layer_prefix="mpnet.encoder.layer.{i}",
        embeddings="mpnet.embeddings",
        final_norm=None,
        head_pooling="cls",
        head_modules=("classifier.dense", "classifier.out_proj"),
        head_kind="MPNetForSequenceClassification: MPNetClassificationHead dense+tanh+out_proj on token 0 (<s>); "
        "no pooler; relative position bias computed once in mpnet.encoder.relative_attention_bias",
        layer_submodules=(
            "attention.attn.q",
            "attention.attn.k",
            "attention.attn.v",
            "attention.attn.o",
            "attention.LayerNorm",
            "intermediate.dense",
            "output.dense",
            "output.LayerNorm",
        ),
    )
)

LLAMA = _register(
    FamilyInfo(
        name="llama",
        model_types=("llama",),
        kind="decoder",
        num_layers_key="num_hidden_layers",
        hidden_size_key="hidden_size",
        num_heads_key="num_attention_heads",
        num_kv_heads_key="num_key_value_heads",
        layer_prefix="model.layers.{i}",
        embeddings="model.embed_tokens",
        final_norm="model.norm",
        head_pooling="last",
        head_modules=("lm_head",),
        head_kind="LlamaForCausalLM: final RMSNorm then lm_head (tied to model.embed_tokens when "
        "tie_word_embeddings)",
        layer_submodules=(
            "input_layernorm",
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "post_attention_layernorm",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ),
    )
)

QWEN2 = _register(
    dataclasses.replace(
        LLAMA,
        name="qwen2",
        model_types=("qwen2",),
        head_kind="Qwen2ForCausalLM: final RMSNorm then lm_head (untied in both Coder GGUFs here); q/k/v have biases",
    )
)


def list_families() -> list[str]:
    return sorted(_FAMILIES)


def get_family(name: str) -> FamilyInfo:
    """FamilyInfo by dyncompile family name; KeyError listing the known names."""
    try:
        return _FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown model family {name!r}; known: {', '.join(list_families())}") from None


def family_for_model_type(model_type: str) -> FamilyInfo:
    """FamilyInfo for a Hugging Face ``config.model_type``."""
    for f in _FAMILIES.values():
        if model_type in f.model_types:
            return f
    raise KeyError(
        f"no dyncompile family for model_type {model_type!r}; known: "
        f"{sorted(t for f in _FAMILIES.values() for t in f.model_types)}"
    )
