"""Test-only fault injection: a worker dies like a SIGKILLed process, or holds to be killed with its whole node, at a
point a test chooses. Off unless a test turns it on.

A test arms faults with `armed(Fault(...), ...)`, or sets DRAFTLINE_TEST_FAULTS to `encode(Fault(...), ...)`
(tests/e2e: extract_fault, train_fault, train_online, multinode).
They travel in one environment variable, DRAFTLINE_TEST_FAULTS, so a stage run in a subprocess sees them too. The
driver of a stage reads its point once (`planned(point)`) and hands the Fault to its workers with their config; a
worker calls `fault.fire(reached, who)` where the point is reached. A fault fires once per marker file (created
exclusively, holding who fired), so the worker Ray restarts carries on past it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import ray

ENV = "DRAFTLINE_TEST_FAULTS"
# point -> where it fires and what `count` counts there
POINTS = {
    "extract.shards": "an offline extraction worker, once it has written `count` shards",
    "online.batches": "an online target actor, once it has captured `count` batches",
    "train.step": "the last training rank, before (1-based) step `count`, once the checkpoints before it are committed",
}
# "exit": die like a SIGKILLed process. "hold": write this worker's Ray node id into the marker and wait to be killed
# with the node (tests/e2e/test_multinode.py kills that node).
ACTIONS = ("exit", "hold")


@dataclass(frozen=True)
class Fault:
    point: str
    count: int
    marker: str
    action: str = "exit"

    def __post_init__(self) -> None:
        if self.point not in POINTS:
            raise ValueError(f"fault point {self.point!r}: use one of {', '.join(POINTS)}")
        if self.action not in ACTIONS:
            raise ValueError(f"fault action {self.action!r}: use one of {', '.join(ACTIONS)}")

    def fire(self, reached: int, who: str, before: Optional[Callable[[], None]] = None) -> None:
        """At `reached` >= count, the first caller (per marker file) runs `before`, then exits or holds."""
        if reached < self.count:
            return
        marker = Path(self.marker)
        marker.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(marker, "x") as handle:  # exclusive create: one worker fires, once
                handle.write(f"{who} pid {os.getpid()} fired at {self.point} {reached}\n")
        except FileExistsError:
            return
        if before is not None:
            before()
        if self.action == "hold":
            hold_until_killed(marker, f"{who} pid {os.getpid()} holding at {self.point} {reached}")
        os.kill(os.getpid(), signal.SIGKILL)


def planned(point: str) -> Optional[Fault]:
    """The fault armed for `point`, or None (always, unless a test armed one)."""
    if point not in POINTS:
        raise ValueError(f"fault point {point!r}: use one of {', '.join(POINTS)}")
    text = os.environ.get(ENV)
    if not text:
        return None
    try:
        faults = [Fault(**entry) for entry in json.loads(text)]
    except (ValueError, TypeError) as err:
        raise RuntimeError(f"{ENV}={text!r}: {err}; arm faults with draftline.faults.armed") from None
    return next((fault for fault in faults if fault.point == point), None)


def encode(*faults: Fault) -> str:
    """The value of DRAFTLINE_TEST_FAULTS that arms `faults` (for a test's monkeypatch.setenv)."""
    return json.dumps([asdict(fault) for fault in faults])


@contextlib.contextmanager
def armed(*faults: Fault) -> Iterator[None]:
    """Arm `faults` for this process and the processes it starts, until the block ends."""
    before = os.environ.get(ENV)
    os.environ[ENV] = encode(*faults)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before


def hold_until_killed(marker: str | os.PathLike, what: str) -> None:
    """Append `what` and this worker's Ray node id to `marker` (one line), then wait to be killed."""
    with open(marker, "a") as handle:
        handle.write(f"{what} on node {ray.get_runtime_context().get_node_id()}\n")
    while True:
        time.sleep(3600)
