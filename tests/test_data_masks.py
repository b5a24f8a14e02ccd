"""Loss masks: golden token-level expectations for two chat templates (the tiny target's and a Llama-3-style one)."""

from __future__ import annotations

import pytest

from draftline.data.masks import build_masked_sample, end_of_turn_text
from draftline.target.bootstrap import CHAT_TEMPLATE, _train_tokenizer

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CORPUS = ["hello world, how are you today?", "the quick brown fox jumps over the lazy dog", "ok then, fine.", "def f(x): return x"] * 20


@pytest.fixture(scope="module")
def tiny_tokenizer():
    return _train_tokenizer(CORPUS, 400)


@pytest.fixture(scope="module")
def llama3_tokenizer():
    tokenizer = _train_tokenizer(CORPUS, 400)
    tokenizer.add_special_tokens({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                                  "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>"]})
    tokenizer.chat_template = LLAMA3_TEMPLATE
    return tokenizer


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


def test_llama3_style_template_golden(llama3_tokenizer):
    assert end_of_turn_text(llama3_tokenizer) == "<|eot_id|>"
    sample = build_masked_sample(llama3_tokenizer, MULTI_TURN)
    header = "<|start_header_id|>{}<|end_header_id|>\n\n"
    assert _pieces(llama3_tokenizer, sample) == [
        ("<|begin_of_text|>" + header.format("system") + "be brief<|eot_id|>" + header.format("user")
         + "hello world<|eot_id|>" + header.format("assistant"), 0),
        ("ok then<|eot_id|>", 1),
        (header.format("user") + "how are you<|eot_id|>" + header.format("assistant"), 0),
        ("fine, the fox<|eot_id|>", 1),
    ]


def test_empty_reply_masks_only_end_of_turn(tiny_tokenizer):
    sample = build_masked_sample(tiny_tokenizer, [{"role": "user", "content": "hello"}, {"role": "assistant", "content": ""}])
    masked = [t for t, m in zip(sample.input_ids, sample.loss_mask) if m]
    assert tiny_tokenizer.convert_ids_to_tokens(masked) == ["<|end|>"]
