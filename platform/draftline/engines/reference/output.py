"""From committed tokens to what a client sees: cuts at stop tokens and budgets, text streamed as it completes."""

from __future__ import annotations

from typing import Optional

from draftline.engines.base import GenerationChunk, SpecStats
from draftline.engines.reference.sequence import Sequence


def cut(pending: list[int], sequence: Sequence, max_positions: int, lookahead: int) -> tuple[list[int], Optional[str]]:
    """Cut newly committed tokens at a stop token or the token budget -> (tokens to emit, finish reason or None).
    Tokens past the cut are dropped from the sequence too, so stats count only emitted tokens. `lookahead`: how
    many positions past the last committed token the next step may write."""
    generated = len(sequence.tokens) - sequence.prompt_length
    already = generated - len(pending)
    emitted: list[int] = []
    reason = None
    for token in pending:
        emitted.append(token)
        if token in sequence.stop_ids:
            reason = "stop"
            break
        if already + len(emitted) >= sequence.params.max_new_tokens:
            reason = "length"
            break
    if reason is None and len(sequence.tokens) + lookahead > max_positions:
        reason = "length"  # the next verify would run past the target's positions
    del sequence.tokens[sequence.prompt_length + already + len(emitted) :]
    # accepted drafts come first in a step's tokens, the bonus last: a cut drops the bonus, then drafts
    sequence.stats.accepted_draft_tokens -= sequence.pending_drafts - min(sequence.pending_drafts, len(emitted))
    sequence.pending_drafts = 0
    return emitted, reason


class IncrementalText:
    """Streams text for token chunks; holds back a trailing partial UTF-8 character until it completes."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = ""

    def push(self, token_ids: list[int], final: bool) -> str:
        self.ids.extend(token_ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not final and text.endswith("\ufffd"):
            return ""
        new, self.sent = text[len(self.sent) :], text
        return new


def chunk(sequence: Sequence, text: IncrementalText, emitted: list[int], finish_reason: Optional[str]) -> GenerationChunk:
    """The chunk for tokens `cut` let through; the final one carries the request's stats."""
    finished = finish_reason is not None
    if finished:
        sequence.stats.output_tokens = len(sequence.tokens) - sequence.prompt_length
    return GenerationChunk(
        token_ids=emitted,
        text=text.push(emitted, final=finished),
        finished=finished,
        finish_reason=finish_reason,
        stats=SpecStats(**vars(sequence.stats)) if finished else None,
    )
