"""A worker killed mid-run: Ray Train restarts the group, the run resumes, every sample ends up exactly once.
A full disk: no restart, one clear line."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from draftline.data.prepare import load_split
from draftline import faults
from draftline.extract.run import extract_with_stats
from draftline.extract.shards import HiddenStateShards
from draftline.utils import StorageFullError
from tests.conftest import make_test_config


SHARDS_BEFORE_DEATH = 3


def test_killed_worker_resumes_and_every_sample_is_written_once(ray_cluster, tiny_dataset_dir, tmp_path, monkeypatch):
    marker = tmp_path / "worker-died"
    monkeypatch.setenv(faults.ENV, faults.encode(faults.Fault("extract.shards", SHARDS_BEFORE_DEATH, str(marker))))
    cfg = make_test_config(extra=[
        f"extract.storage_uri={tmp_path / 'hidden'}",
        "extract.num_workers=2",
        "extract.samples_per_shard=8",
        "extract.max_failures=2",
    ])
    result = extract_with_stats(cfg, tiny_dataset_dir, split="train")

    assert marker.exists(), "the fault hook did not fire: the test would prove nothing"
    died_at_unix = marker.stat().st_mtime
    split_dir = Path(result.location) / "train"
    shards = HiddenStateShards(split_dir)
    shards.verify()
    samples = load_split(tiny_dataset_dir, "train")
    assert len(shards) == len(samples)
    seen = [shards[i]["sample_index"] for i in range(len(shards))]
    assert sorted(seen) == list(range(len(samples))) and len(set(seen)) == len(seen)
    for index in (0, len(samples) // 2, len(samples) - 1):
        assert shards[index]["input_ids"].tolist() == samples[index]["input_ids"]

    # Shards finished before the kill were kept (not rewritten by the retry); the retry wrote the rest.
    records = [json.loads(p.read_text()) for p in sorted(split_dir.glob("shard-*.json"))]
    before_kill = [r for r in records if r["finished_unix"] <= died_at_unix]
    after_kill = [r for r in records if r["finished_unix"] > died_at_unix]
    assert len(before_kill) >= SHARDS_BEFORE_DEATH
    assert after_kill, "the retried worker group wrote nothing"
    assert not list(split_dir.glob(".*.tmp")), "temp files of the killed writer must be cleaned up"


def _train_worker_actors() -> int:
    import ray
    from ray.util.state import list_actors

    return len(list_actors(address=ray.get_runtime_context().gcs_address, limit=10_000,
                           filters=[("class_name", "=", "RayTrainWorker")]))


def test_a_full_disk_fails_at_once_without_retries(ray_cluster, tiny_dataset_dir, one_mb_tmpfs):
    """Fault 13: ENOSPC made Ray Train retry the group extract.max_failures=3 times (61 s), the message buried in a
    traceback. Now one worker group, one line naming the file, the free space and the fix."""
    cfg = make_test_config(extra=[
        f"extract.storage_uri={one_mb_tmpfs / 'hidden'}",
        "extract.num_workers=1",
        "extract.samples_per_shard=8",
        "extract.max_failures=3",
    ])
    workers_before = _train_worker_actors()
    started = time.monotonic()
    with pytest.raises(StorageFullError) as raised:
        extract_with_stats(cfg, tiny_dataset_dir, split="train")
    wall_s = time.monotonic() - started
    print(f"full disk reported after {wall_s:.1f} s: {raised.value}")
    message = str(raised.value)
    assert "\n" not in message
    assert re.match(rf"cannot write {one_mb_tmpfs}/hidden/\w+/train/shard-\d+\.safetensors: No space left on device "
                    r"\(\d+\.\d MB free there\); free space or point data_dir \(or extract.storage_uri\)", message)
    assert _train_worker_actors() - workers_before == 1, "Ray Train started the worker group more than once"
