"""The OpenAI-compatible HTTP ingress: auth, validation, tokenization, streaming, errors in OpenAI's shape.

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
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any, AsyncIterator, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from draftline.config import DraftlineConfig
from draftline.data.masks import end_of_turn_text
from draftline.engines.base import TARGET_ONLY, SamplingParams, SpecStats
from draftline.registry import gate_accept_length, mark_drift
from draftline.serving.drift import Drift, DriftMonitor
from draftline.serving.chat_render import ChatRenderError, ChatReply, ChatTemplate, RenderedChat
from draftline.serving.engine_server import ENGINE_DEPLOYMENT
from draftline.serving.metrics import IngressMetrics, LiveAcceptMetrics
from draftline.serving.openai_schema import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    DeltaToolCall,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    ErrorBody,
    ErrorResponse,
    ModelCard,
    ModelList,
    ResponseMessage,
    ResponseToolCall,
    ServedVersion,
    Usage,
    new_request_id,
)
from draftline.serving.refresh_job import FAILED, SUBMITTED, submit_refresh_job
from draftline.serving.traffic_capture import TrafficRecorder
from draftline.target.load import resolve_target_dir
from draftline.target.reasoning import ReasoningStream

logger = logging.getLogger("ray.serve")

INGRESS_DEPLOYMENT = "DraftlineIngress"
MAX_STOP_STRINGS = 4
DEFAULT_ERROR_CODES = {400: "invalid_value", 401: "invalid_api_key", 404: "not_found", 413: "request_too_large",
                       500: "internal_error", 503: "unavailable"}


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
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.code = code or DEFAULT_ERROR_CODES.get(status, "error")  # clients branch on code: never null
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
    prompt: Any = None  # chat: the messages as sent; completions: the prompt (text or token ids)
    segment: str = ""
    chat: Optional[RenderedChat] = None  # chat: the rendering, and how the generated turn is read back


def reads_back(prepared: _Prepared) -> bool:
    """A chat reply read back from its tokens into tool calls or reasoning (else its text is the reply)."""
    return prepared.chat is not None and (prepared.chat.call_format is not None or prepared.chat.thinking)


@dataclass
class _Progress:
    # The token ids are kept only when something reads them once the turn ended (the traffic store, a reply read
    # back into tool calls or reasoning); else they are only counted.
    keep_token_ids: bool = False
    completion_tokens: int = 0
    stats: Optional[SpecStats] = None
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)  # what the client got (cut at a stop string)
    finish_reason: Optional[str] = None  # set once generation ended normally

    def add_tokens(self, token_ids: list[int]) -> None:
        self.completion_tokens += len(token_ids)
        if self.keep_token_ids:
            self.token_ids.extend(token_ids)

    def add_text(self, text: str) -> None:
        self.text.append(text)

    def reply_text(self) -> str:
        return "".join(self.text)

    def usage(self, prompt_tokens: int) -> Usage:
        return Usage.from_stats(prompt_tokens, self.completion_tokens, self.stats)


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class RequestValidator:
    """Auth, JSON parsing, schema validation, tokenization and bounds: everything before an engine is asked."""

    def __init__(self, cfg: DraftlineConfig, auth_token_sha256: Optional[str] = None) -> None:
        from transformers import AutoConfig, AutoTokenizer

        self._cfg = cfg
        target_dir = resolve_target_dir(cfg)
        self.use_tokenizer(AutoTokenizer.from_pretrained(target_dir))
        target_config = AutoConfig.from_pretrained(target_dir)
        self.context_tokens = int(target_config.max_position_embeddings)
        self.vocab_size = int(target_config.vocab_size)
        self.model_id = cfg.registered_model_name
        self._model_aliases = {self.model_id, cfg.target.name, f"models:/{self.model_id}@champion"}
        self.auth_token_sha256 = auth_token_sha256

    def use_tokenizer(self, tokenizer: Any) -> None:
        """The target's tokenizer and what its chat template does with tools and thinking."""
        self.tokenizer = tokenizer
        # A tokenizer without a template (a base model) serves /v1/completions only.
        self.chat_template = ChatTemplate(tokenizer) if tokenizer.chat_template else None
        turn_ends = {tokenizer.eos_token, end_of_turn_text(tokenizer) if self.chat_template else None}
        self._turn_ends = sorted(end for end in turn_ends if end)

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
        if len(body) > self._cfg.serve.max_request_bytes:
            raise self.too_large(len(body))
        try:
            payload = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ApiError(400, f"request body is not valid JSON: {err}", code="invalid_json") from None
        except RecursionError:
            raise ApiError(400, "request body is nested too deeply to parse", code="invalid_json") from None
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
        chat = self._render_chat(req) if isinstance(req, ChatCompletionRequest) else None
        prompt_ids = self._prompt_ids(req, chat)
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
        prompt = [m.model_dump(exclude_none=True) for m in req.messages] if route == "chat" else req.prompt
        return _Prepared(route, new_request_id(prefix), prompt_ids, params, stop_strings, req.stream, include_usage,
                         prompt, chat=chat)

    def _render_chat(self, req: ChatCompletionRequest) -> RenderedChat:
        if self.chat_template is None:
            raise ApiError(400, "the target's tokenizer has no chat template (a base model): send a prompt to "
                                "/v1/completions instead", param="messages", code="no_chat_template")
        try:
            return self.chat_template.render(req)
        except ChatRenderError as err:
            raise ApiError(400, err.message, param=err.param, code=err.code) from None

    def turn_text(self, token_ids: list[int], stop_strings: list[str]) -> str:
        """The generated turn as text with special tokens kept (DeepSeek's and Kimi's call markers are special
        tokens), cut at the end of turn and at a stop string: what a chat reply is read back from."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=False)
        cuts = [at for at in (text.find(end) for end in self._turn_ends + stop_strings) if at >= 0]
        return text[: min(cuts)] if cuts else text

    def chat_reply(self, prepared: _Prepared, progress: "_Progress") -> ChatReply:
        """The reply of a finished chat request: its text as the client got it, or, when tools or thinking ask for
        it, the turn's tokens read back into content, reasoning and tool calls."""
        if not reads_back(prepared):
            return ChatReply(progress.reply_text())
        return self.chat_template.reply(prepared.chat, self.turn_text(progress.token_ids, prepared.stop_strings))

    def segment(self, request: Request) -> str:
        """The client's segment tag (header serve.traffic.segment_header), or "" when not sent."""
        name = self._cfg.serve.traffic.segment_header
        value = request.headers.get(name, "").strip()
        if value and not SEGMENT_PATTERN.fullmatch(value):
            raise ApiError(400, f"header {name}: {value[:80]!r} is not a segment tag (1-64 characters of letters, "
                                "digits, '_', '-', '.', ':')", param=name)
        return value

    def too_large(self, size_bytes: int) -> ApiError:
        limit = self._cfg.serve.max_request_bytes
        return ApiError(413, f"request body is {size_bytes} bytes; this endpoint accepts at most {limit} "
                             "(serve.max_request_bytes): shorten the prompt")

    def _prompt_ids(self, req: Union[ChatCompletionRequest, CompletionRequest], chat: Optional[RenderedChat]) -> list[int]:
        try:
            return self._tokenize(req, chat)
        except UnicodeEncodeError as err:
            raise self._surrogate(err, "messages" if isinstance(req, ChatCompletionRequest) else "prompt") from None

    @staticmethod
    def _surrogate(err: UnicodeEncodeError, param: str) -> ApiError:
        """A lone surrogate such as "\ud800" is valid JSON but not text."""
        return ApiError(400, f"the {param} holds an unpaired UTF-16 surrogate ({err.object[err.start:err.end]!r}); "
                             "send valid Unicode text", param=param)

    def _tokenize(self, req: Union[ChatCompletionRequest, CompletionRequest], chat: Optional[RenderedChat]) -> list[int]:
        if chat is not None:
            chat.text.encode("utf-8")
            ids = self.tokenizer(chat.text, add_special_tokens=False)["input_ids"]
        elif isinstance(req.prompt, str):
            req.prompt.encode("utf-8")
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


