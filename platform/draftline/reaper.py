"""Ends what a process started together with it, however that process ends (SIGTERM, Ctrl-C, SIGKILL, OOM).

    python -I reaper.py cluster <gcs port>     started by draftline.raycluster right after ray.init
    python -I reaper.py servers <owner token>  started by engines.server_process before its owner's first server

A reaper reads a pipe whose write end only its owner holds: reading returns at end of file when the owner is gone,
however it ended, since no handler has to run in the owner. Then it stops the owner's processes, SIGTERM first,
SIGKILL after GRACE_S (vLLM's resource tracker ignores SIGTERM). It leaves its owner's session and process tree at
start (stdlib only, so it starts fast): a Ray worker that exits kills its direct children, and Ctrl-C reaches the
terminal's whole process group, while the reaper must outlive both.

- cluster: when the driver that started a local cluster is killed, Ray's kernel fate-sharing stops the GCS and the
  raylet at once, but the raylet's dashboard and runtime-env agents first try to report the raylet's death to the
  dead GCS, with a 60 s timeout (ray._private.process_watcher): measured on Ray 2.60, both stayed up and listening
  for 61 s. The cluster's processes are the driver's descendants when the reaper starts (GCS, raylet, its agents,
  dashboard, monitors), and any process whose environment has RAY_GCS_SERVER_PORT=<port>: raycluster exports it to
  Ray's processes while they start, and every worker (and whatever a worker starts) inherits it.
- servers: the engine servers (vLLM, SGLang) one process starts, a Ray actor or a command. ServerProcess starts each
  in a session of its own, with OWNER_ENV=<token>/<n> in its environment, and writes `+PID <token>/<n>` down the
  pipe, `-PID` when it has stopped it (the reaper then kills what is left of it outside its session). A server's
  processes are the members of its session, found by session id even after the server itself died (vLLM's
  EngineCore and Worker, reparented to init); those seen below it while the owner lived (polled every POLL_S: a
  child that calls setsid leaves the session); and any process whose environment carries its mark, which
  everything the server starts inherits.

/proc/<pid>/environ is what a process was started with, but a process that sets its title (Ray's agents and workers,
vLLM's EngineCore and Worker) writes it over its environment: hence the process tree and the sessions as well. A pid
the kernel reuses for an unrelated process is told apart by its start time.
"""

from __future__ import annotations

import itertools
import os
import secrets
import select
import signal
import subprocess
import sys
import time

GRACE_S = 5.0
POLL_S = 1.0
OWNER_ENV = "DRAFTLINE_SERVER_OWNER"


def stat_fields(pid: int) -> list[bytes] | None:
    """/proc/<pid>/stat after the command name: the fields from 3 (state) on of proc(5), so field n is at n - 3;
    None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _stat(pid: int) -> tuple[int, int, int] | None:
    """(parent pid, session id, start time) of a live process; None when it is gone or a zombie."""
    fields = stat_fields(pid)
    if fields is None or fields[0] == b"Z":
        return None
    return int(fields[1]), int(fields[3]), int(fields[19])  # ppid, session, starttime (fields 4, 6, 22 of proc(5))


def _processes() -> dict[int, tuple[int, int, int]]:
    """{pid: (parent pid, session id, start time)} of every live process but this one."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            stat = _stat(int(entry))
            if stat is not None:
                found[int(entry)] = stat
    return found


def descendants(roots: set[int], processes: dict[int, tuple[int, int, int]]) -> dict[int, int]:
    """{pid: start time} of the processes below `roots` (roots excluded)."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _, _) in processes.items():
        children.setdefault(parent, []).append(pid)
    found: dict[int, int] = {}
    stack = [child for root in roots for child in children.get(root, [])]
    while stack:
        pid = stack.pop()
        if pid not in found:
            found[pid] = processes[pid][2]
            stack.extend(children.get(pid, []))
    return found


def _marked(needle: bytes, candidates) -> list[int]:
    """The candidates whose environment, read as b"\\0NAME=VALUE\\0...", holds `needle`."""
    found = []
    for pid in candidates:
        try:
            with open(f"/proc/{pid}/environ", "rb") as handle:
                environ = b"\0" + handle.read()
        except OSError:  # gone meanwhile, or another user's
            continue
        if needle in environ:
            found.append(pid)
    return found


class Owned:
    """What one owner started: processes seen below its roots, sessions led by its servers, and marks."""

    def __init__(self, needle: bytes) -> None:
        self.needle = needle  # every process of the owner carries it in its environment, unless it wrote over it
        self.known: dict[int, tuple[int, int]] = {}  # pid -> (start time, root it was seen below)
        self.sessions: dict[int, tuple[int, bytes]] = {}  # session id (= a server's pid) -> (its start time, mark)

    def add_server(self, pid: int, mark: str) -> None:
        stat = _stat(pid)
        if stat is not None:
            self.sessions[pid] = (stat[2], f"\0{OWNER_ENV}={mark}\0".encode())
            self.known[pid] = (stat[2], pid)

    def record(self, processes: dict[int, tuple[int, int, int]], roots: set[int] | None = None) -> None:
        """Remember the processes below the servers (or below `roots`) as they are now."""
        for root in roots if roots is not None else list(self.sessions):
            for pid, started in descendants({root}, processes).items():
                self.known.setdefault(pid, (started, root))

    def alive(self, root: int | None = None) -> list[int]:
        """The owner's processes alive now (only those of server `root` when given)."""
        processes = _processes()
        sessions = self.sessions if root is None else {root: self.sessions[root]} if root in self.sessions else {}
        found = {pid for pid, (started, seen_below) in self.known.items()
                 if (root is None or seen_below == root) and pid in processes and processes[pid][2] == started}
        found |= {pid for pid, (_, session, started) in processes.items()
                  if session in sessions and started >= sessions[session][0]}
        for needle in [self.needle] if root is None else [mark for _, mark in sessions.values()]:
            found |= set(_marked(needle, set(processes) - found))
        return sorted(found)

    def forget(self, root: int) -> None:
        self.sessions.pop(root, None)
        self.known = {pid: entry for pid, entry in self.known.items() if entry[1] != root}


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


