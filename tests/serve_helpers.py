"""Starting the draftline Serve app on 127.0.0.1 for e2e tests, and a small concurrent HTTP load generator."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections import Counter
from typing import Iterator, Optional

import httpx


def start_serving(cfg) -> str:
    """Start Serve on cfg.serve.host:port (a fresh Serve instance) and deploy the champion; returns the base URL.
    (An HTTP proxy killed by Serve's controller while serve.start waits for it is waited for by serve_champion.)"""
    from ray import serve

    from draftline.serving.control import serve_champion

    serve.shutdown()
    return serve_champion(cfg)


def stop_serving() -> None:
    from ray import serve

    serve.shutdown()


CHAT_BODY = {"messages": [{"role": "user", "content": "Name a Python builtin."}], "max_tokens": 8, "temperature": 0}


class FailedRequest(Exception):
    """A request that got no 200: its HTTP status (None: no HTTP answer at all) and body."""

    def __init__(self, status: Optional[int], body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status, self.body = status, body

    @property
    def openai_shaped(self) -> bool:
        """The body is OpenAI's error shape {"error": {"message", "type", "param", "code"}} with a code."""
        try:
            error = json.loads(self.body)["error"]
        except (ValueError, KeyError, TypeError):
            return False
        return isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error) and bool(error["code"])


async def _loop_load(url: str, stop: threading.Event, max_s: float, clients: int, body: dict, results: list) -> None:
    """`clients` loops until `stop` or max_s; each result, appended to `results` as it comes, is
    (start_s, end_s, version or FailedRequest)."""
    deadline = time.monotonic() + max_s

    async def client() -> None:
        async with httpx.AsyncClient(timeout=120) as http:
            while not stop.is_set() and time.monotonic() < deadline:
                started = time.monotonic()
                try:
                    response = await http.post(f"{url}/v1/chat/completions", json=body)
                    if response.status_code == 200:
                        outcome: object = response.json()["draftline"]["model_version"]
                    else:
                        outcome = FailedRequest(response.status_code, response.text)
                except httpx.HTTPError as err:
                    outcome = FailedRequest(None, f"{type(err).__name__}: {err}")
                results.append((started, time.monotonic(), outcome))

    await asyncio.gather(*(client() for _ in range(clients)))


@contextlib.contextmanager
def under_load(url: str, max_s: float = 40.0, clients: int = 4, body: Optional[dict] = None) -> Iterator[list]:
    """`clients` clients post chat completions to `url` for the with-block (max_s at most); the yielded list fills,
    as requests end, with (start_s, end_s, model version or FailedRequest) per request (time.monotonic)."""
    stop = threading.Event()
    results: list = []
    load = threading.Thread(target=lambda: asyncio.run(_loop_load(url, stop, max_s, clients, body or CHAT_BODY, results)))
    load.start()
    try:
        yield results
    finally:
        stop.set()
        load.join(timeout=max_s + 60)
    assert not load.is_alive()


def wait_for_answers(results: list, count: int, after: float = float("-inf"), timeout_s: float = 300) -> None:
    """Poll until under_load's `results` hold `count` answered requests that started after `after` (time.monotonic).
    Not a fixed sleep: at load 10-20 the first requests of a fresh app took over 5 s, and a test that slept 4 s saw
    none (CI, 2026-12-08)."""
    deadline = time.monotonic() + timeout_s
    while sum(start > after and not isinstance(outcome, Exception) for start, _, outcome in list(results)) < count:
        if time.monotonic() > deadline:
            failures, _ = outcomes(list(results))
            raise AssertionError(f"fewer than {count} requests answered within {timeout_s:.0f} s "
                                 f"({len(results)} ended, {len(failures)} failed: {[str(f)[:120] for f in failures[:3]]})")
        time.sleep(0.2)


def outcomes(results: list) -> tuple[list, Counter]:
    """(failed requests, Counter of the versions that answered) of under_load's results."""
    failures = [outcome for _, _, outcome in results if isinstance(outcome, Exception)]
    return failures, Counter(outcome for _, _, outcome in results if not isinstance(outcome, Exception))
