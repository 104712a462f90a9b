"""Plan emitter ``early_exit_staged``: cut a graph with exit heads into segment graphs.

Segment ``i`` runs from the previous exit's cut tensor (plus the graph inputs it needs: ids, masks)
to the next exit's cut tensor and head logits; the last segment ends at the model's output. Each
segment is its own ONNX file, run by the runtime's ``early_exit_staged`` step with per-row exits and
batch compaction.
"""

from __future__ import annotations

import json
import logging

import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from dyncompile.passes import _keys
from dyncompile.passes._graph import default_opset, extract_model
from dyncompile.passes.emit import (
    EmitRequest,
    add_budget_split,
    add_model_files,
    add_tokenizer,
    early_exit_policy,
    io_signature,
    prefixed_policies,
    register_emitter,
    save_model,
)
from dyncompile.plan import FileRef, Plan, Step

logger = logging.getLogger(__name__)


def _add_learned_scores(model: ir.Model, meta: dict) -> dict[str, str]:
    """Learned criterion: add each firing exit's policy score as a graph output ``exit_score_<k>``.

    Returns ``{head output: score output}``. A segment then reads the previous exit's head logits as an
    input and returns the score; the runtime only compares it with the threshold.
    """
    from dyncompile.passes.early_exit.graph import GraphBuilder

    g = model.graph
    values = ir.convenience.create_value_mapping(g)
    out: dict[str, str] = {}
    for ex in meta["exits"]:
        pol = ex.get("policy")
        if ex["threshold"] is None or pol is None:
            continue
        b = GraphBuilder(default_opset(model), f"exit{ex['layer']}.score.")
        head = values[ex["head_output"]]
        prev = values[pol["prev_head"]] if pol.get("prev_head") else None
        score = b.learned_score(head, prev, pol["weights"], pol["bias"])
        score.name, score.dtype = f"exit_score_{ex['layer']}", ir.DataType.FLOAT
        score.shape = ir.Shape([head.shape[0]]) if head.shape is not None else None
        for init in b.initializers:
            g.register_initializer(init)
        g.insert_after(head.producer(), b.tape.nodes)
        g.outputs.append(score)
        out[ex["head_output"]] = score.name
    return out


@register_emitter("early_exit_staged")
def emit_staged(model: ir.Model, req: EmitRequest) -> Plan:
    """Cut the lowered graph into segment graphs at its exits and write the staged early-exit plan."""
    meta = json.loads(model.metadata_props[_keys.EARLY_EXIT])
    g = model.graph
    values = ir.convenience.create_value_mapping(g)
    if any(values[e["cut"]].dtype is None for e in meta["exits"]):
        common_passes.ShapeInferencePass()(model)  # segment inputs need types
    graph_inputs = [v.name for v in g.inputs]
    scores = _add_learned_scores(model, meta) if meta["criterion"] == "learned" else {}
    files: dict[str, FileRef] = {}
    segments = []
    prev_cut = None
    stages = [*meta["exits"], None]
    for i, ex in enumerate(stages):
        ins = graph_inputs + ([prev_cut] if prev_cut else [])
        outs = [ex["cut"], ex["head_output"]] if ex else [meta["final_output"]]
        prev_head = None
        if ex and ex["head_output"] in scores:
            outs.append(scores[ex["head_output"]])
            prev_head = (ex.get("policy") or {}).get("prev_head")
            if prev_head:
                ins.append(prev_head)
        seg = extract_model(model, ins, outs, f"segment{i}")
        add_model_files(files, f"segment{i}", save_model(seg, req.out_dir, f"segment{i}.onnx", "segment"))
        segments.append(
            {
                "model": f"segment{i}",
                "layer": ex["layer"] if ex else meta["num_layers"],
                "cut_in": prev_cut,
                "cut_out": ex["cut"] if ex else None,
                "head": ex["head_output"] if ex else None,
                "threshold": ex["threshold"] if ex else None,
                "output": None if ex else meta["final_output"],
            }
            | ({"score": scores[ex["head_output"]], "prev_head": prev_head} if ex and ex["head_output"] in scores else {})
        )
        prev_cut = ex["cut"] if ex else None
    tok = add_tokenizer(req, files)
    inputs, _ = io_signature(g)
    final = next(v for v in g.outputs if v.name == meta["final_output"])
    outputs = [
        {"name": final.name, "dtype": "FLOAT", "shape": [d if isinstance(d, int) else str(d) for d in final.shape]},
        {"name": "exit_layer", "dtype": "INT64", "shape": [str(final.shape[0])]},
    ]
    policy = {**prefixed_policies(model), "early_exit": early_exit_policy(model)}
    add_budget_split(policy)
    step = Step(
        "early_exit_staged",
        {
            "segments": segments,
            "criterion": meta["criterion"],
            "patience": meta["patience"],
            "num_layers": meta["num_layers"],
            "output": meta["final_output"],
        },
    )
    return Plan(
        task="text-classification",
        files=files,
        steps=[step],
        inputs=inputs,
        outputs=outputs,
        tokenizer=tok,
        labels=req.labels,
        policy=policy,
        provenance=req.provenance,
    )
