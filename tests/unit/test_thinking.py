"""Thinking modes (`data.thinking`): the template's switch found in its source, on/off/mixed at prepare (mixed by a
hash of the id, recorded on the sample), regenerate and bench; a template without a switch and a fraction without
mixed are config errors naming the field. Qwen3's layout (tests/unit/test_chat_templates.py) is the target."""

from __future__ import annotations

import asyncio
import json

import pytest

from conftest import make_test_config
from draftline.bench.prompts import segment_of
from draftline.data.prepare import load_split, prepare
from draftline.data.thinking import thinking_mode, thinking_switch
from draftline.regenerate.run import regenerate_conversation
from draftline.target.chat_layouts import chat_layout, layout_names
from test_chat_templates import family_tokenizer
from test_regenerate_tools import ScriptedTarget, _settings

IDS = [f"conv-{k}" for k in range(8)]


@pytest.fixture(scope="module")
def qwen3_tokenizer():
    return family_tokenizer("qwen3")


def _target_dir(tmp_path, tokenizer):
    target_dir = tmp_path / "target"
    tokenizer.save_pretrained(target_dir)
    return target_dir


def _config(tmp_path, extra):
    path = tmp_path / "conv.jsonl"
    path.write_text("".join(json.dumps({"id": i, "messages": [{"role": "user", "content": "hello world"},
                                                              {"role": "assistant", "content": "fine, thanks."}]}) + "\n"
                            for i in IDS))
    return make_test_config(tmp_path / "dd", [f"data.conversations={path}", "data.split.val_fraction=0.0",
                                              "data.split.bench_fraction=0.0", "data.draft_vocab_size=64",
                                              "data.held_out_benchmarks=[]", *extra])


def test_the_switch_is_read_from_the_template():
    switches = {name: thinking_switch(chat_layout(name).template) for name in layout_names()}
    assert switches == {"draftline": None, "llama3.1": None, "qwen3": "enable_thinking", "deepseek-v3": None,
                        "kimi-k2": None}
    # DeepSeek-V3.1's form: a `thinking` argument
    assert thinking_switch("{%- if thinking is defined and thinking %}<think>{%- else %}</think>{%- endif %}") == "thinking"


def test_a_fraction_without_mixed_is_a_config_error(tmp_path):
    with pytest.raises(Exception, match=r"data.thinking_on_fraction=0.3 applies to data.thinking=mixed only"):
        make_test_config(tmp_path, ["data.thinking=on", "data.thinking_on_fraction=0.3"])
    with pytest.raises(Exception, match=r"data.thinking"):
        make_test_config(tmp_path, ["data.thinking=sometimes"])
    # YAML reads a bare on/off as a boolean
    assert make_test_config(tmp_path, ["data.thinking=off"]).data.thinking == "off"
    assert make_test_config(tmp_path, ["data.thinking=on"]).data.thinking == "on"


def test_mixed_renders_each_conversation_in_its_mode_and_records_it(tmp_path, qwen3_tokenizer):
    modes = {i: thinking_mode("mixed", i, 0.5) for i in IDS}
    assert set(modes.values()) == {"on", "off"}  # the ids give both
    out = prepare(_config(tmp_path, ["data.thinking=mixed"]), _target_dir(tmp_path, qwen3_tokenizer))
    samples = {s["id"]: s for s in load_split(out, "train")}
    assert {i: s["thinking"] for i, s in samples.items()} == modes
    for i, sample in samples.items():
        trained = qwen3_tokenizer.decode([t for t, m in zip(sample["input_ids"], sample["loss_mask"]) if m])
        prompt = qwen3_tokenizer.decode(sample["input_ids"][: sample["loss_mask"].index(1)])
        if modes[i] == "on":  # the target writes the (empty) think block
            assert trained == "<think>\n\n</think>\n\nfine, thanks.<|im_end|>" and prompt.endswith("assistant\n")
        else:  # the served prompt holds it
            assert trained == "fine, thanks.<|im_end|>" and prompt.endswith("assistant\n<think>\n\n</think>\n\n")


def test_a_template_without_a_switch_is_refused_naming_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"data.thinking is set .* no thinking switch .*remove data.thinking"):
        prepare(_config(tmp_path, ["data.thinking=on"]), _target_dir(tmp_path, family_tokenizer("kimi-k2")))


def test_regenerate_prompts_with_the_conversations_mode(qwen3_tokenizer):
    settings = _settings(qwen3_tokenizer)
    off = type(settings)(**{**settings.__dict__, "thinking": "off"})
    target = ScriptedTarget(qwen3_tokenizer, ["four"])
    record = asyncio.run(regenerate_conversation(target, qwen3_tokenizer, {"id": "c", "messages": [
        {"role": "user", "content": "two plus two?"}]}, off))
    assert target.prompts[0].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert record["thinking"] == "off" and record["messages"][1] == {"role": "assistant", "content": "four"}


def test_bench_segments():
    plain = [{"role": "user", "content": "q"}]
    assert segment_of(None, plain, None) == "plain"
    assert segment_of(None, plain, "on") == "thinking-on" and segment_of(None, plain, "off") == "thinking-off"
    assert segment_of([{"type": "function"}], plain, "on") == "has-tools"
    assert segment_of(None, plain + [{"role": "assistant", "content": "", "tool_calls": [{}]}], None) == "has-tools"
