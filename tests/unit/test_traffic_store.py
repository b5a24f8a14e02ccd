"""The traffic store (shards, checksums, rotation, retention, purge), the drift window and `draftline traffic`:
plain files and Python, no Ray."""

from __future__ import annotations

import errno
import os
import shlex
import stat
import sys
import time

import pytest
import yaml

from draftline.cli import main
from draftline.commands.traffic import parse_duration_s
from draftline.config import ConfigError, load_config
from draftline.serving.drift import DriftMonitor
from draftline.serving.refresh_job import JOB_CONFIG_FILE, job_config, job_entrypoint
from draftline.serving.traffic_store import ShardWriter, purge, read_records, scan_store, shard_paths, trim_to_size


def _records(count: int, start: int = 0) -> list[dict]:
    return [{"id": f"r{i}", "messages": [{"role": "user", "content": "x" * 50}]} for i in range(start, start + count)]


def _writer(directory, shard_bytes=1 << 20, max_age_s=86400.0, max_total_bytes=1 << 30) -> ShardWriter:
    return ShardWriter(directory, shard_bytes, max_age_s, max_total_bytes)


def test_records_round_trip_in_owner_only_files_and_rotate_past_the_shard_size(tmp_path):
    directory = tmp_path / "traffic"
    writer = _writer(directory, shard_bytes=1024)
    for i in range(20):
        writer.append(_records(1, i))
    writer.close()
    assert [r["id"] for r in read_records(directory)] == [f"r{i}" for i in range(20)]
    shards = shard_paths(directory)
    assert len(shards) > 1, "no rotation past shard_bytes"
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert {stat.S_IMODE(p.stat().st_mode) for p in shards} == {0o600}
    assert all(p.stat().st_size < 1024 + 200 for p in shards)


def test_a_checksum_mismatch_is_found_by_line_and_skipped_by_readers(tmp_path):
    writer = _writer(tmp_path)
    writer.append(_records(3))
    shard = writer.current
    writer.close()
    lines = shard.read_bytes().splitlines(keepends=True)
    lines[1] = lines[1].replace(b"xxxx", b"xxxy", 1)  # one flipped character in the second record
    shard.write_bytes(b"".join(lines))
    stats = scan_store(tmp_path)
    assert stats.records == 2 and [s.bad_lines for s in stats.damaged] == [[2]]
    bad = []
    assert [r["id"] for r in read_records(tmp_path, on_bad_line=lambda p, n: bad.append((p, n)))] == ["r0", "r2"]
    assert bad == [(shard, 2)]


def test_traffic_stats_reports_a_damaged_shard_and_exits_1(tmp_path, capsys):
    directory = tmp_path / "traffic"
    writer = _writer(directory)
    writer.append(_records(2))
    writer.close()
    config = ["-c", "configs/tiny-cpu.yaml", f"data_dir={tmp_path}"]
    assert main(["traffic", "stats", *config]) == 0
    assert "2 record(s)" in capsys.readouterr().out
    shard = shard_paths(directory)[0]
    shard.write_bytes(shard.read_bytes()[:-10] + b"corrupted\n")
    assert main(["traffic", "stats", *config]) == 1
    captured = capsys.readouterr()
    assert "1 record(s)" in captured.out
    assert f"{shard}: 1 line(s) fail their checksum (lines 2)" in captured.err


