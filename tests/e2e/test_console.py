"""The terminal of `draftline run`: draftline's own lines, once each; Ray's start-up and worker output in the stage
log (draftline.stagelog). A real CLI run as a subprocess: real local Ray, real extraction into a tmp dir."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from conftest import REPO, TEST_CONFIG, config_overrides, make_test_config



@pytest.mark.parametrize("command", ["run", "extract"])
def test_a_stage_keeps_ray_noise_in_its_log_and_shows_each_line_once(command, tiny_dataset_dir, tmp_path):
    """Issue 18, quiet console. Measured before: `draftline run --until extract` printed 89 terminal lines, 52 of them
    Ray's (start-up, Ray Train's worker group, forwarded worker lines) and both extract worker lines twice; the
    standalone `draftline extract` printed everything too."""
    from draftline.pipeline import pipeline_dir

    stage_args = ["run", "--from", "extract", "--until", "extract"] if command == "run" else ["extract"]
    run = subprocess.run(
        [sys.executable, "-m", "draftline.cli", *stage_args,
         # A fresh storage location: the extraction really runs (Ray Train, a worker that prints).
         "--config", str(TEST_CONFIG), *config_overrides(extra=[f"extract.storage_uri={tmp_path / 'hidden'}"])],
        capture_output=True, text=True, timeout=1800, cwd=REPO,
    )
    terminal = run.stdout + run.stderr
    assert run.returncode == 0, terminal[-3000:]
    lines = [line for line in terminal.splitlines() if line.strip()]

    assert any(line.startswith("[extract] train:") for line in lines), terminal[-3000:]
    assert "Started a local Ray instance" not in terminal
    assert [line for line in lines if "pid=" in line] == []  # Ray's forwarded worker lines: (RayTrainWorker pid=N)
    assert {line: n for line, n in Counter(lines).items() if n > 1} == {}

    cfg = make_test_config()
    log_path = (pipeline_dir(cfg) if command == "run" else Path(cfg.data_dir)) / "logs" / "extract.log"
    if command == "extract":
        assert f"full output, Ray's included, in {log_path}" in terminal
    this_run = log_path.read_text().rsplit("\n===== ", 1)[1]
    print(f"draftline {command}: terminal: {len(lines)} non-blank lines; extract.log for this run: "
          f"{len(this_run.splitlines())} lines")
    assert "Started a local Ray instance" in this_run
    assert "pid=" in this_run  # the worker's forwarded lines
    assert "[extract] train:" in this_run
