"""``early-exit`` (part 2): lower fitted exit heads into an If graph or a staged plan."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from dyncompile.passes import _keys
from dyncompile.passes._graph import backward_slice, default_opset
from dyncompile.passes.early_exit.graph import NEVER_THRESHOLD, GraphBuilder

logger = logging.getLogger(__name__)

__all__ = ["InsertEarlyExitPass"]



class InsertEarlyExitPass(ir.passes.InPlacePass):
    """Lower the exit heads attached by :class:`FitExitHeadsPass` into executable early exits.

    Scope: main graph; creates If subgraphs (``lowering="if"``).

    ``lowering="if"``: one self-contained graph. After layer ``k`` the exit head runs; if every row of
    the batch passes the exit test, ``If`` takes the then-branch (the head's logits, exit layer ``k``),
    else the else-branch runs the rest of the network, with the next exit nested inside it:
    ``logits, exit_layer = If(all(fires_k(head_k(h_k))), [head_k, k], [layers k+1.. , If(...)])``.
    Each initializer is moved into the (innermost) subgraph that uses it, so ONNX Runtime's CPU EP
    keeps weight pre-packing at any nesting depth. Outputs: ``logits`` (as before) and a scalar int64
    ``exit_layer``.

    ``lowering="staged"``: the graph keeps the heads as extra outputs and asks the ``early_exit_staged``
    plan emitter to cut it into segment graphs at the exits; the runtime then exits per row and compacts
    the batch.

    Invariants: with thresholds that never fire, outputs equal the original's (the full path runs the
    original nodes). Idempotent: an already lowered model is left alone (``modified=False``).
    Repairs what it breaks: runs ``NameFixPass`` (subgraph SSA names) and ``TopologicalSortPass``.
    """

    def __init__(self, lowering: str = "if", provider: str | None = None, reason: str | None = None) -> None:
        super().__init__()
        if lowering not in ("if", "staged"):
            raise ValueError(f"lowering must be 'if' or 'staged', got {lowering!r}")
        self.lowering = lowering
        self.provider = provider
        self.reason = reason

    def __repr__(self) -> str:
        return f"InsertEarlyExitPass(lowering={self.lowering!r}, provider={self.provider!r})"

    def requires(self, model: ir.Model) -> None:
        """Refuse a model the pass cannot work on, with what to do about it."""
        if _keys.EARLY_EXIT not in model.metadata_props:
            raise ir.passes.PreconditionError(
                "no exit heads to lower: run FitExitHeadsPass first (the 'early-exit' pass does both)"
            )

    def ensures(self, model: ir.Model) -> None:
        """Check what the pass promises on its output."""
        if self.lowering == "if":
            names = [v.name for v in model.graph.outputs]
            if names[:1] != [json.loads(model.metadata_props[_keys.EARLY_EXIT])["final_output"]] or "exit_layer" not in names:
                raise ir.passes.PostconditionError(f"If lowering must output (logits, exit_layer), got {names}")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Run the rewrite on ``model`` (scope and invariants: the class docstring)."""
        if _keys.EARLY_EXIT_LOWERING in model.metadata_props:
            return ir.passes.PassResult(model, modified=False)
        meta = json.loads(model.metadata_props[_keys.EARLY_EXIT])
        model.metadata_props[_keys.EARLY_EXIT_LOWERING_CHOICE] = json.dumps(
            {"lowering": self.lowering, "provider": self.provider, "reason": self.reason}
        )
        if self.lowering == "staged":
            model.metadata_props[_keys.EARLY_EXIT_LOWERING] = "staged"
            model.metadata_props[_keys.EMITTER] = "early_exit_staged"
            model.metadata_props[_keys.TASK] = "text-classification"
            return ir.passes.PassResult(model, modified=True)
        self._lower_if(model, meta)
        model.metadata_props[_keys.EARLY_EXIT_LOWERING] = "if"
        model.metadata_props[_keys.TASK] = "text-classification"
        common_passes.NameFixPass()(model)
        common_passes.TopologicalSortPass()(model)
        return ir.passes.PassResult(model, modified=True)

    def _lower_if(self, model: ir.Model, meta: dict) -> None:
        g = model.graph
        exits = meta["exits"]
        outputs = {v.name: v for v in g.outputs}
        final = outputs[meta["final_output"]]
        head_outs = [outputs[e["head_output"]] for e in exits]
        criterion, patience = meta["criterion"], int(meta["patience"])
        num_layers = int(meta["num_layers"])
        opset = default_opset(model)

        order = _constants_next_to_readers(list(g))
        if not exits:  # nothing can exit early: the original graph plus exit_layer = L
            b = GraphBuilder(opset, "exit_final.")
            layer = ir.node("Identity", [b.const(np.array(num_layers, np.int64), "layer")])
            layer.outputs[0].name, layer.outputs[0].dtype, layer.outputs[0].shape = "exit_layer", ir.DataType.INT64, ir.Shape([])
            for init in b.initializers:
                g.register_initializer(init)
            g.append(layer)
            g.outputs.append(layer.outputs[0])
            return
        main_slice = backward_slice([final])
        head_nodes = []
        claimed: set[ir.Node] = set()  # nodes several heads read (the shared mask rows) go with the first
        for v in head_outs:
            mine = backward_slice([v], stop=main_slice) - claimed
            head_nodes.append([n for n in order if n in mine])
            claimed.update(head_nodes[-1])
        in_heads = {n for hn in head_nodes for n in hn}
        body = [n for n in order if n not in in_heads]
        values = ir.convenience.create_value_mapping(g)
        boundaries = [body.index(values[e["cut"]].producer()) for e in exits]
        if boundaries != sorted(boundaries):
            raise ir.passes.PreconditionError("exit cut tensors are not in layer order")
        segments = []
        prev = 0
        for b in boundaries:
            segments.append(body[prev : b + 1])
            prev = b + 1
        segments.append(body[prev:])

        # Detach everything: graph outputs first (a value may be the output of one graph only).
        g.outputs.clear()
        g.remove(order, safe=False)
        final.name = f"{meta['final_output']}_full_path"

        # Innermost else: the original tail + exit_layer = L.
        b = GraphBuilder(opset, "exit_final.")
        last_exit = b.const(np.array(num_layers, np.int64), "layer")
        tail = ir.node("Identity", [last_exit])
        tail.outputs[0].name = "exit_layer_full_path"
        tail.outputs[0].dtype, tail.outputs[0].shape = ir.DataType.INT64, ir.Shape([])
        inner = ir.Graph([], [final, tail.outputs[0]], nodes=[*segments[-1], tail], name="else_full")
        for init in b.initializers:
            inner.register_initializer(init)
        level_outputs = None
        for j in range(len(exits) - 1, -1, -1):
            k = exits[j]["layer"]
            thr = exits[j]["threshold"]
            if thr is None:
                thr = NEVER_THRESHOLD[criterion]
            cb = GraphBuilder(opset, f"exit{k}.cond.")
            window = head_outs[max(0, j - patience + 1) : j + 1] if criterion == "patience" else ()
            if criterion == "patience" and len(window) < patience:
                thr = NEVER_THRESHOLD[criterion]  # not enough exits yet for the agreement window
            cond, then_nodes = self._exit_condition(cb, exits[j], head_outs[j], outputs, criterion, float(thr), window)
            head_nodes[j] = [n for n in head_nodes[j] if n not in then_nodes]
            then_logits = ir.node("Identity", [head_outs[j]])
            then_logits.outputs[0].name = f"exit{k}_logits_out"
            layer_const = cb.const(np.array(k, np.int64), "layer")
            then_layer = ir.node("Identity", [layer_const])
            then_layer.outputs[0].name = f"exit{k}_layer_out"
            for node, src in ((then_logits, head_outs[j]), (then_layer, layer_const)):
                node.outputs[0].dtype, node.outputs[0].shape = src.dtype, src.shape
            then_g = ir.Graph([], [then_logits.outputs[0], then_layer.outputs[0]],
                              nodes=[*then_nodes, then_logits, then_layer], name=f"then_exit{k}")
            y = ir.val(f"exit{k}_if_logits", final.dtype, final.shape)
            e = ir.val(f"exit{k}_if_layer", ir.DataType.INT64, ir.Shape([]))
            if_node = ir.node(
                "If", [cond], {"then_branch": then_g, "else_branch": inner}, outputs=[y, e], name=f"early_exit_after_layer_{k}"
            )
            nodes = [*segments[j], *head_nodes[j], *cb.tape.nodes, if_node]
            if j == 0:
                g.extend(nodes)
                for init in cb.initializers:
                    g.register_initializer(init)
                level_outputs = (y, e)
            else:
                inner = ir.Graph([], [y, e], nodes=nodes, name=f"else_after_layer_{k}")
                for init in cb.initializers:
                    inner.register_initializer(init)
        y, e = level_outputs
        y.name = meta["final_output"]
        e.name = "exit_layer"
        g.outputs.extend([y, e])
        self._move_initializers_inward(g)

    def _exit_condition(self, cb: GraphBuilder, ex: dict, logits: ir.Value, outputs: dict[str, ir.Value],
                        criterion: str, thr: float, window: Sequence[ir.Value]) -> tuple[ir.Value, list[ir.Node]]:
        """The If's condition for one exit and the head nodes that move into its then-branch.

        Two-class heads under ``entropy`` or ``maxprob`` test the logit difference
        (:meth:`GraphBuilder.all_margins_exceed`) and compute the logits themselves only where the exit is taken
        (their ``MatMul`` and ``Add`` go into the then-branch): five kernels fewer for every row that goes on.
        """
        if criterion == "learned":
            return self._learned_cond(cb, ex, logits, outputs), []
        margin = _two_class_output_layer(logits) if criterion in ("entropy", "maxprob") else None
        if margin is not None:
            x, w, bias, then_nodes = margin
            return cb.all_margins_exceed(x, w, bias, criterion, thr), then_nodes
        return cb.all_fire(logits, criterion, thr, window), []

    @staticmethod
    def _learned_cond(cb: GraphBuilder, ex: dict, logits: ir.Value, outputs: dict[str, ir.Value]) -> ir.Value:
        """All rows' learned score > threshold (a constant False where the exit never fires)."""
        pol = ex.get("policy")
        if ex["threshold"] is None or pol is None:
            return cb.op("Identity", [cb.const(np.array(False), "never")])
        prev = outputs[pol["prev_head"]] if pol.get("prev_head") else None
        return cb.all_rows(cb.learned_fires(logits, prev, pol["weights"], pol["bias"], float(ex["threshold"])))

    @staticmethod
    def _move_initializers_inward(g: ir.Graph) -> None:
        """Put each main-graph initializer used by a single subgraph into that subgraph."""
        moved = 0
        for name, v in list(g.initializers.items()):
            graphs = {u.node.graph for u in v.uses()}
            if len(graphs) != 1:
                continue
            (owner,) = graphs
            if owner is None or owner is g or v.is_graph_output():
                continue
            g.initializers.pop(name)
            owner.register_initializer(v)
            moved += 1
        logger.debug("moved %d initializers into the subgraphs that use them", moved)


