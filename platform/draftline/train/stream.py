"""A training worker's side of the online stream (extract/online.py): its rows in the training order, checked, as
the samples the shard reader hands out."""

from __future__ import annotations

import itertools
from typing import Iterator, Sequence

import numpy as np
import torch

from draftline.extract.online import PAYLOAD, TRAIN, VAL, from_wire
from draftline.train.order import sample_indices_for_step, val_indices_for_rank


class StreamOrderError(RuntimeError):
    """A training worker got other samples than the order says (a lost, repeated or reordered sample)."""


class StreamReader:
    """A training worker's side: takes its rows in order, checks them, and hands out samples as the shard reader
    does (`input_ids`, `loss_mask`, `aux_hidden`, `final_hidden` tensors), so collate and the loop are shared."""

    def __init__(self, iterator, rank: int, world_size: int, micro_batch_size: int, shard_sizes: Sequence[int],
                 num_val_samples: int, seed: int, dtype: str, prefetch_blocks: int):
        self.rank, self.world_size, self.micro_batch_size = rank, world_size, micro_batch_size
        self.shard_sizes, self.num_val_samples, self.seed, self.dtype = list(shard_sizes), num_val_samples, seed, dtype
        self._orders: dict = {}
        self._rows = self._iter_rows(
            iterator.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=prefetch_blocks)
        )
        self.bytes_received = 0
        self.tokens_received = 0

    @staticmethod
    def _iter_rows(batches) -> Iterator[dict]:
        for batch in batches:
            for row in range(len(batch["step"])):
                yield {name: column[row] for name, column in batch.items()}

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_received / self.tokens_received if self.tokens_received else 0.0

    def _take(self, split: int, step: int, expected: Sequence[int]) -> list[dict]:
        rows = list(itertools.islice(self._rows, len(expected)))
        got = [(int(r["split"]), int(r["step"]), int(r["sample_index"])) for r in rows]
        want = [(split, step, int(i)) for i in expected]
        if got != want:
            raise StreamOrderError(
                f"rank {self.rank}: the online stream gave {got[:4]}... ({len(got)} rows) where the training order "
                f"says {want[:4]}... ({len(want)} rows) as (split, step, sample); a sample was lost, repeated or "
                "reordered: the stream must run with preserve_order and the cursor set before reading"
            )
        samples = []
        for row in rows:
            self.bytes_received += sum(row[name].nbytes for name in PAYLOAD)
            self.tokens_received += len(row["input_ids"])
            samples.append({
                "input_ids": torch.from_numpy(np.array(row["input_ids"])),
                "loss_mask": torch.from_numpy(np.array(row["loss_mask"])),
                "aux_hidden": from_wire(row["aux_hidden"], self.dtype),
                "final_hidden": from_wire(row["final_hidden"], self.dtype),
                "sample_index": int(row["sample_index"]),
            })
        return samples

    def train_samples(self, step: int) -> list[dict]:
        """The micro-batch of 0-based `step` (what ShardSamples.train_samples reads from shards)."""
        expected = sample_indices_for_step(
            step, self.rank, self.world_size, self.micro_batch_size, self.shard_sizes, self.seed, self._orders
        )
        return self._take(TRAIN, step + 1, expected)

    def val_batches(self, step: int) -> Iterator[list[dict]]:
        """The rank's val slice after (1-based) `step`, in micro-batches (what ShardSamples.val_batches reads)."""
        indices = list(val_indices_for_rank(self.num_val_samples, self.rank, self.world_size))
        for start in range(0, len(indices), self.micro_batch_size):
            yield self._take(VAL, step, indices[start : start + self.micro_batch_size])
