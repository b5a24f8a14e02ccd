"""The running rows' KV state: the target's batched HF cache and the drafter's preallocated cache, row b of each the
same request, and the target forward over them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from draftline.drafter.model import attend


@torch.no_grad()
def target_forward(
    model,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cache,
    aux_layer_ids: Optional[list[int]],
    attention_mask: Optional[torch.Tensor | dict[str, torch.Tensor]] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Target forward with KV cache -> (logits [B, T, V], aux states [B, T, n_aux*H] or None). attention_mask: one
    additive mask [B, 1, T, S + T], or one per layer type (config.layer_types) for targets with sliding windows.

    The aux states are exactly what `draftline.target.capture.capture_aux_hidden` feeds the drafter
    (`hidden_states[i + 1]` per aux layer id i, concatenated in order); tests pin the two together.
    """
    outputs = model.base_model(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=aux_layer_ids is not None,
        return_dict=True,
    )
    logits = model.lm_head(outputs.last_hidden_state)
    aux = None
    if aux_layer_ids is not None:
        aux = torch.cat([outputs.hidden_states[layer_id + 1] for layer_id in aux_layer_ids], dim=-1)
    return logits, aux


def batchable_cache(cache) -> bool:
    """Whether the HF cache is made of key/value layers [B, heads, S, D], full attention or a sliding window (Llama,
    Qwen3, MoE, MLA, Gemma 3, gpt-oss as transformers implements them): those can share one batched cache with slot
    masks (TargetBatch). Anything else (linear-attention or chunked layers) runs one sequence per batch."""
    return all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in getattr(cache, "layers", [None]))


def pad_slots(x: torch.Tensor, width: int) -> torch.Tensor:
    """Pad dim 2 (keys/values [B, heads, S, D]) or dim 1 (valid, positions [B, S]) with zeros/False up to width."""
    dim = 2 if x.dim() == 4 else 1
    missing = width - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def attention_windows(config) -> dict[str, tuple[list[int], Optional[int]]]:
    """The target's layers by attention kind (config.layer_types, all "full_attention" without it) ->
    (layer indices, window): `sliding_window` tokens for "sliding_attention" layers, None (every earlier token) else."""
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    windows: dict[str, tuple[list[int], Optional[int]]] = {}
    for layer_id, layer_type in enumerate(layer_types):
        window = config.sliding_window if layer_type == "sliding_attention" else None
        windows.setdefault(layer_type, ([], window))[0].append(layer_id)
    return windows


@dataclass
class SlotGroup:
    """The KV slots of the layers of one attention kind: valid [B, S] marks the slots of committed tokens, positions
    [B, S] their positions. A query at position q sees a slot at position k when k > q - window (HF's and vLLM's
    sliding window, the query itself included), so a windowed group drops the slots no later query can see."""

    layer_ids: list[int]
    window: Optional[int]  # None: full attention
    valid: torch.Tensor
    positions: torch.Tensor

    def allowed(self, positions: torch.Tensor, new_allowed: torch.Tensor) -> torch.Tensor:
        """Which slots and new tokens each new token (positions [B, T]) sees: [B, T, S + T]."""
        batch, length = positions.shape
        allowed = torch.cat([self.valid[:, None, :].expand(batch, length, -1), new_allowed], dim=-1)
        if self.window is None:
            return allowed
        keys = torch.cat([self.positions, positions], dim=1)
        return allowed & (keys[:, None, :] > positions[:, :, None] - self.window)

    def reachable(self) -> torch.Tensor:
        """valid, less the slots a window has left behind: the next query of a row is past its last cached token."""
        if self.window is None:
            return self.valid
        next_position = torch.where(self.valid, self.positions, -1).max(dim=1, keepdim=True).values + 1
        return self.valid & (self.positions > next_position - self.window)


