"""Sequence packing: several samples in one row train exactly as each sample alone."""

from __future__ import annotations

import pytest
import torch
from drafter_helpers import random_inputs, tiny_drafter

from draftline.drafter.ttt import target_signals, ttt_loss
from draftline.train.data import TargetHead, collate, pack_rows
from draftline.train.loop import TTTObjective, objective_inputs

LENGTHS = [9, 4, 6]


def _samples(model, lengths=LENGTHS) -> list[dict]:
    samples = []
    for seed, length in enumerate(lengths):
        embeds, aux, target_logits = random_inputs(model.config, 1, length, seed=seed + 1)
        samples.append({"embeds": embeds[0], "aux": aux[0], "target_logits": target_logits[0],
                        "loss_mask": (torch.arange(length) % 5 != 0).long()})
    return samples


def _packed_row(samples) -> dict:
    row = {key: torch.cat([s[key] for s in samples])[None] for key in samples[0]}
    row["document_ids"] = torch.cat([torch.full((len(s["loss_mask"]),), i) for i, s in enumerate(samples)])[None]
    return row


@pytest.mark.parametrize("attention", ["fused", "blocked"])
def test_a_packed_row_gives_every_sample_the_loss_and_gradients_it_has_alone(attention):
    """Each sample's loss from the packed row (the other samples' tokens left out of the loss mask) equals the loss of
    the sample run by itself: attention, RoPE positions and the TTT shift stop at sample boundaries."""
    model = tiny_drafter().train()
    samples = _samples(model)
    row = _packed_row(samples)
    logits_draft, target_ids = target_signals(row["target_logits"], model.t2d)
    for index, sample in enumerate(samples):
        own_tokens = row["document_ids"] == index
        packed_loss, packed_metrics = ttt_loss(
            model, row["embeds"], row["aux"], logits_draft, row["loss_mask"] * own_tokens, target_ids=target_ids,
            document_ids=row["document_ids"], steps=4, attention=attention, checkpointed=True,
        )
        packed_grads = torch.autograd.grad(packed_loss, list(model.parameters()))
        alone_logits, alone_ids = target_signals(sample["target_logits"][None], model.t2d)
        alone_loss, alone_metrics = ttt_loss(
            model, sample["embeds"][None], sample["aux"][None], alone_logits, sample["loss_mask"][None],
            target_ids=alone_ids, steps=4, attention=attention, checkpointed=True,
        )
        alone_grads = torch.autograd.grad(alone_loss, list(model.parameters()))
        torch.testing.assert_close(packed_loss, alone_loss, atol=1e-5, rtol=0, msg=lambda m: f"sample {index}: {m}")
        assert packed_metrics == pytest.approx(alone_metrics, abs=1e-5), f"sample {index}"
        for (name, _), packed, alone in zip(model.named_parameters(), packed_grads, alone_grads):
            torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0, msg=lambda m: f"sample {index}, {name}: {m}")


def _shard_samples(lengths, width=32, vocab=40) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    return [
        {
            "input_ids": torch.randint(0, vocab, (n,), generator=generator),
            "loss_mask": (torch.arange(n) % 3 != 0).to(torch.uint8),
            "aux_hidden": torch.randn(n, 3 * width, generator=generator),
            "final_hidden": torch.randn(n, width, generator=generator),
        }
        for n in lengths
    ]


def test_the_training_objective_on_a_packed_batch_equals_it_on_the_padded_batch():
    """What the worker trains: collate(packing=True) -> objective_inputs -> TTTObjective, same loss, metrics and
    gradients as one sample a row, on fewer positions."""
    model = tiny_drafter().train()
    generator = torch.Generator().manual_seed(3)
    head = TargetHead(torch.randn(40, 32, generator=generator), torch.randn(40, 32, generator=generator))
    samples = _shard_samples([12, 3, 7, 5, 12, 2])
    objective = TTTObjective(model, steps=3, decay=0.8, loss="soft")
    padded, packed = collate(samples), collate(samples, packing=True)
    assert packed.num_slots < padded.num_slots and packed.num_tokens == padded.num_tokens == 41
    results = []
    for batch in (padded, packed):
        loss, metrics = objective(*objective_inputs(batch, head, model.t2d, torch.float32))
        results.append((loss, metrics, torch.autograd.grad(loss, list(model.parameters()))))
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-5, rtol=0)
    assert results[1][1] == pytest.approx(results[0][1], abs=1e-5)
    for packed_grad, padded_grad in zip(results[1][2], results[0][2]):
        torch.testing.assert_close(packed_grad, padded_grad, atol=1e-5, rtol=0)


def test_pack_rows_fills_rows_longest_first_up_to_the_row_length():
    assert pack_rows([5, 2, 7, 3, 1]) == [[2], [0, 1], [3, 4]]  # rows of 7 (the longest sample)
    assert pack_rows([5, 2, 7, 3, 1], row_tokens=10) == [[2, 3], [0, 1, 4]]
    assert pack_rows([4, 4]) == [[0], [1]]
    assert pack_rows([3], row_tokens=2) == [[0]]  # a sample longer than the row gets a row of its own


def test_collate_packs_samples_one_after_another_with_their_sample_ids():
    samples = _shard_samples([2, 5, 3])
    batch = collate(samples, packing=True)
    assert batch.document_ids.tolist() == [[0, 0, 0, 0, 0], [0, 0, 0, 1, 1]]  # rows: [sample 1], [sample 2, sample 0]
    assert batch.attention_mask.all() and batch.num_slots == 10 and batch.unpacked_slots == 15
    assert torch.equal(batch.input_ids[1], torch.cat([samples[2]["input_ids"], samples[0]["input_ids"]]))
    assert torch.equal(batch.aux_hidden[0], samples[1]["aux_hidden"])
    assert batch.loss_mask[1].tolist() == [False, True, True, False, True]
    assert collate(samples).document_ids is None
