"""Training-time test (TTT): unroll the drafter T steps on its own hidden states, as it runs when serving.

Alignment (all inputs are indexed by sequence position t, as the hidden-state shards store them):
  input_embeds[t]  target embedding of token t
  aux_hidden[t]    target aux states at position t
  target[t]        the target's next-token prediction at position t (for token t+1)
  loss_mask[t]     1 if token t is a trained (assistant) token

At step k the drafter at position t stands for real position t+k of a chain that started from the target's
states at position t: its input is (hidden, embedding of token t+1+k), it predicts token t+k+2, its label is
target[t+k+1], and it counts iff loss_mask[t+k+2]. Step 0 uses fc(aux_hidden[t]); step k>0 uses the step k-1
hidden_out at the same t. RoPE position is t+k.

Attention at step k, position t: the step-0 keys at positions 0..t (causal: the prefix the target verified)
plus the keys of steps 1..k at position t (the chain drafted so far). That is exactly what token-by-token
drafting with `DrafterKVCache` sees (tests/unit/test_drafter_ttt.py checks it). SpecForge/EAGLE additionally hide
the step-0 keys at positions t-k+1..t at step k; that makes training see less context than serving
(SafeAILab/EAGLE#247, sgl-project/SpecForge#245), so it is not done here.

Loss: sum_k decay**k * loss_k, loss_k averaged over the counted positions of step k.
  soft: cross-entropy against softmax(target logits restricted to the draft vocab).
  hard: cross-entropy against the target's argmax mapped into the draft vocab; positions whose target argmax
        lies outside the draft vocab have no label and are left out of the hard loss.
acc_k: fraction of counted positions where the draft argmax (mapped to a target id) equals the target's argmax
       over the FULL target vocab. A target argmax outside the draft vocab is a miss: SGLang would reject it.

Packed rows (`document_ids`): several samples one after another in a row. Attention stays inside each sample, RoPE
positions restart at each sample, and step k counts position t only if t+k+2 is in t's sample, so every sample's
loss terms are those it has alone (tests/unit/test_ttt_packing.py).

Attention (`draftline.drafter.ttt_attention`): `fused` runs one flex attention call per step, `blocked` plain tensor
ops in blocks of query positions. Draft logits are computed in blocks of positions; with `checkpointed` each step keeps
only its inputs for backward. None of it changes the maths: the tests compare loss and gradients with a
materialised reference.
"""

from __future__ import annotations

from typing import Iterator, Literal, Sequence

import torch

from draftline.drafter.model import Eagle3Drafter
from draftline.drafter.ttt_attention import (
    ATTENTION_KINDS,
    CHUNK_TOKENS,
    AttentionKind,
    TTTLayout,
    maybe_checkpoint,
    ttt_attention,
    ttt_layout,
)


def est_accept_len(acc_list: Sequence[float]) -> float:
    """1 + sum_k prod_{j<=k} acc_j: expected tokens per verify step for a chain draft (topk=1) of len(acc_list)
    tokens, counting the target's bonus token, like SGLang's accept length."""
    expected, survive = 1.0, 1.0
    for acc in acc_list:
        survive *= float(acc)
        expected += survive
    return expected


