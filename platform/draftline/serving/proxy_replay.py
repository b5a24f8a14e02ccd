"""Ray Serve's HTTP proxy sends a request again when the ingress replica that had it died before answering.

Issue 18, fault 5: a SIGKILLed ingress replica. Ray 2.60's proxy (serve/_private/proxy.py) does not retry a request
whose replica died, and answers it with nothing (http_util.send_http_response_on_exception writes a body only for
408, 429 and 503), so uvicorn writes a plain-text "500 Internal Server Error". Nothing had reached the client, so
the request can safely run again, on the other ingress replica (serve.ingress_replicas) or on Serve's replacement.

The proxy takes Starlette middlewares from the callback named by RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH, read in
the proxy's process when it starts. draftline's local cluster sets it for its processes (raycluster); a cluster
started with `ray start` needs it in that command's environment (docs/serving.md).

The middleware keeps the request body (bodies declared above REPLAY_MAX_BYTES pass through once, unkept), and while
the proxy returns without starting a response and the client is still connected, runs the request again with a
growing pause, for up to DRAFTLINE_INGRESS_RETRY_S seconds (default 60; Serve replaced a killed ingress replica in
18-50 s on this machine). Then it answers 503 `ingress_failed` in OpenAI's error shape, with Retry-After.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import Any, Awaitable, Callable

from draftline.serving.openai_schema import ErrorBody, ErrorResponse

logger = logging.getLogger("ray.serve")

RETRY_ENV = "DRAFTLINE_INGRESS_RETRY_S"
REPLAY_MAX_BYTES = 8 << 20
FIRST_PAUSE_S, LONGEST_PAUSE_S = 0.25, 2.0

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def middlewares() -> list:
    """The proxy callback (raycluster.SERVE_PROXY_CALLBACK names it): Ray calls it in the proxy process and wraps
    its ASGI app in what it returns."""
    from starlette.middleware import Middleware

    return [Middleware(ReplayUnansweredRequests)]


def _declared_length(scope: dict) -> int | None:
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length" and value.strip().isdigit():
            return int(value)
    return None


class _Receive:
    """The request's body messages again, then the client's own receive (which reports a disconnect)."""

    def __init__(self, kept: list[Message], receive: Receive) -> None:
        self._kept, self._receive, self.disconnected = list(kept), receive, False

    async def __call__(self) -> Message:
        if self._kept:
            return self._kept.pop(0)
        message = await self._receive()
        self.disconnected |= message["type"] == "http.disconnect"
        return message


class ReplayUnansweredRequests:
    """ASGI middleware of the Serve proxy: see the module docstring."""

    def __init__(self, app: Callable, retry_s: float | None = None) -> None:
        self.app = app
        self.retry_s = float(os.environ.get(RETRY_ENV, "60")) if retry_s is None else retry_s

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        declared = _declared_length(scope)
        if scope["type"] != "http" or (declared is not None and declared > REPLAY_MAX_BYTES):
            await self.app(scope, receive, send)
            return
        kept, kept_bytes = [], 0
        while True:
            message = await receive()
            kept.append(message)
            kept_bytes += len(message.get("body", b""))
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
            if kept_bytes > REPLAY_MAX_BYTES:  # no Content-Length (chunked) and too long to keep: once, unkept
                await self.app(scope, _Receive(kept, receive), send)
                return
        if kept[-1]["type"] == "http.disconnect":
            return
        started_s, pause_s, tries = time.monotonic(), FIRST_PAUSE_S, 0
        while True:
            answered = False

            async def tracking_send(message: Message) -> None:
                nonlocal answered
                answered |= message["type"] == "http.response.start"
                await send(message)

            replay = _Receive(kept, receive)
            await self.app(scope, replay, tracking_send)
            tries += 1
            if answered or replay.disconnected:
                return
            if time.monotonic() - started_s + pause_s > self.retry_s:
                break
            logger.warning("%s %s: no answer from the ingress (replica died?); sending it again in %.2f s (try %d)",
                           scope.get("method"), scope.get("path"), pause_s, tries + 1)
            await asyncio.sleep(pause_s)
            pause_s = min(pause_s * 2, LONGEST_PAUSE_S)
        await _send_unavailable(send, tries, time.monotonic() - started_s)


async def _send_unavailable(send: Send, tries: int, waited_s: float) -> None:
    error = ErrorBody(message=f"no ingress replica answered the request ({tries} tries over {waited_s:.0f} s); retry "
                              "the request", type="server_error", code="ingress_failed")
    body = json.dumps(ErrorResponse(error=error).model_dump()).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"retry-after", b"1")]})
    await send({"type": "http.response.body", "body": body, "more_body": False})