SEGMENT_PATTERN = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
# Distinct segments each ingress replica tags its metrics with; later ones are counted as "other" (Prometheus
# series are not free).
MAX_METRIC_SEGMENTS = 64
NO_SEGMENT = "none"


# How many times a request whose engine replica died before the client got anything is sent again.
REPLICA_FAILURE_RETRIES = 2


class _ReplicaDied(Exception):
    """The engine replica of a request died before the client got anything (the request may run again)."""


def replica_died(err: BaseException) -> bool:
    """`err` (or the Ray task error's cause) says the engine replica's actor died or cannot be reached."""
    from ray.exceptions import RayActorError

    return isinstance(err, RayActorError) or isinstance(getattr(err, "cause", None), RayActorError)


# No /docs, /redoc or /openapi.json: they would answer without the bearer token; the API is docs/serving.md.
fastapi_app = FastAPI(title="draftline", description="OpenAI-compatible speculative decoding endpoint",
                      docs_url=None, redoc_url=None, openapi_url=None)


def traffic_record(prepared: _Prepared, served: dict, progress: _Progress) -> dict:
    """What the traffic store keeps of one finished request (docs/traffic.md)."""
    stats = progress.stats
    return {
        "id": prepared.request_id,
        "time_s": round(time.time(), 3),
        "route": prepared.route,
        "segment": prepared.segment or None,
        "registered_model": served["registered_model"],
        "model_version": served["model_version"],
        "backend": served.get("backend"),
        "messages" if prepared.route == "chat" else "prompt": prepared.prompt,
        **(chat_traffic_fields(prepared.chat) if prepared.chat is not None else {}),
        "prompt_token_ids": prepared.prompt_ids,
        "completion_token_ids": progress.token_ids,
        "completion_text": progress.reply_text(),
        "finish_reason": progress.finish_reason,
        "sampling": {"max_new_tokens": prepared.params.max_new_tokens, "temperature": prepared.params.temperature,
                     "top_p": prepared.params.top_p, "seed": prepared.params.seed, "stop": prepared.stop_strings},
        "spec": None if stats is None else {**asdict(stats), "accept_length": round(stats.accept_length, 4)},
    }


