"""Integrity from hash to session: ONNX Runtime gets exactly the bytes that were hashed.

* a model file (or its external data) swapped on disk after the plan was loaded is never run: the answer is the
  hashed model's or one clear error;
* every external-data location of every ONNX file is a hashed file entry of the plan (else the plan does not
  load), covered by ``inspect --verify`` and routed digests;
* a routed plan never shares inodes with the plans it was made from (unless asked to: ``link=True``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from hostile_plans import TEXT, classifier_dir, read_plan, routed_plan, run_model_plan, word_calib, write_plan

import dyncompile
from dyncompile.errors import PlanError
from dyncompile.models.synthetic import tiny_encoder_classifier
from dyncompile.plan import load_plan, plan_digest
from dyncompile.runtime.executor import CompiledModel, RuntimeContext

TEXTS = [TEXT, "w1 w2", "w400 w9 w17"]


def _sha(p) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def root(module_tmp):
    return module_tmp("integrity")


@pytest.fixture(scope="module")
def base_plan(root):
    """A classifier plan (inline weights)."""
    return run_model_plan(classifier_dir(root / "cls"), root / "plan")


@pytest.fixture(scope="module")
def other_model(root):
    """Another model with the same inputs and outputs (other weights): what an attacker swaps in."""
    path = root / "other.onnx"
    ir.save(tiny_encoder_classifier(num_layers=4, seed=7), path)
    return path


def _fresh(base_plan, tmp_path, name="p"):
    dst = tmp_path / name
    shutil.copytree(base_plan, dst)
    return dst


def _to_external(plan_dir, *, location="model.onnx.data", list_it=True, as_entry=True):
    """Re-save the plan's model with its weights in external data ``location``; list the file in plan.json."""
    m = onnx.load(str(plan_dir / "model.onnx"))
    (plan_dir / "model.onnx").unlink()
    onnx.save_model(m, str(plan_dir / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=location, size_threshold=1024)
    raw = read_plan(plan_dir)
    raw["files"]["model"]["sha256"] = _sha(plan_dir / "model.onnx")
    if list_it:
        raw["files"]["model"]["external_data"] = [location]
    if as_entry:
        raw["files"]["model.data"] = {"path": location, "sha256": _sha(plan_dir / location), "role": "external_data"}
    write_plan(plan_dir, raw)
    return plan_dir


def _answer(plan_dir):
    return dyncompile.load(plan_dir).predict_proba(TEXTS)


# ------------------------------------------------------------------------------------------ swapped after load


@pytest.mark.parametrize("same_size", [False, True])
def test_model_swapped_after_load_is_never_run(base_plan, other_model, tmp_path, same_size):
    plan_dir = _fresh(base_plan, tmp_path)
    want = _answer(plan_dir)
    plan = load_plan(plan_dir)  # hashes checked here
    swapped = other_model.read_bytes()
    if same_size:  # other weights, same length as the hashed file: a size check would not notice
        m = onnx.load(str(plan_dir / "model.onnx"))
        for t in m.graph.initializer:
            if t.data_type == onnx.TensorProto.FLOAT and len(t.raw_data) > 4096:
                t.raw_data = (np.frombuffer(t.raw_data, np.float32) * -1.5).astype(np.float32).tobytes()
        swapped = m.SerializeToString()
        assert len(swapped) == (plan_dir / "model.onnx").stat().st_size
    (plan_dir / "model.onnx").write_bytes(swapped)
    try:
        got = CompiledModel(plan, RuntimeContext(plan)).predict_proba(TEXTS)
    except PlanError as e:
        assert "changed on disk" in str(e) and "model.onnx" in str(e)
    else:
        np.testing.assert_array_equal(got, want)


def test_model_swapped_between_calls_keeps_the_hashed_answer(base_plan, other_model, tmp_path):
    plan_dir = _fresh(base_plan, tmp_path)
    cm = dyncompile.load(plan_dir)
    want = cm.predict_proba(TEXTS)
    (plan_dir / "model.onnx").write_bytes(other_model.read_bytes())
    np.testing.assert_array_equal(cm.predict_proba(TEXTS), want)


def test_session_gets_bytes_not_a_path(base_plan, tmp_path, monkeypatch):
    """ORT is handed the model's bytes (the ones that were hashed), never a path it would open again."""
    import onnxruntime as ort

    plan_dir = _fresh(base_plan, tmp_path)
    seen = []
    real = ort.InferenceSession

    def spy(model, *a, **k):
        seen.append(type(model))
        return real(model, *a, **k)

    monkeypatch.setattr(ort, "InferenceSession", spy)
    dyncompile.load(plan_dir).predict_proba(TEXTS)
    assert seen and all(t is bytes for t in seen), seen


def test_external_data_swapped_after_load_is_never_run(base_plan, tmp_path):
    plan_dir = _to_external(_fresh(base_plan, tmp_path))
    want = _answer(plan_dir)
    plan = load_plan(plan_dir)
    data = bytearray((plan_dir / "model.onnx.data").read_bytes())
    data[100:4100] = np.random.default_rng(0).standard_normal(1000).astype(np.float32).tobytes()  # same size
    (plan_dir / "model.onnx.data").write_bytes(bytes(data))
    try:
        got = CompiledModel(plan, RuntimeContext(plan)).predict_proba(TEXTS)
    except PlanError as e:
        assert "changed on disk" in str(e) and "model.onnx.data" in str(e)
    else:
        np.testing.assert_array_equal(got, want)


def _write_in_place_during_session(plan_dir, monkeypatch, *, pause=0.0):
    """Make ORT's session constructor first overwrite 4 KB of the plan's external data in place (same inode, same
    size): what a writer racing the load between the hash and ORT's copy would do."""
    import time

    import onnxruntime as ort

    real = ort.InferenceSession

    def racing(model, *a, **k):
        time.sleep(pause)
        with open(plan_dir / "model.onnx.data", "r+b") as f:
            f.seek(100)
            f.write(np.random.default_rng(0).standard_normal(1000).astype(np.float32).tobytes())
        return real(model, *a, **k)

    monkeypatch.setattr(ort, "InferenceSession", racing)


@pytest.mark.parametrize("pause", [0.0, 0.05], ids=["same-clock-tick", "later-tick"])
def test_external_data_written_while_the_session_is_made_is_never_run(base_plan, tmp_path, monkeypatch, pause):
    """External data is mapped and ORT copies out of the map after the hash: an in-place write in between is caught
    once the session exists (times and a second hash), never answered from. ``same-clock-tick``: the write may
    share the file system's clock tick with the first look, so only the second hash can see it."""
    plan_dir = _to_external(_fresh(base_plan, tmp_path))
    plan = load_plan(plan_dir)
    _write_in_place_during_session(plan_dir, monkeypatch, pause=pause)
    with pytest.raises(PlanError, match=r"model\.onnx\.data.*written while ONNX Runtime read it"):
        CompiledModel(plan, RuntimeContext(plan)).predict_proba(TEXTS)


def test_the_write_race_reaches_ort_without_the_check(base_plan, tmp_path, monkeypatch):
    """Negative control for the test above: with the check off, the racing write is what ORT copied (another
    answer), so the check is what keeps it out."""
    from dyncompile.plan.model_bytes import ModelBytes

    plan_dir = _to_external(_fresh(base_plan, tmp_path))
    want = _answer(plan_dir)
    plan = load_plan(plan_dir)
    _write_in_place_during_session(plan_dir, monkeypatch)
    monkeypatch.setattr(ModelBytes, "check_unchanged", lambda self: None)
    assert not np.array_equal(CompiledModel(plan, RuntimeContext(plan)).predict_proba(TEXTS), want)


def test_external_data_maps_are_closed_once_the_session_exists(base_plan, tmp_path, monkeypatch):
    """ORT gets the external data as a read-only map of the hashed file (page cache, not a second copy in the
    process) and keeps its own copy: the maps are closed after the session is made, and it still answers."""
    import mmap

    import dyncompile.runtime.executor as executor

    plan_dir = _to_external(_fresh(base_plan, tmp_path))
    want = _answer(base_plan)
    seen = []
    real = executor.read_model

    def spy(*a, **k):
        mb = real(*a, **k)
        seen.append(mb)
        return mb

    monkeypatch.setattr(executor, "read_model", spy)
    np.testing.assert_allclose(_answer(plan_dir), want, rtol=0, atol=1e-6)
    maps = [b for mb in seen for b in mb.external.values()]
    assert maps and all(isinstance(b, mmap.mmap) and b.closed for b in maps)


def test_external_data_plan_runs_from_any_working_directory(base_plan, tmp_path, monkeypatch):
    plan_dir = _to_external(_fresh(base_plan, tmp_path))
    want = _answer(base_plan)
    monkeypatch.chdir(tmp_path)
    np.testing.assert_allclose(_answer(plan_dir), want, rtol=0, atol=1e-6)


# ------------------------------------------------------------------------ external data must be a hashed entry


def test_unlisted_external_data_is_refused(base_plan, tmp_path):
    plan_dir = _to_external(_fresh(base_plan, tmp_path), list_it=False, as_entry=False)
    with pytest.raises(PlanError, match=r"model\.onnx\.data.*not a file of the plan"):
        load_plan(plan_dir)


def test_external_data_listed_but_not_hashed_is_refused(base_plan, tmp_path):
    """Named in the model's ``external_data`` list only: no sha256 covers it."""
    plan_dir = _to_external(_fresh(base_plan, tmp_path), list_it=True, as_entry=False)
    with pytest.raises(PlanError, match=r"model\.onnx\.data.*not a file of the plan"):
        load_plan(plan_dir)


def test_external_data_outside_the_plan_is_refused(base_plan, tmp_path):
    plan_dir = _fresh(base_plan, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    _to_external(plan_dir, location="w.data", list_it=False, as_entry=False)
    shutil.move(plan_dir / "w.data", outside / "w.data")
    m = onnx.load(str(plan_dir / "model.onnx"), load_external_data=False)
    for t in m.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = "../outside/w.data"
    (plan_dir / "model.onnx").write_bytes(m.SerializeToString())
    raw = read_plan(plan_dir)
    raw["files"]["model"]["sha256"] = _sha(plan_dir / "model.onnx")
    write_plan(plan_dir, raw)
    with pytest.raises(PlanError, match="outside the plan directory"):
        load_plan(plan_dir)


def test_external_data_listed_and_hashed_loads_and_edits_are_caught(base_plan, tmp_path):
    plan_dir = _to_external(_fresh(base_plan, tmp_path))
    np.testing.assert_allclose(_answer(plan_dir), _answer(base_plan), rtol=0, atol=1e-6)
    d1 = plan_digest(plan_dir)
    with open(plan_dir / "model.onnx.data", "r+b") as f:
        f.seek(200)
        f.write(b"\1\2\3\4")
    with pytest.raises(PlanError, match="modified after compile"):
        load_plan(plan_dir)
    raw = read_plan(plan_dir)
    raw["files"]["model.data"]["sha256"] = _sha(plan_dir / "model.onnx.data")
    write_plan(plan_dir, raw)
    assert plan_digest(plan_dir) != d1


def test_inspect_verify_refuses_unlisted_external_data(base_plan, tmp_path, capsys):
    from dyncompile.tools.cli import main

    plan_dir = _to_external(_fresh(base_plan, tmp_path), list_it=False, as_entry=False)
    assert main(["inspect", str(plan_dir), "--verify"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "model.onnx.data" in err[0], err


def _digest_without_external(plan_dir) -> str:
    """The routed digest of ``plan_dir`` over plan.json and its listed files only (what a digest that forgot
    external data would record)."""
    raw = read_plan(plan_dir)
    rels = {"plan.json"} | {f["path"] for f in raw["files"].values()}
    h = hashlib.sha256(b"dyncompile.plan-digest/v1\0")
    for rel in sorted(rels):
        h.update(rel.encode() + b"\0" + _sha(plan_dir / rel).encode() + b"\0")
    return h.hexdigest()


def test_routed_plan_refuses_candidate_with_unlisted_external_data(base_plan, tmp_path):
    small = _to_external(_fresh(base_plan, tmp_path, "small"))
    big = _fresh(base_plan, tmp_path, "big")
    routed = routed_plan([small, big], tmp_path / "routed", word_calib(tmp_path / "calib.jsonl"))
    cand = routed / "candidates" / "small"
    assert (cand / "model.onnx.data").is_file()
    dyncompile.load(routed)([TEXT])
    raw = read_plan(cand)  # drop the data file's entry: its bytes are then covered by no hash and no digest
    del raw["files"]["model.data"]
    raw["files"]["model"].pop("external_data")
    write_plan(cand, raw)
    top = read_plan(routed)
    top["steps"][0]["candidates"][0]["digest"] = _digest_without_external(cand)
    write_plan(routed, top)
    with pytest.raises(PlanError, match=r"small.*model\.onnx\.data"):
        dyncompile.load(routed)([TEXT] * 3)
    with pytest.raises(PlanError, match=r"small.*model\.onnx\.data"):
        plan_digest(routed)


# -------------------------------------------------------------------------------------------- no shared inodes


def test_routed_plan_shares_no_inode_with_its_candidates(base_plan, tmp_path):
    small = _to_external(_fresh(base_plan, tmp_path, "small"))
    big = _fresh(base_plan, tmp_path, "big")
    routed = routed_plan([small, big], tmp_path / "routed", word_calib(tmp_path / "calib.jsonl"))
    for cand, name in ((small, "small"), (big, "big")):
        for f in cand.iterdir():
            copy = routed / "candidates" / name / f.name
            assert copy.is_file()
            assert os.stat(copy).st_ino != os.stat(f).st_ino, f
    before = _sha(routed / "candidates" / "big" / "model.onnx")
    with open(big / "model.onnx", "r+b") as f:  # an in-place edit of the source plan
        f.seek(64)
        f.write(b"\xff" * 8)
    assert _sha(routed / "candidates" / "big" / "model.onnx") == before
    dyncompile.load(routed)([TEXT])


def test_routed_plan_links_only_when_asked(base_plan, tmp_path):
    small = _fresh(base_plan, tmp_path, "small")
    big = _fresh(base_plan, tmp_path, "big")
    routed = routed_plan([small, big], tmp_path / "routed", word_calib(tmp_path / "calib.jsonl"), link=True)
    assert os.stat(routed / "candidates" / "big" / "model.onnx").st_ino == os.stat(big / "model.onnx").st_ino
    assert os.stat(routed / "candidates" / "big" / "plan.json").st_ino != os.stat(big / "plan.json").st_ino


def test_plan_json_of_an_external_data_plan_lists_both(base_plan, tmp_path):
    plan_dir = _to_external(_fresh(base_plan, tmp_path))
    raw = json.loads((plan_dir / "plan.json").read_text())
    assert {f["path"] for f in raw["files"].values()} >= {"model.onnx", "model.onnx.data"}


def test_external_data_plan_runs_on_the_test_provider(base_plan, tmp_path, provider):
    """Model bytes and external data from memory work on every execution provider (CI: OpenVINO too)."""
    from helpers import tolerance

    plan_dir = _to_external(_fresh(base_plan, tmp_path))
    want = dyncompile.load(base_plan, provider=provider).predict_proba(TEXTS)
    cm = dyncompile.load(plan_dir, provider=provider)
    np.testing.assert_allclose(cm.predict_proba(TEXTS), want, rtol=0, atol=tolerance(provider))
    assert cm.provider == dyncompile.load(base_plan, provider=provider).provider


def _if_model_with_external_data(plan_dir):
    """A model whose ``If`` branches hold external initializers, and one in the main graph, all in one data file."""
    f32 = ir.DataType.FLOAT
    x, c = ir.val("x", f32, ir.Shape([1, 4])), ir.val("c", ir.DataType.BOOL, ir.Shape([]))
    w = ir.val("W", const_value=ir.tensor(np.arange(16, dtype=np.float32).reshape(4, 4), name="W"))
    w2 = ir.val("W2", const_value=ir.tensor(np.full((4, 4), 2.0, np.float32), name="W2"))

    def branch(name, weight, inits):
        t = ir.tape.Tape()
        y = t.op("MatMul", [x, weight])
        y.name, y.dtype, y.shape = name + "_y", f32, ir.Shape([1, 4])
        return ir.Graph([], [y], nodes=t.nodes, initializers=inits, name=name)

    t = ir.tape.Tape()
    out = t.op("If", [c], {"then_branch": branch("then", w2, [w2]), "else_branch": branch("else", w, [])})
    out.name, out.dtype, out.shape = "out", f32, ir.Shape([1, 4])
    g = ir.Graph([x, c], [out], nodes=t.nodes, initializers=[w], opset_imports={"": 17}, name="g")
    plan_dir.mkdir()
    ir.save(ir.Model(g, ir_version=9), plan_dir / "model.onnx", external_data="model.onnx.data", size_threshold_bytes=0)
    from dyncompile.plan import Plan, Step, file_ref, save_plan

    files = {"model": file_ref(plan_dir, "model.onnx", "main", ["model.onnx.data"]),
             "model.data": file_ref(plan_dir, "model.onnx.data", "external_data")}
    save_plan(Plan(task="custom", files=files, steps=[Step("run_model", {"model": "model"})]), plan_dir)
    return plan_dir


def test_subgraph_external_data_comes_from_the_hashed_bytes(tmp_path, provider, monkeypatch):
    """If-branch weights stored as external data: inlined from the hashed bytes (ORT would look for them on disk)."""
    plan_dir = _if_model_with_external_data(tmp_path / "p")
    plan = load_plan(plan_dir)
    monkeypatch.chdir(tmp_path)  # ORT given bytes resolves relative paths from here: it must not need to
    s = RuntimeContext(plan, dyncompile.runtime.LoadOptions(provider=provider)).session("model")
    x = np.ones((1, 4), np.float32)
    np.testing.assert_allclose(s.run(None, {"x": x, "c": np.array(True)})[0], [[8.0] * 4], atol=1e-5)
    np.testing.assert_allclose(s.run(None, {"x": x, "c": np.array(False)})[0], [[24.0, 28.0, 32.0, 36.0]], atol=1e-5)
    (plan_dir / "model.onnx.data").write_bytes(b"\0" * (plan_dir / "model.onnx.data").stat().st_size)
    with pytest.raises(PlanError, match="changed on disk"):
        RuntimeContext(plan).session("model")


def test_copy_model_brings_and_lists_its_external_data(tmp_path):
    """What an emitter copies from a pipeline (text encoder, VAE) comes with its external data, hashed."""
    from dyncompile.passes.emit import copy_model
    from dyncompile.plan import Plan, Step, save_plan

    src = _if_model_with_external_data(tmp_path / "src")
    out = tmp_path / "plan"
    out.mkdir()
    refs = copy_model(src / "model.onnx", out, "enc/model.onnx", "text_encoder")
    assert [(r.path, r.role, r.external_data) for r in refs] == [
        ("enc/model.onnx", "text_encoder", ["enc/model.onnx.data"]), ("enc/model.onnx.data", "external_data", [])]
    files = {"model": refs[0], "model.data": refs[1]}
    save_plan(Plan(task="custom", files=files, steps=[Step("run_model", {"model": "model"})]), out)
    plan = load_plan(out)
    s = RuntimeContext(plan).session("model")
    assert s.run(None, {"x": np.ones((1, 4), np.float32), "c": np.array(True)})[0].tolist() == [[8.0] * 4]


def test_route_cli_links_only_with_link():
    from dyncompile.tools.cli import _route_parser

    base = ["--candidates", "a", "b", "--calib", "c.jsonl", "-o", "r"]
    assert _route_parser().parse_args(base).link is False
    assert _route_parser().parse_args([*base, "--link"]).link is True
