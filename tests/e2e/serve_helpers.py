"""Starting the draftline Serve app on 127.0.0.1 for e2e tests, and a small concurrent HTTP load generator."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import httpx


def start_serving(cfg) -> str:
    """Start Serve on cfg.serve.host:port (a fresh Serve instance) and deploy the champion; returns the base URL."""
    from ray import serve

    from draftline.serving.control import serve_champion

    serve.shutdown()
    return serve_champion(cfg)


def stop_serving() -> None:
    from ray import serve

    serve.shutdown()


@dataclass
class LoadResult:
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    versions: Counter = field(default_factory=Counter)
    latencies_s: list[float] = field(default_factory=list)


async def _client(url: str, body: dict, stop_at: float, result: LoadResult, headers: Optional[dict]) -> None:
    async with httpx.AsyncClient(timeout=60) as http:
        while time.monotonic() < stop_at:
            started = time.monotonic()
            try:
                response = await http.post(url, json=body, headers=headers)
            except httpx.HTTPError as err:
                result.failures.append(f"{type(err).__name__}: {err}")
                continue
            if response.status_code != 200:
                result.failures.append(f"HTTP {response.status_code}: {response.text[:300]}")
                continue
            payload = response.json()
            result.ok += 1
            result.versions[payload["draftline"]["model_version"]] += 1
            result.latencies_s.append(time.monotonic() - started)


async def run_load(
    url: str, body: dict, clients: int, duration_s: float, headers: Optional[dict] = None
) -> LoadResult:
    """`clients` concurrent loops posting `body` until `duration_s` has passed."""
    result = LoadResult()
    stop_at = time.monotonic() + duration_s
    await asyncio.gather(*(_client(url, body, stop_at, result, headers) for _ in range(clients)))
    return result