def chat_traffic_fields(chat: RenderedChat) -> dict:
    """A chat record's tools and template arguments (what its prompt was rendered with) and its prompt segment."""
    fields: dict[str, Any] = {"prompt_segment": chat.segment}
    if chat.tools:
        fields["tools"] = chat.tools
    if chat.template_kwargs:
        fields["chat_template_kwargs"] = chat.template_kwargs
    return fields


def response_message(reply: ChatReply) -> ResponseMessage:
    calls = [ResponseToolCall(**call.openai()) for call in reply.calls or []]
    return ResponseMessage(content=reply.content, reasoning_content=reply.reasoning, tool_calls=calls)


def chat_finish_reason(reply: ChatReply, finish_reason: Optional[str]) -> Optional[str]:
    """OpenAI's "tool_calls" for a turn that ended with calls (a turn cut at the length limit stays "length")."""
    return "tool_calls" if reply.calls and finish_reason == "stop" else finish_reason


def whole_turn_choice(reply: ChatReply, finish_reason: str) -> ChatChunkChoice:
    """A streamed turn with tools, sent whole when it ends: its text and its calls in one delta."""
    calls = [DeltaToolCall(index=k, **call.openai()) for k, call in enumerate(reply.calls or [])]
    delta = ChatDelta(content=reply.content, reasoning_content=reply.reasoning, tool_calls=calls or None)
    return ChatChunkChoice(delta=delta, finish_reason=chat_finish_reason(reply, finish_reason))


def text_delta(reasoning: Optional[ReasoningStream], text: str, finish_reason: Optional[str]) -> Optional[ChatDelta]:
    """A streamed chat piece: its text as content, or, when thinking is on, split into reasoning and content like
    the whole reply. None when a thinking turn has nothing to send yet (a tag, whitespace held back)."""
    if reasoning is None:
        return ChatDelta(content=text) if text else ChatDelta()
    thought, content = reasoning.feed(text)
    if finish_reason is not None:
        held_thought, held_content = reasoning.flush()
        thought, content = thought + held_thought, content + held_content
    if not (thought or content or finish_reason):
        return None
    return ChatDelta(reasoning_content=thought or None, content=content or None)


