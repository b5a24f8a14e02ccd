"""Traffic capture off the request path: the ingress hands finished requests to the capture deployment's actor.

`TrafficRecorder` (in each ingress replica) samples, buffers records for up to FLUSH_INTERVAL_S, and sends each batch
to `TrafficCapture` (one Serve replica: a Ray actor) without awaiting it in any request. A background task waits
for the answer only to count what was lost. `TrafficCapture` applies the redaction hook and appends to the store
(traffic_store.ShardWriter). Nothing here can fail a request: a full disk, a dead or slow capture actor or a backlog
drop records and count them (draftline_traffic_dropped{reason}) with a log line.

When the capture actor dies, Serve starts a new one: batches that were on the dead actor are counted as dropped
(actor_unavailable); batches sent after it wait in Serve's router for the replacement and are written.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import random
import time
from typing import Any, Callable, Optional

from ray import serve

from draftline.config import ConfigError, DraftlineConfig, TrafficConfig
from draftline.serving.metrics import TrafficMetrics
from draftline.serving.traffic_store import ShardWriter, traffic_dir

logger = logging.getLogger("ray.serve")

CAPTURE_DEPLOYMENT = "DraftlineTraffic"
FLUSH_INTERVAL_S = 0.2
FLUSH_RECORDS = 64
# A batch the capture actor has not acknowledged within this long is counted as dropped (and cancelled).
DELIVERY_TIMEOUT_S = 120.0
LOG_EVERY_S = 30.0


def load_redaction_hook(import_path: Optional[str]) -> Optional[Callable[[dict], Optional[dict]]]:
    """The `module:function` of serve.traffic.redact, imported; None when unset."""
    if not import_path:
        return None
    module_name, _, attribute = import_path.partition(":")
    fix = "set serve.traffic.redact to `module:function` importable on the cluster (e.g. via its runtime_env)"
    if not module_name or not attribute:
        raise ConfigError(f"serve.traffic.redact={import_path!r} is not `module:function`; {fix}")
    try:
        hook = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"serve.traffic.redact={import_path!r} cannot be imported ({err}); {fix}") from None
    if not callable(hook):
        raise ConfigError(f"serve.traffic.redact={import_path!r} is not callable; {fix}")
    return hook


class _RateLimitedLog:
    """One warning per LOG_EVERY_S per kind, with the count since the last one (a full disk must not flood the log)."""

    def __init__(self) -> None:
        self._last_s: dict[str, float] = {}
        self._pending: dict[str, int] = {}

    def warn(self, kind: str, count: int, message: str) -> None:
        self._pending[kind] = self._pending.get(kind, 0) + count
        now = time.monotonic()
        if now - self._last_s.get(kind, -LOG_EVERY_S) >= LOG_EVERY_S:
            logger.warning("traffic capture dropped %d record(s) (%s): %s", self._pending.pop(kind), kind, message)
            self._last_s[kind] = now


@serve.deployment(name=CAPTURE_DEPLOYMENT, num_replicas=1, ray_actor_options={"num_cpus": 0})
class TrafficCapture:
    """The one writer of the traffic store: redacts and appends batches of records."""

    def __init__(self, config: dict) -> None:
        cfg = DraftlineConfig.model_validate(config)
        traffic = cfg.serve.traffic
        self._redact = load_redaction_hook(traffic.redact)
        self._writer = ShardWriter(traffic_dir(cfg), traffic.shard_bytes, traffic.max_age_days * 86400,
                                   traffic.max_total_bytes)
        self._metrics = TrafficMetrics()
        self._log = _RateLimitedLog()
        self._writer.apply_retention()

    def append(self, records: list[dict]) -> int:
        """Redact and store `records`; returns how many were written (errors are counted, never raised)."""
        kept = [r for r in (self._redacted(record) for record in records) if r is not None]
        if not kept:
            return 0
        try:
            self._writer.append(kept)
        except OSError as err:
            self._metrics.record_dropped("write_error", len(kept))
            self._log.warn("write_error", len(kept), f"{err} (in {self._writer.directory})")
            return 0
        self._metrics.record_written(len(kept))
        return len(kept)

    def _redacted(self, record: dict) -> Optional[dict]:
        if self._redact is None:
            return record
        try:
            return self._redact(record)
        except Exception as err:  # noqa: BLE001 - a user hook: any failure drops the record, never the actor
            self._metrics.record_dropped("redact_error", 1)
            self._log.warn("redact_error", 1, f"serve.traffic.redact raised {type(err).__name__}: {err}")
            return None

    def __del__(self) -> None:
        self._writer.close()


class TrafficRecorder:
    """The ingress side: sampling, batching and fire-and-forget delivery to the capture actor."""

    def __init__(self, handle: Any, traffic: TrafficConfig) -> None:
        self._handle = handle
        self._traffic = traffic
        self._buffer: list[dict] = []
        self._flush_scheduled = False
        self._unacknowledged = 0
        self._deliveries: set[asyncio.Task] = set()  # strong references: a bare task may be garbage-collected
        self._metrics = TrafficMetrics()
        self._log = _RateLimitedLog()

    def sampled(self) -> bool:
        return random.random() < self._traffic.sample_rate

    def record(self, record: dict) -> None:
        """Queue one record; returns at once (called on the ingress event loop)."""
        if self._unacknowledged + len(self._buffer) >= self._traffic.queue_limit:
            self._metrics.record_dropped("backlog", 1)
            self._log.warn("backlog", 1, f"{self._traffic.queue_limit} records are waiting for the capture actor "
                                         "(serve.traffic.queue_limit)")
            return
        self._buffer.append(record)
        if len(self._buffer) >= FLUSH_RECORDS:
            self.flush()
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_later(FLUSH_INTERVAL_S, self.flush)

    def flush(self) -> None:
        self._flush_scheduled = False
        if not self._buffer:
            return
        batch, self._buffer = self._buffer, []
        self._unacknowledged += len(batch)
        task = asyncio.get_running_loop().create_task(self._deliver(batch))
        self._deliveries.add(task)
        task.add_done_callback(self._deliveries.discard)

    async def _deliver(self, batch: list[dict]) -> None:
        try:
            response = self._handle.append.remote(batch)
            try:
                await asyncio.wait_for(response, timeout=DELIVERY_TIMEOUT_S)
            except asyncio.TimeoutError:
                response.cancel()
                raise
        except Exception as err:  # noqa: BLE001 - any failure to deliver drops the batch, never a request
            self._metrics.record_dropped("actor_unavailable", len(batch))
            self._log.warn("actor_unavailable", len(batch), f"the capture actor did not take them ({type(err).__name__})")
        finally:
            self._unacknowledged -= len(batch)
