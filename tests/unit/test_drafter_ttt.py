"""Training-time test: unrolled attention == serving-time drafting, batching/masking, loss and accuracy."""

from __future__ import annotations

import pytest
import torch
from drafter_helpers import random_inputs, tiny_drafter

from draftline.drafter.model import DrafterKVCache
from draftline.drafter.ttt import est_accept_len, shift_left, target_signals, ttt_loss, ttt_unroll


def test_est_accept_len():
    assert est_accept_len([]) == 1.0
    assert est_accept_len([1.0, 1.0, 1.0]) == 4.0
    assert est_accept_len([0.5, 0.5]) == pytest.approx(1.75)
    assert est_accept_len([0.0, 1.0]) == 1.0


@torch.no_grad()
def test_step0_equals_plain_causal_forward():
    model = tiny_drafter()
    embeds, aux, _ = random_inputs(model.config, batch=2, length=7)
    step0 = next(ttt_unroll(model, embeds, aux, steps=1))
    plain, _ = model(shift_left(embeds, 1), model.fuse_aux(aux), torch.arange(7))
    torch.testing.assert_close(step0, plain, atol=1e-5, rtol=0)


@torch.no_grad()
def test_every_step_equals_token_by_token_drafting_with_the_kv_cache():
    """Step k at position t == serving: prefill 0..t with target states, then draft k tokens one at a time."""
    model = tiny_drafter()
    length, steps = 8, 4
    embeds, aux, _ = random_inputs(model.config, batch=1, length=length)
    unrolled = list(ttt_unroll(model, embeds, aux, steps))
    fused = model.fuse_aux(aux)
    for t in range(length - steps):
        cache = DrafterKVCache()
        # Position p consumes (target state at p, embedding of token p+1).
        logits, hidden_out = model(embeds[:, 1 : t + 2], fused[:, : t + 1], torch.arange(t + 1), cache=cache)
        torch.testing.assert_close(logits[:, -1], unrolled[0][:, t], atol=1e-5, rtol=0)
        for k in range(1, steps):
            logits, hidden_out = model(
                embeds[:, t + 1 + k : t + 2 + k], hidden_out[:, -1:], torch.tensor([t + k]), cache=cache
            )
            torch.testing.assert_close(logits[:, -1], unrolled[k][:, t], atol=1e-5, rtol=0)


def _signals(model, target_logits):
    return target_signals(target_logits, model.t2d)


def test_batched_padding_equals_per_sample():
    model = tiny_drafter()
    lengths = [9, 6]
    batch, max_len = len(lengths), max(lengths)
    embeds, aux, target_logits = random_inputs(model.config, batch, max_len)
    attention_mask = torch.tensor([[1] * n + [0] * (max_len - n) for n in lengths])
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1, 0, 0, 0]])
    # Garbage in the padding must not leak into valid positions.
    embeds[1, 6:] = 1e3
    aux[1, 6:] = -1e3
    logits_draft, target_ids = _signals(model, target_logits)
    steps = 3
    for kind in ("soft", "hard"):
        _, batched = ttt_loss(
            model, embeds, aux, logits_draft, loss_mask,
            target_ids=target_ids, attention_mask=attention_mask, steps=steps, loss=kind,
        )
        singles = []
        for b, n in enumerate(lengths):
            singles.append(
                ttt_loss(
                    model, embeds[b : b + 1, :n], aux[b : b + 1, :n], logits_draft[b : b + 1, :n],
                    loss_mask[b : b + 1, :n], target_ids=target_ids[b : b + 1, :n], steps=steps, loss=kind,
                )[1]
            )
        for k in range(steps):
            count = sum(s[f"count_{k}"] for s in singles)
            assert batched[f"count_{k}"] == count > 0
            hits = sum(s[f"acc_{k}"] * s[f"count_{k}"] for s in singles)
            assert batched[f"acc_{k}"] == pytest.approx(hits / count)
            if kind == "soft":
                loss_sum = sum(s[f"loss_{k}"] * s[f"count_{k}"] for s in singles)
                assert batched[f"loss_{k}"] == pytest.approx(loss_sum / count, rel=1e-5)


