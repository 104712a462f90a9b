"""Hostile inputs: plans and models from strangers, and every user mistake, end in one clear
``error:`` line with exit code 2 (or a documented safe behaviour) — no traceback, no code execution, no file
outside the output directory touched, the input model never modified.

Sections follow the issue's numbered items.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import onnx_ir as ir
import pytest
from helpers import DATA, assert_clean_error, run_cli
from hostile_plans import (
    LABELS,
    TEXT,
    classifier_dir,
    decoder_dir,
    generate_plan,
    read_plan,
    rehash,
    run_model_plan,
    staged_plan,
    tree_state,
    write_plan,
)

import dyncompile
from dyncompile.errors import OutputExistsError, PassConfigError, PlanError


def sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture(scope="module")
def built(module_tmp):
    """Pristine plans, built once: classifier (run_model, with provenance), staged, generate, speculative."""
    root = module_tmp("hostile")
    cls_model = classifier_dir(root / "cls")
    dec_model = decoder_dir(root / "dec")
    return {
        "cls_model": cls_model,
        "dec_model": dec_model,
        "cls": run_model_plan(cls_model, root / "plan-cls"),
        "staged": staged_plan(root / "plan-staged"),
        "gen": generate_plan(dec_model, root / "plan-gen"),
        "spec": generate_plan(dec_model, root / "plan-spec", speculative=True),
    }


@pytest.fixture
def plan_copy(built, tmp_path):
    """``plan_copy(name)``: a private copy of a built plan to mutate."""

    def make(name):
        dst = tmp_path / name
        shutil.copytree(built[name], dst)
        return dst

    return make


@pytest.fixture
def model_copy(built, tmp_path):
    """A private copy of the tiny classifier's model directory (model, tokenizer, config)."""
    dst = tmp_path / "model"
    shutil.copytree(built["cls_model"].parent, dst)
    return dst / "model.onnx"


# ------------------------------------------------------------------------------------------- chat template


def test_chat_template_cannot_execute_code(plan_copy, capsys, tmp_path):
    plan = plan_copy("gen")
    marker = tmp_path / "PWNED"
    raw = read_plan(plan)
    raw["steps"][0]["generation"]["chat_template"] = (
        "{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}"
    )
    write_plan(plan, raw)
    rc, out, err = run_cli(capsys, "run", plan, "--prompt", "w3 w4", "--chat", "--max-new-tokens", "2")
    assert not marker.exists(), "the chat template ran a shell command"
    assert_clean_error(rc, err, "template")


# ------------------------------------------------------------------------------------------- --force


def _compile_args(model, out, *extra):
    return (model, "--passes", "verify", "-o", out, "-q", *extra)


def test_force_refuses_an_unrelated_directory(model_copy, tmp_path, capsys):
    victim = tmp_path / "photos"
    victim.mkdir()
    (victim / "holiday.jpg").write_bytes(b"precious")
    before = tree_state(tmp_path)
    rc, _, err = run_cli(capsys, *_compile_args(model_copy, victim, "--force"))
    assert_clean_error(rc, err, str(victim), "not a dyncompile plan", "--force")
    assert tree_state(tmp_path) == before


def test_force_refuses_an_ancestor_of_the_input_model(built, tmp_path, capsys):
    model_dir = tmp_path / "a" / "b"
    shutil.copytree(built["cls_model"].parent, model_dir)
    model = model_dir / "model.onnx"
    before = tree_state(tmp_path)
    for target in (tmp_path / "a", model_dir):
        rc, _, err = run_cli(capsys, *_compile_args(model, target, "--force"))
        assert rc == 2 and "Traceback" not in err and err.startswith("error: "), err
    assert tree_state(tmp_path) == before


def test_force_refuses_the_working_directory(model_copy, tmp_path, capsys, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    before = tree_state(tmp_path)
    rc, _, err = run_cli(capsys, *_compile_args(model_copy, ".", "--force"))
    assert_clean_error(rc, err, "working directory")
    assert tree_state(tmp_path) == before


def test_force_refuses_a_plan_with_foreign_files(model_copy, tmp_path, capsys):
    out = tmp_path / "out"
    assert run_cli(capsys, *_compile_args(model_copy, out))[0] == 0
    (out / "thesis.tex").write_text("not the plan's")
    rc, _, err = run_cli(capsys, *_compile_args(model_copy, out, "--force"))
    assert_clean_error(rc, err, "thesis.tex")
    assert (out / "thesis.tex").read_text() == "not the plan's"


def test_force_replaces_a_plan_or_an_empty_directory(model_copy, tmp_path, capsys):
    model_sha = sha(model_copy)
    out = tmp_path / "out"
    assert run_cli(capsys, *_compile_args(model_copy, out))[0] == 0
    first = sha(out / "plan.json")
    rc, _, err = run_cli(capsys, *_compile_args(model_copy, out))  # no --force: refused
    assert_clean_error(rc, err, "already exists", "--force")
    assert sha(out / "plan.json") == first
    os.utime(out / "plan.json", (1_000_000, 1_000_000))  # mark the old plan (its content may repeat within a second)
    rc, _, err = run_cli(capsys, *_compile_args(model_copy, out, "--force"))
    assert rc == 0, err
    assert (out / "plan.json").stat().st_mtime > 1_000_000  # a new plan file in place of the old one
    dyncompile.load(out)  # and a whole, hash-consistent plan
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_cli(capsys, *_compile_args(model_copy, empty, "--force"))[0] == 0
    assert dyncompile.load(empty)([TEXT])[0].label in LABELS
    assert sha(model_copy) == model_sha
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


# ------------------------------------------------------------------------------------------- concurrent compiles


def _fake_plan(directory, marker):
    directory.mkdir()
    (directory / "plan.json").write_text(json.dumps({"format": "dyncompile.plan/v1", "files": {}, "who": marker}))


def test_target_appearing_meanwhile_is_not_overwritten(tmp_path):
    from dyncompile.io import atomic_output_dir

    out = tmp_path / "out"
    with pytest.raises(OutputExistsError, match="already exists"):
        with atomic_output_dir(out) as tmp:
            (tmp / "plan.json").write_text("{}")
            _fake_plan(out, "the other compile")  # another compile finished first
    assert json.loads((out / "plan.json").read_text())["who"] == "the other compile"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging left behind


def test_with_force_a_plan_that_appeared_is_replaced_but_nothing_else(tmp_path):
    from dyncompile.io import atomic_output_dir

    out = tmp_path / "out"
    with atomic_output_dir(out, force=True) as tmp:
        (tmp / "plan.json").write_text(json.dumps({"format": "dyncompile.plan/v1", "who": "me"}))
        _fake_plan(out, "the other compile")
    assert json.loads((out / "plan.json").read_text())["who"] == "me"
    out2 = tmp_path / "out2"
    with pytest.raises(OutputExistsError, match="not a dyncompile plan"):
        with atomic_output_dir(out2, force=True) as tmp:
            (tmp / "plan.json").write_text("{}")
            out2.mkdir()
            (out2 / "data.csv").write_text("user data")
    assert (out2 / "data.csv").read_text() == "user data"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "out2"]


