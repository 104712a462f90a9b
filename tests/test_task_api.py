"""The task methods of a loaded plan: each answered by its technique's task API, the others one clear error."""

from __future__ import annotations

import numpy as np
import pytest
from hostile_plans import TEXT, classifier_dir, decoder_dir, generate_plan, run_model_plan, staged_plan

import dyncompile
from dyncompile.errors import DataError
from dyncompile.runtime.classify import ClassifierAPI, Prediction
from dyncompile.runtime.decode.generate import GenerationAPI


@pytest.fixture(scope="module")
def plans(module_tmp):
    root = module_tmp("task-api")
    return {
        "cls": run_model_plan(classifier_dir(root / "cls"), root / "plan-cls"),
        "staged": staged_plan(root / "plan-staged"),
        "gen": generate_plan(decoder_dir(root / "dec"), root / "plan-gen"),
    }


def test_classify_is_calling_the_model_and_agrees_with_predict_proba(plans):
    m = dyncompile.load(plans["cls"])
    assert isinstance(m.task_api, ClassifierAPI)
    texts = [TEXT, "w1 w2", "w8"]
    preds = m.classify(texts)
    assert all(isinstance(p, Prediction) for p in preds)
    assert [(p.label, p.score) for p in preds] == [(p.label, p.score) for p in m(texts)]
    probs = m.predict_proba(texts)
    labels = m.plan.labels
    assert [p.label for p in preds] == [labels[int(k)] for k in probs.argmax(1)]
    np.testing.assert_allclose([p.score for p in preds], probs.max(1), rtol=1e-6)


def test_a_staged_plan_logs_per_row_exits_for_the_drift_guard(plans):
    m = dyncompile.load(plans["staged"])
    texts = [TEXT, "w1 w2", "w8 w9 w10", "w4"]
    preds = m.classify(texts, batch_size=3)
    seen = m.task_api.exit_layers_seen()
    assert seen.tolist() == [p.exit_layer for p in preds] == m.last_info["exit_layer"].tolist()
    m.task_api.reset_exit_log()
    assert m.task_api.exit_layers_seen().size == 0


def test_methods_of_other_tasks_name_the_plans_task(plans):
    cls = dyncompile.load(plans["cls"])
    for call in (lambda: cls.generate("w1"), lambda: cls.generate_images("a shirt")):
        with pytest.raises(DataError, match="this plan's task is 'text-classification'"):
            call()
    gen = dyncompile.load(plans["gen"])
    assert isinstance(gen.task_api, GenerationAPI)
    assert len(gen.generate("w3 w4", max_new_tokens=2).token_ids) <= 2
    for call in (lambda: gen(["w1"]), lambda: gen.classify("w1"), lambda: gen.predict_proba(["w1"]),
                 lambda: gen.drift_report(), lambda: gen.generate_images("a shirt")):
        with pytest.raises(DataError, match="this plan's task is 'text-generation'"):
            call()


def test_the_drift_log_keeps_a_window_of_the_most_recent_rows_in_order(plans):
    m = dyncompile.load(plans["staged"])
    api = m.task_api
    api.EXIT_LOG_WINDOW = 5  # an instance override of the class's window (1 << 20 rows)
    texts = [TEXT, "w1 w2", "w8 w9 w10", "w4", "w5 w6", "w7", "w3 w2 w1"]
    every = []
    for i in range(0, len(texts), 2):  # batches of 2 rows: the ring wraps inside and across batches
        every += [p.exit_layer for p in m.classify(texts[i : i + 2], batch_size=2)]
    assert api.exit_layers_seen().tolist() == every[-5:]
    assert len(api._exit_log) == 5  # grown up to the window, never past it
    m.classify(texts, batch_size=7)  # one batch longer than the window keeps its last rows
    assert api.exit_layers_seen().tolist() == m.last_info["exit_layer"].tolist()[-5:]
    api.reset_exit_log()
    assert api.exit_layers_seen().size == 0
