"""Real chat-template layouts (Llama-3.1, Qwen3 with thinking, DeepSeek-V3, Kimi-K2): golden token-level loss masks.

Each template in platform/draftline/target/chat_templates/ is draftline's own rendering of a published layout (the
header of each .jinja names the published file and what it leaves out; layouts.json names its tokens). The tokenizer
is a small byte-level BPE trained here with the `tokenizers` package (the embedded target's `_train_tokenizer`), with
that layout's special and added tokens.

Tool use: `TOOL_CONVERSATIONS` (a record's `tools`, assistant `tool_calls`, `tool` results) go through the same checks;
the hand-written layouts write the published tool layouts (the schemas, each call, each result), and the trained
segments are the calls as the template writes them and the replies, never a tool result or a schema.

Why the goldens are right, by construction and not by freezing output: `LAYOUTS` writes each family's published
layout out by hand as (text, trained) segments, where the trained segments are exactly the reply plus the
end-of-turn token (and, for Qwen3's last turn, its think block). The rendered text must equal the segments joined,
and the runs of masked tokens must equal the trained segments; only then is the token-level golden file compared,
which pins the token boundaries. `DRAFTLINE_UPDATE_GOLDEN=1` rewrites the golden files (after those checks pass).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from draftline.data.masks import TemplateError, build_masked_sample, end_of_turn_text
from draftline.target.bootstrap import _train_tokenizer
from draftline.target.chat_layouts import TEMPLATE_DIR, chat_layout, layout_names

FAMILIES = [name for name in layout_names() if name != "draftline"]  # draftline's own: tests/unit/test_data_masks.py
GOLDEN = Path(__file__).parents[1] / "data" / "chat_templates"

CORPUS = [
    "be brief. what is two plus two? it is four. and three? five.",
    "think step by step: two plus two makes four, two plus three makes five.",
    "hello world, how are you today? fine, thanks.\n\nok then.",
    "\n\n\n".join(["sections", "are", "split", "by", "two", "blank", "lines"]),
] * 20

CONVERSATIONS = {
    "reasoning_multi_turn": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is two plus two?"},
        {"role": "assistant", "content": "four", "reasoning_content": "two plus two makes four"},
        {"role": "user", "content": "and three?"},
        {"role": "assistant", "content": "it is five.", "reasoning_content": "two plus three makes five"},
    ],
    "no_system": [
        {"role": "user", "content": "hello world"},
        {"role": "assistant", "content": "fine, thanks."},
    ],
}


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def _call(call_id, name, arguments):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# (tools, messages) as conversations.py reads them: arguments parsed into objects.
TOOL_CONVERSATIONS = {
    "tool_use": ([WEATHER], [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather in paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "ask the tool",
         "tool_calls": [_call("functions.get_weather:0", "get_weather", {"city": "paris"})]},
        {"role": "tool", "content": "sunny", "tool_call_id": "functions.get_weather:0"},
        {"role": "assistant", "content": "it is sunny."},
    ]),
    "parallel_calls": ([WEATHER, TIME], [
        {"role": "user", "content": "weather and time?"},
        {"role": "assistant", "content": "let me see.", "tool_calls": [
            _call("functions.get_weather:0", "get_weather", {"city": "paris"}), _call("functions.get_time:1", "get_time", {})]},
        {"role": "tool", "content": "sunny", "tool_call_id": "functions.get_weather:0"},
        {"role": "tool", "content": "noon", "tool_call_id": "functions.get_time:1"},
        {"role": "assistant", "content": "sunny, at noon."},
        {"role": "user", "content": "thanks"},
        {"role": "assistant", "content": "you are welcome."},
    ]),
}
SINGLE_CALL_ONLY = {"llama3.1"}  # its template raises on more than one call per turn, as published


def _tool_conversations(name):
    return {k: v for k, v in TOOL_CONVERSATIONS.items() if not (name in SINGLE_CALL_ONLY and k == "parallel_calls")}


def family_tokenizer(name: str, template: str | None = None):
    """A byte-level BPE trained on CORPUS with the layout's tokens, carrying the layout's (or the given) template."""
    tokenizer = _train_tokenizer(CORPUS, 320, chat_layout(name))
    if template:
        tokenizer.chat_template = template
    return tokenizer


@pytest.fixture(scope="module")
def tokenizers():
    return {name: family_tokenizer(name) for name in FAMILIES}


# ------------------------------------------------------------------------------ the published layouts, by hand


def _llama31(messages, tools=None):
    header = "<|start_header_id|>{}<|end_header_id|>\n\n".format
    system = messages[0]["content"] if messages[0]["role"] == "system" else ""
    turns = messages[1:] if system else messages
    segments = [("<|begin_of_text|>" + header("system") + ("Environment: ipython\n" if tools else "") +
                 "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n" + system + "<|eot_id|>", False)]
    if tools:  # custom tools go in the first user message
        schemas = "".join(json.dumps(t, indent=4, ensure_ascii=False) + "\n\n" for t in tools)
        segments.append((header("user") + "Given the following functions, please respond with a JSON for a function "
                         "call with its proper arguments that best answers the given prompt.\n\nRespond in the format "
                         '{"name": function name, "parameters": dictionary of argument name and its value}.Do not use '
                         "variables.\n\n" + schemas + turns[0]["content"] + "<|eot_id|>", False))
        turns = turns[1:]
    for m in turns:
        if m["role"] == "tool":
            segments.append((header("ipython") + json.dumps(m["content"]) + "<|eot_id|>", False))
        elif m.get("tool_calls"):
            call = m["tool_calls"][0]["function"]
            segments += [(header("assistant"), False), ('{"name": "' + call["name"] + '", "parameters": ' +
                                                        json.dumps(call["arguments"]) + "}<|eot_id|>", True)]
        else:
            segments += [(header(m["role"]), False), (m["content"] + "<|eot_id|>", m["role"] == "assistant")]
    return segments


def _qwen3(messages, tools=None):
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    segments = []
    if tools:
        system = messages[0]["content"] + "\n\n" if messages[0]["role"] == "system" else ""
        messages = messages[1:] if system else messages
        last_user -= 1 if system else 0
        segments.append(("<|im_start|>system\n" + system + "# Tools\n\nYou may call one or more functions to assist "
                         "with the user query.\n\nYou are provided with function signatures within <tools></tools> "
                         "XML tags:\n<tools>" + "".join("\n" + json.dumps(t) for t in tools) + "\n</tools>\n\nFor "
                         "each function call, return a json object with function name and arguments within "
                         '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
                         "<args-json-object>}\n</tool_call><|im_end|>\n", False))
    for i, m in enumerate(messages):
        if m["role"] == "tool":  # a run of results is one user turn
            first = i == 0 or messages[i - 1]["role"] != "tool"
            last = i + 1 == len(messages) or messages[i + 1]["role"] != "tool"
            segments.append((("<|im_start|>user" if first else "") + f"\n<tool_response>\n{m['content']}\n"
                             "</tool_response>" + ("<|im_end|>\n" if last else ""), False))
            continue
        if m["role"] != "assistant":
            segments.append((f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n", False))
            continue
        segments.append(("<|im_start|>assistant\n", False))
        # Thinking is rendered after the last user message only, for the last turn or one that has it.
        reasoning = m.get("reasoning_content", "")
        think = f"<think>\n{reasoning}\n</think>\n\n" if i > last_user and (reasoning or i + 1 == len(messages)) else ""
        calls = "".join(("\n" if m["content"] or k else "") + '<tool_call>\n{"name": "' + c["function"]["name"] +
                        '", "arguments": ' + json.dumps(c["function"]["arguments"]) + "}\n</tool_call>"
                        for k, c in enumerate(m.get("tool_calls", [])))
        segments += [(think + m["content"] + calls + "<|im_end|>", True), ("\n", False)]
    return segments


def _deepseek_v3(messages, tools=None):
    """V3 has no place for tool schemas: `tools` renders nothing."""
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
    segments = [("<｜begin▁of▁sentence｜>" + system, False)]
    for i, m in enumerate(messages):
        after_results = i > 0 and messages[i - 1]["role"] == "tool"
        if m["role"] == "user":
            segments.append(("<｜User｜>" + m["content"], False))
        elif m["role"] == "tool":
            opens = "<｜tool▁outputs▁begin｜>" if messages[i - 1]["role"] == "assistant" else "\n"
            segments.append((opens + "<｜tool▁output▁begin｜>" + m["content"] + "<｜tool▁output▁end｜>", False))
        elif m["role"] == "assistant":
            calls = "\n".join("<｜tool▁call▁begin｜>function<｜tool▁sep｜>" + c["function"]["name"] + "\n```json\n" +
                              json.dumps(c["function"]["arguments"]) + "\n```<｜tool▁call▁end｜>" for c in m.get("tool_calls", []))
            calls = "<｜tool▁calls▁begin｜>" + calls + "<｜tool▁calls▁end｜>" if calls else ""
            segments += [("<｜tool▁outputs▁end｜>" if after_results else "<｜Assistant｜>", False),
                         (m["content"] + calls + "<｜end▁of▁sentence｜>", True)]
    return segments


def _kimi_k2(messages, tools=None):
    marker = {"system": "<|im_system|>", "user": "<|im_user|>", "assistant": "<|im_assistant|>", "tool": "<|im_system|>"}
    segments = []
    if tools:
        segments.append(("<|im_system|>tool_declare<|im_middle|>" + json.dumps(tools) + "<|im_end|>", False))
    if messages[0]["role"] != "system":
        segments.append(("<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>", False))
    for m in messages:
        head = f"{marker[m['role']]}{m['role']}<|im_middle|>"
        if m["role"] == "assistant":
            calls = "".join("<|tool_call_begin|>" + c["id"] + "<|tool_call_argument_begin|>" +
                            json.dumps(c["function"]["arguments"]) + "<|tool_call_end|>" for c in m.get("tool_calls", []))
            calls = "<|tool_calls_section_begin|>" + calls + "<|tool_calls_section_end|>" if calls else ""
            segments += [(head, False), (m["content"] + calls + "<|im_end|>", True)]
        elif m["role"] == "tool":
            segments.append((head + f"## Return of {m['tool_call_id']}\n" + m["content"] + "<|im_end|>", False))
        else:
            segments.append((head + m["content"] + "<|im_end|>", False))
    return segments


END_OF_TURN = {"llama3.1": "<|eot_id|>", "qwen3": "<|im_end|>", "deepseek-v3": "<｜end▁of▁sentence｜>", "kimi-k2": "<|im_end|>"}
LAYOUTS = {"llama3.1": _llama31, "qwen3": _qwen3, "deepseek-v3": _deepseek_v3, "kimi-k2": _kimi_k2}


def _merged(segments):
    out = []
    for text, trained in segments:
        if out and out[-1][1] == trained:
            out[-1] = (out[-1][0] + text, trained)
        elif text:
            out.append((text, trained))
    return out


def _runs(tokenizer, sample):
    """Decode consecutive runs of equal mask value: [(text, mask), ...]."""
    runs, current, value = [], [], None
    for token, m in zip(sample.input_ids, sample.loss_mask):
        if value is not None and m != value:
            runs.append((tokenizer.decode(current), bool(value)))
            current = []
        current.append(token)
        value = m
    runs.append((tokenizer.decode(current), bool(value)))
    return runs


def _golden_json(produced: dict) -> str:
    """One token per line, so a diff of a golden file reads token by token."""
    parts = []
    for conv_name, entry in produced.items():
        tokens = ",\n".join("   " + json.dumps(t, ensure_ascii=False) for t in entry["tokens"])
        parts.append(f' {json.dumps(conv_name)}: {{\n  "rendered": {json.dumps(entry["rendered"], ensure_ascii=False)},\n'
                     f'  "tokens": [\n{tokens}\n  ]\n }}')
    return "{\n" + ",\n".join(parts) + "\n}\n"


def test_every_template_has_a_layout_a_source_and_a_golden():
    assert set(FAMILIES) == set(LAYOUTS) == {p.stem for p in TEMPLATE_DIR.glob("*.jinja")} - {"draftline"}
    assert set(FAMILIES) == {p.stem for p in GOLDEN.glob("*.json")}
    for name in FAMILIES:
        layout = chat_layout(name)
        assert layout.source.startswith("https://huggingface.co/")
        header = layout.template.split("-#}")[0]
        assert layout.source.split("/")[4].split(",")[0] in header and "Left out" in header
        assert END_OF_TURN[name] == layout.eos_token


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_golden_masks(name, tokenizers):
    tokenizer = tokenizers[name]
    assert end_of_turn_text(tokenizer) == END_OF_TURN[name]
    golden_path = GOLDEN / f"{name}.json"
    produced = {}
    conversations = {k: (None, m) for k, m in CONVERSATIONS.items()} | _tool_conversations(name)
    for conv_name, (tools, messages) in conversations.items():
        expected = _merged(LAYOUTS[name](messages, tools))
        rendered = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
        assert rendered == "".join(text for text, _ in expected), f"{name} renders another layout than the published one"
        sample = build_masked_sample(tokenizer, messages, tools=tools)
        assert len(sample.input_ids) == len(sample.loss_mask)
        assert _runs(tokenizer, sample) == expected
        tokens = tokenizer.convert_ids_to_tokens(sample.input_ids)
        produced[conv_name] = {"rendered": rendered, "tokens": [[t, m] for t, m in zip(tokens, sample.loss_mask)]}
    if os.environ.get("DRAFTLINE_UPDATE_GOLDEN"):
        GOLDEN.mkdir(exist_ok=True)
        golden_path.write_text(_golden_json(produced))
    assert json.loads(golden_path.read_text()) == produced


def test_qwen3_thinking_of_the_last_turn_is_trained_earlier_thinking_is_dropped(tokenizers):
    tokenizer = tokenizers["qwen3"]
    messages = CONVERSATIONS["reasoning_multi_turn"]
    sample = build_masked_sample(tokenizer, messages)
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert messages[2]["reasoning_content"] not in text
    trained = tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m])
    assert trained == "four<|im_end|><think>\ntwo plus three makes five\n</think>\n\nit is five.<|im_end|>"
    assert tokenizer.convert_tokens_to_ids("<think>") in [t for t, m in zip(sample.input_ids, sample.loss_mask) if m]


def test_llama_trim_is_a_rewrite_the_mask_refuses(tokenizers):
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "four "}]
    with pytest.raises(TemplateError, match=r"turn 1: the reply \('four '\) is not found verbatim") as err:
        build_masked_sample(tokenizers["llama3.1"], messages)
    assert err.value.turn == 1


def test_qwen3_inline_think_is_a_rewrite_the_mask_refuses(tokenizers):
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "<think>two</think>four"}]
    with pytest.raises(TemplateError, match="turn 1: .*put thinking in reasoning_content"):
        build_masked_sample(tokenizers["qwen3"], messages)


def test_template_whose_prefix_is_not_a_prefix_of_the_whole_is_refused():
    """Modelled on thinking templates whose generation prompt opens a think block that rendered history turns lack."""
    template = (
        "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
    )
    tokenizer = family_tokenizer("qwen3", template)
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "four"}]
    with pytest.raises(TemplateError, match="turn 1: the template renders the conversation up to this reply .* differently"):
        build_masked_sample(tokenizer, messages)


def test_generation_prompt_merged_with_the_reply_is_refused(tokenizers):
    """Qwen3 history turns keep the reply as is: one starting with two newlines: the
    byte-level pre-tokenizer makes one piece of the header's newline and the first of them."""
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "\n\nok then."},
                {"role": "user", "content": "and?"}, {"role": "assistant", "content": "fine."}]
    with pytest.raises(TemplateError, match=r"turn 1: the tokenizer merges the end of the generation prompt"):
        build_masked_sample(tokenizers["qwen3"], messages)


