"""The attention of one training-time-test step, computed two ways with the same result.

At step k, the query at position t of a row attends to the step-0 keys at positions s <= t of its own sample (the
prefix the target verified) and to the keys of steps 1..k at position t (the chain drafted so far). A row holds one
sample (right padding after it) or, packed, several samples one after another (`TTTLayout`): attention never crosses
a sample boundary and rotary positions restart at each sample.

- `fused`: one flex attention call per step (`torch.nn.attention.flex_attention`) over the keys of steps 0..k laid
  end to end ([B, kv, (k+1)L, D]) under the TTT mask as a `BlockMask`: tiles no query of a tile can see are skipped,
  and no [L, L] score matrix is stored. Compiled by inductor. On CUDA flex attention has forward and backward
  kernels. On CPU, PyTorch compiles the forward only (no backward, no log-sum-exp output), so the backward here
  recomputes each block of query positions' probabilities and applies the softmax-attention gradient by hand.
- `blocked`: plain tensor ops in blocks of query positions (scores for one block over the step-0 keys it can see);
  the fallback where flex attention cannot be compiled (`train.attention: blocked`).

tests/unit/test_ttt_attention.py checks both, and a materialised [L, (k+1)L] computation, give the same loss and
gradients.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Literal, Sequence

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

AttentionKind = Literal["fused", "blocked"]
ATTENTION_KINDS: tuple[str, ...] = ("fused", "blocked")

# Positions per block of attention queries in the blocked path and in the fused path's CPU backward: scores
# [B, heads, CHUNK, <=L] instead of [B, heads, L, L] (512 MiB in fp32 at 32 heads and L 2048).
CHUNK_TOKENS = 512
# Flex attention's tile (queries x keys) for the block mask; 128 is its default on CPU and CUDA.
FLEX_TILE = 128


@dataclass
class TTTLayout:
    """Which sample every position of a [B, L] batch belongs to, and what follows from it.

    documents [B, L]: the sample's index in its row, non-decreasing along the row (padding after the last sample
    is one more index); positions [B, L]: RoPE position inside the sample; sample_start [B, L]: the row position
    where t's sample starts. Built by `ttt_layout`.
    """

    documents: torch.Tensor
    positions: torch.Tensor
    sample_start: torch.Tensor
    _block_masks: dict = field(default_factory=dict, repr=False)
    _one_row: "TTTLayout | None" = field(default=None, repr=False)

    @property
    def length(self) -> int:
        return self.documents.shape[1]

    def same_sample_ahead(self, n: int) -> torch.Tensor:
        """[B, L] bool: position t+n exists and belongs to t's sample (a TTT shift of n stays inside the sample)."""
        ahead = torch.full_like(self.documents, -1)
        if n < self.length:
            ahead[:, : self.length - n] = self.documents[:, n:]
        return ahead == self.documents

    def block_mask(self, step: int) -> BlockMask:
        """The fused path's mask at `step` (keys of steps 0..step), built once per step and batch."""
        if step not in self._block_masks:
            self._block_masks[step] = ttt_block_mask(self.documents, step)
        return self._block_masks[step]

    def one_row(self) -> "TTTLayout":
        """The same positions as one row of B*L (row r's samples renumbered after row r-1's), for the fused path."""
        if self._one_row is None:
            batch, length = self.documents.shape
            row = torch.arange(batch, device=self.documents.device)[:, None]
            self._one_row = TTTLayout(
                (self.documents + row * (length + 1)).reshape(1, -1),  # ids run 0..length in a row
                self.positions.reshape(1, -1),
                (self.sample_start + row * length).reshape(1, -1),
            )
        return self._one_row


