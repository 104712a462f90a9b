"""Plan emitters for decoders: ``generate`` (target alone) and ``speculative`` (target + drafter).

``speculative`` writes ``model.onnx`` (the target) and, for a model drafter, ``drafter.onnx``. A split
drafter's weights are the target's: the target is saved with external data (``model.onnx.data``) and
the drafter's shared initializers point into that same file at the same offsets, so only the bridge and
a trimmed LM head are new bytes. A trimmed head's token ids go to ``drafter_vocab.npy``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from dyncompile.passes import _keys
from dyncompile.passes.emit import (
    EXTERNAL_DATA_THRESHOLD,
    EmitRequest,
    add_model_files,
    add_tokenizer,
    io_signature,
    register_default_emitter,
    register_emitter,
    save_model,
)
from dyncompile.passes.speculative.decoder_spec import decoder_spec, generation_config, is_kv_decoder
from dyncompile.plan import FileRef, Plan, Step, file_ref

logger = logging.getLogger(__name__)

__all__ = ["emit_generate", "emit_speculative"]


@register_default_emitter
def _decoder_gets_generate(model: ir.Model, req: EmitRequest) -> str | None:
    """A text-generation model that no pass gave an emitter: ``generate`` if it is a KV-cache decoder."""
    return "generate" if req.task == "text-generation" and is_kv_decoder(model) else None


def _generation(model: ir.Model, req: EmitRequest) -> dict[str, Any]:
    rec = model.metadata_props.get(_keys.SPECULATIVE)
    if rec:
        return json.loads(rec).get("generation") or {}
    cfg = getattr(req, "model_config", None) or {}
    src = (req.provenance.get("source") or {}).get("path")
    return generation_config(cfg, Path(src).parent if src else None)


def _target_spec(model: ir.Model) -> dict[str, Any]:
    spec = decoder_spec(model, "model", what="target model")
    spec.pop("vocab_size", None)
    return spec


def _tokenizer_spec(req: EmitRequest, files: dict[str, FileRef], gen: dict[str, Any]) -> dict[str, Any] | None:
    tok = add_tokenizer(req, files)
    if tok is not None:
        tok["max_length"] = int(gen.get("max_length") or tok.get("max_length") or 512)
    return tok


@register_emitter("generate")
def emit_generate(model: ir.Model, req: EmitRequest) -> Plan:
    """A decoder alone: one ONNX file, a ``generate`` step (``dyncompile run PLAN --prompt``)."""
    files: dict[str, FileRef] = {}
    add_model_files(files, "model", save_model(model, req.out_dir, "model.onnx", "main"))
    gen = _generation(model, req)
    tok = _tokenizer_spec(req, files, gen)
    inputs, outputs = io_signature(model.graph)
    step = Step("generate", {"target": _target_spec(model), "generation": gen})
    return Plan(task="text-generation", files=files, steps=[step], inputs=inputs, outputs=outputs, tokenizer=tok,
                provenance=req.provenance)


def _share_weights(drafter: ir.Model, target: ir.Model, saved_target_path: Path) -> int:
    """Point the drafter's initializers that are the target's own tensors at the saved target's external data.

    A drafter tensor that was the target's but is no longer (a later pass such as ``float16`` replaced the target's)
    still points into the source model's data file: it is read into memory and saved with the drafter.
    """
    saved = ir.load(str(saved_target_path))
    by_id = {id(v.const_value): name for name, v in target.graph.initializers.items() if v.const_value is not None}
    shared = 0
    for v in drafter.graph.initializers.values():
        tname = by_id.get(id(v.const_value))
        if tname is None:
            if isinstance(v.const_value, ir.ExternalTensor):  # a target tensor a later pass replaced (float16):
                v.const_value = ir.tensor(v.const_value.numpy(), name=v.const_value.name)  # the drafter's own copy
            continue
        ext = saved.graph.initializers[tname].const_value
        if isinstance(ext, ir.ExternalTensor):
            v.const_value = ext
            shared += int(ext.nbytes)
    return shared


def _save_rows_twin(model: ir.Model, d: dict[str, Any], out: Path, files: dict[str, FileRef]) -> dict[str, Any]:
    """Save an external drafter's int8 twin (``drafter_rows.onnx``); its step entries, or none.

    The tensors the twin has unchanged from the drafter (the embedding table, the norms) point into the saved
    drafter's data file instead of a second copy.
    """
    kept = model.meta.get(_keys.DRAFTER_ROWS_MODEL)
    if not d.get("rows_from") or kept is None or kept[1] is None:
        return {}
    twin: ir.Model = kept[1]
    shared = _share_weights(twin, model.meta[_keys.DRAFTER_MODEL], out / "drafter.onnx")
    own_bytes = sum(int(v.const_value.nbytes) for v in twin.graph.initializers.values()
                    if v.const_value is not None and not isinstance(v.const_value, ir.ExternalTensor))
    if own_bytes > EXTERNAL_DATA_THRESHOLD:  # too large for one protobuf beside the shared references: a whole copy
        shared = 0
        add_model_files(files, "drafter_rows", save_model(twin, out, "drafter_rows.onnx", "drafter"))
    else:
        ir.save(twin, out / "drafter_rows.onnx")
        files["drafter_rows"] = file_ref(out, "drafter_rows.onnx", "drafter", ["drafter.onnx.data"] if shared else None)
    logger.info("drafter's int8 twin for calls of >= %d rows: %.1f MB of weights shared with the drafter, %.1f MB of "
                "its own", d["rows_from"], shared / 2**20, (out / "drafter_rows.onnx").stat().st_size / 2**20)
    return {"rows_model": "drafter_rows", "rows_from": int(d["rows_from"])}


def _hybrid(d: dict[str, Any]) -> dict[str, Any]:
    """A hybrid drafter's step entries (prompt lookup beside the recorded drafter), or none."""
    if not d.get("prompt_lookup"):
        return {}
    return {"prompt_lookup": True, "max_ngram": d.get("max_ngram", 3), "min_ngram": d.get("min_ngram", 1),
            "lookup_min_match": d.get("lookup_min_match", 1)}


