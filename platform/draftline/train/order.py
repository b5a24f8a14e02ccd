"""The training order: which samples each rank trains on at each step, and after which steps it validates and
checkpoints. The shard reader (train/data.py), the online stream (its rows, streamed by extract/online.py, and their
reader, train/stream.py) and the loop all follow it.

Sample order. Global step s consumes world_size * micro_batch_size sample positions; position p belongs to epoch
p // N and is sample order_e[p % N] of that epoch. Rank r takes positions s*W*B + r*B .. + B. The order is a
function of (seed, step, rank, world size) only, so a worker restarted from a checkpoint at step s reads exactly what
it would have read without the failure: the checkpoint stores the step, not an iterator.
order_e shuffles the shards, then the samples inside each shard (seeded per epoch): consecutive positions come from
the same shard, so a worker loads each shard about once per epoch instead of once per sample (shards are tens of MB
to GB; the reader keeps one in memory).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from draftline.extract.online import TRAIN, VAL


def epoch_order(shard_sizes: Sequence[int], epoch: int, seed: int) -> torch.Tensor:
    """Sample ids of one epoch: shards in a seeded random order, samples shuffled within each shard."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    starts = [0]
    for size in shard_sizes:
        starts.append(starts[-1] + size)
    pieces = []
    for shard in torch.randperm(len(shard_sizes), generator=generator).tolist():
        pieces.append(starts[shard] + torch.randperm(shard_sizes[shard], generator=generator))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)


def sample_indices_for_step(
    step: int, rank: int, world_size: int, micro_batch_size: int, shard_sizes: Sequence[int], seed: int,
    orders: dict[int, torch.Tensor] | None = None,
) -> list[int]:
    """Sample ids rank `rank` trains on at `step` (0-based); see the module docstring for the order. `orders` caches
    epoch orders across calls (epoch -> order) for a caller that walks many steps."""
    num_samples = sum(shard_sizes)
    if num_samples < 1:
        raise ValueError("the train split has no samples: extract hidden states for a non-empty train split")
    first = (step * world_size + rank) * micro_batch_size
    indices = []
    orders = {} if orders is None else orders
    for position in range(first, first + micro_batch_size):
        epoch = position // num_samples
        if epoch not in orders:
            orders[epoch] = epoch_order(shard_sizes, epoch, seed)
        indices.append(int(orders[epoch][position % num_samples]))
    return indices


def val_indices_for_rank(num_samples: int, rank: int, world_size: int) -> range:
    """A contiguous slice per rank (few shard loads); every sample is seen exactly once per validation."""
    return range(rank * num_samples // world_size, (rank + 1) * num_samples // world_size)


def is_checkpoint_step(step: int, train_cfg: Any) -> bool:
    """`step` counts finished optimizer steps (1-based)."""
    return step % train_cfg.checkpoint_every == 0 or step == train_cfg.max_steps


def is_validation_step(step: int, train_cfg: Any) -> bool:
    return step % train_cfg.val_every == 0 or is_checkpoint_step(step, train_cfg)


def rank_stream_rows(
    rank: int, world_size: int, train_cfg, shard_sizes: Sequence[int], num_val_samples: int, seed: int
) -> list[dict]:
    """Every row rank `rank` consumes in a run, in order. `step` is the 1-based optimizer step a train row is
    trained at, or the step after which a val row is validated (val rows follow that step's train rows)."""
    val_indices = list(val_indices_for_rank(num_val_samples, rank, world_size))
    orders: dict = {}
    rows = []
    for step in range(1, train_cfg.max_steps + 1):
        indices = sample_indices_for_step(
            step - 1, rank, world_size, train_cfg.micro_batch_size, shard_sizes, seed, orders
        )
        rows.extend({"split": TRAIN, "step": step, "sample_index": i} for i in indices)
        if is_validation_step(step, train_cfg):
            rows.extend({"split": VAL, "step": step, "sample_index": i} for i in val_indices)
    return rows
