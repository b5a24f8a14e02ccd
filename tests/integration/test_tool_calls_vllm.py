"""The endpoint reads a target's tool calls back as vLLM 0.32's own tool parsers do (.venv-vllm): for each layout
with tools (Llama-3.1, Qwen3, DeepSeek-V3, Kimi-K2), the turn its template writes for some calls (what the target is
trained to generate) is parsed by draftline (data/tool_calls.py, through the endpoint's ChatTemplate) and by vLLM's
parser of that format (hermes, llama3_json, deepseek_v3, kimi_k2); names, arguments and text must agree."""

from __future__ import annotations

import json
import subprocess

from draftline.config import DraftlineConfig
from draftline.data.masks import end_of_turn_text, render
from draftline.engines.vllm.engine import vllm_python
from draftline.serving.chat_render import ChatTemplate
from draftline.serving.openai_schema import ChatCompletionRequest
from draftline.target.bootstrap import _train_tokenizer
from draftline.target.chat_layouts import chat_layout

CORPUS = ["weather in paris? it is sunny.", "let me see: two calls, one answer."] * 20
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def _call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


ONE = [_call("functions.get_weather:0", "get_weather", {"city": "paris", "days": [1, 2], "unit": "c"})]
TWO = ONE + [_call("functions.get_time:1", "get_time", {})]
# (layout, vLLM's parser, text beside the calls, calls): Llama-3.1 writes one call alone, as published.
CASES = [("llama3.1", "llama3_json", "", ONE), ("qwen3", "hermes", "", TWO), ("qwen3", "hermes", "let me see.", ONE),
         ("deepseek-v3", "deepseek_v3", "", TWO), ("deepseek-v3", "deepseek_v3", "let me see.", ONE),
         ("kimi-k2", "kimi_k2", "", TWO), ("kimi-k2", "kimi_k2", "let me see.", ONE)]

VLLM_TOOL_PARSE = """
import json, sys
from transformers import AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tool_parsers.deepseekv3_tool_parser import DeepSeekV3ToolParser
from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from vllm.tool_parsers.kimi_k2_tool_parser import KimiK2ToolParser
from vllm.tool_parsers.llama_tool_parser import Llama3JsonToolParser

PARSERS = {"hermes": Hermes2ProToolParser, "llama3_json": Llama3JsonToolParser, "deepseek_v3": DeepSeekV3ToolParser,
           "kimi_k2": KimiK2ToolParser}
report = []
for directory, parser_name, text, tools in json.loads(sys.argv[1]):
    parser = PARSERS[parser_name](AutoTokenizer.from_pretrained(directory), None)
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=tools)
    info = parser.extract_tool_calls(text, request)
    report.append({"called": info.tools_called, "content": info.content, "calls": [
        {"name": c.function.name, "arguments": json.loads(c.function.arguments), "id": c.id} for c in info.tool_calls]})
print("REPORT", json.dumps(report))
"""


def _generated_turn(tokenizer, text: str, calls: list[dict], tools: list[dict]) -> str:
    """The turn as the template writes it after the generation prompt, up to its end of turn."""
    history = [{"role": "user", "content": "weather in paris?"}]
    prompt = render(tokenizer, history, tools, add_generation_prompt=True)
    whole = render(tokenizer, history + [{"role": "assistant", "content": text, "tool_calls": calls}], tools)
    return whole[len(prompt):].split(end_of_turn_text(tokenizer), 1)[0]


def test_tool_calls_are_read_back_as_vllm_reads_them(tmp_path):
    tools = [WEATHER, TIME]
    probes, ours = [], []
    for layout, parser, text, calls in CASES:
        tokenizer = _train_tokenizer(CORPUS, 320, chat_layout(layout))
        if layout == "llama3.1":  # vLLM's parser needs the published tokenizer's <|python_tag|> (builtin tools,
            tokenizer.add_tokens(["<|python_tag|>"], special_tokens=True)  # which the layout leaves out)
        directory = tmp_path / layout
        tokenizer.save_pretrained(directory)
        template = ChatTemplate(tokenizer)
        assert template.tools.call_format.name == parser
        request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": tools,
                                                        "chat_template_kwargs": {"enable_thinking": False}})
        turn = _generated_turn(tokenizer, text, calls, tools)
        ours.append(template.reply(template.render(request), turn))
        probes.append((str(directory), parser, turn, tools))
    done = subprocess.run([str(vllm_python(DraftlineConfig())), "-c", VLLM_TOOL_PARSE, json.dumps(probes)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(done.stdout.split("REPORT", 1)[1])
    for (layout, _, text, calls), mine, vllm in zip(CASES, ours, theirs):
        assert vllm["called"] and mine.calls, (layout, text)
        assert [(c.name, c.arguments) for c in mine.calls] == [(c["name"], c["arguments"]) for c in vllm["calls"]]
        assert [(c.name, c.arguments) for c in mine.calls] == [(c["function"]["name"], c["function"]["arguments"])
                                                               for c in calls]
        assert mine.content == ((vllm["content"] or "").strip() or None), layout
        if layout == "kimi-k2":  # both keep Kimi-K2's own ids
            assert [c.id for c in mine.calls] == [c["id"] for c in vllm["calls"]]