def reap(owned: Owned) -> None:
    """SIGTERM to every process the owner left, SIGKILL to those still there after GRACE_S."""
    alive = stop(owned.alive(), signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [pid for pid in owned.alive() if pid in alive]
    stop(owned.alive(), signal.SIGKILL)


def watch_servers(owned: Owned, pipe: int) -> None:
    """Follow `+PID` / `-PID` lines and the servers' process trees until end of file on `pipe`."""
    pending = b""
    while True:
        readable, _, _ = select.select([pipe], [], [], POLL_S)
        if readable:
            data = os.read(pipe, 4096)
            if not data:
                return
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                pid, _, mark = line[1:].decode().partition(" ")
                if line.startswith(b"+"):
                    owned.add_server(int(pid), mark)
                else:  # the owner stopped it: what is left ran away from its session
                    stop(owned.alive(int(pid)), signal.SIGKILL)
                    owned.forget(int(pid))
        if owned.sessions:
            owned.record(_processes())


def main(mode: str, value: str) -> None:
    parent = os.getppid()
    if os.fork():  # leave the owner's process tree: the owner reaps the exiting parent
        os._exit(0)
    os.setsid()  # and its session: Ctrl-C at a terminal goes to the foreground process group
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pipe = sys.stdin.fileno()
    if mode == "cluster":
        owned = Owned(f"\0RAY_GCS_SERVER_PORT={value}\0".encode())
        owned.record(_processes(), roots={parent})
        while os.read(pipe, 4096):  # end of file: the driver has exited
            pass
    else:
        owned = Owned(f"\0{OWNER_ENV}={value}/".encode())
        watch_servers(owned, pipe)
    reap(owned)


def spawn(mode: str, value: str) -> subprocess.Popen:
    """Start a reaper for this process; keep the returned Popen (its stdin is the pipe) for as long as this process
    lives. The reaper gets none of this process's environment (secrets included) and needs none."""
    process = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), mode, value], stdin=subprocess.PIPE,
                               env={}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    process.wait()  # the first fork: it exits at once, leaving the reaper running
    return process


class ServerReaper:
    """The owner side of `reaper.py servers`: one per process, started before its first server (server_reaper())."""

    def __init__(self) -> None:
        self.token = f"{os.getpid()}-{secrets.token_hex(8)}"
        self.owner_pid = os.getpid()
        self.servers: dict[int, str] = {}  # pid -> mark
        self._marks = itertools.count()
        self._pipe = spawn("servers", self.token).stdin

    def new_mark(self) -> dict[str, str]:
        """To add to the environment of the next server: the reaper also finds its processes by this mark."""
        return {OWNER_ENV: f"{self.token}/{next(self._marks)}"}

    def started(self, pid: int, env: dict[str, str]) -> None:
        """The server started with `env` (which holds a new_mark()) has `pid`."""
        self.servers[pid] = env[OWNER_ENV]
        self._send(f"+{pid} {env[OWNER_ENV]}\n")

    def stopped(self, pid: int) -> None:
        if self.servers.pop(pid, None) is not None:
            self._send(f"-{pid}\n")

    def _send(self, line: str) -> None:
        try:
            self._pipe.write(line.encode())
            self._pipe.flush()
        except BrokenPipeError:  # someone killed the reaper: start another one, told about every running server
            self._pipe = spawn("servers", self.token).stdin
            self._pipe.write("".join(f"+{pid} {mark}\n" for pid, mark in self.servers.items()).encode())
            self._pipe.flush()


_server_reaper: ServerReaper | None = None


def server_reaper() -> ServerReaper:
    """This process's ServerReaper (a forked child gets one of its own)."""
    global _server_reaper
    if _server_reaper is None or _server_reaper.owner_pid != os.getpid():
        _server_reaper = ServerReaper()
    return _server_reaper


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
