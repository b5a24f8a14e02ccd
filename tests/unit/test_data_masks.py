"""Loss masks on the tiny target's own chat template (the published families' layouts: tests/unit/test_chat_templates.py)."""

from __future__ import annotations

import pytest

from draftline.data.masks import build_masked_sample, end_of_turn_text
from draftline.target.bootstrap import _train_tokenizer

CORPUS = ["hello world, how are you today?", "the quick brown fox jumps over the lazy dog", "ok then, fine.", "def f(x): return x"] * 20


@pytest.fixture(scope="module")
def tiny_tokenizer():
    return _train_tokenizer(CORPUS, 400)


def _pieces(tokenizer, sample):
    """Decode consecutive runs of equal mask value: [(text, mask), ...]."""
    runs, current, value = [], [], None
    for tok, m in zip(sample.input_ids, sample.loss_mask):
        if value is not None and m != value:
            runs.append((tokenizer.decode(current), value))
            current = []
        current.append(tok)
        value = m
    runs.append((tokenizer.decode(current), value))
    return runs


MULTI_TURN = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hello world"},
    {"role": "assistant", "content": "ok then"},
    {"role": "user", "content": "how are you"},
    {"role": "assistant", "content": "fine, the fox"},
]


def test_tiny_template_golden(tiny_tokenizer):
    assert end_of_turn_text(tiny_tokenizer) == "<|end|>"
    sample = build_masked_sample(tiny_tokenizer, MULTI_TURN)
    assert _pieces(tiny_tokenizer, sample) == [
        ("<|bos|><|system|>be brief<|end|><|user|>hello world<|end|><|assistant|>", 0),
        ("ok then<|end|>", 1),
        ("<|user|>how are you<|end|><|assistant|>", 0),
        ("fine, the fox<|end|>", 1),
    ]
    assert len(sample.input_ids) == len(sample.loss_mask)


def test_empty_reply_masks_only_end_of_turn(tiny_tokenizer):
    sample = build_masked_sample(tiny_tokenizer, [{"role": "user", "content": "hello"}, {"role": "assistant", "content": ""}])
    masked = [t for t, m in zip(sample.input_ids, sample.loss_mask) if m]
    assert tiny_tokenizer.convert_ids_to_tokens(masked) == ["<|end|>"]
