"""Tool use in a conversation, read into the one form every chat template takes (OpenAI's, as transformers, vLLM and
SGLang pass it): a record's `tools` as a list of {"type": "function", "function": {...}}; an assistant turn's calls
as `tool_calls` [{"id"?, "type": "function", "function": {"name", "arguments": object}}]; a tool result as
{"role": "tool", "content", "tool_call_id"?, "name"?}.

Arguments are parsed into an object (a JSON string in OpenAI's format): templates write them with `tojson`
(Llama-3.1 would otherwise write a quoted string), and serving engines parse them the same way before rendering.
ShareGPT's forms map onto these: `function_call` (a turn whose value is {"name", "arguments"} or a list of them)
is an assistant turn with those calls and no text, `observation` a tool result. The old OpenAI forms too: an
assistant's `function_call` field, the `function` role. Llama's `ipython` role is a tool result.

A malformed tool turn raises `ToolTurnError` naming the turn, the field and the fix; the caller makes it one bad input.
"""

from __future__ import annotations

import json
from typing import Optional

# Roles whose content is a tool's output (OpenAI, old OpenAI functions, Llama-3.1, ShareGPT/LLaMA-Factory).
TOOL_RESULT_ROLES = ("tool", "function", "ipython", "observation")
SHAREGPT_CALL_ROLE = "function_call"


class ToolTurnError(ValueError):
    """A tool turn the chat template cannot render as recorded; `turn` is the 0-based index in the record."""

    def __init__(self, turn: Optional[int], message: str):
        where = f"turn {turn}: " if turn is not None else ""
        super().__init__(where + message)
        self.turn = turn


def _parsed_json(value, turn: Optional[int], field: str, fix: str):
    try:
        return json.loads(value)
    except (json.JSONDecodeError, RecursionError) as err:
        reason = err.msg if isinstance(err, json.JSONDecodeError) else "nested too deeply"
        raise ToolTurnError(turn, f"{field} is not JSON ({reason}): {fix}") from None


def normalize_tools(value) -> Optional[list[dict]]:
    """The record's `tools` (a list, or a JSON string of one, as LLaMA-Factory writes it) -> OpenAI tool schemas."""
    if value in (None, "", []):
        return None
    fix = 'write tools as a list of {"type": "function", "function": {"name", "description", "parameters"}}'
    if isinstance(value, str):
        value = _parsed_json(value, None, "the record's 'tools'", fix)
    if not isinstance(value, list):
        raise ToolTurnError(None, f"the record's 'tools' is {type(value).__name__}, not a list; {fix}")
    tools = []
    for k, tool in enumerate(value):
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ToolTurnError(None, f"the record's tools[{k}] has no function name; {fix}")
        tools.append({"type": "function", "function": function})
    return tools


def _one_call(call, turn: int, field: str) -> dict:
    fix = 'write each call as {"type": "function", "function": {"name": ..., "arguments": "{...JSON object...}"}}'
    if not isinstance(call, dict):
        raise ToolTurnError(turn, f"{field} is {type(call).__name__}, not an object; {fix}")
    function = call.get("function", call)  # ShareGPT and old OpenAI calls are the function itself
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise ToolTurnError(turn, f"{field} has no function name; {fix}")
    arguments = function.get("arguments", function.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = _parsed_json(arguments, turn, f"{field} arguments ({_excerpt(arguments)})",
                                 "write the arguments as a JSON object (or a string holding one)")
    if not isinstance(arguments, dict):
        raise ToolTurnError(turn, f"{field} arguments are {type(arguments).__name__}, not a JSON object; {fix}")
    normalized = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if isinstance(call.get("id"), str) and call["id"]:
        normalized = {"id": call["id"], **normalized}
    return normalized


def _excerpt(text: str) -> str:
    return repr(text) if len(text) <= 40 else repr(text[:37]) + "..."


def assistant_calls(turn: dict, turn_index: int, content_key: str) -> Optional[list[dict]]:
    """The calls of an assistant turn: `tool_calls`, an old OpenAI `function_call` field, or a ShareGPT
    `function_call` turn's value (a JSON call or a list of them). None when the turn calls nothing."""
    if turn.get("tool_calls"):
        calls, field = turn["tool_calls"], "tool_calls"
        if not isinstance(calls, list):
            raise ToolTurnError(turn_index, f"tool_calls is {type(calls).__name__}, not a list of calls")
    elif isinstance(turn.get("function_call"), dict):
        calls, field = [turn["function_call"]], "function_call"
    elif turn.get("from") == SHAREGPT_CALL_ROLE:
        value = turn.get(content_key)
        if isinstance(value, str):
            value = _parsed_json(value, turn_index, f"{content_key} of the function_call turn",
                                 'write the call as {"name": ..., "arguments": {...}}')
        calls, field = (value if isinstance(value, list) else [value]), content_key
    else:
        return None
    return [_one_call(call, turn_index, f"{field}[{k}]") for k, call in enumerate(calls)]


def tool_result(turn: dict, turn_index: int, content_key: str) -> dict:
    content = turn.get(content_key)
    if not isinstance(content, str):
        raise ToolTurnError(turn_index, f"the tool result's {content_key} is {type(content).__name__}, not a string; "
                            "write the tool's output as a string (a JSON string for structured output)")
    result = {"role": "tool", "content": content}
    for key in ("tool_call_id", "name"):
        if isinstance(turn.get(key), str) and turn[key]:
            result[key] = turn[key]
    return result


def check_results_follow_calls(messages: list[dict], record_turns: list[int]) -> None:
    """Every tool result answers a call of the assistant turn before it (one result per call at most, ids matching
    when both have them). `record_turns[i]` is message i's index in the record, for the error."""
    pending: list[dict] = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            pending = list(message.get("tool_calls") or [])
        elif message["role"] == "tool":
            if not pending:
                raise ToolTurnError(record_turns[i], "a tool result with no tool call before it (the assistant turn "
                                    "before it calls no tool, or every call already has its result); add the call "
                                    "to that assistant turn's tool_calls or remove the result")
            _take_call(pending, message, record_turns[i])
        else:
            pending = []


def _take_call(pending: list[dict], result: dict, turn: int) -> None:
    wanted = result.get("tool_call_id")
    ids = [call.get("id") for call in pending]
    if wanted is None or not any(ids):
        pending.pop(0)
        return
    if wanted not in ids:
        raise ToolTurnError(turn, f"the tool result's tool_call_id {wanted!r} is none of the open calls' ids "
                            f"({', '.join(repr(i) for i in ids if i)}); fix the id")
    pending.pop(ids.index(wanted))
