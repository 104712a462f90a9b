"""Property test (issue #9): a mutated real plan.json — wrong types, missing or extra keys, NaN/inf, huge and
deeply nested values — either loads and runs, or fails with a clean :class:`DyncompileError`; never any
other exception. In-process (``dyncompile.load`` + one prediction) so a few hundred cases take seconds.
"""

from __future__ import annotations

import json

import pytest
from hostile_plans import (
    TEXT,
    classifier_dir,
    decoder_dir,
    generate_plan,
    routed_plan,
    run_model_plan,
    staged_plan,
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
    }
    return {k: (p, json.loads((p / "plan.json").read_text())) for k, p in built.items()}


def _use(plan_dir):
    cm = dyncompile.load(plan_dir)
    if cm.plan.task == "text-generation":
        cm.generate("w3 w4", max_new_tokens=3)
    else:
        cm([TEXT, "w1"])


FUZZ = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("kind", ["classifier", "staged", "speculative", "routed"])
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
            {"plan.json"} | {f.path for f in plan.files.values()} | routed
        )