def test_rename_noreplace_never_replaces(tmp_path):
    from dyncompile.io import rename_noreplace

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()  # an *empty* directory: plain rename(2) would silently replace it
    with pytest.raises(FileExistsError):
        rename_noreplace(a, b)
    assert a.is_dir() and b.is_dir()
    rename_noreplace(a, tmp_path / "c")
    assert (tmp_path / "c").is_dir() and not a.exists()


# ------------------------------------------------------------------------------------------- --compare / bench


def test_compare_checks_the_original_model(built, tmp_path, capsys):
    model_dir = tmp_path / "m"
    shutil.copytree(built["cls_model"].parent, model_dir)
    model = model_dir / "model.onnx"
    plan = tmp_path / "plan"
    assert run_cli(capsys, *_compile_args(model, plan))[0] == 0
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"w{i} w{i + 1}", "label": i % 2}) + "\n" for i in range(8)))
    rc, out, err = run_cli(capsys, "run", plan, "--data", data, "--compare")
    assert rc == 0 and "vs original" in out, err
    other = tmp_path / "other.onnx"
    from dyncompile.models.synthetic import tiny_encoder_classifier

    ir.save(tiny_encoder_classifier(num_layers=4, seed=7), other)
    shutil.copyfile(other, model)  # a different model at the recorded path
    for argv in (("run", plan, "--data", data, "--compare"), ("bench", plan, "--data", data, "--report-dir", tmp_path)):
        rc, _, err = run_cli(capsys, *argv)
        assert_clean_error(rc, err, str(model), "not the model this plan was compiled from")
    model.unlink()
    rc, _, err = run_cli(capsys, "run", plan, "--data", data, "--compare")
    assert_clean_error(rc, err, str(model), "not there any more")


# ------------------------------------------------------------------------------------------- tokenizer at load


def test_tokenizer_swapped_after_load_is_not_used(plan_copy):
    plan = plan_copy("cls")
    cm = dyncompile.load(plan)
    before = cm.predict_proba([TEXT, "w100 w200 w300"])
    from tokenizers import Tokenizer, models, pre_tokenizers

    evil = Tokenizer(models.WordLevel({"[PAD]": 0, "w1": 1}, unk_token="w1"))
    evil.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    evil.save(str(plan / "tokenizer.json"))
    np.testing.assert_array_equal(cm.predict_proba([TEXT, "w100 w200 w300"]), before)
    with pytest.raises(PlanError, match="modified after compile"):
        dyncompile.load(plan)


def test_generation_tokenizer_is_read_at_load(built, plan_copy):
    reference = dyncompile.load(built["gen"]).generate("w3 w4", max_new_tokens=4)
    plan = plan_copy("gen")
    cm = dyncompile.load(plan)
    (plan / "tokenizer.json").write_text("{}")  # swapped (not even a tokenizer) after load, before first use
    res = cm.generate("w3 w4", max_new_tokens=4)
    assert res.prompt_ids == reference.prompt_ids and res.token_ids == reference.token_ids
    assert res.text == reference.text


# ------------------------------------------------------------------------------------------- plan.json mistakes


def _mutate(plan, fn):
    raw = read_plan(plan)
    fn(raw)
    write_plan(plan, raw)
    return plan


GEN_MUTATIONS = {
    "max_length as a string": lambda r: r["steps"][0]["generation"].update(max_length="512"),
    "max_length negative": lambda r: r["steps"][0]["generation"].update(max_length=-5),
    "max_length NaN": lambda r: r["steps"][0]["generation"].update(max_length=float("nan")),
    "eos as text": lambda r: r["steps"][0]["generation"].update(eos_token_ids=["</s>"]),
    "target missing": lambda r: r["steps"][0].pop("target"),
    "target kv missing": lambda r: r["steps"][0]["target"].pop("kv"),
    "kv entry without past": lambda r: r["steps"][0]["target"]["kv"][0].pop("past"),
    "kv shape huge": lambda r: r["steps"][0]["target"]["kv"][0].update(shape=[10**9, 10**9]),
    "target is a list": lambda r: r["steps"][0].update(target=[1, 2]),
    "target names no file": lambda r: r["steps"][0]["target"].update(model="nope"),
    "kind as a list": lambda r: r["steps"][0].update(kind=["generate"]),
    "unknown step field": lambda r: r["steps"][0].update(temprature=0.5),
    "steps empty": lambda r: r.update(steps=[]),
    "rollback unknown": lambda r: r["steps"][0].update(rollback="undo"),
    "tokenizer max_length zero": lambda r: r["tokenizer"].update(max_length=0),
}


@pytest.mark.parametrize("what", list(GEN_MUTATIONS))
def test_generation_plan_mistakes_are_clean_errors(plan_copy, capsys, what):
    plan = _mutate(plan_copy("gen"), GEN_MUTATIONS[what])
    rc, _, err = run_cli(capsys, "run", plan, "--prompt", "w3 w4", "--max-new-tokens", "2")
    assert_clean_error(rc, err, "plan.json")


SPEC_MUTATIONS = {
    "drafter kind unknown": lambda r: r["steps"][0]["drafter"].update(kind="oracle"),
    "ngram zero": lambda r: r["steps"][0]["drafter"].update(max_ngram=0),
    "draft max a string": lambda r: r["steps"][0]["draft"].update(max="8"),
    "draft min > max": lambda r: r["steps"][0]["draft"].update(min=9, max=2),
    "alpha0 inf": lambda r: r["steps"][0]["draft"].update(alpha0=float("inf")),
    "verify cost key": lambda r: r["steps"][0]["draft"].update(verify_cost={"x": 1.0}),
    "eagle drafter without decoder": lambda r: r["steps"][0]["drafter"].update(kind="eagle"),
    "eagle drafter without feature names": lambda r: r["steps"][0]["drafter"].update(
        kind="eagle", decoder=dict(r["steps"][0]["target"])),
    "eagle drafter sharing kv": lambda r: r["steps"][0]["drafter"].update(
        kind="eagle", decoder=dict(r["steps"][0]["target"]), features="f", feature_input="fi", hidden_output="h",
        share_kv=[0] * len(r["steps"][0]["target"]["kv"])),
    "tree nodes zero": lambda r: r["steps"][0]["draft"].update(tree={"max_nodes": 0}),
    "tree unknown field": lambda r: r["steps"][0]["draft"].update(tree={"width": 3}),
    "tree a list": lambda r: r["steps"][0]["draft"].update(tree=[16, 8]),
    "tree branching a string": lambda r: r["steps"][0]["draft"].update(tree={"branching": "3"}),
    "attention bias not a string": lambda r: r["steps"][0]["target"].update(attention_bias=7),
    "kv buffer unknown": lambda r: r["steps"][0]["target"].update(kv_buffer="mmap"),
}


