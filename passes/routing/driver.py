"""The routed-plan compiler behind ``dyncompile route`` / ``dyncompile.route``.

The driver runs each candidate plan on the calibration rows, measures each candidate's batch-1 cost on the
chosen provider (interleaved, medians, under the session config every ``dyncompile.load`` session gets),
then fits and certifies the rule with :mod:`dyncompile.passes.routing` (the early-exit certifier) and writes
the self-contained routed plan folder. Running a plan needs the runtime executor, which passes may not
import: the caller injects it — ``load`` (a plan loader such as :func:`dyncompile.runtime.load`) and
``get_check`` (the executable-check lookup, :func:`dyncompile.runtime.routing.route.get_check`);
``dyncompile.route`` passes both.

For candidates that cannot be run here (e.g. decoders whose correctness needs hidden tests), calibrate from
per-row arrays with :func:`dyncompile.passes.routing.calibrate_check` and write the plan with
:func:`write_fitted` — or pass ``judge=`` (a registered check deciding whether an answer is right) to
:func:`route` with ``rule="check"``.
"""

from __future__ import annotations

import logging
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dyncompile.errors import DataError, PlanError
from dyncompile.runtime.providers import session_config_entries

logger = logging.getLogger(__name__)

__all__ = ["RouteResult", "candidate_probs", "load_candidates", "measure_costs", "route", "router_features", "write_fitted"]

RULES = ("confidence", "learned", "check")


class RouteResult:
    """What :func:`route` made: the plan folder, the fitted rule, the candidates' costs and the router's."""

    def __init__(self, plan_dir: Path, fit, costs: dict[str, float], router_ms: float | None) -> None:
        self.plan_dir = plan_dir
        self.fit = fit
        self.costs = costs
        self.router_ms = router_ms

    def summary(self) -> str:
        """A few lines for the CLI: candidates and their costs, thresholds, the certificate, the expected speedup."""
        from dyncompile.passes.early_exit.certify import describe_certificate

        c = self.fit.certificate
        lines = [f"routed plan: {self.plan_dir}  (rule {self.fit.kind})"]
        for name, ms in self.costs.items():
            lines.append(f"  candidate {name:<16} {ms:8.2f} ms/row (batch 1)")
        if self.router_ms is not None:
            lines.append(f"  router overhead    {self.router_ms:8.3f} ms/row")
        lines.append(f"  thresholds {self.fit.thresholds}  histogram on calib {self.fit.calibration['candidate_histogram']}")
        lines.append("  " + describe_certificate(c))
        lines.append(f"  expected speedup vs the reference alone: {c.get('expected_speedup')}x")
        return "\n".join(lines)


def _name(path: Path, used: set[str]) -> str:
    base = re.sub(r"[^A-Za-z0-9_.-]", "-", path.resolve().name) or "candidate"
    name, i = base, 2
    while name in used:
        name, i = f"{base}-{i}", i + 1
    used.add(name)
    return name


def load_candidates(dirs: Sequence[str | Path], load: Callable[..., Any], provider: str = "cpu") -> list:
    """Load every candidate plan with ``load`` (all plan checks) and check they do one task with one label set."""
    from dyncompile.plan import is_plan_dir

    if len(dirs) < 2:
        raise DataError(f"--candidates needs at least two plan folders (cheapest first), got {len(dirs)}")
    models = []
    for d in dirs:
        if not Path(d).exists():
            raise DataError(f"candidate {d} does not exist; give plan folders made by `dyncompile MODEL -o DIR`")
        if Path(d).is_dir() and not is_plan_dir(d):
            raise PlanError(f"candidate {d} is not a plan folder (no readable plan.json); compile the model first")
        m = load(d, provider=provider)
        if any(s.kind in ("cascade", "route") for s in m.plan.steps):
            raise DataError(f"candidate {d} is itself a routed plan; give its candidates instead")
        models.append(m)
    tasks = {m.plan.task for m in models}
    if len(tasks) != 1:
        desc = ", ".join(f"{d}: {m.plan.task}" for d, m in zip(dirs, models))
        raise DataError(f"candidates do different tasks ({desc}); a router chooses between models of one task")
    labels = [tuple(m.plan.labels) if m.plan.labels else None for m in models]
    if len(set(labels)) != 1:
        desc = "; ".join(f"{d}: {list(lab) if lab else None}" for d, lab in zip(dirs, labels))
        raise DataError(f"candidates have different label sets ({desc}); routing needs one label set (same order)")
    return models


