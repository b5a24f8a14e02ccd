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


class ReasoningStream:
    """A thinking turn's text, arriving in pieces, split as `split_reasoning` splits the whole turn: reasoning up to
    the end tag (a generated start tag dropped), content after it, each without the whitespace around it. A tail that
    could still become a tag, and whitespace that could still end a part, is held back until the next piece shows
    what it is. A turn cut before its end tag streams as reasoning (what split_reasoning calls content: the stream
    cannot know the tag will never come)."""

    def __init__(self, tags: tuple[str, str] = DEFAULT_REASONING_TAGS) -> None:
        self.start, self.end = tags
        self.in_reasoning = True
        self._pending = ""
        self._began = False  # the current part has emitted text (its leading whitespace is behind it)
        self._head_read = False  # the reasoning's start was read: a start tag there dropped, once
        self._space = ""  # whitespace held back at the current part's end

    def feed(self, text: str) -> tuple[str, str]:
        """-> (reasoning, content) safe to send now."""
        self._pending += text
        reasoning = ""
        if self.in_reasoning:
            if not self._head_read and not self._drop_start_tag():
                return "", ""
            at = self._pending.find(self.end)
            if at < 0:
                return self._emit(self._pending[: self._safe_length()]), ""
            before, after = self._pending[:at], self._pending[at + len(self.end):]
            reasoning = self._emit(before, whole=True)
            self._pending = after
            self.in_reasoning, self._began, self._space = False, False, ""
        return reasoning, self._emit(self._pending, whole=True)

    def flush(self) -> tuple[str, str]:
        """-> (reasoning, content) held back when the turn ended."""
        text = self._emit(self._pending, whole=True)
        return (text, "") if self.in_reasoning else ("", text)

    def _drop_start_tag(self) -> bool:
        """False while the reasoning so far could still be a start tag."""
        head = self._pending.lstrip()
        if head.startswith(self.start):
            self._pending = head[len(self.start):]
        elif self.start.startswith(head):
            return False
        self._head_read = True
        return True

    def _safe_length(self) -> int:
        """How much of the pending reasoning can be sent: all but a tail that could be the end tag's beginning."""
        for hold in range(min(len(self.end) - 1, len(self._pending)), 0, -1):
            if self.end.startswith(self._pending[-hold:]):
                return len(self._pending) - hold
        return len(self._pending)

    def _emit(self, text: str, whole: bool = False) -> str:
        """`text` (taken off the pending text; all of it when `whole`) as sent: no whitespace at the part's start,
        trailing whitespace held until more text follows it."""
        self._pending = "" if whole else self._pending[len(text):]
        if not self._began:
            text = text.lstrip()
            if not text:
                return ""
            self._began = True
        body = text.rstrip()
        if not body:
            self._space += text
            return ""
        sent, self._space = self._space + body, text[len(body):]
        return sent
