"""The chat endpoint's tools and thinking, without Ray: a request rendered by prepare's template code, the generated
turn read back into tool_calls and reasoning_content, and every request a template cannot render a 400 naming the
field. The real layouts' templates (Llama-3.1, Qwen3, DeepSeek-V3, Kimi-K2) on the small tokenizers of
test_chat_templates.py; draftline's own template (the tiny target's) has no tool support."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from draftline.data.masks import end_of_turn_text, render, trained_spans
from draftline.serving.chat_render import ChatRenderError, ChatTemplate
from draftline.serving.openai_api import (
    ApiError,
    RequestValidator,
    _Progress,
    reads_back,
    chat_finish_reason,
    chat_traffic_fields,
    response_message,
    text_delta,
    traffic_record,
    whole_turn_choice,
)
from draftline.serving.openai_schema import ChatCompletionRequest
from draftline.target.reasoning import DEFAULT_REASONING_TAGS, ReasoningStream, split_reasoning
from test_chat_templates import FAMILIES, TIME, WEATHER, _call, family_tokenizer

CALL_FORMATS = {"llama3.1": "llama3_json", "qwen3": "hermes", "deepseek-v3": "deepseek_v3", "kimi-k2": "kimi_k2"}
PARALLEL = [n for n in FAMILIES if n != "llama3.1"]  # Llama-3.1's template takes one call per turn


@pytest.fixture(scope="module")
def templates():
    return {name: ChatTemplate(family_tokenizer(name)) for name in FAMILIES}


def _request(messages, **fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": messages, **fields})


def _openai_call(call: dict) -> dict:
    """A call as an OpenAI client sends it back: arguments as a JSON string."""
    function = call["function"]
    return {**call, "function": {**function, "arguments": json.dumps(function["arguments"])}}


def _generated_turn(template: ChatTemplate, history: list[dict], turn: dict, tools) -> str:
    """What the target generates for `turn`, as its own template writes it: the text after the generation prompt up
    to the end of turn (what the drafter is trained on)."""
    tokenizer = template.tokenizer
    prompt = render(tokenizer, history, tools, add_generation_prompt=True)
    whole = render(tokenizer, history + [turn], tools)
    assert whole.startswith(prompt)
    return whole[len(prompt):].split(end_of_turn_text(tokenizer), 1)[0]


def test_each_layout_is_found_from_its_template(templates):
    for name, template in templates.items():
        assert template.tools.renders_calls and template.tools.call_format.name == CALL_FORMATS[name], name
    assert [n for n, t in templates.items() if t.switch] == ["qwen3"] and templates["qwen3"].thinks_by_default


@pytest.mark.parametrize("name", FAMILIES)
def test_a_call_the_target_writes_is_read_back_into_tool_calls(name, templates):
    template = templates[name]
    tools = [WEATHER, TIME]
    history = [{"role": "user", "content": "weather in paris?"}]
    calls = [_call("functions.get_weather:0", "get_weather", {"city": "paris", "days": [1, 2]})]
    if name in PARALLEL:
        calls.append(_call("functions.get_time:1", "get_time", {}))
    turn = {"role": "assistant", "content": "", "tool_calls": calls}
    rendered = template.render(_request(history, tools=tools))
    reply = template.reply(rendered, _generated_turn(template, history, turn, tools))
    assert [(c.name, c.arguments) for c in reply.calls] == [(c["function"]["name"], c["function"]["arguments"])
                                                           for c in calls]
    assert reply.content is None
    message = response_message(reply).model_dump()
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [c["function"]["arguments"]
                                                                                       for c in calls]
    assert all(c["id"] and c["type"] == "function" for c in message["tool_calls"])
    if name == "kimi-k2":  # Kimi-K2's own ids are kept: its template writes them back into the history
        assert [c["id"] for c in message["tool_calls"]] == [c["id"] for c in calls]
    if name == "qwen3":  # thinking on by default: the think block the target writes is reasoning_content
        assert reply.reasoning == ""


def test_qwen3_reasoning_text_and_calls_are_split(templates):
    template = templates["qwen3"]
    history = [{"role": "user", "content": "weather in paris?"}]
    turn = {"role": "assistant", "content": "let me see.", "reasoning_content": "ask the tool",
            "tool_calls": [_call(None, "get_weather", {"city": "paris"})]}
    rendered = template.render(_request(history, tools=[WEATHER]))
    reply = template.reply(rendered, _generated_turn(template, history, turn, [WEATHER]))
    assert (reply.content, reply.reasoning, [c.name for c in reply.calls]) == ("let me see.", "ask the tool",
                                                                               ["get_weather"])
    plain = template.reply(template.render(_request(history)), "<think>\nhm\n</think>\n\nsunny.")
    assert (plain.content, plain.reasoning, plain.calls) == ("sunny.", "hm", None)


def test_text_that_is_no_call_or_a_malformed_call_stays_text(templates):
    template = templates["qwen3"]
    history = [{"role": "user", "content": "hi"}]
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    rendered = template.render(_request(history, tools=[WEATHER], **kwargs))
    broken = 'see <tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    for text in ("it is sunny.", broken):
        reply = template.reply(rendered, text)
        assert (reply.content, reply.calls, reply.reasoning) == (text, None, None)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris"}}\n</tool_call>'
    assert template.reply(rendered, call).calls
    none = template.render(_request(history, tools=[WEATHER], tool_choice="none", **kwargs))
    assert none.call_format is None and template.reply(none, call).content == call


@pytest.mark.parametrize("name", FAMILIES)
def test_a_tool_conversation_renders_as_prepare_trains_it(name, templates):
    """The endpoint's prompt for a conversation up to its last reply, sent in OpenAI's form (arguments as JSON
    strings, content null beside calls), is prepare's rendering up to where that reply's trained text starts."""
    template = templates[name]
    tokenizer = template.tokenizer
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather in paris?"},
        {"role": "assistant", "content": "", "tool_calls": [_call("functions.get_weather:0", "get_weather",
                                                                  {"city": "paris"})]},
        {"role": "tool", "content": "sunny", "tool_call_id": "functions.get_weather:0"},
        {"role": "assistant", "content": "it is sunny."},
    ]
    text, spans = trained_spans(tokenizer, messages, end_of_turn_text(tokenizer), tools=[WEATHER])
    sent = [{**m, "content": None, "tool_calls": [_openai_call(c) for c in m["tool_calls"]]} if m.get("tool_calls")
            else m for m in messages[:-1]]
    rendered = template.render(_request(sent, tools=[WEATHER]))
    assert rendered.text == text[: spans[-1][0]]
    assert rendered.segment == "has-tools"
    assert chat_traffic_fields(rendered) == {"prompt_segment": "has-tools", "tools": [WEATHER]}


def test_chat_template_kwargs_reach_the_template_and_set_the_segment(templates):
    template = templates["qwen3"]
    history = [{"role": "user", "content": "hi"}]
    on, off = (template.render(_request(history, chat_template_kwargs=kw)) for kw in ({}, {"enable_thinking": False}))
    assert off.text == on.text + "<think>\n\n</think>\n\n"
    assert (on.thinking, on.segment, off.thinking, off.segment) == (True, "thinking-on", False, "thinking-off")
    assert chat_traffic_fields(off)["chat_template_kwargs"] == {"enable_thinking": False}
    reply = template.reply(off, "sunny </think> really")  # thinking off: nothing is split off
    assert (reply.content, reply.reasoning) == ("sunny </think> really", None)


def _refused(template: ChatTemplate, messages, **fields) -> ChatRenderError:
    with pytest.raises(ChatRenderError) as info:
        template.render(_request(messages, **fields))
    return info.value


def test_what_the_template_cannot_render_is_an_error_naming_the_field(templates):
    user = [{"role": "user", "content": "hi"}]
    qwen3 = templates["qwen3"]
    err = _refused(qwen3, user, tools=[WEATHER], tool_choice="required")
    assert err.param == "tool_choice" and '"auto"' in err.message and '"none"' in err.message
    err = _refused(qwen3, user, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert err.param == "tool_choice" and "named function" in err.message
    err = _refused(qwen3, user, chat_template_kwargs={"add_generation_prompt": False})
    assert err.param == "chat_template_kwargs.add_generation_prompt"
    err = _refused(qwen3, user + [{"role": "tool", "content": "sunny"}])
    assert err.param == "messages.1" and "no tool call before it" in str(err)
    bad_arguments = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{city"}}
    err = _refused(qwen3, user + [{"role": "assistant", "tool_calls": [bad_arguments]}])
    assert err.param == "messages.1" and "not JSON" in str(err)
    err = _refused(qwen3, [{"role": "user"}])
    assert (err.param, err.code) == ("messages.0.content", "missing_field")
    err = _refused(qwen3, [{"role": "user", "content": "hi", "tool_calls": [bad_arguments]}])
    assert err.param == "messages.0.tool_calls"
    two_calls = {"role": "assistant", "tool_calls": [_openai_call(_call("a", "get_weather", {"city": "x"})),
                                                     _openai_call(_call("b", "get_time", {}))]}
    err = _refused(templates["llama3.1"], user + [two_calls, {"role": "user", "content": "and?"}], tools=[WEATHER, TIME])
    assert (err.param, err.code) == ("messages.1", "template_error") and "refuses" in err.message


def test_a_template_without_tool_support_refuses_tools_and_calls():
    draftline = ChatTemplate(family_tokenizer("draftline"))
    assert not draftline.tools.renders_calls and draftline.switch is None
    user = [{"role": "user", "content": "hi"}]
    err = _refused(draftline, user, tools=[WEATHER])
    assert (err.param, err.code) == ("tools", "tools_not_supported")
    call = {"role": "assistant", "tool_calls": [_openai_call(_call("c1", "get_weather", {"city": "x"}))]}
    err = _refused(draftline, user + [call, {"role": "tool", "content": "sunny"}])
    assert err.param == "messages.1.tool_calls"
    assert draftline.render(_request(user, tool_choice="none")).segment == "plain"


def test_the_ingress_answers_a_refused_chat_with_400_and_reads_turns_with_special_tokens(tiny_cfg, tiny_target_dir):
    validator = RequestValidator(tiny_cfg)
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
    with pytest.raises(ApiError) as info:
        validator.prepare("chat", json.dumps(body).encode())
    assert (info.value.status, info.value.param, info.value.code) == (400, "tools", "tools_not_supported")
    tokenizer = validator.tokenizer
    ids = tokenizer("a b", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert validator.turn_text(ids + ids, []) == tokenizer.decode(ids[:-1], skip_special_tokens=False)
    assert validator.turn_text(ids, ["b"]) == tokenizer.decode(ids[:-1])[: tokenizer.decode(ids[:-1]).find("b")]


def test_a_qwen3_target_served_with_tools_answers_tool_calls_whole_and_streamed(tiny_cfg, tiny_target_dir):
    """The ingress's path from the request body to the response message, with a Qwen3-layout tokenizer in place of
    the tiny target's: the generated tokens of a call turn come back as tool_calls, finish_reason tool_calls."""
    validator = RequestValidator(tiny_cfg)
    validator.use_tokenizer(family_tokenizer("qwen3"))
    tokenizer = validator.tokenizer
    body = {"messages": [{"role": "user", "content": "weather in paris?"}], "tools": [WEATHER], "stream": True}
    prepared = validator.prepare("chat", json.dumps(body).encode())
    assert tokenizer.decode(prepared.prompt_ids) == prepared.chat.text and prepared.chat.segment == "has-tools"
    turn = ('<think>\nask\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris"}}\n'
            "</tool_call><|im_end|>")
    progress = _Progress(token_ids=tokenizer(turn, add_special_tokens=False)["input_ids"], finish_reason="stop")
    assert reads_back(prepared)  # so its tokens are kept with serve.traffic off too
    reply = validator.chat_reply(prepared, progress)
    message = response_message(reply).model_dump()
    assert (message["content"], message["reasoning_content"]) == (None, "ask")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "paris"})]
    assert chat_finish_reason(reply, "stop") == "tool_calls" and chat_finish_reason(reply, "length") == "length"
    streamed = whole_turn_choice(reply, "stop")
    assert streamed.finish_reason == "tool_calls" and [c.index for c in streamed.delta.tool_calls] == [0]
    assert streamed.delta.reasoning_content == "ask"  # a whole turn streamed keeps its reasoning
    served = {"registered_model": "m", "model_version": "1", "backend": "reference"}
    record = traffic_record(prepared, served, progress)
    assert (record["prompt_segment"], record["tools"]) == ("has-tools", [WEATHER])


