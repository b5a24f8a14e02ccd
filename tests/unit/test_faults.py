"""Test-only fault injection (draftline.faults): off unless a test arms it, one point per stage, once per marker."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from draftline import faults
from draftline.faults import Fault


def test_nothing_fires_unless_a_test_arms_it(monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    assert all(faults.planned(point) is None for point in faults.POINTS)


def test_an_armed_fault_reaches_its_point_only_and_processes_the_stage_starts(tmp_path):
    fault = Fault("extract.shards", 3, str(tmp_path / "marker"), action="hold")
    with faults.armed(fault):
        assert faults.planned("extract.shards") == fault
        assert faults.planned("train.step") is None
        child = subprocess.run(
            [sys.executable, "-c", "from draftline import faults; print(faults.planned('extract.shards'))"],
            capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        assert "count=3" in child.stdout and "action='hold'" in child.stdout
    assert faults.planned("extract.shards") is None


def test_unknown_points_and_actions_are_refused(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="fault point 'extract.shard'"):
        Fault("extract.shard", 1, str(tmp_path / "marker"))
    with pytest.raises(ValueError, match="fault action 'stop'"):
        Fault("train.step", 1, str(tmp_path / "marker"), action="stop")
    monkeypatch.setenv(faults.ENV, '[{"point": "train.step"}]')
    with pytest.raises(RuntimeError, match="DRAFTLINE_TEST_FAULTS"):
        faults.planned("train.step")


def test_a_fault_fires_once_per_marker_when_its_count_is_reached(tmp_path, monkeypatch):
    kills = []
    monkeypatch.setattr("draftline.faults.os.kill", lambda pid, sig: kills.append(pid))
    fault = Fault("online.batches", 2, str(tmp_path / "marker"))
    fault.fire(1, "actor")
    assert not kills and not (tmp_path / "marker").exists()
    fault.fire(2, "actor")
    fault.fire(3, "restarted actor")
    assert kills == [os.getpid()] and "actor pid" in (tmp_path / "marker").read_text()
