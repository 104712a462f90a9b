"""Write a routed plan: a self-contained folder with its candidates as hash-checked sub-plans.

Layout::

    routed/plan.json            one ``cascade`` or ``route`` step, ``policy.routing`` (budget, certificate)
    routed/candidates/NAME/     each candidate's plan.json + the files it names (copies of their own)
    routed/router.onnx          learned rule only (+ router_tokenizer.json)

Each candidate's :func:`~dyncompile.plan.plan_digest` is recorded in the step, so a sub-plan that is missing,
changed, or has files added or removed is a load error. The candidates' files are copied (a reflink where the
file system makes one, else a full copy: a 420 MB MPNet costs 420 MB of disk and about half a second), so the
routed plan shares no inode with the plans it was made from: an edit of one never changes the other. ``link=True``
(``dyncompile route --link``) hard-links the model weights instead. The folder is written through :func:`dyncompile.io.atomic_output_dir`
and loaded back with every check before it is renamed into place.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from dyncompile.errors import DataError
from dyncompile.io import atomic_output_dir, clone_or_copy
from dyncompile.plan import PLAN_FILENAME, Plan, Step, file_ref, load_plan, plan_digest

__all__ = ["copy_subplan", "write_routed_plan"]


def _place(src: Path, dst: Path, link: bool) -> None:
    """Put ``src`` at ``dst``: a copy of its own (reflink where possible).

    A hard link only when ``link`` is asked for and ``src`` is model weights (``.onnx``, ``.data``) on the same
    file system.
    """
    dst.parent.mkdir(parents=True, exist_ok=True)
    if link and src.suffix in (".onnx", ".data"):
        try:
            os.link(src, dst)
            return
        except OSError:
            pass
    clone_or_copy(src, dst)


def copy_subplan(src_dir: Path, dst_dir: Path, *, link: bool = False) -> Plan:
    """Copy plan ``src_dir`` (plan.json + the files it names, hash-checked) to ``dst_dir``.

    Every file is a copy of its own (a reflink where the file system supports it, else a full copy: the
    plan's size in disk and time). ``link=True`` hard-links the model weights instead (no copy, but the two
    plans then share those files: an in-place edit of one changes the other, which its hashes then refuse).
    """
    plan = load_plan(src_dir, verify_hashes=True)
    assert plan.directory is not None
    rels = {PLAN_FILENAME}
    for f in plan.files.values():
        rels.add(f.path)
        rels.update(f.external_data)
    for rel in sorted(rels):
        _place(plan.directory / rel, dst_dir / rel, link)
    return load_plan(dst_dir, verify_hashes=False)


def write_routed_plan(
    out_dir: str | Path,
    *,
    kind: str,
    candidates: list[dict[str, Any]],
    rule: dict[str, Any],
    policy: dict[str, Any],
    router: tuple[Path, Path, dict[str, Any]] | None = None,
    provenance: dict[str, Any] | None = None,
    force: bool = False,
    protect: tuple[str | Path, ...] = (),
    link: bool = False,
) -> Path:
    """Write the routed plan folder ``out_dir``.

    Args:
        out_dir: the folder to write (atomically).
        kind: ``cascade`` or ``route``.
        candidates: cheapest first, each ``{"name", "plan_dir", "cost": {"ms", "provider", "batch", "source"}}``.
        rule: :class:`~dyncompile.plan.RoutingRule` JSON (``router`` is filled in here for a learned rule).
        policy: ``policy.routing`` (budget, reference, metric, certificate, calibration, router_overhead_ms).
        router: ``(router.onnx, tokenizer.json, tokenizer spec)`` for a learned rule.
        protect: more inputs (the reference plan) that ``out_dir`` must neither be, hold nor lie inside.
        link: hard-link the candidates' model weights instead of copying them (see :func:`copy_subplan`).
        provenance: recorded in the plan (what it was made from).
        force: replace an existing plan at ``out_dir``.
    """
    if kind not in ("cascade", "route"):
        raise DataError(f"routed plan kind must be cascade or route, got {kind!r}")
    with atomic_output_dir(out_dir, force=force, protect=(*[c["plan_dir"] for c in candidates], *protect)) as tmp:
        files = {}
        cands = []
        first: Plan | None = None
        for c in candidates:
            rel = f"candidates/{c['name']}"
            sub = copy_subplan(Path(c["plan_dir"]), tmp / rel, link=link)
            first = first or sub
            cands.append({
                "name": c["name"], "plan": rel, "digest": plan_digest(tmp / rel), "cost": dict(c["cost"]),
                "task": sub.task, "labels": sub.labels,
            })
        assert first is not None
        rule = dict(rule)
        tokenizer = None
        if router is not None:
            onnx_path, tok_path, tok_spec = router
            shutil.copy2(onnx_path, tmp / "router.onnx")
            shutil.copy2(tok_path, tmp / "router_tokenizer.json")
            files["router"] = file_ref(tmp, "router.onnx", "router").to_dict()
            files["router_tokenizer"] = file_ref(tmp, "router_tokenizer.json", "tokenizer").to_dict()
            tokenizer = {**{k: v for k, v in tok_spec.items() if k in ("max_length", "padding")}, "file": "router_tokenizer"}
            rule["router"] = "router"
        plan = Plan(
            task=first.task,
            files={},
            steps=[Step(kind, {"candidates": cands, "rule": rule, "output": "logits"})],
            inputs=[],
            outputs=list(first.outputs[:1]) if first.task == "text-classification" else [],
            tokenizer=tokenizer,
            labels=first.labels,
            policy={"routing": policy},
            provenance=dict(provenance or {}),
        )
        raw = plan.to_dict()
        raw["files"] = files
        from dyncompile.io import write_json_atomic

        write_json_atomic(tmp / PLAN_FILENAME, raw)
        load_plan(tmp, verify_hashes=True)  # every check a reader will run
    return Path(out_dir)
