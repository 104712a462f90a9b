"""Hostile plans and inputs through the CLI, second round: bounds on everything a plan can make the runtime do.

Each row is an attack run through ``dyncompile.tools.cli.main`` in-process (a few as subprocesses, with a time
and memory limit, where the unbounded behaviour would hang the test) on tiny synthetic plans; each ends in one
``error:`` line naming the problem (exit code 2), never a traceback, a hang or a silently wrong result. Kinds:
chat templates that loop or explode, plan.json that is costly to parse under the size cap, diffusion request and
scheduler ranges, outputs that would overwrite files, ``export-genai`` options, ``route --force`` over its own
inputs, and values read from a plan or a model that have the wrong type (tokenizer, drafter vocabulary,
provenance, declared outputs).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
import types

import numpy as np
import pytest
from helpers import assert_clean_error, run_cli
from hostile_plans import (
    TEXT,
    classifier_dir,
    decoder_dir,
    generate_plan,
    read_plan,
    rehash,
    run_model_plan,
    tree_state,
    word_calib,
    write_plan,
)

from dyncompile.errors import DataError, DyncompileError, PlanError


@pytest.fixture(scope="module")
def built(module_tmp):
    """Pristine plans, built once: two classifier plans (candidates), generate and speculative decoder plans."""
    root = module_tmp("hostile-cli")
    cls_model = classifier_dir(root / "cls")
    dec_model = decoder_dir(root / "dec")
    return {
        "root": root,
        "cls": run_model_plan(cls_model, root / "plan-cls"),
        "cls2": run_model_plan(cls_model, root / "plan-cls2"),
        "gen": generate_plan(dec_model, root / "plan-gen"),
        "spec": generate_plan(dec_model, root / "plan-spec", speculative=True),
        "calib": word_calib(root / "calib.jsonl", 24),
    }


@pytest.fixture
def plan_copy(built, tmp_path):
    def make(name):
        dst = tmp_path / name
        shutil.copytree(built[name], dst)
        return dst

    return make


def _mutate(plan, fn):
    raw = read_plan(plan)
    fn(raw)
    write_plan(plan, raw)
    return plan


def _cli_subprocess(*argv, timeout=90):
    """The CLI in a child process with 6 GiB of address space and ``timeout`` seconds: (rc, stderr)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30)); "
            "from dyncompile.tools.cli import main; sys.exit(main(sys.argv[1:]))")
    try:
        p = subprocess.run([sys.executable, "-c", code, *map(str, argv)], env=env, capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the CLI ran for more than {timeout} s")
    return p.returncode, p.stderr


# ------------------------------------------------------------------------------------------- chat templates

LOOPING_TEMPLATES = {
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x",
    "exponential macro": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    "huge power": "{{ (10 ** (10 ** 9)) % 7 }}",
    "constant folded at compile time": "{{ 'ab'|center(100000000) }}{% for i in range(100000) %}{% endfor %}",
    "string output bomb": "{% for i in range(100000) %}{% for j in range(100000) %}{{ messages[0].content }}"
                          "{% endfor %}{% endfor %}",
}


@pytest.mark.parametrize("what", list(LOOPING_TEMPLATES))
def test_chat_template_work_is_bounded(plan_copy, what):
    plan = _mutate(plan_copy("gen"), lambda r: r["steps"][0]["generation"].update(chat_template=LOOPING_TEMPLATES[what]))
    t0 = time.perf_counter()
    rc, err = _cli_subprocess("run", plan, "--prompt", "w3 w4", "--chat", "--max-new-tokens", "2")
    assert rc == 2 and "Traceback" not in err and err.startswith("error: "), err
    assert "chat template" in err and "limit" in err, err
    assert time.perf_counter() - t0 < 60


MEMORY_TEMPLATES = {
    "string times int": "{{ 'x' * 100000000 }}",
    "list times int": "{{ (['x' * 10000] * 10000)|join }}",
    "method widens": "{{ 'ab'.ljust(100000000) }}",
    "filter widens": "{{ 'ab'|center(100000000) }}",
    "filter indents": "{{ ('a\\n' * 1000)|indent(100000) }}",
    "replace multiplies": "{{ ('x' * 10000)|replace('x', 'y' * 10000) }}",
    "namespace doubling": "{% set ns = namespace(s='xxxxxxxx') %}{% for i in range(24) %}{% set ns.s = ns.s ~ ns.s %}"
                          "{% endfor %}{{ ns.s|length }}",
    "set doubling": "{% set s = 'xxxxxxxx' %}" + "{% set s = s ~ s %}" * 24 + "{{ s|length }}",
    "format width": "{{ '%0100000000d' % 1 }}",
    "huge source": "x" * (1 << 20),
}


@pytest.mark.parametrize("what", list(MEMORY_TEMPLATES))
def test_chat_template_size_is_bounded(plan_copy, capsys, what):
    plan = _mutate(plan_copy("gen"), lambda r: r["steps"][0]["generation"].update(chat_template=MEMORY_TEMPLATES[what]))
    rc, _, err = run_cli(capsys, "run", plan, "--prompt", "w3 w4", "--chat", "--max-new-tokens", "2")
    assert_clean_error(rc, err, "chat template", "limit")


def test_chat_template_of_a_real_shape_still_renders():
    from dyncompile.runtime.text import render_chat

    tpl = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
           "{% if loop.index0 % 2 == 0 %}{% endif %}{% endfor %}{% if add_generation_prompt %}"
           "{{ '<|im_start|>assistant\\n' }}{% endif %}")
    long_prompt = "w3 " * 200_000  # the user's own prompt may be long: the bounds are on the template's work
    assert render_chat(tpl, long_prompt).startswith("<|im_start|>user\nw3 w3")
    ns = "{% set ns = namespace(n=0) %}{% for i in range(10) %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}"
    assert render_chat(ns, "x") == "45"


