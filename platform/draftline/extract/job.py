"""What the extraction driver (extract/run.py) hands every worker (extract/worker.py): one typed record, written
into Ray Train's `train_loop_config` by `to_loop_config` and read back by `from_loop_config`; and what an online
target actor (extract/online.py) is built from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from draftline.config import DraftlineConfig
from draftline.faults import Fault

LOOP_CONFIG_KEY = "extraction_job"


@dataclass(frozen=True)
class SplitAssignment:
    """One split the workers extract: where its shards go and its tokens in Ray's object store."""

    split: str
    location: str  # the split's shard storage (extract.storage.Storage)
    split_tokens_ref: Any  # ObjectRef of the split's extract.worker.SplitTokens


@dataclass(frozen=True)
class ExtractionJob:
    cfg: DraftlineConfig
    plan: dict  # extract.run.capture_plan, plus samples_per_shard and shard_metadata
    splits: list[SplitAssignment]
    fault: Optional[Fault] = None  # test-only (draftline.faults, point "extract.shards")
    storage_full_sink: Any = None  # the driver's StorageFullSink actor: a full disk is reported, not retried

    def to_loop_config(self) -> dict:
        return {LOOP_CONFIG_KEY: self}

    @staticmethod
    def from_loop_config(loop_config: dict) -> "ExtractionJob":
        job = loop_config.get(LOOP_CONFIG_KEY)
        if not isinstance(job, ExtractionJob):
            raise TypeError(f"train_loop_config holds {sorted(loop_config)}, not an ExtractionJob under "
                            f"{LOOP_CONFIG_KEY!r}: start extraction workers with ExtractionJob.to_loop_config()")
        return job


@dataclass(frozen=True)
class CaptureJob:
    """What one online target actor (extract.online.TargetCapture) runs on, for one training rank's stream."""

    cfg: DraftlineConfig
    plan: dict  # extract.run.capture_plan
    split_tokens_refs: dict  # split code (extract.online.TRAIN / VAL) -> ObjectRef of its SplitTokens
    cursor: Any  # the StreamCursor actor: where a resumed rank starts
    rank: int
    fault: Optional[Fault] = None  # test-only (draftline.faults, point "online.batches")