class TargetBatch:
    """The target KV cache of running sequences: one HF DynamicCache of plain layers, one row per sequence, and a
    SlotGroup per attention kind (full, sliding window) marking which slots its layers' rows hold. A verify appends
    T slots to every row; the slots of rejected drafts stay invalid (masked) instead of being cropped, and `compact`
    packs every row's valid slots to the left once a column is unused by every row of a group (a windowed group also
    drops the slots its window has passed). Positions are per row (RoPE is applied before caching), so a slot's index
    need not equal its position."""

    def __init__(self) -> None:
        self.cache = None
        self.groups: dict[str, SlotGroup] = {}  # by layer type, as the model's forward takes its masks

    @classmethod
    def empty(cls, config, rows: int, device) -> "TargetBatch":
        batch = cls()
        batch.cache = DynamicCache(config=config)
        # HF's window layers crop to the last window-1 tokens on update; the slot groups do the windowing instead.
        batch.cache.layers = [DynamicLayer() if type(layer) is DynamicSlidingWindowLayer else layer for layer in batch.cache.layers]
        no_slots = torch.zeros(rows, 0, dtype=torch.bool, device=device)
        batch.groups = {layer_type: SlotGroup(layer_ids, window, no_slots, no_slots.long())
                        for layer_type, (layer_ids, window) in attention_windows(config).items()}  # fmt: skip
        return batch

    @property
    def rows(self) -> int:
        return 0 if self.cache is None else next(iter(self.groups.values())).valid.shape[0]

    def _layers(self, group: SlotGroup):
        return [self.cache.layers[layer_id] for layer_id in group.layer_ids]

    def add(self, other: "TargetBatch") -> None:
        """Append the rows of another batch (freshly prefilled) after the existing rows."""
        if self.cache is None:
            self.cache, self.groups = other.cache, other.groups
            return
        for layer_type, group in self.groups.items():
            theirs = other.groups[layer_type]
            width = max(group.valid.shape[1], theirs.valid.shape[1])
            for mine, their_layer in zip(self._layers(group), other._layers(theirs)):
                mine.keys = torch.cat([pad_slots(mine.keys, width), pad_slots(their_layer.keys, width)])
                mine.values = torch.cat([pad_slots(mine.values, width), pad_slots(their_layer.values, width)])
            group.valid = torch.cat([pad_slots(group.valid, width), pad_slots(theirs.valid, width)])
            group.positions = torch.cat([pad_slots(group.positions, width), pad_slots(theirs.positions, width)])

    def keep_rows(self, rows: list[int]) -> None:
        if not rows:
            self.cache, self.groups = None, {}
            return
        index = torch.tensor(rows, device=next(iter(self.groups.values())).valid.device)
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys.index_select(0, index), layer.values.index_select(0, index)
        for group in self.groups.values():
            group.valid, group.positions = group.valid.index_select(0, index), group.positions.index_select(0, index)

    def forward(self, model, ids, positions, new_allowed, aux_layer_ids):
        """Every row's new tokens [B, T] at positions [B, T] in one forward; row b sees its valid slots and
        new_allowed[b] [T, T], within each layer's window."""
        dtype = model.dtype
        masks = {}
        for layer_type, group in self.groups.items():
            allowed = group.allowed(positions, new_allowed)
            masks[layer_type] = torch.zeros(allowed.shape, dtype=dtype, device=ids.device).masked_fill(
                ~allowed, torch.finfo(dtype).min)[:, None]  # fmt: skip
            group.valid = pad_slots(group.valid, group.valid.shape[1] + ids.shape[1])
            group.positions = torch.cat([group.positions, positions], dim=1)
        # One kind of attention: the plain mask every HF decoder takes; several: one per layer type, as the models
        # with config.layer_types (Gemma 3, gpt-oss, Qwen3) take them.
        mask = next(iter(masks.values())) if len(masks) == 1 and not self._windowed() else masks
        return target_forward(model, ids, positions, self.cache, aux_layer_ids, mask)

    def _windowed(self) -> bool:
        return any(group.window is not None for group in self.groups.values())

    def commit(self, kept: torch.Tensor) -> None:
        """Mark the slots of the last forward whose tokens are committed: kept [B, T] bool over its T new tokens."""
        for group in self.groups.values():
            group.valid[:, group.valid.shape[1] - kept.shape[1] :] = kept.to(group.valid.device)

    def compact(self) -> None:
        for group in self.groups.values():
            reachable = group.reachable()
            counts = reachable.sum(dim=1)
            width = int(counts.max())
            if width == group.valid.shape[1]:
                continue
            # stable sort puts each row's reachable slots first, in slot order
            order = torch.sort((~reachable).to(torch.int8), dim=1, stable=True).indices[:, :width]
            for layer in self._layers(group):
                index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
                layer.keys = layer.keys.gather(2, index)
                index = order[:, None, :, None].expand(-1, layer.values.shape[1], -1, layer.values.shape[3])
                layer.values = layer.values.gather(2, index)
            group.positions = group.positions.gather(1, order)
            group.valid = torch.arange(width, device=counts.device)[None] < counts[:, None]


