"""A server started through ServerProcess goes with the process that started it, whatever ends that process, and with
an orderly stop, including the processes that leave its session. The server is a stand-in here (Python's http.server
under a shell that starts sleepers three ways: in the server's session, in a session of its own below the server,
and orphaned at once in a session of its own); the same with vLLM's real process tree is tests/e2e/test_owners_end.py.
Real processes, real signals, seconds each."""

from __future__ import annotations

import signal
import sys
import time

import pytest

from conftest import free_port
from draftline.reaper import POLL_S
from process_helpers import Owner, cmdline, live_pids, marked, start_time, wait_all_gone, wait_for

OWNER = """
import asyncio, logging, sys
from pathlib import Path
from draftline.engines.server_process import ServerProcess

port, ready_file, then = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
shell = ("sleep 1000 & setsid sleep 1000 & (setsid sh -c 'sleep 1000 &'); "
         f"exec {sys.executable} -m http.server --bind 127.0.0.1 {port}")

async def main():
    server = ServerProcess("stand-in", lambda: ["sh", "-c", shell], None, lambda: f"http://127.0.0.1:{port}", "/",
                           60.0, 0, logging.getLogger("stand-in"), "")
    await server.start()
    ready_file.write_text(str(server.pid))
    if then == "stop":
        await asyncio.sleep(float(sys.argv[4]))
        await server.stop()
        ready_file.with_suffix(".stopped").write_text("")
    await asyncio.sleep(3600)

asyncio.run(main())
"""
SLEEPERS = 3


def start_owner(tmp_path, then: str) -> tuple[Owner, int]:
    """The owner with its server up, once the reaper has seen the server's processes; -> (owner, server pid)."""
    ready = tmp_path / "ready"
    owner = Owner.start([sys.executable, "-c", OWNER, str(free_port()), str(ready), then, str(6 * POLL_S)],
                        tmp_path / "owner.log")
    server_pid = int(wait_for("healthy stand-in server", lambda: ready.exists() and ready.read_text(), 60, owner))
    wait_for(f"{SLEEPERS} sleepers", lambda: len(sleepers(owner.mark)) == SLEEPERS, 30, owner)
    return owner, server_pid


def sleepers(mark: str) -> list[int]:
    return [pid for pid in marked(mark) if cmdline(pid) == "sleep 1000"]


def reapers_of(owner: Owner) -> list[int]:
    return [pid for pid in live_pids() if f"reaper.py servers {owner.process.pid}-" in cmdline(pid)]


def settled(owner: Owner) -> dict[int, int]:
    """{pid: start time} of the owner's processes and its reaper, once the reaper has looked below the server."""
    time.sleep(2 * POLL_S)  # the reaper looks below its servers every POLL_S
    reapers = [pid for pid in live_pids() if f"reaper.py servers {owner.process.pid}-" in cmdline(pid)]
    assert len(reapers) == 1, [cmdline(pid) for pid in reapers]
    return {**owner.tree(), reapers[0]: start_time(reapers[0])}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_a_server_and_all_it_started_go_with_their_owner(tmp_path, sig):
    owner, _ = start_owner(tmp_path, then="wait")
    try:
        recorded = settled(owner)
        owner.send(sig)
        owner.process.wait(timeout=60)
        seconds = wait_all_gone(recorded, owner.mark, timeout_s=30)
        print(f"{sig.name}: the {len(recorded)} processes gone {seconds:.1f} s after the owner")
    finally:
        print(f"the owner's output:\n{owner.output()[-3000:]}")  # shown with a failure


def test_a_stopped_server_leaves_nothing_while_its_owner_runs_on(tmp_path):
    """ServerProcess.stop kills the server's process group; the reaper then kills what left the group."""
    owner, server_pid = start_owner(tmp_path, then="stop")
    try:
        recorded = settled(owner)
        server = {pid: started for pid, started in recorded.items() if pid == server_pid or pid in sleepers(owner.mark)}
        assert len(server) == 1 + SLEEPERS, {pid: cmdline(pid) for pid in recorded}
        wait_for("the stop", (tmp_path / "ready.stopped").exists, 60, owner)
        wait_all_gone(server, None, timeout_s=10)
        assert owner.process.poll() is None
    finally:
        print(f"the owner's output:\n{owner.output()[-3000:]}")  # shown with a failure
