"""Processes as /proc shows them, for the tests that end an owner (a command, a Ray actor) and check that nothing it
started outlives it: a mark in the environment the owner is started with (inherited by everything it starts, unless
a process writes its title over its environment), the process tree, and waits with deadlines."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

MARK_ENV = "DRAFTLINE_TEST_OWNER"


def start_time(pid: int) -> Optional[int]:
    """The process's start time (clock ticks since boot); None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == b"Z" else int(fields[19])


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def parent_pid(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return int(handle.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def live_pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit() and start_time(int(entry)) is not None]


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid in live_pids():
        children.setdefault(parent_pid(pid), []).append(pid)
    found, stack = [], list(children.get(root, []))
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(children.get(pid, []))
    return found


def marked(mark: str) -> list[int]:
    """Live processes whose environment holds MARK_ENV=<mark>."""
    needle = f"\0{MARK_ENV}={mark}\0".encode()
    found = []
    for pid in live_pids():
        try:
            with open(f"/proc/{pid}/environ", "rb") as handle:
                if needle in b"\0" + handle.read():
                    found.append(pid)
        except OSError:
            continue
    return found


@dataclass
class Owner:
    """A command started in a session of its own (so SIGINT to its group is Ctrl-C at its terminal), marked, with
    its output in a file (a pipe nobody reads would stop it once full)."""

    process: subprocess.Popen
    mark: str
    log: Path

    @classmethod
    def start(cls, argv: list[str], log: Path, env: Optional[dict] = None, **popen) -> "Owner":
        mark = uuid.uuid4().hex
        with open(log, "w") as out:
            process = subprocess.Popen(argv, env={**(env or os.environ), MARK_ENV: mark}, start_new_session=True,
                                       stdout=out, stderr=subprocess.STDOUT, **popen)
        return cls(process, mark, log)

    def tree(self) -> dict[int, int]:
        """{pid: start time} of the owner, its descendants and every process carrying its mark, now."""
        pids = {self.process.pid, *descendants(self.process.pid), *marked(self.mark)}
        return {pid: started for pid in pids if (started := start_time(pid)) is not None}

    def send(self, sig: int) -> None:
        """SIGINT goes to the owner's whole process group, as Ctrl-C at a terminal would; other signals to it alone."""
        if sig == signal.SIGINT:
            os.killpg(self.process.pid, sig)
        else:
            self.process.send_signal(sig)

    def output(self) -> str:
        """Its output so far; a test that ends with the owner still running kills it."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)
        return self.log.read_text(errors="replace")


def wait_for(what: str, condition: Callable[[], object], timeout_s: float, owner: Optional[Owner] = None):
    """Poll `condition` until it returns something true; fail naming `what` (and the owner's output) at the deadline
    or when the owner exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        if owner is not None and owner.process.poll() is not None:
            raise AssertionError(f"the owner exited ({owner.process.returncode}) before {what}:\n{owner.output()[-4000:]}")
        time.sleep(0.5)
    tail = owner.output()[-4000:] if owner is not None else ""
    raise AssertionError(f"no {what} within {timeout_s:.0f} s\n{tail}")


def survivors(recorded: dict[int, int], mark: Optional[str] = None) -> list[str]:
    """What is still alive of `recorded` ({pid: start time}) or carries `mark`, named for an assertion message."""
    alive = {pid for pid, started in recorded.items() if start_time(pid) == started}
    alive |= set(marked(mark)) if mark is not None else set()
    return [f"{pid} {cmdline(pid)[:100]}" for pid in sorted(alive)]


def wait_all_gone(recorded: dict[int, int], mark: Optional[str], timeout_s: float) -> float:
    """Seconds until nothing of `recorded` is alive and no process carries `mark` (None: none is checked); fails
    listing the survivors."""
    started = time.monotonic()
    while survivors(recorded, mark) and time.monotonic() - started < timeout_s:
        time.sleep(0.5)
    left = survivors(recorded, mark)
    assert left == [], f"{len(left)} processes outlived their owner by {timeout_s:.0f} s:\n" + "\n".join(left)
    return time.monotonic() - started
