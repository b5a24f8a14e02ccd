"""A chat request rendered with the target's own chat template, and the generated turn read back.

Rendering is prepare's (data/masks.py `render`): the messages, tools and tool turns are read into the one form every
template takes by data/tool_turns.py, and `chat_template_kwargs` are passed to the template as vLLM and SGLang pass
them (Qwen3's `enable_thinking`). So the endpoint serves exactly the prompts the drafter was trained on.

Reading back: a target whose template has a known tool-call format (data/tool_calls.py) gets its calls parsed into
`tool_calls` when the request has tools (and tool_choice is not "none"); a target whose template has a thinking
switch (data/thinking.py) gets the reasoning before `</think>` split into `reasoning_content` when thinking is on,
by the same rule regenerate uses (target/reasoning.py).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Optional

from draftline.bench.prompts import segment_of
from draftline.data.masks import TemplateError, render
from draftline.data.thinking import thinking_switch, thinks_by_default
from draftline.data.tool_calls import CallFormat, ParsedCall, split_calls, template_tools
from draftline.data.tool_turns import ToolTurnError, assistant_calls, check_results_follow_calls, normalize_tools, tool_result
from draftline.serving.openai_schema import ChatCompletionRequest
from draftline.target.reasoning import DEFAULT_REASONING_TAGS, split_reasoning

TOOL_CHOICES = ("auto", "none")
# Names the template already gets from the renderer: a chat_template_kwargs key may not replace them.
_RENDERER_NAMES = {"messages", "tools"}


class ChatRenderError(ValueError):
    """A chat request the template cannot render; `param` is the request field (e.g. messages.2.tool_calls)."""

    def __init__(self, param: str, message: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param, self.message, self.code = param, message, code


@dataclass
class RenderedChat:
    text: str  # the prompt, as the template renders it with the generation prompt
    messages: list[dict]  # as the template got them
    tools: Optional[list[dict]]
    template_kwargs: dict
    call_format: Optional[CallFormat]  # set when generated calls are to be read back into tool_calls
    thinking: Optional[bool]  # None: the template has no thinking switch
    segment: str  # bench/prompts.py's: has-tools, thinking-on, thinking-off or plain


@dataclass
class ChatReply:
    content: Optional[str]
    reasoning: Optional[str] = None
    calls: Optional[list[ParsedCall]] = None


class ChatTemplate:
    """The target's chat template and what it does with tools and thinking (found once, by rendering probes)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tools = template_tools(tokenizer)
        self.switch = thinking_switch(tokenizer.chat_template)
        self.thinks_by_default = thinks_by_default(tokenizer, self.switch) if self.switch else False
        signature = inspect.signature(tokenizer.apply_chat_template).parameters
        self._reserved = _RENDERER_NAMES | {name for name, p in signature.items() if p.kind != p.VAR_KEYWORD}

    def render(self, req: ChatCompletionRequest) -> RenderedChat:
        tool_choice = self._tool_choice(req.tool_choice)
        template_kwargs = self._template_kwargs(req.chat_template_kwargs)
        try:
            tools = normalize_tools([tool.model_dump(exclude_none=True) for tool in req.tools or []])
            messages = [_template_message(m.model_dump(exclude_none=True), i) for i, m in enumerate(req.messages)]
            check_results_follow_calls(messages, list(range(len(messages))))
        except ToolTurnError as err:
            raise ChatRenderError("tools" if err.turn is None else f"messages.{err.turn}", str(err)) from None
        self._check_tool_support(tools, messages)
        text = self._render_text(messages, tools, template_kwargs)
        thinking = bool(template_kwargs.get(self.switch, self.thinks_by_default)) if self.switch else None
        call_format = self.tools.call_format if tools and tool_choice == "auto" else None
        mode = None if thinking is None else ("on" if thinking else "off")
        return RenderedChat(text, messages, tools, template_kwargs, call_format, thinking,
                            segment_of(tools, messages, mode))

    def reply(self, rendered: RenderedChat, text: str) -> ChatReply:
        """The generated turn read back: reasoning split off when thinking is on, calls parsed when asked for."""
        content, reasoning = text, None
        if rendered.thinking and DEFAULT_REASONING_TAGS[1] in text:
            content, reasoning = split_reasoning(text, DEFAULT_REASONING_TAGS)
        if rendered.call_format is not None:
            before, calls = split_calls(content, rendered.call_format)
            if calls:
                return ChatReply(before.strip() or None, reasoning, calls)
        return ChatReply(content, reasoning)

    def _tool_choice(self, choice) -> str:
        if choice is None:
            return "auto"
        if choice not in TOOL_CHOICES:
            shown = choice if isinstance(choice, str) else "a named function"
            raise ChatRenderError("tool_choice", f"tool_choice {shown!r} is not supported: this endpoint supports "
                                  '"auto" (the default: the target decides, and its calls come back in tool_calls) '
                                  'and "none" (no call is read back); send one of those')
        return choice

    def _template_kwargs(self, kwargs: Optional[dict]) -> dict:
        kwargs = dict(kwargs or {})
        clash = sorted(set(kwargs) & self._reserved)
        if clash:
            raise ChatRenderError(f"chat_template_kwargs.{clash[0]}", f"chat_template_kwargs may not set {clash[0]!r}: "
                                  "the endpoint passes it to the template itself (messages and tools from the request, "
                                  "the generation prompt always on); remove it")
        return kwargs

    def _check_tool_support(self, tools: Optional[list[dict]], messages: list[dict]) -> None:
        if self.tools.renders_calls:
            return
        calling = next((i for i, m in enumerate(messages) if m.get("tool_calls")), None)
        if tools is None and calling is None:
            return
        param = "tools" if tools is not None else f"messages.{calling}.tool_calls"
        raise ChatRenderError(param, "the target's chat template has no tool support (it does not render an "
                              "assistant's tool calls, so the target cannot see or make them): send the request "
                              "without tools and tool_calls, or serve a target whose template supports tools",
                              code="tools_not_supported")

    def _render_text(self, messages: list[dict], tools: Optional[list[dict]], template_kwargs: dict) -> str:
        try:
            return render(self.tokenizer, messages, tools, add_generation_prompt=True, template_kwargs=template_kwargs)
        except TemplateError as err:
            at = self._first_refused(messages, tools, template_kwargs)
            where = f"messages.{at}" if at is not None else "messages"
            raise ChatRenderError(where, f"{where}: {err}", code="template_error") from None

    def _first_refused(self, messages: list[dict], tools: Optional[list[dict]], template_kwargs: dict) -> Optional[int]:
        """The index of the first message whose conversation up to it the template refuses (None: only the whole)."""
        for end in range(1, len(messages) + 1):
            try:
                render(self.tokenizer, messages[:end], tools, template_kwargs=template_kwargs)
            except TemplateError:
                return end - 1
        return None


def _template_message(message: dict, index: int) -> dict:
    """A request message in the form templates take (data/tool_turns.py): arguments parsed into objects."""
    role = message["role"]
    for field, allowed in (("tool_calls", "assistant"), ("tool_call_id", "tool")):
        if message.get(field) and role != allowed:
            raise ChatRenderError(f"messages.{index}.{field}", f"messages.{index}: {field} is for {allowed} messages, "
                                  f"not {role} messages; remove it")
    if role == "tool":
        return tool_result(message, index, "content")
    calls = message.pop("tool_calls", None)
    if calls:
        message["tool_calls"] = assistant_calls({"tool_calls": calls}, index, "content")
        message["content"] = message.get("content") or ""
    elif message.get("content") is None:
        raise ChatRenderError(f"messages.{index}.content", f"messages.{index}: a {role} message needs content (a "
                              "string); only an assistant message with tool_calls may leave it out",
                              code="missing_field")
    return message
