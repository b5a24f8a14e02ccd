"""What a training worker reads: hidden-state samples in the training order (train/order.py), and the frozen target
head.

Frozen target head. The drafter's input embeddings come from the target's embedding and its training targets from
the target's lm_head over `final_hidden`; only those two matrices are read from the target's safetensors (not the
whole model).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from draftline.extract.shards import HiddenStateShards
from draftline.train.order import sample_indices_for_step, val_indices_for_rank

EMBED_NAMES = ("model.embed_tokens.weight", "embed_tokens.weight", "model.language_model.embed_tokens.weight")
LM_HEAD_NAMES = ("lm_head.weight", "model.lm_head.weight")
FINAL_NORM_NAMES = ("model.norm.weight", "norm.weight", "model.language_model.norm.weight")
VOCAB_CHUNK = 16384  # target ids per block of target logits: [B*L, 16384] fp32 is 128 MiB at 2K tokens


class ShardSamples:
    """A training worker's samples from hidden-state shards (offline mode). The online stream
    (`draftline.train.stream.StreamReader`) hands out the same samples in the same micro-batches."""

    def __init__(self, train_location: str, val_location: str, rank: int, world_size: int, micro_batch_size: int,
                 seed: int):
        self.train = HiddenStateShards(train_location)
        self.val = HiddenStateShards(val_location)
        self.shard_sizes = [s["samples"] for s in self.train.manifest["shards"]]
        self.rank, self.world_size, self.micro_batch_size, self.seed = rank, world_size, micro_batch_size, seed

    def train_samples(self, step: int) -> list[dict]:
        """The micro-batch of 0-based `step`."""
        indices = sample_indices_for_step(step, self.rank, self.world_size, self.micro_batch_size, self.shard_sizes, self.seed)
        return [self.train[i] for i in indices]

    def val_batches(self, step: int):
        """The rank's val slice in micro-batches (the same after every step)."""
        indices = list(val_indices_for_rank(len(self.val), self.rank, self.world_size))
        for start in range(0, len(indices), self.micro_batch_size):
            yield [self.val[i] for i in indices[start : start + self.micro_batch_size]]


