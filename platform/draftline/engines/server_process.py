"""An engine's HTTP server as a supervised subprocess: launch, wait until healthy, restart on crash, stop as a group.

Started with `start_new_session`, so the server and the workers it forks are stopped together (SIGTERM to the
server, then SIGKILL for what is left of its group). Every server also goes when the process that started it goes,
however that ends (SIGTERM, Ctrl-C, SIGKILL, a Ray actor killed): this process's reaper (draftline/reaper.py, one per
process) is told each server's pid and stops the server's session, the processes seen below it and every process
carrying its mark in the environment, when this process is gone. PR_SET_PDEATHSIG on the server itself makes it go at
once. A server that exits while nobody asked it to stop is relaunched with exponential backoff, at most
`max_restarts` times, once what was left of it is gone; `wait_ready` lets requests wait for the relaunched server.
Every output line goes to `logger`, and the last lines are kept for error messages.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import json
import logging
import os
import signal
import sys
import time
from typing import AsyncIterator, Callable, Optional

from draftline.engines.base import GenerationChunk
from draftline.reaper import server_reaper, stat_fields

PR_SET_PDEATHSIG = 1  # linux/prctl.h
RESTART_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0)
STOP_GRACE_S = 15.0
CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


class ServerError(RuntimeError):
    pass


async def sse_events(response, error: Callable[[str], Exception], what: str) -> AsyncIterator[dict]:
    """The JSON events of a streaming (server-sent events) response up to `data: [DONE]`. An event that holds
    "error" raises error(message): the server gave up on the request mid-stream."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[len("data:") :].strip()
        if payload == "[DONE]":
            return
        event = json.loads(payload)
        if "error" in event:
            raise error(f"{what} error: {event['error']}")
        yield event