# Pieces a thinking turn is made of, tag fragments and whitespace among them, so pieces split tags and runs of spaces.
TURN_PIECES = st.lists(st.sampled_from(["<think>", "</think>", "<", "/", "think", ">", "</", "\n", " ", "a", "b c",
                                        "\n\n"]), max_size=12)


@settings(max_examples=300, deadline=None)
@given(head=TURN_PIECES, tail=TURN_PIECES, cuts=st.lists(st.integers(0, 200), max_size=8))
def test_a_streamed_thinking_turn_joins_to_the_whole_replys_reasoning_and_content(head, tail, cuts):
    """Streamed with thinking on, reasoning_content and content, each joined, are what the non-streamed reply has
    (split_reasoning, the rule regenerate and the endpoint use), however the engine cut the text into pieces."""
    turn = "".join(head) + DEFAULT_REASONING_TAGS[1] + "".join(tail)
    bounds = sorted({min(c, len(turn)) for c in cuts} | {0, len(turn)})
    pieces = [turn[a:b] for a, b in zip(bounds, bounds[1:])] or [""]
    stream, thought, content = ReasoningStream(), "", ""
    for k, piece in enumerate(pieces):
        delta = text_delta(stream, piece, "stop" if k == len(pieces) - 1 else None)
        if delta is not None:
            thought, content = thought + (delta.reasoning_content or ""), content + (delta.content or "")
    assert (content, thought) == split_reasoning(turn, DEFAULT_REASONING_TAGS)


def test_a_streamed_thinking_turn_sends_reasoning_before_the_end_tag_arrives():
    """Reasoning is streamed as it is generated, not held to the end; a piece that may be a tag waits."""
    stream = ReasoningStream()
    assert text_delta(stream, "<think>\nfirst", None).reasoning_content == "first"
    assert text_delta(stream, " step</th", None).reasoning_content == " step"
    last = text_delta(stream, "ink>\n\nThe answer.", "stop")
    assert (last.reasoning_content, last.content) == (None, "The answer.")
    assert text_delta(None, "as is", None).content == "as is"  # thinking off: every piece is content
