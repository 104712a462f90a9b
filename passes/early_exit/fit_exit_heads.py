"""``early-exit`` (part 1): ``FitExitHeadsPass`` fits exit heads on calibration data and calibrates their thresholds.

The pass is the glue between the graph and the numerics: it probes the model in ONNX Runtime for the
cut tensors' pooled features (:func:`collect_exit_features`), fits heads (:mod:`.fit`), calibrates
thresholds (:mod:`.calibrate`) and attaches the heads that can fire (:mod:`.attach_exit_heads`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx_ir as ir

from dyncompile.passes import _keys
from dyncompile.passes._graph import custom_ops_of
from dyncompile.passes._infra import progress_bar as _progress
from dyncompile.passes.early_exit.attach_exit_heads import (
    EARLY_EXIT_FORMAT,
    attach_exit_heads,
)
from dyncompile.passes.early_exit.calibrate import (
    CalibrationError,
    calibrate_exits,
    reference_budget,
)
from dyncompile.passes.early_exit.certify import (
    certified_calibration,
    policy_metadata,
    uncertified_certificate,
)
from dyncompile.passes.early_exit.fit import fit_exit_heads
from dyncompile.passes.early_exit.heads import pool_features
from dyncompile.passes.early_exit.newton import fit_exit_heads_newton
from dyncompile.runtime.providers import calibration_session
from dyncompile.runtime.rules.exit_rule import softmax

logger = logging.getLogger(__name__)

__all__ = [
    "EARLY_EXIT_FORMAT",
    "MIN_CALIB_ROWS",
    "FitExitHeadsPass",
    "calibrate_exits",
    "classifier_output",
    "collect_exit_features",
    "exit_distribution",
    "exits_to_keep",
    "find_exit_cuts",
    "reference_budget",
]

SOLVERS = ("newton", "adam")
#: ``fitted``: linear heads on pooled features (:mod:`.newton`); ``trained``: attention pooling + MLP heads
#: distilled on the cached hidden states (:mod:`.train_heads`, PyTorch).
HEAD_KINDS = ("fitted", "trained")
#: Fewer calibration rows than this cannot fit K-fold heads and calibrate thresholds meaningfully.
MIN_CALIB_ROWS = 100


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

    Extra training text (``train_texts``, trained heads only): run through the model after the calibration
    rows; the heads distil on it too (every fold head and the shipped one), while the thresholds and the
    certificate use the calibration rows alone, whose probabilities stay out-of-fold.

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
        confidence: float | None = 0.9,
        split: float = 0.3,
        heads: str = "fitted",
        metric: str = "accuracy",
        train_options: dict | None = None,
        train_texts: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        self.train_texts = list(train_texts or [])
        self.heads = heads
        self.metric = metric
        self.train_options = dict(train_options or {})
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
        self.confidence = confidence
        self.split = float(split)

    def __repr__(self) -> str:
        return (
            f"FitExitHeadsPass(rows={len(self.texts)}, budget={self.budget}, confidence={self.confidence}, "
            f"criterion={self.criterion!r}, exits={self.exits or 'all'}, heads={self.heads!r}, solver={self.solver!r}, "
            f"metric={self.metric!r}, "
            + (f"train_texts={len(self.train_texts)}, " if self.train_texts else "")
            + f"never_exit={self.never_exit})"
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
        """Refuse a model the pass cannot work on, with what to do about it."""
        if _keys.EARLY_EXIT in model.metadata_props:
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
        if self.heads not in HEAD_KINDS:
            raise ir.passes.PreconditionError(f"unknown heads {self.heads!r}; use one of {', '.join(HEAD_KINDS)}")
        if self.metric not in ("accuracy", "agreement"):
            raise ir.passes.PreconditionError(f"unknown metric {self.metric!r}; use accuracy or agreement")
        if self.train_texts and self.heads != "trained":
            raise ir.passes.PreconditionError(
                f"extra training text ({len(self.train_texts)} rows) is for trained heads: add heads=trained "
                "(--heads trained), or drop the training text"
            )
        if self.heads == "trained" and (self.hidden or self.pooling not in (None, "cls+mean+attn")):
            raise ir.passes.PreconditionError(
                "heads='trained' has its own architecture (cls+mean+attn pooling, one hidden layer): "
                "leave pooling and hidden unset"
            )
        if self.solver not in SOLVERS:
            raise ir.passes.PreconditionError(f"unknown solver {self.solver!r}; use one of {', '.join(SOLVERS)}")
        if self.solver == "newton" and self.hidden:
            raise ir.passes.PreconditionError(
                f"the newton solver fits linear heads; hidden={self.hidden} needs solver='adam'"
            )

    def ensures(self, model: ir.Model) -> None:
        """Check what the pass promises on its output."""
        meta = json.loads(model.metadata_props[_keys.EARLY_EXIT])
        outputs = {v.name for v in model.graph.outputs}
        for e in meta["exits"]:
            if e["head_output"] not in outputs:
                raise ir.passes.PostconditionError(f"exit head output {e['head_output']!r} missing from the graph")

    def _collect(self, model: ir.Model, cut_names: list[str], pooling: str, trained: bool, clock: _PhaseClock):
        """Run the calibration rows (and, for trained heads, the extra training text) through the model.

        Returns ``(features, teacher, teacher_all, cache)``: pooled features and the full model's probabilities
        of the calibration rows, the probabilities of every cached row (calibration rows, then the extra text),
        and the hidden-state cache of trained heads (``None`` for fitted heads).
        """
        cache = None
        if trained:
            from dyncompile.passes.early_exit.train_heads import HiddenCache

            cache = HiddenCache()
        kw = dict(tokenizer_file=self.tokenizer_file, max_length=self.max_length, batch_size=self.batch_size,
                  progress=self.progress)
        # trained heads read the cached states, not these features
        features, teacher = collect_exit_features(model, cut_names, self.texts, pooling="cls" if trained else pooling,
                                                  on_batch=cache.add if cache is not None else None, **kw)
        clock.lap("running the calibration set")
        teacher_all = teacher
        if cache is not None and self.train_texts:
            # the extra text's states join the cache after the calibration rows (row ids from n on): the heads
            # distil on them, the thresholds and the certificate never see them
            n = len(self.texts)
            _, extra = collect_exit_features(model, cut_names, self.train_texts, pooling="cls",
                                             on_batch=lambda rows, mask, hs: cache.add(rows + n, mask, hs), **kw)
            teacher_all = np.concatenate([teacher, extra])
            clock.lap("running the extra training text")
        return features, teacher, teacher_all, cache

    # --- the pass -------------------------------------------------------------------------------

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Run the rewrite on ``model`` (scope and invariants: the class docstring)."""
        if _keys.EARLY_EXIT in model.metadata_props:
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
        trained = self.heads == "trained"
        pooling = "cls+mean+attn" if trained else (self.pooling or "cls+mean")
        cut_names = [cuts[k] for k in exits]
        clock = _PhaseClock()
        features, teacher, teacher_all, cache = self._collect(model, cut_names, pooling, trained, clock)
        bar = _progress(len(exits), "early-exit: " + ("training" if trained else "fitting") + " exit heads",
                        self.progress)
        if trained:
            from dyncompile.passes.early_exit.train_heads import train_exit_heads

            del features
            try:
                fit = train_exit_heads(cache, teacher_all, self.labels, folds=self.folds, seed=self.seed,
                                       n_calibration=len(self.texts),
                                       progress=lambda done, total, msg: bar.update(1), **self.train_options)
            except CalibrationError as e:
                raise ir.passes.PreconditionError(str(e)) from None
            del cache
        elif self.solver == "newton":
            fit = fit_exit_heads_newton(
                features, teacher, self.labels, pooling=pooling, seed=self.seed, folds=self.folds,
                pca_dim=self.pca_dim or "auto", progress=lambda done, total, msg: bar.update(1),
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
        clock.lap("training exit heads" if trained else "fitting exit heads")
        # metric=agreement: certify the disagreement rate with the full model; the labels (if any) only train
        cert_labels = None if self.metric == "agreement" else self.labels
        reference_probs = None
        if self.reference_model is not None and _keys.QUANTIZED in model.metadata_props:
            ref = self.reference_model
            ref = ir.load(ref) if not isinstance(ref, ir.Model) else ref
            _, reference_probs = collect_exit_features(
                ref, [], self.texts, tokenizer_file=self.tokenizer_file, max_length=self.max_length,
                pooling=pooling, batch_size=self.batch_size, progress=self.progress,
            )
            del ref
        if reference_probs is not None:
            clock.lap("running the reference model")
        bar = _progress(1, "early-exit: calibrating thresholds", self.progress)
        certified = None
        try:
            confidence = None if self.never_exit else self.confidence  # nothing fires: nothing to certify
            if confidence is not None or self.criterion == "learned":
                certified, calibration = certified_calibration(
                    fit.oof_probs, teacher, cert_labels, exits, num_layers, budget=self.budget,
                    confidence=confidence, criterion=self.criterion, patience=self.patience,
                    reference_probs=reference_probs, split=self.split, seed=self.seed,
                )
                logger.info("early-exit certificate: %s", certified.certificate.describe())
                for w in certified.warnings:
                    logger.warning("early-exit certificate: %s", w)
                thresholds = list(certified.thresholds[:-1])
            else:
                cal = calibrate_exits(
                    fit.oof_probs, teacher, cert_labels, exits, num_layers,
                    budget=self.budget, criterion=self.criterion, patience=self.patience, reference_probs=reference_probs,
                )
                for w in cal.warnings:
                    logger.warning("early-exit calibration: %s", w)
                thresholds = list(cal.thresholds[:-1])
                calibration = {k: v for k, v in cal.to_dict().items() if k != "thresholds"} | {
                    "thresholds_all_exits": dict(zip(map(str, exits), thresholds)), "rows": len(self.texts)}
        except CalibrationError as e:
            raise ir.passes.PreconditionError(str(e)) from None
        bar.update(1)
        bar.close()
        clock.lap("calibrating thresholds")
        if self.never_exit:
            thresholds = [None] * len(exits)
        learned = self.criterion == "learned"
        keep = exits_to_keep(thresholds, "patience" if learned else self.criterion, 2 if learned else self.patience,
                             self.never_exit)
        extra_policy = {}
        if certified is not None:
            extra_policy["certificate"] = certified.certificate.to_dict()
        else:
            extra_policy["certificate"] = uncertified_certificate(calibration, cert_labels is not None)
        if learned:
            extra_policy["exit_policy"] = certified.policy.to_dict()
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
                        "oof_accuracy": fit.oof_accuracy[j],
                        "oof_agreement": fit.oof_agreement[j],
                    }
                    for j, k in enumerate(exits)
                },
                "calibration": calibration | {
                    "exit_distribution": exit_distribution(calibration["exit_histogram"], exits, num_layers,
                                                           never_exit=self.never_exit)},
                "fit": {"seconds": round(fit.fit_seconds, 2), **fit.config, "phases": clock.phases},
                **extra_policy,
            },
            policies=policy_metadata(certified.policy, exits, keep) if learned else None,
        )
        logger.info(
            "early exit: %d exits kept of %d; expected speedup %.2fx on the calibration rows",
            len(keep), len(exits), calibration["expected_speedup"],
        )
        return ir.passes.PassResult(model, modified=True)


