"""The TTT attention paths (fused flex attention, blocked, materialised) compute the same loss and gradients."""

from __future__ import annotations

import pytest
import torch
from drafter_helpers import random_inputs, tiny_drafter
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from draftline.drafter.model import attend
from draftline.drafter.ttt import shift_left, target_signals, ttt_loss
from draftline.drafter.ttt_attention import _ttt_mask_mod, ttt_block_mask, ttt_layout

# Two rows: three samples packed one after another, and two samples then padding (-1).
PACKED_DOCUMENTS = [[0] * 4 + [1] * 5 + [2] * 2, [0] * 6 + [1] * 2 + [-1] * 3]


def materialised_reference_loss(model, embeds, aux, logits_draft, loss_mask, target_ids, steps, decay, kind,
                                document_ids=None):
    """The TTT loss written the direct way: per step one [B, h, L, (k+1)L] score matrix over the keys of all steps
    with the TTT mask (causal and same sample over step 0, same position over steps 1..k), full [B, L, Vd]
    log-probs, shifted targets; packed rows restart positions per sample and count only targets in the sample."""
    batch, length, _ = embeds.shape
    if document_ids is None:
        document_ids = torch.zeros(batch, length, dtype=torch.long)
    index = torch.arange(length)
    same_sample = document_ids[:, :, None] == document_ids[:, None, :]  # [B, L, L]
    causal = (index[None, :] <= index[:, None]) & same_sample
    same_position = (index[None, :] == index[:, None]).expand(batch, length, length)
    starts = torch.stack([(document_ids[b, None, :] == document_ids[b, :, None]).float().argmax(-1) for b in range(batch)])
    positions = index - starts
    layer = model.midlayer
    hidden = model.fuse_aux(aux)
    keys, values = [], []
    target_probs = logits_draft.float().softmax(-1)
    draft_index = torch.cumsum(model.t2d.long(), 0) - 1
    total = torch.zeros(())
    for k in range(steps):
        q, key, value = layer.project_qkv(shift_left(embeds, k + 1), hidden, positions + k)
        keys.append(key)
        values.append(value)
        allowed = torch.cat([causal] + [same_position] * k, dim=2)[:, None]
        hidden = layer.finish(attend(q, torch.cat(keys, 2), torch.cat(values, 2), allowed), residual=hidden)
        log_probs = model.logits(hidden).float().log_softmax(-1)
        in_sample = shift_left(document_ids + 1, k + 2) == document_ids + 1
        step_mask = shift_left(loss_mask.bool(), k + 2) & in_sample
        step_ids = shift_left(target_ids, k + 1)
        if kind == "soft":
            per_position = -(shift_left(target_probs, k + 1) * log_probs).sum(-1)
        else:
            per_position = -log_probs.gather(-1, draft_index[step_ids].clamp(min=0).unsqueeze(-1)).squeeze(-1)
            step_mask = step_mask & model.t2d[step_ids]
        total = total + decay**k * (per_position * step_mask).sum() / step_mask.sum().clamp(min=1)
    return total


@pytest.mark.parametrize("packed", [False, True], ids=["one-sample-a-row", "packed"])
@pytest.mark.parametrize("kind", ["soft", "hard"])
def test_fused_blocked_and_materialised_paths_give_the_same_loss_and_gradients(packed, kind):
    length, steps, decay = 11, 4, 0.8
    model = tiny_drafter().train()
    embeds, aux, target_logits = random_inputs(model.config, batch=2, length=length)
    loss_mask = (torch.arange(length) % 4 != 0).long().expand(2, length)
    logits_draft, target_ids = target_signals(target_logits, model.t2d)
    document_ids = torch.tensor(PACKED_DOCUMENTS) if packed else None
    attention_mask = None if document_ids is None else document_ids >= 0
    if packed:  # the materialised reference treats padding as a sample of its own, as ttt_layout does
        reference_ids = torch.where(document_ids < 0, length, document_ids)
        loss_mask = loss_mask & attention_mask
    else:
        reference_ids = None

    reference = materialised_reference_loss(
        model, embeds, aux, logits_draft, loss_mask, target_ids, steps, decay, kind, reference_ids
    )
    expected_grads = torch.autograd.grad(reference, list(model.parameters()))
    for attention, checkpointed, chunk_tokens in [
        ("fused", True, 512), ("fused", False, 3), ("blocked", True, 3), ("blocked", False, 512)
    ]:
        total, metrics = ttt_loss(
            model, embeds, aux, logits_draft, loss_mask, target_ids=target_ids, attention_mask=attention_mask,
            document_ids=document_ids, steps=steps, decay=decay, loss=kind, attention=attention,
            checkpointed=checkpointed, chunk_tokens=chunk_tokens,
        )
        grads = torch.autograd.grad(total, list(model.parameters()))
        where = f"{attention}, checkpointed={checkpointed}, chunk_tokens={chunk_tokens}"
        torch.testing.assert_close(total, reference, atol=1e-5, rtol=0, msg=lambda m: f"{where}: {m}")
        for (name, _), grad, expected in zip(model.named_parameters(), grads, expected_grads):
            torch.testing.assert_close(grad, expected, atol=1e-5, rtol=0, msg=lambda m: f"{where}, {name}: {m}")
        assert sum(metrics[f"count_{k}"] for k in range(steps)) > 0