# ------------------------------------------------------------------------------ prepare with a template's target

PREPARE_LINES = [
    {"id": "thinking", "messages": CONVERSATIONS["reasoning_multi_turn"]},
    {"id": "tool-result", "tools": [WEATHER], "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "paris"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"}, {"role": "assistant", "content": "sunny"}]},
    {"id": "sharegpt-tool", "tools": json.dumps([WEATHER["function"]]), "conversations": [
        {"from": "human", "value": "weather?"}, {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "paris"}}'},
        {"from": "observation", "value": "sunny"}, {"from": "gpt", "value": "sunny"}]},
    {"id": "result-without-call", "messages": [{"role": "user", "content": "weather?"}, {"role": "tool", "content": "sunny"},
                                               {"role": "assistant", "content": "sunny"}]},
    {"id": "arguments-not-json", "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": "{city: paris}"}}]},
        {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "sunny"}]},
    {"id": "inline-think", "messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "<think>two</think>four"}]},
    {"id": "plain", "messages": CONVERSATIONS["no_system"]},
]


@pytest.fixture(scope="module")
def qwen3_target_dir(tmp_path_factory, tokenizers):
    """A user's target as prepare sees it (target.kind=hf): its tokenizer directory, chat template included."""
    target_dir = tmp_path_factory.mktemp("qwen3-target")
    tokenizers["qwen3"].save_pretrained(target_dir)
    return target_dir