# ------------------------------------------------------------------------------------------- plan.json parse cost


def _big_plan(plan, payload: str):
    text = (plan / "plan.json").read_text()
    assert text.rstrip().endswith("}")
    raw = json.loads(text)
    raw["provenance"] = {}
    text = json.dumps(raw)
    (plan / "plan.json").write_text(text[:-2] + '"extra": ' + payload + "}}")


@pytest.mark.parametrize("what", ["wide list", "many objects", "many keys", "long string"])
def test_plan_json_that_is_costly_to_parse_is_refused_quickly(plan_copy, capsys, what):
    plan = plan_copy("cls")
    payload = {
        "wide list": "[" + ",".join(["0"] * 3_000_000) + "]",
        "many objects": "[" + ",".join(["{}"] * 4_000_000) + "]",
        "many keys": "{" + ",".join(f'"k{i}":0' for i in range(800_000)) + "}",
        "long string": json.dumps("x" * (12 << 20)),
    }[what]
    _big_plan(plan, payload)
    assert (plan / "plan.json").stat().st_size < 16 << 20
    t0 = time.perf_counter()
    rc, _, err = run_cli(capsys, "inspect", plan)
    assert_clean_error(rc, err, "plan.json")
    assert "items" in err or "characters" in err, err
    assert time.perf_counter() - t0 < 5


# ------------------------------------------------------------------------------------------- diffusion ranges


def _images_api():
    from dyncompile.runtime.diffusion.api import ImagesAPI

    return ImagesAPI(types.SimpleNamespace(plan=types.SimpleNamespace(task="text-to-image"), handlers=[]))


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"guidance": 1e6}, "guidance"),
    ({"guidance": 101.0}, "guidance"),
    ({"steps": 10, "policy": "predicted"}, "--steps"),
    ({"steps": 10, "policy": "online"}, "--steps"),
    ({"seed": -1}, "seed"),
])
def test_diffusion_request_out_of_range_is_refused(kwargs, needle):
    with pytest.raises(DataError, match=needle):
        _images_api().generate_images("a shoe", **kwargs)