def _two_class_output_layer(logits: ir.Value) -> tuple[ir.Value, np.ndarray, np.ndarray, list[ir.Node]] | None:
    """``(x, W [H, 2], b [2], [MatMul, Add])`` for two-class logits ``Add(MatMul(x, W), b)``, else ``None``.

    That is what :meth:`GraphBuilder.head` writes; the product must be read by the ``Add`` alone.
    """
    add = logits.producer()
    if add is None or add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(add.inputs) != 2:
        return None
    mm_out, b = add.inputs
    mm = mm_out.producer() if mm_out is not None else None
    if mm is None or mm.op_type != "MatMul" or b is None or b.const_value is None or len(mm_out.uses()) != 1:
        return None
    x, w = mm.inputs
    if w is None or w.const_value is None or x is None:
        return None
    wa, ba = w.const_value.numpy(), b.const_value.numpy()
    if wa.ndim != 2 or wa.shape[1] != 2 or ba.shape not in ((2,), (1, 2)):
        return None
    return x, wa, ba, [mm, add]


def _constants_next_to_readers(order: list[ir.Node]) -> list[ir.Node]:
    """``order`` with each node that reads only constants placed right before its first reader.

    A static-int8 weight's ``DequantizeLinear(int8 W, scale, zero)`` reads initializers only, and ORT's
    quantizer puts it anywhere before its MatMul (often at the top of the graph). Cut into segments as it
    stood, it would stay in the main graph while its MatMul moves into an ``If`` branch: ORT fuses
    ``DequantizeLinear -> MatMul`` only within one graph, so every call would dequantize every weight of the model
    (measured on MiniLM-L6 static int8 × early exit: 0.31x fp32). Next to its reader it moves into the same
    branch. A topological order stays one (the node's inputs are constants).
    """
    def constant_only(n: ir.Node) -> bool:
        return all(i is None or i.const_value is not None or i.is_initializer() for i in n.inputs) and not any(
            o.is_graph_output() for o in n.outputs)

    pos = {n: i for i, n in enumerate(order)}
    movable = [n for n in order if constant_only(n) and n.op_type != "Constant" and n.graph is not None]
    first_reader = {}
    for n in movable:
        readers = [u.node for o in n.outputs for u in o.uses() if u.node in pos]
        if readers:
            first_reader[n] = min(readers, key=pos.__getitem__)
    if not first_reader:
        return order
    before: dict[ir.Node, list[ir.Node]] = {}
    for n, r in first_reader.items():
        before.setdefault(r, []).append(n)
    out = []
    for n in order:
        if n in first_reader:
            continue
        out.extend(before.get(n, ()))
        out.append(n)
    return out