@serve.deployment(name=INGRESS_DEPLOYMENT)
@serve.ingress(fastapi_app)
class Ingress:
    """HTTP front: validation, auth, tokenization, streaming, metrics. Generation happens in the engine replicas."""

    def __init__(self, engine: Any, config: dict, auth_token_sha256: Optional[str] = None, traffic: Any = None) -> None:
        self._engine = engine  # None with serve.rollout=blue_green: reconfigure names the engine set's app
        self._cfg = DraftlineConfig.model_validate(config)
        self._requests = RequestValidator(self._cfg, auth_token_sha256)
        self._metrics = IngressMetrics()
        self._live = LiveAcceptMetrics()
        self._metric_segments: set[str] = set()
        self._drift = DriftMonitor(self._cfg.serve.drift.window_requests, self._cfg.serve.drift.margin)
        # The capture deployment's handle (serve.traffic.enabled), else None.
        self._traffic = TrafficRecorder(traffic, self._cfg.serve.traffic) if traffic is not None else None
        self._background: set[asyncio.Task] = set()  # strong references to fire-and-forget tasks

    def reconfigure(self, user_config: dict) -> None:
        """serve.rollout=blue_green: {"engine_app": <Serve app of the engine set to send new requests to>}.

        Switching is this in-place reconfigure: requests already sent finish on the set they went to."""
        self._engine = serve.get_deployment_handle(ENGINE_DEPLOYMENT, user_config["engine_app"], _check_exists=False)
        logger.info("sending requests to the engine set in Serve app %s", user_config["engine_app"])

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
            declared = request.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > self._cfg.serve.max_request_bytes:
                raise self._requests.too_large(int(declared))  # before reading the body
            segment = self._requests.segment(request)
            # Off the event loop: tokenizing a long chat template must not stall /healthz and other requests.
            prepared = await asyncio.to_thread(self._requests.prepare, route, await request.body())
            prepared.segment = segment
        except ApiError as err:
            self._metrics.record_status(route, err.status)
            return err.response()
        # A replica that dies (SIGKILL, OOM, its node lost) before the client got anything: the request runs again.
        # Serve's router drops a replica once a call to it fails with ActorDiedError, so the retry goes to a live one
        # (or waits for Serve's replacement when there was only one).
        for attempt in range(REPLICA_FAILURE_RETRIES + 1):
            last_try = attempt == REPLICA_FAILURE_RETRIES
            try:
                stream = self._engine.options(stream=True).generate.remote(prepared.prompt_ids, asdict(prepared.params))
                first = await self._first_chunk(stream, retry=not last_try)
            except _ReplicaDied:
                logger.warning("request %s: the engine replica died before answering; retrying", prepared.request_id)
                continue
            except ApiError as err:
                self._metrics.record_status(route, err.status)
                return err.response()
            if prepared.stream:  # after the first SSE event, a replica failure is reported in-band (_sse)
                self._metrics.record_status(route, 200)
                return StreamingResponse(
                    self._sse(prepared, stream, first, started_s),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache"},
                )
            try:
                result = await self._collect(prepared, stream, first, started_s)
            except Exception as err:  # noqa: BLE001 - e.g. the replica died mid-request: still an OpenAI-shaped answer
                if replica_died(err) and not last_try:
                    logger.warning("request %s: the engine replica died while generating; retrying", prepared.request_id)
                    continue
                logger.exception("request %s failed after it started", prepared.request_id)
                error = self._engine_failed()
                self._metrics.record_status(route, error.status)
                return error.response()
            self._metrics.record_status(route, 200)
            return JSONResponse(result)
        error = self._engine_failed()
        self._metrics.record_status(route, error.status)
        return error.response()

    def _engine_failed(self) -> ApiError:
        return ApiError(503, "the engine replica failed while generating; retry the request", "server_error",
                        code="engine_failed", headers=self._retry_after())

    async def _first_chunk(self, stream: Any, retry: bool = False) -> dict:
        """Wait for the first chunk so overload and engine errors become status codes, not broken streams.

        A dead replica raises _ReplicaDied when `retry` (the caller sends the request again), else 503 engine_failed."""
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
            if replica_died(err):
                if retry:
                    raise _ReplicaDied() from None
                raise self._engine_failed() from None
            # The full error (replica, node, paths) goes to the Serve log only; the client gets one clean line.
            logger.exception("engine request failed")
            raise ApiError(500, f"the engine failed ({type(cause or err).__name__}); the error is in the Serve "
                                "replica logs", "server_error") from None

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
                progress.add_tokens(chunk["token_ids"])
                if chunk["stats"] is not None:
                    progress.stats = SpecStats(**chunk["stats"])
                text = stop.feed(chunk["text"])
                if stop.stopped:
                    stream.cancel()
                    progress.add_text(text)
                    progress.finish_reason = "stop"
                    yield text, "stop"
                    return
                if chunk["finished"]:
                    text += stop.flush()
                    progress.add_text(text)
                    progress.finish_reason = chunk["finish_reason"] or "stop"
                    yield text, progress.finish_reason
                    return
                if text:
                    progress.add_text(text)
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
            if progress.finish_reason is not None:
                self._finished(prepared, first["served"], progress)

    # -- after a request finished: live acceptance, drift, capture (nothing here is awaited by the request) ----------

    def _finished(self, prepared: _Prepared, served: dict, progress: _Progress) -> None:
        version = served["model_version"]
        if progress.stats is not None and progress.stats.verify_steps:
            self._live.record(version, self._metric_segment(prepared.segment), progress.stats)
            if self._cfg.serve.drift.enabled and version != TARGET_ONLY:
                self._check_drift(version, progress.stats.accept_length)
        if self._traffic is not None and self._traffic.sampled():
            self._traffic.record(traffic_record(prepared, served, progress))

    def _metric_segment(self, segment: str) -> str:
        if not segment:
            return NO_SEGMENT
        if segment not in self._metric_segments and len(self._metric_segments) >= MAX_METRIC_SEGMENTS:
            return "other"
        self._metric_segments.add(segment)
        return segment

    def _check_drift(self, version: str, accept_length: float) -> None:
        if not self._drift.knows_gate(version):
            self._drift.set_gate(version, None)  # asked once; the answer arrives in the background
            self._in_background(self._fetch_gate_accept_length(version))
        drift = self._drift.observe(version, accept_length)
        self._live.record_window(version, self._drift.window_mean(version))
        if drift is not None:
            self._drifted(drift)

    def _drifted(self, drift: Drift) -> None:
        self._live.record_drift(drift.model_version)
        logger.warning("drift: version %s serves an accept length of %.3f over its last %d requests, below the gate's "
                       "%.3f by more than serve.drift.margin=%g; tagging it drift=yes", drift.model_version,
                       drift.live_accept_length, drift.window_requests, drift.gate_accept_length, drift.margin)
        self._in_background(self._tag_drift(drift))
        if self._cfg.serve.drift.refresh:
            self._in_background(self._start_refresh(drift.model_version))

    def _in_background(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _fetch_gate_accept_length(self, version: str) -> None:
        try:
            accept = await asyncio.to_thread(gate_accept_length, self._cfg, version, self._cfg.serve.max_ongoing_requests)
        except Exception:  # noqa: BLE001 - the registry unreachable: no drift check for this version, serving goes on
            logger.exception("drift check: could not read the gate's accept length of version %s", version)
            return
        self._drift.set_gate(version, accept)
        logger.info("drift check: version %s has a gate accept length of %s", version, accept)
        drift = self._drift.judge(version)
        if drift is not None:
            self._drifted(drift)

    async def _tag_drift(self, drift: Drift) -> None:
        try:
            await asyncio.to_thread(mark_drift, self._cfg, drift.model_version, drift.detail())
        except Exception:  # noqa: BLE001 - the metric and the log line stand; the tag is best effort
            logger.exception("drift check: could not tag version %s drift=yes", drift.model_version)

    async def _start_refresh(self, version: str) -> None:
        timeout_s = self._cfg.serve.drift.refresh_submit_timeout_s
        try:
            # The submission's own deadline ends its tries; the wait's, 1 s later, a call that hangs (the thread
            # is then left to finish on its own).
            job = await asyncio.wait_for(
                asyncio.to_thread(submit_refresh_job, self._cfg, version, time.monotonic() + timeout_s), timeout_s + 1)
        except Exception as err:  # noqa: BLE001 - serving goes on; the metric and the log line say it failed
            self._live.record_refresh_job(version, FAILED)
            logger.error("drift: could not start the refresh of version %s within serve.drift.refresh_submit_timeout_s"
                         "=%g s (%s); start it by hand: `draftline refresh -c CONFIG`", version, timeout_s,
                         str(err) or type(err).__name__)
            return
        self._live.record_refresh_job(version, job.outcome)
        if job.outcome == SUBMITTED:
            logger.warning("drift: started the refresh of version %s as Ray job %s (`ray job logs %s`); tagged "
                           "refresh_job on the version", version, job.submission_id, job.submission_id)
        else:
            logger.info("drift: the refresh of version %s was started already (Ray job %s)", version, job.submission_id)

    def _common(self, prepared: _Prepared, served: dict) -> dict:
        version = ServedVersion(**served)
        return {
            "id": prepared.request_id,
            "model": self._requests.model_id,
            "system_fingerprint": version.fingerprint,
            "draftline": version,
        }

    def _progress_for(self, prepared: _Prepared) -> _Progress:
        return _Progress(keep_token_ids=self._traffic is not None or reads_back(prepared))

    async def _collect(self, prepared: _Prepared, stream: Any, first: dict, started_s: float) -> dict:
        progress = self._progress_for(prepared)
        finish_reason: Optional[str] = None
        async for _, reason in self._generation(prepared, stream, first, started_s, progress):
            finish_reason = reason or finish_reason
        usage = progress.usage(len(prepared.prompt_ids))
        common = self._common(prepared, first["served"])
        if prepared.route == "chat":
            reply = self._requests.chat_reply(prepared, progress)
            choice = ChatChoice(message=response_message(reply), finish_reason=chat_finish_reason(reply, finish_reason))
            return ChatCompletionResponse(**common, choices=[choice], usage=usage).model_dump()
        choice = CompletionChoice(text=progress.reply_text(), finish_reason=finish_reason)
        return CompletionResponse(**common, choices=[choice], usage=usage).model_dump()

    async def _sse(self, prepared: _Prepared, stream: Any, first: dict, started_s: float) -> AsyncIterator[str]:
        common = self._common(prepared, first["served"])
        progress = self._progress_for(prepared)
        chat = prepared.route == "chat"

        def event(model: BaseModel) -> str:
            return f"data: {model.model_dump_json(exclude_none=True)}\n\n"

        if chat:
            yield event(ChatCompletionChunk(**common, choices=[ChatChunkChoice(delta=ChatDelta(role="assistant"))]))
        # With tools, the turn is sent whole when it ends, its calls read back into tool_calls (calls are not
        # streamed piece by piece). With thinking on, the pieces are split into reasoning_content and content.
        whole_turn = chat and prepared.chat is not None and prepared.chat.call_format is not None
        reasoning = ReasoningStream() if chat and prepared.chat is not None and prepared.chat.thinking else None
        try:
            async for text, reason in self._generation(prepared, stream, first, started_s, progress):
                if whole_turn:
                    if reason is not None:
                        choice = whole_turn_choice(self._requests.chat_reply(prepared, progress), reason)
                        yield event(ChatCompletionChunk(**common, choices=[choice]))
                elif chat:
                    delta = text_delta(reasoning, text, reason)
                    if delta is not None:
                        choice = ChatChunkChoice(delta=delta, finish_reason=reason)
                        yield event(ChatCompletionChunk(**common, choices=[choice]))
                else:
                    yield event(CompletionChunk(**common, choices=[CompletionChoice(text=text, finish_reason=reason)]))
        except Exception as err:  # noqa: BLE001 - headers are sent; report in-band like OpenAI does
            logger.exception("stream %s failed", prepared.request_id)
            # One clean line: the Ray error names the replica, node and paths (those go to the Serve log only).
            failed = "the engine replica failed" if replica_died(err) else f"generation failed ({type(err).__name__})"
            error = ErrorResponse(error=ErrorBody(message=f"{failed}; retry the request", type="server_error",
                                                  code="engine_failed"))
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
