"""The Ray Serve deployments: one engine per replica, and an OpenAI-compatible FastAPI ingress in front.

Model versions and rollout
- The engine deployment learns which drafter to serve from its Serve `user_config`
  ({"registered_model", "model_version", "export_dir"}; see `ServedModel`), resolved from the registry alias
  `models:/<name>@champion` when the app is built (`resolve_served_model`).
- A new user_config reaches every replica through Serve's rolling update (`reconfigure`, a fraction of the
  replicas at a time). Inside a replica the new engine is started and health-checked *beside* the old one; the
  replica swaps only when the new engine is healthy. Requests already running finish on the engine they started
  on; the old engine stops once it is idle (or after serve.drain_timeout_s). So every response comes whole from
  one version and no request fails during a rollout. If the new engine cannot start, the replica keeps serving
  the old version and reports the error (`served()`), which `roll_to_champion` turns into a failure.
- Changes that restart replicas (resources, code) use `max_surge_percent`: new replicas start before old ones stop.

Overload: the engine deployment's `max_ongoing_requests` bounds work per replica and `max_queued_requests` the
queue in front of it; beyond that the ingress answers 503 with Retry-After instead of queueing without bound.
"""

# No `from __future__ import annotations` here: FastAPI must see real annotations (e.g. `Request`) on the
# ingress methods, which Serve re-wraps.
import asyncio
import hashlib
import hmac
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.serve.config import BackpressureConfig
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from draftline.config import DraftlineConfig
from draftline.engines.base import TARGET_ONLY, SamplingParams, SpecStats
from draftline.serving.metrics import EngineMetrics, IngressMetrics
from draftline.serving.openai_schema import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    ErrorBody,
    ErrorResponse,
    ModelCard,
    ModelList,
    ResponseMessage,
    ServedVersion,
    Usage,
    new_request_id,
)

logger = logging.getLogger("ray.serve")

APP_NAME = "draftline"
ENGINE_DEPLOYMENT = "DraftlineEngine"
INGRESS_DEPLOYMENT = "DraftlineIngress"
MAX_STOP_STRINGS = 4


class ServedModel(BaseModel):
    """The engine deployment's user_config: which registry version to serve (export_dir None = target only)."""

    registered_model: str
    model_version: str
    export_dir: Optional[str] = None


def resolve_served_model(cfg: DraftlineConfig) -> ServedModel:
    """The champion from the registry, or the target alone when there is none and serve.allow_target_only."""
    from draftline.registry import CHAMPION, RegistryError, resolve_alias

    try:
        resolved = resolve_alias(cfg, CHAMPION)
    except RegistryError as err:
        if not cfg.serve.allow_target_only:
            raise RegistryError(f"{err} (serve.allow_target_only is false, so there is nothing to serve)") from None
        logger.warning("serving the target alone: %s", err)
        return ServedModel(registered_model=cfg.registered_model_name, model_version=TARGET_ONLY)
    return ServedModel(registered_model=resolved.name, model_version=resolved.version, export_dir=str(resolved.export_dir))


# ---------------------------------------------------------------------------------------------------------------
# Engine deployment
# ---------------------------------------------------------------------------------------------------------------


class _LiveEngine:
    """An engine plus its in-flight request count, so a replaced engine stops only when idle."""

    def __init__(self, engine: Any, served: ServedModel) -> None:
        self.engine = engine
        self.served = served
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def retire(self, drain_timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=drain_timeout_s)
        except asyncio.TimeoutError:
            logger.warning(
                "engine for version %s still had %d requests after %.0f s; stopping it anyway",
                self.served.model_version,
                self.in_flight,
                drain_timeout_s,
            )
        await self.engine.stop()


