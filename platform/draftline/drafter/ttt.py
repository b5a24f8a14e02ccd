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
drafting with `DrafterKVCache` sees (tests/test_drafter_ttt.py checks it). SpecForge/EAGLE additionally hide
the step-0 keys at positions t-k+1..t at step k; that makes training see less context than serving
(SafeAILab/EAGLE#247, sgl-project/SpecForge#245), so it is not done here.

Loss: sum_k decay**k * loss_k, loss_k averaged over the counted positions of step k.
  soft: cross-entropy against softmax(target logits restricted to the draft vocab).
  hard: cross-entropy against the target's argmax mapped into the draft vocab; positions whose target argmax
        lies outside the draft vocab have no label and are left out of the hard loss.
acc_k: fraction of counted positions where the draft argmax (mapped to a target id) equals the target's argmax
       over the FULL target vocab. A target argmax outside the draft vocab is a miss: SGLang would reject it.
"""

from __future__ import annotations

from typing import Iterator, Literal, Sequence

import torch

from draftline.drafter.model import Eagle3Drafter, expand_kv_heads


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


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """q [B,h,L,D]; keys/values[j] [B,kv,L,D] from step j. Causal over step 0, same-position over steps 1..k."""
    num_heads, length = q.shape[1], q.shape[2]
    scale = q.shape[-1] ** -0.5
    q32 = q.float()
    k0 = expand_kv_heads(keys[0], num_heads).float()
    v0 = expand_kv_heads(values[0], num_heads).float()
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    prefix_scores = (q32 @ k0.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))
    chain_keys = [expand_kv_heads(k, num_heads).float() for k in keys[1:]]
    chain_scores = [(q32 * k).sum(-1, keepdim=True) * scale for k in chain_keys]  # each [B,h,L,1]
    probs = torch.cat([prefix_scores, *chain_scores], dim=-1).softmax(dim=-1)
    out = probs[..., :length] @ v0
    for j, v in enumerate(values[1:]):
        out = out + probs[..., length + j : length + j + 1] * expand_kv_heads(v, num_heads).float()
    return out.to(q.dtype)


def ttt_unroll(
    drafter: Eagle3Drafter, input_embeds: torch.Tensor, aux_hidden: torch.Tensor, steps: int
) -> Iterator[torch.Tensor]:
    """Yield the draft logits [B, L, Vd] of steps 0..steps-1; position t of step k predicts token t+k+2."""
    batch, length, _ = input_embeds.shape
    position_ids = torch.arange(length, device=input_embeds.device).unsqueeze(0).expand(batch, length)
    layer = drafter.midlayer
    hidden = drafter.fuse_aux(aux_hidden)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for k in range(steps):
        q, key, value = layer.project_qkv(shift_left(input_embeds, k + 1), hidden, position_ids + k)
        keys.append(key)
        values.append(value)
        hidden = layer.finish(ttt_attention(q, keys, values), residual=hidden)
        yield drafter.logits(hidden)


def _check_inputs(drafter, input_embeds, aux_hidden, target_logits_draft, target_ids, loss_mask, attention_mask):
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
    steps: int = 7,
    decay: float = 0.8,
    loss: Literal["soft", "hard"] = "soft",
) -> tuple[torch.Tensor, dict[str, float]]:
    """-> (total_loss, metrics: loss_k, acc_k, count_k for k < steps, est_accept_len, vocab_coverage).

    Shapes: input_embeds [B,L,H], aux_hidden [B,L,n_aux*Ht], target_logits_draft [B,L,Vd] (see
    `target_signals`), target_ids [B,L] target argmax over the full vocab, loss_mask and attention_mask [B,L]
    (right padding; attention_mask None = no padding).
    """
    if loss not in ("soft", "hard"):
        raise ValueError(f"ttt_loss: loss must be 'soft' or 'hard', got {loss!r}")
    if steps < 1:
        raise ValueError(f"ttt_loss: steps must be >= 1, got {steps}")
    _check_inputs(drafter, input_embeds, aux_hidden, target_logits_draft, target_ids, loss_mask, attention_mask)
    counted = loss_mask.bool() if attention_mask is None else loss_mask.bool() & attention_mask.bool()

    t2d = drafter.t2d
    draft_index_of_target = torch.cumsum(t2d.long(), 0) - 1  # valid only where t2d
    with torch.no_grad():
        target_probs = target_logits_draft.float().softmax(dim=-1)

    total = input_embeds.new_zeros((), dtype=torch.float32)
    metrics: dict[str, float] = {}
    accs = []
    for k, draft_logits in enumerate(ttt_unroll(drafter, input_embeds, aux_hidden, steps)):
        step_mask = shift_left(counted, k + 2)
        step_target_ids = shift_left(target_ids, k + 1)
        log_probs = draft_logits.float().log_softmax(dim=-1)

        if loss == "soft":
            per_position = -(shift_left(target_probs, k + 1) * log_probs).sum(-1)
            loss_mask_k = step_mask
        else:
            in_draft_vocab = t2d[step_target_ids]
            labels = draft_index_of_target[step_target_ids].clamp(min=0)
            per_position = -log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
            loss_mask_k = step_mask & in_draft_vocab
        loss_k = (per_position * loss_mask_k).sum() / loss_mask_k.sum().clamp(min=1)
        total = total + decay**k * loss_k

        with torch.no_grad():
            hits = (drafter.draft_to_target(log_probs.argmax(-1)) == step_target_ids) & step_mask
            count = int(step_mask.sum())
            acc = float(hits.sum()) / count if count else 0.0
        accs.append(acc)
        metrics[f"loss_{k}"] = float(loss_k.detach())
        metrics[f"acc_{k}"] = acc
        metrics[f"count_{k}"] = count

    with torch.no_grad():
        first_mask = shift_left(counted, 2)
        first_ids = shift_left(target_ids, 1)
        covered = int((t2d[first_ids] & first_mask).sum())
        metrics["vocab_coverage"] = covered / max(int(first_mask.sum()), 1)
    metrics["est_accept_len"] = est_accept_len(accs)
    return total, metrics
