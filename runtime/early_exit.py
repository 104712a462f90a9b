"""``early_exit_staged`` step: run segment graphs with per-row exits and batch compaction."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from dyncompile.plan import STEP_SCHEMAS
from dyncompile.runtime.registry import StepHandler, register_step
from dyncompile.runtime.rules.exit_rule import exit_fires, softmax

logger = logging.getLogger(__name__)

__all__ = ["StagedEarlyExitStep"]


@register_step("early_exit_staged")
class StagedEarlyExitStep(StepHandler):
    """Run ``segments`` in order; after each exit, rows whose test fires leave the batch.

    Params: ``segments`` (each ``model``, ``layer``, ``cut_in``, ``cut_out``, ``head``, ``threshold``,
    ``output``), ``criterion``, ``patience``, ``num_layers``, ``output``. The remaining rows are
    compacted (and right-padding trimmed to the longest remaining row) before the next segment; outputs
    are reassembled in input order: ``state[output]`` ``[B, C]`` and ``state["exit_layer"]`` ``[B]``.
    """

    def __init__(self, step, ctx) -> None:
        """Open one session per segment."""
        super().__init__(step, ctx)
        p = step.typed or STEP_SCHEMAS["early_exit_staged"](step.params, "early_exit_staged step")  # validated
        self.segments = p.segments
        self.criterion = p.criterion
        self.patience = p.patience
        self.output = p.output
        self.sessions = [ctx.session(s.model) for s in self.segments]
        self.inputs = [[i.name for i in s.get_inputs()] for s in self.sessions]

    def run(self, state: dict[str, Any]) -> dict[str, Any]:
        """Run the segments, dropping the rows whose exit fires after each."""
        mask = state.get("attention_mask")
        batch = next(iter(v for k, v in state.items() if isinstance(v, np.ndarray))).shape[0]
        active = np.arange(batch)
        feeds_all = {k: v for k, v in state.items() if isinstance(v, np.ndarray)}
        result = None
        exit_layer = np.zeros(batch, np.int64)
        hidden = prev_logits = None
        preds: list[np.ndarray] = []  # per exit: argmax of the active rows (patience windows)
        width = feeds_all["input_ids"].shape[1] if "input_ids" in feeds_all else None
        for seg, sess, names in zip(self.segments, self.sessions, self.inputs):
            feeds = {}
            for n in names:
                if n == seg.cut_in:
                    feeds[n] = hidden
                elif n == seg.prev_head:  # learned policy: the previous exit's logits, active rows
                    feeds[n] = prev_logits
                else:
                    v = feeds_all[n][active]
                    feeds[n] = v[:, :width] if width is not None and v.ndim == 2 and n != seg.cut_in else v
            if seg.cut_in and hidden is not None and width is not None:
                feeds[seg.cut_in] = hidden[:, :width]
            # Trimmed views are strided: ORT's CUDA EP copies raw buffers, so hand it contiguous arrays.
            feeds = {n: np.ascontiguousarray(v) for n, v in feeds.items()}
            outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
            if seg.head is None:  # the full model's output for everything still active
                logits = outs[seg.output]
                if result is None:
                    result = np.zeros((batch, logits.shape[-1]), logits.dtype)
                result[active] = logits
                exit_layer[active] = seg.layer
                break
            logits = outs[seg.head]
            if result is None:
                result = np.zeros((batch, logits.shape[-1]), logits.dtype)
            preds.append(logits.argmax(-1))
            if seg.score:  # learned policy: the segment computed the score (ONNX ops); compare it only
                thr = seg.threshold
                f = outs[seg.score] > np.float32(thr) if thr is not None else np.zeros(len(logits), bool)
            else:
                probs = softmax(logits.astype(np.float64))
                f = exit_fires(probs, seg.threshold, self.criterion, self.patience, preds)
            if f.any():
                result[active[f]] = logits[f]
                exit_layer[active[f]] = seg.layer
            keep = ~f
            active = active[keep]
            hidden = outs[seg.cut_out][keep]
            prev_logits = logits[keep]
            preds = [p[keep] for p in preds]
            if active.size == 0:
                break
            if mask is not None:  # drop right padding no remaining row needs
                width = int(mask[active].sum(-1).max())
        state[self.output] = result
        state["exit_layer"] = exit_layer
        return state