@serve.deployment(name=ENGINE_DEPLOYMENT)
class EngineServer:
    """One engine (SGLang on GPU, the reference engine on CPU) per replica; the version comes from user_config."""

    def __init__(self, config: dict) -> None:
        from draftline.target.load import resolve_target_dir

        self._cfg = DraftlineConfig.model_validate(config)
        self._target_dir = resolve_target_dir(self._cfg)
        self._live: Optional[_LiveEngine] = None
        self._swap_lock = asyncio.Lock()
        self._retiring: set[asyncio.Task] = set()
        self._last_error: Optional[str] = None
        self._metrics = EngineMetrics()

    async def reconfigure(self, user_config: dict) -> None:
        wanted = ServedModel.model_validate(user_config)
        async with self._swap_lock:
            if self._live is not None and self._live.served == wanted:
                return
            try:
                engine = await self._start_engine(wanted)
            except Exception as err:  # noqa: BLE001 - the old engine keeps serving; the error is reported
                self._last_error = f"could not start version {wanted.model_version} from {wanted.export_dir}: {err!r}"
                if self._live is None:
                    raise RuntimeError(self._last_error) from err
                logger.error("%s; still serving version %s", self._last_error, self._live.served.model_version)
                return
            old, self._live = self._live, _LiveEngine(engine, wanted)
            self._last_error = None
            self._metrics.record_swap(self._cfg.engine.backend, wanted.model_version, old and old.served.model_version)
            logger.info(
                "now serving %s version %s%s",
                wanted.registered_model,
                wanted.model_version,
                f" (replaced {old.served.model_version})" if old else "",
            )
            if old is not None:
                task = asyncio.create_task(old.retire(self._cfg.serve.drain_timeout_s))
                self._retiring.add(task)
                task.add_done_callback(self._retiring.discard)

    async def _start_engine(self, wanted: ServedModel) -> Any:
        from draftline.engines import make_engine

        engine = make_engine(
            self._cfg,
            self._target_dir,
            drafter_dir=Path(wanted.export_dir) if wanted.export_dir else None,
            model_version=wanted.model_version,
        )
        await engine.start()
        if not await engine.health():
            await engine.stop()
            raise RuntimeError(f"engine {engine.name} started but reports unhealthy")
        return engine

    def _served_version(self, live: _LiveEngine) -> dict:
        return ServedVersion(
            registered_model=live.served.registered_model,
            model_version=live.served.model_version,
            backend=self._cfg.engine.backend,
        ).model_dump()

    async def generate(self, prompt_ids: list[int], params: dict) -> AsyncIterator[dict]:
        """Stream chunks as dicts; every chunk names the version, which stays the same for the whole request."""
        live = self._live
        if live is None:
            raise RuntimeError("no engine is loaded yet (reconfigure has not run)")
        served = self._served_version(live)
        live.enter()
        try:
            async for chunk in live.engine.generate(prompt_ids, SamplingParams(**params)):
                yield {
                    "token_ids": list(chunk.token_ids),
                    "text": chunk.text,
                    "finished": chunk.finished,
                    "finish_reason": chunk.finish_reason,
                    "stats": asdict(chunk.stats) if chunk.stats is not None else None,
                    "served": served,
                }
        finally:
            live.leave()

    async def served(self) -> dict:
        """The version this replica serves, its engine's health, and the last failed swap (if any)."""
        live = self._live
        return {
            "served": self._served_version(live) if live else None,
            "healthy": bool(live) and await live.engine.health(),
            "last_error": self._last_error,
            "replica": serve.get_replica_context().replica_id.unique_id,
        }

    async def check_health(self) -> None:
        if self._live is None or not await self._live.engine.health():
            raise RuntimeError("engine is not loaded or reports unhealthy")

    async def __del__(self) -> None:
        if self._live is not None:
            await self._live.engine.stop()


# ---------------------------------------------------------------------------------------------------------------
# Ingress: OpenAI-compatible HTTP
# ---------------------------------------------------------------------------------------------------------------


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: Optional[str] = None,
        code: Optional[str] = None,
        headers: Optional[dict[str, str]] = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=ErrorBody(message=self.message, type=self.type, param=self.param, code=self.code))
        return JSONResponse(body.model_dump(), status_code=self.status, headers=self.headers)


def validation_error(err: ValidationError) -> ApiError:
    first = err.errors()[0]
    param = ".".join(str(part) for part in first["loc"]) or None
    if first["type"] == "extra_forbidden":
        message = f"unknown field '{param}': this endpoint does not support it (remove it from the request)"
        return ApiError(400, message, param=param, code="unknown_field")
    if first["type"] == "missing":
        return ApiError(400, f"missing required field '{param}'", param=param, code="missing_field")
    return ApiError(400, f"invalid value for '{param}': {first['msg']}", param=param, code="invalid_value")


