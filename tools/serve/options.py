"""What ``dyncompile serve`` serves and how: the options, and each plan's kind (no Ray imported here)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from dyncompile.errors import DataError
from dyncompile.plan import EMBEDDING_TASKS
from dyncompile.runtime.providers import MEMORY_MODES

__all__ = ["KINDS", "PlanInfo", "ServeOptions", "plan_info"]

#: plan task -> what the deployment serves
KINDS = {"text-classification": "classify", "text-generation": "generate", "text-to-image": "images"}


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """How plans are served.

    Attributes:
        host, port: where Ray Serve's HTTP proxy listens (loopback by default).
        replicas: replicas of each plan's deployment (Ray places them on the cluster's nodes).
        replica_cpus: CPUs Ray reserves for each replica (placement; ORT uses ``threads``).
        max_ongoing_requests: requests one replica works on at once (default: 64 classify/embeddings, 2
            generation, 1 images); more wait in Ray's queue.
        max_queued_requests: requests waiting for a replica beyond which Ray answers 503 (back-pressure).
        max_batch_size, batch_wait_ms: dynamic batching of classify/embeddings rows (``@serve.batch``).
        provider, threads, spinning: how each replica loads its plan (see ``dyncompile.load``).
        memory: ``dyncompile.load``'s ``memory`` for each replica; None: ``arena`` when rows are batched
            (``max_batch_size`` > 1: ORT's arena is faster from 4 rows a call), else ``auto``. ``malloc`` keeps a
            replica's memory near its model's size (MiniLM-L6, 4,000 calls of 1-32 rows in one process: 231 -> 282
            MiB with ``malloc``, 231 -> 530 MiB with the arena) at the arena's batched speed cost.
        request_timeout_s: Ray Serve's HTTP request timeout (None: none).
        address: a running Ray cluster to join (``ray.init(address=...)``); None starts Ray in this process.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    replicas: int = 1
    replica_cpus: float = 1.0
    max_ongoing_requests: int | None = None
    max_queued_requests: int = 256
    max_batch_size: int = 32
    batch_wait_ms: float = 5.0
    provider: str = "cpu"
    threads: int | None = None
    spinning: bool = False
    memory: str | None = None
    request_timeout_s: float | None = None
    address: str | None = None

    def __post_init__(self) -> None:
        """Check every number: one clear error naming the option."""
        checks = [("replicas", self.replicas, 1), ("max_batch_size", self.max_batch_size, 1),
                  ("max_queued_requests", self.max_queued_requests, -1), ("port", self.port, 0)]
        if self.max_ongoing_requests is not None:
            checks.append(("max_ongoing_requests", self.max_ongoing_requests, 1))
        if self.threads is not None:
            checks.append(("threads", self.threads, 1))
        for name, value, low in checks:
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise DataError(f"serve option {name} must be an integer >= {low}, got {value!r}")
        if not (0 <= self.batch_wait_ms <= 10_000):
            raise DataError(f"serve option batch_wait_ms must be in 0..10000, got {self.batch_wait_ms!r}")
        if self.memory is not None and self.memory not in MEMORY_MODES:
            raise DataError(f"serve option memory must be one of {', '.join(MEMORY_MODES)}, got {self.memory!r}")
        if not self.replica_cpus >= 0:
            raise DataError(f"serve option replica_cpus must be >= 0, got {self.replica_cpus!r}")

    @property
    def replica_memory(self) -> str:
        """``dyncompile.load``'s ``memory`` for a replica (``memory``, or ``arena`` when rows are batched)."""
        if self.memory is not None:
            return self.memory
        return "arena" if self.max_batch_size > 1 else "auto"

    def ongoing(self, kind: str) -> int:
        """Requests one replica of a ``kind`` deployment works on at once."""
        if self.max_ongoing_requests is not None:
            return self.max_ongoing_requests
        return {"classify": 64, "embed": 64, "generate": 2, "images": 1}[kind]


@dataclasses.dataclass(frozen=True)
class PlanInfo:
    """One plan to serve: its folder (absolute), deployment name, task and kind (classify/generate/images/embed)."""

    path: str
    name: str
    task: str
    kind: str


def plan_info(plan_dir: str | Path, name: str | None = None) -> PlanInfo:
    """Read ``plan_dir``'s task (the plan's JSON, schema-checked; hashes are checked when a replica loads it)."""
    from dyncompile.plan import load_plan

    path = Path(plan_dir).expanduser().resolve()
    if not (path / "plan.json").is_file():
        raise DataError(f"{plan_dir}: not a plan folder (no plan.json); compile a model first (dyncompile MODEL -o DIR)")
    plan = load_plan(path, verify_hashes=False)
    kind = "embed" if plan.task in EMBEDDING_TASKS else KINDS.get(plan.task)
    if kind is None:
        raise DataError(f"{plan_dir}: plans of task {plan.task!r} cannot be served (classifier, decoder, text-to-image "
                        "and sentence-embedding plans can)")
    name = name or re.sub(r"[^A-Za-z0-9_.-]+", "-", path.name).strip("-.") or "plan"
    return PlanInfo(str(path), name, plan.task, kind)
