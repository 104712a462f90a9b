"""The step index: importing it registers every built-in step handler (and ``run_model``, defined here)."""

from __future__ import annotations

from typing import Any

import numpy as np

import dyncompile.runtime.classify  # noqa: F401  (registers the text-classification task API)
import dyncompile.runtime.decode.generate  # noqa: F401  (registers generate and the text-generation task API)
import dyncompile.runtime.decode.speculative  # noqa: F401  (registers speculative_generate)
import dyncompile.runtime.diffusion.api  # noqa: F401  (registers the text-to-image task API)
import dyncompile.runtime.diffusion.steps  # noqa: F401  (registers diffusion_encode, predict_steps, diffusion_denoise)
import dyncompile.runtime.early_exit  # noqa: F401  (registers early_exit_staged)
import dyncompile.runtime.embed  # noqa: F401  (registers the sentence-embedding task API)
import dyncompile.runtime.routing.route  # noqa: F401  (registers cascade, route)
from dyncompile.plan import STEP_SCHEMAS
from dyncompile.runtime.registry import StepHandler, register_step

__all__ = ["RunModelStep"]


@register_step("run_model")
class RunModelStep(StepHandler):
    """Run one ONNX file: feeds are taken from the state by input name; outputs are added to it.

    Params: ``model`` (file key); optional ``outputs`` mapping ONNX output name -> state name.
    """

    def __init__(self, step, ctx) -> None:
        """Open the model's session."""
        super().__init__(step, ctx)
        p = step.typed or STEP_SCHEMAS["run_model"](step.params, "run_model step")  # validated
        self.model = p.model
        self.session = ctx.session(p.model)
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.rename = dict(p.outputs)

    def run(self, state: dict[str, Any]) -> dict[str, Any]:
        """Run the model on the state's arrays named like its inputs (a several-row call: the batched session)."""
        feeds = {n: state[n] for n in self.input_names}
        first = np.shape(feeds[self.input_names[0]]) if self.input_names else ()
        session = self.ctx.session(self.model, first[0] if len(first) > 1 else None)
        results = session.run(self.output_names, feeds)
        for name, val in zip(self.output_names, results):
            state[self.rename.get(name, name)] = np.asarray(val)
        return state
