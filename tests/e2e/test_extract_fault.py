"""A worker killed mid-run: Ray Train restarts the group, the run resumes, every sample ends up exactly once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftline.data.prepare import load_split
from draftline.extract.run import FAULT_AFTER_SHARDS_ENV, FAULT_MARKER_ENV, extract_with_stats
from draftline.extract.shards import HiddenStateShards
from tests.conftest import make_test_config

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

SHARDS_BEFORE_DEATH = 3


def test_killed_worker_resumes_and_every_sample_is_written_once(ray_cluster, tiny_dataset_dir, tmp_path, monkeypatch):
    marker = tmp_path / "worker-died"
    monkeypatch.setenv(FAULT_AFTER_SHARDS_ENV, str(SHARDS_BEFORE_DEATH))
    monkeypatch.setenv(FAULT_MARKER_ENV, str(marker))
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
