"""Regenerate with tool use: the recorded tool results are kept and the assistant turns around them are the
target's; a target whose call differs from the recorded one stops the conversation at its own call.

The target is scripted (`ScriptedTarget` answers each prompt with a fixed text, as the target would stream it): the
rendering, the reply slots, the comparison with the recorded call and the mask are the product's, on the Qwen3
layout's tokenizer (tests/unit/test_chat_templates.py). tests/integration/test_regenerate*.py run real engines on
the tiny target, whose replies cannot be steered to a given call."""

from __future__ import annotations

import asyncio

import pytest

from draftline.data.masks import build_masked_sample
from draftline.engines.base import GenerationChunk
from draftline.regenerate.run import ReplySlot, TurnSettings, regenerate_conversation, reply_slots
from test_chat_templates import WEATHER, family_tokenizer

CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "paris"}}}
RECORDED = [
    {"role": "user", "content": "weather in paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    {"role": "assistant", "content": "it was sunny."},
]
PARIS_CALL = '<think>\ncall the tool\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris"}}\n</tool_call>'
LONDON_CALL = '<think>\nlondon?\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "london"}}\n</tool_call>'
REPLY = "<think>\nsunny it is\n</think>\n\nsunny today."


class ScriptedTarget:
    """Streams the next scripted text for each prompt (then the end-of-turn token), and keeps the prompts."""

    def __init__(self, tokenizer, replies: list[str]):
        self.tokenizer, self.replies, self.prompts = tokenizer, list(replies), []

    async def generate(self, prompt_ids, params):
        self.prompts.append(self.tokenizer.decode(prompt_ids))
        text = self.replies.pop(0) + "<|im_end|>"
        yield GenerationChunk(token_ids=self.tokenizer(text, add_special_tokens=False)["input_ids"], text=text,
                              finished=True, finish_reason="stop")


@pytest.fixture(scope="module")
def tokenizer():
    return family_tokenizer("qwen3")


def _settings(tokenizer) -> TurnSettings:
    return TurnSettings(0.0, 1.0, 64, 0, (tokenizer.convert_tokens_to_ids("<|im_end|>"),), "<|im_end|>",
                        ("<think>", "</think>"))


def _trained_text(tokenizer, record) -> str:
    sample = build_masked_sample(tokenizer, record["messages"], tools=record.get("tools"))
    return tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m])


def test_tool_results_get_a_reply_slot_and_recorded_turns_are_kept_in_theirs():
    user, call, result, reply = RECORDED
    assert reply_slots(RECORDED) == [user, ReplySlot(call), result, ReplySlot(reply)]
    assert reply_slots(RECORDED[:3]) == [user, ReplySlot(call), result, ReplySlot()]


def test_a_reproduced_call_keeps_the_recorded_result_and_the_reply_after_it_is_the_targets(tokenizer):
    target = ScriptedTarget(tokenizer, [PARIS_CALL, REPLY])
    record = asyncio.run(regenerate_conversation(target, tokenizer, {"id": "c", "messages": RECORDED, "tools": [WEATHER]},
                                                 _settings(tokenizer)))
    assert record["tools"] == [WEATHER] and "stopped" not in record["regenerated"]
    assert record["messages"] == [
        RECORDED[0],
        {"role": "assistant", "content": "", "tool_calls": [CALL], "reasoning_content": "call the tool"},
        RECORDED[2],
        {"role": "assistant", "content": "sunny today.", "reasoning_content": "sunny it is"},
    ]
    # the tools are in every prompt; the second prompt carries the recorded result
    assert all("# Tools" in prompt for prompt in target.prompts)
    assert "<tool_response>\nsunny\n</tool_response>" in target.prompts[1]
    # prepare trains exactly what the target generated, and not the result
    assert _trained_text(tokenizer, record) == PARIS_CALL + "<|im_end|>" + REPLY + "<|im_end|>"


def test_a_different_call_stops_the_conversation_at_the_targets_own_call(tokenizer):
    target = ScriptedTarget(tokenizer, [LONDON_CALL, REPLY])
    record = asyncio.run(regenerate_conversation(target, tokenizer, {"id": "c", "messages": RECORDED, "tools": [WEATHER]},
                                                 _settings(tokenizer)))
    assert len(target.prompts) == 1  # nothing is generated after a call the recorded result does not answer
    assert record["messages"] == [RECORDED[0], {"role": "assistant", "content": LONDON_CALL.split("\n\n", 1)[1],
                                                "reasoning_content": "london?"}]
    assert record["regenerated"]["stopped"] == {
        "turn": 1, "reason": "the target's turn differs from the recorded tool call, so the recorded tool result "
        "cannot follow it"}
    assert _trained_text(tokenizer, record) == LONDON_CALL + "<|im_end|>"
