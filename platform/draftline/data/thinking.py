"""Thinking modes (`data.thinking`): the chat-template argument that switches a reasoning target's thinking on or off
(Qwen3's `enable_thinking`; DeepSeek-V3.1's `thinking`), and which mode a conversation is rendered in. Prepare,
regenerate and bench render with the same mode, so the drafter learns the prompts it is served with."""

from __future__ import annotations

import re
from typing import Optional

from draftline.data.masks import render
from draftline.utils import stable_fraction

# The template argument, found in the template's source: checked first to last.
THINKING_SWITCHES = (("enable_thinking", re.compile(r"\benable_thinking\b")),
                     ("thinking", re.compile(r"(?<![\w.])thinking\s+is\s+(?:defined|true|false|sameas)|\bif\s+thinking\b")))


def thinking_switch(chat_template) -> Optional[str]:
    """The argument name the template reads to switch thinking, or None when it has none."""
    source = chat_template if isinstance(chat_template, str) else str(chat_template or "")
    return next((name for name, pattern in THINKING_SWITCHES if pattern.search(source)), None)


def thinking_mode(setting: Optional[str], conversation_id: str, on_fraction: float) -> Optional[str]:
    """"on", "off", or None (the template's default) for one conversation; mixed picks by a hash of its id."""
    if setting != "mixed":
        return setting
    return "on" if stable_fraction(f"thinking:{conversation_id}") < on_fraction else "off"


def thinking_kwargs(tokenizer, mode: Optional[str]) -> dict:
    """The chat-template arguments for `mode`. ValueError naming data.thinking when the template has no switch."""
    if mode is None:
        return {}
    switch = thinking_switch(tokenizer.chat_template)
    if switch is None:
        raise ValueError(
            f"data.thinking is set ({mode} for this conversation) but the target's chat template has no thinking "
            f"switch (it reads neither {' nor '.join(name for name, _ in THINKING_SWITCHES)}; DeepSeek-V3 and "
            "Kimi-K2-Instruct have none): remove data.thinking to render with the template's default")
    return {switch: mode == "on"}


def check_thinking_switch(tokenizer, setting: Optional[str]) -> None:
    """Fail before any conversation is rendered when data.thinking is set and the template cannot honour it."""
    thinking_kwargs(tokenizer, "on" if setting else None)


def thinks_by_default(tokenizer, switch: str) -> bool:
    """Whether the template thinks when `switch` is not passed (Qwen3 does, DeepSeek-V3.1 does not): its generation
    prompt without the argument is the one with the switch on."""
    probe = [{"role": "user", "content": "probe"}]
    default = render(tokenizer, probe, add_generation_prompt=True)
    return default == render(tokenizer, probe, add_generation_prompt=True, template_kwargs={switch: True})
