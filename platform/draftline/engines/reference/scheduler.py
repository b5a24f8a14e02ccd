"""Continuous batching: one loop owns the model. Between steps, waiting requests join (one batched prefill) and
finished or cancelled ones leave; each step advances every running request with one batched target forward, in a
worker thread so the event loop keeps streaming. Rows of the running caches follow `running`, in order."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable, Optional

from draftline.engines.base import GenerationChunk
from draftline.engines.reference.kv_cache import Caches
from draftline.engines.reference.output import IncrementalText
from draftline.engines.reference.sequence import Sequence


@dataclass
class Request:
    """A request inside the scheduler: its sequence and the queue its chunks stream through."""

    sequence: Sequence
    chunks: asyncio.Queue
    text: IncrementalText
    cancelled: bool = False
    caches: Caches = field(default_factory=Caches)  # own row, only for a target whose cache cannot be batched


# (running, joining, the running rows' caches) -> the chunks the step produced, per request
Advance = Callable[[list[Request], list[Request], Caches], list[tuple[Request, GenerationChunk]]]


class Scheduler:
    def __init__(self, advance: Advance, batchable: bool) -> None:
        self.advance = advance
        self.batchable = batchable  # False: every request steps alone, in its own one-row caches
        self.caches = Caches()  # the running requests' target and drafter KV, one row each
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # in cache row order
        self.stopped = False
        self._wake = asyncio.Event()
        self._task: Optional[asyncio.Task] = None

    def submit(self, request: Request) -> None:
        self.waiting.append(request)
        if self._task is None or self._task.done():
            # one loop per event loop (asyncio.run in tests and benchmarks makes a new one each time); rows of
            # requests left behind by an earlier event loop are dropped with it
            self._wake = asyncio.Event()
            self.running, self.caches = [], Caches()
            self._task = asyncio.get_running_loop().create_task(self._loop())
        self._wake.set()

    def stop(self) -> None:
        self.stopped = True
        for request in self.running + self.waiting:
            request.chunks.put_nowait(RuntimeError("the engine stopped before the request finished"))
        self.running, self.waiting, self.caches = [], [], Caches()
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _loop(self) -> None:
        while not self.stopped:
            self._drop_cancelled()
            joining, self.waiting = [r for r in self.waiting if not r.cancelled], []
            if not self.running and not joining:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                events = await asyncio.to_thread(self.advance, self.running, joining, self.caches)
            except Exception as err:  # noqa: BLE001 - every waiting client gets the error, the loop keeps serving
                for request in self.running + joining:
                    request.chunks.put_nowait(err)
                self.running, self.caches = [], Caches()
                continue
            for request, chunk in events:
                request.chunks.put_nowait(chunk)
            finished = {id(request) for request, chunk in events if chunk.finished}
            self.running = [r for r in self.running + joining if id(r) not in finished]

    def _drop_cancelled(self) -> None:
        live = [row for row, request in enumerate(self.running) if not request.cancelled]
        if len(live) < len(self.running):
            if self.batchable:
                self.caches.keep_rows(live)
            self.running = [self.running[row] for row in live]
