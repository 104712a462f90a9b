"""``early-exit{heads=given}``: use per-layer logits the graph already exposes (DeeBERT-style) as exits."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from dyncompile.passes import _keys
from dyncompile.passes._graph import backward_slice, custom_ops_of
from dyncompile.passes._infra import progress_bar
from dyncompile.passes.early_exit.checks import CalibrationError
from dyncompile.passes.early_exit.fit_exit_heads import (
    EARLY_EXIT_FORMAT,
    MIN_CALIB_ROWS,
    calibrate_exits,
    exits_to_keep,
)
from dyncompile.runtime.providers import calibration_session
from dyncompile.runtime.rules.exit_rule import softmax

logger = logging.getLogger(__name__)

__all__ = ["WireGivenExitHeadsPass", "given_exit_outputs"]


def given_exit_outputs(model: ir.Model) -> tuple[ir.Value, dict[int, ir.Value], int, dict[int, str]] | None:
    """``(final output, {layer: logits output}, num_layers, {layer: cut})`` if the graph exposes per-layer logits.

    Candidates are float ``[batch, C]`` outputs with the same C; each is placed at the deepest layer whose output
    cut tensor it depends on; the one that reaches the last layer is the model's own output.
    """
    outs = [v for v in model.graph.outputs if v.dtype == ir.DataType.FLOAT and v.shape is not None and len(v.shape) == 2]
    if len(outs) < 2 or len({v.shape[1] for v in outs}) != 1:
        return None
    from dyncompile.passes.analysis.layers import analyze_model

    s = analyze_model(model)
    if not s.has_layers:
        return None
    producers = {layer.index: ir.convenience.create_value_mapping(model.graph)[layer.output_cut].producer() for layer in s.layers}
    depth = {}
    for v in outs:
        sl = backward_slice([v])
        ks = [k for k, p in producers.items() if p in sl]
        depth[v.name] = (max(ks) if ks else 0, v)
    L = len(s.layers)
    finals = [v for d, v in depth.values() if d == L]
    exits: dict[int, ir.Value] = {}
    for d, v in depth.values():
        if 0 < d < L:
            if d in exits:
                raise ir.passes.PreconditionError(f"outputs {exits[d].name!r} and {v.name!r} both read layer {d}")
            exits[d] = v
    if len(finals) != 1 or not exits:
        return None
    return finals[0], exits, L, {layer.index: layer.output_cut for layer in s.layers}


class WireGivenExitHeadsPass(ir.passes.InPlacePass):
    """Turn a graph's own per-layer logits outputs into calibrated exits (no head fitting).

    Scope: main graph. Runs the model on the calibration texts, calibrates per-exit thresholds to the budget on
    the given heads' probabilities, renames the kept outputs ``exit_logits_<k>`` (the others are dropped with
    their now-dead nodes) and records the same ``dyncompile.early_exit`` metadata as :class:`FitExitHeadsPass`,
    so :class:`InsertEarlyExitPass` lowers it unchanged. Idempotent.
    Sketch: ``(logits, l1_logits, l2_logits, ...) -> (logits, exit_logits_1, ...) + thresholds``.
    """

    def __init__(self, texts: Sequence[str], labels, *, tokenizer_file, max_length: int = 512, budget: float = 1.0,
                 criterion: str = "entropy", patience: int = 2, never_exit: bool = False, batch_size: int = 32,
                 progress: bool = True) -> None:
        super().__init__()
        self.texts = list(texts)
        self.labels = None if labels is None else np.asarray(labels, np.int64)
        self.tokenizer_file = Path(tokenizer_file)
        self.max_length, self.budget, self.criterion = int(max_length), float(budget), criterion
        self.patience, self.never_exit, self.batch_size, self.progress = int(patience), bool(never_exit), int(batch_size), progress

    def __repr__(self) -> str:
        return f"WireGivenExitHeadsPass(rows={len(self.texts)}, budget={self.budget}, criterion={self.criterion!r})"

    def requires(self, model: ir.Model) -> None:
        """Refuse a model the pass cannot work on, with what to do about it."""
        if _keys.EARLY_EXIT in model.metadata_props:
            return
        if len(self.texts) < MIN_CALIB_ROWS:
            raise ir.passes.PreconditionError(
                f"the calibration set has {len(self.texts)} rows; early exit needs at least {MIN_CALIB_ROWS}"
            )
        if given_exit_outputs(model) is None:
            raise ir.passes.PreconditionError(
                "heads=given needs a graph that outputs per-layer logits [batch, classes] besides its final logits "
                "(DeeBERT-style); this one does not — use the default fitted heads"
            )

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Run the rewrite on ``model`` (scope and invariants: the class docstring)."""
        if _keys.EARLY_EXIT in model.metadata_props:
            return ir.passes.PassResult(model, modified=False)
        import onnxruntime as ort

        from dyncompile.runtime.text import TextEncoder

        final, given, num_layers, cuts = given_exit_outputs(model)
        exits = sorted(given)
        so = ort.SessionOptions()
        so.log_severity_level = 3
        sess = calibration_session(ir.to_proto(model).SerializeToString(), so, custom_ops=bool(custom_ops_of(model)))
        enc = TextEncoder(self.tokenizer_file, max_length=self.max_length)
        names = [final.name] + [given[k].name for k in exits]
        in_names = [i.name for i in sess.get_inputs()]
        outs: list[list[np.ndarray]] = [[] for _ in names]
        bar = progress_bar(len(self.texts), "early-exit: running calibration set", self.progress)
        for i in range(0, len(self.texts), self.batch_size):
            feeds = enc(self.texts[i : i + self.batch_size])
            for j, r in enumerate(sess.run(names, {k: feeds[k] for k in in_names})):
                outs[j].append(softmax(r))
            bar.update(len(feeds["input_ids"]))
        bar.close()
        probs = [np.concatenate(o) for o in outs]
        try:
            cal = calibrate_exits(np.stack(probs[1:]).astype(np.float32), probs[0], self.labels, exits, num_layers,
                                  budget=self.budget, criterion=self.criterion, patience=self.patience)
        except CalibrationError as e:
            raise ir.passes.PreconditionError(str(e)) from None
        thresholds = [None] * len(exits) if self.never_exit else list(cal.thresholds[:-1])
        keep = exits_to_keep(thresholds, self.criterion, self.patience, self.never_exit)
        g = model.graph
        g.outputs.clear()
        g.outputs.append(final)
        for j in keep:
            v = given[exits[j]]
            v.name = f"exit_logits_{exits[j]}"
            g.outputs.append(v)
        common_passes.RemoveUnusedNodesPass()(model)
        meta = {
            "format": EARLY_EXIT_FORMAT,
            "num_layers": num_layers,
            "criterion": self.criterion,
            "patience": self.patience,
            "final_output": final.name,
            "heads_source": "given",
            "exits": [
                {"layer": exits[j], "cut": cuts[exits[j]], "head_output": f"exit_logits_{exits[j]}", "threshold": thresholds[j]}
                for j in keep
            ],
            "calibration": {k: v for k, v in cal.to_dict().items() if k != "thresholds"}
            | {"thresholds_all_exits": dict(zip(map(str, exits), thresholds)), "rows": len(self.texts)},
        }
        model.metadata_props[_keys.EARLY_EXIT] = json.dumps(meta)
        return ir.passes.PassResult(model, modified=True)