@pytest.mark.parametrize("what", list(SPEC_MUTATIONS))
def test_speculative_plan_mistakes_are_clean_errors(plan_copy, capsys, what):
    plan = _mutate(plan_copy("spec"), SPEC_MUTATIONS[what])
    rc, _, err = run_cli(capsys, "run", plan, "--prompt", "w3 w4", "--max-new-tokens", "2")
    assert_clean_error(rc, err, "plan.json")


STAGED_MUTATIONS = {
    "segments missing": lambda r: r["steps"][0].pop("segments"),
    "segments a dict": lambda r: r["steps"][0].update(segments={"a": 1}),
    "segment without model": lambda r: r["steps"][0]["segments"][0].pop("model"),
    "layer as text": lambda r: r["steps"][0]["segments"][0].update(layer="one"),
    "patience zero": lambda r: r["steps"][0].update(patience=0),
    "last segment has a head": lambda r: r["steps"][0]["segments"][-1].update(head="x"),
    "output missing": lambda r: r["steps"][0].pop("output"),
}


@pytest.mark.parametrize("what", list(STAGED_MUTATIONS))
def test_staged_plan_mistakes_are_clean_errors(plan_copy, capsys, what):
    plan = _mutate(plan_copy("staged"), STAGED_MUTATIONS[what])
    rc, _, err = run_cli(capsys, "run", plan, "--text", TEXT)
    assert_clean_error(rc, err, "plan.json")


def test_deeply_nested_plan_json(plan_copy, capsys):
    plan = plan_copy("cls")
    text = (plan / "plan.json").read_text()
    for depth in (100, 100_000):
        (plan / "plan.json").write_text(text.replace('"provenance": {', '"provenance": {"x": ' + "[" * depth + "]" * depth + ", ", 1))
        rc, _, err = run_cli(capsys, "run", plan, "--text", TEXT)
        assert_clean_error(rc, err, "nested too deeply")


def test_ort_session_failure_is_a_clean_error(plan_copy, capsys):
    plan = plan_copy("cls")
    (plan / "model.onnx").write_bytes(b"\x08\x07" + b"garbage" * 100)  # a publisher shipping a broken model
    rehash(plan, "model")
    rc, _, err = run_cli(capsys, "run", plan, "--text", TEXT)
    assert_clean_error(rc, err, "model.onnx", "ONNX Runtime")


def test_plan_inputs_disagreeing_with_the_model(plan_copy, capsys):
    plan = _mutate(plan_copy("cls"), lambda r: r["inputs"][0].update(name="token_ids"))
    rc, _, err = run_cli(capsys, "run", plan, "--text", TEXT)
    assert_clean_error(rc, err, "input_ids", "recompile")


def test_invalid_utf8_data_and_calib(built, model_copy, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "ok", "label": 1}\n{"text": "caf\xe9"}\n')
    rc, _, err = run_cli(capsys, "run", built["cls"], "--data", bad)
    assert_clean_error(rc, err, "bad.jsonl:2", "UTF-8")
    rc, _, err = run_cli(capsys, *_compile_args(model_copy, tmp_path / "ee"), "--passes", "early-exit",
                         "--calib", bad)
    assert_clean_error(rc, err, "bad.jsonl:2", "UTF-8")
    assert not (tmp_path / "ee").exists()


@pytest.mark.parametrize("flag", ["--batch-size", "--limit"])
def test_zero_batch_size_and_limit(built, capsys, flag):
    rc, _, err = run_cli(capsys, "run", built["cls"], "--data", DATA / "movie-test.jsonl", flag, "0")
    assert_clean_error(rc, err, flag)


# ------------------------------------------------------------------------------------------- policy values, pass options

THRESHOLDS = {"NaN": float("nan"), "-inf": float("-inf"), "+inf": float("inf"), "negative entropy": -0.5, "text": "0.5"}


@pytest.mark.parametrize("what", list(THRESHOLDS))
def test_bad_thresholds_are_refused(plan_copy, capsys, what):
    plan = _mutate(plan_copy("staged"), lambda r: r["steps"][0]["segments"][0].update(threshold=THRESHOLDS[what]))
    rc, _, err = run_cli(capsys, "run", plan, "--text", TEXT)
    assert_clean_error(rc, err, "segments[0].threshold")


def test_probability_threshold_above_one_is_refused(plan_copy, capsys):
    def bump(r):
        r["steps"][0]["criterion"] = "maxprob"
        for s in r["steps"][0]["segments"][:-1]:
            s["threshold"] = 1.5
    plan = _mutate(plan_copy("staged"), bump)
    rc, _, err = run_cli(capsys, "run", plan, "--text", TEXT)
    assert_clean_error(rc, err, "[0, 1]")


POLICY_MUTATIONS = {
    "unknown criterion": (lambda r: r["steps"][0].update(criterion="vibes"), "entropy"),
    "policy criterion unknown": (lambda r: r["policy"]["early_exit"].update(criterion="vibes"), "entropy"),
    "policy threshold NaN": (lambda r: r["policy"]["early_exit"]["thresholds"].update({"1": float("nan")}), "finite"),
    "labels as a string": (lambda r: r.update(labels="negative,positive"), "labels"),
    "labels with numbers": (lambda r: r.update(labels=[0, 1]), "labels"),
    "pooling mode unknown": (lambda r: r["policy"].update(pooling={"mode": "median"}), "policy.pooling.mode"),
    "pooling field unknown": (lambda r: r["policy"].update(pooling={"mode": "mean", "pca": 3}), "policy.pooling"),
}


@pytest.mark.parametrize("what", list(POLICY_MUTATIONS))
def test_bad_policy_values_are_refused(plan_copy, capsys, what):
    fn, needle = POLICY_MUTATIONS[what]
    plan = _mutate(plan_copy("staged"), fn)
    rc, _, err = run_cli(capsys, "run", plan, "--text", TEXT)
    assert_clean_error(rc, err, needle)