def choose_lowering(provider: str = "cpu", batch_sizes: Sequence[int] = ()) -> tuple[str, str]:
    """EP-aware choice for ``--lowering auto``: ``(lowering, reason)``.

    From the batch sizes the plan will serve (``--batch-sizes``), then known provider capabilities. The If
    graph exits only when every row of a batch passes its exit test, so a declared batch above 1 gets the staged
    plan, which exits per row and compacts the batch, on every provider.
    """
    from dyncompile.runtime.providers import PROVIDERS

    info = PROVIDERS.get(provider)
    if info is None:
        raise ValueError(f"unknown provider {provider!r}; choose one of {', '.join(PROVIDERS)}")
    if any(b > 1 for b in batch_sizes):
        return "staged", (
            f"declared batch sizes {','.join(map(str, batch_sizes))} include {max(batch_sizes)} > 1: an If graph exits "
            "only when every row of the batch passes, staged exits per row and compacts the batch"
        )
    if provider == "openvino":
        return "staged", (
            "OpenVINO EP (onnxruntime-openvino 1.24, OpenVINO 2025.4) fails session creation when an op inside an If "
            "branch is not supported (no fallback; seen on the BERT If graph) and can take the wrong If branch with "
            "symbolic dims; staged segments contain no If"
        )
    if provider == "directml":
        return "staged", "DirectML EP does not run If/Loop (they fall back to the CPU with their whole subgraphs)"
    if provider == "cuda":
        return "if", (
            "CUDA EP runs If with the condition on the host (one scalar copy per exit); the single graph keeps hidden "
            "states on the device, while staged exits would copy them to the host at every exit"
        )
    return "if", ("CPU EP: skipped branches cost nothing, an If around a layer's branch ~30 µs (MiniLM-L6, 2 threads) "
                  "with no Python between stages; one self-contained graph deploys anywhere")