def ttt_layout(document_ids: torch.Tensor | None, batch: int, length: int, device: torch.device) -> TTTLayout:
    """document_ids [B, L] int (sample index within its row, -1 for padding) or None (one sample per row)."""
    if document_ids is None:
        documents = torch.zeros(batch, length, dtype=torch.int64, device=device)
    else:
        # Padding as one more sample at the end of the row keeps the ids non-decreasing (the block mask relies on it).
        documents = torch.where(document_ids < 0, length, document_ids.long())
        if (documents[:, 1:] < documents[:, :-1]).any():
            raise ValueError(
                "document_ids must be non-decreasing along each row with padding (-1) only at the end: a packed row "
                "holds its samples one after another"
            )
    index = torch.arange(length, device=device).expand(batch, length)
    starts_here = torch.ones_like(documents, dtype=torch.bool)
    starts_here[:, 1:] = documents[:, 1:] != documents[:, :-1]
    sample_start = torch.where(starts_here, index, 0).cummax(dim=1).values
    return TTTLayout(documents, index - sample_start, sample_start)


def ttt_attention(
    q: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], layout: TTTLayout,
    kind: AttentionKind = "fused", chunk_tokens: int = CHUNK_TOKENS, checkpointed: bool = False,
) -> torch.Tensor:
    """q [B,h,L,D]; keys/values[j] [B,kv,L,D] from step j -> [B,h,L,D]. `checkpointed` (blocked only): a block's
    scores are recomputed in backward instead of kept."""
    if kind == "fused":
        return fused_ttt_attention(q, keys, values, layout, chunk_tokens)
    if kind == "blocked":
        return blocked_ttt_attention(q, keys, values, layout, chunk_tokens, checkpointed)
    raise ValueError(f"ttt attention must be one of {ATTENTION_KINDS}, got {kind!r} (train.attention)")


# --- fused: flex attention -------------------------------------------------------------------------------------


