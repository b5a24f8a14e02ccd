"""The terminal of `draftline run` and of the stage commands: draftline's own lines, once each; Ray's start-up and
worker output, and libraries' progress bars, in the stage log (draftline.stagelog). Real CLI runs as subprocesses whose
output is a pipe (as in CI, or `| cat`): real local Ray, real extraction and training into a tmp dir."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from conftest import REPO, SMALL_BENCH, TEST_CONFIG, config_overrides, make_test_config
from registry_helpers import mlflow_overrides

# A run through extraction and a short training took 7.5 min at load 25 and did not finish in 15 at load 50.
pytestmark = pytest.mark.timeout(1800)


# The run goes on through a short training (2 validation steps), whose progress must reach a terminal that is not one.
TRAIN = ["train.max_steps=4", "train.val_every=2", "train.checkpoint_every=2"]
STAGE_ARGS = {
    "run": ["run", "--from", "extract", "--until", "train"],
    "extract": ["extract"],
}


def run_cli(argv: list[str], overrides: list[str]) -> tuple[str, list[str]]:
    """(terminal output, its non-blank lines) of a `draftline` command whose output is a pipe, not a terminal."""
    run = subprocess.run([sys.executable, "-m", "draftline.cli", *argv, "--config", str(TEST_CONFIG),
                          *config_overrides(extra=overrides)],
                         capture_output=True, text=True, timeout=1800, cwd=REPO)  # fmt: skip
    terminal = run.stdout + run.stderr
    assert run.returncode == 0, terminal[-3000:]
    return terminal, [line for line in terminal.splitlines() if line.strip()]


def check_only_draftline_lines(terminal: str, lines: list[str]) -> None:
    assert "Started a local Ray instance" not in terminal
    assert [line for line in lines if "pid=" in line] == []  # Ray's forwarded worker lines: (RayTrainWorker pid=N)
    assert [line for line in lines if "%|" in line] == []  # tqdm bars: transformers' `Loading weights:  50%|...|`
    assert "Checkpoint successfully created" not in terminal  # Ray Train's, from its workers
    assert {line: n for line, n in Counter(lines).items() if n > 1} == {}


@pytest.mark.parametrize("command", sorted(STAGE_ARGS))
def test_a_stage_keeps_ray_noise_in_its_log_and_shows_each_line_once(command, tiny_dataset_dir, tmp_path):
    """Issue 18, quiet console. Measured before: `draftline run --until extract` printed 89 terminal lines, 52 of them
    Ray's (start-up, Ray Train's worker group, forwarded worker lines) and both extract worker lines twice; the
    standalone `draftline extract` printed everything too. And the training workers' progress, one line per
    validation step, never reached a terminal that was not one (it is the only worker line shown, without Ray's
    prefix)."""
    from draftline.pipeline import RUN_LOG, pipeline_dir

    # Fresh storage locations: the extraction really runs (Ray Train, a worker that prints), and training starts from
    # step 0 (Ray Train resumes from a checkpoint an earlier run left for the same inputs).
    overrides = [f"extract.storage_uri={tmp_path / 'hidden'}", f"train.storage_uri={tmp_path / 'checkpoints'}", *TRAIN,
                 *mlflow_overrides(tmp_path)]
    terminal, lines = run_cli(STAGE_ARGS[command], overrides)

    assert any(line.startswith("[extract] train:") for line in lines), terminal[-3000:]
    check_only_draftline_lines(terminal, lines)

    cfg = make_test_config()
    logs = (pipeline_dir(cfg) if command == "run" else Path(cfg.data_dir)) / "logs"
    if command == "extract":
        assert f"full output, Ray's included, in {logs / 'extract.log'}" in terminal
    this_run = (logs / "extract.log").read_text().rsplit("\n===== ", 1)[1]
    print(f"draftline {command}: terminal: {len(lines)} non-blank lines; extract.log for this run: "
          f"{len(this_run.splitlines())} lines")
    assert "Started a local Ray instance" in this_run
    assert "pid=" in this_run  # the worker's forwarded lines
    assert "[extract] train:" in this_run
    if command == "run":
        progress = [line for line in lines if line.startswith("[train] step ")]
        assert [line.split(" loss ")[0] for line in progress] == ["[train] step 2/4", "[train] step 4/4"], lines
        assert "Checkpoint successfully created" in (logs / "train.log").read_text() + (logs / RUN_LOG).read_text()


def test_a_command_keeps_library_progress_bars_in_its_log(fitted_drafter_dir, tiny_dataset_dir):
    """`draftline bench` loads the target in its own process (the reference engine): before, transformers'
    `Loading weights` bar reached the terminal, redrawn with carriage returns as if it were draftline's own."""
    terminal, lines = run_cli(["bench", "--drafter", str(fitted_drafter_dir), "--concurrency", "1"],
                              [*SMALL_BENCH, "bench.rounds=1"])
    assert any(line.startswith("[bench] round 1 ") for line in lines), terminal[-3000:]
    check_only_draftline_lines(terminal, lines)
    this_run = (Path(make_test_config().data_dir) / "logs" / "bench.log").read_text().rsplit("\n===== ", 1)[1]
    assert "Loading weights" in this_run