def _prepare_config(tmp_path, extra=()):
    from conftest import make_test_config

    path = tmp_path / "conv.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in PREPARE_LINES))
    return path, make_test_config(tmp_path / "dd", [f"data.conversations={path}", "data.split.val_fraction=0.0",
                                                    "data.split.bench_fraction=0.0", "data.draft_vocab_size=64",
                                                    "data.max_seq_len=4096", *extra])


def test_prepare_uses_the_targets_own_template_and_counts_what_the_mask_cannot_represent(tmp_path, qwen3_target_dir, tokenizers):
    from draftline.data.prepare import load_split, prepare
    from draftline.utils import read_json

    path, cfg = _prepare_config(tmp_path)
    out = prepare(cfg, qwen3_target_dir)
    report = read_json(out / "report.json")
    assert report["bad_input"]["by_kind"] == {"tool_turn": 2, "template": 1}
    items = report["bad_input"]["items"]
    assert items[0] == (f"{path}:4: tool_turn: conversation 'result-without-call' turn 1: a tool result with no tool call "
                        "before it (the assistant turn before it calls no tool, or every call already has its result); "
                        "add the call to that assistant turn's tool_calls or remove the result")
    assert items[1].startswith(f"{path}:5: tool_turn: conversation 'arguments-not-json' turn 1: tool_calls[0] arguments "
                               "('{city: paris}') is not JSON (Expecting property name enclosed in double quotes): write "
                               "the arguments as a JSON object")
    assert items[2].startswith(f"{path}:6: template: conversation 'inline-think' turn 1: the reply ('<think>two</think>four')")
    tokenizer = tokenizers["qwen3"]
    samples = {s["id"]: s for s in load_split(out, "train")}
    assert set(samples) == {"thinking", "plain", "tool-result", "sharegpt-tool"}
    # OpenAI's and ShareGPT's forms of one exchange are one rendering, the schema included; the call and the reply
    # after the tool result are trained, the result and the schema are not.
    assert samples["tool-result"]["input_ids"] == samples["sharegpt-tool"]["input_ids"]
    assert samples["tool-result"]["loss_mask"] == samples["sharegpt-tool"]["loss_mask"]
    assert samples["tool-result"]["tools"] == [WEATHER]
    tool_ids, tool_mask = samples["tool-result"]["input_ids"], samples["tool-result"]["loss_mask"]
    assert tokenizer.decode([t for t, m in zip(tool_ids, tool_mask) if m]) == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris"}}\n</tool_call><|im_end|>'
        "<think>\n\n</think>\n\nsunny<|im_end|>")
    assert "# Tools" in tokenizer.decode(tool_ids) and "<tool_response>\nsunny\n</tool_response>" in tokenizer.decode(tool_ids)
    masked = [t for t, m in zip(samples["thinking"]["input_ids"], samples["thinking"]["loss_mask"]) if m]
    assert tokenizer.decode(masked) == "four<|im_end|><think>\ntwo plus three makes five\n</think>\n\nit is five.<|im_end|>"
    assert tokenizer.decode(samples["thinking"]["input_ids"]) == tokenizer.apply_chat_template(CONVERSATIONS["reasoning_multi_turn"], tokenize=False)


