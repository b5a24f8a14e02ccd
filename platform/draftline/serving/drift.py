"""Drift check: a served version's live accept length against the one its gate measured.

Each ingress replica keeps, per served version, the accept lengths of its last `serve.drift.window_requests`
finished requests. When the window is full and its mean is below the gate's accept length x (1 - serve.drift.margin),
the version drifted: the ingress tags it `drift=yes` on the MLflow version, sets the draftline_drift gauge and logs
a line, once per version and replica; with serve.drift.refresh it also starts the refresh (serving/refresh_job.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Drift:
    model_version: str
    live_accept_length: float
    gate_accept_length: float
    window_requests: int
    margin: float

    def detail(self) -> dict:
        return {"live_accept_length": round(self.live_accept_length, 4),
                "gate_accept_length": round(self.gate_accept_length, 4),
                "window_requests": self.window_requests, "margin": self.margin}


class DriftMonitor:
    """Windows of live accept length per version; `observe` returns a Drift the first time a version drifts."""

    def __init__(self, window_requests: int, margin: float) -> None:
        self.window_requests = window_requests
        self.margin = margin
        self._windows: dict[str, deque[float]] = {}
        self._gate: dict[str, Optional[float]] = {}
        self._drifted: set[str] = set()

    def knows_gate(self, model_version: str) -> bool:
        """Whether the gate's accept length was asked for already (None when the gate measured none)."""
        return model_version in self._gate

    def set_gate(self, model_version: str, accept_length: Optional[float]) -> None:
        self._gate[model_version] = accept_length

    def window_mean(self, model_version: str) -> Optional[float]:
        window = self._windows.get(model_version)
        return sum(window) / len(window) if window else None

    def observe(self, model_version: str, accept_length: float) -> Optional[Drift]:
        self._windows.setdefault(model_version, deque(maxlen=self.window_requests)).append(accept_length)
        return self.judge(model_version)

    def judge(self, model_version: str) -> Optional[Drift]:
        """A Drift the first time the version's full window is below the gate's value by the margin, else None
        (also called when the gate's value arrives, so a window filled meanwhile is judged without new requests)."""
        window = self._windows.get(model_version, ())
        gate = self._gate.get(model_version)
        if gate is None or model_version in self._drifted or len(window) < self.window_requests:
            return None
        live = sum(window) / len(window)
        if live >= gate * (1 - self.margin):
            return None
        self._drifted.add(model_version)
        return Drift(model_version, live, gate, self.window_requests, self.margin)