@dataclass
class Batch:
    """Right-padded rows. input_ids/loss_mask/attention_mask [B, L]; aux_hidden [B, L, n_aux*H]; final_hidden [B, L, H].

    Packed (`collate(..., packing=True)`): a row holds several samples one after another and document_ids [B, L] gives
    each position's sample index within its row (-1 for padding); unpacked, document_ids is None (one sample a row).
    `unpacked_slots`: the positions (rows x length) the same samples take one per row, for the padding figures."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    attention_mask: torch.Tensor
    aux_hidden: torch.Tensor
    final_hidden: torch.Tensor
    document_ids: torch.Tensor | None = None
    unpacked_slots: int | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    @property
    def num_slots(self) -> int:
        """Positions computed: rows x row length, padding included."""
        return self.attention_mask.numel()

    def to(self, device: torch.device | str, dtype: torch.dtype) -> "Batch":
        return Batch(
            input_ids=self.input_ids.to(device),
            loss_mask=self.loss_mask.to(device),
            attention_mask=self.attention_mask.to(device),
            aux_hidden=self.aux_hidden.to(device, dtype),
            final_hidden=self.final_hidden.to(device, dtype),
            document_ids=None if self.document_ids is None else self.document_ids.to(device),
            unpacked_slots=self.unpacked_slots,
        )


def pack_rows(lengths: Sequence[int], row_tokens: int | None = None) -> list[list[int]]:
    """Sample indices per row: first fit, longest sample first, into rows of max(row_tokens, longest) tokens
    (None: the longest sample, so a packed batch is never longer than the padded one). Deterministic."""
    capacity = max([*lengths, row_tokens or 0])
    rows: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        row = next((r for r, free in enumerate(room) if free >= lengths[index]), None)
        if row is None:
            rows.append([])
            room.append(capacity)
            row = len(rows) - 1
        rows[row].append(index)
        room[row] -= lengths[index]
    return rows


def collate(samples: Sequence[dict], packing: bool = False, row_tokens: int | None = None) -> Batch:
    """Per-sample dicts (HiddenStateShards items) -> a right-padded Batch (pad id 0, masks 0, states 0): one sample
    a row, or with `packing` several samples a row (`pack_rows`)."""
    if not samples:
        raise ValueError("collate: no samples")
    lengths = [len(s["input_ids"]) for s in samples]
    rows = pack_rows(lengths, row_tokens) if packing else [[i] for i in range(len(samples))]
    longest = max(sum(lengths[i] for i in row) for row in rows)
    first = samples[0]
    input_ids = torch.zeros(len(rows), longest, dtype=torch.int64)
    loss_mask = torch.zeros(len(rows), longest, dtype=torch.bool)
    attention_mask = torch.zeros(len(rows), longest, dtype=torch.bool)
    document_ids = torch.full((len(rows), longest), -1, dtype=torch.int64)
    aux_hidden = first["aux_hidden"].new_zeros(len(rows), longest, first["aux_hidden"].shape[-1])
    final_hidden = first["final_hidden"].new_zeros(len(rows), longest, first["final_hidden"].shape[-1])
    for row, indices in enumerate(rows):
        start = 0
        for document, index in enumerate(indices):
            sample, end = samples[index], start + lengths[index]
            input_ids[row, start:end] = sample["input_ids"]
            loss_mask[row, start:end] = sample["loss_mask"].bool()
            attention_mask[row, start:end] = True
            document_ids[row, start:end] = document
            aux_hidden[row, start:end] = sample["aux_hidden"]
            final_hidden[row, start:end] = sample["final_hidden"]
            start = end
    return Batch(
        input_ids, loss_mask, attention_mask, aux_hidden, final_hidden,
        document_ids=document_ids if packing else None, unpacked_slots=len(samples) * max(lengths),
    )


class TargetHead:
    """The target's frozen token embedding [Vt, H] and lm_head [Vt, H], read alone from its safetensors, and its
    final norm's weight [H] (None when the weights have none under a known name)."""

    def __init__(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                 final_norm_weight: torch.Tensor | None = None):
        if embed_weight.shape != lm_head_weight.shape:
            raise ValueError(
                f"target embedding {tuple(embed_weight.shape)} and lm_head {tuple(lm_head_weight.shape)} differ in shape"
            )
        self.embed_weight = embed_weight
        self.lm_head_weight = lm_head_weight
        self.final_norm_weight = final_norm_weight

    @property
    def vocab_size(self) -> int:
        return self.embed_weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.embed_weight.shape[1]

    def to(self, device: torch.device | str, dtype: torch.dtype) -> "TargetHead":
        norm = self.final_norm_weight.to(device, dtype) if self.final_norm_weight is not None else None
        return TargetHead(self.embed_weight.to(device, dtype), self.lm_head_weight.to(device, dtype), norm)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(input_ids, self.embed_weight)

    def logits(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """Full target logits [..., Vt] from the target's final (normed) hidden state, computed in fp32."""
        return final_hidden.float() @ self.lm_head_weight.float().t()

    def draft_signals(
        self, final_hidden: torch.Tensor, t2d: torch.Tensor, vocab_chunk: int = VOCAB_CHUNK
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`target_signals(self.logits(final_hidden), t2d)` without the full-vocab logits: fp32 logits over the draft
        vocab [..., Vd] and the full-vocab argmax [...], computed `vocab_chunk` target ids at a time (a [B, L, 128K]
        fp32 tensor is 1 GiB per 2K tokens)."""
        hidden32 = final_hidden.float()
        t2d = t2d.bool()
        draft_logits = hidden32.new_empty(*final_hidden.shape[:-1], int(t2d.sum()))
        best = hidden32.new_full(final_hidden.shape[:-1], float("-inf"))
        best_ids = torch.zeros(final_hidden.shape[:-1], dtype=torch.int64, device=final_hidden.device)
        filled = 0
        for start in range(0, self.vocab_size, vocab_chunk):
            logits = hidden32 @ self.lm_head_weight[start : start + vocab_chunk].float().t()
            chunk_best, chunk_ids = logits.max(dim=-1)
            better = chunk_best > best  # strict: a tie keeps the lower id, as argmax over the full vocab does
            best = torch.where(better, chunk_best, best)
            best_ids = torch.where(better, chunk_ids + start, best_ids)
            in_draft = t2d[start : start + vocab_chunk]
            taken = int(in_draft.sum())
            draft_logits[..., filled : filled + taken] = logits[..., in_draft]
            filled += taken
        return draft_logits, best_ids


def _weight_files(target_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, for a single-file or an index-sharded checkpoint."""
    index_path = target_dir / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text())["weight_map"]
        return {name: target_dir / file for name, file in weight_map.items()}
    files = sorted(target_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{target_dir} has no *.safetensors files: the trainer reads the target's embedding and lm_head from "
            "safetensors; convert the checkpoint (e.g. save_pretrained(..., safe_serialization=True))"
        )
    from safetensors import safe_open

    where: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                where[name] = path
    return where


def _read_tensor(where: dict[str, Path], candidates: Sequence[str]) -> torch.Tensor | None:
    from safetensors import safe_open

    for name in candidates:
        if name in where:
            with safe_open(str(where[name]), framework="pt") as handle:
                return handle.get_tensor(name)
    return None


def load_target_head(target_dir: str | Path) -> TargetHead:
    """Read embed_tokens and lm_head (the embedding again when tie_word_embeddings) from the target directory."""
    target_dir = Path(target_dir)
    hf_config = json.loads((target_dir / "config.json").read_text())
    where = _weight_files(target_dir)
    embed = _read_tensor(where, EMBED_NAMES)
    if embed is None:
        raise KeyError(f"{target_dir}: no token embedding among the weights (looked for {list(EMBED_NAMES)})")
    lm_head = _read_tensor(where, LM_HEAD_NAMES)
    if lm_head is None:
        if not hf_config.get("tie_word_embeddings", False):
            raise KeyError(
                f"{target_dir}: no lm_head among the weights (looked for {list(LM_HEAD_NAMES)}) and "
                "config.json does not set tie_word_embeddings"
            )
        lm_head = embed
    return TargetHead(embed, lm_head, _read_tensor(where, FINAL_NORM_NAMES))