SCHED = {"_class_name": "DDIMScheduler", "num_train_timesteps": 1000, "beta_schedule": "linear",
         "timestep_spacing": "leading", "set_alpha_to_one": True}


def _denoise_step(sched=None, **over):
    from dyncompile.plan import Step
    from dyncompile.runtime.diffusion.steps import DiffusionDenoiseStep

    class Unet:
        def get_inputs(self):
            return [types.SimpleNamespace(name=n) for n in ("sample", "timestep", "encoder_hidden_states")]

        def get_outputs(self):
            return [types.SimpleNamespace(name="out")]

        def run(self, names, feeds):
            return [np.zeros_like(feeds["sample"])]

    params = {"unet": "unet", "scheduler": {**SCHED, **(sched or {})}, "sample_shape": [1, 4, 4],
              "guidance_scale": 2.0, "num_inference_steps": 10, **over}
    ctx = types.SimpleNamespace(session=lambda key: Unet(), plan=None)
    return DiffusionDenoiseStep(Step("diffusion_denoise", params), ctx)


def _state(**over):
    return {"ctx": np.zeros((1, 2, 3), np.float32), "null_ctx": np.zeros((1, 2, 3), np.float32), "seeds": [0], **over}


@pytest.mark.parametrize(("sched", "over", "needle"), [
    ({"steps_offset": 5000}, {}, "steps_offset"),
    ({"steps_offset": -500}, {}, "steps_offset"),
    ({"clip_sample_range": 0.0}, {}, "clip_sample_range"),
    ({"clip_sample_range": float("nan")}, {}, "clip_sample_range"),
    ({"num_train_timesteps": 10**12}, {}, "num_train_timesteps"),
    ({"num_train_timesteps": 20}, {"num_inference_steps": 50}, "num_inference_steps"),
    ({"num_train_timesteps": 20}, {"stop_rule": {"kind": "x0_change", "threshold": 0.1, "max_steps": 50}}, "max_steps"),
])
def test_scheduler_config_out_of_range_is_a_plan_error(sched, over, needle):
    with pytest.raises(PlanError, match=needle):
        _denoise_step(sched, **over).run(_state())


def test_requested_steps_beyond_the_schedule_are_a_data_error():
    step = _denoise_step({"num_train_timesteps": 20})
    with pytest.raises(DataError, match="steps"):
        step.run(_state(num_inference_steps=50))


class _FakeImages:
    """A text-to-image model stand-in: ``generate_images`` gives grey 4x4 images."""

    def generate_images(self, prompts, **kw):
        n = len(prompts)
        return types.SimpleNamespace(images=np.full((n, 4, 4), 128, np.uint8), steps=np.full(n, 3), policy="fixed",
                                     seconds=0.0, unet_calls=3, shallow_calls=0, to_dict=lambda: {})


def _png_args(out, *, force=False, prompts=("a shoe",)):
    return types.SimpleNamespace(prompt=prompts[0], text=list(prompts[1:]), output=str(out), seed=0, steps=None,
                                 guidance=None, policy=None, json=False, force=force)


def test_run_png_output_never_overwrites_without_force(tmp_path, capsys):
    from dyncompile.tools.diffusion_cli import run_text_to_image

    out = tmp_path / "OUT.png"
    out.write_bytes(b"my holiday photo")
    with pytest.raises(DyncompileError, match="--force"):
        run_text_to_image(_FakeImages(), _png_args(out))
    assert out.read_bytes() == b"my holiday photo"
    (tmp_path / "OUT-1.png").write_bytes(b"another")
    with pytest.raises(DyncompileError, match="OUT-1.png"):
        run_text_to_image(_FakeImages(), _png_args(out, force=False, prompts=("a", "b")))
    assert not (tmp_path / "OUT-0.png").exists()
    assert run_text_to_image(_FakeImages(), _png_args(out, force=True)) == 0
    assert out.read_bytes().startswith(b"\x89PNG")