def _save_target_external(model: ir.Model, out: Path, files: dict[str, FileRef]) -> None:
    """Save the target with its weights in ``model.onnx.data``, the file a drafter's shared weights point into."""
    ir.save(model, out / "model.onnx", external_data="model.onnx.data")
    add_model_files(files, "model", [file_ref(out, "model.onnx", "main", ["model.onnx.data"]),
                                     file_ref(out, "model.onnx.data", "external_data")])


def _speculative_plan(model: ir.Model, req: EmitRequest, rec: dict[str, Any], files: dict[str, FileRef],
                      step_drafter: dict[str, Any], policy: dict[str, Any]) -> Plan:
    """The ``speculative_generate`` plan of every drafter kind.

    The target, ``step_drafter`` (+ a hybrid's prompt lookup), the recorded draft policy and generation settings,
    the tokenizer and ``policy``.
    """
    step_drafter.update(_hybrid(rec["drafter"]))
    tok = _tokenizer_spec(req, files, rec.get("generation") or {})
    inputs, outputs = io_signature(model.graph)
    target = dict(rec["target"])
    target.pop("vocab_size", None)
    step = Step("speculative_generate", {"target": target, "drafter": step_drafter, "draft": rec.get("draft", {}),
                                         "generation": rec.get("generation", {})})
    return Plan(task="text-generation", files=files, steps=[step], inputs=inputs, outputs=outputs, tokenizer=tok,
                policy=policy, provenance=req.provenance)


@register_emitter("speculative")
def emit_speculative(model: ir.Model, req: EmitRequest) -> Plan:
    """Write the target, its drafter and the speculative-generation plan that runs them."""
    rec = json.loads(model.metadata_props[_keys.SPECULATIVE])
    d = rec["drafter"]
    out = req.out_dir
    files: dict[str, FileRef] = {}
    step_drafter: dict[str, Any]
    split = d["kind"] == "model" and d.get("name") == "split"
    if d["kind"] == "eagle":
        return _emit_eagle(model, req, rec)
    if d["kind"] == "medusa":
        return _emit_medusa(model, req, rec)
    if split:  # always external data, so that the drafter can point into it
        _save_target_external(model, out, files)
    else:
        add_model_files(files, "model", save_model(model, out, "model.onnx", "main"))
    if d["kind"] == "model":
        drafter: ir.Model = model.meta[_keys.DRAFTER_MODEL]
        spec = dict(d["decoder"])
        spec.pop("vocab_size", None)
        spec["model"] = "drafter"
        if split:
            shared = _share_weights(drafter, model, out / "model.onnx")
            ir.save(drafter, out / "drafter.onnx")
            files["drafter"] = file_ref(out, "drafter.onnx", "drafter", ["model.onnx.data"])
            logger.info("split drafter: %.1f MB of weights shared with the target, %.1f MB of its own",
                        shared / 2**20, (out / "drafter.onnx").stat().st_size / 2**20)
        else:
            add_model_files(files, "drafter", save_model(drafter, out, "drafter.onnx", "drafter"))
        rows = _save_rows_twin(model, d, out, files)
        vocab_key = None
        subset = model.meta.get(_keys.SPLIT_DRAFTER_VOCAB if split else _keys.DRAFTER_VOCAB)
        if subset is not None:
            np.save(out / "drafter_vocab.npy", np.asarray(subset, np.int64))
            files["drafter_vocab"] = file_ref(out, "drafter_vocab.npy", "vocab_map")
            vocab_key = "drafter_vocab"
        step_drafter = {"kind": "model", "name": d.get("name", "external"), "decoder": spec,
                        "share_kv": d.get("share_kv"), "vocab": vocab_key, **rows}
    elif d["kind"] == "lookahead":
        step_drafter = {"kind": "lookahead", "window": d["window"], "ngram": d["ngram"], "guesses": d["guesses"]}
    else:
        step_drafter = {"kind": d["kind"], "max_ngram": d.get("max_ngram", 3), "min_ngram": d.get("min_ngram", 1)}
    name = d.get("name", d["kind"])
    policy: dict[str, Any] = {"speculative": {"drafter": f"prompt-lookup+{name}" if d.get("prompt_lookup") else name,
                                              "draft": rec.get("draft", {})}}
    if d.get("source"):
        policy["speculative"]["drafter_source"] = d["source"]
    if d.get("rows_twin") and step_drafter.get("rows_model"):
        policy["speculative"]["drafter_rows"] = d["rows_twin"]
    if d.get("tokenizer_check"):
        policy["speculative"]["tokenizer_check"] = d["tokenizer_check"]
    if split:
        policy["split_drafter"] = json.loads(model.metadata_props[_keys.SPLIT_DRAFTER])
    return _speculative_plan(model, req, rec, files, step_drafter, policy)


