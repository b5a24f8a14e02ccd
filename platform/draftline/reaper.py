"""Ends a local Ray cluster together with the process that started it (issue 18, fault 7).

    python reaper.py <gcs port>      (started by draftline.raycluster right after ray.init; stdlib only: starts fast)

When the driver that started a local cluster is killed (SIGKILL, OOM), Ray's kernel fate-sharing stops the GCS and
the raylet at once, but the raylet's dashboard and runtime-env agents first try to report the raylet's death to the
dead GCS, with a 60 s timeout (ray._private.process_watcher): measured on Ray 2.60, both stayed up and listening for
61 s; longer on a loaded machine. This process holds the read end of a pipe whose write end only the driver holds:
reading returns at end of file when the driver is gone, however it ended. Then every process of that cluster is
stopped, SIGTERM first, SIGKILL after a grace period. The cluster's processes are
- the driver's descendants when this process starts (GCS, raylet, its agents, dashboard, monitors), told apart
  from a later process with a reused pid by their start time, and
- any process whose environment has RAY_GCS_SERVER_PORT=<port>: raycluster exports it to Ray's processes while
  they start, and every worker (and whatever a worker starts) inherits it. /proc/<pid>/environ is what a process
  was started with, though a process that sets its title (Ray's agents and workers) may overwrite part of it:
  hence both.
"""

from __future__ import annotations

import os
import signal
import sys
import time

GRACE_S = 5.0


def _start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == b"Z" else int(fields[19])  # state; starttime (field 22 of proc(5))


def descendants(root: int) -> dict[int, int]:
    """{pid: start time} of the processes below `root`, this one excluded."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                parent = int(handle.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found: dict[int, int] = {}
    stack = list(children.get(root, []))
    while stack:
        pid = stack.pop()
        started = _start_time(pid)
        if pid != os.getpid() and started is not None:
            found[pid] = started
        stack.extend(children.get(pid, []))
    return found


def cluster_pids(port: str, known: dict[int, int]) -> list[int]:
    """The cluster's processes alive now: those in `known` (same start time) and those whose environment pins
    them to the GCS at `port`."""
    marker = f"\0RAY_GCS_SERVER_PORT={port}\0".encode()
    found = [pid for pid, started in known.items() if _start_time(pid) == started]
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in found or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                environ = b"\0" + handle.read()
        except OSError:  # gone meanwhile, or another user's
            continue
        if marker in environ and _start_time(int(entry)) is not None:
            found.append(int(entry))
    return found


def stop(pids: list[int], sig: int) -> list[int]:
    """Send `sig`; returns the pids it reached."""
    reached = []
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            continue
        reached.append(pid)
    return reached


def main(port: str) -> None:
    known = descendants(os.getppid())
    sys.stdin.buffer.read()  # end of file: the driver has exited
    alive = stop(cluster_pids(port, known), signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [pid for pid in cluster_pids(port, known) if pid in alive]
    stop(cluster_pids(port, known), signal.SIGKILL)


if __name__ == "__main__":
    main(sys.argv[1])