class DraftBatch:
    """The drafter's KV cache of running sequences, preallocated: keys/values [B, kv_heads, capacity, D].

    Slot s of a row holds the drafter's entry at position s, so a row's committed entries are its slots
    0..lengths[b]-1 and dropping rejected drafts is just a shorter length (no cropping, no copy). A forward writes
    its tokens' keys at their positions and a query at position p reads slots 0..p: committed entries, and the
    entries this round wrote before it (chain drafts, or the earlier tokens of an extend). Slots past a row's
    length are stale until the next forward overwrites them before anything reads them. `logits`/`hidden` [B, ...]
    are each row's drafter output at its last committed position, which drafts the next round's first token.
    Capacity doubles when a forward would run past it."""

    def __init__(self) -> None:
        self.keys: Optional[torch.Tensor] = None  # [B, kv_heads, capacity, D]
        self.values: Optional[torch.Tensor] = None
        self.lengths: list[int] = []
        self.logits: Optional[torch.Tensor] = None  # [B, Vd]
        self.hidden: Optional[torch.Tensor] = None  # [B, H]

    @property
    def rows(self) -> int:
        return len(self.lengths)

    def add(self, other: "DraftBatch") -> None:
        """Append other's rows after the existing ones."""
        if self.keys is None:
            vars(self).update(vars(other))
            return
        width = max(self.keys.shape[2], other.keys.shape[2])
        self.keys = torch.cat([pad_slots(self.keys, width), pad_slots(other.keys, width)])
        self.values = torch.cat([pad_slots(self.values, width), pad_slots(other.values, width)])
        self.lengths = self.lengths + other.lengths
        self.logits, self.hidden = torch.cat([self.logits, other.logits]), torch.cat([self.hidden, other.hidden])

    def keep_rows(self, rows: list[int]) -> None:
        if self.keys is None:
            return
        if not rows:
            vars(self).update(vars(DraftBatch()))
            return
        index = torch.tensor(rows, device=self.keys.device)
        self.keys, self.values = self.keys.index_select(0, index), self.values.index_select(0, index)
        self.logits, self.hidden = self.logits.index_select(0, index), self.hidden.index_select(0, index)
        self.lengths = [self.lengths[row] for row in rows]

    def forward(self, drafter, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """Drafter over new tokens of every row: embeds, hidden [B, T, H], positions [B, T] ->
        (logits [B, T, Vd], hidden_out [B, T, H]). Keys land in slot = position; query at p sees slots <= p."""
        layer = drafter.midlayer
        q, k, v = layer.project_qkv(embeds, hidden, positions)
        end = int(positions.max()) + 1
        self._reserve(end, like=k)
        index = positions[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        self.keys.scatter_(2, index, k)
        self.values.scatter_(2, index, v)
        allowed = torch.arange(end, device=positions.device)[None, None] <= positions[:, :, None]  # [B, T, end]
        attn = attend(q, self.keys[:, :, :end], self.values[:, :, :end], allowed[:, None])
        hidden_out = layer.finish(attn, residual=hidden)
        return drafter.logits(hidden_out), hidden_out

    def _reserve(self, slots: int, like: torch.Tensor) -> None:
        if self.keys is None:
            shape = (like.shape[0], like.shape[1], max(slots, 64), like.shape[3])
            self.keys, self.values = like.new_zeros(shape), like.new_zeros(shape)
        elif slots > self.keys.shape[2]:
            self.keys = pad_slots(self.keys, max(slots, 2 * self.keys.shape[2]))
            self.values = pad_slots(self.values, self.keys.shape[2])


@dataclass
class Caches:
    """Both KV caches of a set of sequences; row b of each is the same sequence."""

    target: TargetBatch = field(default_factory=TargetBatch)
    draft: DraftBatch = field(default_factory=DraftBatch)

    def add(self, other: "Caches") -> None:
        if other.target.rows == 0:
            return
        self.target.add(other.target)
        self.draft.add(other.draft)

    def keep_rows(self, rows: list[int]) -> None:
        self.target.keep_rows(rows)
        self.draft.keep_rows(rows)
