"""The reference engine's parts on hand-made tensors: the batched drafter cache, top-p, tree attention masks."""

from __future__ import annotations

import torch

import draftline.engines.reference as reference


def test_draft_batch_equals_one_drafter_cache_per_sequence():
    """DraftBatch (slot = position, ragged rows, a shorter length instead of a crop) computes what the drafter's
    own forward computes with one DrafterKVCache per sequence."""
    from draftline.drafter.model import DrafterConfig, DrafterKVCache, Eagle3Drafter

    torch.manual_seed(0)
    config = DrafterConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
        draft_vocab_size=16, target_vocab_size=16, target_hidden_size=32, aux_layer_ids=(0, 1, 2),
    )  # fmt: skip
    drafter = Eagle3Drafter(config).eval()
    lengths, width = [5, 9], 9
    embeds, hidden = torch.randn(2, width, 32), torch.randn(2, width, 32)
    batch = reference.DraftBatch()
    with torch.no_grad():
        logits, _ = batch.forward(drafter, embeds, hidden, torch.arange(width)[None].expand(2, -1))
        # row 0 keeps 3 entries (2 rejected), row 1 all 9; then two more tokens each, at their own positions
        more_embeds, more_hidden = torch.randn(2, 2, 32), torch.randn(2, 2, 32)
        kept = [3, 9]
        more_logits, _ = batch.forward(drafter, more_embeds, more_hidden, torch.tensor(kept)[:, None] + torch.arange(2))
        for row, (length, keep) in enumerate(zip(lengths, kept)):
            cache = DrafterKVCache()
            alone, _ = drafter(embeds[row : row + 1, :length], hidden[row : row + 1, :length], torch.arange(length), cache)
            torch.testing.assert_close(logits[row, :length], alone[0], atol=1e-5, rtol=1e-5)
            cache.crop(keep)
            alone, _ = drafter(more_embeds[row : row + 1], more_hidden[row : row + 1], torch.arange(keep, keep + 2), cache)
            torch.testing.assert_close(more_logits[row], alone[0], atol=1e-5, rtol=1e-5)



def test_target_probs_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = reference.target_probs(logits, temperature=1.0, top_p=0.8)
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)



def test_tree_allowed_sees_ancestors_and_self_and_padding_sees_itself():
    allowed = reference.tree_allowed([-1, 0, 0, 1], size=5, device="cpu").int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [0, 0, 0, 0, 1],
    ]