@pytest.mark.parametrize(
    ("spec", "needles"),
    [
        ("cleanup{cse=maybe}", ["cse", "true or false"]),
        ("cleanup{cse=1}", ["cse", "true or false"]),
        ("early-exit{budjet=2}", ["budjet", "budget", "lowering"]),
        ("verify{colour=red}", ["colour", "full_check"]),
        ("quantize-int8{format=fp8}", ["fp8", "dynamic", "static", "qdq-weights"]),
        ("quantize-int4{block_size=nan}", ["block_size", "int"]),
        ("early-exit{lowering=sideways}", ["sideways", "staged"]),
        ("split-drafter{bridge=quadratic}", ["quadratic", "linear"]),
        ("speculative{draft_length=many}", ["draft_length", "int"]),
        ("speculative{tree=maybe}", ["tree", "true or false"]),
        ("explicit-attention{mask=4d}", ["mask", "input_name"]),
        ("fuse-decoder{max_positions=long}", ["max_positions", "int"]),
    ],
)
def test_unknown_or_ill_typed_pass_options(model_copy, tmp_path, capsys, spec, needles):
    before = tree_state(tmp_path)
    rc, _, err = run_cli(capsys, model_copy, "--passes", spec, "-o", tmp_path / "out", "--calib",
                         DATA / "movie-calib.jsonl", "-q")
    assert_clean_error(rc, err, *needles)
    assert tree_state(tmp_path) == before


def test_pass_order_is_checked_before_the_model_loads(tmp_path, capsys):
    rc, _, err = run_cli(capsys, tmp_path / "missing.onnx", "--passes", "quantize-int4,split-drafter,speculative",
                         "--calib", DATA / "movie-calib.jsonl", "-o", tmp_path / "out")
    assert_clean_error(rc, err, "split-drafter", "before", "quantize-int4")


def test_factory_with_kwargs_is_rejected_at_registration():
    from dyncompile.passes._infra import PASS_REGISTRY, register_pass

    def loose(context, **opts):  # pragma: no cover - never called
        raise AssertionError

    def untyped(context, level=1):  # pragma: no cover - never called
        raise AssertionError

    for factory, needle in ((loose, r"\*\*opts"), (untyped, "type annotation")):
        with pytest.raises(TypeError, match=needle):
            register_pass("test-loose-pass", help="x")(factory)
        assert "test-loose-pass" not in PASS_REGISTRY


def test_pass_option_types_come_from_the_factory():
    from dyncompile.passes import build_passes

    (q,) = build_passes("quantize-int4{accuracy_level=none,block_size=64,symmetric=false}")
    assert (q.accuracy_level, q.block_size, q.symmetric) == (None, 64, False)
    with pytest.raises(PassConfigError, match="given twice"):
        build_passes("cleanup{cse=true,cse=false}")


def test_unknown_compile_option_is_an_error(model_copy, tmp_path):
    with pytest.raises(PassConfigError, match="budjet.*valid options"):
        dyncompile.compile(model_copy, "verify", tmp_path / "out", budjet=2)


# ------------------------------------------------------------------------------------------- smaller items


def test_tokenizer_option_reaches_early_exit_and_split_drafter(built, tmp_path):
    from dyncompile.models.synthetic_decoder import write_word_tokenizer
    from dyncompile.passes import CompileContext, build_passes

    lonely = tmp_path / "m" / "model.onnx"  # no tokenizer.json beside it
    lonely.parent.mkdir()
    shutil.copyfile(built["cls_model"], lonely)
    tok = write_word_tokenizer(tmp_path / "tok", 16, eos=0)
    calib = tmp_path / "calib.txt"
    calib.write_text("w3 w4 w5 w6 " * 50)
    ctx = CompileContext(model_path=lonely, options={"calib": str(DATA / "movie-calib.jsonl")}, tokenizer=tok)
    fit = build_passes("early-exit", ctx)[0]
    assert fit.tokenizer_file == tok
    ctx = CompileContext(model_path=lonely, options={"calib": str(calib)}, tokenizer=tok, progress=False)
    (sd,) = build_passes("split-drafter", ctx)
    assert sd.calib_ids[0][:4] == [3, 4, 5, 6]  # tokenized with --tokenizer's word ids
    ctx = CompileContext(model_path=lonely, options={"calib": str(calib)})
    with pytest.raises(dyncompile.errors.DyncompileError, match="--tokenizer"):
        build_passes("split-drafter", ctx)


def test_stale_staging_folders_are_cleaned_and_nothing_else(model_copy, tmp_path, capsys):
    from dyncompile.io import STAGING_MARK

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / ".out.tmp-kill9"
    stale.mkdir()
    (stale / STAGING_MARK).write_text(f"{dead.pid} {os.uname().nodename}\n")
    (stale / "model.onnx").write_bytes(b"x" * 1000)  # a half-written copy of the model
    alive = tmp_path / ".out.tmp-running"  # a compile still running (this process)
    alive.mkdir()
    (alive / STAGING_MARK).write_text(f"{os.getppid()} {os.uname().nodename}\n")
    lookalike = tmp_path / ".out.tmp-mine"  # not dyncompile's: no mark
    lookalike.mkdir()
    (lookalike / "keep.txt").write_text("keep")
    assert run_cli(capsys, *_compile_args(model_copy, tmp_path / "out"))[0] == 0
    assert not stale.exists()
    assert alive.is_dir() and (lookalike / "keep.txt").read_text() == "keep"


def test_pass_temp_files_stay_inside_the_staging_folder(model_copy, tmp_path):
    seen = []

    class TempUser(ir.passes.InPlacePass):
        def call(self, model):
            seen.append(tempfile.mkdtemp())  # e.g. ORT's quantizer copying the model
            return ir.passes.PassResult(model, modified=False)

    out = tmp_path / "out"
    dyncompile.compile(model_copy, [TempUser()], out, progress=False)
    (made,) = seen
    assert made.startswith(str(tmp_path / ".out.tmp-")), made
    assert not os.path.exists(made)
    assert tempfile.gettempdir() != os.path.dirname(made)  # tempfile restored afterwards


def test_plan_strings_are_printed_without_terminal_escapes(plan_copy, capsys):
    plan = _mutate(plan_copy("cls"), lambda r: r.update(labels=["\x1b[2J\x1b]0;pwned\x07neg", "pos\x1b[31m"]))
    rc, out, err = run_cli(capsys, "run", plan, "--text", TEXT, "--text", "evil\x1b[1A")
    assert rc == 0, err
    assert "\x1b" not in out and "\x07" not in out
    assert "\\x1b[2J" in out or "\\x1b[31m" in out
    rc, out, err = run_cli(capsys, "inspect", plan)
    assert rc == 0 and "\x1b" not in out