def test_prepare_fails_on_what_the_mask_cannot_represent_with_policy_fail(tmp_path, qwen3_target_dir):
    from draftline.data.conversations import DataError
    from draftline.data.prepare import prepare

    path, cfg = _prepare_config(tmp_path, ["data.on_bad_input=fail"])
    with pytest.raises(DataError) as err:
        prepare(cfg, qwen3_target_dir)
    message = str(err.value)
    assert "3 bad input(s)" in message and f"{path}:6: template: conversation 'inline-think' turn 1" in message
    assert f"{path}:4: tool_turn: conversation 'result-without-call' turn 1" in message


def test_prepare_refuses_a_target_without_a_chat_template(tmp_path):
    from draftline.data.prepare import prepare

    target_dir = tmp_path / "base-model"
    tokenizer = family_tokenizer("qwen3")
    tokenizer.chat_template = None
    tokenizer.save_pretrained(target_dir)
    _, cfg = _prepare_config(tmp_path)
    with pytest.raises(ValueError, match=r"has no chat template.*add its template as chat_template.jinja"):
        prepare(cfg, target_dir)



# ------------------------------------------------------------------------------ tool turns the mask refuses


def test_a_template_without_tool_support_is_refused_not_trained_without_the_call():
    """A ChatML template written without tools writes no tool calls: the turn would be trained as an empty reply."""
    tools, messages = TOOL_CONVERSATIONS["tool_use"]
    template = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
                "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    tokenizer = family_tokenizer("qwen3", template)
    with pytest.raises(TemplateError, match=r"turn 2: the template does not render the tool call 'get_weather'"):
        build_masked_sample(tokenizer, messages, tools=tools)