class _PhaseClock:
    """Wall and CPU seconds (this process, all threads) per compile phase, logged and kept for the plan."""

    def __init__(self) -> None:
        self.phases: dict[str, dict[str, float]] = {}
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def lap(self, name: str) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        self.phases[name] = {"wall_s": round(wall - self._wall, 2), "cpu_s": round(cpu - self._cpu, 2)}
        logger.info("early exit: %s took %.1f s wall, %.1f s CPU", name, wall - self._wall, cpu - self._cpu)
        self._wall, self._cpu = wall, cpu


def exit_distribution(
    exit_histogram: Sequence[int], exits: Sequence[int], num_layers: int, *, never_exit: bool = False
) -> dict:
    """The calibration rows' exit-layer histogram, for the plan (the run-time drift guard compares with it).

    Counts per exit layer (``exits`` + the full model ``num_layers``) from the out-of-fold heads, i.e.
    heads that had not seen the row: what new rows of the calibration's distribution should do.
    """
    counts = [int(c) for c in exit_histogram]
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

    recorded = (json.loads(model.metadata_props.get(_keys.QUANTIZED, "{}")).get("layers")
                or json.loads(model.metadata_props.get(_keys.SMOOTHED, "{}")).get("layers"))
    if not cuts and recorded:  # an int8 search kept some layers fp32 (or smoothing added Muls): the fp32 graph's boundaries
        return int(recorded["num_layers"]), {int(k): v for k, v in recorded["cuts"].items()}, recorded["pooling"]
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
    """The classifier's one output besides exit heads, or a PreconditionError."""
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
    on_batch=None,
) -> tuple[list[np.ndarray], np.ndarray]:
    """Run the model on ``texts`` with the cut tensors exposed (ONNX Runtime, CPU).

    Returns the pooled features ``[N, F]`` of every cut and the full model's probabilities ``[N, C]``.
    ``on_batch(rows, attention_mask, [hidden states per cut])``, if given, sees every batch's raw cut
    tensors (the trained heads cache them).
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
    # Threads that sleep instead of spinning between ops: batch-32 throughput work loses nothing to the
    # wake-up, and on a busy machine spinning burnt ~45 % more CPU for the same rows (MiniLM, 640 rows).
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = calibration_session(proto.SerializeToString(), so, custom_ops=bool(custom_ops_of(model)))
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
        p = softmax(outs[0].astype(np.float64))
        if finals is None:
            finals = np.empty((n, p.shape[1]), np.float64)
        finals[rows] = p
        if on_batch is not None:
            on_batch(rows, feeds["attention_mask"], outs[1:])
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