def test_purge_removes_exactly_the_shards_older_than_asked(tmp_path, capsys):
    directory = tmp_path / "traffic"
    writer = _writer(directory, shard_bytes=1024)
    for i in range(12):
        writer.append(_records(1, i))
    writer.close()
    shards = shard_paths(directory)
    now = time.time()
    old, new = shards[: len(shards) // 2], shards[len(shards) // 2:]
    for path in old:
        os.utime(path, (now - 3 * 86400, now - 3 * 86400))
    config = ["-c", "configs/tiny-cpu.yaml", f"data_dir={tmp_path}"]
    assert main(["traffic", "purge", "--older-than", "2d", *config]) == 0
    assert shard_paths(directory) == new
    assert f"deleted {len(old)} shard(s)" in capsys.readouterr().out
    assert main(["traffic", "purge", "--all", *config]) == 0
    assert shard_paths(directory) == []


def test_purge_leaves_the_open_shard_and_the_writer_reopens_one_purged_under_it(tmp_path):
    writer = _writer(tmp_path)
    writer.append(_records(1))
    open_shard = writer.current
    assert purge(tmp_path, keep=frozenset({open_shard})) == [] and open_shard.exists()
    assert purge(tmp_path) == [open_shard]
    writer.append(_records(1, 1))
    writer.close()
    assert [r["id"] for r in read_records(tmp_path)] == ["r1"], "a record went into the deleted file"


def test_retention_by_size_and_age_deletes_the_oldest_shards(tmp_path):
    writer = _writer(tmp_path, shard_bytes=1024)
    for i in range(12):
        writer.append(_records(1, i))
    writer.close()
    shards = shard_paths(tmp_path)
    total = sum(p.stat().st_size for p in shards)
    newest_size = shards[-1].stat().st_size
    assert trim_to_size(tmp_path, total - 1) == [shards[0]]
    trim_to_size(tmp_path, newest_size)
    assert shard_paths(tmp_path) == [shards[-1]]
    old = time.time() - 10
    os.utime(shards[-1], (old, old))
    aged = _writer(tmp_path, max_age_s=5)
    assert aged.apply_retention() == [shards[-1]]


def test_a_write_error_raises_to_the_caller_and_the_next_append_starts_a_new_shard(tmp_path, monkeypatch):
    writer = _writer(tmp_path)
    writer.append(_records(1))
    real_write = os.write

    def full_disk(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(OSError, match="No space left"):
        writer.append(_records(1, 1))
    assert writer.current is None
    monkeypatch.setattr(os, "write", real_write)
    writer.append(_records(1, 2))
    writer.close()
    assert [r["id"] for r in read_records(tmp_path)] == ["r0", "r2"]


def test_drift_is_reported_once_when_a_full_window_falls_below_the_margin():
    monitor = DriftMonitor(window_requests=3, margin=0.1)
    monitor.set_gate("7", 2.0)  # drift below 2.0 x 0.9 = 1.8
    assert monitor.observe("7", 1.0) is None and monitor.observe("7", 1.0) is None, "a window not yet full was judged"
    monitor = DriftMonitor(window_requests=3, margin=0.1)
    monitor.set_gate("7", 2.0)
    assert [monitor.observe("7", value) for value in (2.0, 2.0, 1.5)] == [None] * 3  # 2.0, 2.0, 1.5: 1.83, not below
    drift = monitor.observe("7", 1.5)  # 2.0, 1.5, 1.5: 1.67 < 1.8
    assert drift is not None and drift.live_accept_length == pytest.approx(5 / 3) and drift.gate_accept_length == 2.0
    assert drift.detail() == {"live_accept_length": 1.6667, "gate_accept_length": 2.0, "window_requests": 3,
                              "margin": 0.1}
    assert monitor.observe("7", 1.0) is None, "reported twice"


def test_drift_waits_for_the_gate_value_and_never_fires_for_a_version_the_gate_did_not_measure():
    monitor = DriftMonitor(window_requests=3, margin=0.1)
    assert not monitor.knows_gate("8")
    monitor.set_gate("8", None)  # the lookup is under way
    assert monitor.knows_gate("8") and [monitor.observe("8", 1.0) for _ in range(5)] == [None] * 5
    monitor.set_gate("8", 2.0)  # the answer arrives: the window filled meanwhile is judged at once
    assert monitor.judge("8") is not None and monitor.observe("8", 1.0) is None


def test_a_refresh_on_drift_needs_capture_and_its_job_runs_on_the_apps_config_and_store(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="serve.drift.refresh=true needs serve.traffic.enabled"):
        load_config(None, ["serve.drift.refresh=true"])
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["serve.drift.refresh=true", "serve.traffic.enabled=true", "data_dir=./data",
                             "serve.traffic.dir=./store"])
    written = tmp_path / JOB_CONFIG_FILE
    written.write_text(yaml.safe_dump(job_config(cfg)))
    monkeypatch.chdir(tmp_path.parent)  # the job's working directory is not the app's
    loaded = load_config(written)
    assert loaded.data_path() == tmp_path / "data" and loaded.serve.traffic.dir == str(tmp_path / "store")
    assert loaded.model_dump(exclude={"data_dir": True, "serve": {"traffic": {"dir"}}}) == cfg.model_dump(
        exclude={"data_dir": True, "serve": {"traffic": {"dir"}}})
    assert shlex.split(job_entrypoint(promote=True)) == [sys.executable, "-m", "draftline", "refresh", "--config",
                                                         JOB_CONFIG_FILE]
    assert shlex.split(job_entrypoint(promote=False))[-1] == "--no-promote"


def test_durations():
    assert [parse_duration_s(t) for t in ("90s", "30m", "12h", "7d", "1.5d")] == [90, 1800, 43200, 604800, 129600]
    with pytest.raises(Exception, match="not a duration"):
        parse_duration_s("7 days")