def per_row_plan(model) -> bool:
    """An If-lowered early-exit plan: at batch > 1 it exits only when every row may (one decision per batch)."""
    return (model.plan.policy.get("early_exit") or {}).get("lowering") == "if"


def candidate_probs(model, texts: Sequence[str], batch_size: int = 32, desc: str = "", progress: bool = True) -> np.ndarray:
    """``[N, C]`` probabilities of one candidate on ``texts`` (length-sorted batches)."""
    from tqdm.auto import tqdm

    if per_row_plan(model):  # an If-graph early exit decides one exit per batch: calibrate what batch 1 does
        batch_size = 1
    order = np.argsort([len(t) for t in texts], kind="stable")
    out = np.zeros((len(texts), len(model.plan.labels or [0, 0])), np.float64)
    for s in tqdm(range(0, len(texts), batch_size), desc=desc or "candidate", leave=False, disable=not progress):
        idx = order[s : s + batch_size]
        out[idx] = model.predict_proba([texts[i] for i in idx], batch_size=len(idx))
    return out


def measure_costs(fns: dict[str, Callable[[str], Any]], texts: Sequence[str], rows: int = 40, warmup: int = 3) -> dict[str, float]:
    """Median batch-1 ms per call of each function, interleaved (order rotated per row)."""
    names = list(fns)
    for n in names:
        for t in texts[:warmup]:
            fns[n](t)
    lat: dict[str, list[float]] = {n: [] for n in names}
    for i, t in enumerate(texts[:rows]):
        k = i % len(names)
        for n in names[k:] + names[:k]:
            t0 = time.perf_counter()
            fns[n](t)
            lat[n].append((time.perf_counter() - t0) * 1e3)
    return {n: statistics.median(v) for n, v in lat.items()}


def router_features(model, texts: Sequence[str], table: np.ndarray) -> np.ndarray:
    """:func:`~dyncompile.passes.routing.router.bag_features` of ``texts`` with ``model``'s tokenizer."""
    from dyncompile.passes.routing.router import bag_features
    from dyncompile.runtime.text import TextEncoder

    enc = TextEncoder.from_plan(model.plan, model.plan.tokenizer)
    out = []
    for s in range(0, len(texts), 64):
        f = enc(list(texts[s : s + 64]))
        out.append(bag_features(f["input_ids"], f["attention_mask"], table))
    return np.concatenate(out)


def _router_parts(model):
    """(token embedding table, tokenizer path, tokenizer spec) of the cheapest candidate."""
    from dyncompile.passes.routing.router import find_token_embedding

    plan = model.plan
    if not plan.tokenizer:
        raise DataError("the learned router reads the first candidate's tokenizer, and its plan has none")
    onnx_keys = [k for k, f in plan.files.items() if f.path.endswith(".onnx")]
    err = None
    for k in onnx_keys:
        try:
            return find_token_embedding(plan.path_of(k)), plan.path_of(plan.tokenizer["file"]), plan.tokenizer
        except DataError as e:
            err = e
    raise err or DataError("the first candidate's plan has no ONNX file with a token embedding table")


def _labels_of(rows: list[dict], labels: list[str] | None, calib: Path, need: bool) -> np.ndarray | None:
    from dyncompile.io import texts_and_labels

    has = all("label" in r for r in rows)
    if not has:
        if need:
            missing = next(i for i, r in enumerate(rows) if "label" not in r)
            raise DataError(
                f"{calib}: row {missing + 1} has no 'label' field; --metric accuracy needs a label on every row "
                "(or use --metric agreement: the budget is then the disagreement rate with the reference)"
            )
        return None
    _, y = texts_and_labels(rows, labels)
    return np.asarray(y, np.int64)


