"""Chat template -> token ids + assistant-only loss mask.

The conversation is rendered once with the target's own chat template. For each assistant turn i, the rendering of
the turns before it plus the generation prompt (what a serving engine sends the target) must be a prefix of the full
rendering; the trained region of turn i is everything the target would generate from there: any text the template
puts before the reply (Qwen3's `<think>` block, rendered from `reasoning_content`), the reply itself verbatim, and
the end-of-turn token. Tokens that start inside a trained region get mask 1; headers, system and user text get 0.

Tool use is rendered by the template too (the record's `tools` passed as transformers passes them): an assistant
turn with `tool_calls` is trained from its generation prompt through its end-of-turn token, the calls as the template
writes them; tool results, like user turns, are not trained, and the reply after them is.

The end-of-turn token is found by rendering a probe conversation, so any template works without per-template code.
What this cannot represent is refused with a `TemplateError` naming the turn (never masked approximately):
- a template that rewrites the reply (Llama-3.1 trims it, Qwen3 moves inline `<think>` text out of it);
- a template whose rendering up to a turn is not a prefix of the full rendering;
- a tokenizer that merges the end of the generation prompt with the first characters of the reply, so the trained
  tokens would not be the ones the target generates after that prompt;
- a template that leaves a tool call out (one without tool support: the reply would be trained without its call),
  drops the text beside a call (Llama-3.1), or raises on the conversation (Llama-3.1: one call per turn).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from jinja2.exceptions import TemplateError as JinjaTemplateError

_PROBE = "\u2063draftline-probe\u2063"


@dataclass
class MaskedSample:
    input_ids: list[int]
    loss_mask: list[int]


class TemplateError(ValueError):
    """A conversation the assistant-only mask cannot represent; `turn` is the 0-based index of the message (None:
    the template refused the whole conversation)."""

    def __init__(self, turn: Optional[int], reason: str):
        super().__init__(f"turn {turn}: {reason}" if turn is not None else reason)
        self.turn = turn
        self.reason = reason


def end_of_turn_text(tokenizer) -> str:
    """The special-token text the template writes right after an assistant reply ('' if none)."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "u"}, {"role": "assistant", "content": _PROBE}], tokenize=False
    )
    after = rendered.split(_PROBE, 1)[1]
    for token in sorted(tokenizer.all_special_tokens + list(tokenizer.get_added_vocab()), key=len, reverse=True):
        if token and after.startswith(token):
            return token
    return ""


def render(tokenizer, messages: list[dict], tools: Optional[list[dict]] = None, add_generation_prompt: bool = False,
           template_kwargs: Optional[dict] = None) -> str:
    """The chat template's text (`template_kwargs`: e.g. the thinking switch, data/thinking.py); a template that raises
    on the conversation (raise_exception, a missing field) is a TemplateError naming the template's message."""
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **(template_kwargs or {}))
    except (JinjaTemplateError, TypeError) as err:
        raise TemplateError(None, f"the chat template refuses the conversation ({type(err).__name__}: {err}); "
                            "change the conversation to what the template supports") from None


def trained_spans(tokenizer, messages: list[dict], eot_text: str, tools: Optional[list[dict]] = None,
                  template_kwargs: Optional[dict] = None) -> tuple[str, list[tuple[int, int]]]:
    """(rendered text, [start, end) character spans of the trained region of each assistant turn)."""
    text = render(tokenizer, messages, tools, template_kwargs=template_kwargs)
    assistant_turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    starts = {}
    for i in assistant_turns:
        prefix = render(tokenizer, messages[:i], tools, add_generation_prompt=True, template_kwargs=template_kwargs)
        if not text.startswith(prefix):
            at = next((k for k, (a, b) in enumerate(zip(prefix, text)) if a != b), min(len(prefix), len(text)))
            raise TemplateError(
                i, f"the template renders the conversation up to this reply (with the generation prompt) differently "
                f"from the whole conversation (they part at character {at}: {prefix[at:at + 30]!r} vs {text[at:at + 30]!r}), "
                "so the prompt the target is served with is not the one it would be trained on; the loss mask "
                "cannot represent this template")
        starts[i] = len(prefix)
    spans = []
    for k, i in enumerate(assistant_turns):
        start = starts[i]
        # The reply must lie before where the next assistant turn's prompt ends (or the end of the text).
        limit = starts[assistant_turns[k + 1]] if k + 1 < len(assistant_turns) else len(text)
        if messages[i].get("tool_calls"):
            spans.append((start, _tool_call_turn_end(text, start, limit, messages[i], i, eot_text)))
            continue
        reply = messages[i]["content"] + eot_text
        at = text.find(reply, start, limit)
        # Found only after the turn's own end-of-turn token means it was found in a later turn.
        if at < 0 or (eot_text and eot_text in text[start:at]):
            raise TemplateError(
                i, f"the reply ({_excerpt(messages[i]['content'])}) is not found verbatim in the rendered chat "
                "template: the template rewrites it (e.g. trims whitespace, or moves inline <think> text out of it; "
                "put thinking in reasoning_content), so the loss mask cannot say which tokens are the reply")
        spans.append((start, at + len(reply)))
    return text, spans


