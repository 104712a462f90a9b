"""Property test: a mutated real plan.json — wrong types, missing or extra keys, NaN/inf, huge and
deeply nested values — either loads and runs, or fails with a clean :class:`DyncompileError`; never any
other exception. In-process (``dyncompile.load`` + one prediction) so a few hundred cases take seconds.
Classifier, early-exit, speculative, draft-tree, routed and text-to-image plans; and external data: its bytes
changed behind the plan's back (then the answer is the original one or a clean error) and the ONNX file's
external-data references rewritten by a publisher (a clean error, or a plan that runs).
"""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest
from hostile_plans import (
    TEXT,
    classifier_dir,
    decoder_dir,
    diffusion_plan,
    generate_plan,
    routed_plan,
    run_model_plan,
    staged_plan,
    tree_plan,
    word_calib,
)

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import dyncompile  # noqa: E402
from dyncompile.errors import DyncompileError  # noqa: E402

DEEP = "__deeply_nested__"

leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2, 3, 2**31, 2**63, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([float("nan"), float("inf"), float("-inf"), 0.5, 1.5, -0.0]),
    st.text(max_size=12),
    st.sampled_from(["model", "segment0", "tokenizer", "input_ids", "logits", "../plan.json", "/etc/passwd",
                     "entropy", "maxprob", "vibes", "mask", "copy", "model", "prompt-lookup", "eagle", "features",
                     "\x1b[2J", "x" * 5000]),
    st.just(DEEP),
)
values = st.recursive(
    leaves, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
mutations = st.lists(
    st.tuples(st.integers(min_value=0, max_value=10**6),
              st.sampled_from(["replace", "replace", "replace", "delete", "add_key", "wrap", "stringify"]),
              values),
    min_size=1, max_size=3,
)


def _paths(v, prefix=()):
    out = [prefix]
    if isinstance(v, dict):
        for k, x in v.items():
            out += _paths(x, (*prefix, k))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            out += _paths(x, (*prefix, i))
    return out


def _mutate(raw, muts):
    for idx, op, value in muts:
        paths = [p for p in _paths(raw) if p]
        path = paths[idx % len(paths)]
        parent = raw
        for k in path[:-1]:
            parent = parent[k]
        key = path[-1]
        if op == "replace":
            parent[key] = value
        elif op == "delete":
            del parent[key]
        elif op == "add_key":
            if isinstance(parent[key], dict):
                parent[key]["extra_field"] = value
            elif isinstance(parent, dict):
                parent["extra_field"] = value
            else:
                parent.append(value)
        elif op == "wrap":
            parent[key] = [parent[key]]
        else:
            parent[key] = json.dumps(parent[key])
    return raw


def _write(plan_dir, raw):
    text = json.dumps(raw, allow_nan=True)
    text = text.replace(json.dumps(DEEP), "[" * 50_000 + "]" * 50_000)
    (plan_dir / "plan.json").write_text(text)


@pytest.fixture(scope="module")
def plans(module_tmp):
    root = module_tmp("fuzz")
    dec = decoder_dir(root / "dec")
    cls = run_model_plan(classifier_dir(root / "cls"), root / "plan-cls")
    small = run_model_plan(classifier_dir(root / "cls-small"), root / "small")
    big = run_model_plan(classifier_dir(root / "cls-big"), root / "big")
    built = {
        "classifier": cls,
        "routed": routed_plan([small, big], root / "plan-routed", word_calib(root / "calib.jsonl")),
        "staged": staged_plan(root / "plan-staged"),
        "speculative": generate_plan(dec, root / "plan-spec", speculative=True),
        "tree": tree_plan(dec, root / "plan-tree"),
        "diffusion": diffusion_plan(root / "plan-diffusion"),
    }
    return {k: (p, json.loads((p / "plan.json").read_text())) for k, p in built.items()}


def _use(plan_dir):
    return _answer(dyncompile.load(plan_dir))


def _answer(cm):
    if cm.plan.task == "text-generation":
        return np.asarray(cm.generate("w3 w4", max_new_tokens=3).token_ids)
    if cm.plan.task == "text-to-image":
        return cm.generate_images(["w3 w4", "w5"], seed=[0, 1]).images
    return cm.predict_proba([TEXT, "w1"])


FUZZ = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("kind", ["classifier", "staged", "speculative", "tree", "routed", "diffusion"])
def test_mutated_plan_loads_or_fails_cleanly(plans, kind):
    plan_dir, pristine = plans[kind]
    outcomes = {"ran": 0, "clean error": 0}

    @FUZZ
    @given(muts=mutations)
    def check(muts):
        raw = _mutate(json.loads(json.dumps(pristine)), muts)
        _write(plan_dir, raw)
        try:
            _use(plan_dir)
            outcomes["ran"] += 1
        except DyncompileError as e:
            assert str(e).strip(), "an error must say something"
            outcomes["clean error"] += 1

    try:
        check()
    finally:
        _write(plan_dir, pristine)
    # the pristine plan still runs, and the mutations exercised both outcomes
    _use(plan_dir)
    assert outcomes["ran"] > 0 and outcomes["clean error"] > 0, outcomes


def test_fuzz_left_no_files_behind(plans):
    """Loading and running mutated plans wrote nothing into the plan directories."""
    for plan_dir, _ in plans.values():
        plan = dyncompile.load(plan_dir).plan
        routed = {"candidates"} if any(s.kind in ("cascade", "route") for s in plan.steps) else set()
        assert sorted(p.name for p in plan_dir.iterdir()) == sorted(
            {"plan.json"} | {f.path.split("/")[0] for f in plan.files.values()} | routed
        )


# ------------------------------------------------------------------------------------------------ external data


@pytest.fixture(scope="module")
def external_plans(module_tmp, plans):
    """Plans whose weights are external data: the text-to-image plan (its U-Net) and a classifier re-saved so."""
    import onnx

    root = module_tmp("fuzz-ext")
    cls = root / "cls-ext"
    shutil.copytree(plans["classifier"][0], cls)
    m = onnx.load(str(cls / "model.onnx"))
    (cls / "model.onnx").unlink()
    onnx.save_model(m, str(cls / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx.data", size_threshold=1024)
    raw = json.loads((cls / "plan.json").read_text())
    raw["files"]["model"].update(sha256=_sha(cls / "model.onnx"), external_data=["model.onnx.data"])
    raw["files"]["model.data"] = {"path": "model.onnx.data", "sha256": _sha(cls / "model.onnx.data"),
                                  "role": "external_data"}
    (cls / "plan.json").write_text(json.dumps(raw))
    out = {}
    for name, plan_dir, onnx_key, data_key in (("classifier", cls, "model", "model.data"),
                                               ("diffusion", plans["diffusion"][0], "unet", "unet.data")):
        files = json.loads((plan_dir / "plan.json").read_text())["files"]
        out[name] = (plan_dir, files[onnx_key]["path"], files[data_key]["path"], _use(plan_dir))
    return out


def _sha(p) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _rehash(plan_dir, rel):
    raw = json.loads((plan_dir / "plan.json").read_text())
    for fr in raw["files"].values():
        if fr["path"] == rel:
            fr["sha256"] = _sha(plan_dir / rel)
    (plan_dir / "plan.json").write_text(json.dumps(raw))


data_edits = st.lists(
    st.tuples(st.sampled_from(["flip", "truncate", "append", "zero", "delete", "swap"]),
              st.integers(min_value=0, max_value=10**7), st.binary(min_size=1, max_size=64)),
    min_size=1, max_size=3,
)
locations = st.one_of(
    st.sampled_from(["../model.onnx.data", "/etc/passwd", "model.onnx", "", "./model.onnx.data", "sub/../x.data",
                     "model.onnx.data\x00", "C:\\x.data", "plan.json", "tokenizer.json", "nope.data", "//x",
                     "model.onnx.data/", "."]),
    st.text(max_size=20),
)
ref_edits = st.lists(
    st.tuples(st.sampled_from(["location", "offset", "length", "drop_key", "unlist"]),
              st.integers(min_value=0, max_value=10**6), locations,
              st.sampled_from(["0", "-1", "7", "18446744073709551615", "1e3", "x", "", "100000000"])),
    min_size=1, max_size=3,
)


def _edit_data(path, edits):
    for op, i, blob in edits:
        data = path.read_bytes() if path.exists() else b""
        k = i % (len(data) or 1)
        if op == "flip" and data:
            data = data[:k] + bytes([data[k] ^ (blob[0] | 1)]) + data[k + 1:]
        elif op == "truncate":
            data = data[:k]
        elif op == "append":
            data = data + blob
        elif op == "zero":
            data = bytes(len(data))
        elif op == "delete":
            path.unlink(missing_ok=True)
            continue
        elif op == "swap":
            data = blob * (len(data) // len(blob) + 1)
            data = data[: max(len(data) - len(blob), 0)]
        path.write_bytes(data)


def _edit_refs(plan_dir, onnx_rel, edits):
    import onnx

    m = onnx.load(str(plan_dir / onnx_rel), load_external_data=False)
    tensors = [t for t in m.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    for op, i, loc, num in edits:
        if op == "unlist":  # the publisher forgets the data file in plan.json (and rehashes the rest)
            raw = json.loads((plan_dir / "plan.json").read_text())
            raw["files"] = {k: f for k, f in raw["files"].items() if f.get("role") != "external_data"}
            for f in raw["files"].values():
                f.pop("external_data", None)
            (plan_dir / "plan.json").write_text(json.dumps(raw))
            continue
        t = tensors[i % len(tensors)]
        entries = {e.key: e for e in t.external_data}
        if op == "drop_key" and entries:
            key = sorted(entries)[i % len(entries)]
            t.external_data.remove(entries[key])
        elif op in ("location", "offset", "length"):
            if op in entries:
                entries[op].value = loc if op == "location" else num
            else:
                e = t.external_data.add()
                e.key, e.value = op, (loc if op == "location" else num)
    (plan_dir / onnx_rel).write_bytes(m.SerializeToString())
    _rehash(plan_dir, onnx_rel)


def _unhashed_locations(plan_dir, onnx_rel) -> list[str]:
    """External-data locations of the ONNX file that are not (plan-relative) paths of plan.json's file entries."""
    import posixpath

    import onnx

    listed = {f["path"] for f in json.loads((plan_dir / "plan.json").read_text())["files"].values()}
    m = onnx.load(str(plan_dir / onnx_rel), load_external_data=False)
    out = []
    for t in m.graph.initializer:
        loc = {e.key: e.value for e in t.external_data}.get("location")
        if t.data_location == onnx.TensorProto.EXTERNAL and loc is not None:
            rel = posixpath.normpath(posixpath.join(posixpath.dirname(onnx_rel), loc))
            if rel not in listed:
                out.append(loc)
    return out


def _restore(plan_dir, pristine):
    shutil.rmtree(plan_dir)
    shutil.copytree(pristine, plan_dir)


@pytest.mark.parametrize("kind", ["classifier", "diffusion"])
def test_external_data_changed_behind_the_plan_gives_the_original_answer_or_a_clean_error(external_plans, kind,
                                                                                          tmp_path):
    plan_dir, _, data_rel, want = external_plans[kind]
    pristine = tmp_path / "pristine"
    shutil.copytree(plan_dir, pristine)
    outcomes = {"same answer": 0, "clean error": 0}

    @FUZZ
    @given(edits=data_edits, rehash=st.booleans(), after_load=st.booleans())
    def check(edits, rehash, after_load):
        from dyncompile.plan import load_plan
        from dyncompile.runtime.executor import CompiledModel, RuntimeContext

        rehash = rehash and not after_load
        loaded = load_plan(plan_dir) if after_load else None  # hashed now; its sessions are made after the edit
        _edit_data(plan_dir / data_rel, edits)
        if rehash and (plan_dir / data_rel).exists():  # a publisher shipping other weights: any answer may do
            _rehash(plan_dir, data_rel)
        try:
            got = _use(plan_dir) if loaded is None else _answer(CompiledModel(loaded, RuntimeContext(loaded)))
            if not rehash:
                np.testing.assert_array_equal(got, want)
            outcomes["same answer"] += 1
        except DyncompileError as e:
            assert str(e).strip() and "\n" not in str(e).strip(), "one error line"
            outcomes["clean error"] += 1
        finally:
            _restore(plan_dir, pristine)

    check()
    np.testing.assert_array_equal(_use(plan_dir), want)
    assert outcomes["clean error"] > 0, outcomes


@pytest.mark.parametrize("kind", ["classifier", "diffusion"])
def test_rewritten_external_data_references_load_or_fail_cleanly(external_plans, kind, tmp_path):
    plan_dir, onnx_rel, _, want = external_plans[kind]
    pristine = tmp_path / "pristine"
    shutil.copytree(plan_dir, pristine)
    outcomes = {"ran": 0, "clean error": 0}

    @FUZZ
    @given(edits=ref_edits)
    def check(edits):
        _edit_refs(plan_dir, onnx_rel, edits)
        unhashed = _unhashed_locations(plan_dir, onnx_rel)
        try:
            _use(plan_dir)
            assert not unhashed, f"ran with external data that no sha256 covers: {unhashed}"
            outcomes["ran"] += 1
        except DyncompileError as e:
            assert str(e).strip() and "\n" not in str(e).strip(), "one error line"
            outcomes["clean error"] += 1
        finally:
            _restore(plan_dir, pristine)

    check()
    np.testing.assert_array_equal(_use(plan_dir), want)
    assert outcomes["clean error"] > 0, outcomes