def route(
    candidates: Sequence[str | Path],
    calib: str | Path,
    output_dir: str | Path,
    *,
    budget: float = 1.0,
    confidence: Any = None,
    rule: str = "confidence",
    criterion: str = "entropy",
    reference: str | Path | None = None,
    metric: str | None = None,
    check: str | None = None,
    judge: str | None = None,
    limit: int | None = None,
    cost_rows: int = 40,
    costs: dict[str, float] | None = None,
    provider: str = "cpu",
    force: bool = False,
    link: bool = False,
    seed: int = 0,
    ridge: float = 30.0,
    outputs: dict[str, np.ndarray] | None = None,
    progress: bool = True,
    load: Callable[..., Any],
    get_check: Callable[[str], Callable[[dict, dict], bool]],
) -> RouteResult:
    """Compile a routed plan over ``candidates`` (plan folders, cheapest first) calibrated on ``calib``.

    Args:
        candidates: plan folders, cheapest first.
        calib: JSONL calibration rows (``text`` + ``label`` for classifiers, ``prompt`` + fields for decoders).
        output_dir: the routed plan folder to write (atomically; ``force`` replaces a plan there).
        budget: points of accuracy (or agreement) to give up against the reference.
        confidence: the certificate's confidence (default 0.9), or ``"none"`` for an uncertified fit.
        check: cascade on this registered executable check (rule ``check``).
        limit: use only the first rows of ``calib``.
        cost_rows: rows to time each candidate on, batch 1.
        provider: execution provider the costs are measured on.
        force: replace an existing plan at ``output_dir``.
        seed: seed of the certificate's split and of the router's fit.
        ridge: the router's ridge penalty (rule ``learned``).
        progress: show progress bars.
        load: ``load(plan_dir, provider=...)`` -> a loaded plan (``dyncompile.runtime.load``).
        get_check: executable check by name (``dyncompile.runtime.routing.route.get_check``).
        rule: ``confidence`` (cascade on the candidates' own confidence), ``learned`` (a router reads the input
            first) or ``check`` (cascade on the executable check ``check``).
        criterion: entropy or maxprob (confidence rule).
        reference: plan folder the budget is measured against (default: the last candidate), e.g. the plain
            model when the last candidate is its early-exit plan.
        metric: ``accuracy`` (needs labels), ``agreement`` (with the reference) — default: accuracy when every
            calibration row has a label.
        judge: check rule on decoders: a registered check that decides whether an answer is right.
        costs: candidate name -> ms, instead of measuring (``source: given``).
        outputs: precomputed ``{plan folder: [N, C] probabilities}`` on the calibration rows (benchmarks).
        link: hard-link the candidates' model weights into the routed plan instead of copying them (the plans
            then share those files).
    """
    from dyncompile.io import read_jsonl
    from dyncompile.passes.early_exit.certify import parse_confidence
    from dyncompile.passes.routing import calibrate_cascade, calibrate_route
    from dyncompile.passes.routing.router import build_router_onnx

    _check_options(rule, metric, Path(calib))
    conf = parse_confidence(confidence)
    calib = Path(calib)
    models = load_candidates(candidates, load, provider)
    used: set[str] = set()
    names = [_name(Path(c), used) for c in candidates]
    task = _task_of(models, rule)
    field = "text" if task == "text-classification" else "prompt"
    rows = read_jsonl(calib, limit=limit, text_field=field)
    texts = [r[field] for r in rows]
    labels = models[0].plan.labels
    ref_model = models[-1]
    if reference is not None and Path(reference).resolve() not in [Path(c).resolve() for c in candidates]:
        ref_model = load_candidates([reference, candidates[-1]], load, provider)[0]
    from dyncompile.io import check_output_dir

    # the output rules of `dyncompile MODEL --force`, before any measuring: the inputs (candidates, reference,
    # calib) are never replaced or written into
    check_output_dir(output_dir, force=force, protect=(*candidates, *([reference] if reference else []), calib))

    fns = {n: (lambda t, m=m: m.predict_proba([t], batch_size=1)) for n, m in zip(names, models)}
    if task == "text-generation":
        fns = {n: (lambda t, m=m: m.generate(t)) for n, m in zip(names, models)}
    router_parts = _router_parts(models[0]) if rule == "learned" else None
    tmpdir = tempfile.TemporaryDirectory(prefix="dyncompile-route-")
    router_ms = None
    try:
        router_path = Path(tmpdir.name) / "router.onnx"
        if router_parts is not None:  # time a router of the final shape (its weights do not change its cost)
            from dyncompile.passes.routing.router import RouterHead

            table = router_parts[0]
            k = len(models) - 1
            dummy = RouterHead(np.zeros(table.shape[1] + 1), np.ones(table.shape[1] + 1), np.zeros((k, table.shape[1] + 1)),
                               np.zeros(k), ridge)
            build_router_onnx(dummy, table, router_path)
            fns["router"] = _router_fn(router_path, router_parts[1], router_parts[2])
        ref_name = "reference"
        if ref_model is not models[-1]:
            fns[ref_name] = lambda t, m=ref_model: m.predict_proba([t], batch_size=1)
        measured, source = _costs(fns, texts, cost_rows, costs, names, learned=rule == "learned",
                                  need_reference=ref_model is not models[-1])
        ms = [measured[n] for n in names]
        ref_ms = measured.get(ref_name, ms[-1])
        router_ms = measured.get("router")

        if task == "text-classification":
            y = _labels_of(rows, labels, calib, need=metric == "accuracy" or rule == "check")
            if metric == "agreement":
                y = None
            probs, ref_probs = _classifier_outputs(candidates, names, models, reference, ref_model, texts, outputs,
                                                   progress)
        if rule == "confidence":
            fit = calibrate_cascade(probs, ref_probs, y, ms, ref_ms, budget=budget, confidence=conf, criterion=criterion,
                                    seed=seed)
        elif rule == "learned":
            table = router_parts[0]
            feats = router_features(models[0], texts, table)
            fit = calibrate_route(feats, probs, ref_probs, y, ms, ref_ms, router_ms or 0.0, budget=budget,
                                  confidence=conf, ridge=ridge, seed=seed)
            build_router_onnx(fit.router, table, router_path)
        else:
            fit = _calibrate_check(models, names, rows, texts, task, get_check(check) if check else None,
                                   get_check(judge) if judge else None, y if task == "text-classification" else None,
                                   ms, ref_ms, budget, conf, seed, progress)
        cand_specs = [{"name": n, "plan_dir": Path(c), "cost": {"ms": round(float(x), 4), "provider": provider, "batch": 1,
                                                                 "source": source}}
                      for n, c, x in zip(names, candidates, ms)]
        return write_fitted(output_dir, fit, cand_specs, budget=budget, reference=str(reference or candidates[-1]),
                            reference_ms=ref_ms, router=(router_path, router_parts[1], router_parts[2]) if router_parts else None,
                            router_ms=router_ms, calib=calib, force=force, check=check, link=link)
    finally:
        tmpdir.cleanup()