def _tool_call_turn_end(text: str, start: int, limit: int, message: dict, turn: int, eot_text: str) -> int:
    """Where the trained region of an assistant turn with tool calls ends: its end-of-turn token after the reply
    text, which must all be there, and each call's name in order in between (templates write the arguments each
    their own way, so those are not matched)."""
    content = message["content"]
    if not eot_text:
        raise TemplateError(turn, "the template writes no end-of-turn token, so where a tool-call turn ends is unknown")
    texts = [content] + [json.dumps(call["function"]["arguments"], ensure_ascii=False) for call in message["tool_calls"]]
    if any(eot_text in piece for piece in texts):
        raise TemplateError(turn, f"the reply or a call's arguments contain the end-of-turn text {eot_text!r}, so "
                            "where the turn ends is ambiguous; remove it")
    at = text.find(content, start, limit)
    if at < 0:
        raise TemplateError(turn, f"the reply beside the tool call ({_excerpt(content)}) is not rendered verbatim "
                            "(Llama-3.1 writes the call alone): empty the content of tool-call turns for this template")
    end = text.find(eot_text, at + len(content), limit)
    cursor = at + len(content)
    for call in message["tool_calls"]:
        found = text.find(call["function"]["name"], cursor, end if end >= 0 else limit)
        cursor = found + len(call["function"]["name"])
        if found < 0 or end < 0:
            raise TemplateError(turn, f"the template does not render the tool call {call['function']['name']!r} "
                                "(a template without tool support drops it, and the loss mask would train the turn "
                                "without its call); use the target's own template with tool support, or remove the "
                                "tool turns")
    return end + len(eot_text)


def _excerpt(content: str) -> str:
    return repr(content) if len(content) <= 40 else repr(content[:37]) + "..."


def build_masked_sample(tokenizer, messages: list[dict], eot_text: str | None = None,
                        tools: Optional[list[dict]] = None, template_kwargs: Optional[dict] = None) -> MaskedSample:
    if eot_text is None:
        eot_text = end_of_turn_text(tokenizer)
    text, spans = trained_spans(tokenizer, messages, eot_text, tools, template_kwargs)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = encoded["offset_mapping"]
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for turn, (start, _) in zip(turns, spans):
        straddling = next(((a, b) for a, b in offsets if a < start < b), None)
        if straddling:
            raise TemplateError(
                turn, f"the tokenizer merges the end of the generation prompt with the start of the reply into one "
                f"token ({text[straddling[0]:straddling[1]]!r}), so the trained tokens would differ from those the "
                "target generates after the prompt; remove the leading whitespace of the reply")
    input_ids = list(encoded["input_ids"])
    loss_mask = [0] * len(input_ids)
    span_index = 0
    for t, (tok_start, tok_end) in enumerate(offsets):
        while span_index < len(spans) and tok_start >= spans[span_index][1]:
            span_index += 1
        if span_index < len(spans) and spans[span_index][0] <= tok_start < spans[span_index][1] and tok_end > tok_start:
            loss_mask[t] = 1
    return MaskedSample(input_ids=input_ids, loss_mask=loss_mask)