def parse_batch_sizes(spec: str | int | None) -> tuple[int, ...]:
    """``"1,32"`` -> ``(1, 32)``; ``None`` or empty -> ``()`` (nothing declared)."""
    from dyncompile.errors import PassConfigError

    if spec in (None, ""):
        return ()
    try:
        sizes = tuple(int(x) for x in str(spec).replace(";", ",").split(",") if x.strip())
    except ValueError:
        sizes = ()
    if not sizes or any(b < 1 for b in sizes):
        raise PassConfigError(f"--batch-sizes must be positive integers like 1,32, got {spec!r}")
    return sizes


def _parse_exits(spec) -> list[int] | None:
    from dyncompile.errors import PassConfigError

    if spec in (None, "", "all"):
        return None
    if isinstance(spec, int):
        return [spec]
    try:
        return [int(x) for x in str(spec).replace(";", ",").split(",") if x.strip()]
    except ValueError:
        raise PassConfigError(f"--exits must be layer numbers like 2,4,6, got {spec!r}") from None


def _refuse_embeddings(context) -> None:
    """Early exit on a sentence-embedding model: refused, with the reason (no exit criterion for embeddings)."""
    from dyncompile.errors import PassConfigError
    from dyncompile.plan import EMBEDDING_TASKS

    task = (context.model_config or {}).get("task")
    if task in EMBEDDING_TASKS:
        raise PassConfigError(
            f"early-exit cannot run on a {task} model: every exit criterion it has (entropy, maxprob, patience, "
            "learned) reads class probabilities, and an embedding model has none; an embedding would need its own "
            "criterion (e.g. a certified bound on the cosine agreement of the early layer's pooled embedding with "
            "the full model's), which is not implemented. Compile it without early-exit (quantize-int8 makes an "
            "encoder faster)"
        )


