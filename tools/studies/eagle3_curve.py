"""Held-out draft agreement of an EAGLE head against training tokens, across the runs that trained it.

Reads the ``eagle_head.json`` of the last run (``train-drafter --init`` carries the curve of the runs before it)
and writes ``NAME.json`` (the curve, one row per evaluation: tokens seen, agreement per draft step, run) and
``NAME.png``. Agreement at draft step ``j`` is the share of held-out positions where the head's ``j``-th draft,
drafted on its own earlier drafts' features, is the target's greedy token (teacher-forced tokens)::

    python -m dyncompile.tools.studies.eagle3_curve HEAD_DIR --out bench-results/eagle3 --name qwen05-eagle3-curve

``--compare OTHER_HEAD`` draws another head's curve beside it (dashed, same colour per draft step; e.g. the other
draft-layer layout trained on the same data) and stores it under ``compare`` in the JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def runs_of(training: dict) -> list[dict]:
    """The chain of training records, oldest first (each run's ``continued_from``)."""
    out = []
    while training:
        out.append({k: v for k, v in training.items() if k != "continued_from"})
        training = training.get("continued_from")
    return out[::-1]


def layout_of(info: dict) -> str:
    """The draft layer's layout a head was trained in (heads before the reference layout existed are ``fc``)."""
    return info["training"].get("layout", "fc")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("head", help="the head directory of the last run")
    p.add_argument("--out", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--compare", action="append", default=[], metavar="HEAD",
                   help="another head's directory: its curve is drawn dashed beside this one's (repeatable)")
    args = p.parse_args(argv)
    info = json.loads((Path(args.head) / "eagle_head.json").read_text())
    runs = runs_of(info["training"])
    ends = [r["tokens_seen"] for r in runs]
    curve = [{**c, "run": next(i for i, e in enumerate(ends) if c["tokens"] <= e) + 1} for c in info["curve"]]
    report = {"head_format": info["format"], "feature_layers": info.get("feature_layers"),
              "corpus": info["corpus"], "runs": runs, "curve": curve,
              "final_eval_all_heldout_windows": info["eval"]}
    others = [json.loads((Path(h) / "eagle_head.json").read_text()) for h in args.compare]
    if others:
        report["layout"] = layout_of(info)
        report["compare"] = [{"head": Path(h).name, "layout": layout_of(o), "curve": o["curve"],
                              "final_eval_all_heldout_windows": o["eval"]} for h, o in zip(args.compare, others)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = len(curve[0]["agreement"])
    tag = f"{layout_of(info)}, " if others else ""
    for j in range(steps):
        ax.plot([c["tokens"] / 1e6 for c in curve], [c["agreement"][j] for c in curve], marker=".",
                color=f"C{j}", label=f"{tag}draft step {j + 1}")
    for o in others:
        for j in range(min(steps, len(o["curve"][0]["agreement"]))):
            ax.plot([c["tokens"] / 1e6 for c in o["curve"]], [c["agreement"][j] for c in o["curve"]], ls="--",
                    color=f"C{j}", label=f"{layout_of(o)}, draft step {j + 1}")
    for e in ends[:-1]:
        ax.axvline(e / 1e6, color="grey", lw=0.6, ls="--")
    ax.set_xlabel("training tokens (millions; grey dashed line: a new run continued from the last checkpoint)")
    ax.set_ylabel("held-out top-1 agreement with the target")
    ax.set_title(f"EAGLE-3 head for {info['target']}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2 if others else 1)
    fig.tight_layout()
    fig.savefig(out / f"{args.name}.png", dpi=110)
    print(f"wrote {out / args.name}.json/.png: {len(curve)} evaluations over {len(runs)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
