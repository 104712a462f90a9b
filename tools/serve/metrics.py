"""Prometheus metrics of one replica: requests, latencies, exit layers, acceptance, the drift alarm.

Each replica keeps its own registry (``/metrics`` answers with the replica that takes the scrape, labelled
``replica``); Ray's own metrics (queue lengths, replica counts, HTTP status codes of the proxy) are on Ray's
metrics port.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["ReplicaMetrics"]

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class ReplicaMetrics:
    """The metrics of one replica serving plan ``plan`` (its own ``CollectorRegistry``).

    Args:
        plan: the deployment's name.
        replica: the replica's id.
        exits: the plan's exit layers (early-exit classifiers), the buckets of the exit-layer histogram.
    """

    def __init__(self, plan: str, replica: str, exits: list[int] | None = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"plan": plan, "replica": replica}
        self.labels = labels
        r = self.registry
        names = list(labels)
        self.requests = Counter("dyncompile_requests", "HTTP requests answered", [*names, "endpoint", "code"],
                                registry=r)
        self.latency = Histogram("dyncompile_request_seconds", "request latency inside the replica",
                                 [*names, "endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_rows = Histogram("dyncompile_batch_rows", "rows per batch the plan ran", names,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.rows = Counter("dyncompile_rows", "texts classified or embedded", names, registry=r)
        buckets = sorted(set(exits or [])) or [1]
        self.exit_layer = Histogram("dyncompile_exit_layer", "layer each classified row exited after", names,
                                    buckets=buckets, registry=r)
        self.tokens = Counter("dyncompile_generated_tokens", "new tokens generated", names, registry=r)
        self.drafted = Counter("dyncompile_drafted_tokens", "draft tokens proposed (speculative plans)", names,
                               registry=r)
        self.accepted = Counter("dyncompile_accepted_tokens", "draft tokens accepted", names, registry=r)
        self.acceptance = Gauge("dyncompile_acceptance_rate", "accepted / drafted tokens since start", names,
                                registry=r)
        self.tpot = Histogram("dyncompile_time_per_output_token_seconds", "generation seconds per new token",
                              names, buckets=TOKEN_BUCKETS, registry=r)
        self.ttft = Histogram("dyncompile_time_to_first_token_seconds", "streamed requests: seconds to the first "
                              "token", names, buckets=LATENCY_BUCKETS, registry=r)
        self.images = Counter("dyncompile_images", "images generated", names, registry=r)
        self.unet_calls = Counter("dyncompile_unet_calls", "denoiser calls", names, registry=r)
        self.drift_alarm = Gauge("dyncompile_drift_alarm", "1 when the rows seen exit unlike the calibration's rows "
                                 "(chi-square + total variation; dyncompile.runtime.drift)", names, registry=r)
        self.drift_tv = Gauge("dyncompile_drift_tv", "total variation between seen and calibration exit layers",
                              names, registry=r)
        self.drift_rows = Gauge("dyncompile_drift_rows", "rows the drift check compared", names, registry=r)
        self._drafted = 0
        self._accepted = 0

    def request(self, endpoint: str, code: int, seconds: float) -> None:
        """Count one answered request and its latency."""
        self.requests.labels(**self.labels, endpoint=endpoint, code=str(code)).inc()
        self.latency.labels(**self.labels, endpoint=endpoint).observe(seconds)

    def batch(self, rows: int, exit_layers: Any = None) -> None:
        """One batch the plan ran, with its rows' exit layers (early exit)."""
        self.batch_rows.labels(**self.labels).observe(rows)
        self.rows.labels(**self.labels).inc(rows)
        if exit_layers is not None:
            h = self.exit_layer.labels(**self.labels)
            for layer in exit_layers:
                h.observe(int(layer))

    def generation(self, stats: Any) -> None:
        """One generation's statistics (``GenerationStats``)."""
        self.tokens.labels(**self.labels).inc(stats.new_tokens)
        if stats.new_tokens:
            self.tpot.labels(**self.labels).observe(stats.seconds / stats.new_tokens)
        if stats.drafted:
            self._drafted += stats.drafted
            self._accepted += stats.accepted
            self.drafted.labels(**self.labels).inc(stats.drafted)
            self.accepted.labels(**self.labels).inc(stats.accepted)
            self.acceptance.labels(**self.labels).set(self._accepted / self._drafted)

    def drift(self, verdict: Any) -> None:
        """The drift guard's latest verdict (``DriftVerdict``)."""
        self.drift_alarm.labels(**self.labels).set(1.0 if verdict.drift else 0.0)
        self.drift_rows.labels(**self.labels).set(verdict.rows)
        if verdict.tv is not None:
            self.drift_tv.labels(**self.labels).set(verdict.tv)

    def text(self) -> bytes:
        """The Prometheus text exposition of this replica's metrics."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
