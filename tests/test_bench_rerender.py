"""Every JSON report stored under bench-results/ re-renders, from the JSON alone, to the markdown stored beside it,
byte for byte, with the harness that wrote it (``render_markdown``; on the command line ``--render JSON``).

Nothing is skipped silently: a stored JSON is either owned by a harness (:data:`OWNERS`), or listed with the reason
its markdown cannot be re-rendered (:data:`PREDATES`, :data:`ANNOTATED`), or listed as not a report
(:data:`NOT_REPORTS`); the lists are checked to stay true.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench-results"

#: (glob under bench-results/, module whose ``render_markdown`` wrote the markdown); first match wins
OWNERS: list[tuple[str, str]] = [
    ("certificate-splits/*.json", "dyncompile.tools.studies.certificate_splits"),
    ("decoder-graphs/*.json", "dyncompile.tools.studies.decoder_graphs"),
    ("decoder-quality/*.json", "dyncompile.tools.bench.quality"),
    ("early-exit-certified/*.json", "dyncompile.tools.studies.certified"),
    ("early-exit-cpu/*.json", "dyncompile.tools.studies.early_exit"),
    ("early-exit-cuda/*.json", "dyncompile.tools.studies.early_exit"),
    ("restructure-check/early_exit.json", "dyncompile.tools.studies.early_exit"),
    ("restructure-check/pl-all.json", "dyncompile.tools.bench.generate"),
    ("early-exit-resplit/*.json", "dyncompile.tools.studies.early_exit_resplit"),
    ("peers/q05-prefill-conv-vs-noconv-*.json", "dyncompile.tools.bench.generate"),
    ("peers/*.json", "dyncompile.tools.bench.peers"),
    ("fast-path-default/*.json", "dyncompile.tools.bench.peers"),
    ("peers-cuda/*.json", "dyncompile.tools.bench.peers"),
    ("speculative-cuda/*-peers.json", "dyncompile.tools.bench.peers"),
    ("speculative-cuda/*-quality.json", "dyncompile.tools.bench.quality"),
    ("speculative-*/*.json", "dyncompile.tools.bench.generate"),
    ("lookahead/*.json", "dyncompile.tools.bench.generate"),
    ("eagle3/*-peers.json", "dyncompile.tools.bench.peers"),
    ("eagle3/qwen05-hybrid-policy.json", "dyncompile.tools.studies.hybrid_policy"),
    ("eagle3/qwen05-hybrid-min3-*.json", "dyncompile.tools.bench.generate"),
    ("eagle3-interop/smollm2-eagle3-*interop-*.json", "dyncompile.tools.bench.peers"),
    ("eagle3-interop/qwen05-eagle3-interop-*.json", "dyncompile.tools.bench.peers"),
    ("eagle3-interop/qwen05-eagle3-layouts-*.json", "dyncompile.tools.bench.generate"),
    ("eagle3-interop/qwen05-eagle3-int8-drafter-*.json", "dyncompile.tools.bench.generate"),
    ("eagle3/qwen05-eagle3-*-code.json", "dyncompile.tools.bench.generate"),
    ("eagle3/qwen05-eagle3-code.json", "dyncompile.tools.bench.generate"),
    ("eagle3/qwen15-*-code.json", "dyncompile.tools.bench.generate"),
    ("eagle3/qwen05-eagle3-*-grounded.json", "dyncompile.tools.bench.generate"),
    ("medusa/smollm2-*.json", "dyncompile.tools.bench.generate"),
    ("medusa/qwen15-*-code.json", "dyncompile.tools.bench.generate"),
    ("early-exit-trained/wallclock/*.json", "dyncompile.tools.bench.classify"),
    ("early-exit-trained/alpha0.5/*-trained-*.json", "dyncompile.tools.bench.classify"),
    ("early-exit-trained/bbc-news/wallclock/*.json", "dyncompile.tools.bench.classify"),
    ("contextual-sparsity/kernels.json", "dyncompile.tools.studies.sparsity_kernels"),
    ("contextual-sparsity/kernels-sparse-rows*.json", "dyncompile.tools.studies.sparse_rows_kernel"),
    ("contextual-sparsity/*-sites.json", "dyncompile.tools.studies.sparsity_sites"),
    ("contextual-sparsity/*-allocation.json", "dyncompile.tools.studies.sparsity_allocation"),
    ("contextual-sparsity/*-quality.json", "dyncompile.tools.bench.quality"),
    ("contextual-sparsity/*-code.json", "dyncompile.tools.bench.generate"),
    ("contextual-sparsity/*-all.json", "dyncompile.tools.bench.generate"),
    ("contextual-sparsity/*-grounded.json", "dyncompile.tools.bench.generate"),
    ("screen-lm-head/*-screen-target.json", "dyncompile.tools.studies.decoder_graphs"),
    ("screen-lm-head/qwen15-d05-*.json", "dyncompile.tools.bench.peers"),
    ("screen-lm-head/*.json", "dyncompile.tools.bench.generate"),
    ("serve/*.json", "dyncompile.tools.bench.serve"),
    ("route-code/*.json", "dyncompile.tools.studies.route_code"),
    ("stepsaver/stepsaver.json", "dyncompile.tools.studies.stepsaver"),
    ("stepsaver/composition/*.json", "dyncompile.tools.studies.diffusion_plans"),
    ("unet-cache/*.json", "dyncompile.tools.studies.unet_cache"),
    ("quantized-certified/*-quality.json", "dyncompile.tools.bench.quality"),
    ("quantized-certified/*-minrows-code.json", "dyncompile.tools.bench.generate"),
    ("quantized-certified/qwen2.5-coder-0.5b*.json", "dyncompile.tools.studies.int4_row_invariance"),
    ("quantized-certified/*.json", "dyncompile.tools.studies.quantized_certified"),
    ("quantized-cuda/*.json", "dyncompile.tools.bench.classify"),
    ("quantized-*/*.json", "dyncompile.tools.studies.quantized_early_exit"),
    ("route-sentiment/*.json", "dyncompile.tools.bench.routed"),
    ("under-load/*.json", "dyncompile.tools.studies.under_load"),
]

#: JSON files that are not JSON + markdown report pairs: path -> what they are
NOT_REPORTS = {
    "contextual-sparsity/qwen05-budget-confidence-records.json": "the pass's own dyncompile.sparsity records (data)",
    "route-code/cost-model.json": "the cost model `studies.humaneval costmodel` measured (an input of route_code)",
    "route-code/cost-model-fp32.json": "the cost model `studies.humaneval costmodel` measured (an input of route_code)",
    "route-code/live-check.json": "route_code's live re-run of a subsample (data inside route-code.json's run)",
    "route-code/live-check-fp32-gpu-table.json": "route_code's live re-run of a subsample (data, no markdown)",
    "speculative-eagle/qwen2.5-coder-0.5b-head.json": "the training record `dyncompile train-drafter` writes",
    "speculative-eagle/smollm2-135m-head.json": "the training record `dyncompile train-drafter` writes",
    "eagle3-interop/smollm2-eagle3-ref-head.json": "the training record `dyncompile train-drafter` writes",
    "eagle3-interop/smollm2-eagle3-fc-head.json": "the training record `dyncompile train-drafter` writes",
    "eagle3-interop/smollm2-eagle3-ref2-head.json": "the training record `dyncompile train-drafter` writes",
    "eagle3-interop/qwen05-eagle3-fc-head.json": "the training record `dyncompile train-drafter` writes",
    "eagle3-interop/qwen05-eagle3-ref-head.json": "the training record `dyncompile train-drafter` writes",
    "eagle3-interop/qwen05-eagle3-ref2-head.json": "the training record `dyncompile train-drafter` writes",
    "eagle3-interop/qwen05-eagle3-d12k-head.json": "the training record `dyncompile train-drafter` writes",
    "eagle3-interop/qwen05-eagle3-curves.json": "`studies.eagle3_curve`: held-out agreement vs training tokens, reference vs fc layout (JSON + PNG)",
    "speculative-trees/qwen05-verify-curve.json": "`bench.generate curve` output: JSON only, no markdown",
    "lookahead/smollm2-verify-curve-2threads.json": "`bench.generate curve` output: JSON only, no markdown",
    "lookahead/qwen05-verify-curve-cpu-t2.json": "`bench.generate curve` output: JSON only, no markdown",
    "lookahead/qwen05-verify-curve-cpu-t4.json": "`bench.generate curve` output: JSON only, no markdown",
    "lookahead/qwen05-verify-curve-cpu-t8.json": "`bench.generate curve` output: JSON only, no markdown",
    "lookahead/qwen05-verify-curve-cpu-t16.json": "`bench.generate curve` output: JSON only, no markdown",
    "lookahead/qwen05-verify-curve-h200-torch.json": "GPU verification-cost curve timed with PyTorch on the GPU machine (README)",
    "medusa/heads-run1-heldout.json": "per-head held-out agreement `train_medusa.evaluate_medusa` returns (README)",
    "medusa/heads-run2-heldout.json": "per-head held-out agreement `train_medusa.evaluate_medusa` returns (README)",
    "medusa/qwen05-gpu-eval-curve.json": "eval curve parsed from the GPU training log of the Qwen heads (README)",
    "medusa/qwen05-heads-gpu.json": "the training record `train-drafter --kind medusa` wrote for the Qwen heads (README)",
    "medusa/qwen15-heads-gpu.json": "the training record `train-drafter --kind medusa` wrote for the Qwen 1.5B heads (README)",
    "medusa/qwen15-heads-gpu-run2.json": "the training record of the 1.5B heads on the EAGLE-3 data, eval curve inside (README)",
    "medusa/qwen15-heads-run2-heldout.json": "per-head held-out agreement `train_medusa.evaluate_medusa` returns, 1.5B run-2 heads",
    "medusa/qwen15-heads-gpu-run3.json": "the training record of the 1.5B run-3 heads (per-head LM heads), eval curves inside (README)",
    "medusa/qwen15-heads-run3-heldout.json": "per-head held-out agreement `train_medusa.evaluate_medusa` returns, 1.5B run-3 heads",
    "eagle3/qwen05-eagle3-curve.json": "`studies.eagle3_curve`: held-out agreement vs training tokens (JSON + PNG)",
    "eagle3/qwen15-eagle3-curve.json": "`studies.eagle3_curve`: held-out agreement vs training tokens, 1.5B head, first run (JSON + PNG)",
    "early-exit-trained/heads-minilm-l6-sentiment.json": "studies.trained_heads per-exit AUC / certificate data (the README's tables)",
    "early-exit-trained/heads-mpnet-base-sentiment.json": "studies.trained_heads per-exit AUC / certificate data (the README's tables)",
    "early-exit-trained/alpha0.5/heads-minilm-l6-sentiment.json": "studies.trained_heads data of the label-mix run",
    "early-exit-trained/alpha0.5/heads-mpnet-base-sentiment.json": "studies.trained_heads data of the label-mix run",
    "early-exit-trained/bbc-news/heads-minilm-l6-bbc-news.json": "studies.trained_heads data of the BBC News (second task) run",
    "models.json": "the recorded accuracy of each model recipe (tests/test_models_recipes.py reads it)",
}

_OLD_DECODER_GRAPHS = ("measured with sessions spinning off, before the harness took dyncompile.load's session "
                       "config; the JSON does not record the setting, the stored markdown states it")
_OLD_PEERS = ("written before the peers table's present columns (prefill, decode, paired ratios, ceiling): its rows "
              "lack fields the renderer reads, or its markdown has the earlier table")

#: stored reports whose format predates the renderer: path -> why (each is checked to really differ)
PREDATES = {
    **{f"decoder-graphs/{n}.json": _OLD_DECODER_GRAPHS for n in (
        "q05-int4-blocks", "q05-int4-head8", "qwen05-fp32-packed-gqa", "qwen05-int4-packed-gqa", "qwen05-packed",
        "qwen15-fp32", "smollm2-one-session", "smollm2")},
    **{f"peers/{n}.json": _OLD_PEERS for n in (
        "q05-fpk-pl-grounded-peers-ovf32", "q05-fused-pl-code-peers-ovf32", "q05-fused-pl-grounded-peers-ovf32",
        "q05-fused-pl-grounded-peers", "q05-fused-pl-grounded-spinning", "q05-int4-b128a-code-peers",
        "q05-int4-fast-code-peers", "q05-int4-h8-code-peers", "q05-int4-pack-code-peers",
        "q05-int4-packbias-code-peers", "q05-int4-pgqa-code-peers", "q05-int4-spin-code-peers",
        "q05-pgqa-pl-code-peers", "q05-pgqa-pl-grounded-peers", "q05-pl-grounded-peers", "q05-pl16-code-peers",
        "q05-pl16-grounded-peers", "q05-s9-code-peers", "q05-s9-grounded-peers", "q05-spin-code-peers",
        "q05-spin-grounded-peers", "q05-xfpt-pl-code-peers", "q05-xfpt-pl-grounded-peers", "q05-xft-pl-code-peers",
        "q05-xft-pl-grounded-peers", "q15-d05b128-code-peers", "q15-d05h8-code-peers", "q15-fast-pl-code-peers",
        "q15-fast-pl-grounded-peers", "q15-pgqa-d05-code-peers", "smollm2-prompt-lookup-peers",
        "smollm2-spinning-all")},
    **{f"peers-cuda/{n}.json": _OLD_PEERS for n in ("smol-fused-pl-cuda-peers", "smol-pl-cuda-peers")},
}

#: stored markdown with hand-written text around the rendered report: path -> why (the render must be inside it)
ANNOTATED = {
    "quantized-early-exit-openvino-dynamic/quantized_early_exit.json":
        "a hand-written preface explains why the run is kept beside the newer one",
}


def _owner(rel: str) -> str | None:
    path = Path(rel)
    return next((mod for pattern, mod in OWNERS if path.match(pattern)), None)


def _stored_json() -> list[str]:
    return sorted(str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*.json"))


def _render(rel: str) -> str:
    report = json.loads((RESULTS / rel).read_text(encoding="utf-8"))
    return importlib.import_module(_owner(rel)).render_markdown(report)


def _markdown(rel: str) -> bytes:
    return (RESULTS / rel).with_suffix(".md").read_bytes()


RERENDERED = [r for r in _stored_json() if r not in NOT_REPORTS and r not in PREDATES and r not in ANNOTATED]


def test_every_stored_json_is_owned_or_listed():
    stored = _stored_json()
    assert stored, "no stored reports found"
    unowned = [r for r in stored if r not in NOT_REPORTS and _owner(r) is None]
    assert unowned == [], "stored JSON reports no harness re-renders (add an owner, or list them with a reason)"
    stale = sorted((set(NOT_REPORTS) | set(PREDATES) | set(ANNOTATED)) - set(stored))
    assert stale == [], f"listed but not stored (remove them from the lists): {stale}"
    no_md = [r for r in stored if r not in NOT_REPORTS and not (RESULTS / r).with_suffix(".md").is_file()]
    assert no_md == [], f"reports without their markdown: {no_md}"
    assert not [r for r in NOT_REPORTS if (RESULTS / r).with_suffix(".md").is_file()], "a NOT_REPORTS file has a .md"


@pytest.mark.parametrize("rel", RERENDERED)
def test_stored_report_rerenders_byte_for_byte(rel):
    assert _render(rel).encode("utf-8") == _markdown(rel)


@pytest.mark.parametrize("rel", sorted(PREDATES))
def test_reports_listed_as_predating_the_renderer_do_differ(rel):
    """The list stays honest: a report the renderer reproduces again belongs in the byte-for-byte test."""
    try:
        rendered = _render(rel).encode("utf-8")
    except (KeyError, TypeError):  # a field the renderer reads is missing from the older report
        return
    assert rendered != _markdown(rel)


@pytest.mark.parametrize("rel", sorted(ANNOTATED))
def test_annotated_reports_contain_their_render(rel):
    rendered = _render(rel).encode("utf-8")
    stored = _markdown(rel)
    assert rendered != stored and rendered.strip() in stored


@pytest.mark.parametrize(("argv_head", "rel"), [
    (["bench", "generate"], "speculative-smollm2/smollm2-prompt-lookup-all.json"),
    (["bench", "quality"], "decoder-quality/q05-int4-formats.json"),
])
def test_render_option_prints_the_stored_markdown(capsys, argv_head, rel):
    from dyncompile.tools.cli import main

    assert main([*argv_head, "--render", str(RESULTS / rel)]) == 0
    assert capsys.readouterr().out.encode("utf-8") == _markdown(rel)


def test_render_option_of_a_study(capsys):
    from dyncompile.tools.studies import early_exit

    assert early_exit.main(["--render", str(RESULTS / "early-exit-cpu" / "early_exit.json")]) == 0
    assert capsys.readouterr().out.encode("utf-8") == _markdown("early-exit-cpu/early_exit.json")


def test_render_of_a_missing_or_broken_file_is_one_error(tmp_path, capsys):
    from dyncompile.tools.cli import main

    assert main(["bench", "peers", "--render", str(tmp_path / "none.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --render ") and "no such file" in err and err.count("\n") == 1
    (tmp_path / "bad.json").write_text("[1, 2]")
    assert main(["bench", "classify", "--render", str(tmp_path / "bad.json")]) == 2
    assert "not a JSON report" in capsys.readouterr().err
