"""Tool calls in the text a target generated, read back into OpenAI's form, as vLLM's and SGLang's tool parsers do.

Which format a target writes its calls in is found from its own chat template, not from its name: a probe call is
rendered as an assistant turn, and the text the template writes for it (what the target is trained to generate)
names the format by its markers. The formats are the tool-call layouts of docs/chat-templates.md:

| format | the call, as the template writes it | vLLM's parser of it |
|---|---|---|
| `hermes` (Qwen3) | `<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>` per call | `hermes` |
| `llama3_json` (Llama-3.1) | `{"name": NAME, "parameters": ARGS}` as the whole turn | `llama3_json` |
| `deepseek_v3` | `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` + json fence + `<｜tool▁call▁end｜>` | `deepseek_v3` |
| `kimi_k2` | `<\\|tool_call_begin\\|>functions.NAME:INDEX<\\|tool_call_argument_begin\\|>ARGS<\\|tool_call_end\\|>` | `kimi_k2` |

A template that renders the probe call in none of these has `renders_calls` but no format: its calls stay text.
A template that leaves the probe call out (draftline's own) has no tool support at all.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Callable, Optional

from draftline.data.masks import TemplateError, render

_PROBE_NAME = "draftline_probe_tool"
_PROBE_ARGUMENTS = {"draftline_probe_argument": "draftline_probe_value"}
_PROBE_TOOL = {"type": "function", "function": {"name": _PROBE_NAME, "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: dict
    id: Optional[str] = None  # the id the target wrote (Kimi-K2's functions.NAME:INDEX), else None

    def openai(self) -> dict:
        """OpenAI's `tool_calls` entry: arguments as a JSON string, an id (the target's own, else a new one)."""
        call_id = self.id or f"call_{uuid.uuid4().hex[:24]}"
        return {"id": call_id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


@dataclass(frozen=True)
class CallFormat:
    name: str
    start: str  # the text a turn's calls begin with: what comes before it is the turn's text
    parse: Callable[[str], Optional[list[ParsedCall]]]  # the text from `start` on -> the calls, None: not calls
    whole_turn: bool = False  # the calls are the whole turn (Llama-3.1): `start` counts only at the turn's start

    def starts_at(self, text: str) -> int:
        """Where the calls begin in `text`, -1 when they do not."""
        if self.whole_turn:
            return 0 if text.lstrip().startswith(self.start) else -1
        return text.find(self.start)


def _json_object(text: str) -> Optional[dict]:
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _named_call(value: Optional[dict], arguments_key: str) -> Optional[ParsedCall]:
    if value is None or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get(arguments_key, value.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI sends them
        arguments = _json_object(arguments)
    return ParsedCall(value["name"], arguments) if isinstance(arguments, dict) else None


def _all_or_none(calls: list[Optional[ParsedCall]]) -> Optional[list[ParsedCall]]:
    """A turn's calls only when every one of them parses: a half-read turn stays text, as the target wrote it."""
    return calls if calls and all(call is not None for call in calls) else None


_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _parse_hermes(text: str) -> Optional[list[ParsedCall]]:
    bodies = _HERMES_CALL.findall(text)
    if _HERMES_CALL.sub("", text).strip():  # text after or between the calls: not a call turn as trained
        return None
    return _all_or_none([_named_call(_json_object(body), "arguments") for body in bodies])


def _parse_llama3_json(text: str) -> Optional[list[ParsedCall]]:
    # Llama-3.1 writes one call per turn; vLLM's parser also reads several joined by ';'.
    decoder, calls, at = json.JSONDecoder(), [], 0
    text = text.strip()
    while at < len(text):
        try:
            value, at = decoder.raw_decode(text, at)
        except (json.JSONDecodeError, RecursionError):
            return None
        calls.append(_named_call(value if isinstance(value, dict) else None, "parameters"))
        at = len(text) - len(text[at:].lstrip().removeprefix(";").lstrip())
    return _all_or_none(calls)


_DEEPSEEK_CALL = re.compile(r"<｜tool▁call▁begin｜>(?P<type>.*?)<｜tool▁sep｜>(?P<name>.*?)\n```json\n(?P<arguments>.*?)\n```"
                            r"<｜tool▁call▁end｜>", re.DOTALL)


def _parse_deepseek_v3(text: str) -> Optional[list[ParsedCall]]:
    return _all_or_none([_named_call({"name": m["name"].strip(), "arguments": _json_object(m["arguments"])}, "arguments")
                         for m in _DEEPSEEK_CALL.finditer(text)])


_KIMI_CALL = re.compile(r"<\|tool_call_begin\|>\s*(?P<id>.*?)\s*<\|tool_call_argument_begin\|>\s*(?P<arguments>.*?)\s*"
                        r"<\|tool_call_end\|>", re.DOTALL)


def _parse_kimi_k2(text: str) -> Optional[list[ParsedCall]]:
    calls = []
    for m in _KIMI_CALL.finditer(text):
        name = m["id"].split(":")[0].split(".")[-1]  # Kimi-K2's own ids read functions.NAME:INDEX
        call = _named_call({"name": name, "arguments": _json_object(m["arguments"])}, "arguments")
        calls.append(call and ParsedCall(call.name, call.arguments, m["id"]))
    return _all_or_none(calls)


CALL_FORMATS = (
    CallFormat("hermes", "<tool_call>", _parse_hermes),
    CallFormat("deepseek_v3", "<｜tool▁calls▁begin｜>", _parse_deepseek_v3),
    CallFormat("kimi_k2", "<|tool_calls_section_begin|>", _parse_kimi_k2),
    CallFormat("llama3_json", '{"name"', _parse_llama3_json, whole_turn=True),
)


@dataclass(frozen=True)
class TemplateTools:
    """What a chat template does with tools: whether it renders an assistant's calls, and in which known format."""

    renders_calls: bool
    call_format: Optional[CallFormat]


def template_tools(tokenizer) -> TemplateTools:
    """Render a probe call as an assistant turn and read its format from the text the template writes for it."""
    call = {"id": "functions.draftline_probe_tool:0", "type": "function",
            "function": {"name": _PROBE_NAME, "arguments": _PROBE_ARGUMENTS}}
    history = [{"role": "user", "content": "probe"}]
    try:
        prompt = render(tokenizer, history, [_PROBE_TOOL], add_generation_prompt=True)
        whole = render(tokenizer, history + [{"role": "assistant", "content": "", "tool_calls": [call]}], [_PROBE_TOOL])
    except TemplateError:
        return TemplateTools(False, None)
    turn = whole[len(prompt):] if whole.startswith(prompt) else whole
    if _PROBE_NAME not in turn:
        return TemplateTools(False, None)
    return TemplateTools(True, next((f for f in CALL_FORMATS if f.starts_at(turn) >= 0), None))


def split_calls(text: str, call_format: CallFormat) -> tuple[str, Optional[list[ParsedCall]]]:
    """(the turn's text before its calls, the calls) of a generated turn; (text, None) when it made no call that
    parses (a malformed call stays text, as vLLM's parsers leave it)."""
    at = call_format.starts_at(text)
    if at < 0:
        return text, None
    calls = call_format.parse(text[at:])
    return (text[:at], calls) if calls else (text, None)