def test_counted_positions_follow_the_predicted_token_mask():
    model = tiny_drafter()
    embeds, aux, target_logits = random_inputs(model.config, batch=1, length=8)
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 0]])
    logits_draft, target_ids = _signals(model, target_logits)
    _, metrics = ttt_loss(model, embeds, aux, logits_draft, loss_mask, target_ids=target_ids, steps=3)
    # Step k counts position t >= 0 iff loss_mask[t+k+2]: t+k+2 in 3..6, so step 2 loses t = -1.
    assert [metrics[f"count_{k}"] for k in range(3)] == [4, 4, 3]
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1]])
    _, metrics = ttt_loss(model, embeds, aux, logits_draft, loss_mask, target_ids=target_ids, steps=3)
    assert [metrics[f"count_{k}"] for k in range(3)] == [6, 5, 4]


@torch.no_grad()
def test_accuracy_counts_out_of_vocab_targets_as_misses():
    model = tiny_drafter()
    length = 10
    embeds, aux, target_logits = random_inputs(model.config, batch=1, length=length)
    loss_mask = torch.ones(1, length, dtype=torch.long)
    step0 = next(ttt_unroll(model, embeds, aux, steps=1))
    # Make the target agree with the draft everywhere at step 0 (position t predicts the target at t+1).
    target_ids = torch.zeros(1, length, dtype=torch.long)
    target_ids[:, 1:] = model.draft_to_target(step0.argmax(-1))[:, :-1]
    logits_draft = target_logits[..., model.t2d]
    _, metrics = ttt_loss(model, embeds, aux, logits_draft, loss_mask, target_ids=target_ids, steps=1)
    assert metrics["acc_0"] == 1.0
    assert metrics["vocab_coverage"] == 1.0
    # Two counted targets outside the draft vocab: misses for acc, not counted by the hard loss.
    out_of_vocab = (~model.t2d).nonzero()[0, 0]
    target_ids[:, [3, 5]] = out_of_vocab
    total_soft, metrics = ttt_loss(model, embeds, aux, logits_draft, loss_mask, target_ids=target_ids, steps=1)
    count = metrics["count_0"]
    assert metrics["acc_0"] == pytest.approx((count - 2) / count)
    assert metrics["vocab_coverage"] == pytest.approx((count - 2) / count)
    _, hard = ttt_loss(model, embeds, aux, logits_draft, loss_mask, target_ids=target_ids, steps=1, loss="hard")
    log_probs = step0.log_softmax(-1)[0]
    draft_index = torch.cumsum(model.t2d.long(), 0) - 1
    expected = [-log_probs[t, draft_index[target_ids[0, t + 1]]] for t in range(count) if t + 1 not in (3, 5)]
    assert hard["loss_0"] == pytest.approx(float(torch.stack(expected).mean()), rel=1e-5)


def test_total_is_decayed_sum_and_training_reduces_loss():
    model = tiny_drafter().train()
    embeds, aux, target_logits = random_inputs(model.config, batch=2, length=12)
    loss_mask = torch.ones(2, 12, dtype=torch.long)
    logits_draft, target_ids = _signals(model, target_logits)
    total, metrics = ttt_loss(model, embeds, aux, logits_draft, loss_mask, target_ids=target_ids, steps=3, decay=0.5)
    assert total.item() == pytest.approx(sum(0.5**k * metrics[f"loss_{k}"] for k in range(3)), rel=1e-5)
    assert metrics["est_accept_len"] == pytest.approx(est_accept_len([metrics[f"acc_{k}"] for k in range(3)]))

    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = total.item()
    for _ in range(30):
        optimizer.zero_grad()
        total, _ = ttt_loss(model, embeds, aux, logits_draft, loss_mask, target_ids=target_ids, steps=3, decay=0.5)
        total.backward()
        optimizer.step()
    assert total.item() < 0.7 * first


def test_input_validation():
    model = tiny_drafter()
    embeds, aux, target_logits = random_inputs(model.config, batch=2, length=5)
    logits_draft, target_ids = _signals(model, target_logits)
    loss_mask = torch.ones(2, 5)
    with pytest.raises(ValueError, match="aux_hidden has shape"):
        ttt_loss(model, embeds, aux[..., :-1], logits_draft, loss_mask, target_ids=target_ids)
    with pytest.raises(ValueError, match="right-padded"):
        ttt_loss(
            model, embeds, aux, logits_draft, loss_mask,
            target_ids=target_ids, attention_mask=torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]),
        )
    with pytest.raises(ValueError, match="'soft' or 'hard'"):
        ttt_loss(model, embeds, aux, logits_draft, loss_mask, target_ids=target_ids, loss="kl")