def ttt_block_mask(documents: torch.Tensor, step: int) -> BlockMask:
    """The TTT mask over keys of steps 0..step laid end to end, as flex attention's tiles: for every tile of
    FLEX_TILE queries, the key tiles it may see in part (mask evaluated) and in full (mask skipped).

    Built from the tile bounds directly ([B, L/128, (step+1)L/128] booleans) rather than by evaluating the mask at
    every (query, key) pair, which costs seconds at L=2048 on a CPU. Exact because sample ids are non-decreasing
    along a row: a step-0 key tile entirely before a query tile shares a sample with it iff its last key and the
    tile's first query do.
    """
    batch, length = documents.shape
    kv_length = (step + 1) * length
    device = documents.device
    q_first = torch.arange(0, length, FLEX_TILE, device=device)
    q_last = (q_first + FLEX_TILE).clamp(max=length) - 1
    kv_first = torch.arange(0, kv_length, FLEX_TILE, device=device)
    kv_last = (kv_first + FLEX_TILE).clamp(max=kv_length) - 1
    q_first_, q_last_ = q_first[:, None], q_last[:, None]  # [nq, 1] against key tiles [nkv]

    # Step-0 keys: the diagonal tile, and whole tiles before it that share the tile's first query's sample.
    before = kv_last < q_first_
    prefix_last_doc = documents[:, kv_last.clamp(max=length - 1)][:, None, :]  # [B, 1, nkv]
    prefix_first_doc = documents[:, kv_first.clamp(max=length - 1)][:, None, :]
    shares_sample = before & (prefix_last_doc == documents[:, q_first][:, :, None])
    prefix_any = (kv_first == q_first_) | shares_sample
    # Seen in full: all its keys and queries in one sample, and a whole tile of queries (as flex counts a last tile).
    full = before & (prefix_first_doc == documents[:, q_last][:, :, None]) & (q_first_ + FLEX_TILE <= length)
    # Steps 1..step: position t of step j is key j*L + t, so a query tile sees at most two tiles per step.
    chain_any = torch.zeros(len(q_first), len(kv_first), dtype=torch.bool, device=device)
    for j in range(1, step + 1):
        chain_any |= (kv_first <= q_last_ + j * length) & (kv_last >= q_first_ + j * length)
    partial = (prefix_any & ~full) | chain_any

    def kv_tiles(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = tiles.sum(-1, dtype=torch.int32)
        order = tiles.to(torch.int8).argsort(dim=-1, descending=True, stable=True).to(torch.int32)
        return counts[:, None], order[:, None]  # one mask for all heads

    return BlockMask.from_kv_blocks(
        *kv_tiles(partial), *kv_tiles(full), BLOCK_SIZE=FLEX_TILE, mask_mod=_ttt_mask_mod(documents),
        seq_lengths=(length, kv_length),
        compute_q_blocks=device.type != "cpu",  # the key-major tiles serve flex's backward, which CPU does not run
    )


def _ttt_mask_mod(documents: torch.Tensor):
    """mask_mod(b, h, q, kv) of the layout: the row length is read from a tensor, so one compiled kernel serves
    every length and step (a Python int here would be a constant of the compiled code)."""
    length = torch.tensor(documents.shape[1], device=documents.device)

    def mask_mod(b, h, q_idx, kv_idx):
        position = kv_idx % length
        prefix = (kv_idx < length) & (position <= q_idx) & (documents[b, position] == documents[b, q_idx])
        return prefix | ((kv_idx >= length) & (position == q_idx))

    return mask_mod


@functools.cache
def compiled_flex_attention():
    """flex_attention compiled once per process for all shapes (dynamic), so a new sequence length does not
    compile again."""
    return torch.compile(flex_attention, dynamic=True)


def fused_ttt_attention(q, keys, values, layout: TTTLayout, chunk_tokens: int = CHUNK_TOKENS) -> torch.Tensor:
    """The B rows run as one row of B*L positions whose samples never see each other. Inductor's CPU flex kernel
    is miscompiled for a mask that reads per-sample ids with a batch index under dynamic shapes (torch 2.13); one
    row also means one compiled kernel for every batch size."""
    batch, num_heads, length, head_dim = q.shape
    one_row = layout.one_row()
    q_row = _as_one_row(q)
    all_keys = torch.cat([_as_one_row(k) for k in keys], dim=2)  # steps 0..k end to end: [1, kv, (k+1)BL, D]
    all_values = torch.cat([_as_one_row(v) for v in values], dim=2)
    block_mask = one_row.block_mask(len(keys) - 1)
    if q.device.type == "cpu":
        out = _CpuFlexAttention.apply(q_row, all_keys, all_values, block_mask, one_row, chunk_tokens)
    else:
        out = compiled_flex_attention()(q_row, all_keys, all_values, block_mask=block_mask, enable_gqa=True)
    return out.view(num_heads, batch, length, head_dim).transpose(0, 1)


def _as_one_row(x: torch.Tensor) -> torch.Tensor:
    """[B, heads, L, D] -> [1, heads, B*L, D], row after row."""
    batch, heads, length, head_dim = x.shape
    return x.transpose(0, 1).reshape(1, heads, batch * length, head_dim)


class _CpuFlexAttention(torch.autograd.Function):
    """Forward: compiled flex attention (CPU has no flex backward). Backward: per block of query positions, the
    probabilities are recomputed (a block's rows are complete: it sees every key its queries may see) and
    dQ = dS K, dK = dS^T Q, dV = P^T dO with dS = P * (dO V^T - rowsum(dO * O)), scaled like the scores."""

    @staticmethod
    def forward(ctx, q, all_keys, all_values, block_mask, layout, chunk_tokens):
        out = compiled_flex_attention()(
            q.detach().float(), all_keys.detach().float(), all_values.detach().float(), block_mask=block_mask,
            enable_gqa=True,
        )
        ctx.save_for_backward(q, all_keys, all_values, out)
        ctx.layout, ctx.chunk_tokens = layout, chunk_tokens
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, all_keys, all_values, out = ctx.saved_tensors
        dq, dk, dv = _blocked_attention_backward(
            q.float(), all_keys.float(), all_values.float(), out, grad_out.float(), ctx.layout, ctx.chunk_tokens
        )
        return dq.to(q.dtype), dk.to(all_keys.dtype), dv.to(all_values.dtype), None, None, None


def _blocked_attention_backward(q, all_keys, all_values, out, grad_out, layout: TTTLayout, chunk_tokens: int):
    batch, num_heads, length, head_dim = q.shape
    kv_heads = all_keys.shape[1]
    group, scale = num_heads // kv_heads, head_dim**-0.5
    # Query heads grouped under their kv head ([B, kv, group, L, D]), as the blocked forward does.
    q_g, out_g, dout_g = (x.view(batch, kv_heads, group, length, head_dim) for x in (q, out, grad_out))
    prefix_keys, prefix_values = all_keys[:, :, :length], all_values[:, :, :length]
    chain_keys, chain_values = _chain(all_keys, length), _chain(all_values, length)  # [B, kv, L, steps-1, D]
    dq = torch.empty_like(q_g)
    d_prefix_keys, d_prefix_values = torch.zeros_like(prefix_keys), torch.zeros_like(prefix_values)
    d_chain_keys, d_chain_values = torch.empty_like(chain_keys), torch.empty_like(chain_values)
    for start in range(0, length, chunk_tokens):
        end = min(start + chunk_tokens, length)
        first_key = int(layout.sample_start[:, start].min())  # no query of the block sees a key before it
        rows, seen = slice(start, end), slice(first_key, end)
        block_q, block_dout = q_g[:, :, :, rows], dout_g[:, :, :, rows]
        keys, values = prefix_keys[:, :, seen], prefix_values[:, :, seen]
        c_keys, c_values = chain_keys[:, :, rows], chain_values[:, :, rows]
        probs = _block_probs(block_q, keys, c_keys, layout.documents, start, first_key, scale)
        prefix = end - first_key
        flat = (batch, kv_heads, group * (end - start))
        # dP over [prefix keys ; chain keys], then dS = P * (dP - rowsum(dO * O)), scaled as the scores were.
        d_scores = torch.cat(
            [
                (block_dout.reshape(*flat, head_dim) @ values.transpose(-1, -2)).view(*block_q.shape[:-1], prefix),
                torch.einsum("bkgcd,bkcsd->bkgcs", block_dout, c_values),
            ],
            dim=-1,
        )
        d_scores.sub_((block_dout * out_g[:, :, :, rows]).sum(-1, keepdim=True)).mul_(probs).mul_(scale)
        d_prefix, d_chain = d_scores[..., :prefix], d_scores[..., prefix:]
        dq[:, :, :, rows] = (d_prefix.reshape(*flat, prefix) @ keys).view_as(block_q) + torch.einsum(
            "bkgcs,bkcsd->bkgcd", d_chain, c_keys
        )
        d_prefix_keys[:, :, seen] += d_prefix.reshape(*flat, prefix).transpose(-1, -2) @ block_q.reshape(*flat, head_dim)
        d_prefix_values[:, :, seen] += (
            probs[..., :prefix].reshape(*flat, prefix).transpose(-1, -2) @ block_dout.reshape(*flat, head_dim)
        )
        # A chain key of position t is seen by position t's queries only: its gradient sums over the head group.
        d_chain_keys[:, :, rows] = torch.einsum("bkgcs,bkgcd->bkcsd", d_chain, block_q)
        d_chain_values[:, :, rows] = torch.einsum("bkgcs,bkgcd->bkcsd", probs[..., prefix:], block_dout)
    d_keys = torch.cat([d_prefix_keys, _unchain(d_chain_keys)], dim=2)
    d_values = torch.cat([d_prefix_values, _unchain(d_chain_values)], dim=2)
    return dq.view_as(q), d_keys, d_values


def _chain(all_keys: torch.Tensor, length: int) -> torch.Tensor:
    """Keys of steps 1..k laid end to end [B, kv, k*L, D] -> by position [B, kv, L, k, D]."""
    batch, kv_heads, total, head_dim = all_keys.shape
    return all_keys[:, :, length:].view(batch, kv_heads, total // length - 1, length, head_dim).transpose(2, 3)


def _unchain(chain: torch.Tensor) -> torch.Tensor:
    """The inverse of `_chain`: [B, kv, L, k, D] -> [B, kv, k*L, D]."""
    batch, kv_heads, _, _, head_dim = chain.shape
    return chain.transpose(2, 3).reshape(batch, kv_heads, -1, head_dim)


def _stack_chain(keys: Sequence[torch.Tensor]) -> torch.Tensor:
    """Keys of steps 0..k, each [B, kv, L, D] -> those of steps 1..k by position [B, kv, L, k, D] (fp32)."""
    if len(keys) == 1:
        batch, kv_heads, length, head_dim = keys[0].shape
        return keys[0].new_zeros(batch, kv_heads, length, 0, head_dim, dtype=torch.float32)
    return torch.stack([k.float() for k in keys[1:]], dim=3)


# --- blocked: plain tensor ops per block of query positions -----------------------------------------------------


def blocked_ttt_attention(
    q, keys, values, layout: TTTLayout, chunk_tokens: int = CHUNK_TOKENS, checkpointed: bool = False
) -> torch.Tensor:
    """Scores exist for one block of `chunk_tokens` query positions at a time ([B, h, chunk, <=L], never
    [B, h, L, L]); a block reads only the step-0 keys its queries may see."""
    batch, num_heads, length, head_dim = q.shape
    kv_heads = keys[0].shape[1]
    # GQA without copying keys: query head i reads kv head i // group, so group the query heads under their kv head.
    grouped_q = q.float().view(batch, kv_heads, num_heads // kv_heads, length, head_dim)
    step0_keys, step0_values = keys[0].float(), values[0].float()
    chain_keys, chain_values = _stack_chain(keys), _stack_chain(values)  # [B, kv, L, k, D]
    blocks = []
    for start in range(0, length, chunk_tokens):
        end = min(start + chunk_tokens, length)
        first_key = int(layout.sample_start[:, start].min())  # no query of the block sees a key before it
        blocks.append(
            maybe_checkpoint(
                checkpointed,
                _attention_block,
                grouped_q[:, :, :, start:end],
                step0_keys[:, :, first_key:end],
                step0_values[:, :, first_key:end],
                chain_keys[:, :, start:end],
                chain_values[:, :, start:end],
                layout.documents,
                start,
                first_key,
            )
        )
    return torch.cat(blocks, dim=3).reshape(batch, num_heads, length, head_dim).to(q.dtype)


def _attention_block(q, prefix_keys, prefix_values, chain_keys, chain_values, documents, start, first_key):
    """q [B,kv,g,C,D] for positions start..start+C-1; prefix keys/values [B,kv,n,D] for positions
    first_key..start+C-1; chain keys/values [B,kv,C,k,D]. -> [B,kv,g,C,D]."""
    batch, kv_heads, group, block, head_dim = q.shape
    probs = _block_probs(q, prefix_keys, chain_keys, documents, start, first_key, head_dim**-0.5)
    prefix = prefix_keys.shape[2]
    out = probs[..., :prefix].reshape(batch, kv_heads, group * block, prefix) @ prefix_values
    return out.view_as(q) + torch.einsum("bkgcs,bkcsd->bkgcd", probs[..., prefix:], chain_values)


def _block_probs(q, prefix_keys, chain_keys, documents, start: int, first_key: int, scale: float) -> torch.Tensor:
    """Softmax over [step-0 keys first_key..end-1 (causal, same sample) ; chain keys] of the queries at positions
    start..end-1. q [B,kv,g,C,D]; prefix_keys [B,kv,n,D]; chain_keys [B,kv,C,k,D] -> [B,kv,g,C,n+k]."""
    batch, kv_heads, group, block, head_dim = q.shape
    prefix = prefix_keys.shape[2]
    scores = (q.reshape(batch, kv_heads, group * block, head_dim) @ prefix_keys.transpose(-1, -2)).mul_(scale)
    query_position = torch.arange(start, start + block, device=q.device)
    key_position = torch.arange(first_key, first_key + prefix, device=q.device)
    same_sample = documents[:, first_key : first_key + prefix][:, None, :] == documents[:, start : start + block, None]
    visible = (key_position[None, :] <= query_position[:, None]) & same_sample  # [B, C, n]
    scores = scores.view(batch, kv_heads, group, block, prefix).masked_fill(~visible[:, None, None], float("-inf"))
    chain_scores = torch.einsum("bkgcd,bkcsd->bkgcs", q, chain_keys).mul_(scale)
    return torch.cat([scores, chain_scores], dim=-1).softmax(dim=-1)


def maybe_checkpoint(checkpointed: bool, function, *args):
    """function(*args), recomputed in backward instead of keeping its intermediates when `checkpointed`."""
    if checkpointed and torch.is_grad_enabled():
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
    return function(*args)
