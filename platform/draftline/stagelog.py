"""A stage's output in `draftline run`: all of it to the stage log, only draftline's own lines to the terminal.

Ray, Ray Train, DeepSpeed, MLflow and transformers write start-up and progress noise: Ray's own log lines, every line a
Ray worker prints (forwarded with a `(Name pid=N)` prefix; draftline's worker lines too, which the driver sums up),
MLflow's registry messages. Measured on `draftline run --until extract` (test target, bootstrap cached, load ~30):
52 of the 89 terminal lines were such noise, and both worker lines of the extract stage were shown twice (Ray
forwards them on stdout and on stderr). Progress bars of transformers and the Hugging Face libraries (tqdm: `Loading weights:  50%|...`) redraw with a
carriage return. These go to the stage log only; the terminal keeps draftline's own lines, each shown once per run. A
line is noise when what a terminal would show of it (after its last carriage return) matches THIRD_PARTY_LINE (the
one place for the rule). One kind of worker line is draftline's own and meant for the terminal: the training workers'
`[train] ...` lines (rank 0's progress, one line per validation step, and a worker's resume); RELAYED_WORKER_LINE
shows them without Ray's prefix, so a run whose output is not a terminal still shows how training goes.

The standalone stage commands (`draftline extract`, `draftline train`, ...: LOGGED_COMMANDS) do the same into
`<data_dir>/logs/<command>.log` (command_log).
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import time
from pathlib import Path
from typing import Any, Iterator, TextIO

from draftline.config import load_config

THIRD_PARTY_LINE = re.compile(
    r"(\x1b\[[0-9;]*m)?\(((\w[\w.:-]*\s)?pid=\d+|raylet|autoscaler|gcs_server)"  # forwarded by Ray: (RayTrainWorker pid=12)
    r"|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\s+(DEBUG|INFO|WARNING|ERROR)\s+\S+\.py:\d+ -- "  # Ray's logger
    r"|\d{4}/\d\d/\d\d \d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR) (mlflow|alembic)"  # MLflow's logger
    r"|(INFO|WARNING)\s+\[alembic"  # MLflow's database migrations
    r"|\[\d{4}-\d\d-\d\d [\d:,.]+\] \[(INFO|WARNING|ERROR)\] \[\w+\.py:\d+"  # DeepSpeed's logger
    r"|\[\d{4}-\d\d-\d\d [\d:,.]+ [IWEF] \d+ \d+\] "  # Ray's C++ core (glog format)
    r"|(Successfully registered model|Created version '\d+' of model|Registered model) "  # MLflow registry prints
    r"|INFO \d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ serve \d+ -- "  # Ray Serve's logger in the driver
    r"|[^\n]*: *\d+%\|"  # a tqdm progress bar: `Loading weights:  50%|█████     | 37/75 [00:00<00:00, ...]`
)
# A forwarded worker line that is draftline's own terminal line: `(RayTrainWorker pid=12, ip=...) [train] step 50/300`.
RELAYED_WORKER_LINE = re.compile(r"(\x1b\[[0-9;]*m)?\(\w[\w.:-]*\s+pid=\d+[^)]*\)(\x1b\[0m)?\s+(?P<line>\[train\] .*)")

# Live displays (rich progress bars) redraw with these: such writes go through as they come.
_REDRAW = ("\r", "\x1b[?", "\x1b[2K", "\x1b[1A")


def _redrawn(line: str) -> str:
    """What a terminal shows of a line that redraws itself with carriage returns: the part after the last one."""
    return line.rstrip("\n").rsplit("\r", 1)[-1]


class StageStream:
    """A file-like stream for sys.stdout / sys.stderr during a stage: the log gets every byte; the terminal gets
    complete lines that are not THIRD_PARTY_LINE and were not shown before in this run (`shown`, shared by stdout,
    stderr and every stage of a run), plus live redraws as they come."""

    def __init__(self, terminal: TextIO, log: TextIO, shown: set[str]) -> None:
        self.terminal, self.log, self.shown = terminal, log, shown
        self._line = ""

    def write(self, data: str) -> int:
        # A logging handler made during the stage (Ray Serve's) keeps this stream after the stage's log has closed;
        # its later lines still go through the terminal's filter (before, each was a `--- Logging error ---`).
        if not self.log.closed:
            self.log.write(data)
            self.log.flush()
        *complete, self._line = (self._line + data).split("\n")
        for line in complete:
            self._show(line + "\n")
        if any(code in self._line for code in _REDRAW) and not THIRD_PARTY_LINE.match(_redrawn(self._line)):
            self.terminal.write(self._line)  # a live display redrawing: show it now, not at its next newline
            self.terminal.flush()
            self._line = ""
        return len(data)

    def _show(self, line: str) -> None:
        relayed = RELAYED_WORKER_LINE.match(line)
        if relayed:
            line = relayed.group("line") + "\n"
        elif THIRD_PARTY_LINE.match(_redrawn(line)):
            return
        if line.strip() and line in self.shown:
            return
        self.shown.add(line)
        self.terminal.write(line)
        self.terminal.flush()

    def _flush_line(self) -> None:
        if self._line:
            self._show(self._line)
            self._line = ""

    def flush(self) -> None:
        if not self.log.closed:
            self.log.flush()
        self.terminal.flush()

    def close_line(self) -> None:
        self._flush_line()

    def isatty(self) -> bool:
        return self.terminal.isatty()

    def fileno(self) -> int:
        return self.terminal.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self.terminal, "encoding", "utf-8")


def _third_party_handlers(streams: tuple[TextIO, ...]) -> list[logging.StreamHandler]:
    """StreamHandlers (not file handlers) that write to the terminal streams directly: Ray creates its handler
    (PlainRayHandler) when it is imported, before any stage, bound to the sys.stderr of that moment."""
    loggers = [logging.getLogger()] + [l for l in logging.Logger.manager.loggerDict.values() if isinstance(l, logging.Logger)]
    return [h for lg in loggers for h in lg.handlers
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler) and h.stream in streams]


@contextlib.contextmanager
def stage_log(path: Path, shown: set[str]) -> Iterator[None]:
    """Send a stage's stdout, stderr and logging handlers through StageStreams onto `path` (appended)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as log:
        log.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} =====\n")
        out, err = sys.stdout, sys.stderr
        stage_out, stage_err = StageStream(out, log, shown), StageStream(err, log, shown)
        handlers = _third_party_handlers((out, err, sys.__stdout__, sys.__stderr__))
        saved = [(h, h.stream) for h in handlers]
        for handler, stream in saved:
            handler.setStream(stage_err if stream in (err, sys.__stderr__) else stage_out)
        sys.stdout, sys.stderr = stage_out, stage_err
        try:
            yield
        finally:
            sys.stdout, sys.stderr = out, err
            stage_out.close_line()
            stage_err.close_line()
            for handler, stream in saved:
                handler.setStream(stream)


