"""OpenAI-compatible request and response models for the Serve ingress.

Requests are strict (`extra="forbid"`): an unknown field is a 400 naming the field rather than being ignored,
so a client that relies on an unsupported option (e.g. `n=2`, `logprobs`) finds out at once.
Responses follow OpenAI's shapes and add two things: speculative statistics in `usage`
(`spec_accept_length`, `spec_verify_steps`, `spec_accepted_draft_tokens`) and the served model version
(`system_fingerprint` plus a `draftline` object with the registry name and version).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from draftline.engines.base import SpecStats


class StrictRequest(BaseModel):
    # strict: JSON true is not the integer 1, "10" is not 10, and [true, false] are not token ids.
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionCall(StrictRequest):
    name: str
    arguments: str = Field(description="a JSON object, as a string (OpenAI's form)")


class ToolCall(StrictRequest):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictRequest):
    role: Literal["system", "user", "assistant", "tool"]
    content: Optional[str] = Field(None, description="required except on an assistant turn with tool_calls")
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = Field(None, description="assistant turns only")
    tool_call_id: Optional[str] = Field(None, description="tool results only: the call it answers")
    reasoning_content: Optional[str] = Field(None, description="assistant turns: thinking the template may render")


class FunctionDefinition(StrictRequest):
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(StrictRequest):
    type: Literal["function"]
    function: FunctionDefinition


class StreamOptions(StrictRequest):
    include_usage: bool = False


class _SamplingFields(StrictRequest):
    """Fields shared by both endpoints. Bounds on max_tokens and the context are checked by the ingress."""

    model: Optional[str] = Field(None, description="ignored beyond a check: the endpoint serves one model")
    max_tokens: Optional[int] = Field(None, description="new tokens to generate (1 .. serve.max_tokens_limit)")
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: Literal[1] = Field(1, description="only one choice per request")
    # What torch.Generator.manual_seed accepts (int64 .. uint64).
    seed: Optional[int] = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: Optional[Union[str, list[str]]] = Field(None, description="up to 4 stop strings")
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, description="OpenAI's newer name for max_tokens")
    tools: Optional[list[Tool]] = None
    # Any JSON here: the ingress answers an unsupported choice with a 400 that says what is supported.
    tool_choice: Optional[Union[str, dict[str, Any]]] = Field(None, description='"auto" (the default) or "none"')
    chat_template_kwargs: Optional[dict[str, Any]] = Field(
        None, description="extra arguments for the target's chat template (vLLM's and SGLang's field), e.g. "
                          '{"enable_thinking": false}')

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[int]] = Field(description="a string or one list of token ids")
    echo: Literal[False] = False

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_tokens


class ServedVersion(BaseModel):
    """What answered a request: registry model name and version (or 'target-only') and the engine backend."""

    registered_model: str
    model_version: str
    backend: str

    @property
    def fingerprint(self) -> str:
        return f"{self.registered_model}:{self.model_version}"


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    spec_accept_length: float = Field(description="tokens emitted per target verify step, bonus token included")
    spec_verify_steps: int
    spec_accepted_draft_tokens: int

    @classmethod
    def from_stats(cls, prompt_tokens: int, completion_tokens: int, stats: Optional[SpecStats]) -> "Usage":
        stats = stats or SpecStats()
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            spec_accept_length=round(stats.accept_length, 4),
            spec_verify_steps=stats.verify_steps,
            spec_accepted_draft_tokens=stats.accepted_draft_tokens,
        )


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as a string


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str]
    tool_calls: list[ResponseToolCall] = Field(default_factory=list)
    reasoning_content: Optional[str] = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ResponseMessage
    finish_reason: Optional[str]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Optional[str]
    logprobs: None = None


class _ResponseBase(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str
    draftline: ServedVersion


class ChatCompletionResponse(_ResponseBase):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class CompletionResponse(_ResponseBase):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage


class DeltaToolCall(ResponseToolCall):
    index: int


class ChatDelta(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None  # as vLLM's and SGLang's reasoning parsers stream it
    tool_calls: Optional[list[DeltaToolCall]] = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: Optional[str] = None


class ChatCompletionChunk(_ResponseBase):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None


class CompletionChunk(_ResponseBase):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "draftline"
    draftline: ServedVersion


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorBody


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"
