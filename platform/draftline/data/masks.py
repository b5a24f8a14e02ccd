"""Chat template -> token ids + assistant-only loss mask.

The template is rendered to text; each assistant reply is located in that text (after the rendered prefix of
the turns before it), and the tokens that start inside a reply, plus the end-of-turn token the template puts right after it, get mask 1.
That end-of-turn token is found by rendering a probe conversation, so any template works without per-template code.
"""

from __future__ import annotations

from dataclasses import dataclass

_PROBE = "\u2063draftline-probe\u2063"


@dataclass
class MaskedSample:
    input_ids: list[int]
    loss_mask: list[int]


class TemplateError(ValueError):
    pass


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


def build_masked_sample(tokenizer, messages: list[dict[str, str]], eot_text: str | None = None) -> MaskedSample:
    if eot_text is None:
        eot_text = end_of_turn_text(tokenizer)
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        # The template rendered up to this reply (with the generation prompt) is a prefix of the full text for
        # prefix-stable templates; otherwise fall back to locating the reply text after the previous one.
        prefix = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        if text.startswith(prefix) and text.startswith(message["content"], len(prefix)):
            start = len(prefix)
        else:
            start = text.find(message["content"], cursor)
        if start < 0:
            raise TemplateError(f"assistant turn {i} is not found verbatim in the rendered chat template; the template rewrites content")
        end = start + len(message["content"])
        if eot_text and text.startswith(eot_text, end):
            end += len(eot_text)
        spans.append((start, end))
        cursor = end
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = list(encoded["input_ids"])
    loss_mask = [0] * len(input_ids)
    span_index = 0
    for t, (tok_start, tok_end) in enumerate(encoded["offset_mapping"]):
        while span_index < len(spans) and tok_start >= spans[span_index][1]:
            span_index += 1
        if span_index < len(spans) and spans[span_index][0] <= tok_start < spans[span_index][1] and tok_end > tok_start:
            loss_mask[t] = 1
    return MaskedSample(input_ids=input_ids, loss_mask=loss_mask)
