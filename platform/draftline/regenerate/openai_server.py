"""The engine protocol over a running OpenAI-compatible server: vLLM's api_server, SGLang's launch_server, draftline serve.

Prompts go as token ids to `/v1/completions` (every one of those servers takes a list of ids), so the chat template
is rendered once, by draftline, exactly as prepare renders it. Streaming, so many requests stay in flight on one
connection pool; the server batches them. The server stops at the target's end of turn (its EOS).
"""

from __future__ import annotations

import os
from typing import AsyncIterator, Optional

import httpx

from draftline.engines.base import TARGET_ONLY, GenerationChunk, SamplingParams, SpecStats
from draftline.engines.server_process import sse_events


class ServerRejected(ValueError):
    """The server answered 4xx: the request (e.g. a prompt longer than the context), not the server, is at fault."""


class OpenAIServerEngine:
    name = "openai"

    def __init__(self, base_url: str, model: Optional[str] = None, api_key_env: str = "", timeout_s: float = 600,
                 max_connections: int = 64) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.model_version = TARGET_ONLY
        api_key = os.environ.get(api_key_env) if api_key_env else None
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout_s = timeout_s
        self._max_connections = max_connections
        self._client: Optional[httpx.AsyncClient] = None

    async def start(self) -> None:
        self._client = httpx.AsyncClient(
            base_url=self.base_url, headers=self._headers, timeout=self._timeout_s,
            limits=httpx.Limits(max_connections=self._max_connections),
        )
        try:
            response = await self._client.get("/models")
        except httpx.HTTPError as err:
            raise ConnectionError(
                f"OpenAI-compatible server {self.base_url} is not reachable ({type(err).__name__}: {err}); start it "
                "or fix regenerate.openai_base_urls (the URL ends in /v1)"
            ) from None
        if response.status_code != 200:
            raise ConnectionError(f"{self.base_url}/models answered {response.status_code}: {response.text[:300]}")
        served = [m["id"] for m in response.json().get("data", [])]
        if self.model is None:
            if not served:
                raise ConnectionError(f"{self.base_url}/models lists no model; set regenerate.openai_model")
            self.model = served[0]

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[GenerationChunk]:
        if self._client is None:
            raise RuntimeError("OpenAIServerEngine.generate before start(): await engine.start() first")
        body = {
            "model": self.model, "prompt": list(prompt_ids), "max_tokens": params.max_new_tokens,
            "temperature": params.temperature, "top_p": params.top_p, "stream": True,
            "stream_options": {"include_usage": True},
        }
        if params.seed is not None:
            body["seed"] = params.seed
        async with self._client.stream("POST", "/completions", json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:500]
                error = ServerRejected if 400 <= response.status_code < 500 else ConnectionError
                raise error(f"{self.base_url}/completions answered {response.status_code}: {detail}")
            finish_reason = None
            completion_tokens = 0
            async for event in sse_events(response, ConnectionError, f"{self.base_url}/completions"):
                if event.get("usage"):
                    completion_tokens = int(event["usage"].get("completion_tokens") or 0)
                for choice in event.get("choices") or []:
                    finish_reason = choice.get("finish_reason") or finish_reason
                    if choice.get("text"):
                        yield GenerationChunk(token_ids=[], text=choice["text"])
        yield GenerationChunk(token_ids=[], text="", finished=True, finish_reason=finish_reason,
                              stats=SpecStats(output_tokens=completion_tokens))

    async def health(self) -> bool:
        if self._client is None:
            return False
        try:
            return (await self._client.get("/models")).status_code == 200
        except httpx.HTTPError:
            return False

    async def stop(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