def _check_options(rule: str, metric: str | None, calib: Path) -> None:
    """The routing options that need no model: one clear error each."""
    if rule not in RULES:
        raise DataError(f"--rule must be one of {', '.join(RULES)}, got {rule!r}")
    if metric not in (None, "accuracy", "agreement"):
        raise DataError(f"--metric must be accuracy or agreement, got {metric!r}")
    if not calib.is_file():
        raise DataError(f"calibration data {calib} not found; give a JSONL file with 'text' (and 'label') per row")


def _task_of(models: list, rule: str) -> str:
    """The candidates' task, refused where routing (or the chosen rule) does not apply."""
    task = models[0].plan.task
    if task not in ("text-classification", "text-generation"):
        raise DataError(f"routing supports classifier and decoder candidates; these do {task!r}")
    if rule == "confidence" and task != "text-classification":
        raise DataError("the confidence rule needs classifier candidates; for decoders use --rule check")
    return task


def _costs(fns: dict[str, Callable[[str], Any]], texts: list[str], cost_rows: int, costs: dict[str, float] | None,
           names: list[str], *, learned: bool, need_reference: bool) -> tuple[dict[str, float], str]:
    """Batch-1 milliseconds per candidate (+ router, reference): measured, or the ``costs`` given; and the source."""
    if costs is None:
        logger.info("measuring batch-1 costs on %d rows", cost_rows)
        return measure_costs(fns, texts, rows=cost_rows), "measured"
    missing = [n for n in names if n not in costs]
    if missing:
        raise DataError(f"costs given for {sorted(costs)}, but not for candidate(s) {missing}")
    measured = {**costs}
    if learned and "router" not in measured:
        measured["router"] = 0.0
    if need_reference and "reference" not in measured:
        raise DataError("costs must include 'reference' when --reference is not a candidate")
    return measured, "given"


def _classifier_outputs(candidates, names, models, reference, ref_model, texts, outputs, progress):
    """Each candidate's (and the reference's) probabilities on the calibration texts; ``outputs`` precomputed."""

    def probs_of(key, model, desc):
        if outputs and str(key) in outputs:
            return outputs[str(key)]
        return candidate_probs(model, texts, desc=desc, progress=progress)

    probs = [probs_of(c, m, n) for c, n, m in zip(candidates, names, models)]
    ref_probs = probs[-1] if ref_model is models[-1] else probs_of(reference, ref_model, "reference")
    return probs, ref_probs

