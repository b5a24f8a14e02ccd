"""Prometheus metrics of the Serve app, through Ray's metrics API (`ray.util.metrics`).

Ray exports them with its own metrics (prefixed `ray_`) on every node's metrics export port
(`ray metrics launch-prometheus`, or scrape `<node>:<metrics_export_port>/metrics`); docs/serving.md lists them.
Created once per replica process: the ingress records request-level series, the engine replica its model version.
"""

from __future__ import annotations

import collections
from typing import Optional

from draftline.engines.base import SpecStats

LATENCY_BOUNDARIES_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]
ACCEPT_LENGTH_BOUNDARIES = [1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0]
TOKENS_PER_S_BOUNDARIES = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000]


class IngressMetrics:
    """Per-request series, tagged with the route and, where known, the model version that answered."""

    def __init__(self) -> None:
        from ray.util.metrics import Counter, Histogram

        self.requests = Counter(
            "draftline_requests",
            description="HTTP requests by route and status code",
            tag_keys=("route", "status"),
        )
        self.latency_s = Histogram(
            "draftline_request_latency_s",
            description="end-to-end request latency in seconds (to the last byte for streams)",
            boundaries=LATENCY_BOUNDARIES_S,
            tag_keys=("route",),
        )
        self.time_to_first_token_s = Histogram(
            "draftline_time_to_first_token_s",
            description="seconds from request arrival to the first generated token",
            boundaries=LATENCY_BOUNDARIES_S,
            tag_keys=("route",),
        )
        self.accept_length = Histogram(
            "draftline_spec_accept_length",
            description="speculative accept length per request (tokens per target verify step, bonus included)",
            boundaries=ACCEPT_LENGTH_BOUNDARIES,
            tag_keys=("model_version",),
        )
        self.output_tokens_per_s = Histogram(
            "draftline_output_tokens_per_s",
            description="generated tokens per second of generation time, per request",
            boundaries=TOKENS_PER_S_BOUNDARIES,
            tag_keys=("model_version",),
        )
        self.output_tokens = Counter(
            "draftline_output_tokens",
            description="generated tokens",
            tag_keys=("model_version",),
        )

    def record_status(self, route: str, status: int) -> None:
        self.requests.inc(1, tags={"route": route, "status": str(status)})

    def record_generation(
        self,
        route: str,
        model_version: str,
        latency_s: float,
        first_token_s: Optional[float],
        generation_s: float,
        stats: Optional[SpecStats],
        completion_tokens: int,
    ) -> None:
        self.latency_s.observe(latency_s, tags={"route": route})
        if first_token_s is not None:
            self.time_to_first_token_s.observe(first_token_s, tags={"route": route})
        version_tags = {"model_version": model_version}
        if stats is not None and stats.verify_steps:
            self.accept_length.observe(stats.accept_length, tags=version_tags)
        if completion_tokens and generation_s > 0:
            self.output_tokens_per_s.observe(completion_tokens / generation_s, tags=version_tags)
        self.output_tokens.inc(completion_tokens, tags=version_tags)


class EngineMetrics:
    """Which version each engine replica serves (1 = serving, 0 = retired) and engine swaps."""

    def __init__(self) -> None:
        from ray.util.metrics import Counter, Gauge

        self.serving = Gauge(
            "draftline_engine_serving",
            description="1 while this replica serves the tagged model version, 0 after it was replaced",
            tag_keys=("model_version", "backend"),
        )
        self.swaps = Counter(
            "draftline_engine_swaps",
            description="model version changes applied by reconfigure",
            tag_keys=("model_version",),
        )

    def record_swap(self, backend: str, new_version: str, old_version: Optional[str]) -> None:
        if old_version is not None:
            self.serving.set(0, tags={"model_version": old_version, "backend": backend})
        self.serving.set(1, tags={"model_version": new_version, "backend": backend})
        self.swaps.inc(1, tags={"model_version": new_version})


class LiveAcceptMetrics:
    """Live acceptance per served version and client segment, and the drift verdict per version (docs/traffic.md).

    The live accept length over any interval is rate(draftline_live_output_tokens) / rate(draftline_live_verify_steps)
    for a version and segment; draftline_drift_window_accept_length is the drift check's window mean."""

    def __init__(self) -> None:
        from ray.util.metrics import Counter, Gauge, Histogram

        tags = ("model_version", "segment")
        self.accept_length = Histogram(
            "draftline_live_accept_length",
            description="speculative accept length per finished request, by served version and client segment",
            boundaries=ACCEPT_LENGTH_BOUNDARIES,
            tag_keys=tags,
        )
        self.verify_steps = Counter("draftline_live_verify_steps", description="target verify steps", tag_keys=tags)
        self.output_tokens = Counter(
            "draftline_live_output_tokens", description="tokens emitted over those verify steps", tag_keys=tags
        )
        self.window_accept_length = Gauge(
            "draftline_drift_window_accept_length",
            description="mean accept length over the drift check's last serve.drift.window_requests requests",
            tag_keys=("model_version",),
        )
        self.drift = Gauge(
            "draftline_drift",
            description="1 once the version's live accept length fell below the gate's by serve.drift.margin",
            tag_keys=("model_version",),
        )
        self.refresh_jobs = Counter(
            "draftline_refresh_jobs",
            description="refresh jobs a drift started (serve.drift.refresh), by outcome: submitted, "
            "already_submitted (by another ingress replica, or before), failed (not submitted in time)",
            tag_keys=("model_version", "outcome"),
        )

    def record(self, model_version: str, segment: str, stats: SpecStats) -> None:
        tags = {"model_version": model_version, "segment": segment}
        self.accept_length.observe(stats.accept_length, tags=tags)
        self.verify_steps.inc(stats.verify_steps, tags=tags)
        self.output_tokens.inc(stats.output_tokens, tags=tags)

    def record_window(self, model_version: str, mean_accept_length: float) -> None:
        self.window_accept_length.set(mean_accept_length, tags={"model_version": model_version})

    def record_drift(self, model_version: str) -> None:
        self.drift.set(1, tags={"model_version": model_version})

    def record_refresh_job(self, model_version: str, outcome: str) -> None:
        self.refresh_jobs.inc(1, tags={"model_version": model_version, "outcome": outcome})


class TrafficMetrics:
    """Traffic capture: records written to the store and records dropped (by reason), never a failed request."""

    def __init__(self) -> None:
        from ray.util.metrics import Counter

        self.dropped_by_reason: collections.Counter[str] = collections.Counter()  # this process's totals, for logs
        self.written = Counter("draftline_traffic_written", description="records appended to the traffic store")
        self.dropped = Counter(
            "draftline_traffic_dropped",
            description="records not stored: write_error (e.g. a full disk), actor_unavailable (the capture actor "
            "died or did not answer), backlog (serve.traffic.queue_limit), redact_error",
            tag_keys=("reason",),
        )

    def record_written(self, count: int) -> None:
        if count:
            self.written.inc(count)

    def record_dropped(self, reason: str, count: int) -> None:
        if count:
            self.dropped.inc(count, tags={"reason": reason})
            self.dropped_by_reason[reason] += count