def test_llama_drops_the_text_beside_a_call_and_refuses_two_calls(tokenizers):
    tools, messages = TOOL_CONVERSATIONS["parallel_calls"]
    with pytest.raises(TemplateError, match=r"the chat template refuses the conversation .*only supports single tool-calls"):
        build_masked_sample(tokenizers["llama3.1"], messages, tools=tools)
    one_call = [messages[0], {**messages[1], "tool_calls": messages[1]["tool_calls"][:1]}, messages[2], messages[4]]
    with pytest.raises(TemplateError, match=r"turn 1: the reply beside the tool call \('let me see.'\) is not rendered"):
        build_masked_sample(tokenizers["llama3.1"], one_call, tools=tools)


@pytest.mark.parametrize("record, error", [
    ({"tools": {"name": "x"}, "messages": [{"role": "user", "content": "q"}]}, "the record's 'tools' is dict, not a list"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "function": {"name": "f", "arguments": "{}"}}]}, {"role": "tool", "content": "r", "tool_call_id": "b"}]},
     "turn 2: the tool result's tool_call_id 'b' is none of the open calls' ids ('a')"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"arguments": "{}"}}]}]}, "turn 1: tool_calls[0] has no function name"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": "[1]"}}]}]}, "turn 1: tool_calls[0] arguments are list, not a JSON object"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "f(x)"}]},
     "turn 1: value of the function_call turn is not JSON"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": {}}}]}, {"role": "tool", "content": {"t": 1}}]},
     "turn 2: the tool result's content is dict, not a string"),
])
def test_malformed_tool_turns_are_bad_input_naming_the_turn_and_field(tmp_path, record, error):
    from draftline.data.conversations import read_conversations

    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"id": "c", **record}) + "\n")
    good, bad = read_conversations(path, need_reply=False)
    assert not good and [(b.line, b.kind) for b in bad] == [(1, "tool_turn")]
    assert bad[0].message.startswith(f"conversation 'c' {error}")
