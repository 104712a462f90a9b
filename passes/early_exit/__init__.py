"""Early exit for encoder classifiers: stop at an inner layer when a small head there is confident enough.

An encoder classifier is cut after chosen layers ``k``; at each cut an *exit head* predicts the class
from the layer-``k`` hidden states, and at run time a row stops at the first exit whose test fires. No
retraining of the model: the heads are fitted on a calibration set, the thresholds are calibrated to an
accuracy-drop budget, and the graph is rewritten so that the rest of the network is skipped.

The technique, in order (module per step):

1. **heads** — :mod:`.heads`: the head model, ``softmax(dense(...act(dense(pool(h_k)))))`` with ``cls``,
   ``mean`` or ``cls+mean`` pooling, and its JSON form (numpy).
2. **fit** — :mod:`.fit`: one head per exit by distillation towards the full model (labels mixed in),
   K-fold cross-fitted so that the *out-of-fold* probabilities are honest about new data (numpy).
3. **calibrate** — :mod:`.calibrate`: per-exit thresholds that minimise the mean cost subject to
   "accuracy drop <= budget points" on the out-of-fold probabilities (numpy).
4. **lower** — :mod:`.insert_early_exit`: the heads and thresholds become an If graph (the batch exits when
   every row may) or a staged plan (:mod:`.emit_staged`; per-row exits with batch compaction).

The exit rule itself (entropy / maxprob / patience, first exit that fires) is written once in numpy in
:mod:`dyncompile.runtime.rules.exit_rule` — calibration optimises it and the staged runtime step applies it —
and once in ONNX in :mod:`.graph` (``GraphBuilder.fires``) for the If lowering; a test asserts both give
the same decisions.

Passes (one per module):

* :class:`FitExitHeadsPass` (:mod:`.fit_exit_heads`) — steps 1-3 on a model: probe the cut tensors in
  ONNX Runtime, fit, calibrate, attach the heads that can fire;
* :class:`AttachExitHeadsPass` (:mod:`.attach_exit_heads`) — attach heads fitted elsewhere, with given
  thresholds;
* :class:`WireGivenExitHeadsPass` (:mod:`.wire_given_exit_heads`) — per-layer logits the graph already
  outputs (DeeBERT-style) become the exits, calibrated the same way;
* :class:`InsertEarlyExitPass` (:mod:`.insert_early_exit`) — step 4. The ``early-exit`` pipeline name is
  ``FitExitHeadsPass`` (or ``WireGivenExitHeadsPass`` with ``heads=given``) + ``InsertEarlyExitPass``.
"""

from dyncompile.passes.early_exit import emit_staged  # noqa: F401  (registers the staged plan emitter)
from dyncompile.passes.early_exit.attach_exit_heads import AttachExitHeadsPass
from dyncompile.passes.early_exit.fit_exit_heads import FitExitHeadsPass
from dyncompile.passes.early_exit.insert_early_exit import InsertEarlyExitPass
from dyncompile.passes.early_exit.wire_given_exit_heads import WireGivenExitHeadsPass

__all__ = ["AttachExitHeadsPass", "FitExitHeadsPass", "InsertEarlyExitPass", "WireGivenExitHeadsPass"]