def test_run_has_a_force_flag():
    from dyncompile.tools.cli import _run_parser

    assert _run_parser().parse_args(["p", "--force"]).force is True


# ------------------------------------------------------------------------------------------- export-genai


@pytest.mark.parametrize(("flags", "needle"), [
    (("--max-draft-tokens", "0"), "--max-draft-tokens"),
    (("--max-draft-tokens", "-3"), "--max-draft-tokens"),
    (("--genai-adaptive-k", "0"), "--genai-adaptive-k"),
])
def test_export_genai_zero_is_not_the_default(built, tmp_path, capsys, flags, needle):
    rc, _, err = run_cli(capsys, "export-genai", built["spec"], "-o", tmp_path / "x", *flags)
    assert_clean_error(rc, err, needle)
    assert not (tmp_path / "x").exists()


def test_export_genai_never_overwrites_without_force(built, tmp_path, capsys):
    out = tmp_path / "x"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    rc, _, err = run_cli(capsys, "export-genai", built["spec"], "-o", out)
    assert_clean_error(rc, err, "--force")
    rc, _, err = run_cli(capsys, "export-genai", built["spec"], "-o", out, "--force")
    assert_clean_error(rc, err, "not a dyncompile plan")
    assert (out / "mine.txt").read_text() == "keep"


def test_export_genai_never_writes_inside_its_input(plan_copy, tmp_path, capsys):
    plan = plan_copy("spec")
    before = tree_state(plan)
    rc, _, err = run_cli(capsys, "export-genai", plan, "-o", plan / "genai")
    assert_clean_error(rc, err, "inside")
    assert tree_state(plan) == before


# ------------------------------------------------------------------------------------------- route --force


def _route(built, out, *extra, candidates=("cls", "cls2")):
    return ("route", "--candidates", *[built[c] if c in built else c for c in candidates], "--calib", built["calib"],
            "-o", out, "--confidence", "none", "--budget", "100", "--cost-rows", "2", "-q", *extra)


def test_route_force_never_replaces_the_reference(built, plan_copy, capsys):
    ref = plan_copy("cls")
    before = tree_state(ref)
    rc, _, err = run_cli(capsys, *_route(built, ref, "--reference", ref, "--force"))
    assert_clean_error(rc, err, "input")
    assert tree_state(ref) == before


def test_route_force_never_writes_inside_or_over_a_candidate(built, plan_copy, tmp_path, capsys):
    a, b = plan_copy("cls"), plan_copy("cls2")
    before = tree_state(tmp_path)
    for out in (a / "inner", a, tmp_path):
        rc, _, err = run_cli(capsys, *_route(built, out, "--force", candidates=(a, b)))
        assert rc == 2 and "Traceback" not in err and err.startswith("error: "), err
    assert tree_state(tmp_path) == before


def test_route_force_refuses_a_folder_that_is_not_a_plan(built, tmp_path, capsys):
    victim = tmp_path / "photos"
    victim.mkdir()
    (victim / "holiday.jpg").write_bytes(b"precious")
    rc, _, err = run_cli(capsys, *_route(built, victim, "--force"))
    assert_clean_error(rc, err, "not a dyncompile plan")
    assert (victim / "holiday.jpg").read_bytes() == b"precious"


def test_force_never_wipes_user_files_inside_a_folder_the_plan_names(built, tmp_path, capsys):
    """A plan.json that names a folder (``candidates/x``) does not make everything in that folder the plan's."""
    out = tmp_path / "routed"
    (out / "candidates" / "x").mkdir(parents=True)
    (out / "candidates" / "precious.txt").write_text("mine")
    (out / "plan.json").write_text(json.dumps({
        "format": "dyncompile.plan/v1", "task": "text-classification", "files": {},
        "steps": [{"kind": "cascade", "candidates": [{"name": "x", "plan": "candidates/x"}]}]}))
    rc, _, err = run_cli(capsys, *_route(built, out, "--force"))
    assert_clean_error(rc, err, "precious.txt")
    assert (out / "candidates" / "precious.txt").read_text() == "mine"


