"""``dyncompile bench``: explicit harness subcommands, or the harness of the plan's kind read from plan.json (never
from the flags on the command line)."""

from __future__ import annotations

import json
import sys
import types

import pytest
from helpers import assert_clean_error

from dyncompile.tools.bench import dispatch
from dyncompile.tools.cli import main


def _plan(tmp_path, name, task, kinds):
    d = tmp_path / name
    d.mkdir()
    (d / "plan.json").write_text(json.dumps({"format": "dyncompile.plan/v1", "task": task,
                                             "steps": [{"kind": k, "params": {}} for k in kinds]}))
    return d


@pytest.fixture
def recorded(monkeypatch):
    """Every harness replaced by one that records the argv it was given."""
    calls = []
    fakes = {}
    for name in dispatch.HARNESSES:
        mod = types.ModuleType(f"fake_bench_{name}")
        mod.main = lambda argv, name=name: calls.append((name, list(argv))) or 0
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
        fakes[name] = (mod.__name__, dispatch.HARNESSES[name][1])
    monkeypatch.setattr(dispatch, "HARNESSES", fakes)
    return calls


def test_the_plan_kind_picks_the_harness(tmp_path):
    assert dispatch.harness_for_plan(_plan(tmp_path, "c", "text-classification", ["run_model"])) == "classify"
    assert dispatch.harness_for_plan(_plan(tmp_path, "s", "text-classification", ["early_exit_staged"])) == "classify"
    assert dispatch.harness_for_plan(_plan(tmp_path, "g", "text-generation", ["speculative_generate"])) == "generate"
    assert dispatch.harness_for_plan(_plan(tmp_path, "r", "text-classification", ["cascade"])) == "route"
    assert dispatch.harness_for_plan(_plan(tmp_path, "rg", "text-generation", ["route"])) == "route"


def test_plan_form_passes_every_argument_to_the_plan_kinds_harness(tmp_path, recorded):
    gen = _plan(tmp_path, "g", "text-generation", ["generate"])
    cls = _plan(tmp_path, "c", "text-classification", ["run_model"])
    # the flags do not choose: --data on a decoder plan still goes to the generate harness (which refuses it)
    assert main(["bench", str(gen), "--data", "x.jsonl"]) == 0
    assert main(["bench", str(cls), "--prompts", "p.jsonl", "--peers", "ortgenai"]) == 0
    assert main(["bench", "peers", str(cls), "--prompts", "p.jsonl"]) == 0
    assert recorded == [("generate", [str(gen), "--data", "x.jsonl"]),
                        ("classify", [str(cls), "--prompts", "p.jsonl", "--peers", "ortgenai"]),
                        ("peers", [str(cls), "--prompts", "p.jsonl"])]


def test_generate_hands_peers_runs_to_the_peers_harness(monkeypatch):
    from dyncompile.tools.bench import generate, peers

    seen = []
    monkeypatch.setattr(peers, "main", lambda argv: seen.append(list(argv)) or 0)
    assert generate.main(["plan/", "--prompts", "p.jsonl", "--peers", "none"]) == 0
    assert seen == [["plan/", "--prompts", "p.jsonl", "--peers", "none"]]


def test_bench_without_a_plan_or_harness_is_one_error(tmp_path, capsys):
    rc = main(["bench", "--data", "x.jsonl"])
    assert_clean_error(rc, capsys.readouterr().err, "give a harness", "--data")
    rc = main(["bench", str(tmp_path), "--data", "x.jsonl"])
    assert_clean_error(rc, capsys.readouterr().err, "not a plan folder", "dyncompile bench {")
    (tmp_path / "plan.json").write_text("{not json")
    rc = main(["bench", str(tmp_path)])
    assert_clean_error(rc, capsys.readouterr().err, "not readable JSON")
    img = _plan(tmp_path, "img", "text-to-image", ["denoise"])
    rc = main(["bench", str(img), "--data", "x.jsonl"])
    assert_clean_error(rc, capsys.readouterr().err, "text-to-image plan", "dyncompile.tools.studies.stepsaver")


def test_bench_help_lists_every_harness(capsys):
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in dispatch.HARNESSES) and "current directory" in out
    assert main(["bench"]) == 2  # no arguments: the help, as a usage error


@pytest.mark.parametrize("name", ["classify", "generate", "peers", "route", "quality"])
def test_each_harness_has_its_own_help(name, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", name, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: dyncompile bench {name} ") and "--render JSON" in out
    assert "--report-dir" in out or name == "route"


def test_classifier_plan_bench_writes_in_the_current_directory_and_rerenders(tmp_path, monkeypatch, capsys):
    """``dyncompile bench PLAN --data`` on a classifier plan: the classify harness, its report in the current
    directory (no --report-dir), and ``--render`` of that JSON prints the markdown it wrote."""
    from hostile_plans import classifier_dir, run_model_plan

    plan = run_model_plan(classifier_dir(tmp_path / "m"), tmp_path / "tiny-plan")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"w{i} w{i + 1} w{i + 2}", "label": i % 2}) + "\n" for i in range(12)))
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    assert main(["bench", str(plan), "--data", str(data), "--batch1-rows", "4", "--batch-size", "4", "-q"]) == 0
    capsys.readouterr()
    assert sorted(p.name for p in work.iterdir()) == ["tiny-plan.json", "tiny-plan.md"]
    report = json.loads((work / "tiny-plan.json").read_text())
    assert [r["name"] for r in report["results"]] == ["original", "compiled"]
    assert report["results"][1]["batch1"]["agreement"] == 100.0  # verify,cleanup reproduces the original
    assert main(["bench", "classify", "--render", str(work / "tiny-plan.json")]) == 0
    assert capsys.readouterr().out == (work / "tiny-plan.md").read_text()