def _emit_eagle(model: ir.Model, req: EmitRequest, rec: dict[str, Any]) -> Plan:
    """Target (with its ``features`` output) + EAGLE drafter sharing the target's external data + vocabulary."""
    d = rec["drafter"]
    out = req.out_dir
    files: dict[str, FileRef] = {}
    _save_target_external(model, out, files)
    drafter, vocab = model.meta[_keys.EAGLE_MODEL]
    shared = _share_weights(drafter, model, out / "model.onnx")
    ir.save(drafter, out / "drafter.onnx")
    files["drafter"] = file_ref(out, "drafter.onnx", "drafter", ["model.onnx.data"])
    logger.info("eagle drafter: %.1f MB of weights shared with the target, %.1f MB of its own", shared / 2**20,
                (out / "drafter.onnx").stat().st_size / 2**20)
    np.save(out / "drafter_vocab.npy", np.asarray(vocab, np.int64))
    files["drafter_vocab"] = file_ref(out, "drafter_vocab.npy", "vocab_map")
    spec = dict(d["decoder"])
    spec.pop("vocab_size", None)
    spec["model"] = "drafter"
    step_drafter = {"kind": "eagle", "name": "eagle", "decoder": spec, "vocab": "drafter_vocab",
                    "features": d["features"], "feature_input": d["feature_input"], "hidden_output": d["hidden_output"]}
    policy: dict[str, Any] = {"speculative": {"drafter": "eagle", "draft": rec.get("draft", {})},
                              "eagle": json.loads(model.metadata_props[_keys.EAGLE])}
    return _speculative_plan(model, req, rec, files, step_drafter, policy)


def _emit_medusa(model: ir.Model, req: EmitRequest, rec: dict[str, Any]) -> Plan:
    """Target (with its ``medusa_features`` output) + the Medusa heads graph.

    The heads graph shares the target's LM head when the heads cover the full vocabulary.
    """
    d = rec["drafter"]
    out = req.out_dir
    files: dict[str, FileRef] = {}
    _save_target_external(model, out, files)
    heads = model.meta[_keys.MEDUSA_MODEL]
    shared = _share_weights(heads, model, out / "model.onnx")
    ir.save(heads, out / "drafter.onnx")
    files["drafter"] = file_ref(out, "drafter.onnx", "drafter", ["model.onnx.data"] if shared else None)
    logger.info("medusa heads: %.1f MB of weights shared with the target, %.1f MB of their own", shared / 2**20,
                (out / "drafter.onnx").stat().st_size / 2**20)
    step_drafter = {"kind": "medusa", "name": "medusa", "heads_model": "drafter", "features": d["features"],
                    "heads": d["heads"], "topk": d["topk"]}
    name = "prompt-lookup+medusa" if d.get("prompt_lookup") else "medusa"
    policy: dict[str, Any] = {"speculative": {"drafter": name, "draft": rec.get("draft", {})},
                              "medusa": json.loads(model.metadata_props[_keys.MEDUSA])}
    return _speculative_plan(model, req, rec, files, step_drafter, policy)