# ------------------------------------------------------------------------------------------- values read from plans


def test_corrupt_tokenizer_json_is_one_error(plan_copy, capsys):
    plan = plan_copy("gen")
    tok = read_plan(plan)["files"]["tokenizer"]["path"]
    (plan / tok).write_text(json.dumps({"model": {"type": "WordLevel", "vocab": 5, "unk_token": 3}}))
    rehash(plan, "tokenizer")
    rc, _, err = run_cli(capsys, "run", plan, "--prompt", "w3", "--max-new-tokens", "2")
    assert_clean_error(rc, err, "tokenizer")


PROVENANCE = {
    "source a string": {"source": "model.onnx"},
    "passes not strings": {"passes": [1, {"a": 2}]},
    "source path a number": {"source": {"path": 5, "sha256": 7}},
    "provenance a list": ["x"],
}


@pytest.mark.parametrize("what", list(PROVENANCE))
def test_provenance_of_the_wrong_type(plan_copy, capsys, what):
    plan = _mutate(plan_copy("cls"), lambda r: r.update(provenance=PROVENANCE[what]))
    for argv in (("inspect", plan), ("run", plan, "--text", TEXT, "--compare")):
        rc, _, err = run_cli(capsys, *argv)
        assert_clean_error(rc, err, "provenance")


def test_declared_output_shape_that_lies(plan_copy, capsys):
    plan = _mutate(plan_copy("cls"), lambda r: r["outputs"][0].update(shape=["batch", 7]))
    rc, _, err = run_cli(capsys, "run", plan, "--text", TEXT)
    assert_clean_error(rc, err, "logits")


@pytest.mark.parametrize(("vocab", "needle"), [
    (b"not a numpy file", "vocab"),
    (np.arange(6, dtype=np.float32), "integer"),
    (np.arange(6, dtype=np.int64).reshape(2, 3), "1-D"),
    (np.array([0, -4, 2], np.int64), "negative"),
    (np.array(["a", "b"], dtype=object), "vocab"),
])
def test_drafter_vocab_of_the_wrong_kind(vocab, needle):
    from dyncompile.runtime.decode.speculative import read_drafter_vocab

    if isinstance(vocab, bytes):
        data = vocab
    else:
        buf = io.BytesIO()
        np.save(buf, vocab, allow_pickle=True)
        data = buf.getvalue()
    with pytest.raises(PlanError, match=needle):
        read_drafter_vocab(data, "drafter_vocab", target_vocab=16)
    buf = io.BytesIO()
    np.save(buf, np.array([0, 3, 20], np.int64))
    with pytest.raises(PlanError, match="target"):
        read_drafter_vocab(buf.getvalue(), "drafter_vocab", target_vocab=16)


def test_no_pickle_anywhere():
    """Every np.load passes allow_pickle=False; no pickle or torch.load without weights_only in the package."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1]
    bad = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).parts
        if "tests" in rel or "build" in rel or any(part.startswith(".") for part in rel):  # venvs (.venv*), .git
            continue
        src = path.read_text()
        for m in re.finditer(r"np\.load\(([^()]*(?:\([^()]*\))?[^()]*)\)", src):
            if "allow_pickle=False" not in m.group(1):
                bad.append(f"{path.relative_to(root)}: {m.group(0)}")
        for m in re.finditer(r"torch\.load\(([^()]*)\)", src):
            if "weights_only=True" not in m.group(1):
                bad.append(f"{path.relative_to(root)}: {m.group(0)}")
        if re.search(r"^\s*(import pickle|from pickle|import cPickle|import dill|import joblib)", src, re.M):
            bad.append(f"{path.relative_to(root)}: imports a pickle module")
    assert not bad, bad


def test_negative_sampling_seed_is_one_error(built, capsys):
    rc, _, err = run_cli(capsys, "run", built["gen"], "--prompt", "w3", "--sample", "--seed", "-1",
                         "--max-new-tokens", "2")
    assert_clean_error(rc, err, "seed")
