"""Training data order, batching and the frozen target head (no Ray, tiny tensors)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from draftline.train.data import Batch, TargetHead, collate, load_target_head
from draftline.train.order import epoch_order, sample_indices_for_step, val_indices_for_rank

SHARD_SIZES = [5, 5, 3]  # 13 samples


def test_epoch_order_is_a_seeded_permutation_grouped_by_shard():
    order = epoch_order(SHARD_SIZES, epoch=0, seed=0)
    assert sorted(order.tolist()) == list(range(13))
    assert torch.equal(order, epoch_order(SHARD_SIZES, epoch=0, seed=0))
    assert not torch.equal(order, epoch_order(SHARD_SIZES, epoch=1, seed=0))
    # Samples of one shard are consecutive in the order (one shard load per shard per epoch).
    shard_of = [0] * 5 + [1] * 5 + [2] * 3
    runs = [shard_of[i] for i in order.tolist()]
    changes = sum(1 for a, b in zip(runs, runs[1:]) if a != b)
    assert changes == len(SHARD_SIZES) - 1


def test_step_order_covers_each_epoch_once_across_ranks_and_is_restartable():
    world_size, micro_batch_size = 2, 3
    seen = []
    for step in range(4):  # 4 steps x 2 ranks x 3 = 24 positions: epoch 0 complete + 11 of epoch 1
        for rank in range(world_size):
            seen += sample_indices_for_step(step, rank, world_size, micro_batch_size, SHARD_SIZES, seed=7)
    assert sorted(seen[:13]) == list(range(13))
    assert len(set(seen[13:])) == len(seen[13:])
    # A restarted worker asks for step 3 without having seen steps 0-2 and gets the same samples.
    assert sample_indices_for_step(3, 1, world_size, micro_batch_size, SHARD_SIZES, seed=7) == seen[-3:]
    assert sample_indices_for_step(3, 1, world_size, micro_batch_size, SHARD_SIZES, seed=8) != seen[-3:]


def test_empty_train_split_is_refused():
    with pytest.raises(ValueError, match="no samples"):
        sample_indices_for_step(0, 0, 1, 2, [0], seed=0)


def test_val_slices_partition_the_split():
    parts = [list(val_indices_for_rank(11, rank, 3)) for rank in range(3)]
    assert sum(parts, []) == list(range(11))
    assert all(parts)


def _sample(length: int, width: int = 4) -> dict:
    return {
        "input_ids": torch.arange(1, length + 1),
        "loss_mask": torch.ones(length, dtype=torch.uint8),
        "aux_hidden": torch.randn(length, 3 * width),
        "final_hidden": torch.randn(length, width),
    }


def test_collate_right_pads_and_keeps_values():
    short, long = _sample(2), _sample(5)
    batch = collate([short, long])
    assert batch.input_ids.shape == (2, 5)
    assert batch.attention_mask.tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert batch.loss_mask[0].tolist() == [True, True, False, False, False]
    assert torch.equal(batch.aux_hidden[1], long["aux_hidden"])
    assert torch.equal(batch.final_hidden[0, :2], short["final_hidden"])
    assert batch.final_hidden[0, 2:].abs().sum() == 0
    assert batch.num_tokens == 7
    moved = batch.to("cpu", torch.bfloat16)
    assert isinstance(moved, Batch) and moved.aux_hidden.dtype == torch.bfloat16 and moved.input_ids.dtype == torch.int64


def _write_target(directory, tied: bool, vocab: int = 6, hidden: int = 4) -> dict[str, torch.Tensor]:
    tensors = {
        "model.embed_tokens.weight": torch.randn(vocab, hidden),
        "model.layers.0.mlp.up_proj.weight": torch.randn(8, hidden),
    }
    if not tied:
        tensors["lm_head.weight"] = torch.randn(vocab, hidden)
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({"tie_word_embeddings": tied}))
    return tensors


def test_target_head_reads_embedding_and_lm_head(tmp_path):
    tensors = _write_target(tmp_path, tied=False)
    head = load_target_head(tmp_path)
    assert torch.equal(head.embed_weight, tensors["model.embed_tokens.weight"])
    assert torch.equal(head.lm_head_weight, tensors["lm_head.weight"])
    final_hidden = torch.randn(2, 3, 4)
    assert torch.allclose(head.logits(final_hidden), final_hidden @ tensors["lm_head.weight"].t())
    assert torch.equal(head.embed(torch.tensor([[1, 5]])), tensors["model.embed_tokens.weight"][[1, 5]].unsqueeze(0))


def test_target_head_tied_and_missing(tmp_path):
    tied_dir, broken_dir = tmp_path / "tied", tmp_path / "broken"
    tied_dir.mkdir()
    broken_dir.mkdir()
    tensors = _write_target(tied_dir, tied=True)
    head = load_target_head(tied_dir)
    assert torch.equal(head.lm_head_weight, tensors["model.embed_tokens.weight"])
    _write_target(broken_dir, tied=False)
    (broken_dir / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    save_file({"model.embed_tokens.weight": torch.randn(6, 4)}, str(broken_dir / "model.safetensors"))
    with pytest.raises(KeyError, match="no lm_head"):
        load_target_head(broken_dir)


def test_draft_signals_equal_the_full_vocab_logits_in_blocks():
    vocab, hidden = 37, 8
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, hidden, generator=generator)
    weight[4] = weight[30] = 3.0  # a tie across two blocks: the lower id wins, as with argmax over the full vocab
    head = TargetHead(weight, weight)
    final_hidden = torch.randn(2, 5, hidden, generator=generator)
    final_hidden[0, 0] = 1.0
    t2d = torch.rand(vocab, generator=generator) < 0.5
    full = head.logits(final_hidden)
    for vocab_chunk in (5, 16, 64):
        draft_logits, target_ids = head.draft_signals(final_hidden, t2d, vocab_chunk=vocab_chunk)
        torch.testing.assert_close(draft_logits, full[..., t2d], atol=1e-5, rtol=0)
        assert torch.equal(target_ids, full.argmax(-1))
    assert target_ids[0, 0] == 4