def target_signals(target_logits: torch.Tensor, t2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Full target logits [..., Vt] -> (logits over the draft vocab [..., Vd], argmax target ids [...])."""
    return target_logits[..., t2d.bool()], target_logits.argmax(dim=-1)


def shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, t] <- x[:, t+n] along dim 1, zero-filled at the end."""
    length = x.shape[1]
    if n >= length:
        return torch.zeros_like(x)
    pad = torch.zeros_like(x[:, : min(n, length)])
    return torch.cat([x[:, n:], pad], dim=1)


def ttt_step(
    drafter: Eagle3Drafter,
    input_embeds: torch.Tensor,
    hidden: torch.Tensor,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    step: int,
    layout: TTTLayout,
    attention: AttentionKind = "fused",
    chunk_tokens: int = CHUNK_TOKENS,
    checkpointed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One TTT step: (hidden_out [B,L,H], its key and value [B,kv,L,D]); keys/values of the earlier steps."""
    layer = drafter.midlayer
    q, key, value = layer.project_qkv(shift_left(input_embeds, step + 1), hidden, layout.positions + step)
    heads = ttt_attention(q, [*keys, key], [*values, value], layout, attention, chunk_tokens, checkpointed)
    return layer.finish(heads, residual=hidden), key, value


def ttt_hidden_states(
    drafter: Eagle3Drafter,
    input_embeds: torch.Tensor,
    aux_hidden: torch.Tensor,
    steps: int,
    layout: TTTLayout | None = None,
    attention: AttentionKind = "fused",
    chunk_tokens: int = CHUNK_TOKENS,
    checkpointed: bool = False,
) -> Iterator[torch.Tensor]:
    """Yield hidden_out [B, L, H] of steps 0..steps-1 (`layout` None: one sample per row). `checkpointed`: each step
    keeps only its inputs for backward and is recomputed there, so activations of one step are alive at a time
    instead of all `steps`."""
    if layout is None:
        layout = ttt_layout(None, input_embeds.shape[0], input_embeds.shape[1], input_embeds.device)
    hidden = drafter.fuse_aux(aux_hidden)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for k in range(steps):
        hidden, key, value = maybe_checkpoint(
            checkpointed, ttt_step, drafter, input_embeds, hidden, tuple(keys), tuple(values), k, layout, attention,
            chunk_tokens, checkpointed,
        )
        keys.append(key)
        values.append(value)
        yield hidden


def ttt_unroll(
    drafter: Eagle3Drafter, input_embeds: torch.Tensor, aux_hidden: torch.Tensor, steps: int,
    attention: AttentionKind = "fused",
) -> Iterator[torch.Tensor]:
    """Yield the draft logits [B, L, Vd] of steps 0..steps-1; position t of step k predicts token t+k+2."""
    for hidden in ttt_hidden_states(drafter, input_embeds, aux_hidden, steps, attention=attention):
        yield drafter.logits(hidden)


def _check_inputs(
    drafter, input_embeds, aux_hidden, target_logits_draft, target_ids, loss_mask, attention_mask, document_ids
):
    batch, length, _ = input_embeds.shape
    cfg = drafter.config
    expected = {
        "input_embeds": (input_embeds, (batch, length, cfg.hidden_size)),
        "aux_hidden": (aux_hidden, (batch, length, cfg.num_aux * cfg.target_hidden_size)),
        "target_logits_draft": (target_logits_draft, (batch, length, cfg.draft_vocab_size)),
        "target_ids": (target_ids, (batch, length)),
        "loss_mask": (loss_mask, (batch, length)),
    }
    if attention_mask is not None:
        expected["attention_mask"] = (attention_mask, (batch, length))
    if document_ids is not None:
        expected["document_ids"] = (document_ids, (batch, length))
    for name, (tensor, shape) in expected.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"ttt_loss: {name} has shape {tuple(tensor.shape)}, expected {shape}")
    if attention_mask is not None:
        real = attention_mask.bool()
        if (real[:, 1:] & ~real[:, :-1]).any():
            raise ValueError("ttt_loss: attention_mask must be right-padded (ones then zeros in every row)")


def ttt_loss(
    drafter: Eagle3Drafter,
    input_embeds: torch.Tensor,
    aux_hidden: torch.Tensor,
    target_logits_draft: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    target_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
    steps: int = 7,
    decay: float = 0.8,
    loss: Literal["soft", "hard"] = "soft",
    attention: AttentionKind = "fused",
    checkpointed: bool = False,
    chunk_tokens: int = CHUNK_TOKENS,
) -> tuple[torch.Tensor, dict[str, float]]:
    """-> (total_loss, metrics: loss_k, acc_k, count_k for k < steps, est_accept_len, vocab_coverage).

    Shapes: input_embeds [B,L,H], aux_hidden [B,L,n_aux*Ht], target_logits_draft [B,L,Vd] (see
    `target_signals`), target_ids [B,L] target argmax over the full vocab, loss_mask and attention_mask [B,L]
    (right padding; attention_mask None = no padding), document_ids [B,L] for packed rows: the sample's index in its
    row, -1 for padding (None = one sample per row).

    Memory: draft logits (and, blocked, attention scores) exist for `chunk_tokens` positions at a time. `checkpointed`
    recomputes each step (and each block of it) in backward instead of keeping its activations: the loss and the
    gradients are the same, peak memory no longer grows with `steps`, compute grows by about one forward.
    """
    if loss not in ("soft", "hard"):
        raise ValueError(f"ttt_loss: loss must be 'soft' or 'hard', got {loss!r}")
    if steps < 1:
        raise ValueError(f"ttt_loss: steps must be >= 1, got {steps}")
    if chunk_tokens < 1:
        raise ValueError(f"ttt_loss: chunk_tokens must be >= 1, got {chunk_tokens}")
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"ttt_loss: attention must be one of {ATTENTION_KINDS}, got {attention!r}")
    _check_inputs(
        drafter, input_embeds, aux_hidden, target_logits_draft, target_ids, loss_mask, attention_mask, document_ids
    )
    counted = loss_mask.bool() if attention_mask is None else loss_mask.bool() & attention_mask.bool()
    batch, length, _ = input_embeds.shape
    layout = ttt_layout(document_ids, batch, length, input_embeds.device)

    with torch.no_grad():
        target_probs = target_logits_draft.float().softmax(dim=-1) if loss == "soft" else None

    total = input_embeds.new_zeros((), dtype=torch.float32)
    metrics: dict[str, float] = {}
    accs = []
    hidden_states = ttt_hidden_states(
        drafter, input_embeds, aux_hidden, steps, layout, attention, chunk_tokens, checkpointed
    )
    for k, hidden_out in enumerate(hidden_states):
        # Position t of step k predicts token t+k+2 against target[t+k+1]: positions t < L-k-1 have a label, and
        # count when token t+k+2 is a trained token of t's own sample.
        labelled = max(length - k - 1, 0)
        step_mask = counted_ahead(counted, layout, k + 2)[:, :labelled]
        step_target_ids = shift_left(target_ids, k + 1)[:, :labelled]
        step_target_probs = None if target_probs is None else target_probs[:, k + 1 :]
        loss_sum = total.new_zeros(())
        hits = torch.zeros((), dtype=torch.int64, device=input_embeds.device)
        for start in range(0, labelled, chunk_tokens):
            block = slice(start, min(start + chunk_tokens, labelled))
            block_loss, block_hits = maybe_checkpoint(
                checkpointed,
                _step_loss_block,
                drafter,
                hidden_out[:, block],
                None if step_target_probs is None else step_target_probs[:, block],
                step_target_ids[:, block],
                step_mask[:, block],
            )
            loss_sum = loss_sum + block_loss
            hits = hits + block_hits
        loss_count = step_mask.sum() if loss == "soft" else (step_mask & drafter.t2d[step_target_ids]).sum()
        loss_k = loss_sum / loss_count.clamp(min=1)
        total = total + decay**k * loss_k

        count = int(step_mask.sum())
        acc = int(hits) / count if count else 0.0
        accs.append(acc)
        metrics[f"loss_{k}"] = float(loss_k.detach())
        metrics[f"acc_{k}"] = acc
        metrics[f"count_{k}"] = count

    with torch.no_grad():
        first_mask = counted_ahead(counted, layout, 2)
        first_ids = shift_left(target_ids, 1)
        covered = int((drafter.t2d[first_ids] & first_mask).sum())
        metrics["vocab_coverage"] = covered / max(int(first_mask.sum()), 1)
    metrics["est_accept_len"] = est_accept_len(accs)
    return total, metrics


def counted_ahead(counted: torch.Tensor, layout: TTTLayout, n: int) -> torch.Tensor:
    """[B, L] bool: token t+n is counted and in t's sample (a packed row's next sample is not t's future)."""
    return shift_left(counted, n) & layout.same_sample_ahead(n)


def _step_loss_block(drafter, hidden_out, target_probs, step_target_ids, step_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (summed loss over the counted positions of the block, number of counted draft hits). Soft when
    target_probs [B,C,Vd] is given, else hard against step_target_ids [B,C] mapped into the draft vocab."""
    log_probs = drafter.logits(hidden_out).float().log_softmax(dim=-1)
    if target_probs is not None:
        per_position = -(target_probs * log_probs).sum(-1)
        weight = step_mask
    else:
        t2d = drafter.t2d
        draft_index_of_target = torch.cumsum(t2d.long(), 0) - 1  # valid only where t2d
        labels = draft_index_of_target[step_target_ids].clamp(min=0)
        per_position = -log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        weight = step_mask & t2d[step_target_ids]
    with torch.no_grad():
        # Hits count against the target's full-vocab argmax: a target id outside the draft vocab is a miss.
        hits = ((drafter.draft_to_target(log_probs.argmax(-1)) == step_target_ids) & step_mask).sum()
    return (per_position * weight).sum(), hits
