"""The diffusion step handlers and the text-to-image task API on stand-in sessions (no model, no ORT).

The real pipeline is exercised end to end in test_diffusion.py; here the handlers' reading of the typed
plan schema, the step policies and the request checks run in milliseconds.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

from dyncompile.errors import DataError, PlanError
from dyncompile.plan import Step
from dyncompile.runtime.diffusion.api import ImagesAPI
from dyncompile.runtime.diffusion.steps import DiffusionDenoiseStep, PredictStepsStep
from dyncompile.runtime.registry import TaskAPI, task_api_for

SCHED = {"_class_name": "DDIMScheduler", "num_train_timesteps": 1000, "beta_schedule": "linear",
         "timestep_spacing": "trailing", "set_alpha_to_one": True}


class _Unet:
    """Predicts zero noise: DDIM then keeps rescaling the sample, deterministically."""

    def __init__(self):
        self.calls = 0

    def get_inputs(self):
        return [types.SimpleNamespace(name=n) for n in ("sample", "timestep", "encoder_hidden_states")]

    def get_outputs(self):
        return [types.SimpleNamespace(name="out_sample")]

    def run(self, names, feeds):
        self.calls += 1
        return [np.zeros_like(feeds["sample"])]


def _ctx(unet):
    return types.SimpleNamespace(session=lambda key: unet, plan=None)


def _denoise(**over):
    params = {"unet": "unet", "scheduler": SCHED, "sample_shape": [1, 4, 4], "guidance_scale": 2.0,
              "num_inference_steps": 3, **over}
    unet = _Unet()
    return DiffusionDenoiseStep(Step("diffusion_denoise", params), _ctx(unet)), unet


def _state(n=2, **over):
    return {"ctx": np.zeros((n, 2, 3), np.float32), "null_ctx": np.zeros((1, 2, 3), np.float32),
            "seeds": list(range(n)), **over}


def test_denoise_reads_the_typed_schema_and_runs_the_plan_step_count():
    step, unet = _denoise(output_crop=[0, 3, 1, 4])
    out = step.run(_state())
    assert out["policy"] == "fixed"
    assert out["steps"].tolist() == [3, 3]
    assert out["images"].shape == (2, 3, 3) and out["images"].dtype == np.uint8
    assert out["unet_calls"] == unet.calls == 3  # one U-Net call per step on [uncond; cond]


def test_denoise_explicit_step_count_and_per_row_predicted_counts():
    step, _ = _denoise()
    assert step.run(_state(num_inference_steps=5))["steps"].tolist() == [5, 5]
    out = step.run(_state(step_policy="predicted", predicted_steps=np.array([2, 4])))
    assert out["policy"] == "predicted" and out["steps"].tolist() == [2, 4]


def test_denoise_policies_the_plan_cannot_serve_are_one_data_error():
    step, _ = _denoise()
    with pytest.raises(DataError, match="no online stop rule"):
        step.run(_state(step_policy="online"))
    with pytest.raises(DataError, match="no step predictor"):
        step.run(_state(step_policy="predicted"))


def test_denoise_online_policy_uses_the_plans_stop_rule():
    rule = {"kind": "x0_change", "threshold": 0.5, "max_steps": 6, "min_steps": 2}
    step, _ = _denoise(stop_rule=rule, default_policy="online")
    out = step.run(_state())
    assert out["policy"] == "online"
    assert ((out["steps"] >= 2) & (out["steps"] <= 6)).all()


@pytest.mark.parametrize(("over", "match"), [
    ({"scheduler": {"_class_name": "EulerScheduler"}}, "not implemented"),
    ({"eta": 0.5}, "eta"),
    ({"default_policy": "online"}, "stop_rule"),
    ({"sample_shape": [1, 4]}, "sample_shape"),
    ({"num_inference_steps": 1001}, "num_inference_steps"),
])
def test_denoise_refuses_bad_parameters_at_load(over, match):
    with pytest.raises(PlanError, match=match):
        _denoise(**over)


def test_unet_inputs_must_match_the_plan():
    with pytest.raises(PlanError, match="U-Net's inputs"):
        _denoise(input_names=["x", "t", "c"])


def test_predict_steps_rounds_up_onto_the_grid():
    params = {"weights": [1.0], "bias": 0.0, "mean": [0.0], "scale": [1.0], "grid": [2, 4, 8], "offset": 0.0}
    step = PredictStepsStep(Step("predict_steps", params), _ctx(None))
    out = step.run({"text_features": np.array([[1.0], [1.5], [2.5], [9.0]])})
    # log2 steps = f: 2 -> 2, 2.83 -> 4, 5.66 -> 8, 512 -> the grid's largest
    assert out["predicted_steps"].tolist() == [2, 4, 8, 8]
    np.testing.assert_allclose(out["predicted_log2_steps"], [1.0, 1.5, 2.5, 9.0])


def _model(task):
    return types.SimpleNamespace(plan=types.SimpleNamespace(task=task), handlers=[])


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"prompts": ["ok", " "]}, "prompt #1 is empty"),
    ({"prompts": "x", "policy": "sometimes"}, "policy="),
    ({"prompts": "x", "steps": 0}, "steps=0"),
    ({"prompts": "x", "guidance": 0.5}, "guidance="),
    ({"prompts": "x", "noise_source": "dice"}, "noise source"),
    ({"prompts": ["a", "b"], "seed": [1]}, "1 seeds for 2 prompts"),
])
def test_image_requests_are_checked_before_anything_runs(kwargs, match):
    api = ImagesAPI(_model("text-to-image"))
    with pytest.raises(DataError, match=match):
        api.generate_images(**kwargs)


def test_each_task_has_its_api_and_other_methods_name_the_task():
    assert task_api_for("text-to-image") is ImagesAPI
    api = task_api_for("text-to-image")(_model("text-to-image"))
    for call in (lambda: api.classify(["x"]), lambda: api.generate("x"), lambda: api.drift_report()):
        with pytest.raises(DataError, match="this plan's task is 'text-to-image'"):
            call()
    with pytest.raises(DataError, match="generate_images\\(\\) is for text-to-image plans; this plan's task is 'text-generation'"):
        TaskAPI(_model("text-generation")).generate_images("x")