def test_oversized_plan_json(plan_copy, capsys):
    plan = plan_copy("cls")
    raw = read_plan(plan)
    raw["provenance"]["padding"] = "x" * (17 * 2**20)
    write_plan(plan, raw)
    rc, _, err = run_cli(capsys, "run", plan, "--text", TEXT)
    assert_clean_error(rc, err, "MiB")


def test_run_on_an_onnx_model(built, capsys):
    rc, _, err = run_cli(capsys, "run", built["cls_model"], "--text", TEXT)
    assert_clean_error(rc, err, "ONNX model", "not a plan", "compile it first")


def test_labels_outside_the_label_set(built, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": TEXT, "label": 1}) + "\n" + json.dumps({"text": TEXT, "label": 7}) + "\n")
    rc, _, err = run_cli(capsys, "run", built["cls"], "--data", data)
    assert_clean_error(rc, err, "label 7", "negative, positive")


def test_compile_refuses_a_custom_domain_op(model_copy, tmp_path, capsys):
    m = ir.load(str(model_copy))
    node = next(n for n in m.graph if n.op_type == "Relu")
    node.domain = "com.evil"
    m.opset_imports["com.evil"] = 1
    bad = model_copy.parent / "custom.onnx"
    ir.save(m, bad)
    rc, _, err = run_cli(capsys, bad, "--passes", "cleanup", "-o", tmp_path / "out", "-q")
    assert_clean_error(rc, err, "com.evil", "Relu")
    assert not (tmp_path / "out").exists()


def test_compile_refuses_a_non_tokenizer(model_copy, tmp_path, capsys):
    not_tok = tmp_path / "tokenizer.json"
    not_tok.write_text(json.dumps({"hello": "world"}))
    rc, _, err = run_cli(capsys, *_compile_args(model_copy, tmp_path / "out", "--tokenizer", not_tok))
    assert_clean_error(rc, err, str(not_tok), "tokenizer")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------- whole-plan digest


def test_inspect_verify_prints_one_digest_of_the_whole_plan(plan_copy, tmp_path, capsys):
    plan = plan_copy("staged")
    rc, out, err = run_cli(capsys, "inspect", "--verify", plan)
    assert rc == 0, err
    digest = out.split()[0]
    assert len(digest) == 64 and int(digest, 16) >= 0
    moved = tmp_path / "elsewhere"
    shutil.copytree(plan, moved)
    assert run_cli(capsys, "inspect", "--verify", moved)[1].split()[0] == digest  # location-independent
    _mutate(moved, lambda r: r["steps"][0]["segments"][0].update(threshold=0.01))  # only plan.json changed
    assert run_cli(capsys, "inspect", "--verify", moved)[1].split()[0] != digest
    (plan / "segment1.onnx").write_bytes((plan / "segment1.onnx").read_bytes() + b"\0")
    rc, _, err = run_cli(capsys, "inspect", "--verify", plan)
    assert_clean_error(rc, err, "segment1", "modified after compile")


# ------------------------------------------------------------------------------------------- model config from a stranger

MODEL_CONFIG_MUTATIONS = {
    "labels as a string": ("labels", "negative,positive"),
    "max_length as text": ("max_length", "64"),
    "max_length negative": ("max_length", -1),
    "eos as text": ("eos_token_id", "</s>"),
    "hf_dir a number": ("hf_dir", 7),
}


@pytest.mark.parametrize("what", list(MODEL_CONFIG_MUTATIONS))
def test_bad_model_config_is_refused_at_compile(model_copy, tmp_path, capsys, what):
    key, value = MODEL_CONFIG_MUTATIONS[what]
    cfg_path = model_copy.parent / "dyncompile-model.json"
    cfg = json.loads(cfg_path.read_text())
    cfg[key] = value
    cfg_path.write_text(json.dumps(cfg))
    before = tree_state(tmp_path)
    rc, _, err = run_cli(capsys, *_compile_args(model_copy, tmp_path / "out"))
    assert_clean_error(rc, err, "dyncompile-model.json", key)
    assert tree_state(tmp_path) == before


def test_labels_not_matching_the_model_outputs(plan_copy, capsys):
    plan = _mutate(plan_copy("cls"), lambda r: r.update(labels=["negative", "neutral", "positive"]))
    rc, _, err = run_cli(capsys, "run", plan, "--text", TEXT)
    assert_clean_error(rc, err, "labels lists 3 classes", "has 2")


@pytest.mark.parametrize("label", [1.5, True, "maybe"])
def test_data_labels_of_the_wrong_type(built, tmp_path, capsys, label):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": TEXT, "label": label}) + "\n")
    rc, _, err = run_cli(capsys, "run", built["cls"], "--data", data)
    assert_clean_error(rc, err, "label")


# ------------------------------------------------------------------------------------------- more CLI mistakes


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (("run", "{cls}", "--text", ""), "no tokens"),
        (("run", "{gen}", "--text", TEXT), "classifiers"),
        (("run", "{gen}", "--prompt", "w3", "--max-new-tokens", "-1"), "max_new_tokens"),
        (("run", "{gen}", "--prompt", "w3", "--sample", "--temperature", "nan"), "temperature"),
        (("run", "{cls}", "--data", "{tmp}"), "directory"),
        (("{cls_model}", "-o", "/proc/dyncompile-nope/out", "-q"), "cannot access"),
        (("{cls_model}", "--passes", "quantize-int4{block_size=0}", "-o", "{tmp}/o", "-q"), "block_size"),
        (("{cls_model}", "--passes", "fuse-decoder{max_positions=-1}", "-o", "{tmp}/o", "-q"), "max_positions"),
        (("{cls_model}", "--passes", "early-exit", "--calib", DATA / "movie-calib.jsonl", "--budget", "nan",
          "-o", "{tmp}/o", "-q"), "budget"),
        (("{cls_model}", "--passes", "early-exit", "--calib", DATA / "movie-calib.jsonl", "--batch-sizes", "1,0",
          "-o", "{tmp}/o", "-q"), "--batch-sizes"),
        (("{cls_model}", "--passes", "verify", "--provider", "tpu", "-o", "{tmp}/o", "-q"), "provider"),
        (("inspect", "{tokenizer}"), "not a valid ONNX model"),
        (("{tokenizer}", "-o", "{tmp}/o"), "not a valid ONNX model"),
    ],
)
def test_cli_mistakes_are_one_clear_line(built, tmp_path, capsys, argv, needle):
    subst = {"{cls}": built["cls"], "{gen}": built["gen"], "{cls_model}": built["cls_model"], "{tmp}": tmp_path,
             "{tokenizer}": built["cls_model"].parent / "tokenizer.json"}
    args = []
    for a in argv:
        a = str(a)
        for k, v in subst.items():
            a = a.replace(k, str(v))
        args.append(a)
    before = tree_state(built["cls_model"].parent)
    rc, _, err = run_cli(capsys, *args)
    assert_clean_error(rc, err, needle)
    assert tree_state(built["cls_model"].parent) == before
    assert not (tmp_path / "o").exists()