def test_fused_equals_blocked_over_many_flex_tiles():
    """Rows longer than one flex tile (128): tiles skipped, tiles seen in full and in part, a chain step crossing a
    tile boundary, several samples per row and a row of one sample."""
    length, steps = 300, 3
    model = tiny_drafter().train()
    embeds, aux, target_logits = random_inputs(model.config, batch=2, length=length)
    logits_draft, target_ids = target_signals(target_logits, model.t2d)
    document_ids = torch.tensor([[0] * 140 + [1] * 100 + [2] * 60, [0] * 290 + [-1] * 10])
    loss_mask = (torch.arange(length) % 3 != 0).expand(2, length) & (document_ids >= 0)
    results = {}
    for attention in ("fused", "blocked"):
        total, metrics = ttt_loss(
            model, embeds, aux, logits_draft, loss_mask, target_ids=target_ids, attention_mask=document_ids >= 0,
            document_ids=document_ids, steps=steps, attention=attention, checkpointed=True,
        )
        results[attention] = (total, torch.autograd.grad(total, list(model.parameters())), metrics)
    torch.testing.assert_close(results["fused"][0], results["blocked"][0], atol=1e-5, rtol=0)
    for fused, blocked in zip(results["fused"][1], results["blocked"][1]):
        torch.testing.assert_close(fused, blocked, atol=1e-5, rtol=0)
    assert results["fused"][2] == pytest.approx(results["blocked"][2], abs=1e-5)


@pytest.mark.parametrize("step", [0, 1, 3])
def test_block_mask_tiles_are_those_flex_attention_derives_from_the_mask(step):
    """ttt_block_mask builds the tiles from tile bounds; create_block_mask evaluates the mask at every pair."""
    document_ids = torch.tensor([[0] * 100 + [1] * 150 + [2] * 20 + [-1] * 30, [0] * 300])
    layout = ttt_layout(document_ids, 2, 300, torch.device("cpu"))
    ours = ttt_block_mask(layout.documents, step)
    flex = create_block_mask(_ttt_mask_mod(layout.documents), 2, None, 300, 300 * (step + 1), device="cpu")
    assert torch.equal(ours.to_dense(), flex.to_dense())  # every tile with a visible pair, partial or full
    assert torch.equal(_full_tiles(ours), _full_tiles(flex))  # tiles where the mask need not be evaluated


def _full_tiles(mask: BlockMask) -> torch.Tensor:
    return BlockMask.from_kv_blocks(mask.full_kv_num_blocks, mask.full_kv_indices, compute_q_blocks=False).to_dense()


def test_layout_restarts_positions_per_sample_and_rejects_unordered_samples():
    layout = ttt_layout(torch.tensor([[0, 0, 0, 1, 1, -1]]), 1, 6, torch.device("cpu"))
    assert layout.positions.tolist() == [[0, 1, 2, 0, 1, 0]]
    assert layout.same_sample_ahead(2).tolist() == [[True, False, False, False, False, False]]
    with pytest.raises(ValueError, match="non-decreasing"):
        ttt_layout(torch.tensor([[0, 1, 0]]), 1, 3, torch.device("cpu"))
