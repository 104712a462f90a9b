"""StepSaver: diffusion pipelines as plans, and per-prompt denoising step counts.

* ``pipeline`` — pipeline folders as compile inputs, the ``diffusion`` plan emitter;
* ``metrics`` — SSIM, Fréchet distance, texture measure (calibration labels and the bench);
* ``calibrate`` — calibration runs (the runtime's own denoising loop), labels, the step head and stop rule fits;
* ``step_saver_pass`` — ``StepSaverPass`` (``--passes step-saver``), which lowers them into the plan.
"""

from dyncompile.passes.step_saver import pipeline  # noqa: F401  (registers the diffusion emitter)
from dyncompile.passes.step_saver.step_saver_pass import StepSaverPass

__all__ = ["StepSaverPass", "pipeline"]