def test_two_concurrent_compiles_to_one_output(model_copy, tmp_path):
    """Two real compiles race for one -o: whatever the timing, one writes the plan, the other fails cleanly."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    cmd = [sys.executable, "-c", "import sys; from dyncompile.tools.cli import main; sys.exit(main(sys.argv[1:]))",
           str(model_copy), "--passes", "verify,cleanup", "-o", str(out), "-q"]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    assert sorted(rc for rc, _ in results) == [0, 2], results
    (err,) = [e for rc, e in results if rc == 2]
    assert "Traceback" not in err and err.strip().startswith("error: ")
    assert "already exists" in err or "meanwhile" in err, err
    assert dyncompile.load(out)([TEXT])[0].label in LABELS
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "out"]


# ------------------------------------------------------------------------------------------- export-genai


def test_export_genai_refuses_bad_plans(built, plan_copy, tmp_path, capsys):
    """A classifier plan, a tampered model file and KV names without one per-layer pattern: one clean error each,
    and no output folder."""
    rc, _, err = run_cli(capsys, "export-genai", built["cls"], "-o", tmp_path / "a")
    assert_clean_error(rc, err, "text-generation")
    spec = plan_copy("spec")
    with open(spec / "model.onnx", "ab") as f:
        f.write(b"\0")
    rc, _, err = run_cli(capsys, "export-genai", spec, "-o", tmp_path / "b")
    assert_clean_error(rc, err, "model.onnx")
    gen = _mutate(plan_copy("gen"), lambda r: r["steps"][0]["target"]["kv"][2].update(past="cache_k_layer1"))
    rc, _, err = run_cli(capsys, "export-genai", gen, "-o", tmp_path / "c")
    assert_clean_error(rc, err, "cache_k_layer1", "pattern")
    assert not any((tmp_path / d).exists() for d in "abc")

# ------------------------------------------------------------------------------------------- routing and cascades


@pytest.fixture(scope="module")
def routed(built, module_tmp):
    """A cascade over two tiny classifier plans (``small``, ``big``) and its calibration file."""
    from hostile_plans import routed_plan, word_calib

    root = module_tmp("routed")
    small, big = root / "small", root / "big"
    shutil.copytree(built["cls"], small)
    shutil.copytree(built["cls"], big)
    calib = word_calib(root / "calib.jsonl")
    return {"root": root, "small": small, "big": big, "calib": calib,
            "plan": routed_plan([small, big], root / "routed", calib)}


@pytest.fixture
def routed_copy(routed, tmp_path):
    dst = tmp_path / "routed"
    shutil.copytree(routed["plan"], dst)  # a real copy: the routed folder's files are hard links of the sources
    return dst


def test_routed_plan_runs_and_names_the_candidate(routed, capsys):
    rc, out, err = run_cli(capsys, "run", routed["plan"], "--text", TEXT)
    assert rc == 0, err
    assert "answered by small" in out or "answered by big" in out


def test_candidates_with_different_label_sets(routed, tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(routed["big"], other)
    raw = read_plan(other)
    raw["labels"] = ["bad", "good"]
    write_plan(other, raw)
    rc, _, err = run_cli(capsys, "route", "--candidates", routed["small"], other, "--calib", routed["calib"], "-o",
                         tmp_path / "r", "-q")
    assert_clean_error(rc, err, "different label sets")
    assert not (tmp_path / "r").exists()


def test_candidates_with_different_tasks(built, routed, tmp_path, capsys):
    rc, _, err = run_cli(capsys, "route", "--candidates", routed["small"], built["gen"], "--calib", routed["calib"],
                         "-o", tmp_path / "r", "-q")
    assert_clean_error(rc, err, "different tasks")


def test_a_candidate_that_is_no_plan(routed, tmp_path, capsys):
    rc, _, err = run_cli(capsys, "route", "--candidates", routed["small"], tmp_path, "--calib", routed["calib"],
                         "-o", tmp_path / "r", "-q")
    assert_clean_error(rc, err, "not a plan")


def test_a_routed_plan_as_candidate(routed, tmp_path, capsys):
    rc, _, err = run_cli(capsys, "route", "--candidates", routed["plan"], routed["big"], "--calib", routed["calib"],
                         "-o", tmp_path / "r", "-q")
    assert_clean_error(rc, err, "itself a routed plan")


def test_calib_without_labels_when_labels_are_needed(routed, tmp_path, capsys):
    from hostile_plans import word_calib

    calib = word_calib(tmp_path / "nolabels.jsonl", labels=False)
    rc, _, err = run_cli(capsys, "route", "--candidates", routed["small"], routed["big"], "--calib", calib,
                         "--metric", "accuracy", "-o", tmp_path / "r", "-q", "--cost-rows", "1")
    assert_clean_error(rc, err, "'label'", "--metric agreement")
    rc, _, err = run_cli(capsys, "route", "--candidates", routed["small"], routed["big"], "--calib", calib,
                         "--rule", "check", "--check", "python-doctest", "-o", tmp_path / "r", "-q", "--cost-rows", "1")
    assert rc == 2 and "error:" in err and "Traceback" not in err


def test_calib_without_text(routed, tmp_path, capsys):
    calib = tmp_path / "c.jsonl"
    calib.write_text('{"sentence": "w1 w2", "label": 0}\n')
    rc, _, err = run_cli(capsys, "route", "--candidates", routed["small"], routed["big"], "--calib", calib,
                         "-o", tmp_path / "r", "-q")
    assert_clean_error(rc, err, "text")


def test_missing_subplan(routed_copy, capsys):
    shutil.rmtree(routed_copy / "candidates" / "big")
    rc, _, err = run_cli(capsys, "run", routed_copy, "--text", TEXT)
    assert_clean_error(rc, err, "sub-plan", "big", "missing")


def test_tampered_subplan_file(routed_copy, capsys):
    model = routed_copy / "candidates" / "small" / "model.onnx"
    data = bytearray(model.read_bytes())
    data[-5] ^= 0xFF
    model.unlink()
    model.write_bytes(bytes(data))
    rc, _, err = run_cli(capsys, "run", routed_copy, "--text", TEXT)
    assert_clean_error(rc, err, "small", "modified")


def test_tampered_and_rehashed_subplan_is_caught_by_the_digest(routed_copy, capsys):
    """A publisher who rewrites the sub-plan's own sha256 still changes its digest, which the routed plan records."""
    sub = routed_copy / "candidates" / "small"
    model = sub / "model.onnx"
    data = bytearray(model.read_bytes())
    data[-5] ^= 0xFF
    model.unlink()
    model.write_bytes(bytes(data))
    rehash(sub, "model")
    rc, _, err = run_cli(capsys, "run", routed_copy, "--text", TEXT)
    assert_clean_error(rc, err, "small", "modified after the routed plan was compiled")
    rc, _, err = run_cli(capsys, "inspect", "--verify", routed_copy)
    assert_clean_error(rc, err, "modified after the routed plan was compiled")


