"""What the extraction driver (extract/run.py) hands every worker (extract/worker.py): one typed record, written
into Ray Train's `train_loop_config` by `to_loop_config` and read back by `from_loop_config` (draftline.records);
and what an online target actor (extract/online.py) is built from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from draftline.config import DraftlineConfig
from draftline.faults import Fault
from draftline.records import WorkerJob


@dataclass(frozen=True)
class SplitAssignment:
    """One split the workers extract: where its shards go and its tokens in Ray's object store."""

    split: str
    location: str  # the split's shard storage (extract.storage.Storage)
    split_tokens_ref: Any  # ObjectRef of the split's extract.worker.SplitTokens


@dataclass(frozen=True)
class ExtractionJob(WorkerJob):
    KEY = "extraction_job"
    cfg: DraftlineConfig
    plan: dict  # extract.run.capture_plan, plus samples_per_shard and shard_metadata
    splits: list[SplitAssignment]
    fault: Optional[Fault] = None  # test-only (draftline.faults, point "extract.shards")
    storage_full_sink: Any = None  # the driver's StorageFullSink actor: a full disk is reported, not retried


@dataclass(frozen=True)
class CaptureJob:
    """What one online target actor (extract.online.TargetCapture) runs on, for one training rank's stream."""

    cfg: DraftlineConfig
    plan: dict  # extract.run.capture_plan
    split_tokens_refs: dict  # split code (extract.online.TRAIN / VAL) -> ObjectRef of its SplitTokens
    cursor: Any  # the StreamCursor actor: where a resumed rank starts
    rank: int
    fault: Optional[Fault] = None  # test-only (draftline.faults, point "online.batches")