# Standalone commands that start Ray, DeepSpeed or MLflow (or load a target). `run` logs per stage itself; `serve`,
# `sglang-command` and `check-sglang-args` print what the user asked for.
LOGGED_COMMANDS = frozenset({"bootstrap-target", "regenerate", "prepare", "extract", "train", "export", "bench", "gate",
                             "promote", "rollback"})


def command_log_path(command: str, args: Any) -> Path | None:
    """`<data_dir>/logs/<command>.log` for a LOGGED_COMMANDS command whose config loads and whose data_dir takes the
    log; else None (the command then reports a bad config or data_dir itself, in one line)."""
    if command not in LOGGED_COMMANDS or not hasattr(args, "config"):
        return None

    try:
        cfg = load_config(args.config, list(getattr(args, "overrides", None) or []))
        path = Path(cfg.data_dir) / "logs" / f"{command}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
    except Exception:  # noqa: BLE001 - the command itself gives the proper error for any of these
        return None
    return path


@contextlib.contextmanager
def command_log(command: str, args: Any) -> Iterator[None]:
    """A standalone stage command's output split as `draftline run` splits a stage's (stage_log), when
    command_log_path gives a log; the terminal is told where the log is."""
    path = command_log_path(command, args)
    if path is None:
        yield
        return
    print(f"draftline {command}: full output, Ray's included, in {path}", flush=True)
    with stage_log(path, set()):
        yield
