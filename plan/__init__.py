"""The execution plan: a versioned JSON file beside the ONNX files it names, and its one schema.

``plan.json`` (``"format": "dyncompile.plan/v1"``) says which files make up a compiled model (relative
paths + sha256, each with a role), the I/O signature, the tokenizer, and the ordered ``steps`` the
runtime executes with their policy parameters (thresholds, ...). Passes and the compiler produce it;
the runtime only follows it.

The package holds one concern per module:

* :mod:`~dyncompile.plan._typed`: the generic typed-JSON validator (:func:`from_json`): dataclasses as
  schemas, each value checked against its field's annotation and ``lo``/``hi`` range, unknown keys refused;
  every failure is a :class:`~dyncompile.errors.PlanError` naming the field
  (``steps[0].segments[1].threshold``), what it got and what it needs;
* :mod:`~dyncompile.plan.classify`, :mod:`~dyncompile.plan.decode`, :mod:`~dyncompile.plan.diffusion`,
  :mod:`~dyncompile.plan.routing`: each technique's step and policy schemas;
* :mod:`~dyncompile.plan._core`: the container (:class:`Plan`, :class:`Step`, :class:`FileRef`,
  :func:`save_plan`) and the registries :data:`STEP_SCHEMAS` and :data:`POLICY_SCHEMAS`;
* :mod:`~dyncompile.plan.load`: the trust boundary (:func:`load_plan`, :func:`load_subplan`,
  :func:`plan_digest`): a plan may come from a stranger, so everything is checked before any ONNX file opens.
"""

from __future__ import annotations

from dyncompile.plan._core import (
    PLAN_FILENAME,
    PLAN_FORMAT,
    POLICY_SCHEMAS,
    STEP_SCHEMAS,
    FileRef,
    OrtSessionPolicy,
    Plan,
    Step,
    file_ref,
    save_plan,
)
from dyncompile.plan._typed import from_json
from dyncompile.plan.classify import (
    Criterion,
    EarlyExitPolicy,
    RunModelParams,
    Segment,
    StagedEarlyExitParams,
)
from dyncompile.plan.decode import (
    MAX_DIM,
    MAX_POSITIONS,
    DecoderSpec,
    DrafterParams,
    DraftPolicy,
    GenerateParams,
    GenerationConfig,
    KVEntry,
    SparsityPolicy,
    SpeculativeParams,
    SpeculativePolicy,
    TreePolicy,
)
from dyncompile.plan.diffusion import (
    CacheScheduleParams,
    DiffusionDenoiseParams,
    DiffusionEncodeParams,
    FeatureCacheParams,
    PredictStepsParams,
    StopRuleParams,
    VaeDecoderParams,
)
from dyncompile.plan.embed import EMBEDDING_TASKS, PoolingPolicy, pooling_from_sentence_transformers
from dyncompile.plan.load import (
    MAX_DEPTH,
    MAX_PLAN_BYTES,
    SUPPORTED_FORMATS,
    is_plan_dir,
    load_plan,
    load_subplan,
    plan_digest,
)
from dyncompile.plan.routing import (
    RULE_KINDS,
    Candidate,
    CandidateCost,
    RoutedParams,
    RouteParams,
    RoutingPolicy,
    RoutingRule,
)

__all__ = [
    "EMBEDDING_TASKS",
    "PoolingPolicy",
    "pooling_from_sentence_transformers",
    "MAX_DEPTH",
    "MAX_DIM",
    "MAX_PLAN_BYTES",
    "MAX_POSITIONS",
    "PLAN_FILENAME",
    "PLAN_FORMAT",
    "POLICY_SCHEMAS",
    "RULE_KINDS",
    "STEP_SCHEMAS",
    "SUPPORTED_FORMATS",
    "CacheScheduleParams",
    "Candidate",
    "CandidateCost",
    "Criterion",
    "DecoderSpec",
    "DiffusionDenoiseParams",
    "DiffusionEncodeParams",
    "DraftPolicy",
    "DrafterParams",
    "EarlyExitPolicy",
    "FeatureCacheParams",
    "FileRef",
    "OrtSessionPolicy",
    "GenerateParams",
    "GenerationConfig",
    "KVEntry",
    "Plan",
    "PredictStepsParams",
    "RouteParams",
    "RoutedParams",
    "RoutingPolicy",
    "RoutingRule",
    "RunModelParams",
    "Segment",
    "SparsityPolicy",
    "SpeculativeParams",
    "SpeculativePolicy",
    "StagedEarlyExitParams",
    "Step",
    "StopRuleParams",
    "TreePolicy",
    "VaeDecoderParams",
    "file_ref",
    "from_json",
    "is_plan_dir",
    "load_plan",
    "load_subplan",
    "plan_digest",
    "save_plan",
]