def _read_train_text(path: str | None, heads: str) -> list[str] | None:
    """The ``--train-text`` rows (texts only), refused for heads that do not train."""
    from dyncompile.errors import PassConfigError
    from dyncompile.io import read_jsonl

    if not path:
        return None
    if heads != "trained":
        raise PassConfigError(
            f"--train-text is extra text for trained exit heads to distil on; add --heads trained (heads is {heads!r})"
        )
    texts = [r["text"] for r in read_jsonl(path)]
    if not texts:
        raise PassConfigError(f"--train-text {path} has no rows")
    return texts


def _make_early_exit(
    context,
    budget: float | None = None,
    lowering: str | None = None,
    criterion: str | None = None,
    patience: int = 2,
    exits: int | str | None = None,
    pooling: str | None = None,
    hidden: int | None = None,
    never_exit: bool | None = None,
    heads: str | None = None,
    budget_reference: str = "original",
    confidence: str | float | None = None,
    batch_sizes: str | int | None = None,
    metric: str | None = None,
    train_text: str | None = None,
):
    """Factory of the ``early-exit`` pass: FitExitHeadsPass + InsertEarlyExitPass.

    Options left at None take the compile's flags (``--budget``, ``--confidence``, ``--lowering``,
    ``--criterion``, ``--exits``, ``--never-exit``, ``--heads``, ``--batch-sizes``, ``--metric``), then the defaults
    (budget 1.0 certified at confidence 0.9, lowering auto, entropy, every layer, fitted (linear) heads, no batch
    sizes declared, metric accuracy). ``heads=trained``: attention-pooling + MLP heads distilled from the full
    model (PyTorch). ``metric=agreement``: the budget bounds the disagreement rate with the full model, certified
    without labels (it also bounds the accuracy drop: a row that agrees with the full model cannot change
    correctness). ``train_text`` (``--train-text``): a JSONL file of extra text the trained heads distil on
    (every fold head and the shipped one; the thresholds and the certificate use the calibration rows only).
    ``lowering=auto`` picks staged when a declared batch size is above 1, else by provider.
    """
    from dyncompile.errors import PassConfigError
    from dyncompile.io import read_jsonl, texts_and_labels
    from dyncompile.passes.early_exit.fit_exit_heads import FitExitHeadsPass

    _refuse_embeddings(context)
    o = context.options
    budget = budget if budget is not None else o.get("budget")
    budget = 1.0 if budget is None else budget
    if isinstance(budget, bool) or not isinstance(budget, int | float) or not 0 <= budget <= 100:
        raise PassConfigError(
            f"--budget is the accepted accuracy drop in points and must be >= 0 (at most 100), got {budget!r}"
        )
    budget = float(budget)
    lowering = lowering or o.get("lowering") or "auto"
    if lowering not in ("if", "staged", "auto"):
        raise PassConfigError(f"--lowering must be if, staged or auto, got {lowering!r}")
    criterion = criterion or o.get("criterion") or "entropy"
    if criterion not in ("entropy", "maxprob", "patience", "learned"):
        raise PassConfigError(f"--criterion must be entropy, maxprob, patience or learned, got {criterion!r}")
    from dyncompile.passes.early_exit.certify import CalibrationError, parse_confidence

    asked = confidence if confidence is not None else o.get("confidence")
    try:
        confidence = parse_confidence(asked)
    except CalibrationError as e:
        raise PassConfigError(str(e)) from None
    if not 1 <= patience <= 64:
        raise PassConfigError(f"early-exit patience must be in 1..64, got {patience}")
    never_exit = bool(o.get("never_exit", False)) if never_exit is None else never_exit
    heads = heads or o.get("heads") or "fitted"
    if heads not in ("fitted", "trained", "given"):
        raise PassConfigError(f"heads must be 'fitted', 'trained' or 'given', got {heads!r}")
    metric = metric or o.get("metric") or "accuracy"
    if metric not in ("accuracy", "agreement"):
        raise PassConfigError(f"--metric must be accuracy or agreement, got {metric!r}")
    target = o.get("provider") or "cpu"
    sizes = parse_batch_sizes(batch_sizes if batch_sizes is not None else o.get("batch_sizes"))
    if lowering == "auto":
        try:
            lowering, reason = choose_lowering(target, sizes)
        except ValueError as e:
            raise PassConfigError(str(e)) from None
    else:
        reason = "chosen by the user (--lowering)"
    train_texts = _read_train_text(train_text if train_text is not None else o.get("train_text"), heads)
    rows = read_jsonl(o["calib"])
    labels_names = context.model_config.get("labels")
    texts, labels = texts_and_labels(rows, labels_names)
    tok = context.require_tokenizer("early exit")
    max_length = int(context.model_config.get("max_length", 512))
    if heads == "given":
        from dyncompile.passes.early_exit.wire_given_exit_heads import WireGivenExitHeadsPass

        if criterion == "learned":
            raise PassConfigError("--criterion learned needs fitted heads (--heads fitted); given heads support entropy, "
                                  "maxprob and patience")
        if confidence is not None and asked is not None:
            raise PassConfigError("--heads given calibrates without a certificate: pass --confidence none")
        logger.warning("early-exit with --heads given: thresholds are calibrated without a certificate (the budget "
                       "holds on the calibration rows only)")

        wire = WireGivenExitHeadsPass(
            texts, labels, tokenizer_file=tok, max_length=max_length, budget=budget, criterion=criterion,
            patience=patience, never_exit=never_exit, progress=context.progress,
        )
        return [wire, InsertEarlyExitPass(lowering=lowering, provider=target, reason=reason)]
    fit = FitExitHeadsPass(
        texts,
        labels,
        tokenizer_file=tok,
        max_length=max_length,
        budget=budget,
        criterion=criterion,
        patience=patience,
        exits=_parse_exits(exits if exits is not None else o.get("exits")),
        pooling=pooling,
        hidden=hidden,
        never_exit=never_exit,
        # after quantize-int8/int4 in the same pipeline, the budget is the total drop vs the compile input
        reference_model=context.model_path if budget_reference == "original" and context.model_path else None,
        progress=context.progress,
        confidence=confidence,
        heads=heads,
        metric=metric,
        train_texts=train_texts,
    )
    return [fit, InsertEarlyExitPass(lowering=lowering, provider=target, reason=reason)]


from dyncompile.passes._infra import register_pass  # noqa: E402

register_pass(
    "early-exit",
    help="fit exit heads on --calib data, calibrate thresholds to --budget, lower to an If graph or staged plan",
    requires=("calib",),
    choices={
        "lowering": ("if", "staged", "auto"),
        "criterion": ("entropy", "maxprob", "patience", "learned"),
        "heads": ("fitted", "trained", "given"),
        "metric": ("accuracy", "agreement"),
        "budget_reference": ("original", "self"),
        "pooling": ("cls", "mean", "cls+mean"),
    },
)(_make_early_exit)