def session_cpu_seconds(session_id: int) -> float:
    """CPU seconds (user and system) of the processes of a session, with those of their children already waited for."""
    ticks = 0
    for entry in os.listdir("/proc"):
        fields = stat_fields(int(entry)) if entry.isdigit() else None
        if fields is not None and int(fields[3]) == session_id:  # session
            ticks += sum(int(value) for value in fields[11:15])  # utime, stime, cutime, cstime (fields 14-17)
    return ticks / CLOCK_TICKS_PER_S


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGKILL it when the process that started it dies."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class ServerProcess:
    def __init__(
        self,
        name: str,
        argv: Callable[[], list[str]],
        env: Optional[dict[str, str]],
        base_url: Callable[[], str],
        health_path: str,
        startup_timeout_s: float,
        max_restarts: int,
        logger: logging.Logger,
        timeout_hint: str,
    ) -> None:
        """argv and base_url are called at every launch (a relaunch may pick a new port); env None inherits ours."""
        self.name = name
        self._argv, self._base_url = argv, base_url
        self.env = env
        self.health_path = health_path
        self.startup_timeout_s = startup_timeout_s
        self.max_restarts = max_restarts
        self.logger = logger
        self.timeout_hint = timeout_hint
        self.restarts = 0
        self.failed: Optional[str] = None
        self.recent_log_lines: collections.deque[str] = collections.deque(maxlen=200)
        self.base_url = ""
        self._process: Optional[asyncio.subprocess.Process] = None
        self._ready = asyncio.Event()
        self._stopping = False
        self._tasks: list[asyncio.Task] = []
        self._client = None

    @property
    def pid(self) -> Optional[int]:
        return self._process.pid if self._process is not None else None

    def cpu_seconds(self) -> float:
        """CPU seconds the running server's processes have used (its session: the server and its engine processes)."""
        return session_cpu_seconds(self._process.pid) if self._process is not None else 0.0

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.returncode is None and self._ready.is_set() and not self.failed

    async def start(self) -> None:
        import httpx

        self._client = httpx.AsyncClient(timeout=httpx.Timeout(10.0))
        self._stopping = False
        await self._launch()
        self._tasks.append(asyncio.create_task(self._watch(), name=f"{self.name}-watch"))

    async def _launch(self) -> None:
        self._ready.clear()
        argv, self.base_url = self._argv(), self._base_url()
        self.logger.info("launching: %s", " ".join(argv))
        reaper = server_reaper()
        env = {**(os.environ if self.env is None else self.env), **reaper.new_mark()}
        self._process = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
            start_new_session=True, preexec_fn=_die_with_parent,
        )  # fmt: skip
        reaper.started(self._process.pid, env)
        self._tasks.append(asyncio.create_task(self._forward_logs(self._process), name=f"{self.name}-logs"))
        await self._wait_healthy(self._process)
        self._ready.set()

    async def _forward_logs(self, process: asyncio.subprocess.Process) -> None:
        assert process.stdout is not None
        async for raw in process.stdout:
            line = raw.decode(errors="replace").rstrip()
            self.recent_log_lines.append(line)
            self.logger.info("[%s pid %s] %s", self.name, process.pid, line)

    def last_log_lines(self, count: int = 20) -> str:
        return "\n".join(list(self.recent_log_lines)[-count:])

    async def _wait_healthy(self, process: asyncio.subprocess.Process) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if process.returncode is not None:
                await asyncio.sleep(0.2)  # let the log forwarder read the last lines
                raise ServerError(
                    f"{self.name} exited with code {process.returncode} before it was healthy; last log lines:\n"
                    + self.last_log_lines()
                )
            if await self.healthy():
                return
            await asyncio.sleep(0.5)
        await self._terminate(process)
        raise ServerError(
            f"{self.name} at {self.base_url} was not healthy within {self.startup_timeout_s} s ({self.timeout_hint}); "
            "last log lines:\n" + self.last_log_lines()
        )

    async def healthy(self) -> bool:
        try:
            return (await self._client.get(self.base_url + self.health_path, timeout=5.0)).status_code == 200
        except Exception:  # connection refused while the server is loading
            return False

    async def _watch(self) -> None:
        """Relaunch a server that exits while nobody asked it to stop."""
        while not self._stopping:
            code = await self._process.wait()
            if self._stopping:
                return
            self._ready.clear()
            self._kill_leftovers(self._process)
            if self.restarts >= self.max_restarts:
                self.failed = f"{self.name} exited with code {code} and its {self.max_restarts} restarts are used up"
                self.logger.error(self.failed)
                self._ready.set()  # wake waiting requests so they fail fast
                return
            backoff_s = RESTART_BACKOFF_S[min(self.restarts, len(RESTART_BACKOFF_S) - 1)]
            self.restarts += 1
            self.logger.warning("%s exited with code %s; restart %d in %.0f s", self.name, code, self.restarts, backoff_s)
            await asyncio.sleep(backoff_s)
            try:
                await self._launch()
            except ServerError as err:
                self.logger.error("restart %d failed: %s", self.restarts, err)

    async def wait_ready(self) -> None:
        try:
            await asyncio.wait_for(self._ready.wait(), self.startup_timeout_s)
        except asyncio.TimeoutError:
            raise ServerError(f"{self.name} at {self.base_url} did not come back within {self.startup_timeout_s} s") from None
        if self.failed:
            raise ServerError(self.failed)

    async def wait_relaunched(self, refused_pid: Optional[int]) -> None:
        """After a refused connection: wait until the server with `refused_pid` is healthy again or, if it died,
        until the watcher (which may not have seen the exit yet) has relaunched it and the new one is ready."""
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.failed:
                raise ServerError(self.failed)
            if self._ready.is_set() and (self.pid != refused_pid or await self.healthy()):
                return
            await asyncio.sleep(0.5)
        raise ServerError(f"{self.name} did not come back within {self.startup_timeout_s} s")

    async def stream(
        self, open_stream: Callable[[], AsyncIterator[GenerationChunk]], error: Callable[[str], Exception]
    ) -> AsyncIterator[GenerationChunk]:
        """One request's chunks from `open_stream()` (a new HTTP stream per call), through crashes: a request the
        server refused, or lost before any chunk reached the caller, is sent again once the watcher has relaunched
        the server (at most max_restarts + 1 sends); one cut after a chunk was passed on, or ended before a finished
        chunk, raises error(message), since the caller already holds part of it."""
        import httpx

        await self.wait_ready()
        sends = self.max_restarts + 1
        for _ in range(sends):
            pid, streamed = self.pid, False
            try:
                async for chunk in open_stream():
                    streamed = True
                    yield chunk
                    if chunk.finished:
                        return
            except httpx.TransportError as err:  # refused, or a pooled connection to a server that has just died
                if streamed:
                    raise error(f"{self.name} closed the stream mid-request (did the server crash?): {err!r}") from None
                await self.wait_relaunched(pid)
                continue
            raise error(f"{self.name} closed the stream before the request finished (did the server crash?)")
        raise error(f"{self.name} at {self.base_url} refused connections {sends} times")

    async def kill(self) -> None:
        """SIGKILL the server group as a crash would (tests; the watcher relaunches it)."""
        if self._process is not None and self._process.returncode is None:
            os.killpg(self._process.pid, signal.SIGKILL)

    async def stop(self) -> None:
        self._stopping = True
        if self._process is not None:
            await self._terminate(self._process)
        # The log forwarders end at EOF: let them, so the pipes are closed on this loop, not at interpreter exit.
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5.0)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _terminate(self, process: asyncio.subprocess.Process) -> None:
        """SIGTERM to the server alone (it shuts its workers down), then SIGKILL to whatever is left of the group."""
        if process.returncode is None:
            try:
                os.kill(process.pid, signal.SIGTERM)
                await asyncio.wait_for(process.wait(), STOP_GRACE_S)
            except (ProcessLookupError, asyncio.TimeoutError):
                pass
        self._kill_leftovers(process)
        try:
            await asyncio.wait_for(process.wait(), 5.0)
        except asyncio.TimeoutError:
            self.logger.error("%s pid %s did not exit after SIGKILL", self.name, process.pid)

    @staticmethod
    def _kill_leftovers(process: asyncio.subprocess.Process) -> None:
        """SIGKILL what is left of a server's group (a crashed API server leaves its engine processes), and have the
        reaper kill its processes that left the group and forget it."""
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        server_reaper().stopped(process.pid)