def _router_fn(router_path: Path, tok_path: Path, tok_spec: dict) -> Callable[[str], Any]:
    import onnxruntime as ort

    from dyncompile.runtime.text import TextEncoder

    so = ort.SessionOptions()
    for k, v in session_config_entries().items():
        so.add_session_config_entry(k, v)
    sess = ort.InferenceSession(str(router_path), so, providers=["CPUExecutionProvider"])
    enc = TextEncoder(tok_path, max_length=tok_spec.get("max_length", 512), padding=tok_spec.get("padding", "longest"))

    def fn(t: str):
        f = enc([t])
        return sess.run(None, {"input_ids": f["input_ids"], "attention_mask": f["attention_mask"]})

    return fn


def _calibrate_check(models, names, rows, texts, task, chk, jd, y, ms, ref_ms, budget, conf, seed, progress=True):
    from dyncompile.passes.routing import calibrate_check

    if chk is None:
        raise DataError("--rule check needs --check NAME (a registered executable check, e.g. python-doctest)")
    if task == "text-classification":
        if y is None:
            raise DataError("--rule check on classifiers needs a 'label' on every calibration row to score answers")
        outs = []
        for m in models:
            p = candidate_probs(m, texts, progress=progress)
            outs.append(p)
        labs = models[0].plan.labels
        passes = np.array([[chk({"text": t}, {"label": labs[int(np.argmax(p))],
                                              "probabilities": dict(zip(labs, map(float, p)))})
                            for t, p in zip(texts, o)] for o in outs[:-1]], bool)
        correct = np.array([o.argmax(-1) == y for o in outs], bool)
    else:
        if jd is None:
            raise DataError("--rule check on decoders needs --judge NAME: a registered check that says whether an "
                            "answer is right (e.g. the hidden tests), to measure quality against the budget")
        from tqdm.auto import tqdm

        passes_l, correct_l = [], []
        for k, m in enumerate(models):
            pk, ck = [], []
            for r in tqdm(rows, desc=names[k], leave=False, disable=not progress):
                res = m.generate(r["prompt"])
                out = {"text": res.text, "token_ids": list(res.token_ids)}
                ck.append(bool(jd(r, out)))
                if k < len(models) - 1:
                    pk.append(bool(chk(r, out)))
            correct_l.append(ck)
            if k < len(models) - 1:
                passes_l.append(pk)
        passes, correct = np.array(passes_l, bool), np.array(correct_l, bool)
    return calibrate_check(passes, correct, correct[-1], ms, ref_ms, budget=budget, confidence=conf, seed=seed)


def write_fitted(output_dir, fit, candidates: list[dict], *, budget: float, reference: str, reference_ms: float,
                 router=None, router_ms: float | None = None, calib=None, force: bool = False,
                 check: str | None = None, link: bool = False) -> RouteResult:
    """Write the routed plan for a :class:`~dyncompile.passes.routing.RoutingFit` (from any calibration)."""
    from dyncompile.io import sha256_file
    from dyncompile.passes.routing import write_routed_plan

    rule: dict[str, Any] = {"kind": fit.kind, "thresholds": list(fit.thresholds)}
    if fit.kind == "confidence":
        rule["criterion"] = fit.criterion
    if fit.kind == "check":
        rule["check"] = check
    policy = {
        "budget": float(budget), "reference": str(reference), "metric": fit.calibration.get("metric"),
        "certificate": fit.certificate, "calibration": fit.calibration, "reference_ms": round(float(reference_ms), 4),
    }
    if router_ms is not None:
        policy["router_overhead_ms"] = round(float(router_ms), 4)
    prov = {"tool": "dyncompile route"}
    if calib is not None:
        prov["calib"] = {"path": str(Path(calib).resolve()), "sha256": sha256_file(calib)}
    kind = "route" if fit.kind == "learned" else "cascade"
    out = write_routed_plan(output_dir, kind=kind, candidates=candidates, rule=rule, policy=policy, router=router,
                            provenance=prov, force=force, protect=(reference,) if reference else (),
                            link=link)
    return RouteResult(out, fit, {c["name"]: c["cost"]["ms"] for c in candidates}, router_ms)
