"""``dyncompile inspect``: a structure report of an ONNX model or a plan directory."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from dyncompile.plan import PLAN_FILENAME, load_plan

__all__ = ["inspect_command", "inspect_path"]


def _inspect_plan(plan_dir: Path, as_json: bool) -> str:
    plan = load_plan(plan_dir)
    if as_json:
        return json.dumps(plan.to_dict(), indent=2)
    lines = [f"plan {plan_dir / PLAN_FILENAME}  ({plan.format}, task {plan.task})"]
    lines.append("files:")
    for k, f in plan.files.items():
        lines.append(f"  {k:<18} {f.path:<28} role={f.role:<14} sha256={f.sha256[:12]}… (verified)")
    lines.append("inputs:  " + ", ".join(f"{i['name']}{i.get('shape')}" for i in plan.inputs))
    lines.append("outputs: " + ", ".join(f"{o['name']}{o.get('shape')}" for o in plan.outputs))
    if plan.labels:
        lines.append(f"labels:  {plan.labels}")
    routed = [s for s in plan.steps if s.kind in ("cascade", "route")]
    if routed:
        lines += _routed_lines(plan, routed[0])
    lines.append("steps:")
    for i, s in enumerate(plan.steps):
        params = json.dumps(s.params)
        lines.append(f"  {i}: {s.kind} {params if len(params) < 400 else params[:400] + '…'}")
    if plan.policy:
        lines.append("policy:")
        cert = (plan.policy.get("early_exit") or plan.policy.get("routing") or {}).get("certificate")
        if cert:
            from dyncompile.passes.early_exit.certify import describe_certificate

            lines.append(f"  certificate: {describe_certificate(cert)}")
        for key in ("sparsity", "drafter_sparsity"):
            sp = plan.policy.get(key)
            if isinstance(sp, dict):
                from dyncompile.passes.sparsify_activations import describe_sparsity

                what = "budget" if sp.get("mode") == "budget" else "quality"
                lines.append(f"  {'drafter ' if key.startswith('drafter') else ''}sparsity {what}: "
                             f"{describe_sparsity(sp)}")
        quant = plan.policy.get("quantization")
        if isinstance(quant, dict) and isinstance(quant.get("table"), list):
            lines += quantization_lines(quant, plan.policy.get("budget_split"))
        for k, v in plan.policy.items():
            if k in ("quantization", "budget_split") and isinstance(quant, dict) and isinstance(quant.get("table"), list):
                continue
            cal = v.get("calibration") if isinstance(v, dict) else None
            if isinstance(cal, dict) and isinstance(cal.get("path"), list):  # the certification path: a count
                v = {**v, "calibration": {**cal, "path": f"<{len(cal['path'])} configurations, see plan.json>"}}
            lines.append(f"  {k}: {v}")
    src = plan.provenance.get("source", {})
    if src:
        lines.append(f"source:  {src.get('path')} (sha256 {str(src.get('sha256'))[:12]}…)")
    if plan.provenance.get("passes"):
        lines.append("passes:  " + ", ".join(plan.provenance["passes"]))
    pipe = plan.provenance.get("pipeline")
    if isinstance(pipe, dict) and isinstance(pipe.get("passes"), list):
        inserted = pipe.get("inserted") if isinstance(pipe.get("inserted"), list) else []
        lines.append(f"pipeline (-O{pipe.get('opt_level')} on {pipe.get('provider')}): "
                     f"{', '.join(map(str, pipe['passes']))}; inserted: {', '.join(map(str, inserted)) or 'none'}")
    return "\n".join(lines)


def quantization_lines(q: dict, split: dict | None = None, top: int = 20) -> list[str]:
    """The int8 (or int4/int8) search of a plan: the certificate, the budget split and the per-MatMul table.

    Rows sorted by the search's fallback order (the int8 search: KL of the fp32 outputs to the outputs with that
    MatMul alone in int8, on the search rows; the int4 search also shows the KL with it alone in int4 and
    each MatMul's precision and why); the ``top`` first and every fallback are shown, the rest counted.
    """
    c = q.get("certificate") or {}
    int4 = q.get("int4") if isinstance(q.get("int4"), dict) else None
    out = [f"  quantization: {'int4/int8' if int4 else 'int8'} search, target {q.get('target_points')} points = "
           f"{q.get('share')} x budget {q.get('budget')}; {len(q.get('excluded') or [])} of {len(q['table'])} MatMuls "
           "kept in fp32"]
    if int4:
        out.append(f"    int4: MatMulNBits block {int4.get('block_size')}, "
                   f"{'symmetric' if int4.get('symmetric') else 'zero points'}, accuracy_level "
                   f"{int4.get('accuracy_level')} ({'int8' if int4.get('accuracy_level') == 4 else 'fp32'} compute); "
                   f"{len(q.get('int4_nodes') or [])} int4, {len(q.get('int8_nodes') or [])} int8 (dynamic), "
                   f"{len(q.get('excluded') or [])} fp32")
    if c:
        bound = "none" if c.get("bound") is None else f"{c['bound']:.2f}"
        out.append(f"    {'the quantized model' if int4 else 'int8'} alone on {c.get('rows')} held-out calibration rows: drop {c.get('observed'):.2f} points, "
                   f"agreement {c.get('agreement')} %, bound {bound} at {c.get('confidence')} -> "
                   f"{'certified' if c.get('certified') else 'NOT certified'} within {c.get('target')}")
    if split:
        pl, qs, ex = split.get("pipeline") or {}, split.get("quantization") or {}, split.get("exits") or {}
        out.append(f"    budget split of {split.get('budget')}: {'quantized' if int4 else 'int8'} observed {qs.get('observed')}, exits observed "
                   f"{ex.get('observed')}, pipeline observed {pl.get('observed')} bound {pl.get('bound')} "
                   f"({'certified' if pl.get('certified') else 'NOT certified'}, one certificate vs the fp32 original)")
    for st in q.get("steps") or []:
        mix = f" ({st['int4']} int4, {st['int8']} int8)" if "int4" in st else ""
        out.append(f"    search: {st['fp32_kept']:>3} in fp32{mix} -> path-row drop {st['observed_path']:.2f}, agreement "
                   f"{st['agreement_path']} %, predicted bound {st['predicted_bound']:.2f}")
    rows = sorted(q["table"], key=lambda r: r.get("rank", 0))
    kl4 = f" {'KL int4':>10} {'flips4':>6}" if int4 else ""
    out.append(f"    {'rank':>4}  {'MatMul':<28} {'KL int8':>10} {'flips':>5} {'acc Δ':>7}{kl4}  precision  why")
    shown = [r for r in rows if r.get("rank", 0) <= top or r.get("fp32") or (int4 and r.get("precision") == "int8")]
    for r in shown:
        acc = "–" if r.get("acc_change") is None else f"{r['acc_change']:+.2f}"
        prec = r.get("precision") or ("fp32" if r.get("fp32") else "int8")
        k4 = (f" {r['kl_int4']:>10.2e} {r['flips_int4']:>6}" if "kl_int4" in r else f" {'–':>10} {'–':>6}") if int4 else ""
        out.append(f"    {r.get('rank', 0):>4}  {r['label'][:28]:<28} {r['kl']:>10.2e} {r['flips']:>5} {acc:>7}{k4}  "
                   f"{prec:<9}  {r.get('why', '')}")
    if len(rows) > len(shown):
        rest = "int4" if int4 else "int8"
        out.append(f"    ... {len(rows) - len(shown)} less sensitive MatMuls, all {rest} (plan.json has the full table)")
    return out


def _routed_lines(plan, step) -> list[str]:
    """Candidates (cost, digest), the rule and the certificate of a routed plan; sub-plans are checked."""
    from dyncompile.plan import load_subplan

    p = step.typed
    routing = plan.policy.get("routing") or {}
    lines = [f"{step.kind}: {len(p.candidates)} candidates, cheapest first (the last always answers)"]
    for c in p.candidates:
        sub = load_subplan(plan, c)
        kinds = ",".join(s.kind for s in sub.steps)
        lines.append(f"  {c.name:<18} {c.cost.ms:9.3f} ms/call ({c.cost.source} on {c.cost.provider}, batch {c.cost.batch})  "
                     f"steps={kinds}  digest={c.digest[:12]}… (verified)")
    r = p.rule
    if r.kind == "confidence":
        rule = f"confidence: candidate k answers when its {r.criterion} passes thresholds[k] = {r.thresholds}"
    elif r.kind == "learned":
        rule = f"learned router {r.router!r} (reads the input first): first k with score_k > {r.thresholds}"
    else:
        rule = f"executable check {r.check!r}: candidate k's answer is kept when the check passes"
    lines.append(f"rule:    {rule}")
    if routing.get("router_overhead_ms") is not None:
        lines.append(f"router overhead: {routing['router_overhead_ms']} ms/row (tokenizer + router, batch 1)")
    cal = routing.get("calibration") or {}
    if cal:
        lines.append(f"calibration: reference {routing.get('reference')} ({routing.get('reference_ms')} ms), "
                     f"answers per candidate on calib {cal.get('candidate_histogram')}, expected speedup vs the "
                     f"reference {cal.get('expected_speedup')}x")
    return lines


def inspect_path(path: str | Path, as_json: bool = False) -> str:
    """Report on ``path``: a plan directory (or plan.json) or an ONNX model file."""
    p = Path(path)
    if p.is_dir() and (p / PLAN_FILENAME).is_file() or p.name == PLAN_FILENAME:
        return _inspect_plan(p if p.is_dir() else p.parent, as_json)
    from dyncompile.io import load_input_model
    from dyncompile.passes.analysis import analyze_model, format_report
    from dyncompile.passes.analysis.hf_metadata import hf_model_config, resolve_model_dir

    p = resolve_model_dir(p)  # a Hugging Face / Optimum model folder: its model.onnx
    model = load_input_model(p)
    structure = analyze_model(model)
    hf = hf_model_config(p)  # config.json & co. beside the model: what the compiler will use
    from dyncompile.io import MODEL_CONFIG_NAME, read_model_config

    override = {k: v for k, v in read_model_config(p).items()  # it wins field by field, as in the compiler
                if k in ("task", "model_type", "num_layers", "labels")}
    if as_json:
        return json.dumps({**dataclasses.asdict(structure), "hf_config": hf, "model_config": override}, indent=2,
                          default=str)
    source = MODEL_CONFIG_NAME if override else "config.json"
    hf = {**hf, **override}
    report = f"model {p}\n" + format_report(structure)
    if hf.get("model_type") or hf.get("task"):
        facts = [f"model_type {hf.get('model_type', '?')}", f"task {hf.get('task', 'unknown')}"]
        facts += [f"{hf['num_layers']} layers"] if hf.get("num_layers") else []
        facts += [f"labels {', '.join(hf['labels'])}"] if hf.get("labels") else []
        report = report.rstrip("\n") + f"\nFrom {source}: " + "; ".join(facts) + "\n"
    return report


def inspect_command(args) -> int:
    """``dyncompile inspect PATH [--json] [--verify]``."""
    from dyncompile.tools._text import safe_text

    if args.verify:
        from dyncompile.plan import plan_digest

        digest = plan_digest(args.path)
        print(json.dumps({"plan": str(Path(args.path).resolve()), "sha256": digest}) if args.json
              else f"{digest}  {safe_text(args.path)}")
        return 0
    print(safe_text(inspect_path(args.path, as_json=args.json)))
    return 0
