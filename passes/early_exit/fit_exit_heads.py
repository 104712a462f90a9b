"""``early-exit`` (part 1): fit exit heads on calibration data and calibrate their thresholds."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from dyncompile.passes._infra import progress_bar as _progress
from dyncompile.passes.early_exit.exit_heads import (
    Calibration,
    CalibrationError,
    ExitHead,
    calibrate_thresholds,
    exit_decisions,
    fit_exit_heads,
    pool_features,
)
from dyncompile.passes.early_exit.graph import GraphBuilder
from dyncompile.passes.early_exit.newton import DEFAULT_NEWTON_PCA_DIM, fit_exit_heads_newton
from dyncompile.passes.quantize_weights import QUANTIZED_KEY

logger = logging.getLogger(__name__)

__all__ = [
    "EARLY_EXIT_KEY",
    "MIN_CALIB_ROWS",
    "AttachExitHeadsPass",
    "FitExitHeadsPass",
    "attach_exit_heads",
    "calibrate_exits",
    "collect_exit_features",
    "exit_distribution",
    "exits_to_keep",
    "find_exit_cuts",
    "reference_budget",
]

EARLY_EXIT_KEY = "dyncompile.early_exit"
EARLY_EXIT_FORMAT = "dyncompile.early_exit/v1"
SOLVERS = ("newton", "adam")
#: Fewer calibration rows than this cannot fit K-fold heads and calibrate thresholds meaningfully.
MIN_CALIB_ROWS = 100


def _softmax(x: np.ndarray) -> np.ndarray:
    z = np.exp(x - x.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def default_opset(model: ir.Model) -> int:
    return int(model.opset_imports.get("", model.opset_imports.get("ai.onnx", 18)))


class FitExitHeadsPass(ir.passes.InPlacePass):
    """Attach a fitted exit head after chosen layers and calibrate per-exit thresholds to a budget.

    Scope: main graph of an encoder classifier (one ``[batch, classes]`` float output). Layers and
    their output (cut) tensors come from :func:`dyncompile.passes.analysis.analyze_model` unless
    ``cuts`` names them.

    What it does: runs the model in ONNX Runtime on the calibration texts with the cut tensors exposed,
    pools each exit's hidden states, fits one head per exit by distillation towards the full model
    (labels mixed in when known) with K-fold cross-fitting, calibrates per-exit thresholds on the
    out-of-fold probabilities (max saved compute s.t. accuracy drop <= ``budget`` points), and adds the
    heads of the exits that can fire as graph nodes with outputs ``exit_logits_<layer>``. The decisions
    go into ``model.metadata_props["dyncompile.early_exit"]`` (JSON) for the lowering pass.

    Budget reference: the budget is an accuracy drop against the model the heads are fitted on, unless
    that model's numerics were changed by an earlier pass (``dyncompile.quantized`` metadata, set by the
    quantize passes) and ``reference_model`` (path or model: the fp32 original; the ``early-exit`` pass
    gives the compile input) is set: then the reference is run on the calibration rows too and the budget
    is the *total* drop against it, quantization included (:func:`reference_budget`).

    Invariants: the original output (``logits``) and every original node are unchanged; only head
    nodes, their initializers and extra graph outputs are added. Idempotent: a model that already
    carries the metadata is left alone (``modified=False``).

    Sketch: ``h_k = layer_k(...)  ->  exit_logits_k = head_k(pool(h_k, mask))`` (extra output).
    """

    def __init__(
        self,
        texts: Sequence[str],
        labels: Sequence[int] | None,
        *,
        tokenizer_file: str | Path,
        max_length: int = 512,
        budget: float = 1.0,
        criterion: str = "entropy",
        patience: int = 2,
        exits: Sequence[int] | None = None,
        cuts: dict[int, str] | None = None,
        pooling: str | None = None,
        hidden: int | None = None,
        never_exit: bool = False,
        reference_model: str | Path | ir.Model | None = None,
        batch_size: int = 32,
        folds: int = 5,
        seed: int = 0,
        solver: str | None = None,
        pca_dim: int | None = None,
        progress: bool = True,
    ) -> None:
        super().__init__()
        self.texts = list(texts)
        self.labels = None if labels is None else np.asarray(labels, np.int64)
        self.tokenizer_file = Path(tokenizer_file)
        self.max_length = int(max_length)
        self.budget = float(budget)
        self.criterion = criterion
        self.patience = int(patience)
        self.exits = None if exits is None else sorted({int(e) for e in exits})
        self.cuts = dict(cuts) if cuts else None
        self.pooling = pooling
        self.hidden = hidden
        self.never_exit = bool(never_exit)
        self.reference_model = reference_model
        self.batch_size = int(batch_size)
        self.folds = int(folds)
        self.seed = int(seed)
        self.solver = solver or ("adam" if hidden else "newton")
        self.pca_dim = pca_dim
        self.progress = progress

    def __repr__(self) -> str:
        return (
            f"FitExitHeadsPass(rows={len(self.texts)}, budget={self.budget}, criterion={self.criterion!r}, "
            f"exits={self.exits or 'all'}, solver={self.solver!r}, never_exit={self.never_exit})"
        )

    # --- preconditions ------------------------------------------------------------------------

    def _classifier_output(self, model: ir.Model) -> ir.Value:
        out = classifier_output(model)
        shape = out.shape
        if out.dtype != ir.DataType.FLOAT or shape is None or len(shape) != 2:
            raise ir.passes.PreconditionError(
                f"early exit needs a classifier: output {out.name!r} is {out.dtype}{list(shape) if shape else ''}, "
                "expected float [batch, classes] (e.g. an exported *ForSequenceClassification model)"
            )
        return out

    def requires(self, model: ir.Model) -> None:
        if EARLY_EXIT_KEY in model.metadata_props:
            return
        self._classifier_output(model)
        if self.budget < 0:
            raise ir.passes.PreconditionError(f"budget must be >= 0 accuracy points, got {self.budget}")
        if len(self.texts) < MIN_CALIB_ROWS:
            raise ir.passes.PreconditionError(
                f"the calibration set has {len(self.texts)} rows; early exit needs at least {MIN_CALIB_ROWS} "
                "(a few thousand is better) to fit heads and calibrate thresholds"
            )
        if self.labels is not None and len(np.unique(self.labels)) < 2:
            raise ir.passes.PreconditionError(
                f"every calibration row has label {int(self.labels[0])}; thresholds calibrated on one class "
                "say nothing about accuracy — use a calibration set with every class"
            )
        if not self.tokenizer_file.is_file():
            raise ir.passes.PreconditionError(f"tokenizer file {self.tokenizer_file} not found")
        if self.solver not in SOLVERS:
            raise ir.passes.PreconditionError(f"unknown solver {self.solver!r}; use one of {', '.join(SOLVERS)}")
        if self.solver == "newton" and self.hidden:
            raise ir.passes.PreconditionError(
                f"the newton solver fits linear heads; hidden={self.hidden} needs solver='adam'"
            )

    def ensures(self, model: ir.Model) -> None:
        meta = json.loads(model.metadata_props[EARLY_EXIT_KEY])
        outputs = {v.name for v in model.graph.outputs}
        for e in meta["exits"]:
            if e["head_output"] not in outputs:
                raise ir.passes.PostconditionError(f"exit head output {e['head_output']!r} missing from the graph")

    # --- the pass -------------------------------------------------------------------------------

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if EARLY_EXIT_KEY in model.metadata_props:
            logger.info("model already has exit heads; nothing to do")
            return ir.passes.PassResult(model, modified=False)
        self._classifier_output(model)
        num_layers, cuts, model_pooling = find_exit_cuts(model, self.cuts)
        exits = self.exits or [k for k in sorted(cuts) if k < num_layers]
        bad = [k for k in exits if k not in cuts or k >= num_layers]
        if bad:
            raise ir.passes.PreconditionError(
                f"exits {bad} are not inner layer boundaries of this {num_layers}-layer model; choose from "
                f"1..{num_layers - 1}"
            )
        pooling = self.pooling or "cls+mean"
        cut_names = [cuts[k] for k in exits]
        features, teacher = collect_exit_features(
            model,
            cut_names,
            self.texts,
            tokenizer_file=self.tokenizer_file,
            max_length=self.max_length,
            pooling=pooling,
            batch_size=self.batch_size,
            progress=self.progress,
        )
        bar = _progress(len(exits), "early-exit: fitting exit heads", self.progress)
        if self.solver == "newton":
            fit = fit_exit_heads_newton(
                features, teacher, self.labels, pooling=pooling, seed=self.seed, folds=self.folds,
                pca_dim=self.pca_dim or DEFAULT_NEWTON_PCA_DIM, progress=lambda done, total, msg: bar.update(1),
            )
        else:
            fit = fit_exit_heads(
                features,
                teacher.astype(np.float32),
                self.labels,
                pooling=pooling,
                hidden=self.hidden,
                seed=self.seed,
                folds=self.folds,
                progress=lambda done, total, msg: bar.update(1),
            )
        bar.close()
        reference_probs = None
        if self.reference_model is not None and QUANTIZED_KEY in model.metadata_props:
            ref = self.reference_model
            ref = ir.load(ref) if not isinstance(ref, ir.Model) else ref
            _, reference_probs = collect_exit_features(
                ref, [], self.texts, tokenizer_file=self.tokenizer_file, max_length=self.max_length,
                pooling=pooling, batch_size=self.batch_size, progress=self.progress,
            )
            del ref
        bar = _progress(1, "early-exit: calibrating thresholds", self.progress)
        try:
            cal = calibrate_exits(
                fit.oof_probs, teacher, self.labels, exits, num_layers,
                budget=self.budget, criterion=self.criterion, patience=self.patience, reference_probs=reference_probs,
            )
        except CalibrationError as e:
            raise ir.passes.PreconditionError(str(e)) from None
        bar.update(1)
        bar.close()
        for w in cal.warnings:
            logger.warning("early-exit calibration: %s", w)
        thresholds = list(cal.thresholds[:-1])
        if self.never_exit:
            thresholds = [None] * len(exits)
        keep = exits_to_keep(thresholds, self.criterion, self.patience, self.never_exit)
        attach_exit_heads(
            model,
            heads={exits[j]: fit.heads[j] for j in keep},
            cuts={exits[j]: cuts[exits[j]] for j in keep},
            thresholds={exits[j]: thresholds[j] for j in keep},
            num_layers=num_layers,
            criterion=self.criterion,
            patience=self.patience,
            extra={
                "model_pooling": model_pooling,
                "never_exit": self.never_exit,
                "exit_stats": {
                    str(k): {
                        "oof_accuracy": None if fit.oof_accuracy is None else fit.oof_accuracy[j],
                        "oof_agreement": fit.oof_agreement[j],
                    }
                    for j, k in enumerate(exits)
                },
                "calibration": {k: v for k, v in cal.to_dict().items() if k != "thresholds"}
                | {"thresholds_all_exits": dict(zip(map(str, exits), thresholds)), "rows": len(self.texts),
                   "exit_distribution": exit_distribution(cal, exits, num_layers, never_exit=self.never_exit)},
                "fit": {"seconds": round(fit.fit_seconds, 2), **fit.config},
            },
        )
        logger.info(
            "early exit: %d exits kept of %d; expected speedup %.2fx, accuracy %s (full %s)",
            len(keep), len(exits), cal.expected_speedup, cal.expected_accuracy, cal.baseline_accuracy,
        )
        return ir.passes.PassResult(model, modified=True)


def exit_distribution(cal: Calibration, exits: Sequence[int], num_layers: int, *, never_exit: bool = False) -> dict:
    """The calibration rows' exit-layer histogram, for the plan (the run-time drift guard compares with it).

    Counts per exit layer (``exits`` + the full model ``num_layers``) from the out-of-fold heads, i.e.
    heads that had not seen the row: what new rows of the calibration's distribution should do.
    """
    counts = list(cal.exit_histogram)
    if never_exit:
        counts = [0] * len(exits) + [int(sum(counts))]
    return {
        "layers": [int(k) for k in exits] + [int(num_layers)],
        "counts": [int(c) for c in counts],
        "rows": int(sum(counts)),
        "source": "calibration rows, out-of-fold heads",
    }


def exits_to_keep(thresholds: list[float | None], criterion: str, patience: int, never_exit: bool = False) -> list[int]:
    """Indices of the exits that can fire, plus (patience) the exits their agreement windows read."""
    if never_exit:
        return list(range(len(thresholds)))
    keep = {j for j, t in enumerate(thresholds) if t is not None}
    if criterion == "patience":
        for j in list(keep):
            keep.update(range(max(0, j - patience + 1), j + 1))
    return sorted(keep)


def find_exit_cuts(model: ir.Model, cuts: dict[int, str] | None = None) -> tuple[int, dict[int, str], str]:
    """``(num_layers, {layer: output cut tensor}, head pooling)`` from the graph analysis."""
    from dyncompile.passes.analysis.layers import analyze_model

    s = analyze_model(model)
    pooling = s.head.pooling if s.head else "cls"
    if cuts:
        return (len(s.layers) if s.has_layers else max(cuts) + 1), dict(cuts), pooling
    if not s.has_layers:
        raise ir.passes.PreconditionError(
            "early exit needs a layered encoder, but no repeated layer structure was found in this graph: " + s.message
        )
    return len(s.layers), {layer.index: layer.output_cut for layer in s.layers}, pooling


def classifier_output(model: ir.Model) -> ir.Value:
    outs = [v for v in model.graph.outputs if not v.name.startswith("exit_logits_")]
    if len(outs) != 1:
        raise ir.passes.PreconditionError(
            f"early exit needs a classifier with one output [batch, classes]; the graph has outputs {[v.name for v in outs]}"
        )
    return outs[0]


def collect_exit_features(
    model: ir.Model,
    cut_names: Sequence[str],
    texts: Sequence[str],
    *,
    tokenizer_file: str | Path,
    max_length: int,
    pooling: str,
    batch_size: int = 32,
    progress: bool = True,
) -> tuple[list[np.ndarray], np.ndarray]:
    """Run the model on ``texts`` with the cut tensors exposed (ONNX Runtime, CPU).

    Returns the pooled features ``[N, F]`` of every cut and the full model's probabilities ``[N, C]``.
    The model is left as it was (the extra outputs exist only in the serialised probe).
    """
    import onnxruntime as ort

    from dyncompile.runtime.text import TextEncoder

    final = classifier_output(model)
    g = model.graph
    values = ir.convenience.create_value_mapping(g)
    n_out = len(g.outputs)
    g.outputs.extend(values[n] for n in cut_names if not values[n].is_graph_output())
    try:
        proto = ir.to_proto(model)
    finally:
        while len(g.outputs) > n_out:  # pop(), not `del [n:]`: UserList's del skips onnx-ir's bookkeeping
            g.outputs.pop()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    del proto
    enc = TextEncoder(tokenizer_file, max_length=max_length)
    in_names = [i.name for i in sess.get_inputs()]
    order = length_order(enc, texts)
    n = len(texts)
    feats = [None] * len(cut_names)
    finals = None
    bar = _progress(n, "early-exit: running the calibration set", progress)
    for i in range(0, n, batch_size):
        rows = order[i : i + batch_size]
        feeds = enc([texts[r] for r in rows])
        outs = sess.run([final.name, *cut_names], {k: feeds[k] for k in in_names})
        p = _softmax(outs[0].astype(np.float64))
        if finals is None:
            finals = np.empty((n, p.shape[1]), np.float64)
        finals[rows] = p
        for j, h in enumerate(outs[1:]):
            f = pool_features(h, feeds["attention_mask"], pooling)
            if feats[j] is None:
                feats[j] = np.empty((n, f.shape[1]), np.float32)
            feats[j][rows] = f
        bar.update(len(rows))
    bar.close()
    return list(feats), finals


def length_order(enc, texts: Sequence[str]) -> np.ndarray:
    """Row order by token count (stable): batches of similar length carry little padding.

    Movie-review rows vary from 4 to ~60 tokens; batching them in file order pads each batch to its
    longest row (about 1.9x the real tokens on movie-calib), in length order to within a few percent.
    Outputs are scattered back to the input order, so results do not depend on it (attention masks make
    every row independent of its batch).
    """
    lengths = np.fromiter((len(e.ids) for e in enc.tokenizer.encode_batch(list(texts))), np.int64, len(texts))
    return np.argsort(lengths, kind="stable")


def reference_budget(
    budget: float, probs: np.ndarray, reference_probs: np.ndarray, labels: np.ndarray | None
) -> tuple[float, dict[str, Any]]:
    """The part of a ``budget`` (accuracy points vs a reference model) left for early exit.

    ``probs`` are the full model's probabilities (e.g. the int8 model), ``reference_probs`` the reference's
    (its fp32 original) on the same calibration rows. With labels the model already spends
    ``max(0, acc_ref - acc)`` points; without labels (budget = disagreement with the reference's
    predictions) ``100 - agreement``. What is left, ``max(0, budget - spent)``, is the budget of the exits
    against the model itself, so on these rows ``acc_ref - acc_early_exit <= budget`` (and
    ``disagreement(early exit, reference) <= budget`` by the union bound) whenever ``spent <= budget``.
    A model more accurate than its reference on these rows does not give the exits more than ``budget``
    (``spent >= 0``): a gain of a quantized model on calibration data is noise more often than not.
    """
    probs, reference_probs = np.asarray(probs), np.asarray(reference_probs)
    if probs.shape != reference_probs.shape:
        raise CalibrationError(f"reference probabilities {reference_probs.shape} do not match the model's {probs.shape}")
    n = len(probs)
    pred, ref_pred = probs.argmax(1), reference_probs.argmax(1)
    agree = int((pred == ref_pred).sum())
    info: dict[str, Any] = {"budget_total": float(budget), "agreement_with_reference": round(100.0 * agree / n, 4)}
    if labels is not None:
        y = np.asarray(labels)
        c_ref, c = int((ref_pred == y).sum()), int((pred == y).sum())
        spent = max(0.0, 100.0 * (c_ref - c) / n)
        info.update(metric="accuracy", reference_accuracy=round(100.0 * c_ref / n, 4), model_accuracy=round(100.0 * c / n, 4))
    else:
        spent = 100.0 * (n - agree) / n
        info.update(metric="agreement")
    left = max(0.0, float(budget) - spent)
    info.update(spent_by_model=round(spent, 4), budget_left=round(left, 4), budget_exceeded=bool(spent > budget + 1e-9))
    return left, info


def calibrate_exits(
    oof_probs: np.ndarray,
    teacher: np.ndarray,
    labels: np.ndarray | None,
    exits: Sequence[int],
    num_layers: int,
    *,
    budget: float,
    criterion: str,
    patience: int,
    reference_probs: np.ndarray | None = None,
) -> Calibration:
    """Thresholds for the head exits (+ the full model as the last exit), costs ``k / L``.

    ``reference_probs`` (e.g. the fp32 original's probabilities on the same rows, for an int8 model):
    ``budget`` is the total drop against that reference, and the exits get what the model leaves of it
    (:func:`reference_budget`); ``Calibration.budget`` stays the total, ``Calibration.reference`` says how
    it was split.
    """
    exit_probs = np.concatenate([oof_probs, teacher[None].astype(np.float32)])
    costs = [k / num_layers for k in exits] + [1.0]
    info = None
    if reference_probs is not None:
        budget_total = float(budget)
        budget, info = reference_budget(budget_total, teacher, reference_probs, labels)
    cal = calibrate_thresholds(exit_probs, teacher, labels, costs, budget=budget, criterion=criterion, patience=patience)
    if info is not None:
        cal.budget, cal.reference = budget_total, info
        if info["budget_exceeded"]:
            cal.warnings.append(
                f"the model alone already drops {info['spent_by_model']:.2f} points against its reference on the "
                f"calibration rows, more than the budget of {budget_total:g}: exits were calibrated with no budget left"
            )
        n = len(teacher)
        pred = exit_probs[exit_decisions(exit_probs, cal), np.arange(n)].argmax(1)
        ref_pred = np.asarray(reference_probs).argmax(1)
        info["expected_agreement_with_reference"] = round(float((pred == ref_pred).mean() * 100), 4)
        if labels is not None:
            info["expected_drop_vs_reference"] = round(
                float(((ref_pred == np.asarray(labels)).mean() - (pred == np.asarray(labels)).mean()) * 100), 4
            )
    return cal


def attach_exit_heads(
    model: ir.Model,
    *,
    heads: dict[int, ExitHead],
    cuts: dict[int, str],
    thresholds: dict[int, float | None],
    num_layers: int,
    criterion: str = "entropy",
    patience: int = 2,
    extra: dict[str, Any] | None = None,
) -> None:
    """Add ``exit_logits_<k>`` head outputs after the cut tensors and record the early-exit metadata.

    ``thresholds[k] is None`` means exit ``k`` never fires (kept for patience windows / fidelity checks).
    """
    g = model.graph
    outs = [v for v in g.outputs if not v.name.startswith("exit_logits_")]
    final = outs[0]
    values = ir.convenience.create_value_mapping(g)
    mask = next((v for v in g.inputs if v.name == "attention_mask"), None)
    opset = default_opset(model)
    for k in sorted(heads):
        if cuts[k] not in values:
            raise ir.passes.PreconditionError(f"cut tensor {cuts[k]!r} for the exit after layer {k} is not in the graph")
        b = GraphBuilder(opset, f"exit{k}.")
        hidden = values[cuts[k]]
        logits = b.head(heads[k], hidden, b.float_mask(mask))
        logits.name = f"exit_logits_{k}"
        logits.dtype = ir.DataType.FLOAT
        logits.shape = ir.Shape([final.shape[0], final.shape[1]])
        for init in b.initializers:
            g.register_initializer(init)
        g.insert_after(hidden.producer(), b.tape.nodes)
        g.outputs.append(logits)
    meta = {
        "format": EARLY_EXIT_FORMAT,
        "num_layers": int(num_layers),
        "criterion": criterion,
        "patience": int(patience),
        "final_output": final.name,
        "exits": [
            {"layer": k, "cut": cuts[k], "head_output": f"exit_logits_{k}", "threshold": thresholds[k]}
            for k in sorted(heads)
        ],
        **(extra or {}),
    }
    model.metadata_props[EARLY_EXIT_KEY] = json.dumps(meta)


class AttachExitHeadsPass(ir.passes.InPlacePass):
    """Attach already-fitted exit heads with given thresholds (no calibration data needed).

    For re-lowering one fit at several budgets (benchmarks) and for heads fitted elsewhere. Same
    output as :class:`FitExitHeadsPass`: ``exit_logits_<k>`` outputs + ``dyncompile.early_exit``
    metadata; idempotent.
    """

    def __init__(self, heads, cuts, thresholds, num_layers: int, criterion: str = "entropy", patience: int = 2, extra=None):
        super().__init__()
        self.heads, self.cuts, self.thresholds = dict(heads), dict(cuts), dict(thresholds)
        self.num_layers, self.criterion, self.patience = int(num_layers), criterion, int(patience)
        self.extra = dict(extra or {})

    def __repr__(self) -> str:
        return f"AttachExitHeadsPass(exits={sorted(self.heads)}, criterion={self.criterion!r})"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if EARLY_EXIT_KEY in model.metadata_props:
            return ir.passes.PassResult(model, modified=False)
        attach_exit_heads(
            model, heads=self.heads, cuts=self.cuts, thresholds=self.thresholds, num_layers=self.num_layers,
            criterion=self.criterion, patience=self.patience, extra=self.extra,
        )
        return ir.passes.PassResult(model, modified=True)