@pytest.mark.parametrize("what, value, needle", [
    ("plan", "../../etc", "escapes"),
    ("digest", "00" * 31, "64 lowercase hex"),
    ("labels", ["a", "b", "c"], "one label set"),
    ("task", "text-generation", "same task"),
])
def test_bad_candidate_fields(routed_copy, capsys, what, value, needle):
    raw = read_plan(routed_copy)
    raw["steps"][0]["candidates"][1][what] = value
    write_plan(routed_copy, raw)
    rc, _, err = run_cli(capsys, "run", routed_copy, "--text", TEXT)
    assert_clean_error(rc, err, needle)


@pytest.mark.parametrize("rule, needle", [
    ({"kind": "check", "check": "rm -rf"}, "unknown executable check"),
    ({"kind": "learned", "thresholds": [0.0]}, "needs 'router'"),
    ({"kind": "confidence", "thresholds": [0.5, 0.5], "criterion": "entropy"}, "one value per candidate"),
    ({"kind": "confidence", "thresholds": [2.0], "criterion": "maxprob"}, "probability"),
    ({"kind": "vibes"}, "one of"),
])
def test_bad_rules(routed_copy, capsys, rule, needle):
    raw = read_plan(routed_copy)
    raw["steps"][0]["rule"] = rule
    write_plan(routed_copy, raw)
    rc, _, err = run_cli(capsys, "run", routed_copy, "--text", TEXT)
    assert_clean_error(rc, err, needle)


def test_check_registry():
    from dyncompile.runtime.routing.route import get_check, register_check

    @register_check("test-always")
    def always(record, output):
        return True

    assert get_check("test-always") is always
    with pytest.raises(PlanError, match="unknown executable check"):
        get_check("no-such-check")


def test_force_replaces_a_routed_plan_and_nothing_else(routed, tmp_path, capsys):
    from hostile_plans import routed_plan

    out = tmp_path / "r"
    routed_plan([routed["small"], routed["big"]], out, routed["calib"])
    routed_plan([routed["small"], routed["big"]], out, routed["calib"], force=True)  # its candidates/ are its own
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="notes.txt"):
        routed_plan([routed["small"], routed["big"]], out, routed["calib"], force=True)


# ------------------------------------------------------------------------------------------- hard-linked weights