class StopMatcher:
    """Cuts streamed text at the first stop string, holding back a tail that could still become one."""

    def __init__(self, stop_strings: list[str]) -> None:
        self.stop_strings = [s for s in stop_strings if s]
        self._hold_chars = max((len(s) for s in self.stop_strings), default=1) - 1
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Text safe to emit now; sets `stopped` when a stop string appeared (the stop string is not emitted)."""
        self._pending += text
        hits = [i for i in (self._pending.find(s) for s in self.stop_strings) if i >= 0]
        if hits:
            self.stopped = True
            emit, self._pending = self._pending[: min(hits)], ""
            return emit
        cut = len(self._pending) - self._hold_chars
        if cut <= 0:
            return ""
        emit, self._pending = self._pending[:cut], self._pending[cut:]
        return emit

    def flush(self) -> str:
        emit, self._pending = self._pending, ""
        return emit


@dataclass
class _Prepared:
    route: str
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stop_strings: list[str]
    stream: bool
    include_usage: bool


@dataclass
class _Progress:
    completion_tokens: int = 0
    stats: Optional[SpecStats] = None

    def usage(self, prompt_tokens: int) -> Usage:
        return Usage.from_stats(prompt_tokens, self.completion_tokens, self.stats)


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class RequestValidator:
    """Auth, JSON parsing, schema validation, tokenization and bounds: everything before an engine is asked."""

    def __init__(self, cfg: DraftlineConfig, auth_token_sha256: Optional[str] = None) -> None:
        from transformers import AutoConfig, AutoTokenizer

        from draftline.target.load import resolve_target_dir

        self._cfg = cfg
        target_dir = resolve_target_dir(cfg)
        self.tokenizer = AutoTokenizer.from_pretrained(target_dir)
        target_config = AutoConfig.from_pretrained(target_dir)
        self.context_tokens = int(target_config.max_position_embeddings)
        self.vocab_size = int(target_config.vocab_size)
        self.model_id = cfg.registered_model_name
        self._model_aliases = {self.model_id, cfg.target.name, f"models:/{self.model_id}@champion"}
        self.auth_token_sha256 = auth_token_sha256

    def authorize(self, request: Request) -> None:
        if self.auth_token_sha256 is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise ApiError(401, "missing bearer token: send 'Authorization: Bearer <token>'", "authentication_error",
                           code="invalid_api_key")
        if not hmac.compare_digest(token_hash(token.strip()), self.auth_token_sha256):
            raise ApiError(401, "invalid bearer token", "authentication_error", code="invalid_api_key")

    def prepare(self, route: str, body: bytes) -> _Prepared:
        try:
            payload = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ApiError(400, f"request body is not valid JSON: {err}", code="invalid_json") from None
        if not isinstance(payload, dict):
            raise ApiError(400, f"request body must be a JSON object, got {type(payload).__name__}", code="invalid_json")
        schema = ChatCompletionRequest if route == "chat" else CompletionRequest
        try:
            req: Union[ChatCompletionRequest, CompletionRequest] = schema.model_validate(payload)
        except ValidationError as err:
            raise validation_error(err) from None
        if req.model is not None and req.model not in self._model_aliases:
            raise ApiError(404, f"model '{req.model}' is not served here; this endpoint serves '{self.model_id}' "
                                "(see GET /v1/models)", param="model", code="model_not_found")
        stop_strings = req.stop_strings()
        if len(stop_strings) > MAX_STOP_STRINGS:
            raise ApiError(400, f"'stop' has {len(stop_strings)} strings; at most {MAX_STOP_STRINGS} are allowed",
                           param="stop")
        prompt_ids = self._prompt_ids(req)
        max_new_tokens = self._max_new_tokens(req, len(prompt_ids), route)
        params = SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            seed=req.seed,
            stop_token_ids=[self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else [],
        )
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        prefix = "chatcmpl" if route == "chat" else "cmpl"
        return _Prepared(route, new_request_id(prefix), prompt_ids, params, stop_strings, req.stream, include_usage)

    def _prompt_ids(self, req: Union[ChatCompletionRequest, CompletionRequest]) -> list[int]:
        if isinstance(req, ChatCompletionRequest):
            messages = [message.model_dump(exclude_none=True) for message in req.messages]
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        elif isinstance(req.prompt, str):
            ids = self.tokenizer(req.prompt)["input_ids"]
        else:
            ids = list(req.prompt)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ApiError(400, f"prompt token ids {bad[:5]} are outside the vocabulary 0..{self.vocab_size - 1}",
                               param="prompt")
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt" if isinstance(req, CompletionRequest) else "messages")
        if len(ids) >= self.context_tokens:
            param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
            raise ApiError(400, f"the prompt is {len(ids)} tokens; this model's context is {self.context_tokens} tokens "
                                "(prompt + completion): shorten the prompt", param=param, code="context_length_exceeded")
        return ids

    def _max_new_tokens(self, req: Union[ChatCompletionRequest, CompletionRequest], prompt_tokens: int, route: str) -> int:
        limit = self._cfg.serve.max_tokens_limit
        room = self.context_tokens - prompt_tokens
        requested = req.requested_max_tokens()
        param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
        if requested is None:
            # OpenAI's defaults: 16 for completions, as much as fits for chat.
            return min(16 if route == "completions" else limit, limit, room)
        if not 1 <= requested <= limit:
            raise ApiError(400, f"{param}={requested} is out of bounds: use 1 .. {limit} (serve.max_tokens_limit)",
                           param=param, code="invalid_value")
        if requested > room:
            raise ApiError(400, f"this model's context is {self.context_tokens} tokens, but {prompt_tokens} prompt "
                                f"tokens + {param}={requested} need {prompt_tokens + requested}: lower {param} or "
                                "shorten the prompt", param=param, code="context_length_exceeded")
        return requested


fastapi_app = FastAPI(title="draftline", description="OpenAI-compatible speculative decoding endpoint")


@serve.deployment(name=INGRESS_DEPLOYMENT)
@serve.ingress(fastapi_app)
class Ingress:
    """HTTP front: validation, auth, tokenization, streaming, metrics. Generation happens in the engine replicas."""

    def __init__(self, engine: Any, config: dict, auth_token_sha256: Optional[str] = None) -> None:
        self._engine = engine
        self._cfg = DraftlineConfig.model_validate(config)
        self._requests = RequestValidator(self._cfg, auth_token_sha256)
        self._metrics = IngressMetrics()

    # -- routes -----------------------------------------------------------------------------------------------

    @fastapi_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._handle("chat", request)

    @fastapi_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._handle("completions", request)

    @fastapi_app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        try:
            self._requests.authorize(request)
            served = await self._any_replica_version()
        except ApiError as err:
            self._metrics.record_status("models", err.status)
            return err.response()
        self._metrics.record_status("models", 200)
        return JSONResponse(ModelList(data=[ModelCard(id=self._requests.model_id, draftline=served)]).model_dump())

    @fastapi_app.get("/healthz")
    async def healthz(self) -> Response:
        """Unauthenticated liveness for load balancers: 200 with the served version, or 503."""
        try:
            state = await asyncio.wait_for(self._engine.served.remote(), timeout=10)
        except Exception as err:  # noqa: BLE001 - any failure to reach an engine means unhealthy
            return JSONResponse({"status": "unavailable", "reason": repr(err)}, status_code=503)
        status = 200 if state["healthy"] else 503
        return JSONResponse({"status": "ok" if status == 200 else "unhealthy", **state}, status_code=status)

    # -- request handling -------------------------------------------------------------------------------------

    async def _handle(self, route: str, request: Request) -> Response:
        started_s = time.perf_counter()
        try:
            self._requests.authorize(request)
            prepared = self._requests.prepare(route, await request.body())
            stream = self._engine.options(stream=True).generate.remote(prepared.prompt_ids, asdict(prepared.params))
            first = await self._first_chunk(stream)
        except ApiError as err:
            self._metrics.record_status(route, err.status)
            return err.response()
        if prepared.stream:
            self._metrics.record_status(route, 200)
            return StreamingResponse(
                self._sse(prepared, stream, first, started_s),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        result = await self._collect(prepared, stream, first, started_s)
        self._metrics.record_status(route, 200)
        return JSONResponse(result)

    async def _first_chunk(self, stream: Any) -> dict:
        """Wait for the first chunk so overload and engine errors become status codes, not broken streams."""
        try:
            return await stream.__anext__()
        except BackPressureError as err:
            raise self._overloaded(str(err)) from None
        except DeploymentUnavailableError as err:
            raise ApiError(503, f"no engine replica is available: {err}", "server_error", code="unavailable",
                           headers=self._retry_after()) from None
        except StopAsyncIteration:
            raise ApiError(500, "the engine returned no output", "server_error") from None
        except Exception as err:  # noqa: BLE001 - a Ray task error may wrap the backpressure error
            cause = getattr(err, "cause", None)
            if isinstance(cause, BackPressureError):
                raise self._overloaded(str(cause)) from None
            logger.exception("engine request failed")
            raise ApiError(500, f"the engine failed: {type(err).__name__}: {err}", "server_error") from None

    def _retry_after(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, round(self._cfg.serve.retry_after_s)))}

    def _overloaded(self, detail: str) -> ApiError:
        return ApiError(503, f"the server is at capacity ({detail}); retry after {self._cfg.serve.retry_after_s:g} s",
                        "server_error", code="overloaded", headers=self._retry_after())

    async def _chunks(self, stream: Any, first: dict) -> AsyncIterator[dict]:
        yield first
        async for chunk in stream:
            yield chunk

    async def _generation(
        self, prepared: _Prepared, stream: Any, first: dict, started_s: float, progress: "_Progress"
    ) -> AsyncIterator[tuple[str, Optional[str]]]:
        """Yield (text delta, finish_reason or None), count tokens into `progress`, record metrics when done."""
        stop = StopMatcher(prepared.stop_strings)
        first_token_s: Optional[float] = None
        try:
            async for chunk in self._chunks(stream, first):
                if chunk["token_ids"] and first_token_s is None:
                    first_token_s = time.perf_counter() - started_s
                progress.completion_tokens += len(chunk["token_ids"])
                if chunk["stats"] is not None:
                    progress.stats = SpecStats(**chunk["stats"])
                text = stop.feed(chunk["text"])
                if stop.stopped:
                    stream.cancel()
                    yield text, "stop"
                    return
                if chunk["finished"]:
                    yield text + stop.flush(), chunk["finish_reason"] or "stop"
                    return
                if text:
                    yield text, None
        finally:
            total_s = time.perf_counter() - started_s
            self._metrics.record_generation(
                prepared.route,
                first["served"]["model_version"],
                latency_s=total_s,
                first_token_s=first_token_s,
                generation_s=total_s - (first_token_s or 0.0),
                stats=progress.stats,
                completion_tokens=progress.completion_tokens,
            )

    def _common(self, prepared: _Prepared, served: dict) -> dict:
        version = ServedVersion(**served)
        return {
            "id": prepared.request_id,
            "model": self._requests.model_id,
            "system_fingerprint": version.fingerprint,
            "draftline": version,
        }

    async def _collect(self, prepared: _Prepared, stream: Any, first: dict, started_s: float) -> dict:
        progress = _Progress()
        pieces: list[str] = []
        finish_reason: Optional[str] = None
        async for text, reason in self._generation(prepared, stream, first, started_s, progress):
            pieces.append(text)
            finish_reason = reason or finish_reason
        usage = progress.usage(len(prepared.prompt_ids))
        common = self._common(prepared, first["served"])
        text = "".join(pieces)
        if prepared.route == "chat":
            choice = ChatChoice(message=ResponseMessage(content=text), finish_reason=finish_reason)
            return ChatCompletionResponse(**common, choices=[choice], usage=usage).model_dump()
        choice = CompletionChoice(text=text, finish_reason=finish_reason)
        return CompletionResponse(**common, choices=[choice], usage=usage).model_dump()

    async def _sse(self, prepared: _Prepared, stream: Any, first: dict, started_s: float) -> AsyncIterator[str]:
        common = self._common(prepared, first["served"])
        progress = _Progress()
        chat = prepared.route == "chat"

        def event(model: BaseModel) -> str:
            return f"data: {model.model_dump_json(exclude_none=True)}\n\n"

        if chat:
            yield event(ChatCompletionChunk(**common, choices=[ChatChunkChoice(delta=ChatDelta(role="assistant"))]))
        try:
            async for text, reason in self._generation(prepared, stream, first, started_s, progress):
                if chat:
                    delta = ChatDelta(content=text) if text else ChatDelta()
                    choice = ChatChunkChoice(delta=delta, finish_reason=reason)
                    yield event(ChatCompletionChunk(**common, choices=[choice]))
                else:
                    yield event(CompletionChunk(**common, choices=[CompletionChoice(text=text, finish_reason=reason)]))
        except Exception as err:  # noqa: BLE001 - headers are sent; report in-band like OpenAI does
            logger.exception("stream %s failed", prepared.request_id)
            error = ErrorResponse(error=ErrorBody(message=f"generation failed: {err}", type="server_error"))
            yield f"data: {error.model_dump_json()}\n\n"
            return
        if prepared.include_usage:
            chunk_type = ChatCompletionChunk if chat else CompletionChunk
            yield event(chunk_type(**common, choices=[], usage=progress.usage(len(prepared.prompt_ids))))
        yield "data: [DONE]\n\n"

    async def _any_replica_version(self) -> ServedVersion:
        try:
            state = await asyncio.wait_for(self._engine.served.remote(), timeout=10)
        except Exception as err:  # noqa: BLE001
            raise ApiError(503, f"no engine replica answered: {err!r}", "server_error", code="unavailable",
                           headers=self._retry_after()) from None
        if state["served"] is None:
            raise ApiError(503, "the engine has not loaded a model yet", "server_error", code="unavailable",
                           headers=self._retry_after())
        return ServedVersion(**state["served"])


# ---------------------------------------------------------------------------------------------------------------
# Building the application
# ---------------------------------------------------------------------------------------------------------------

_FROM_ENV = object()


def auth_token_sha256_from_env(cfg: DraftlineConfig) -> Optional[str]:
    """sha256 of the bearer token in the env var named by serve.auth_token_env (None: auth off).

    Only the hash travels to the replicas, so the token never appears in Serve's config or dashboard.
    """
    token = os.environ.get(cfg.serve.auth_token_env, "").strip()
    return token_hash(token) if token else None


def engine_options(cfg: DraftlineConfig, served: ServedModel) -> dict:
    """Serve options of the engine deployment (also the `deployments` override in a declarative config)."""
    return {
        "num_replicas": cfg.serve.num_replicas,
        "max_ongoing_requests": cfg.serve.max_ongoing_requests,
        "max_queued_requests": cfg.serve.max_queued_requests,
        "max_surge_percent": cfg.serve.max_surge_percent,
        "ray_actor_options": {"num_cpus": cfg.serve.cpus_per_replica, "num_gpus": cfg.serve.gpus_per_replica},
        "user_config": served.model_dump(),
        "graceful_shutdown_timeout_s": cfg.serve.drain_timeout_s,
        "health_check_period_s": 5,
        "health_check_timeout_s": 60,
    }


def build_app(cfg: DraftlineConfig, served: Optional[ServedModel] = None, auth_token_sha256: Any = _FROM_ENV):
    """The Serve application for `cfg`: ingress -> engine. `served` defaults to the registry champion."""
    config = cfg.model_dump(mode="json")
    served = served or resolve_served_model(cfg)
    if auth_token_sha256 is _FROM_ENV:
        auth_token_sha256 = auth_token_sha256_from_env(cfg)
    # The ingress admits what the engines can run or queue, plus headroom for /healthz and /v1/models.
    engine_capacity = cfg.serve.num_replicas * (cfg.serve.max_ongoing_requests + max(cfg.serve.max_queued_requests, 0))
    engine = EngineServer.options(**engine_options(cfg, served)).bind(config)
    return Ingress.options(
        num_replicas=1,
        max_ongoing_requests=engine_capacity + 16,
        max_queued_requests=max(cfg.serve.max_queued_requests, 0) + 16,
        backpressure_config=BackpressureConfig(status_code=503, retry_after_s=cfg.serve.retry_after_s),
        ray_actor_options={"num_cpus": cfg.serve.ingress_cpus_per_replica},
    ).bind(engine, config, auth_token_sha256)


def app_builder(args: dict):
    """Serve application builder for declarative configs: args {"config": <resolved config>, "auth_token_sha256"}."""
    if "config" not in args:
        raise ValueError("draftline app args need 'config' (a resolved draftline config mapping)")
    cfg = DraftlineConfig.model_validate(args["config"])
    return build_app(cfg, auth_token_sha256=args.get("auth_token_sha256"))
