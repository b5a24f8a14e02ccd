"""What the training driver (train/run.py) hands every worker (train/loop.py): one typed record, written into Ray
Train's `train_loop_config` by `to_loop_config` and read back by `from_loop_config` (draftline.records)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from draftline.config import DraftlineConfig
from draftline.drafter.model import DrafterConfig
from draftline.faults import Fault
from draftline.records import WorkerJob


@dataclass(frozen=True)
class OnlineStream:
    """extract.mode=online: the worker reads its rank's stream of the target's states (train/stream.py)."""

    cursor: Any  # the StreamCursor actor (extract/online.py)
    shard_sizes: list[int]  # of the train split, as offline extraction would write it: the order is over them
    num_val_samples: int


@dataclass(frozen=True)
class TrainingJob(WorkerJob):
    KEY = "training_job"
    cfg: DraftlineConfig
    target_dir: str
    d2t: torch.Tensor  # draft vocab -> target vocab offsets
    t2d: torch.Tensor  # target vocab -> in the draft vocab
    drafter_config: DrafterConfig
    tracking_uri: str
    run_id: str  # the MLflow run rank 0 logs into
    train_location: Optional[str] = None  # offline: the shards' split directories
    val_location: Optional[str] = None
    online: Optional[OnlineStream] = None
    fault: Optional[Fault] = None  # test-only (draftline.faults, point "train.step")
    checkpoint_location: str = ""  # where the ranks write a checkpoint's files before reporting it
    storage_full_sink: Any = None  # the driver's StorageFullSink actor: a full disk is reported, not retried

    def with_run(self, checkpoint_location: str, storage_full_sink: Any, online: Optional[OnlineStream]) -> "TrainingJob":
        """What only exists once the worker group is about to start."""
        return replace(self, checkpoint_location=checkpoint_location, storage_full_sink=storage_full_sink, online=online)