def test_hard_linked_external_data_is_one_clear_error(built, tmp_path, capsys):
    """A model whose weight file has a second hard link (a routed plan links its candidates' weights): the ONNX
    checker refuses it as a possible "hardlink attack"; the CLI says so in one line and writes nothing."""
    import onnx

    src = tmp_path / "m"
    src.mkdir()
    onnx.save_model(onnx.load(str(built["cls_model"])), str(src / "model.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="model.onnx.data", size_threshold=256)
    rc, _, err = run_cli(capsys, str(src / "model.onnx"), "--passes", "verify", "-o", tmp_path / "ok")
    assert rc == 0, err  # the same model without the second link compiles
    os.link(src / "model.onnx.data", tmp_path / "second-link.data")
    rc, _, err = run_cli(capsys, str(src / "model.onnx"), "--passes", "verify", "-o", tmp_path / "out")
    assert_clean_error(rc, err, "hard links")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------- diffusion steps


def _diffusion_plan(directory):
    """A text-to-image plan whose files are stand-in bytes: loading checks the plan, it opens no ONNX file."""
    from dyncompile.plan import Plan, Step, file_ref, save_plan

    directory.mkdir(parents=True)
    for rel in ("te.onnx", "unet.onnx", "vae.onnx", "tokenizer.json"):
        (directory / rel).write_bytes(rel.encode())
    files = {key: file_ref(directory, rel, key) for key, rel in
             (("text_encoder", "te.onnx"), ("unet", "unet.onnx"), ("vae_decoder", "vae.onnx"), ("tokenizer", "tokenizer.json"))}
    steps = [
        Step("diffusion_encode", {"text_encoder": "text_encoder", "output": "last_hidden_state", "null_prompt": ""}),
        Step("predict_steps", {"weights": [0.5, -0.25], "bias": 3.0, "mean": [0.0, 0.1], "scale": [1.0, 2.0],
                               "grid": [5, 10, 20, 40], "offset": 0.25, "features": "mean_pool"}),
        Step("diffusion_denoise", {
            "unet": "unet", "input_names": ["sample", "timestep", "encoder_hidden_states"],
            "scheduler": {"_class_name": "DDIMScheduler"}, "guidance_scale": 3.0, "num_inference_steps": 20,
            "sample_shape": [1, 32, 32], "output_crop": [2, 30, 2, 30], "eta": 0.0, "noise": "numpy",
            "default_policy": "online", "stop_rule": {"kind": "x0_change", "threshold": 0.01, "max_steps": 40, "min_steps": 4},
            "vae_decoder": {"file": "vae_decoder", "scaling_factor": 0.18215},
        }),
    ]
    tokenizer = {"file": "tokenizer", "max_length": 77, "padding": "max_length"}
    save_plan(Plan(task="text-to-image", files=files, steps=steps, tokenizer=tokenizer), directory)
    return directory


def _enc(r):
    return r["steps"][0]


def _pred(r):
    return r["steps"][1]


def _den(r):
    return r["steps"][2]


# each check of a diffusion step, made by its schema at load (what the runtime handlers may rely on)
DIFFUSION_MUTATIONS = {
    "encode: text_encoder names no file": (lambda r: _enc(r).update(text_encoder="nope"), "text_encoder names file 'nope'"),
    "encode: null_prompt not a string": (lambda r: _enc(r).update(null_prompt=3), "null_prompt must be a string"),
    "encode: output not a string": (lambda r: _enc(r).update(output=["x"]), "output must be a string"),
    "encode: the plan has no tokenizer": (lambda r: r.update(tokenizer=None), "(diffusion_encode) tokenizes text, but the plan has no tokenizer"),
    "predict: weights not numbers": (lambda r: _pred(r).update(weights=["a", 1]), "weights[0] must be a finite number"),
    "predict: weights NaN": (lambda r: _pred(r).update(weights=[float("nan"), 1.0]), "weights[0]: nan is not a finite number"),
    "predict: mean of the wrong length": (lambda r: _pred(r).update(mean=[0.0]), "mean has 1 values"),
    "predict: scale of the wrong length": (lambda r: _pred(r).update(scale=[1.0, 1.0, 1.0]), "scale 3"),
    "predict: bias missing": (lambda r: _pred(r).pop("bias"), "missing required field 'bias'"),
    "predict: offset missing": (lambda r: _pred(r).pop("offset"), "missing required field 'offset'"),
    "predict: offset out of range": (lambda r: _pred(r).update(offset=11.0), "offset must be in [-10.0, 10.0]"),
    "predict: grid empty": (lambda r: _pred(r).update(grid=[]), "grid must be an increasing list"),
    "predict: grid not increasing": (lambda r: _pred(r).update(grid=[10, 5]), "grid must be an increasing list"),
    "predict: grid of floats": (lambda r: _pred(r).update(grid=[5.5, 10]), "grid[0] must be an integer"),
    "predict: grid above the step bound": (lambda r: _pred(r).update(grid=[5, 1001]), "grid[1] must be in [1, 1000]"),
    "predict: unknown features": (lambda r: _pred(r).update(features="cls"), "features must be one of 'mean_pool'"),
    "denoise: unet names no file": (lambda r: _den(r).update(unet="nope"), "unet names file 'nope'"),
    "denoise: sample_shape of rank 2": (lambda r: _den(r).update(sample_shape=[32, 32]), "sample_shape must be [C, H, W]"),
    "denoise: sample_shape not positive": (lambda r: _den(r).update(sample_shape=[1, 0, 32]), "sample_shape[1] must be in [1, 1000000]"),
    "denoise: output_crop outside the sample": (lambda r: _den(r).update(output_crop=[0, 40, 0, 32]), "output_crop must be"),
    "denoise: output_crop negative": (lambda r: _den(r).update(output_crop=[-1, 30, 2, 30]), "output_crop[0] must be in [0, 1000000]"),
    "denoise: eta not zero": (lambda r: _den(r).update(eta=0.5), "only deterministic DDIM (eta 0)"),
    "denoise: unknown noise source": (lambda r: _den(r).update(noise="jax"), "noise must be one of 'numpy', 'torch'"),
    "denoise: unknown default_policy": (lambda r: _den(r).update(default_policy="vibes"), "default_policy must be one of"),
    "denoise: online without a stop rule": (lambda r: _den(r).update(stop_rule=None), "default_policy 'online' needs a stop_rule"),
    "denoise: stop rule of another kind": (lambda r: _den(r)["stop_rule"].update(kind="eps_change"), "stop_rule.kind must be one of 'x0_change'"),
    "denoise: stop rule max_steps below 2": (lambda r: _den(r)["stop_rule"].update(max_steps=1), "max_steps must be in [2, 1000]"),
    "denoise: stop rule threshold above 1": (lambda r: _den(r)["stop_rule"].update(threshold=1.5), "threshold must be in [0.0, 1.0]"),
    "denoise: stop rule min_steps above max_steps": (lambda r: _den(r)["stop_rule"].update(min_steps=41), "min_steps 41 exceeds max_steps 40"),
    "denoise: stop rule not an object": (lambda r: _den(r).update(stop_rule="x0_change"), "stop_rule must be an object"),
    "denoise: vae_decoder names no file": (lambda r: _den(r)["vae_decoder"].update(file="nope"), "vae_decoder.file names file 'nope'"),
    "denoise: vae scaling_factor zero": (lambda r: _den(r)["vae_decoder"].update(scaling_factor=0.0), "scaling_factor must be in"),
    "denoise: vae_decoder not an object": (lambda r: _den(r).update(vae_decoder="vae_decoder"), "vae_decoder must be an object"),
    "denoise: input_names of two": (lambda r: _den(r).update(input_names=["sample", "timestep"]), "input_names must name"),
    "denoise: input_names not strings": (lambda r: _den(r).update(input_names=["sample", 1, "c"]), "input_names[1] must be a string"),
    "denoise: guidance_scale below 1": (lambda r: _den(r).update(guidance_scale=0.5), "guidance_scale must be in [1.0, 100.0]"),
    "denoise: num_inference_steps above the bound": (lambda r: _den(r).update(num_inference_steps=1001), "num_inference_steps must be in [1, 1000]"),
    "denoise: num_inference_steps a float": (lambda r: _den(r).update(num_inference_steps=20.0), "num_inference_steps must be an integer"),
}


def test_the_diffusion_stand_in_plan_loads(tmp_path):
    from dyncompile.plan import DiffusionDenoiseParams, PredictStepsParams, load_plan

    plan = load_plan(_diffusion_plan(tmp_path / "plan"))
    assert [type(s.typed) for s in plan.steps[1:]] == [PredictStepsParams, DiffusionDenoiseParams]
    assert plan.steps[2].typed.stop_rule.min_steps == 4 and plan.steps[2].typed.vae_decoder.file == "vae_decoder"


@pytest.mark.parametrize("what", list(DIFFUSION_MUTATIONS))
def test_diffusion_plan_mistakes_are_clean_errors(tmp_path, what):
    from dyncompile.plan import load_plan

    mutate, needle = DIFFUSION_MUTATIONS[what]
    plan = _mutate(_diffusion_plan(tmp_path / "plan"), mutate)
    with pytest.raises(PlanError) as e:
        load_plan(plan)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_routed_step_whose_output_nothing_reads_is_a_clean_error(tmp_path, capsys):
    """A routed plan whose step writes its answer under a name the classifier does not read: one error line."""
    from hostile_plans import classifier_dir, routed_plan, run_model_plan, word_calib

    model = classifier_dir(tmp_path / "c")
    a, b = run_model_plan(model, tmp_path / "a"), run_model_plan(model, tmp_path / "b")
    routed = routed_plan([a, b], tmp_path / "r", word_calib(tmp_path / "calib.jsonl"))
    raw = json.loads((routed / "plan.json").read_text())
    raw["steps"][0]["output"] = "not_logits"
    (routed / "plan.json").write_text(json.dumps(raw))
    rc, _, err = run_cli(capsys, "run", routed, "--text", "w3 w5")
    assert_clean_error(rc, err, "no 'logits'")
