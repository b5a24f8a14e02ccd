"""Reasoning (thinking) in a reply: the tags a reasoning target writes it between, and the reply split at them."""

from __future__ import annotations

from typing import Optional

DEFAULT_REASONING_TAGS = ("<think>", "</think>")


def split_reasoning(text: str, tags: Optional[tuple[str, str]]) -> tuple[str, Optional[str]]:
    """-> (content, reasoning or None). The start tag may sit in the generation prompt, so only the end tag counts."""
    if not tags or tags[1] not in text:
        return text.strip(), None
    reasoning, content = text.split(tags[1], 1)
    reasoning = reasoning.strip()
    if reasoning.startswith(tags[0]):
        reasoning = reasoning[len(tags[0]):].strip()
    return content.strip(), reasoning
