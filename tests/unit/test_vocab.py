"""Draft vocab tensors in SGLang's layout: d2t offsets, t2d mask; round-trip for every draft id."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from draftline.data.vocab import VocabError, build_draft_vocab, draft_to_target, target_to_draft


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(min_value=0, max_value=299), min_size=1, max_size=400),
    draft_size=st.integers(min_value=1, max_value=300),
)
def test_mapping_round_trips_for_every_draft_id(tokens, draft_size):
    d2t, t2d, _ = build_draft_vocab(tokens, 300, draft_size)
    assert d2t.dtype == torch.int64 and d2t.shape == (draft_size,)
    assert t2d.dtype == torch.bool and t2d.shape == (300,) and int(t2d.sum()) == draft_size
    draft_ids = torch.arange(draft_size)
    target_ids = draft_to_target(draft_ids, d2t)
    assert bool(t2d[target_ids].all())
    assert torch.equal(target_to_draft(target_ids, t2d), draft_ids)
    # Target tokens outside the draft vocab map to -1.
    outside = torch.nonzero(~t2d).flatten()
    if len(outside):
        assert bool((target_to_draft(outside, t2d) == -1).all())


def test_most_frequent_tokens_are_kept():
    tokens = [5] * 10 + [7] * 9 + [1] * 3 + [2]
    d2t, t2d, stats = build_draft_vocab(tokens, 10, 2)
    assert torch.nonzero(t2d).flatten().tolist() == [5, 7]
    assert d2t.tolist() == [5, 6]
    assert stats["coverage"] == pytest.approx(19 / 23)


def test_forced_tokens_are_included():
    _, t2d, _ = build_draft_vocab([5] * 10 + [7] * 9, 10, 2, always_include=[0])
    assert torch.nonzero(t2d).flatten().tolist() == [0, 5]


def test_too_large_draft_vocab_is_refused():
    with pytest.raises(VocabError, match="draft_vocab_size=20 exceeds"):
        build_draft_vocab([1, 2], 10, 20)
